// Conversions between the cache dtypes' bytes and float, without libtorch (kvinspect and kvpack
// are torch-free). Narrowing rounds to nearest even, as libtorch does, so that a key rotated here
// rounds the same way as one rotated by the runtime.
#pragma once

#include "kv/cache_file.hpp"

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
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_float(uint16_t bits) {
    _Float16 half;
    std::memcpy(&half, &bits, 2);
    return static_cast<float>(half);
}

inline uint16_t float_to_f16(float value) {
    const _Float16 half = static_cast<_Float16>(value);
    uint16_t bits;
    std::memcpy(&bits, &half, 2);
    return bits;
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
