// kvbake: prefill each document on its own and store its KV cache as a packet of a cache file.
//
// Short documents are packed several to a forward pass with a block-diagonal attention mask
// (each attends only to itself, each from position 0), so a batch of small documents bakes at
// the speed of one long one, with no padding. Torch-free header: the tool includes only this.
#pragma once

#include "kv/api/report.hpp"
#include "kv/compress.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/json.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kv {

struct BakeProgress {
    int64_t documents_done = 0;
    int64_t documents_total = 0;
    int64_t tokens_done = 0;
    double seconds = 0;
};

struct BakeOptions {
    std::filesystem::path model;
    std::optional<std::filesystem::path> tokenizer;
    std::vector<std::string> inputs;  ///< text files, "-" (stdin) or .jsonl files
    std::filesystem::path output;     ///< "-": standard output
    bool add_bos = true;              ///< start each packet with BOS when the tokenizer uses one
    /// A KV Packet adapter file (kvtrain): every document is baked wrapped as [header][document]
    /// [trailer], from position 0 and without BOS (the header is the packet's attention sink).
    std::optional<std::filesystem::path> adapter;
    /// KV Packet's preamble from the model's chat template (kvbake --chat-preamble): a first
    /// packet, id chat_preamble_packet_id ("chat-preamble"), holding the template's start (BOS
    /// where the template writes one, the system turn with `system`, the opening of the user's
    /// turn) as it is: no BOS added, no adapter, never compressed. kvpack --preamble and
    /// kvserve-once --cache put it first; kvserve-once --chat takes it as its preamble. Only
    /// shard 0 bakes it.
    bool chat_preamble = false;
    std::string system;       ///< with chat_preamble: a system message ("" for none)
    int64_t shard_index = 0;  ///< bake documents whose ordinal % shard_count == shard_index
    int64_t shard_count = 1;
    int64_t batch_tokens = 512;  ///< most tokens per forward pass when packing documents
    /// Skip bad documents (unreadable, malformed, not UTF-8, empty, duplicate, too long) and
    /// report them instead of failing the whole run.
    bool keep_going = false;
    bool truncate = false;  ///< cut documents longer than the context instead of refusing them
    /// Add the packets to the existing store at `output` (created when absent): the store is
    /// locked meanwhile and replaced atomically with its old packets followed by the new ones.
    bool append = false;
    /// Compress each packet as it is baked (kvpress-style, with the prefill's own queries for
    /// the rules that need them; such documents are prefilled one at a time).
    std::optional<CompressionSettings> compress;
    int threads = 0;
    std::string device = "auto";
    std::string dtype = "auto";  ///< compute and storage dtype
    bool use_mmap = false;
    CacheWriteOptions write;
    Provenance provenance;
    std::function<void(const BakeProgress&)> progress;  ///< after every forward pass
};

struct BakeReport {
    int64_t documents = 0;             ///< baked by this run
    int64_t kept_documents = 0;        ///< already in the store (append)
    int64_t truncated = 0;             ///< documents cut to the context length
    int64_t stored_tokens = 0;         ///< tokens per head kept (less than tokens when compressing)
    std::vector<std::string> skipped;  ///< one line per document skipped (keep_going)
    int64_t tokens = 0;
    double seconds = 0;  ///< tokenizing, prefilling and writing, without loading the model
    double tokens_per_second = 0;
};

BakeReport bake(const BakeOptions& options);

/// kvbake's progress: "3/10 documents, 1200 tokens, 800 tokens/s".
ProgressLine progress_line(const BakeProgress& progress);
/// kvbake --json: documents, tokens, seconds, tokens_per_second, truncated, compress and
/// stored_tokens (when compressing), skipped, kept_documents (when appending).
json::Value to_json(const BakeReport& report, const BakeOptions& options);
/// kvbake's summary line: "3 documents, 1200 tokens in 1.50 s (800 tokens/s)", then what was
/// appended, truncated, compressed and skipped.
std::string summary(const BakeReport& report, const BakeOptions& options);

}  // namespace kv
