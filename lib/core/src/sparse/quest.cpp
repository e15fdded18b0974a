// Quest (Tang et al., 2024): the rows in token-order pages, each page summarised by the
// per-channel minimum and maximum of its keys; a query ranks pages by the upper bound
// sum_d max(q_d * min_d, q_d * max_d) of its scores there and retrieves the best pages.
#include "common.hpp"
#include "methods.hpp"

namespace kv::sparse {
namespace {

class Quest final : public SparsePolicy {
  public:
    explicit Quest(const PolicySetup& setup)
        : page_(setup.options.page_size),
          page_min_(static_cast<std::size_t>(setup.config.num_layers * setup.config.num_kv_heads)),
          page_max_(page_min_.size()) {}

    int64_t unit_rows() const override { return page_; }
    bool parallel_heads() const override { return true; }

    void rank(const SparseStep& step, int64_t head, std::vector<Ranking>& rankings) override {
        const int64_t dim = step.cache.head_dim(), kv_heads = step.cache.kv_heads();
        const int64_t window_start = step.resident.window_start;
        const auto plane = static_cast<std::size_t>(step.layer * kv_heads + head);
        std::vector<float>& mins = page_min_[plane];
        std::vector<float>& maxs = page_max_[plane];
        // Summaries of every page up to the window, recomputed for the page still filling.
        const int64_t pages = (window_start + page_ - 1) / page_;
        const int64_t complete = static_cast<int64_t>(mins.size()) / dim;
        const int64_t from = std::max<int64_t>(0, std::min(complete, pages) - 1);
        mins.resize(static_cast<std::size_t>(pages * dim));
        maxs.resize(static_cast<std::size_t>(pages * dim));
        // Chunks of whole pages, so that each page is summarised from one chunk.
        const int64_t chunk = std::max<int64_t>(1, key_chunk_rows / page_) * page_;
        scan_keys(step.cache, step.layer, head, from * page_, window_start, chunk,
                  [&](int64_t first, const torch::Tensor& rows_read) {
                      const int64_t last = first + rows_read.size(0);
                      const float* keys = rows_read.data_ptr<float>();
                      for (int64_t p = first / page_; p * page_ < last; ++p)
                          for (int64_t d = 0; d < dim; ++d) {
                              float low = std::numeric_limits<float>::infinity(), high = -low;
                              for (int64_t r = p * page_; r < std::min(last, (p + 1) * page_);
                                   ++r) {
                                  const float value = keys[(r - first) * dim + d];
                                  low = std::min(low, value);
                                  high = std::max(high, value);
                              }
                              mins[static_cast<std::size_t>(p * dim + d)] = low;
                              maxs[static_cast<std::size_t>(p * dim + d)] = high;
                          }
                  });
        const int64_t first_page = step.resident.sink / page_;  // pages before it lie in the sink
        for (int64_t member = 0; member < step.group; ++member) {
            const float* query =
                step.queries.data_ptr<float>() + (head * step.group + member) * dim;
            std::vector<float> bounds;
            for (int64_t p = first_page; p < pages; ++p) {
                float bound = 0;
                for (int64_t d = 0; d < dim; ++d)
                    bound += std::max(query[d] * mins[static_cast<std::size_t>(p * dim + d)],
                                      query[d] * maxs[static_cast<std::size_t>(p * dim + d)]);
                bounds.push_back(bound);
            }
            Ranking& ranking = rankings[static_cast<std::size_t>(member)];
            for (int64_t index : best_indices(bounds, step.retrievable)) {
                const int64_t p = first_page + index;
                RankedUnit unit{p, {}};
                for (int64_t r = p * page_; r < std::min(window_start, (p + 1) * page_); ++r)
                    unit.rows.push_back(r);
                ranking.push_back(std::move(unit));
            }
        }
    }

  private:
    int64_t page_;
    // Per plane, the per-channel minimum and maximum of each page, page after page.
    std::vector<std::vector<float>> page_min_, page_max_;
};

}  // namespace

std::unique_ptr<SparsePolicy> make_quest(const PolicySetup& setup) {
    return std::make_unique<Quest>(setup);
}

}  // namespace kv::sparse
