#include "kv/runtime.hpp"

#include "kv/error.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#include <malloc.h>

#include <thread>

namespace kv {

int set_compute_threads(int threads) {
    // Keep freed tensors in the heap for the next layer instead of unmapping them: attention
    // scores of a prefill chunk are megabytes, and fresh mappings fault on every first touch
    // (perf: page faults were half of a 1k-token prefill's time before this).
    static const bool tuned = [] {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
        return true;
    }();
    (void)tuned;
    if (threads < 0) throw UsageError("threads must be >= 0, got " + std::to_string(threads));
    if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    torch::set_num_threads(threads);
    return threads;
}

}  // namespace kv
