#include "kv/api/index.hpp"

#include "kv/error.hpp"
#include "kv/float_convert.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/index/dci.hpp"
#include "kv/output_path.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

namespace kv {

namespace {

DciOptions dci_options(const IndexOptions& options) {
    DciOptions dci;
    dci.page_size = options.page_size;
    dci.promotion_first = options.promotion_first;
    dci.promotion_rest = options.promotion_rest;
    dci.exact_parent_limit = options.exact_parent_limit;
    dci.anchor_interval = options.anchor_interval;
    return dci;
}

// The layers decoding queries an index of: past the dense ones, the first of each run of
// layers that share a choice. Empty when that is every layer (the file then needs no list).
std::vector<int64_t> indexed_layers(const IndexOptions& options, int64_t num_layers) {
    if (options.dense_layers < 0) throw UsageError("--dense-layers must be >= 0");
    if (options.reuse_layers < 1) throw UsageError("--reuse-layers must be >= 1");
    if (options.dense_layers >= num_layers)
        throw UsageError("--dense-layers " + std::to_string(options.dense_layers) +
                         " leaves no layer to index (the model has " + std::to_string(num_layers) +
                         ")");
    std::vector<int64_t> layers;
    for (int64_t layer = options.dense_layers; layer < num_layers; layer += options.reuse_layers)
        layers.push_back(layer);
    if (static_cast<int64_t>(layers.size()) == num_layers) layers.clear();
    return layers;
}

// One segment over the whole packet, one index per (covered layer, kv-head), built on `threads`
// threads.
PacketIndex build_packet_index(const Packet& packet, const CacheModelInfo& model,
                               const IndexOptions& options, const std::vector<float>& projection,
                               const std::vector<int64_t>& layers, int threads, int* max_levels) {
    const int64_t rows = layers.empty() ? model.num_layers : static_cast<int64_t>(layers.size());
    const int64_t planes = rows * model.num_kv_heads;
    const int64_t tokens = packet.stored_length(), dim = model.head_dim;
    PacketIndex index;
    index.page_size = options.page_size;
    index.promotion_first = options.promotion_first;
    index.promotion_rest = options.promotion_rest;
    index.projection = projection;
    index.segments = {{0, tokens, 0}};
    index.layers = layers;
    index.layouts.resize(static_cast<std::size_t>(planes));
    const DciOptions dci = dci_options(options);
    std::atomic<int64_t> next{0};
    std::atomic<int> levels{0};
    auto work = [&] {
        std::vector<float> keys(static_cast<std::size_t>(tokens * dim));
        for (int64_t plane; (plane = next++) < planes;) {
            // The plane's place among the packet's keys: its layer's, not its row's.
            const int64_t row = plane / model.num_kv_heads, head = plane % model.num_kv_heads;
            const int64_t layer = layers.empty() ? row : layers[static_cast<std::size_t>(row)];
            const std::size_t base =
                static_cast<std::size_t>((layer * model.num_kv_heads + head) * tokens * dim);
            for (std::size_t i = 0; i < keys.size(); ++i)
                keys[i] = load_float(packet.keys.data(), model.dtype, base + i);
            DciIndex built(dim, projection, dci);
            built.build(keys.data(), tokens);
            index.layouts[static_cast<std::size_t>(plane)] = built.layout();
            int seen = levels.load();
            while (built.levels() > seen && !levels.compare_exchange_weak(seen, built.levels())) {
            }
        }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < std::min<int64_t>(threads, planes); ++t)
        pool.emplace_back(work);
    work();
    for (std::thread& thread : pool)
        thread.join();
    *max_levels = std::max(*max_levels, levels.load());
    return index;
}

}  // namespace

IndexReport index_cache_file(const IndexOptions& options) {
    const auto started = std::chrono::steady_clock::now();
    validate_dci_options(dci_options(options));
    const int threads = options.threads > 0
                            ? options.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

    // Indexing a store in place (-o the input, as the README does) is a rewrite by design: under
    // the lock kvbake --append takes, held until the new file is in place.
    std::optional<CacheFileLock> lock;
    if (same_file(options.input, options.output)) {
        if (options.input == "-" || options.output == "-")
            throw UsageError(
                "standard input and standard output are the same file: write the "
                "indexed store to another file");
        lock.emplace(options.input);
    }
    const CacheReader reader(options.input);
    const CacheModelInfo& model = reader.model();
    const std::vector<float> projection = dci_projection(model.head_dim, options.seed);
    const std::vector<int64_t> layers = indexed_layers(options, model.num_layers);
    CacheWriteOptions write = options.write;
    const TensorLayout layout =
        options.zstd_level_of_input ? reader.tensor_layout() : TensorLayout{};
    // A store of quantised packets only has no such keys to go by: write.zstd_level stays.
    if (!layout.storage.empty()) {
        const bool zstd =
            std::find(layout.filters.begin(), layout.filters.end(), "zstd") != layout.filters.end();
        // zstd's level 0 is its default, 3; a negative (fast) one the writer's fastest, 1.
        write.zstd_level = !zstd                    ? 0
                           : layout.zstd_level == 0 ? 3
                                                    : std::clamp(layout.zstd_level, 1, 22);
    }
    CacheWriter writer(options.output, model, options.provenance, write);
    if (reader.has_adapter()) writer.set_adapter(reader.read_adapter());  // kept as it is
    IndexReport report;
    report.layers = layers.empty() ? model.num_layers : static_cast<int64_t>(layers.size());
    const auto total = static_cast<int64_t>(reader.packets().size());
    for (const PacketInfo& info : reader.packets()) {
        Packet packet = reader.read(info.id);
        if (options.keep_existing && !packet.index.empty()) {
            ++report.kept;
        } else if (packet.stored_length() > 0) {
            if (packet.padded())
                throw UnsupportedError(reader.source() + ": packet " + kv::quoted(info.id) +
                                       " keeps different numbers of tokens per head; an IceCache "
                                       "index over such heads is not defined (formats/kvcache.md "
                                       "6.3)");
            const auto began = std::chrono::steady_clock::now();
            packet.index = build_packet_index(packet, model, options, projection, layers, threads,
                                              &report.max_levels);
            report.build_seconds +=
                std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
            report.indexes += static_cast<int64_t>(packet.index.layouts.size());
            for (const DciLayout& layout : packet.index.layouts)
                report.pages += static_cast<int64_t>(layout.page_sizes.size());
        } else {
            packet.index = {};
        }
        report.tokens += packet.stored_length();
        writer.add(packet);
        ++report.packets;
        if (options.progress) options.progress({report.packets, total});
    }
    writer.finish();
    report.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return report;
}

ProgressLine progress_line(const IndexProgress& progress) {
    return {format_text("%lld/%lld packets", static_cast<long long>(progress.packets_done),
                        static_cast<long long>(progress.packets_total)),
            progress.packets_done == progress.packets_total};
}

json::Value to_json(const IndexReport& report) {
    json::Value value = json::Value::object();
    value.set("packets", report.packets);
    value.set("tokens", report.tokens);
    value.set("indexes", report.indexes);
    value.set("layers", report.layers);
    value.set("pages", report.pages);
    value.set("kept", report.kept);
    value.set("max_levels", static_cast<int64_t>(report.max_levels));
    value.set("build_seconds", report.build_seconds);
    value.set("seconds", report.seconds);
    return value;
}

std::string summary(const IndexReport& report) {
    return format_text(
        "%lld packets, %lld tokens, %lld indexes, %lld pages, up to %d levels; built in %.3f s "
        "(%.3f s in all)",
        static_cast<long long>(report.packets), static_cast<long long>(report.tokens),
        static_cast<long long>(report.indexes), static_cast<long long>(report.pages),
        report.max_levels, report.build_seconds, report.seconds);
}

}  // namespace kv
