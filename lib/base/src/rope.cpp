#include "kv/rope.hpp"

#include "kv/avx2_lanes.hpp"
#include "kv/avx512_lanes.hpp"
#include "kv/error.hpp"
#include "kv/float_convert.hpp"
#include "kv/json.hpp"

#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <numbers>

namespace kv {

std::vector<float> rope_inverse_frequencies(int64_t head_dim, double theta_value,
                                            const RopeScaling& scaling) {
    const int64_t half = head_dim / 2;
    std::vector<float> frequencies(static_cast<std::size_t>(half));
    const float theta = static_cast<float>(theta_value);
    for (int64_t i = 0; i < half; ++i)
        frequencies[i] =
            1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));

    if (scaling.type == RopeScalingType::linear) {
        for (float& f : frequencies)
            f = static_cast<float>(f / scaling.factor);
    } else if (scaling.type == RopeScalingType::llama3) {
        // Long wavelengths are slowed down by `factor`, short ones kept, the band between
        // interpolated smoothly (Meta's Llama 3.1 reference and transformers agree on this).
        const double old_context = static_cast<double>(scaling.original_max_position_embeddings);
        const double low_freq_wavelength = old_context / scaling.low_freq_factor;
        const double high_freq_wavelength = old_context / scaling.high_freq_factor;
        for (float& f : frequencies) {
            const double wavelength = 2.0 * std::numbers::pi / f;
            double scaled = f;
            if (wavelength > low_freq_wavelength) {
                scaled = f / scaling.factor;
            } else if (wavelength >= high_freq_wavelength) {
                const double smooth = (old_context / wavelength - scaling.low_freq_factor) /
                                      (scaling.high_freq_factor - scaling.low_freq_factor);
                scaled = (1.0 - smooth) * f / scaling.factor + smooth * f;
            }
            f = static_cast<float>(scaled);
        }
    }
    return frequencies;
}

std::string rope_scaling_to_json(const RopeScaling& scaling) {
    if (scaling.type == RopeScalingType::none) return "";
    json::Value value = json::Value::object();
    value.set("type", scaling.type == RopeScalingType::llama3 ? "llama3" : "linear");
    value.set("factor", scaling.factor);
    if (scaling.type == RopeScalingType::llama3) {
        value.set("low_freq_factor", scaling.low_freq_factor);
        value.set("high_freq_factor", scaling.high_freq_factor);
        value.set("original_max_position_embeddings", scaling.original_max_position_embeddings);
    }
    return json::dump(value);
}

RopeScaling rope_scaling_from_json(const std::string& text) {
    RopeScaling scaling;
    if (text.empty()) return scaling;
    const json::Value value = json::parse(text);
    const std::string& type = value.at("type").as_string();
    scaling.factor = value.at("factor").as_double();
    if (type == "linear") {
        scaling.type = RopeScalingType::linear;
    } else if (type == "llama3") {
        scaling.type = RopeScalingType::llama3;
        scaling.low_freq_factor = value.at("low_freq_factor").as_double();
        scaling.high_freq_factor = value.at("high_freq_factor").as_double();
        scaling.original_max_position_embeddings =
            value.at("original_max_position_embeddings").as_int();
    } else {
        throw FormatError("unknown RoPE scaling type " + kv::quoted(type));
    }
    if (!(scaling.factor > 0)) throw FormatError("RoPE scaling factor must be positive");
    return scaling;
}

RopeSettings rope_settings(const CacheModelInfo& model) {
    RopeSettings settings;
    if (model.rope_layout == "half_split")
        settings.layout = RopeLayout::half_split;
    else if (model.rope_layout == "interleaved")
        settings.layout = RopeLayout::interleaved;
    else
        throw FormatError("unknown RoPE layout " + kv::quoted(model.rope_layout));
    if (model.head_dim <= 0 || model.head_dim % 2 != 0)
        throw FormatError("head_dim must be even and positive, got " +
                          std::to_string(model.head_dim));
    if (!(model.rope_theta > 0)) throw FormatError("rope_theta must be positive");
    RopeScaling scaling;
    try {
        scaling = rope_scaling_from_json(model.rope_scaling);
    } catch (const Error& error) {
        throw FormatError("invalid rope_scaling " + kv::quoted(model.rope_scaling) + ": " +
                          error.what());
    }
    settings.head_dim = model.head_dim;
    settings.inverse_frequencies =
        rope_inverse_frequencies(model.head_dim, model.rope_theta, scaling);
    return settings;
}

namespace {

// Pairs [first, half) of a row turned one at a time, in float32 (separate multiplies and adds):
// the whole rotation where no vector kernel serves, a row's last pairs where one does. Value i
// pairs with i + half in half-split rows, 2i with 2i + 1 in interleaved ones.
void turn_pairs(std::byte* row, CacheDtype dtype, std::size_t first, std::size_t half,
                bool interleaved, const float* cosines, const float* sines) {
    for (std::size_t i = first; i < half; ++i) {
        const std::size_t a = interleaved ? 2 * i : i;
        const std::size_t b = interleaved ? 2 * i + 1 : i + half;
        const float x = load_float(row, dtype, a), y = load_float(row, dtype, b);
        store_float(row, dtype, a, x * cosines[i] - y * sines[i]);
        store_float(row, dtype, b, y * cosines[i] + x * sines[i]);
    }
}

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which its own
// -Wmaybe-uninitialized then reports inside the header (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
using avx512::first_lanes;

// A row of float32 or bf16 (raw bytes, as rotate_keys takes them).
KV_AVX512_BW inline __m512 load16(const std::byte* p, bool bf16, __mmask16 lanes) {
    return bf16 ? avx512::load16(reinterpret_cast<const uint16_t*>(p), lanes)
                : avx512::load16(reinterpret_cast<const float*>(p), lanes);
}
KV_AVX512_BW inline void store16(std::byte* p, bool bf16, __m512 v, __mmask16 lanes) {
    if (bf16)
        avx512::store16(reinterpret_cast<uint16_t*>(p), v, lanes);
    else
        avx512::store16(reinterpret_cast<float*>(p), v, lanes);
}

// rotate_keys' arithmetic on 16 values at a time: each product and difference rounded to float32
// as the scalar loop rounds it (separate multiplies and adds, no fused multiply-add), so the bits
// are the same. Half-split rows pair value i with i + half; interleaved rows pair 2i with 2i + 1,
// done as row * [c, c] + swapped * [-s, s] (x c + (-(y s)) is x c - y s exactly), the 8 angles'
// cosines and sines of 16 values duplicated in registers (a decoding step rotates one token).
KV_AVX512_BW void rotate_rows_avx512(std::byte* keys, bool bf16, std::size_t rows,
                                     std::size_t row_stride, std::size_t half, bool interleaved,
                                     const float* cosines, const float* sines) {
    const std::size_t element = bf16 ? 2 : 4, dim = 2 * half;
    if (interleaved) {
        const __m512i duplicate = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i negate_even =
            _mm512_set_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN,
                             0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN);
        for (std::size_t r = 0; r < rows; ++r) {
            std::byte* row = keys + r * row_stride;
            for (std::size_t d = 0; d < dim; d += 16) {
                const __mmask16 lanes = first_lanes(static_cast<int64_t>(dim - d));
                const __mmask16 angles = first_lanes(static_cast<int64_t>((dim - d) / 2));
                const __m512 v = load16(row + d * element, bf16, lanes);
                const __m512 swapped = _mm512_permute_ps(v, 0xB1);  // (x, y) -> (y, x)
                const __m512 c = _mm512_permutexvar_ps(
                    duplicate, _mm512_maskz_loadu_ps(angles & 0xFF, cosines + d / 2));
                const __m512 s = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(_mm512_permutexvar_ps(
                        duplicate, _mm512_maskz_loadu_ps(angles & 0xFF, sines + d / 2))),
                    negate_even));
                store16(row + d * element, bf16,
                        _mm512_add_ps(_mm512_mul_ps(v, c), _mm512_mul_ps(swapped, s)), lanes);
            }
        }
        return;
    }
    for (std::size_t r = 0; r < rows; ++r) {
        std::byte* row = keys + r * row_stride;
        for (std::size_t i = 0; i < half; i += 16) {
            const __mmask16 lanes = first_lanes(half - i);
            const __m512 x = load16(row + i * element, bf16, lanes);
            const __m512 y = load16(row + (i + half) * element, bf16, lanes);
            const __m512 c = _mm512_maskz_loadu_ps(lanes, cosines + i);
            const __m512 s = _mm512_maskz_loadu_ps(lanes, sines + i);
            store16(row + i * element, bf16,
                    _mm512_sub_ps(_mm512_mul_ps(x, c), _mm512_mul_ps(y, s)), lanes);
            store16(row + (i + half) * element, bf16,
                    _mm512_add_ps(_mm512_mul_ps(y, c), _mm512_mul_ps(x, s)), lanes);
        }
    }
}

// rotate_rows_avx512 on 8 values at a time with AVX2, the same separate multiplies and adds (the
// same bits); a row's last values, fewer than a vector, one pair at a time as the scalar loop
// turns them.
template <typename Value>
KV_AVX2 void rotate_rows_avx2(std::byte* keys, std::size_t rows, std::size_t row_stride,
                              std::size_t half, bool interleaved, const float* cosines,
                              const float* sines) {
    constexpr CacheDtype dtype = sizeof(Value) == 4 ? CacheDtype::f32 : CacheDtype::bf16;
    const std::size_t dim = 2 * half;
    if (interleaved) {
        const __m256i duplicate = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        const __m256 negate_even = _mm256_castsi256_ps(
            _mm256_setr_epi32(INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0));
        const std::size_t vector_dim = dim & ~std::size_t{7};
        for (std::size_t r = 0; r < rows; ++r) {
            auto* row = reinterpret_cast<Value*>(keys + r * row_stride);
            for (std::size_t d = 0; d < vector_dim; d += 8) {
                const __m256 v = avx2::load8(row + d);
                const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // (x, y) -> (y, x)
                const __m256 c = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_loadu_ps(cosines + d / 2)), duplicate);
                const __m256 s = _mm256_xor_ps(
                    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(sines + d / 2)),
                                             duplicate),
                    negate_even);
                avx2::store8(row + d,
                             _mm256_add_ps(_mm256_mul_ps(v, c), _mm256_mul_ps(swapped, s)));
            }
            turn_pairs(keys + r * row_stride, dtype, vector_dim / 2, half, true, cosines, sines);
        }
        return;
    }
    const std::size_t vector_half = half & ~std::size_t{7};
    for (std::size_t r = 0; r < rows; ++r) {
        auto* row = reinterpret_cast<Value*>(keys + r * row_stride);
        for (std::size_t i = 0; i < vector_half; i += 8) {
            const __m256 x = avx2::load8(row + i);
            const __m256 y = avx2::load8(row + i + half);
            const __m256 c = _mm256_loadu_ps(cosines + i);
            const __m256 s = _mm256_loadu_ps(sines + i);
            avx2::store8(row + i, _mm256_sub_ps(_mm256_mul_ps(x, c), _mm256_mul_ps(y, s)));
            avx2::store8(row + i + half, _mm256_add_ps(_mm256_mul_ps(y, c), _mm256_mul_ps(x, s)));
        }
        turn_pairs(keys + r * row_stride, dtype, vector_half, half, false, cosines, sines);
    }
}
#endif

}  // namespace

void rotate_rows(std::byte* keys, CacheDtype dtype, std::size_t rows, std::size_t row_stride,
                 RopeLayout layout, std::size_t half, const float* cosines, const float* sines) {
    const bool interleaved = layout == RopeLayout::interleaved;
#if defined(__x86_64__)
    // A packet's keys go through here at every realignment (1 GiB for 32k tokens of a 1B model):
    // scalar, with a dtype switch per value, that was ~2 s.
    if (dtype != CacheDtype::f16 && avx512::cpu_supported())
        return rotate_rows_avx512(keys, dtype == CacheDtype::bf16, rows, row_stride, half,
                                  interleaved, cosines, sines);
    // Without AVX-512 (most desktop CPUs), the same on AVX2: one pair at a time, the
    // realignment was most of a 32k packet's read (0.76 s of it, 0.28 s since).
    if (dtype == CacheDtype::f32 && avx2::cpu_supported())
        return rotate_rows_avx2<float>(keys, rows, row_stride, half, interleaved, cosines, sines);
    if (dtype == CacheDtype::bf16 && avx2::cpu_supported())
        return rotate_rows_avx2<uint16_t>(keys, rows, row_stride, half, interleaved, cosines,
                                          sines);
#endif
    for (std::size_t r = 0; r < rows; ++r)
        turn_pairs(keys + r * row_stride, dtype, 0, half, interleaved, cosines, sines);
}

void rotate_keys(std::byte* keys, CacheDtype dtype, std::size_t rows, const RopeSettings& rope,
                 int64_t delta) {
    if (delta == 0) return;
    const std::size_t half = rope.inverse_frequencies.size();
    std::vector<float> cosines(half), sines(half);
    for (std::size_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(delta) * rope.inverse_frequencies[i];
        cosines[i] = cosf(angle);
        sines[i] = sinf(angle);
    }
    rotate_rows(keys, dtype, rows, 2 * half * cache_dtype_size(dtype), rope.layout, half,
                cosines.data(), sines.data());
}

}  // namespace kv
