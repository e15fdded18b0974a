// The instruction set the hand-written kernels (gemv.cpp, attention_rows.cpp) dispatch on,
// detected once at start-up.
#pragma once

namespace kv {

enum class Isa { portable, avx2, avx512, avx512_bf16 };

inline Isa detect_isa() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        // The dot-product instruction halves the work per bf16 weight.
        if (__builtin_cpu_supports("avx512bf16")) return Isa::avx512_bf16;
        return Isa::avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
    return Isa::portable;
}

inline const Isa isa = detect_isa();

}  // namespace kv
