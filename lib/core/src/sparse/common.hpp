// What the sparse methods share beyond the engine: reading a kv head's keys a chunk at a time,
// ranking scores, running heads in parallel, and a chunked log-sum-exp.
#pragma once

#include "kv/model/kv_cache.hpp"

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace kv::sparse {

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Rows a step reads at a time when it scans a layer's keys (quest's page summaries, topk, h2o's
/// first step, the recall measurement): what it holds of them at once.
inline constexpr int64_t key_chunk_rows = 4096;

/// Calls visit(first, keys [count, D] float32) for rows [from, to) of one kv head in chunks of at
/// most `chunk` rows, in order, whichever tier holds them (KvCache::read_keys).
template <class Visit>
void scan_keys(const KvCache& cache, int64_t layer, int64_t head, int64_t from, int64_t to,
               int64_t chunk, Visit&& visit) {
    for (int64_t first = from; first < to; first += chunk) {
        const int64_t count = std::min(chunk, to - first);
        visit(first, cache.read_keys(layer, head, first, count));
    }
}

/// fn(head) for every kv head, the heads spread over the compute threads: a step's choices are
/// independent per head (each writes its own rows and plane state). Each thread takes the next
/// head when it is done with one: heads differ in cost (an IceCache head's walk by the points its
/// queries keep), and fixed shares of 4 heads each left one of 2 threads waiting for the other.
/// at::parallel_for rethrows the first failure (a read of an offloaded cache).
template <typename Fn>
void for_each_head(int64_t kv_heads, Fn&& fn) {
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(kv_heads, at::get_num_threads());
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
        for (int64_t head = next++; head < kv_heads; head = next++)
            fn(head);
    });
}

/// The best `count` of `scores` (indices), best first; ties to the lower index.
inline std::vector<int64_t> best_indices(const std::vector<float>& scores, int64_t count) {
    std::vector<int64_t> order(scores.size());
    std::iota(order.begin(), order.end(), 0);
    const auto keep =
        std::min<std::size_t>(order.size(), static_cast<std::size_t>(std::max<int64_t>(0, count)));
    std::partial_sort(
        order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
        [&](int64_t a, int64_t b) {
            return scores[static_cast<std::size_t>(a)] != scores[static_cast<std::size_t>(b)]
                       ? scores[static_cast<std::size_t>(a)] > scores[static_cast<std::size_t>(b)]
                       : a < b;
        });
    order.resize(keep);
    return order;
}

/// log(sum(exp(logits))) per query row, over logits [rows, n] added a chunk at a time (float64).
class LogSumExp {
  public:
    explicit LogSumExp(int64_t rows)
        : top_(torch::full({rows}, -std::numeric_limits<double>::infinity(), torch::kFloat64)),
          sum_(torch::zeros({rows}, torch::kFloat64)) {}

    void add(const torch::Tensor& logits) {
        const torch::Tensor wide = logits.to(torch::kFloat64);
        const torch::Tensor top = torch::maximum(top_, std::get<0>(wide.max(1)));
        sum_ = sum_ * torch::exp(top_ - top) + torch::exp(wide - top.unsqueeze(1)).sum(1);
        top_ = top;
    }
    /// [rows]: the log of each row's normaliser.
    torch::Tensor value() const { return top_ + torch::log(sum_); }

  private:
    torch::Tensor top_, sum_;
};

}  // namespace kv::sparse
