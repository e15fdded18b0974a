// Compression of baked caches by pruning tokens, with the scoring rules of NVIDIA kvpress
// (github.com/NVIDIA/kvpress, its presses): each (layer, kv-head) keeps its own top-scored tokens,
// so a compressed packet stores per-head positions (formats/kvcache.md 6.3) and keeps its logical
// length, which is what keeps RoPE right when it is packed after others.
//
// Rules that look only at the cache (random, knorm, streaming, leverage, cur) compress a file
// as it is; those that need the prefill's queries (snapkv, tova, observed, expected) run the
// model over the packet's tokens once more (`kvinspect compress -m`) or score while baking
// (`kvbake --compress`). Torch-free header: the tools include only this.
#pragma once

#include "kv/format/cache_writer.hpp"
#include "kv/json.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kv {

enum class CompressionMethod {
    random,
    knorm,
    streaming,
    snapkv,
    tova,
    observed,
    expected,
    leverage,
    cur
};

/// "random", "knorm", ...; UsageError listing the names otherwise.
CompressionMethod parse_compression_method(const std::string& name);
const char* compression_method_name(CompressionMethod method);
/// The names, comma-separated, for help texts.
std::string compression_method_names();
/// Whether the rule needs the prefill's queries (so the model).
bool compression_needs_queries(CompressionMethod method);

/// How much to keep and the rules' parameters, with kvpress's defaults.
struct CompressionSettings {
    CompressionMethod method = CompressionMethod::knorm;
    double ratio = -1;           ///< fraction of each head's tokens pruned, in [0, 1); < 0: unset
    int64_t keep_tokens = -1;    ///< tokens each head keeps instead of a ratio; < 0: unset
    bool keep_adapters = false;  ///< never prune a packet's header and trailer soft tokens
    uint64_t seed = 0;           ///< random's scores, leverage's sketch
    int64_t sinks = 4;           ///< streaming, expected, cur: first tokens always kept
    int64_t window_size = 64;    ///< snapkv: the last queries whose attention scores the rest
    int64_t kernel_size = 5;     ///< snapkv: average pooling of the scores
    int64_t future_positions = 512;  ///< expected: positions the query statistics are rotated over
    int64_t sketch_dimension = 48;   ///< leverage: Gaussian sketch width
    int64_t local_window = 16;       ///< cur: norms are normalised inside windows of this size

    /// Tokens a head of a packet of `tokens` stored tokens keeps (kvpress: floor(T(1 - ratio)),
    /// at least 1), before adapter tokens are added back.
    int64_t kept(int64_t tokens) const;
};

/// UsageError unless exactly one of ratio and keep_tokens is set and in range, and the
/// parameters are positive.
void validate_compression_settings(const CompressionSettings& settings);

struct CompressOptions {
    std::filesystem::path input;   ///< "-": standard input
    std::filesystem::path output;  ///< "-": standard output
    std::vector<std::string> ids;  ///< packets to compress; empty: every packet
    bool prune = true;             ///< false: only rewrite (e.g. quantise, write.quantization)
    CompressionSettings settings;
    /// For rules that need queries: the model the cache was baked with (checked).
    std::optional<std::filesystem::path> model;
    std::optional<std::filesystem::path> tokenizer;
    std::string device = "auto";
    int threads = 0;
    CacheWriteOptions write;
    Provenance provenance;
    std::function<void(int64_t done, int64_t total)> progress;
};

struct CompressedPacket {
    std::string id;
    int64_t logical_length = 0;
    int64_t stored_before = 0;
    int64_t stored_after = 0;  ///< slots per head now
    bool per_head = false;     ///< heads keep different tokens (ragged)
    bool index_dropped = false;
};

struct CompressReport {
    std::string method;                     ///< "" when nothing was pruned
    std::string quantization;               ///< how the output stores the compressed packets
    std::vector<CompressedPacket> packets;  ///< compressed ones, in file order
    int64_t copied = 0;                     ///< packets left as they were (not selected)
    int64_t bytes_before = 0;               ///< keys and values of the compressed packets
    int64_t bytes_after = 0;
    double seconds = 0;
};

/// Reads `input`, compresses the selected packets and writes every packet to `output`
/// atomically (unselected ones unchanged). Throws UsageError for bad settings or a rule that
/// needs the model when none is given, MismatchError when the model is not the cache's,
/// FormatError for a packet that cannot be compressed (already per-head, or pruned before
/// when the rule needs its queries); nothing is written then.
CompressReport compress_cache_file(const CompressOptions& options);

/// kvinspect compress --json: method, quantization, compressed, copied, tokens_before,
/// tokens_after, bytes_before, bytes_after, seconds, and per packet its id, logical_length,
/// stored_before, stored_after, per_head and index_dropped.
json::Value to_json(const CompressReport& report);
/// kvinspect compress's summary line: "compressed 3 packets with knorm: 60 -> 42 tokens per
/// head, ... bytes of keys and values", and whether tokens were chosen per head and IceCache
/// indexes dropped.
std::string summary(const CompressReport& report);
/// "note: IceCache indexes dropped from 2 packets: run kvindex again" when some were, ""
/// otherwise: the warning the summary line and the JSON report carry, for when neither is shown.
std::string warning(const CompressReport& report);
/// One line per compressed packet (kvinspect compress -v): "packet 'd1': 23 -> 16 tokens per
/// head, of 23 positions", and whether its tokens were chosen per head and its index dropped.
std::vector<std::string> details(const CompressReport& report);

}  // namespace kv
