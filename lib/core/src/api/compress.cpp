#include "kv/compress.hpp"

#include "kv/api/report.hpp"

#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/format/quantize.hpp"
#include "kv/model/compress.hpp"
#include "kv/output_path.hpp"
#include "kv/rope.hpp"
#include "kv/runtime.hpp"
#include "runtime.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <set>

namespace kv {
namespace {

// The queries of a packet's prefill exist only for the tokens as baked: from position 0, every
// token stored, no adapter soft token (their embeddings are the adapter's, not the model's).
void check_recomputable(const Packet& packet, const std::string& source, CompressionMethod method) {
    const std::string what = source + ": packet " + kv::quoted(packet.id);
    const std::string rule = compression_method_name(method);
    if (packet.stored_length() != packet.logical_length)
        throw FormatError(what + " was pruned before (" + std::to_string(packet.stored_length()) +
                          " of " + std::to_string(packet.logical_length) + " tokens); " + rule +
                          " scores a packet by its whole prefill");
    for (std::size_t i = 0; i < packet.positions.size(); ++i)
        if (packet.positions[i] != static_cast<int64_t>(i))
            throw FormatError(what + " does not store positions 0, 1, 2, ...; " + rule +
                              " scores a packet by its prefill from position 0");
    for (int32_t id : packet.token_ids)
        if (id < 0)
            throw FormatError(what +
                              " holds adapter soft tokens, whose queries only its baking "
                              "sees: use kvbake --compress " +
                              rule);
}

// Bytes of keys and values as the file stores them (before zstd): codes, scales and offsets of
// quantised ones.
int64_t stored_bytes(const Packet& packet, const CacheModelInfo& model) {
    const int64_t planes = model.num_layers * model.num_kv_heads, slots = packet.stored_length();
    const Quantization& q = packet.quantization;
    if (!q.enabled()) return static_cast<int64_t>(packet.keys.size() + packet.values.size());
    const int64_t residual = std::min(slots, q.residual_tokens), quantized = slots - residual;
    const int64_t per_row = model.head_dim * q.bits / 8 + 2 * 2 * (model.head_dim / q.group_size);
    return 2 * planes *
           (quantized * per_row +
            residual * model.head_dim * static_cast<int64_t>(cache_dtype_size(model.dtype)));
}

}  // namespace

CompressReport compress_cache_file(const CompressOptions& options) {
    const auto started = std::chrono::steady_clock::now();
    const CompressionSettings& settings = options.settings;
    if (options.prune) validate_compression_settings(settings);
    const bool needs_queries = options.prune && compression_needs_queries(settings.method);
    if (needs_queries && !options.model)
        throw UsageError(std::string("--method ") + compression_method_name(settings.method) +
                         " scores tokens by the prefill's queries: give the model (-m)");
    set_compute_threads(options.threads);

    // Compressing a store in place (-o the input) is a rewrite by design: under the lock
    // kvbake --append takes, held until the new file is in place. Any other input as the output
    // is refused before any work.
    std::optional<CacheFileLock> lock;
    if (same_file(options.input, options.output)) {
        if (options.input == "-" || options.output == "-")
            throw UsageError("standard input and standard output are the same file: write the "
                             "compressed store to another file");
        lock.emplace(options.input);
    }
    {
        std::vector<std::filesystem::path> inputs;
        if (options.model)
            for (const std::filesystem::path& file : model_input_files(*options.model))
                inputs.push_back(file);
        if (options.tokenizer) inputs.push_back(*options.tokenizer);
        refuse_output_among_inputs(options.output, inputs);
    }
    const CacheReader reader(options.input);
    const CacheModelInfo& model = reader.model();
    std::set<std::string> selected;
    for (const std::string& id : options.ids)
        selected.insert(reader.packet_info(id).id);  // throws for an unknown id

    std::optional<Runtime> runtime;
    std::unique_ptr<Rope> file_rope;
    if (needs_queries) {
        runtime = load_runtime({*options.model, options.tokenizer, "auto", options.device, false});
        CacheModelInfo expected = runtime->cache_info;
        expected.dtype = model.dtype;
        check_compatible(expected, model, reader.source());
    } else {
        RopeSettings rope;
        try {
            rope = rope_settings(model);
        } catch (const FormatError& error) {
            throw FormatError(reader.source() + ": cannot rotate its keys: " + error.what());
        }
        file_rope = std::make_unique<Rope>(rope.layout, rope.inverse_frequencies);
    }
    const Rope& rope = runtime ? runtime->model->rope() : *file_rope;

    CompressReport report;
    report.method = options.prune ? compression_method_name(settings.method) : "";
    CacheWriter writer(options.output, model, options.provenance, options.write);
    if (reader.has_adapter()) writer.set_adapter(reader.read_adapter());  // kept as it is
    const auto total = static_cast<int64_t>(reader.packets().size());
    int64_t done = 0;
    for (const PacketInfo& info : reader.packets()) {
        Packet packet = reader.read(info.id);
        if (!selected.empty() && !selected.count(info.id)) {
            writer.add(packet);
            ++report.copied;
        } else {
            if (packet.ragged())
                throw FormatError(reader.source() + ": packet " + kv::quoted(info.id) +
                                  " is already compressed per head; compress the uncompressed "
                                  "packet instead");
            std::unique_ptr<QueryRecorder> recorder;
            if (needs_queries) {
                check_recomputable(packet, reader.source(), settings.method);
                const Model& m = *runtime->model;
                recorder = std::make_unique<QueryRecorder>(settings, rope, model.num_layers);
                KvCache cache = m.new_cache(packet.stored_length());
                m.prefill(packet.token_ids, cache, 512, nullptr, recorder.get());
            }
            Packet compressed = options.prune
                                    ? compress_packet(packet, model, rope, settings, recorder.get())
                                    : packet;
            if (options.write.quantization) compressed.quantization = *options.write.quantization;
            report.quantization = quantization_name(compressed.quantization);
            CompressedPacket line;
            line.id = info.id;
            line.logical_length = packet.logical_length;
            line.stored_before = packet.stored_length();
            line.stored_after = compressed.stored_length();
            line.per_head = compressed.ragged();
            line.index_dropped = !packet.index.empty() && compressed.index.empty();
            report.bytes_before += static_cast<int64_t>(packet.keys.size() + packet.values.size());
            report.bytes_after += stored_bytes(compressed, model);
            report.packets.push_back(line);
            writer.add(compressed);
        }
        if (options.progress) options.progress(++done, total);
    }
    writer.finish();
    report.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return report;
}

json::Value to_json(const CompressReport& report) {
    int64_t before = 0, after = 0;
    json::Value packets = json::Value::array();
    for (const CompressedPacket& line : report.packets) {
        before += line.stored_before;
        after += line.stored_after;
        json::Value item = json::Value::object();
        item.set("id", line.id);
        item.set("logical_length", line.logical_length);
        item.set("stored_before", line.stored_before);
        item.set("stored_after", line.stored_after);
        item.set("per_head", line.per_head);
        item.set("index_dropped", line.index_dropped);
        packets.push_back(std::move(item));
    }
    json::Value value = json::Value::object();
    value.set("method", report.method);
    value.set("quantization", report.quantization);
    value.set("compressed", static_cast<int64_t>(report.packets.size()));
    value.set("copied", report.copied);
    value.set("tokens_before", before);
    value.set("tokens_after", after);
    value.set("bytes_before", report.bytes_before);
    value.set("bytes_after", report.bytes_after);
    value.set("seconds", report.seconds);
    value.set("packets", std::move(packets));
    return value;
}

std::string summary(const CompressReport& report) {
    int64_t before = 0, after = 0, per_head = 0, dropped = 0;
    for (const CompressedPacket& line : report.packets) {
        before += line.stored_before;
        after += line.stored_after;
        per_head += line.per_head;
        dropped += line.index_dropped;
    }
    const std::string how = report.method.empty() ? "stored as " + report.quantization
                            : report.quantization == "none"
                                ? "with " + report.method
                                : "with " + report.method + ", stored as " + report.quantization;
    return format_text(
        "compressed %zu packet%s %s: %lld -> %lld tokens per head, %lld -> %lld "
        "bytes of keys and values%s%s",
        report.packets.size(), report.packets.size() == 1 ? "" : "s", how.c_str(),
        static_cast<long long>(before), static_cast<long long>(after),
        static_cast<long long>(report.bytes_before), static_cast<long long>(report.bytes_after),
        per_head ? ", tokens chosen per head" : "",
        dropped ? " (IceCache indexes dropped: run kvindex again)" : "");
}

std::string warning(const CompressReport& report) {
    const auto dropped =
        std::count_if(report.packets.begin(), report.packets.end(),
                      [](const CompressedPacket& line) { return line.index_dropped; });
    if (!dropped) return "";
    return format_text("note: IceCache indexes dropped from %lld packet%s: run kvindex again",
                       static_cast<long long>(dropped), dropped == 1 ? "" : "s");
}

std::vector<std::string> details(const CompressReport& report) {
    std::vector<std::string> lines;
    for (const CompressedPacket& line : report.packets)
        lines.push_back("packet " + kv::quoted(line.id) + ": " +
                        format_text("%lld -> %lld tokens per head, of %lld positions",
                                    static_cast<long long>(line.stored_before),
                                    static_cast<long long>(line.stored_after),
                                    static_cast<long long>(line.logical_length)) +
                        (line.per_head ? ", chosen per head" : "") +
                        (line.index_dropped ? ", IceCache index dropped" : ""));
    return lines;
}

}  // namespace kv
