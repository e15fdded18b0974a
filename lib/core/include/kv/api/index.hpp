// kvindex: IceCache's multi-level DCI index for every (layer, kv-head) of every packet of a cache
// file, stored with the packet (formats/kvcache.md, section 6.5), but for the layers decoding
// reads densely and those that reuse an earlier layer's choice. Needs no model: the keys are all
// it reads. Torch-free header: the tool includes only this.
#pragma once

#include "kv/api/report.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/json.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

namespace kv {

struct IndexProgress {
    int64_t packets_done = 0;
    int64_t packets_total = 0;
};

struct IndexOptions {
    std::filesystem::path input;         ///< "-": standard input
    std::filesystem::path output = "-";  ///< "-": standard output
    int64_t page_size = 16;
    double promotion_first = 0.01;  ///< p0
    double promotion_rest = 0.2;    ///< p1
    int64_t exact_parent_limit = 3000;
    int64_t anchor_interval = 120;
    /// The first layers decode densely and get no index (kvserve-once --dense-layers).
    int64_t dense_layers = 2;
    /// One sparse layer's choice serves this many (kvserve-once --reuse-layers): only the
    /// first of each run, layer dense_layers + k * reuse_layers, gets an index.
    int64_t reuse_layers = 1;
    uint64_t seed = 1;           ///< draws the projection direction
    int threads = 0;             ///< 0: all cores; one (layer, kv-head) per thread
    bool keep_existing = false;  ///< leave packets that already have an index as they are
    CacheWriteOptions write;
    /// Write the keys and values compressed as the input's are (its first packet's keys: their
    /// zstd level, none when they are not zstd-compressed) instead of at write.zstd_level (which
    /// a store of quantised packets only keeps): an index added to a store baked uncompressed
    /// for reading speed leaves it uncompressed.
    bool zstd_level_of_input = false;
    Provenance provenance;
    std::function<void(const IndexProgress&)> progress;  ///< after each packet
};

struct IndexReport {
    int64_t packets = 0;
    int64_t tokens = 0;
    int64_t indexes = 0;  ///< (packet, layer, kv-head) indexes built
    int64_t layers = 0;   ///< layers indexed per packet (of the model's)
    int64_t pages = 0;    ///< pages over all of them
    int64_t kept = 0;     ///< packets whose existing index was kept
    int max_levels = 0;
    double build_seconds = 0;  ///< building the indexes only
    double seconds = 0;        ///< everything
};

/// Reads `input`, indexes every packet and writes `output` atomically (the input is never
/// modified; the same path for both is fine).
IndexReport index_cache_file(const IndexOptions& options);

/// kvindex's progress: "3/10 packets".
ProgressLine progress_line(const IndexProgress& progress);
/// kvindex --json: packets, tokens, indexes, layers, pages, kept, max_levels, build_seconds,
/// seconds.
json::Value to_json(const IndexReport& report);
/// kvindex's summary line: "3 packets, 1200 tokens, 48 indexes, 75 pages, up to 3 levels; built
/// in 0.120 s (0.150 s in all)".
std::string summary(const IndexReport& report);

}  // namespace kv
