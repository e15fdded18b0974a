// H2O (Zhang et al., 2023): each kv head keeps the recent half of its budget and, of the older
// rows, the heavy hitters: those that have gathered the most attention (summed over its query
// heads and the steps since they arrived). Evicted rows never return, so their score is
// forgotten.
#include "common.hpp"
#include "methods.hpp"

#include <cmath>

namespace kv::sparse {
namespace {

class H2O final : public SparsePolicy {
  public:
    explicit H2O(const PolicySetup& setup)
        : budget_(setup.options.budget),
          kept_(static_cast<std::size_t>(setup.config.num_layers * setup.config.num_kv_heads)),
          accumulated_(kept_.size()),
          seen_(kept_.size(), 0) {}

    // No sink of its own: the recent half is the window, the heavy hitters the retrieved rows.
    Residency residency(const BudgetSplit&, int64_t budget, int64_t rows) const override {
        return {0, rows - budget / 2};
    }
    int64_t unit_rows() const override { return 1; }
    bool reusable() const override { return false; }

    void rank(const SparseStep& step, int64_t head, std::vector<Ranking>& rankings) override {
        const int64_t total = step.rows, group = step.group;
        const int64_t recent = budget_ / 2;
        const double scale = 1.0 / std::sqrt(static_cast<double>(step.cache.head_dim()));
        const auto plane = static_cast<std::size_t>(step.layer * step.cache.kv_heads() + head);
        // The kept rows, ascending, and the attention each has accumulated.
        std::vector<int64_t>& kept = kept_[plane];
        std::vector<double>& score = accumulated_[plane];
        for (int64_t r = seen_[plane]; r < total; ++r) {
            kept.push_back(r);
            score.push_back(0.0);
        }
        seen_[plane] = total;
        const torch::Tensor group_queries = step.queries.narrow(0, head * group, group);
        auto logits_of = [&](std::size_t from) {
            const std::size_t count =
                std::min(kept.size() - from, static_cast<std::size_t>(key_chunk_rows));
            return torch::matmul(
                       group_queries,
                       step.cache.gather_keys(step.layer, head, {kept.data() + from, count}).t()) *
                   scale;
        };
        // This step's attention over the kept rows, summed over the group's query heads: the
        // normaliser first, then the probabilities, a chunk at a time (one chunk, read once,
        // after the first step: the kept rows are the budget).
        LogSumExp normaliser(group);
        torch::Tensor only_chunk;
        for (std::size_t from = 0; from < kept.size();
             from += static_cast<std::size_t>(key_chunk_rows)) {
            const torch::Tensor logits = logits_of(from);
            normaliser.add(logits);
            if (from == 0 && kept.size() <= static_cast<std::size_t>(key_chunk_rows))
                only_chunk = logits;
        }
        const torch::Tensor log_total = normaliser.value().unsqueeze(1);
        for (std::size_t from = 0; from < kept.size();
             from += static_cast<std::size_t>(key_chunk_rows)) {
            const torch::Tensor logits = only_chunk.defined() ? only_chunk : logits_of(from);
            const torch::Tensor summed =
                torch::exp(logits.to(torch::kFloat64) - log_total).sum(0).contiguous();
            for (int64_t i = 0; i < summed.size(0); ++i)
                score[from + static_cast<std::size_t>(i)] += summed.data_ptr<double>()[i];
        }
        // Every recent row stays; of the older ones, those with the most attention.
        std::vector<std::size_t> old, next;
        for (std::size_t i = 0; i < kept.size(); ++i)
            (kept[i] >= total - recent ? next : old).push_back(i);
        std::sort(old.begin(), old.end(), [&](std::size_t a, std::size_t b) {
            return score[a] != score[b] ? score[a] > score[b] : a < b;
        });
        if (static_cast<int64_t>(kept.size()) > budget_) {
            old.resize(std::min(old.size(), static_cast<std::size_t>(std::max<int64_t>(
                                                0, budget_ - static_cast<int64_t>(next.size())))));
            next.insert(next.end(), old.begin(), old.end());
            std::sort(next.begin(), next.end());
            std::vector<int64_t> kept_rows;
            std::vector<double> kept_scores;
            for (std::size_t i : next) {
                kept_rows.push_back(kept[i]);
                kept_scores.push_back(score[i]);
            }
            // The ranking below refers to the rows by their old places.
            Ranking& ranking = rankings.front();
            for (std::size_t i : old)
                ranking.push_back({kept[i], {kept[i]}});
            kept = std::move(kept_rows);
            score = std::move(kept_scores);
            return;
        }
        // The heavy hitters, most attention first; the recent rows are the window.
        for (std::size_t i : old)
            rankings.front().push_back({kept[i], {kept[i]}});
    }

  private:
    int64_t budget_;
    // Per plane: the kept rows, every row's accumulated attention, and rows seen so far.
    std::vector<std::vector<int64_t>> kept_;
    std::vector<std::vector<double>> accumulated_;
    std::vector<int64_t> seen_;
};

}  // namespace

std::unique_ptr<SparsePolicy> make_h2o(const PolicySetup& setup) {
    return std::make_unique<H2O>(setup);
}

}  // namespace kv::sparse
