// The softmax of one row of a causal attention tile, forward and backward, fused into two passes
// over the row with a vectorised exponential (AVX-512 where the CPU has it, a portable loop
// otherwise), reading and writing the tile's dtype (float32, or bf16 as raw bits).
//
// Training's tiled attention (causal_attention.cpp) ran a dozen libtorch elementwise operations
// per tile (dtype conversions, scale, mask, max, exp, sum, divide, and as many backward), each a
// pass over the tile and a dispatch; these do the same arithmetic in the row while it is in L1.
#pragma once

#include <cstdint>

namespace kv {

/// probabilities[j] = exp(scale * scores[j] - lse) for j < visible and 0 for visible <= j <
/// width, where lse = log(sum_{j < visible} exp(scale * scores[j])), which is returned.
/// visible >= 1. probabilities may alias scores.
float softmax_row(const float* scores, float* probabilities, int64_t visible, int64_t width,
                  float scale);
float softmax_row(const uint16_t* scores, uint16_t* probabilities, int64_t visible, int64_t width,
                  float scale);

/// The backward of softmax_row given its lse: with p[j] = exp(scale * scores[j] - lse) and
/// d = sum_{j < visible} p[j] * d_probabilities[j], writes probabilities[j] = p[j] and
/// d_scores[j] = scale * p[j] * (d_probabilities[j] - d) (the gradient of the unscaled scores)
/// for j < visible, and zeros up to width. d_scores may alias d_probabilities.
void softmax_backward_row(const float* scores, const float* d_probabilities, float lse,
                          float* probabilities, float* d_scores, int64_t visible, int64_t width,
                          float scale);
void softmax_backward_row(const uint16_t* scores, const uint16_t* d_probabilities, float lse,
                          uint16_t* probabilities, uint16_t* d_scores, int64_t visible,
                          int64_t width, float scale);

/// The portable loops behind both, whatever the CPU: the tests hold the vectorised kernels to them.
float softmax_row_portable(const float* scores, float* probabilities, int64_t visible,
                           int64_t width, float scale);
void softmax_backward_row_portable(const float* scores, const float* d_probabilities, float lse,
                                   float* probabilities, float* d_scores, int64_t visible,
                                   int64_t width, float scale);

}  // namespace kv
