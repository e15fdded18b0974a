#include "kv/model/attention_rows.hpp"

#include "isa.hpp"
#include "kernel_scratch.hpp"
#include "kv/avx512_lanes.hpp"
#include "kv/float_convert.hpp"

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which its own
// -Wmaybe-uninitialized then reports inside the header (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kv {
namespace {

inline float load_scalar(const float* p) {
    return *p;
}
inline float load_scalar(const uint16_t* p) {
    return bf16_to_float(*p);
}
inline void store_scalar(float* p, float value) {
    *p = value;
}
inline void store_scalar(uint16_t* p, float value) {
    *p = float_to_bf16(value);
}

// A row's working copy in float32.
struct RowCopy {};
float* scratch(int64_t count) {
    return kernel_scratch<RowCopy>(count);
}

template <typename T>
float softmax_row_loop(const T* scores, T* probabilities, int64_t visible, int64_t width,
                       float scale) {
    float* row = scratch(visible);
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < visible; ++j)
        best = std::max(best, row[j] = scale * load_scalar(scores + j));
    float total = 0;
    for (int64_t j = 0; j < visible; ++j)
        total += (row[j] = std::exp(row[j] - best));
    const float inverse = 1.0f / total;
    for (int64_t j = 0; j < visible; ++j)
        store_scalar(probabilities + j, row[j] * inverse);
    for (int64_t j = visible; j < width; ++j)
        store_scalar(probabilities + j, 0.0f);
    return best + std::log(total);
}

template <typename T>
void softmax_backward_row_loop(const T* scores, const T* d_probabilities, float lse,
                               T* probabilities, T* d_scores, int64_t visible, int64_t width,
                               float scale) {
    float* row = scratch(visible);
    float dot = 0;
    for (int64_t j = 0; j < visible; ++j) {
        row[j] = std::exp(scale * load_scalar(scores + j) - lse);
        dot += row[j] * load_scalar(d_probabilities + j);
    }
    for (int64_t j = 0; j < visible; ++j) {
        const float d = load_scalar(d_probabilities + j);
        store_scalar(probabilities + j, row[j]);
        store_scalar(d_scores + j, scale * row[j] * (d - dot));
    }
    for (int64_t j = visible; j < width; ++j) {
        store_scalar(probabilities + j, 0.0f);
        store_scalar(d_scores + j, 0.0f);
    }
}

// 16 lanes at a time, the last of a row masked.
using avx512::first_lanes;
using avx512::load16;
using avx512::store16;

// exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 (in two parts), exp(r) by Cephes'
// expf polynomial: within 2 ulp of expf over the range softmax uses (x <= 0 or a little above;
// below -87.3, where expf is subnormal, the result is clamped to exp(-87.3)).
KV_AVX512_BW inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

template <typename T>
KV_AVX512_BW float softmax_row_avx512(const T* scores, T* probabilities, int64_t visible,
                                      int64_t width, float scale) {
    float* row = scratch(visible + 16);
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512 best_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < visible; j += 16) {
        const __mmask16 lanes = first_lanes(visible - j);
        const __m512 x = _mm512_mul_ps(load16(scores + j, lanes), scale_v);
        _mm512_storeu_ps(row + j, x);
        best_v = _mm512_mask_max_ps(best_v, lanes, best_v, x);
    }
    const float best = _mm512_reduce_max_ps(best_v);
    const __m512 best_b = _mm512_set1_ps(best);
    __m512 total_v = _mm512_setzero_ps();
    for (int64_t j = 0; j < visible; j += 16) {
        const __mmask16 lanes = first_lanes(visible - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), best_b));
        _mm512_storeu_ps(row + j, e);
        total_v = _mm512_mask_add_ps(total_v, lanes, total_v, e);
    }
    const float total = _mm512_reduce_add_ps(total_v);
    const __m512 inverse = _mm512_set1_ps(1.0f / total);
    for (int64_t j = 0; j < visible; j += 16)
        store16(probabilities + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), inverse),
                first_lanes(visible - j));
    for (int64_t j = visible; j < width; j += 16)
        store16(probabilities + j, _mm512_setzero_ps(), first_lanes(width - j));
    return best + std::log(total);
}

template <typename T>
KV_AVX512_BW void softmax_backward_row_avx512(const T* scores, const T* d_probabilities, float lse,
                                              T* probabilities, T* d_scores, int64_t visible,
                                              int64_t width, float scale) {
    float* row = scratch(visible + 16);
    const __m512 scale_v = _mm512_set1_ps(scale), lse_v = _mm512_set1_ps(lse);
    __m512 dot_v = _mm512_setzero_ps();
    for (int64_t j = 0; j < visible; j += 16) {
        const __mmask16 lanes = first_lanes(visible - j);
        const __m512 p = exp16(_mm512_fmsub_ps(load16(scores + j, lanes), scale_v, lse_v));
        _mm512_storeu_ps(row + j, p);
        dot_v = _mm512_mask3_fmadd_ps(p, load16(d_probabilities + j, lanes), dot_v, lanes);
    }
    const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(dot_v));
    for (int64_t j = 0; j < visible; j += 16) {
        const __mmask16 lanes = first_lanes(visible - j);
        const __m512 p = _mm512_loadu_ps(row + j);
        const __m512 d = _mm512_sub_ps(load16(d_probabilities + j, lanes), dot);
        store16(probabilities + j, p, lanes);
        store16(d_scores + j, _mm512_mul_ps(_mm512_mul_ps(p, d), scale_v), lanes);
    }
    for (int64_t j = visible; j < width; j += 16) {
        const __mmask16 lanes = first_lanes(width - j);
        store16(probabilities + j, _mm512_setzero_ps(), lanes);
        store16(d_scores + j, _mm512_setzero_ps(), lanes);
    }
}

template <typename T>
float softmax_row_any(const T* scores, T* probabilities, int64_t visible, int64_t width,
                      float scale) {
    if (isa == Isa::avx512 || isa == Isa::avx512_bf16)
        return softmax_row_avx512(scores, probabilities, visible, width, scale);
    return softmax_row_loop(scores, probabilities, visible, width, scale);
}

template <typename T>
void softmax_backward_row_any(const T* scores, const T* d_probabilities, float lse,
                              T* probabilities, T* d_scores, int64_t visible, int64_t width,
                              float scale) {
    if (isa == Isa::avx512 || isa == Isa::avx512_bf16)
        return softmax_backward_row_avx512(scores, d_probabilities, lse, probabilities, d_scores,
                                           visible, width, scale);
    softmax_backward_row_loop(scores, d_probabilities, lse, probabilities, d_scores, visible, width,
                              scale);
}

}  // namespace

float softmax_row(const float* scores, float* probabilities, int64_t visible, int64_t width,
                  float scale) {
    return softmax_row_any(scores, probabilities, visible, width, scale);
}
float softmax_row(const uint16_t* scores, uint16_t* probabilities, int64_t visible, int64_t width,
                  float scale) {
    return softmax_row_any(scores, probabilities, visible, width, scale);
}
void softmax_backward_row(const float* scores, const float* d_probabilities, float lse,
                          float* probabilities, float* d_scores, int64_t visible, int64_t width,
                          float scale) {
    softmax_backward_row_any(scores, d_probabilities, lse, probabilities, d_scores, visible, width,
                             scale);
}
void softmax_backward_row(const uint16_t* scores, const uint16_t* d_probabilities, float lse,
                          uint16_t* probabilities, uint16_t* d_scores, int64_t visible,
                          int64_t width, float scale) {
    softmax_backward_row_any(scores, d_probabilities, lse, probabilities, d_scores, visible, width,
                             scale);
}

float softmax_row_portable(const float* scores, float* probabilities, int64_t visible,
                           int64_t width, float scale) {
    return softmax_row_loop(scores, probabilities, visible, width, scale);
}
void softmax_backward_row_portable(const float* scores, const float* d_probabilities, float lse,
                                   float* probabilities, float* d_scores, int64_t visible,
                                   int64_t width, float scale) {
    softmax_backward_row_loop(scores, d_probabilities, lse, probabilities, d_scores, visible, width,
                              scale);
}

}  // namespace kv
