// Moving baked caches between files and the model: slicing a KvCache into a Packet's tensors,
// and appending a Packet to a KvCache with its keys realigned to their place in the context.
//
// Realignment is a rotation: keys are stored after RoPE at the packet's own positions (from 0),
// and R(p + delta) = R(delta) R(p), so rotating every key by delta places the packet at offset
// delta without recomputing anything. Values carry no position and are copied as they are.
#pragma once

#include "kv/format/cache_reader.hpp"
#include "kv/model/kv_cache.hpp"
#include "kv/model/ops.hpp"

#include <torch/types.h>

namespace kv {

class Model;

torch::ScalarType torch_dtype(CacheDtype dtype);
CacheDtype cache_dtype(torch::ScalarType dtype);

/// Copies tokens [begin, begin + count) of every layer into packet.keys/values, laid out
/// [layers, kv_heads, count, head_dim] in `dtype`.
void copy_cache_to_packet(const KvCache& cache, int64_t begin, int64_t count, CacheDtype dtype,
                          Packet& packet);

/// The packet's keys or values as a tensor [layers, kv_heads, stored_length, head_dim] viewing
/// its bytes (no copy; valid while the packet lives).
torch::Tensor packet_tensor(const Packet& packet, bool keys, int64_t num_layers, int64_t kv_heads,
                            int64_t head_dim, CacheDtype dtype);

/// Appends the packet after what `cache` holds: its positions shifted by cache.next_position(),
/// keys rotated by the same offset, and the cache's logical length advanced by the packet's
/// logical length (compressed packets keep their gaps).
void append_packet(const Rope& rope, KvCache& cache, const Packet& packet, CacheDtype dtype);

/// Reads packet `id` of `reader` with its keys and values straight into the rows after the end
/// of `cache` (KvCache::rows_after_end; room for them reserved), which stay outside it until
/// append_packet_in_place; the keys are turned by cache.next_position() as they land. The
/// index's per-token layouts stay in the file (CacheReader::read_index_layout reads them when
/// the index is restored). For a host cache in memory of the file's dtype and a packet that
/// keeps the same tokens in every head (can_read_into_cache).
Packet read_packet_into_cache(const Rope& rope, const CacheReader& reader, const std::string& id,
                              KvCache& cache);
bool can_read_into_cache(const CacheReader& reader, const std::string& id, const KvCache& cache);
/// append_packet() for a packet read_packet_into_cache() put after the end of `cache` with its
/// keys turned by `turned_by`, cache.next_position() then and now (else Error): its rows become
/// the cache's. The same arithmetic as append_packet, bit for bit.
void append_packet_in_place(KvCache& cache, const Packet& packet, int64_t turned_by);

/// append_packet() for a packet read without its tensors (CacheReader::read_without_tensors):
/// its keys and values come from `reader` one (layer, kv-head) plane at a time, so memory never
/// holds the packet (an offloaded cache). The same arithmetic as append_packet, bit for bit.
/// Packets that keep different tokens per head are refused (UnsupportedError).
void append_packet_planes(const Rope& rope, KvCache& cache, const Packet& packet,
                          const CacheReader& reader, CacheDtype dtype);

/// BOS's keys and values as the model computes them into an empty cache, at position 0: the same
/// rows for every context that starts with them, so that a process answering many questions
/// (kvserve-once --requests) computes them once and copies them after (a forward pass of the
/// model for one token, a twentieth of a question on the demo model).
class BosRows {
  public:
    /// Puts BOS (`bos`) into the empty `cache`: by the model the first time (and whenever the
    /// model, the token or the cache's dtype or device differ from the last time), then as
    /// the same rows.
    void prefill(const Model& model, int32_t bos, KvCache& cache);

  private:
    const Model* model_ = nullptr;
    int32_t bos_ = -1;
    std::vector<torch::Tensor> keys_, values_;  // per layer, [kv_heads, 1, head_dim]
};

}  // namespace kv
