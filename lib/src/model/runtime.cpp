#include "kv/runtime.hpp"

#include "kv/error.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#include <thread>

namespace kv {

int set_compute_threads(int threads) {
    if (threads < 0) throw UsageError("threads must be >= 0, got " + std::to_string(threads));
    if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    torch::set_num_threads(threads);
    return threads;
}

}  // namespace kv
