// The instruction set kvtools' hand-written kernels choose on this CPU, detected once: what the
// kernels dispatch on, what every tool's --version names on its "kernels:" line, and what the CLI
// tests' per-CPU expectations (<case>.<stream>.exact.<name>) are named by.
#pragma once

namespace kv {

enum class Isa { portable, avx2, avx512, avx512_bf16 };

inline Isa detect_isa() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        // The dot-product instruction halves the work per bf16 weight.
        if (__builtin_cpu_supports("avx512bf16")) return Isa::avx512_bf16;
        return Isa::avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
    return Isa::portable;
}

/// "avx512-bf16", "avx512", "avx2" or "portable".
inline const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::avx512_bf16:
            return "avx512-bf16";
        case Isa::avx512:
            return "avx512";
        case Isa::avx2:
            return "avx2";
        case Isa::portable:
            break;
    }
    return "portable";
}

}  // namespace kv
