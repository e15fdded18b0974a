// The instruction set the hand-written kernels (gemv.cpp, attention_rows.cpp) dispatch on,
// detected once at start-up (kv/cpu_kernels.hpp).
#pragma once

#include "kv/cpu_kernels.hpp"

namespace kv {

inline const Isa isa = detect_isa();

}  // namespace kv
