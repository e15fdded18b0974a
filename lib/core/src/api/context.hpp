// Assembling a context from baked packets, as kvserve-once --cache and kvinspect plot do: BOS
// first when the tokenizer uses one and the first packet does not start with it (KV Packet's
// preamble), then every selected packet in order, its keys rotated to follow the previous one.
#pragma once

#include "kv/format/packet_source.hpp"
#include "kv/model/model.hpp"
#include "kv/model/packets.hpp"
#include "kv/packet.hpp"
#include "kv/tokenizer.hpp"

#include <functional>
#include <string>
#include <vector>

namespace kv {

/// Where one packet landed in the assembled cache.
struct PlacedPacket {
    std::string id;
    int64_t first_slot = 0;  ///< its first stored token's slot in the cache
    int64_t stored = 0;
    int64_t first_position = 0;
    int64_t header_tokens = 0;
    int64_t trailer_tokens = 0;
};

struct AssembledContext {
    std::vector<PlacedPacket> packets;
    std::vector<int32_t> tokens;  ///< per slot of the packets, in order (-1: soft tokens)
    bool bos_added = false;
    bool per_head = false;   ///< some packet keeps different tokens per head (kvcache.md 6.3)
    int64_t bytes_read = 0;  ///< keys and values read from the files
    double read_seconds = 0;
    double open_seconds = 0;          ///< opening the stores (part of read_seconds)
    double append_seconds = 0;        ///< realigning packets in memory into the cache
    int64_t packets_from_memory = 0;  ///< packets the source kept from earlier questions
    int64_t packets_read = 0;         ///< packets read from their files
    /// Of those, read straight into the cache (in place or plane by plane), not through the
    /// source; with the keys and values read for them.
    int64_t packets_read_directly = 0, bytes_read_directly = 0;
};

/// Appends the packets of `caches` (FILE or FILE:ID each) to `cache`, checking that every file
/// belongs to the model (`model_info`), that the packets share their adapter and that the
/// context fits the model. `before_append(packet)` runs before each packet is appended, after
/// those checks (sparse attention takes the packet's index there: it may move it out; a packet
/// the source keeps for later questions comes as a copy without tensors then). Stores and
/// packets come from `source` (a DirectPacketSource: opened and read here), BOS from
/// `bos_rows` where given.
AssembledContext assemble_packets(const Model& model, const Tokenizer& tokenizer,
                                  const CacheModelInfo& model_info,
                                  const std::vector<std::string>& caches, bool add_bos,
                                  int64_t reserve_extra, KvCache& cache,
                                  const std::function<void(Packet&)>& before_append = {},
                                  PacketSource* source = nullptr, BosRows* bos_rows = nullptr);

}  // namespace kv
