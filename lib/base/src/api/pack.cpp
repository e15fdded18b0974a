#include "kv/api/pack.hpp"
#include "kv/api/report.hpp"
#include "kv/format/cache_reader.hpp"

#include "kv/error.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/output_path.hpp"
#include "kv/rope.hpp"
#include "kv/sha256.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <memory>

namespace kv {

void check_same_adapter(const std::string& context_adapter, const Packet& packet) {
    if (packet.adapter_fingerprint == context_adapter) return;
    auto name = [](const std::string& fingerprint) {
        return fingerprint.empty() ? std::string("no adapter")
                                   : "adapter " + fingerprint.substr(0, 12);
    };
    throw MismatchError("packet " + kv::quoted(packet.id) + " was baked with " +
                        name(packet.adapter_fingerprint) + ", an earlier packet with " +
                        name(context_adapter) +
                        ": packets of one context must share their adapter");
}

namespace {

// The parts' indexes side by side: each segment keeps its tree and pages, shifted to its place in
// the context and told the rotation its keys received (formats/kvcache.md, 6.5). Only when every
// part has an index built alike (over the same layers); otherwise the context has none.
PacketIndex pack_indexes(const std::vector<Packet>& packets, const CacheModelInfo& model) {
    const PacketIndex& first = packets.front().index;
    for (const Packet& packet : packets) {
        const PacketIndex& index = packet.index;
        if (index.empty() || packet.padded() || index.projection != first.projection ||
            index.page_size != first.page_size || index.promotion_first != first.promotion_first ||
            index.promotion_rest != first.promotion_rest || index.layers != first.layers)
            return {};
    }
    PacketIndex out;
    out.layers = first.layers;
    out.page_size = first.page_size;
    out.promotion_first = first.promotion_first;
    out.promotion_rest = first.promotion_rest;
    out.projection = first.projection;
    int64_t offset = 0, stored_offset = 0;
    for (const Packet& packet : packets) {
        for (const IndexSegment& segment : packet.index.segments)
            out.segments.push_back(
                {segment.first + stored_offset, segment.count, segment.delta + offset});
        offset += packet.logical_length;
        stored_offset += packet.stored_length();
    }
    // Planes of the covered layers (every layer when `layers` is empty).
    const int64_t planes =
        (first.layers.empty() ? model.num_layers : static_cast<int64_t>(first.layers.size())) *
        model.num_kv_heads;
    for (int64_t plane = 0; plane < planes; ++plane)
        for (const Packet& packet : packets) {
            const auto segments = static_cast<int64_t>(packet.index.segments.size());
            for (int64_t segment = 0; segment < segments; ++segment)
                out.layouts.push_back(
                    packet.index.layouts[static_cast<std::size_t>(plane * segments + segment)]);
        }
    return out;
}

}  // namespace

Packet pack_packets(const std::vector<Packet>& packets, const CacheModelInfo& model,
                    const std::string& id) {
    if (packets.empty()) throw UsageError("nothing to pack: no packets");
    const RopeSettings rope = rope_settings(model);
    const std::size_t element = cache_dtype_size(model.dtype);
    const std::size_t planes = static_cast<std::size_t>(model.num_layers * model.num_kv_heads);
    const std::size_t row_bytes = static_cast<std::size_t>(model.head_dim) * element;

    Packet out;
    out.id = id;
    int64_t total_stored = 0, logical_total = 0;
    for (const Packet& packet : packets) {
        const std::size_t expected =
            planes * static_cast<std::size_t>(packet.stored_length()) * row_bytes;
        if (packet.keys.size() != expected || packet.values.size() != expected)
            throw FormatError("packet " + kv::quoted(packet.id) + " holds " +
                              std::to_string(packet.keys.size()) +
                              " bytes of keys, its shape needs " + std::to_string(expected));
        if (packet.positions.size() != packet.token_ids.size())
            throw FormatError("packet " + kv::quoted(packet.id) + " has " +
                              std::to_string(packet.positions.size()) + " positions for " +
                              std::to_string(packet.token_ids.size()) + " tokens");
        if (&packet == &packets.front())
            out.adapter_fingerprint = packet.adapter_fingerprint;
        else
            check_same_adapter(out.adapter_fingerprint, packet);
        total_stored += packet.stored_length();
        if (packet.logical_length > std::numeric_limits<int64_t>::max() - logical_total)
            throw FormatError("packet " + kv::quoted(packet.id) + " (logical_length " +
                              std::to_string(packet.logical_length) +
                              ") makes the context longer than 2^63 - 1 tokens");
        logical_total += packet.logical_length;
    }
    // Slots each (layer, kv head) uses, per part: all of them unless the part keeps tokens per
    // head (formats/kvcache.md 6.3). The context's heads then hold their parts' used slots one
    // after another, and its slot count is the largest total.
    const bool ragged = std::any_of(packets.begin(), packets.end(),
                                    [](const Packet& packet) { return packet.ragged(); });
    std::vector<int64_t> used_total(planes, 0);
    for (const Packet& packet : packets)
        for (std::size_t plane = 0; plane < planes; ++plane)
            used_total[plane] +=
                packet.ragged() ? packet.head_lengths.at(plane) : packet.stored_length();
    const int64_t slots =
        ragged ? *std::max_element(used_total.begin(), used_total.end()) : total_stored;
    const std::size_t total_bytes = planes * static_cast<std::size_t>(slots) * row_bytes;
    out.keys.assign(total_bytes, std::byte{0});
    out.values.assign(total_bytes, std::byte{0});
    if (ragged) {
        out.head_lengths = used_total;
        out.head_positions.assign(planes * static_cast<std::size_t>(slots), 0);
        out.positions.assign(static_cast<std::size_t>(slots), 0);
        out.token_ids.assign(static_cast<std::size_t>(slots), -1);
    }

    Sha256 parts_hash;
    parts_hash.update("kvpack-v1\n");
    int64_t offset = 0;
    std::vector<int64_t> filled(planes, 0);
    for (const Packet& packet : packets) {
        const std::size_t rows = static_cast<std::size_t>(packet.stored_length());
        std::vector<std::byte> keys = packet.keys;
        rotate_keys(keys.data(), model.dtype, planes * rows, rope, offset);
        // [L, H, S, D] per packet into [L, H, S_total, D]: one copy per (layer, kv head).
        for (std::size_t plane = 0; plane < planes; ++plane) {
            const std::size_t used =
                packet.ragged() ? static_cast<std::size_t>(packet.head_lengths[plane]) : rows;
            const std::size_t from = plane * rows * row_bytes;
            const std::size_t first = static_cast<std::size_t>(filled[plane]);
            const std::size_t to = (plane * static_cast<std::size_t>(slots) + first) * row_bytes;
            std::memcpy(out.keys.data() + to, keys.data() + from, used * row_bytes);
            std::memcpy(out.values.data() + to, packet.values.data() + from, used * row_bytes);
            if (ragged) {
                int64_t* positions =
                    out.head_positions.data() + plane * static_cast<std::size_t>(slots) + first;
                for (std::size_t slot = 0; slot < used; ++slot) {
                    positions[slot] =
                        offset + (packet.ragged() ? packet.head_positions[plane * rows + slot]
                                                  : packet.positions[slot]);
                    // Each context slot at the largest position a head uses it for, with the
                    // token of the part's slot that holds it (exactly that position's token
                    // unless a part had padding).
                    const std::size_t at = first + slot;
                    if (positions[slot] >= out.positions[at]) {
                        out.positions[at] = positions[slot];
                        out.token_ids[at] = packet.token_ids[slot];
                    }
                }
            }
            filled[plane] += static_cast<int64_t>(used);
        }
        if (!ragged) {
            out.token_ids.insert(out.token_ids.end(), packet.token_ids.begin(),
                                 packet.token_ids.end());
            for (int64_t position : packet.positions)
                out.positions.push_back(position + offset);
        }
        parts_hash.update(packet.text_sha256 + "\n");
        offset += packet.logical_length;  // checked above: the lengths' sum fits
    }
    out.logical_length = offset;
    out.text_sha256 = parts_hash.hex();
    out.index = pack_indexes(packets, model);
    return out;
}

PackReport pack_caches(const PackOptions& options) {
    const auto started = std::chrono::steady_clock::now();
    std::vector<CacheSelection> selections;
    if (options.preamble) selections.push_back(*options.preamble);
    selections.insert(selections.end(), options.inputs.begin(), options.inputs.end());
    if (options.inputs.empty()) throw UsageError("nothing to pack: give at least one input");
    int stdin_inputs = 0;
    for (const CacheSelection& selection : selections)
        stdin_inputs += selection.file == "-";
    if (stdin_inputs > 1) throw UsageError("standard input ('-') can be read only once");
    {
        std::vector<std::filesystem::path> files;
        for (const CacheSelection& selection : selections)
            files.push_back(selection.file);
        refuse_output_among_inputs(options.output, files);
    }

    // Each file is opened once, whatever number of its packets are named.
    std::map<std::filesystem::path, std::unique_ptr<CacheReader>> readers;
    const CacheReader* first = nullptr;
    PackReport report;
    std::vector<Packet> packets;
    for (const CacheSelection& selection : selections) {
        auto& reader = readers[selection.file];
        if (!reader) {
            reader = std::make_unique<CacheReader>(selection.file);
            if (!first)
                first = reader.get();
            else
                check_compatible(first->model(), reader->model(), reader->source());
        }
        std::vector<std::string> ids;
        if (selection.id.empty()) {
            for (const PacketInfo& info : reader->packets())
                ids.push_back(info.id);
            if (ids.empty()) throw FormatError(reader->source() + " holds no packet");
        } else {
            ids.push_back(reader->packet_info(selection.id).id);
        }
        for (const std::string& id : ids) {
            packets.push_back(reader->read(id));
            const Packet& packet = packets.back();
            if (packet.logical_length > std::numeric_limits<int64_t>::max() - report.logical_length)
                throw FormatError(reader->source() + ": packet " + kv::quoted(id) +
                                  " (logical_length " + std::to_string(packet.logical_length) +
                                  ") makes the context longer than 2^63 - 1 tokens");
            report.parts.push_back({selection.file.string(), id, report.logical_length,
                                    packet.logical_length, packet.stored_length()});
            report.logical_length += packet.logical_length;
            report.stored_length += packet.stored_length();
            report.bytes_read += static_cast<int64_t>(packet.keys.size() + packet.values.size());
        }
    }
    try {
        rope_settings(first->model());  // what the rotation needs, named with its file
    } catch (const FormatError& error) {
        throw FormatError(first->source() + ": cannot rotate its keys: " + error.what());
    }
    const Packet context = pack_packets(packets, first->model(), options.id);
    report.indexed = !context.index.empty();
    if (!report.indexed) {
        const auto indexed = std::count_if(packets.begin(), packets.end(),
                                           [](const Packet& p) { return !p.index.empty(); });
        if (indexed > 0) {
            const auto without = std::find_if(packets.begin(), packets.end(),
                                              [](const Packet& p) { return p.index.empty(); });
            report.index_dropped = without != packets.end()
                                       ? "packet " + kv::quoted(without->id) + " has no index"
                                       : "the packets' indexes were built with different settings";
        }
    }
    packets.clear();
    CacheWriter writer(options.output, first->model(), options.provenance, options.write);
    writer.add(context);
    writer.finish();
    report.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return report;
}

json::Value to_json(const PackReport& report) {
    json::Value value = json::Value::object();
    json::Value parts = json::Value::array();
    for (const PackPart& part : report.parts) {
        json::Value item = json::Value::object();
        item.set("file", part.file);
        item.set("id", part.id);
        item.set("offset", part.offset);
        item.set("logical_length", part.logical_length);
        item.set("stored_length", part.stored_length);
        parts.push_back(std::move(item));
    }
    value.set("packets", static_cast<int64_t>(report.parts.size()));
    value.set("logical_length", report.logical_length);
    value.set("stored_length", report.stored_length);
    value.set("bytes_read", report.bytes_read);
    value.set("indexed", report.indexed);
    value.set("seconds", report.seconds);
    value.set("parts", std::move(parts));
    return value;
}

std::string summary(const PackReport& report) {
    return format_text("%zu packets, %lld tokens (%lld stored) in %.3f s", report.parts.size(),
                       static_cast<long long>(report.logical_length),
                       static_cast<long long>(report.stored_length), report.seconds);
}

std::string warning(const PackReport& report) {
    return report.index_dropped.empty()
               ? ""
               : "note: " + report.index_dropped + ": the context carries no IceCache index";
}

}  // namespace kv
