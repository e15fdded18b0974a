// Eight float32 lanes to and from a row of float32 or bf16 values with AVX2: avx512_lanes.hpp's
// twin for CPUs without AVX-512 (no masks: callers finish a row's tail one value at a time).
// Narrowing rounds to nearest even and keeps NaNs quiet, as float_to_bf16 does, so that the
// vector and the scalar paths store the same bits. x86-64 only; callers check the CPU first
// (cpu_supported).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#define KV_AVX2 __attribute__((target("avx2,fma")))

namespace kv::avx2 {

/// Whether this CPU runs the AVX2 and FMA instructions of KV_AVX2 code (asked once).
inline bool cpu_supported() {
    static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return supported;
}

KV_AVX2 inline __m256 load8(const float* p) {
    return _mm256_loadu_ps(p);
}
KV_AVX2 inline __m256 load8(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

KV_AVX2 inline void store8(float* p, __m256 v) {
    _mm256_storeu_ps(p, v);
}
KV_AVX2 inline void store8(uint16_t* p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    // |v|'s bits above infinity's: a NaN (signed comparison is safe with the sign bit cleared).
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i narrowed = _mm256_blendv_epi8(rounded, quiet, nan);
    // Pack within each 128-bit half, then the two halves' low quadwords together.
    const __m256i packed = _mm256_packus_epi32(narrowed, narrowed);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

}  // namespace kv::avx2

#endif
