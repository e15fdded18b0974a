// The numerical pieces of the decoder, as free functions over libtorch tensors, so that each is
// tested on its own against a float64 reference (tests/unit/core/model/test_ops.cpp).
#pragma once

#include "kv/model/config.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#include <vector>

namespace kv {

/// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension; the statistics are computed in
/// float32 whatever x's dtype (as Hugging Face does), the result has x's dtype.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
/// Whether rms_norm computes host rows of `width` (f32 or bf16, no gradients) in one loop of its
/// own: where its sum of squares gives the bits of this libtorch's (checked once per width), and
/// the width is one libtorch sums with vectors on one thread (16 to 32,767); else through
/// libtorch's operations.
bool rms_norm_in_one_loop(int64_t width);

/// a b for matrices (mm) or batches of them (bmm), in the inputs' dtype: bf16 ones through
/// float32 on a CPU where libtorch has no bf16 kernel (widen_bf16_matmuls: without AVX-512 its
/// own bf16 gemm is slower than float32 by far and further from float64), rounded back to bf16
/// as oneDNN rounds its float32 sums.
torch::Tensor product_in_dtype(const torch::Tensor& a, const torch::Tensor& b);

/// x W^T (+ bias). One-row inputs on CPU (decoding) use kv's gemv kernels, which stream f32
/// weights faster than libtorch's `mv` and bf16 weights ~10x faster than libtorch's bf16 path.
/// With `after_context` (a question after a cached context), 2 to 64 rows through bf16 weights
/// on a CPU with AVX512-BF16 go through kv's few-token kernel (gemm_few_bf16): the weights read
/// once, each row with the bits one-token decoding gives it. Without, such rows take libtorch's
/// matmul, as every row of a longer input does, so that a document's keys and values have the
/// same bits whether it is baked alone or batched with others.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias = {}, bool after_context = false);

/// silu(gate) * up.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

/// Inverse frequencies of RoPE (head_dim/2 values) with the configured scaling applied; computed
/// in float32 as llama2.c and Hugging Face do, so that rotations agree with them bit for bit.
std::vector<float> rope_inverse_frequencies(const ModelConfig& config);

/// Rotary position embedding for one model. Rotations compose: rotating an already rotated key
/// at position p by delta gives the key at p + delta, which is how packed caches are realigned.
class Rope {
  public:
    explicit Rope(const ModelConfig& config);
    /// From settings a cache file records (no model needed).
    Rope(RopeLayout layout, std::vector<float> inverse_frequencies)
        : layout_(layout), inverse_frequencies_(std::move(inverse_frequencies)) {}

    /// Rotates x [..., T, head_dim] by positions [T] (int64, any device); returns x's dtype.
    /// Host f32/bf16/f16 tensors that need no gradient are rotated row by row (rotate_rows);
    /// others by libtorch operations, with the same float32 arithmetic and the same bits.
    torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& positions) const;

    /// Rotates every token of x [..., T, head_dim] by the same offset.
    torch::Tensor shift(const torch::Tensor& x, int64_t delta) const;
    /// shift() in place, where x is a host f32/bf16/f16 tensor [..., T, head_dim] whose rows
    /// are contiguous within each [T, head_dim] block (a slice of a KvCache's keys); the same
    /// bits as shift(). Returns false, touching nothing, where x is not such a tensor.
    bool shift_in_place(const torch::Tensor& x, int64_t delta) const;

    RopeLayout layout() const { return layout_; }
    const std::vector<float>& inverse_frequencies() const { return inverse_frequencies_; }

  private:
    torch::Tensor apply_with_tensors(const torch::Tensor& x, const torch::Tensor& positions) const;

    RopeLayout layout_;
    std::vector<float> inverse_frequencies_;
};

/// Which keys each query may see. By default causal by position (key position <= query position),
/// limited to the last `sliding_window` positions when that is positive; `allow` [T, S] (bool),
/// when defined, is AND-ed on top (e.g. block-diagonal masks for packets computed together).
struct AttentionMask {
    torch::Tensor query_positions;  ///< [T] int64
    torch::Tensor key_positions;    ///< [S] int64
    int64_t sliding_window = 0;
    torch::Tensor allow;  ///< optional [T, S] bool
    /// Optional [Hkv, S] bool: false for a kv head's padding slots (a cache whose heads keep
    /// different numbers of tokens, formats/kvcache.md 6.3), which no query of the head sees.
    torch::Tensor key_valid;
};

/// Exact softmax attention with grouped-query heads: q [Hq, T, D], k and v [Hkv, S, D] with Hq a
/// multiple of Hkv (query head h reads kv head h / (Hq/Hkv)). Scores and softmax in float32.
/// Returns [Hq, T, D] in q's dtype. A query that may see no key gets zeros.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionMask& mask, double scale);

/// Causal self-attention by index (query i sees keys 0..i) with gradients, for training: q [Hq,
/// T, D], k and v [Hkv, T, D]; products in q's dtype, softmax in float32, q's dtype out. Computed
/// by tiles that keep only the output and each row's log-sum-exp, backward recomputing the
/// probabilities, so that no [T, T] tensor is ever stored. attention() takes this path when
/// gradients are wanted and the mask is plain causality over increasing positions.
torch::Tensor causal_self_attention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, double scale);

/// The same tiles forward only, for prefills: q [Hq, T, D] the last T of S positions whose keys
/// and values k, v [Hkv, S, D] hold (S >= T; one dtype, float32 or bf16; each head's rows
/// contiguous, as cache views are): query t sees keys 0 .. S - T + t. attention() takes this
/// path without gradients when the mask is plain causality over increasing positions and the
/// queries are the last keys' positions.
torch::Tensor causal_attention_prefill(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, double scale);
/// Whether causal_attention_prefill takes these tensors (dtype, sizes and layout; it throws
/// std::invalid_argument otherwise).
bool causal_attention_prefill_takes(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v);
/// Whether the rows of each head of `rows` [H, S, D] are contiguous, as in a [H, capacity, D]
/// cache buffer viewed to S slots: what the tiled and the decoding kernels read.
bool head_rows_contiguous(const torch::Tensor& rows);
/// Whether the decoding kernels (the row kernels, attend_rows) read these queries, keys and
/// values as they are: host memory, keys and values float32 or bf16 of one dtype with their rows
/// contiguous per head, no gradients. (attention() takes them for one token when its mask is
/// also plain causality.)
bool decode_kernel_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

}  // namespace kv
