// The pieces of KV Packet's self-distillation that are numerics: the teacher's kept answer, the
// loss against it, and the optimizer step (tested against float64 references and libtorch's own
// AdamW in tests/unit/core/model/test_adapter.cpp).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace kv {

/// The frozen model's greedy answer from the whole context, with its `top_k` most likely next
/// tokens at every answer step (the first is the answer token itself).
struct TeacherAnswer {
    std::vector<int32_t> tokens;           // the answer, its stop token included
    int64_t top_k = 0;                     // entries kept per answer token
    std::vector<int32_t> candidates;       // [tokens, top_k] vocabulary ids
    std::vector<float> log_probabilities;  // [tokens, top_k]
};

/// KL(teacher || student) summed over the answer tokens; `student_logits` [tokens, vocab]. The
/// teacher's kept candidates count one by one and the rest of the vocabulary as one bucket, so
/// the loss is exact when the teacher kept every token and never negative.
torch::Tensor distillation_loss(const torch::Tensor& student_logits, const TeacherAnswer& teacher);

/// AdamW as torch.optim.AdamW computes it (betas 0.9 and 0.999, eps 1e-8, no weight decay),
/// written out so that its state can be stored in checkpoints and a resumed run continue
/// exactly.
struct AdamW {
    torch::Tensor moment, second_moment;
    /// One update of `parameter` (in place) by `gradient`; `step_number` counts from 1.
    void step(torch::Tensor& parameter, const torch::Tensor& gradient, int64_t step_number,
              double learning_rate);
};

}  // namespace kv
