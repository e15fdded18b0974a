// Rotary position embedding arithmetic without libtorch: the inverse frequencies (with linear or
// llama3 scaling) and the rotation of stored keys by a position offset. The runtime's Rope
// (kv/model/ops.hpp) builds on the same frequencies; kvpack realigns packets with rotate_keys,
// reading the RoPE settings from the cache file instead of a model.
#pragma once

#include "kv/model/config.hpp"
#include "kv/packet.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kv {

/// head_dim/2 inverse frequencies theta^(-2i/head_dim), scaled; computed in float32 as llama2.c
/// and Hugging Face do, so that rotations agree with them bit for bit.
std::vector<float> rope_inverse_frequencies(int64_t head_dim, double theta,
                                            const RopeScaling& scaling);

/// The RoPE settings a cache file records (layout, theta, scaling JSON), ready to rotate with.
struct RopeSettings {
    RopeLayout layout = RopeLayout::half_split;
    int64_t head_dim = 0;
    std::vector<float> inverse_frequencies;
};

/// Reads them from a file's model description; throws FormatError on an unknown layout or
/// scaling.
RopeSettings rope_settings(const CacheModelInfo& model);

/// The scaling as cache files record it: compact JSON, "" when there is none.
std::string rope_scaling_to_json(const RopeScaling& scaling);
RopeScaling rope_scaling_from_json(const std::string& text);

/// Rotates `rows` rows of 2 * half values each (stored in `dtype`, `row_stride` bytes apart) in
/// place by the angles whose cosines and sines are given (half of each): x cos - y sin and
/// y cos + x sin, each product and difference rounded to float32, one rounding back to the dtype.
/// An angle of 0 is rotated too (-0 and infinities are not left as they were by it).
void rotate_rows(std::byte* keys, CacheDtype dtype, std::size_t rows, std::size_t row_stride,
                 RopeLayout layout, std::size_t half, const float* cosines, const float* sines);

/// Rotates `rows` keys of head_dim values each (stored in `dtype`) by `delta` positions in
/// place: R(p) k becomes R(p + delta) k. Angles and products in float32, one rounding back to
/// the dtype, as the runtime's Rope::shift does.
void rotate_keys(std::byte* keys, CacheDtype dtype, std::size_t rows, const RopeSettings& rope,
                 int64_t delta);

}  // namespace kv
