// Process-wide compute settings shared by every tool.
#pragma once

namespace kv {

/// Sets libtorch's intra-op thread count; 0 means one per core. Returns the count in effect.
int set_compute_threads(int threads);

}  // namespace kv
