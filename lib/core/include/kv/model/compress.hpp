// The scoring rules of kv/compress.hpp over libtorch tensors, and the pruning they drive. Each
// rule is a function of one layer's evidence returning a score per (kv-head, token), higher kept,
// so that each is tested on its own against a float64 reference (tests/unit/core/model/
// test_compress.cpp).
#pragma once

#include "kv/compress.hpp"
#include "kv/model/model.hpp"
#include "kv/model/ops.hpp"
#include "kv/packet.hpp"

#include <torch/types.h>

#include <vector>

namespace kv {

/// What one layer's prefill tells a scoring rule about its tokens.
struct LayerEvidence {
    torch::Tensor keys;       ///< [Hkv, T, D] after RoPE, as stored
    torch::Tensor values;     ///< [Hkv, T, D]
    torch::Tensor positions;  ///< [T] int64
    // From the prefill's queries (QueryRecorder); undefined for rules that need none.
    torch::Tensor last_queries;      ///< [Hq, W, D] after RoPE: the last W queries (snapkv, tova)
    torch::Tensor last_positions;    ///< [W] int64
    torch::Tensor attention_sums;    ///< [Hq, T]: attention each key received from every query
    torch::Tensor query_mean;        ///< [Hq, D] before RoPE, over queries past the sinks
    torch::Tensor query_covariance;  ///< [Hq, D, D] likewise (divided by the count)
};

/// Scores [Hkv, T] (float64) of one layer; `layer` varies random's stream.
torch::Tensor score_tokens(const CompressionSettings& settings, const Rope& rope,
                           const LayerEvidence& evidence, int64_t layer);

/// Records, layer by layer during a prefill from position 0, what the query-aware rules need
/// (and nothing else: the last queries, running attention sums, running query moments).
class QueryRecorder : public QueryObserver {
  public:
    QueryRecorder(const CompressionSettings& settings, const Rope& rope, int64_t num_layers);
    void observe(int64_t layer, const torch::Tensor& queries, const torch::Tensor& positions,
                 const torch::Tensor& keys, const torch::Tensor& key_positions) override;
    /// Adds the recorded statistics of `layer` to `evidence` (tokens = the stored length).
    void fill(int64_t layer, LayerEvidence& evidence) const;

  private:
    struct Layer {
        torch::Tensor last_queries, last_positions, attention_sums, query_sum, query_products;
        int64_t query_count = 0;
    };
    CompressionSettings settings_;
    const Rope& rope_;
    std::vector<Layer> layers_;
};

/// The packet with each (layer, kv-head) keeping its best-scored tokens (ties to the earlier
/// token), in position order; per-head storage only when the heads' choices differ. `recorder`
/// must be given for rules that need queries (and have recorded this packet's prefill). The
/// packet's IceCache index is dropped (its tokens changed). Throws FormatError for a packet
/// already compressed per head.
Packet compress_packet(const Packet& packet, const CacheModelInfo& model, const Rope& rope,
                       const CompressionSettings& settings, const QueryRecorder* recorder);

}  // namespace kv
