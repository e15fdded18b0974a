// kvserve-once: load a model, prefill a prompt, decode a continuation, report timings.
//
// Torch-free on purpose: the tool's main includes only this header.
#pragma once

#include "kv/api/report.hpp"
#include "kv/json.hpp"
#include "kv/runtime.hpp"
#include "kv/sampler.hpp"
#include "kv/sparse/options.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kv {

/// The baselines of KV Packet: part of a context packed from --cache packets recomputed before
/// the prompt.
struct RecomputeOptions {
    /// "none", "epic" (each packet's first `tokens` tokens, in every layer), "cacheblend" (every
    /// packet token in the first two layers, then the `ratio` whose keys and values deviated
    /// most at layer 1) or "all" (full recompute of every packet token).
    std::string method = "none";
    double ratio = 0.3;
    int64_t tokens = 32;
};

/// Where the work before the first token stands: reading packets, prefilling a document layer by
/// layer, feeding the prompt a token at a time through the sparse attention. (The generated text
/// is its own progress.)
struct ServeProgress {
    std::string stage;  ///< "packets", "document layers", "prompt tokens"
    int64_t done = 0;
    int64_t total = 0;  ///< 0: not known ahead
};

struct ServeOptions {
    RuntimeOptions runtime;   ///< the model, its tokenizer, device, dtype, threads
    SamplerOptions sampling;  ///< temperature, top-p and the seed (none: drawn, reported)
    /// Decoding attention: "full" or a sparse method with its budget (kv/sparse/options.hpp).
    SparseOptions attention;
    RecomputeOptions recompute;
    /// Baked caches packed in order: "FILE" (every packet, in file order), "FILE:ID" (one
    /// packet), "-" (standard input).
    std::vector<std::string> caches;
    std::string prompt;
    /// A long document to read before the prompt (kvserve-once --document), instead of --cache
    /// packets: prefilled layer by layer, IceCache building each layer's index on a worker
    /// thread while the next layer computes. Empty: none.
    std::string document;
    bool echo = false;    ///< emit the prompt text before the continuation
    bool add_bos = true;  ///< start with BOS when the tokenizer has one and asks for it
    /// Text put before the --cache packets instead of BOS (kvserve-once --chat: the chat
    /// template's start, KV Packet's preamble), tokenized with the special tokens it writes
    /// recognised and nothing added. Empty: BOS as add_bos says.
    std::string preamble;
    int64_t max_new_tokens = 256;
    bool ignore_eos = false;  ///< keep going past end-of-generation tokens
    int64_t prefill_chunk = 512;
    /// Feed the prompt one token at a time through the sparse attention as well, so that no
    /// step reads the cached context densely (a stricter test of a sparse method).
    bool sparse_prompt = false;
    /// Where the --cache keys and values live while decoding: "host" (memory) or "disk" (a
    /// temporary file in `offload_dir`, rows read with pread as a step needs them: memory holds
    /// what one step reads, not the context).
    std::string offload = "host";
    std::filesystem::path offload_dir;                   ///< empty: $TMPDIR, else /tmp
    std::function<void(const ServeProgress&)> progress;  ///< as each stage advances
};

struct ServeStats {
    int64_t prompt_tokens = 0;
    int64_t generated_tokens = 0;
    std::string stop_reason;  ///< "eos", "length" (max_new_tokens) or "context" (the model's limit)
    double load_seconds = 0;
    double prefill_seconds = 0;
    int64_t document_tokens = 0;  ///< tokens of --document (BOS included)
    double document_seconds = 0;  ///< prefilling it, indexes included
    /// After its last layer, waiting for the index worker (the part of the index work that
    /// did not overlap the prefill).
    double index_wait_seconds = 0;
    std::string offload;           ///< as ServeOptions::offload
    int64_t offloaded_bytes = 0;   ///< the files an offloaded cache and its index keys live in
    int64_t cache_tokens = 0;      ///< tokens taken from --cache files
    int64_t cache_bytes_read = 0;  ///< bytes of keys and values read from them
    int64_t packets_read = 0;      ///< packets read from their files
    /// Packets taken from memory instead, kept since an earlier request (serve_requests).
    int64_t packets_from_memory = 0;
    /// Of packets_read and cache_bytes_read, those read straight into the cache (in place, or
    /// plane by plane when offloaded): with --requests, the packets that never pass through its
    /// PacketCache (not in --stats).
    int64_t packets_read_directly = 0, bytes_read_directly = 0;
    double cache_load_seconds = 0;  ///< reading them (included in time to first token)
    /// Where the time to first token went, besides load_seconds and cache_load_seconds: from the
    /// process's start to serving (the program and its libraries loading), opening the cache
    /// files (part of cache_load_seconds), making the cache's memory ready, realigning the
    /// packets' keys into the cache,
    /// recomputing cached tokens, the prompt's prefill alone. Restoring the packets' indexes
    /// comes after the first token, before the second (before the prompt where it goes through
    /// the sparse attention), and counts in neither.
    double startup_seconds = 0;
    double cache_open_seconds = 0;
    /// Making the cache's memory ready before the packets are read into it: fresh pages are
    /// zeroed by the system as they are first touched (4.3 GB at 128k tokens of a 1B model).
    double cache_allocate_seconds = 0;
    double realign_seconds = 0;
    double index_restore_seconds = 0;
    double recompute_seconds = 0;
    double prompt_prefill_seconds = 0;
    int64_t total_context_tokens = 0;  ///< positions before generation: cached and prompt
    /// From the start of context assembly (reading caches, realigning, prefilling the prompt) to
    /// the first sampled token.
    double time_to_first_token_seconds = 0;
    double decode_seconds = 0;  ///< the tokens after the first
    double prefill_tokens_per_second = 0;
    double time_per_output_token_seconds = 0;
    double decode_tokens_per_second = 0;
    std::string attention;
    int64_t budget = 0;
    /// Per layer: the share of the full softmax mass on the tokens attended to (measure_recall),
    /// averaged over steps and query heads; 1 for dense layers.
    std::vector<double> attention_recall;
    std::string recompute;                      ///< as ServeOptions::recompute
    std::vector<int64_t> recomputed_per_layer;  ///< cached tokens recomputed in each layer
    double attended_tokens = 0;                 ///< per kv head and sparse step, on average
    /// Per layer that chose rows: its index, and the rows one kv head attended to at a step,
    /// on average and at most (never more than the budget).
    struct LayerRows {
        int64_t layer = 0;
        double mean = 0;
        int64_t max = 0;
    };
    std::vector<LayerRows> attended_per_layer;
    /// One-token steps through the sparse attention (decoding, and a prompt fed token by
    /// token), and their attention time in dense layers and over the chosen rows: with
    /// select_seconds, the parts of a step that are not the weights.
    int64_t sparse_steps = 0;
    double dense_attention_seconds = 0;
    double sparse_attention_seconds = 0;
    int64_t index_dot_products = 0;
    int64_t indexed_tokens = 0;
    double index_seconds = 0;
    double select_seconds = 0;
    uint64_t seed = 0;
    int threads = 0;
    std::string device;
    std::string dtype;
};

/// Runs one generation; `emit` receives printable text as it is produced (UTF-8 sequences are
/// never split). Throws kv::Error subclasses for every failure.
ServeStats serve_once(const ServeOptions& options,
                      const std::function<void(std::string_view)>& emit);

json::Value stats_to_json(const ServeStats& stats);

// ---------------------------------------------------------------------------------------------
// Many questions in one process (kvserve-once --requests): the model loaded once, each store
// opened once, loaded packets kept in memory for the next questions.

/// One request's answer, or why it has none: a line of kvserve-once --requests's output.
struct RequestResult {
    int64_t line = 0;  ///< of the request in the input, from 1
    json::Value id;    ///< as the request gave it (null when the line has none)
    bool ok = false;
    std::string text;    ///< the answer (with echo, the prompt first)
    std::string error;   ///< one line, when not ok
    ServeStats stats;    ///< when ok
    double seconds = 0;  ///< serving it, from taking its line to its last token
    /// Its packets read ahead on the read-ahead thread while the requests before it were
    /// served (RequestsOptions::read_ahead): the time that took there, and the part of it this
    /// request still waited for (counted in its stats' cache_open_seconds, cache_load_seconds
    /// and time to first token). Both 0 for a request whose packets it read itself.
    bool read_ahead = false;
    double read_ahead_seconds = 0;
    double read_ahead_wait_seconds = 0;
};

/// What a run of requests did, so far or in all.
struct RequestsReport {
    int64_t requests = 0;  ///< lines that were not blank
    int64_t answered = 0;
    int64_t failed = 0;
    double load_seconds = 0;  ///< the model and tokenizer, once
    double seconds = 0;       ///< serving the requests, after loading
    int threads = 0;
    int64_t cache_memory = 0;         ///< RequestsOptions::cache_memory
    int64_t read_ahead = 0;           ///< requests whose packets were read ahead
    int64_t stores = 0;               ///< cache files opened
    int64_t packets_read = 0;         ///< packets read from their files
    int64_t packets_from_memory = 0;  ///< packets kept since an earlier request
    int64_t packets_evicted = 0;      ///< dropped to make room for others
    int64_t kept_bytes = 0;           ///< of packets in memory at the end
    int64_t peak_kept_bytes = 0;
    int64_t bytes_read = 0;  ///< keys and values read from the files
};

struct RequestsOptions {
    /// Bytes of loaded packets kept in memory for later requests, the least recently used
    /// dropped first; 0 keeps none. Packets offloaded to disk are never loaded (unused then).
    int64_t cache_memory = int64_t{1} << 30;
    /// Requests whose lines are already waiting in the input (nothing blocks for one) and whose
    /// packets a second thread reads while the one before them is served: at most this many
    /// ahead; 0 reads every request's packets when it is served. The packets of up to this many
    /// requests may be held beyond cache_memory while they wait. Requests offloaded to disk, and
    /// packets over a quarter of cache_memory, are read when served.
    int read_ahead = 2;
    /// Receives each request's result as soon as it is known, in input order; an exception it
    /// throws (a closed output) ends the run.
    std::function<void(const RequestResult&)> answer;
    /// After each request.
    std::function<void(const RequestsReport&)> progress;
};

/// Serves the requests of `input`, one JSON object per line (blank lines skipped), each with an
/// "id" (a string or an integer), its "prompt" and its "cache" (FILE[:ID] strings, in order)
/// and any of the per-request fields of request_options(); `defaults` gives what a request
/// leaves out, and the model, tokenizer, device, dtype, threads and offloading of them all.
/// The model is loaded once. A request that fails (a bad line, a missing packet, a prompt too
/// long) gets its error in its result and the run goes on. Throws for what ends the run: the
/// model not loading, a usage error in `defaults`, an unreadable input, `answer` throwing.
RequestsReport serve_requests(const ServeOptions& defaults, std::istream& input,
                              const RequestsOptions& options);

/// `defaults` with the fields of one request (a JSON object): id, prompt, cache (an array of
/// FILE[:ID] or one string), n_predict, temp, top_p, seed, echo, ignore_eos, attention, budget,
/// dense_layers, reuse_layers, field_of_view, sparse_prompt, measure_recall, recompute,
/// recompute_ratio, recompute_tokens: the command line's options of those names, each checked
/// as its option is. Throws UsageError naming the field for a wrong type or value and for a
/// field it does not know.
ServeOptions request_options(const json::Value& request, const ServeOptions& defaults);

/// A request's output line: {"id", "text", "stats"} (the stats of stats_to_json() less
/// load_seconds, with packets_read, packets_from_memory and the request's seconds), or {"id",
/// "line", "error"}.
json::Value to_json(const RequestResult& result);
json::Value to_json(const RequestsReport& report);
/// "12 requests: 11 answered, 1 failed, 3.4/s; packets 80 read, 16 from memory (12.3 MiB kept)"
ProgressLine progress_line(const RequestsReport& report);
/// kvserve-once --requests -v: the same after the last request, with the load time.
std::string summary(const RequestsReport& report);
/// kvserve-once's progress: "document layers: 5/16".
ProgressLine progress_line(const ServeProgress& progress);
/// kvserve-once -v: "12 prompt tokens after 4096 cached, 32 generated (eos); first token after
/// 0.85 s, 23.1 tokens/s".
std::string summary(const ServeStats& stats);

}  // namespace kv
