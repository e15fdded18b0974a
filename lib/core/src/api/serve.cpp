#include "kv/api/serve.hpp"

#include "context.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/json.hpp"
#include "kv/model/model.hpp"
#include "kv/model/packets.hpp"
#include "kv/runtime.hpp"
#include "kv/sampler.hpp"
#include "kv/sparse/sparse_attention.hpp"
#include "kv/tokenizer.hpp"
#include "runtime.hpp"
#include "serve_session.hpp"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>

namespace kv {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

// Seconds from this process's start (the kernel's record, in clock ticks since boot) to now: what
// loading the program and its libraries (libtorch's) took before serving began; 0 where /proc
// does not say.
double seconds_since_process_start() {
    std::ifstream stat_file("/proc/self/stat");
    std::string line;
    if (!std::getline(stat_file, line)) return 0;
    // Fields after the command name, which may hold spaces and parentheses: the state is the
    // 3rd field, the start time the 22nd.
    const std::size_t close = line.rfind(')');
    if (close == std::string::npos) return 0;
    std::istringstream fields(line.substr(close + 1));
    std::string field;
    for (int index = 3; index < 22; ++index)
        if (!(fields >> field)) return 0;
    unsigned long long start_ticks = 0;
    if (!(fields >> start_ticks)) return 0;
    const long ticks_per_second = ::sysconf(_SC_CLK_TCK);
    timespec now{};
    if (ticks_per_second <= 0 || ::clock_gettime(CLOCK_BOOTTIME, &now) != 0) return 0;
    const double since_boot =
        static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
    return std::max(
        0.0, since_boot - static_cast<double>(start_ticks) / static_cast<double>(ticks_per_second));
}

std::span<const float> as_span(const torch::Tensor& logits) {
    return {logits.data_ptr<float>(), static_cast<std::size_t>(logits.numel())};
}

using Emit = std::function<void(std::string_view)>;

// One run of kvserve-once, stage by stage: what a stage leaves behind (the cache, the logits,
// the streamer's view of the text) is what the next one starts from.
class Session {
  public:
    /// Checks the options against the loaded model and its tokenizer, and sets up the decoding
    /// attention; `sampler` samples, and the stores and packets come from `packets`.
    Session(const ServeOptions& options, ServeStats& stats, Sampler sampler, const Runtime& runtime,
            PacketSource& packets, KeptBetweenQuestions* kept = nullptr);
    /// The --cache packets, in order, realigned, into a cache of the chosen tier; their indexes
    /// go to the sparse attention.
    void assemble_packets();
    /// KV Packet's baselines: part of the packed context recomputed (--recompute).
    void recompute();
    /// --document: prefilled layer by layer, IceCache indexing each finished layer.
    void prefill_document();
    /// The prompt after the context (through the sparse attention for an offloaded cache or
    /// --sparse-prompt, whose stored indexes are restored first).
    void prefill_prompt(const Emit& emit);
    /// Samples and feeds tokens until EOS, the length or the model's context.
    void decode(const Emit& emit);
    /// The sparse attention's counts and the rates, into the stats.
    void finish_stats();
    /// Gives the cache in memory back to `kept` for the next question.
    void keep_cache();

  private:
    /// The stored indexes restored and the rows after them indexed (SparseAttention::prepare):
    /// before a sparse prompt, and after the first token, which the prompt's logits give
    /// without them.
    void restore_indexes();
    void report(const ServeProgress& progress) const {
        if (options_.progress) options_.progress(progress);
    }

    const ServeOptions& options_;
    ServeStats& stats_;
    Sampler sampler_;
    const Runtime& runtime_;
    PacketSource& packets_;
    KeptBetweenQuestions* kept_;
    const Model& model_;
    const Tokenizer& tokenizer_;
    const int64_t context_;
    const bool has_bos_;
    const bool offload_to_disk_;
    std::unique_ptr<SparseAttention> sparse_;
    std::optional<TextStreamer> streamer_;
    std::optional<KvCache> cache_;
    std::vector<int32_t> prompt_ids_;
    std::vector<int32_t> preamble_ids_;
    AssembledContext assembled_;
    int64_t packets_read_ = 0;
    torch::Tensor logits_;
    Clock::time_point prefill_start_;
    bool indexes_restored_ = false;
};

// The model is loaded before anything else is checked against it; the options alone first.
const ServeOptions& checked(const ServeOptions& options) {
    if (options.max_new_tokens < 0)
        throw UsageError("the number of tokens to generate must be >= 0");
    return options;
}

Session::Session(const ServeOptions& options, ServeStats& stats, Sampler sampler,
                 const Runtime& runtime, PacketSource& packets, KeptBetweenQuestions* kept)
    : options_(options),
      stats_(stats),
      sampler_(std::move(sampler)),
      runtime_(runtime),
      packets_(packets),
      kept_(kept),
      model_(*runtime_.model),
      tokenizer_(*runtime_.tokenizer),
      context_(model_.config().max_position_embeddings),
      has_bos_(options.add_bos && tokenizer_.add_bos() && tokenizer_.bos_id() >= 0),
      offload_to_disk_(options.offload == "disk") {
    stats_.device = model_.device().str();
    stats_.dtype = dtype_name(model_.dtype());
    if (!options_.document.empty() && !options_.caches.empty())
        throw UsageError("--document and --cache are two ways to give the context: use one");
    if (!options_.caches.empty() && options_.prompt.empty())
        throw UsageError(
            "with --cache the prompt must not be empty: a cache holds the keys and values of "
            "its tokens, not the logits that follow them");
    const SparseOptions& attention = options_.attention;
    check_sparse_method(attention.method);
    const bool full = attention.method == "full";
    if (!full || attention.measure_recall)
        sparse_ = std::make_unique<SparseAttention>(model_.config(), model_.rope(), attention);
    stats_.attention = attention.method;
    stats_.budget = full ? 0 : attention.budget;

    streamer_.emplace(tokenizer_);
    stats_.offload = options_.offload;
    if (options_.offload != "host" && !offload_to_disk_)
        throw UsageError("--offload is host or disk, not " + kv::quoted(options_.offload));
    if (offload_to_disk_) {
        if (options_.caches.empty())
            throw UsageError("--offload disk keeps --cache packets on disk: give --cache files");
        for (const std::string& spec : options_.caches)
            if (parse_cache_selection(spec).file == "-")
                throw UsageError(
                    "--offload disk reads cache files in place; standard input would be held in "
                    "memory: give a file");
        if (!model_.device().is_cpu())
            throw UnsupportedError("--offload disk decodes on the CPU only so far (device " +
                                   model_.device().str() + ")");
    }
    prompt_ids_ = tokenizer_.encode(options_.prompt);
    if (!options_.preamble.empty()) {
        if (options_.caches.empty())
            throw UsageError("a preamble goes before --cache packets: give --cache");
        preamble_ids_ = tokenizer_.encode(options_.preamble);
    }
}

void Session::assemble_packets() {
    const ModelConfig& config = model_.config();
    // The cache is made once for everything it will hold: the packets, BOS, the prompt and the
    // tokens to generate (an offloaded one cannot grow; one in memory grown packet by packet
    // copied what it held each time, and faulted in fresh pages for it: eight packets of a RAG
    // question, a tenth of --requests' time).
    auto planned_tokens = [&] {
        // (assemble_packets asks for 64 tokens to spare after each packet.)
        int64_t tokens = 2 + 64 + options_.max_new_tokens +
                         static_cast<int64_t>(prompt_ids_.size()) +
                         static_cast<int64_t>(preamble_ids_.size());
        for (const std::string& spec : options_.caches) {
            const CacheSelection selection = parse_cache_selection(spec);
            const std::shared_ptr<const CacheReader> reader = packets_.store(selection.file);
            if (!selection.id.empty())
                tokens += reader->packet_info(selection.id).stored_length;
            else
                for (const PacketInfo& info : reader->packets())
                    tokens += info.stored_length;
        }
        return tokens;
    };
    // The time to the first token starts here: opening the stores and finding the packets to
    // size the cache are part of it (as the open, and of the cache's load).
    prefill_start_ = Clock::now();
    const int64_t planned = planned_tokens();
    const double planning_seconds = seconds_since(prefill_start_);
    // The previous question's cache, emptied, where it is in memory and not more than 4x what
    // this one needs (one long question would otherwise keep its memory for every later one):
    // fresh, its pages faulted in anew as the packets were copied in, a few percent of
    // --requests' time.
    const bool reuse = !offload_to_disk_ && kept_ && kept_->cache &&
                       kept_->cache->capacity() <= 4 * std::max<int64_t>(planned, 256);
    if (offload_to_disk_) {
        cache_.emplace(KvCache::on_disk(config.num_layers, config.num_kv_heads, config.head_dim,
                                        model_.dtype(), planned, options_.offload_dir));
    } else if (reuse) {
        cache_.emplace(std::move(*kept_->cache));
        cache_->clear();
        cache_->reserve(planned);
    } else {
        const auto allocate_start = Clock::now();
        cache_.emplace(model_.new_cache(planned));
        if (!options_.caches.empty()) cache_->fault_in();
        stats_.cache_allocate_seconds = seconds_since(allocate_start);
    }
    if (kept_) kept_->cache.reset();  // one not reused goes
    KvCache& cache = *cache_;
    stats_.offloaded_bytes = cache.offloaded_bytes();

    // KV Packet's preamble (the chat template's start) in place of BOS, then the baked packets,
    // in order, each realigned to follow the previous one.
    if (!preamble_ids_.empty()) {
        model_.prefill(preamble_ids_, cache);
        for (int32_t id : preamble_ids_)
            streamer_->push(id);
    }
    assembled_ = kv::assemble_packets(
        model_, tokenizer_, runtime_.cache_info, options_.caches, has_bos_ && preamble_ids_.empty(),
        options_.max_new_tokens + 64, cache,
        [&](Packet& packet) {
            report({"packets", ++packets_read_, 0});
            if (!sparse_) return;
            if (packet.padded())
                throw UnsupportedError("packet " + kv::quoted(packet.id) +
                                       " keeps different numbers of tokens per head; sparse "
                                       "attention (--attention " +
                                       options_.attention.method +
                                       ") does not handle that yet: use --attention full");
            const auto restore_start = Clock::now();
            sparse_->add_stored_index(cache.length(), cache.next_position(),
                                      std::move(packet.index));
            stats_.index_restore_seconds += seconds_since(restore_start);
        },
        &packets_, kept_ ? &kept_->bos : nullptr);
    if (packets_read_ > 0) report({"packets", packets_read_, packets_read_});
    stats_.cache_load_seconds = assembled_.read_seconds + planning_seconds;
    stats_.cache_open_seconds = assembled_.open_seconds + planning_seconds;
    stats_.realign_seconds = assembled_.append_seconds;
    stats_.cache_bytes_read = assembled_.bytes_read;
    stats_.packets_read = assembled_.packets_read;
    stats_.packets_from_memory = assembled_.packets_from_memory;
    stats_.packets_read_directly = assembled_.packets_read_directly;
    stats_.bytes_read_directly = assembled_.bytes_read_directly;
    if (assembled_.bos_added) streamer_->push(tokenizer_.bos_id());
    // Adapter soft tokens (id -1) have no text.
    for (int32_t id : assembled_.tokens)
        if (id >= 0 && id < tokenizer_.vocab_size()) streamer_->push(id);
    stats_.cache_tokens = static_cast<int64_t>(assembled_.tokens.size());
}

void Session::recompute() {
    const RecomputeOptions& recompute = options_.recompute;
    stats_.recompute = recompute.method;
    if (recompute.method == "none") return;
    if (assembled_.packets.empty())
        throw UsageError("--recompute " + recompute.method + " needs --cache packets");
    if (assembled_.per_head || sparse_)
        throw UnsupportedError(
            "--recompute needs packets that keep the same tokens in every head, decoded with "
            "--attention full");
    std::vector<int64_t> slots;
    std::vector<int32_t> ids;
    const int64_t first_slot = assembled_.packets.front().first_slot;
    for (const PlacedPacket& placed : assembled_.packets) {
        const int64_t take =
            recompute.method == "epic" ? std::min(placed.stored, recompute.tokens) : placed.stored;
        for (int64_t slot = placed.first_slot; slot < placed.first_slot + take; ++slot) {
            const int32_t id = assembled_.tokens[static_cast<std::size_t>(slot - first_slot)];
            if (id < 0)
                throw UnsupportedError(
                    "--recompute needs packets baked without an adapter: "
                    "soft tokens have no token id to recompute from");
            slots.push_back(slot);
            ids.push_back(id);
        }
    }
    const auto recompute_start = Clock::now();
    stats_.recomputed_per_layer =
        model_.recompute(*cache_, torch::tensor(slots, torch::kInt64), ids,
                         recompute.method == "cacheblend" ? recompute.ratio : 1.0, 1);
    stats_.recompute_seconds = seconds_since(recompute_start);
}

void Session::prefill_document() {
    if (options_.document.empty()) return;
    KvCache& cache = *cache_;
    std::vector<int32_t> document;
    if (has_bos_) document.push_back(tokenizer_.bos_id());
    for (int32_t id : tokenizer_.encode(options_.document))
        document.push_back(id);
    stats_.document_tokens = static_cast<int64_t>(document.size());
    if (stats_.document_tokens >= context_)
        throw MismatchError("the document is " + std::to_string(stats_.document_tokens) +
                            " tokens, the model's context is " + std::to_string(context_));
    for (int32_t id : document)
        streamer_->push(id);
    const auto document_start = Clock::now();
    cache.reserve(stats_.document_tokens + options_.max_new_tokens + 64);
    auto report_layer = [&](int64_t layer) {
        report({"document layers", layer + 1, model_.config().num_layers});
    };
    const bool icecache = sparse_ && options_.attention.method == "icecache";
    if (icecache && !model_.device().is_cpu()) {
        // The layers compute on the accelerator while the host indexes the finished ones.
        IndexWorker worker(*sparse_, cache);
        logits_ =
            model_.prefill_by_layer(document, cache, options_.prefill_chunk, [&](int64_t layer) {
                worker.layer_done(layer);
                report_layer(layer);
            });
        const auto wait_start = Clock::now();
        worker.finish();
        stats_.index_wait_seconds = seconds_since(wait_start);
    } else if (icecache) {
        // On the host the prefill already keeps every core busy: a worker thread only competed
        // with it (bench/bench-document, when the worker ran on the CPU too: 0.90x at 2k tokens,
        // 0.88x at 8k, one run each), so each layer is indexed on all cores as soon as it is
        // done.
        logits_ =
            model_.prefill_by_layer(document, cache, options_.prefill_chunk, [&](int64_t layer) {
                sparse_->prepare_layer(layer, cache);
                report_layer(layer);
            });
    } else {
        logits_ = model_.prefill_by_layer(document, cache, options_.prefill_chunk, report_layer);
    }
    stats_.document_seconds = seconds_since(document_start);
}

void Session::prefill_prompt(const Emit& emit) {
    KvCache& cache = *cache_;
    std::vector<int32_t> prompt;
    if (cache.length() == 0 && has_bos_) prompt.push_back(tokenizer_.bos_id());
    prompt.insert(prompt.end(), prompt_ids_.begin(), prompt_ids_.end());
    if (prompt.empty() && options_.document.empty())
        throw UsageError("the prompt is empty and the tokenizer has no BOS token to start from");
    stats_.prompt_tokens = static_cast<int64_t>(prompt.size());
    if (cache.next_position() + stats_.prompt_tokens >= context_)
        throw MismatchError(
            "the prompt is " + std::to_string(stats_.prompt_tokens) + " tokens" +
            (cache.length() ? " after " + std::to_string(cache.next_position()) + " cached" : "") +
            ", the model's context is " + std::to_string(context_));

    if (options_.echo) emit(options_.prompt);
    cache.reserve(cache.length() + stats_.prompt_tokens + options_.max_new_tokens + 1);
    // The streamer applies the leading-space rule after BOS; prompt text was emitted as typed.
    for (int32_t id : prompt)
        streamer_->push(id);

    const auto prompt_start = Clock::now();
    // Without a prompt (a document alone) decoding continues from the document's logits.
    // An offloaded cache goes through the sparse attention for the prompt too: a dense prefill
    // would read every page of the context.
    const bool sparse_prompt =
        !prompt.empty() && sparse_ && (options_.sparse_prompt || offload_to_disk_);
    // Indexes that the prompt goes through are restored before it (an offloaded cache's keep
    // their keys on disk too, SparseAttention::prepare).
    if (sparse_ && (sparse_prompt || offload_to_disk_)) restore_indexes();
    const auto prefill_start = Clock::now();
    if (sparse_prompt) {
        for (std::size_t i = 0; i < prompt.size(); ++i) {
            logits_ = model_.prefill(std::span<const int32_t>(prompt).subspan(i, 1), cache, 1,
                                     sparse_.get());
            report({"prompt tokens", static_cast<int64_t>(i) + 1,
                    static_cast<int64_t>(prompt.size())});
        }
    } else if (!prompt.empty()) {
        logits_ = model_.prefill(prompt, cache, options_.prefill_chunk);
    }
    stats_.prompt_prefill_seconds = seconds_since(prefill_start);
    // The first token needs no index: the stored indexes (after a dense prompt) and the
    // prompt's rows are indexed after it, before the first decoding step (decode). The time
    // to first token of a 32k-token IceCache packet of a 1B model waited 1.1 s for them.
    indexes_restored_ = false;
    cache.release_pages();
    stats_.prefill_seconds = seconds_since(prompt_start);
    stats_.total_context_tokens = cache.next_position();
}

void Session::decode(const Emit& emit) {
    KvCache& cache = *cache_;
    stats_.stop_reason = "length";
    Clock::time_point decode_start;
    int32_t token_buffer[1];
    while (stats_.generated_tokens < options_.max_new_tokens) {
        const int32_t next = sampler_.sample(as_span(logits_));
        if (stats_.generated_tokens == 0) {
            stats_.time_to_first_token_seconds = seconds_since(prefill_start_);
            decode_start = Clock::now();
        }
        if (!options_.ignore_eos && tokenizer_.is_end_of_generation(next)) {
            stats_.stop_reason = "eos";
            break;
        }
        ++stats_.generated_tokens;
        // Models may have more rows than the tokenizer has tokens (padding to a round size);
        // such ids have no text.
        const std::string text =
            next < tokenizer_.vocab_size() ? streamer_->push(next) : std::string();
        if (!text.empty()) emit(text);
        if (stats_.generated_tokens == options_.max_new_tokens) break;
        if (cache.next_position() >= context_) {
            stats_.stop_reason = "context";
            break;
        }
        if (sparse_ && !indexes_restored_) {
            restore_indexes();
            decode_start = Clock::now();  // decoding's rates are of the decoding alone
        }
        token_buffer[0] = next;
        logits_ =
            model_.prefill(std::span<const int32_t>(token_buffer, 1), cache, 1, sparse_.get());
    }
    const std::string rest = streamer_->finish();
    if (!rest.empty()) emit(rest);
    if (stats_.generated_tokens > 1) {
        stats_.decode_seconds = seconds_since(decode_start);
        stats_.time_per_output_token_seconds =
            stats_.decode_seconds / static_cast<double>(stats_.generated_tokens - 1);
        stats_.decode_tokens_per_second =
            static_cast<double>(stats_.generated_tokens - 1) / stats_.decode_seconds;
    }
}

void Session::restore_indexes() {
    const auto restore_start = Clock::now();
    sparse_->prepare(*cache_);
    stats_.index_restore_seconds += seconds_since(restore_start);
    indexes_restored_ = true;
}

void Session::finish_stats() {
    if (sparse_) {
        const SparseStats& sparse_stats = sparse_->stats();
        // Only measured recall is reported; a layer with no sparse step (dense) attends to
        // every token, so its recall is exactly 1.
        for (std::size_t layer = 0;
             options_.attention.measure_recall && layer < sparse_stats.recall_sum.size(); ++layer)
            stats_.attention_recall.push_back(
                sparse_stats.recall_count[layer] > 0
                    ? sparse_stats.recall_sum[layer] /
                          static_cast<double>(sparse_stats.recall_count[layer])
                    : 1.0);
        if (sparse_stats.selections > 0)
            stats_.attended_tokens = static_cast<double>(sparse_stats.selected_tokens) /
                                     static_cast<double>(sparse_stats.selections);
        for (std::size_t layer = 0; layer < sparse_stats.layer_selections.size(); ++layer)
            if (sparse_stats.layer_selections[layer] > 0)
                stats_.attended_per_layer.push_back(
                    {static_cast<int64_t>(layer),
                     static_cast<double>(sparse_stats.layer_rows_sum[layer]) /
                         static_cast<double>(sparse_stats.layer_selections[layer]),
                     sparse_stats.layer_rows_max[layer]});
        stats_.sparse_steps = sparse_stats.steps;
        stats_.dense_attention_seconds = sparse_stats.dense_attention_seconds;
        stats_.sparse_attention_seconds = sparse_stats.sparse_attention_seconds;
        stats_.index_dot_products = sparse_stats.index_dot_products;
        stats_.indexed_tokens = sparse_stats.indexed_tokens;
        stats_.index_seconds = sparse_stats.index_seconds;
        stats_.select_seconds = sparse_stats.select_seconds;
        stats_.offloaded_bytes += sparse_stats.offloaded_index_bytes;
    }
    if (stats_.prefill_seconds > 0)
        stats_.prefill_tokens_per_second =
            static_cast<double>(stats_.prompt_tokens) / stats_.prefill_seconds;
}

void Session::keep_cache() {
    if (kept_ && cache_ && !cache_->offloaded()) kept_->cache = std::move(cache_);
}

void run(Session& session, const Emit& emit) {
    session.assemble_packets();
    session.recompute();
    session.prefill_document();
    session.prefill_prompt(emit);
    session.decode(emit);
    session.finish_stats();
    session.keep_cache();
}

}  // namespace

ServeStats serve_loaded(const ServeOptions& options, const Runtime& runtime, PacketSource& packets,
                        const Emit& emit, int threads, KeptBetweenQuestions* kept) {
    ServeStats stats;
    torch::NoGradGuard no_grad;
    Sampler sampler(checked(options).sampling);
    stats.threads = threads;
    stats.seed = sampler.seed();
    Session session(options, stats, std::move(sampler), runtime, packets, kept);
    run(session, emit);
    return stats;
}

ServeStats serve_once(const ServeOptions& options, const Emit& emit) {
    ServeStats stats;
    torch::NoGradGuard no_grad;
    // The options alone are checked before the model loads, then everything against it.
    Sampler sampler(checked(options).sampling);
    stats.threads = set_compute_threads(options.runtime.threads);
    stats.seed = sampler.seed();
    stats.startup_seconds = seconds_since_process_start();
    const auto load_start = Clock::now();
    const Runtime runtime = load_runtime(options.runtime);
    stats.load_seconds = seconds_since(load_start);
    DirectPacketSource packets(stats.threads);
    Session session(options, stats, std::move(sampler), runtime, packets);
    run(session, emit);
    return stats;
}

ProgressLine progress_line(const ServeProgress& progress) {
    ProgressLine line;
    line.text = progress.total > 0 ? format_text("%s: %lld/%lld", progress.stage.c_str(),
                                                 static_cast<long long>(progress.done),
                                                 static_cast<long long>(progress.total))
                                   : format_text("%s: %lld", progress.stage.c_str(),
                                                 static_cast<long long>(progress.done));
    line.last = progress.total > 0 && progress.done == progress.total;
    // Plain lines with -v at the ends of stages only: a line per token would drown the text.
    line.plain = line.last;
    return line;
}

std::string summary(const ServeStats& stats) {
    std::string context;
    if (stats.cache_tokens > 0)
        context = format_text(" after %lld cached", static_cast<long long>(stats.cache_tokens));
    else if (stats.document_tokens > 0)
        context =
            format_text(" after a document of %lld", static_cast<long long>(stats.document_tokens));
    return format_text(
        "%lld prompt tokens%s, %lld generated (%s); first token after %.2f s, %.1f tokens/s",
        static_cast<long long>(stats.prompt_tokens), context.c_str(),
        static_cast<long long>(stats.generated_tokens), stats.stop_reason.c_str(),
        stats.time_to_first_token_seconds, stats.decode_tokens_per_second);
}

json::Value stats_to_json(const ServeStats& stats) {
    json::Value result = json::Value::object();
    result.set("prompt_tokens", stats.prompt_tokens);
    result.set("generated_tokens", stats.generated_tokens);
    result.set("stop_reason", stats.stop_reason);
    result.set("load_seconds", stats.load_seconds);
    result.set("prefill_seconds", stats.prefill_seconds);
    result.set("prefill_tokens_per_second", stats.prefill_tokens_per_second);
    result.set("time_to_first_token_seconds", stats.time_to_first_token_seconds);
    result.set("time_per_output_token_seconds", stats.time_per_output_token_seconds);
    result.set("decode_tokens_per_second", stats.decode_tokens_per_second);
    if (stats.document_tokens > 0) {
        result.set("document_tokens", stats.document_tokens);
        result.set("document_seconds", stats.document_seconds);
        result.set("index_wait_seconds", stats.index_wait_seconds);
    }
    result.set("offload", stats.offload);
    if (stats.offloaded_bytes > 0) result.set("offloaded_bytes", stats.offloaded_bytes);
    result.set("cache_tokens", stats.cache_tokens);
    result.set("cache_bytes_read", stats.cache_bytes_read);
    result.set("cache_load_seconds", stats.cache_load_seconds);
    result.set("startup_seconds", stats.startup_seconds);
    result.set("cache_open_seconds", stats.cache_open_seconds);
    result.set("cache_allocate_seconds", stats.cache_allocate_seconds);
    result.set("realign_seconds", stats.realign_seconds);
    result.set("index_restore_seconds", stats.index_restore_seconds);
    result.set("recompute_seconds", stats.recompute_seconds);
    result.set("prompt_prefill_seconds", stats.prompt_prefill_seconds);
    result.set("context_tokens", stats.total_context_tokens);
    result.set("attention", stats.attention);
    if (stats.budget > 0) result.set("budget", stats.budget);
    if (!stats.attention_recall.empty()) {
        json::Value recall = json::Value::array();
        for (double value : stats.attention_recall)
            recall.push_back(value);
        result.set("attention_recall", std::move(recall));
    }
    if (stats.attention != "full" || !stats.attention_recall.empty()) {
        result.set("attended_tokens", stats.attended_tokens);
        json::Value layers = json::Value::array();
        for (const ServeStats::LayerRows& rows : stats.attended_per_layer) {
            json::Value item = json::Value::object();
            item.set("layer", rows.layer);
            item.set("mean", rows.mean);
            item.set("max", rows.max);
            layers.push_back(std::move(item));
        }
        result.set("attended_per_layer", std::move(layers));
        result.set("index_dot_products", stats.index_dot_products);
        result.set("indexed_tokens", stats.indexed_tokens);
        result.set("index_seconds", stats.index_seconds);
        result.set("select_seconds", stats.select_seconds);
        result.set("sparse_steps", stats.sparse_steps);
        result.set("dense_attention_seconds", stats.dense_attention_seconds);
        result.set("sparse_attention_seconds", stats.sparse_attention_seconds);
    }
    if (stats.recompute != "none" && !stats.recompute.empty()) {
        result.set("recompute", stats.recompute);
        json::Value counts = json::Value::array();
        for (int64_t count : stats.recomputed_per_layer)
            counts.push_back(count);
        result.set("recomputed_per_layer", std::move(counts));
    }
    result.set("seed", stats.seed);
    result.set("threads", stats.threads);
    result.set("device", stats.device);
    result.set("dtype", stats.dtype);
    return result;
}

}  // namespace kv
