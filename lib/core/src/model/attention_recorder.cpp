#include "kv/model/attention_recorder.hpp"

#include <cmath>
#include <limits>

namespace kv {

void AttentionRecorder::observe(int64_t layer, const torch::Tensor& queries,
                                const torch::Tensor& positions, const torch::Tensor& keys,
                                const torch::Tensor& key_positions) {
    const int64_t query_heads = queries.size(0), kv_heads = keys.size(0);
    const int64_t group = query_heads / kv_heads, head_dim = queries.size(2);
    const torch::Tensor q = queries.to(torch::kFloat32);
    // Query head h reads kv head h / group.
    const torch::Tensor k = keys.to(torch::kFloat32).repeat_interleave(group, 0);  // [Hq, S, D]
    torch::Tensor scores =
        torch::matmul(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(head_dim));
    const torch::Tensor hidden =
        key_positions.to(q.device()).unsqueeze(0).gt(positions.to(q.device()).unsqueeze(1));
    scores = scores.masked_fill(hidden.unsqueeze(0), -std::numeric_limits<float>::infinity());
    const torch::Tensor mean =
        torch::softmax(scores, -1).mean(std::vector<int64_t>{0, 1}).to(torch::kCPU);
    weights_[static_cast<std::size_t>(layer)] =
        std::vector<double>(mean.data_ptr<float>(), mean.data_ptr<float>() + mean.numel());
}

}  // namespace kv
