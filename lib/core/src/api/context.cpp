#include "context.hpp"

#include "kv/api/pack.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/model/packets.hpp"

#include <chrono>
#include <memory>
#include <optional>

namespace kv {

AssembledContext assemble_packets(const Model& model, const Tokenizer& tokenizer,
                                  const CacheModelInfo& model_info,
                                  const std::vector<std::string>& caches, bool add_bos,
                                  int64_t reserve_extra, KvCache& cache,
                                  const std::function<void(Packet&)>& before_append,
                                  PacketSource* source, BosRows* bos_rows) {
    using Clock = std::chrono::steady_clock;
    auto since = [](Clock::time_point start) {
        return std::chrono::duration<double>(Clock::now() - start).count();
    };
    const int64_t context = model.config().max_position_embeddings;
    AssembledContext assembled;
    DirectPacketSource direct;
    PacketSource& packets = source ? *source : direct;
    std::optional<std::string> context_adapter;  // the first packet's; the others must agree
    auto add_bos_row = [&] {
        if (bos_rows)
            bos_rows->prefill(model, tokenizer.bos_id(), cache);
        else {
            const int32_t bos = tokenizer.bos_id();
            model.prefill(std::span<const int32_t>(&bos, 1), cache);
        }
        assembled.bos_added = true;
    };
    for (const std::string& spec : caches) {
        const CacheSelection selection = parse_cache_selection(spec);
        auto read_start = Clock::now();
        // Shared with the indexes of offloaded packets, which read their layouts later.
        const std::shared_ptr<const CacheReader> shared_reader = packets.store(selection.file);
        const CacheReader& reader = *shared_reader;
        assembled.read_seconds += since(read_start);
        assembled.open_seconds += since(read_start);
        CacheModelInfo expected = model_info;
        expected.dtype = reader.model().dtype;  // any storage dtype converts to the compute dtype
        check_compatible(expected, reader.model(), reader.source());
        // One packet is found by its id, without reading the store's whole directory.
        const std::vector<PacketInfo> selected =
            selection.id.empty() ? reader.packets()
                                 : std::vector<PacketInfo>{reader.packet_info(selection.id)};
        for (const PacketInfo& info : selected) {
            // An offloaded cache takes the keys and values plane by plane from the file, so
            // that memory never holds a whole packet. A cache in memory, when nothing keeps the
            // packet for later, has them read straight into its rows after its end: a copy of
            // the packet in between cost as much memory again, each page faulted in and zeroed
            // (a 32k-token packet of a 1B model: 1 GiB, most of the time it took to read).
            const bool by_plane = cache.offloaded();
            const bool in_place = !by_plane && !packets.keeps(reader, info) &&
                                  can_read_into_cache(reader, info.id, cache);
            if (in_place && cache.length() == 0 && add_bos) {
                // BOS goes first: whether the packet starts with it is known before its rows
                // are read to where BOS would go.
                const Packet peek = reader.read_without_tensors_or_layouts(info.id);
                if (peek.token_ids.empty() || peek.token_ids.front() != tokenizer.bos_id()) {
                    add_bos_row();
                }
            }
            read_start = Clock::now();
            SourcedPacket sourced;
            int64_t turned_by = 0;  // in place: the keys were turned by this as they were read
            if (by_plane) {
                sourced.packet =
                    std::make_shared<Packet>(reader.read_without_tensors_or_layouts(info.id));
            } else if (in_place) {
                cache.reserve(cache.length() + info.stored_length + reserve_extra);
                turned_by = cache.next_position();
                sourced.packet = std::make_shared<Packet>(
                    read_packet_into_cache(model.rope(), reader, info.id, cache));
                sourced.bytes_read = packet_tensor_bytes(reader.model(), info.stored_length);
            } else {
                sourced = packets.packet(shared_reader, info.id);
            }
            ++(sourced.from_memory ? assembled.packets_from_memory : assembled.packets_read);
            // A packet kept for later questions is lent: the callback gets a copy of what it
            // may take (the index), never the packet itself.
            Packet& packet = *sourced.packet;
            if ((by_plane || in_place) && !packet.index.empty())
                // Each plane's layout is read when its index is restored, then dropped: memory
                // never holds every plane's (9 bytes per token and plane), and the first token,
                // which needs no index, does not wait for them (32k tokens of a 1B shape: 33 MB
                // read and checked, 0.18 s).
                packet.index.read_layout = [shared_reader, id = info.id](
                                               int64_t layer, int64_t head, int64_t segment) {
                    return shared_reader->read_index_layout(id, layer, head, segment);
                };
            assembled.read_seconds += since(read_start);
            const int64_t bytes_read =
                by_plane ? packet_tensor_bytes(reader.model(), packet.stored_length())
                         : sourced.bytes_read;
            assembled.bytes_read += bytes_read;
            if (by_plane || in_place) {
                ++assembled.packets_read_directly;
                assembled.bytes_read_directly += bytes_read;
            }
            const bool starts_with_bos =
                !packet.token_ids.empty() && packet.token_ids.front() == tokenizer.bos_id();
            if (cache.length() == 0 && add_bos && !starts_with_bos && !in_place) {
                add_bos_row();
            }
            if (cache.next_position() + packet.logical_length >= context)
                throw MismatchError("the cached context reaches " +
                                    std::to_string(cache.next_position() + packet.logical_length) +
                                    " tokens with packet " + kv::quoted(packet.id) +
                                    ", the model's context is " + std::to_string(context));
            if (packet.ragged() && model.config().sliding_window > 0)
                throw UnsupportedError("packet " + kv::quoted(packet.id) +
                                       " keeps different tokens per head, which a sliding-window "
                                       "model cannot decode exactly yet");
            if (!context_adapter)
                context_adapter = packet.adapter_fingerprint;
            else
                check_same_adapter(*context_adapter, packet);
            cache.reserve(cache.length() + packet.stored_length() + reserve_extra);
            if (before_append && sourced.kept) {
                Packet lent;
                lent.id = packet.id;
                lent.logical_length = packet.logical_length;
                lent.token_ids = packet.token_ids;
                lent.head_lengths = packet.head_lengths;
                lent.head_positions = packet.head_positions;
                lent.index = packet.index;
                before_append(lent);
            } else if (before_append) {
                before_append(packet);
            }
            assembled.per_head = assembled.per_head || packet.ragged();
            assembled.packets.push_back({packet.id, cache.length(), packet.stored_length(),
                                         cache.next_position(), packet.header_tokens,
                                         packet.trailer_tokens});
            if (by_plane) {  // reading the tensors is part of appending them
                read_start = Clock::now();
                append_packet_planes(model.rope(), cache, packet, reader, reader.model().dtype);
                assembled.read_seconds += since(read_start);
            } else {
                const auto append_start = Clock::now();
                if (in_place)
                    append_packet_in_place(cache, packet, turned_by);
                else
                    append_packet(model.rope(), cache, packet, reader.model().dtype);
                assembled.append_seconds += since(append_start);
            }
            assembled.tokens.insert(assembled.tokens.end(), packet.token_ids.begin(),
                                    packet.token_ids.end());
        }
    }
    return assembled;
}

}  // namespace kv
