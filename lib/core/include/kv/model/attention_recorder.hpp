// The attention a prompt gives every key it may see, recorded layer by layer during a forward
// pass (kvinspect plot attention): exact softmax in float32 with the model's causal rule by
// position, averaged over the query heads and the prompt's tokens.
#pragma once

#include "kv/model/model.hpp"

#include <vector>

namespace kv {

class AttentionRecorder : public QueryObserver {
  public:
    explicit AttentionRecorder(int64_t layers) : weights_(static_cast<std::size_t>(layers)) {}
    void observe(int64_t layer, const torch::Tensor& queries, const torch::Tensor& positions,
                 const torch::Tensor& keys, const torch::Tensor& key_positions) override;
    /// Per layer, one weight per key seen (they sum to 1); empty for a layer never observed.
    const std::vector<std::vector<double>>& weights() const { return weights_; }

  private:
    std::vector<std::vector<double>> weights_;
};

}  // namespace kv
