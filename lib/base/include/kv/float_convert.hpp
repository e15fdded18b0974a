// Conversions between the cache dtypes' bytes and float, without libtorch (kvinspect and kvpack
// are torch-free). Narrowing rounds to nearest even, as libtorch does, so that a key rotated here
// rounds the same way as one rotated by the runtime.
#pragma once

#include "kv/packet.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kv {

inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &wide, 4);
    return value;
}

inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// IEEE half precision by bit manipulation rather than _Float16, which not every compiler has on
// x86 (clang 14 lacks it; the fuzz build uses clang).
inline float f16_to_float(uint16_t bits) {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exponent = (bits >> 10) & 0x1fu;
    uint32_t mantissa = bits & 0x3ffu;
    uint32_t wide;
    if (exponent == 0x1f) {
        wide = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        wide = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        wide = sign;
    } else {  // subnormal: normalise
        uint32_t shift = 0;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            ++shift;
        }
        wide = sign | ((113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float value;
    std::memcpy(&value, &wide, 4);
    return value;
}

/// Rounds to nearest even; overflow gives infinity, NaN stays NaN (quiet).
inline uint16_t float_to_f16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u)
        return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520
    if (magnitude < 0x38800000u) {                  // below 2^-14: a subnormal half, or zero
        if (magnitude <= 0x33000000u) return sign;  // <= 2^-25 rounds to zero (a tie goes to even)
        const uint32_t exponent = magnitude >> 23;
        const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - exponent;  // value * 2^24 = mantissa >> shift
        uint32_t result = mantissa >> shift;
        const uint32_t remainder = mantissa & ((1u << shift) - 1);
        const uint32_t halfway = 1u << (shift - 1);
        if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
        return static_cast<uint16_t>(sign | result);
    }
    uint32_t rebased = magnitude - 0x38000000u;  // exponent bias 127 -> 15
    rebased += 0xfffu + ((rebased >> 13) & 1u);
    return static_cast<uint16_t>(sign | (rebased >> 13));
}

/// Element i of a buffer of `dtype` values, as float.
inline float load_float(const std::byte* data, CacheDtype dtype, std::size_t i) {
    if (dtype == CacheDtype::f32) {
        float value;
        std::memcpy(&value, data + 4 * i, 4);
        return value;
    }
    uint16_t bits;
    std::memcpy(&bits, data + 2 * i, 2);
    return dtype == CacheDtype::bf16 ? bf16_to_float(bits) : f16_to_float(bits);
}

inline void store_float(std::byte* data, CacheDtype dtype, std::size_t i, float value) {
    if (dtype == CacheDtype::f32) {
        std::memcpy(data + 4 * i, &value, 4);
        return;
    }
    const uint16_t bits = dtype == CacheDtype::bf16 ? float_to_bf16(value) : float_to_f16(value);
    std::memcpy(data + 2 * i, &bits, 2);
}

inline std::vector<float> to_float(const std::vector<std::byte>& bytes, CacheDtype dtype) {
    const std::size_t count = bytes.size() / cache_dtype_size(dtype);
    std::vector<float> values(count);
    for (std::size_t i = 0; i < count; ++i)
        values[i] = load_float(bytes.data(), dtype, i);
    return values;
}

}  // namespace kv
