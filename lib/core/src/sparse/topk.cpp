// The exact top-k oracle: every key between the sink and the window scored against each query
// head, the best rows retrieved. What the other methods approximate (and what they cost less
// than: it reads every key at every step).
#include "common.hpp"
#include "methods.hpp"

namespace kv::sparse {
namespace {

class TopK final : public SparsePolicy {
  public:
    int64_t unit_rows() const override { return 1; }

    void rank(const SparseStep& step, int64_t head, std::vector<Ranking>& rankings) override {
        // The best rows per query head, merged chunk by chunk: the global top-k, ties to the
        // earlier row, holding one chunk of scores at a time.
        struct Scored {
            float score;
            int64_t row;
        };
        const auto better = [](const Scored& a, const Scored& b) {
            return a.score != b.score ? a.score > b.score : a.row < b.row;
        };
        const auto keep = static_cast<std::size_t>(step.retrievable);
        const int64_t group = step.group;
        std::vector<std::vector<Scored>> best(static_cast<std::size_t>(group));
        scan_keys(step.cache, step.layer, head, step.resident.sink, step.resident.window_start,
                  key_chunk_rows, [&](int64_t first, const torch::Tensor& chunk) {
                      const torch::Tensor scores =
                          torch::matmul(step.queries.narrow(0, head * group, group), chunk.t())
                              .contiguous();
                      for (int64_t member = 0; member < group; ++member) {
                          auto& kept = best[static_cast<std::size_t>(member)];
                          const float* row = scores.data_ptr<float>() + member * chunk.size(0);
                          for (int64_t i = 0; i < chunk.size(0); ++i)
                              kept.push_back({row[i], first + i});
                          const std::size_t n = std::min(keep, kept.size());
                          std::partial_sort(kept.begin(),
                                            kept.begin() + static_cast<std::ptrdiff_t>(n),
                                            kept.end(), better);
                          kept.resize(n);
                      }
                  });
        for (int64_t member = 0; member < group; ++member)
            for (const Scored& found : best[static_cast<std::size_t>(member)])
                rankings[static_cast<std::size_t>(member)].push_back({found.row, {found.row}});
    }
};

}  // namespace

std::unique_ptr<SparsePolicy> make_topk(const PolicySetup&) {
    return std::make_unique<TopK>();
}

}  // namespace kv::sparse
