// Sixteen float32 lanes to and from a row of float32 or bf16 values with AVX-512, the first
// `lanes` of them (masked, so that a row's tail needs no scalar loop): what the kernels that read
// and write the cache's dtypes share (RoPE's rotation of stored keys, attention's softmax rows).
// Narrowing rounds to nearest even and keeps NaNs quiet, as float_to_bf16 does, so that the
// vector and the scalar paths store the same bits. x86-64 only; callers check the CPU first
// (cpu_supported).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which its own
// -Wmaybe-uninitialized then reports inside the header (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define KV_AVX512_BW __attribute__((target("avx512f,avx512bw")))

namespace kv::avx512 {

/// Whether this CPU runs the AVX512F and AVX512BW instructions of KV_AVX512_BW code (asked once).
inline bool cpu_supported() {
    static const bool supported =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return supported;
}

/// The first min(count, 16) lanes; none for count <= 0.
KV_AVX512_BW inline __mmask16 first_lanes(int64_t count) {
    if (count <= 0) return 0;
    return count >= 16 ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>((1u << static_cast<unsigned>(count)) - 1u);
}

KV_AVX512_BW inline __m512 load16(const float* p, __mmask16 lanes) {
    return _mm512_maskz_loadu_ps(lanes, p);
}
// 512-bit masked loads and stores of 16-bit values (AVX512BW), of which the low half is used:
// the 256-bit ones would need AVX512VL as well.
KV_AVX512_BW inline __m512 load16(const uint16_t* p, __mmask16 lanes) {
    const __m256i bits = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(lanes, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

KV_AVX512_BW inline void store16(float* p, __m512 v, __mmask16 lanes) {
    _mm512_mask_storeu_ps(p, lanes, v);
}
KV_AVX512_BW inline void store16(uint16_t* p, __m512 v, __mmask16 lanes) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    rounded =
        _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm512_mask_storeu_epi16(p, lanes, _mm512_castsi256_si512(_mm512_cvtepi32_epi16(rounded)));
}

}  // namespace kv::avx512

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
