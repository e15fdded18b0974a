// kvinspect: look into cache files (formats/kvcache.md): summarize, verify, compare, export.
//
// Torch-free: these work on the stored bytes, converting bf16 and f16 to float where values are
// compared, so kvinspect runs without libtorch. Merging is merge_cache_files
// (kv/format/cache_store.hpp); its report's summary is here.
#pragma once

#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/json.hpp"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kv {

/// show: a summary for people (format, model, tokenizer, dtype, provenance, one line per packet)
/// from the packet index alone: no tensor is read.
std::string describe_cache_text(const CacheReader& reader);

/// show --json: the same as a JSON object; every field of the file's metadata, packet by packet.
json::Value describe_cache_json(const CacheReader& reader);

struct CheckReport {
    std::string source;                 ///< the file, quoted ("standard input" for "-")
    int64_t packets = 0;                ///< in the file (0 when it cannot be opened)
    std::vector<std::string> problems;  ///< one line each, naming the file (and the packet)
};

/// check: reads every chunk of every packet (so every checksum is verified), validates shapes
/// and looks for values that are not finite. Problems are empty when the file is sound. Errors
/// that stop the reading of a packet are reported and the next packet is checked.
CheckReport check_cache(const std::filesystem::path& path);
/// check_cache's problems.
std::vector<std::string> check_cache_file(const std::filesystem::path& path);
/// kvinspect check -v, one line per file: "'a.kvc': sound, 3 packets" or "'a.kvc': 2 problems,
/// 3 packets".
std::string summary(const CheckReport& report);

struct DiffOptions {
    double tolerance = 0;               ///< largest absolute difference still counted as equal
    std::optional<std::string> packet;  ///< compare only this packet
};

/// Absolute differences of one layer's keys and values (over kv-heads, tokens and dimensions).
struct LayerDifference {
    double keys_max = 0;
    double keys_mean = 0;
    double values_max = 0;
    double values_mean = 0;
};

struct PacketDifference {
    std::string id;
    int64_t stored_length = 0;
    /// Why the tensors could not be compared (token ids or shapes differ); empty when they were.
    std::vector<std::string> mismatches;
    std::vector<LayerDifference> layers;  ///< per layer, when compared
    bool same = false;                    ///< no mismatch and every error within the tolerance
};

struct DiffReport {
    std::string a, b;                       ///< the sources, quoted
    std::vector<std::string> notes;         ///< file-level differences: model, shapes, packet sets
    std::vector<std::string> remarks;       ///< what differs without making the files differ: dtype
    std::vector<PacketDifference> packets;  ///< packets present in both, in A's order
    bool same = false;
};

/// diff: compares the packets with the same ids in `a` and `b` (or only options.packet), layer
/// by layer, as float. Different model fingerprints, token ids, positions, shapes or packet sets
/// make the files different; a different dtype alone does not (the values are compared).
/// Throws for unreadable files and for a --packet that neither file has.
DiffReport diff_cache_files(const std::filesystem::path& a, const std::filesystem::path& b,
                            const DiffOptions& options);

/// The report as a table, one block per packet, then a summary line.
std::string format_diff_report(const DiffReport& report, double tolerance);

/// export --to safetensors: one safetensors file with, per packet, "<id>.keys" and "<id>.values"
/// ([layers, kv_heads, stored_length, head_dim] in the cache's dtype: F32, BF16 or F16),
/// "<id>.token_ids" (I32) and "<id>.positions" (I64); the metadata holds the model, provenance
/// and packet index as JSON strings. Written one packet at a time (memory holds one packet),
/// atomically; "-" is standard output, refused when it is a terminal unless `force`.
struct ExportReport {
    std::string output;  ///< quoted ("standard output" for "-")
    int64_t packets = 0;
    int64_t tensors = 0;
    int64_t bytes = 0;  ///< the whole file: header and tensors
};
ExportReport export_safetensors(const std::filesystem::path& input,
                                const std::filesystem::path& output, bool force = false);
/// kvinspect export -v: "exported 3 packets as 12 tensors to 'a.safetensors' (34567 bytes)".
std::string summary(const ExportReport& report);

/// kvinspect merge -v: "merged 2 files into 'all.kvc': 6 packets, 120 tokens (120 stored), 61440
/// bytes of keys and values".
std::string summary(const MergeReport& report, const std::filesystem::path& output);

}  // namespace kv
