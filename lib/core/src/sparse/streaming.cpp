// StreamingLLM (Xiao et al., 2023): the attention sink and the most recent rows, the rest of the
// budget given to the window; nothing retrieved.
#include "methods.hpp"

namespace kv::sparse {
namespace {

class Streaming final : public SparsePolicy {
  public:
    Residency residency(const BudgetSplit& split, int64_t budget, int64_t rows) const override {
        return {split.sink, rows - (budget - split.sink)};
    }
    int64_t unit_rows() const override { return 1; }
    void rank(const SparseStep&, int64_t, std::vector<Ranking>&) override {}
    bool reusable() const override { return false; }
};

}  // namespace

std::unique_ptr<SparsePolicy> make_streaming(const PolicySetup&) {
    return std::make_unique<Streaming>();
}

}  // namespace kv::sparse
