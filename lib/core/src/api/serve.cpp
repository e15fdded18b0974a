#include "kv/api/serve.hpp"

#include "context.hpp"
#include "kv/api/pack.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/json.hpp"
#include "kv/model/model.hpp"
#include "kv/model/packets.hpp"
#include "kv/model/sparse.hpp"
#include "kv/runtime.hpp"
#include "kv/sampler.hpp"
#include "kv/tokenizer.hpp"
#include "runtime.hpp"

#include <chrono>
#include <optional>
#include <random>

namespace kv {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

std::span<const float> as_span(const torch::Tensor& logits) {
    return {logits.data_ptr<float>(), static_cast<std::size_t>(logits.numel())};
}

}  // namespace

ServeStats serve_once(const ServeOptions& options,
                      const std::function<void(std::string_view)>& emit) {
    if (options.max_new_tokens < 0)
        throw UsageError("the number of tokens to generate must be >= 0");
    ServeStats stats;
    stats.threads = set_compute_threads(options.threads);
    stats.seed = options.seed ? *options.seed : std::random_device{}();
    Sampler sampler({options.temperature, options.top_p, stats.seed});

    const auto load_start = Clock::now();
    const Runtime runtime = load_runtime(
        {options.model, options.tokenizer, options.dtype, options.device, options.use_mmap});
    const Model& model = *runtime.model;
    const Tokenizer& tokenizer = *runtime.tokenizer;
    stats.load_seconds = seconds_since(load_start);
    stats.device = model.device().str();
    stats.dtype = dtype_name(model.dtype());
    const ModelConfig& config = model.config();
    const int64_t context = config.max_position_embeddings;
    const bool has_bos = options.add_bos && tokenizer.add_bos() && tokenizer.bos_id() >= 0;
    if (!options.document.empty() && !options.caches.empty())
        throw UsageError("--document and --cache are two ways to give the context: use one");
    if (!options.caches.empty() && options.prompt.empty())
        throw UsageError(
            "with --cache the prompt must not be empty: a cache holds the keys and values of "
            "its tokens, not the logits that follow them");

    SparseOptions sparse_options;
    sparse_options.method = parse_sparse_method(options.attention);
    sparse_options.budget = options.budget;
    sparse_options.dense_layers = options.dense_layers;
    sparse_options.reuse_layers = options.reuse_layers;
    sparse_options.field_of_view = options.field_of_view;
    sparse_options.measure_recall = options.measure_recall;
    sparse_options.offload_dir = options.offload_dir;
    std::unique_ptr<SparseAttention> sparse;
    if (sparse_options.method != SparseMethod::full || options.measure_recall)
        sparse = std::make_unique<SparseAttention>(config, model.rope(), sparse_options);
    stats.attention = options.attention;
    stats.budget = sparse_options.method == SparseMethod::full ? 0 : options.budget;

    torch::NoGradGuard no_grad;
    TextStreamer streamer(tokenizer);
    stats.offload = options.offload;
    const bool offload_to_disk = options.offload == "disk";
    if (options.offload != "host" && !offload_to_disk)
        throw UsageError("--offload is host or disk, not " + kv::quoted(options.offload));
    if (offload_to_disk) {
        if (options.caches.empty())
            throw UsageError("--offload disk keeps --cache packets on disk: give --cache files");
        for (const std::string& spec : options.caches)
            if (parse_cache_selection(spec).file == "-")
                throw UsageError(
                    "--offload disk reads cache files in place; standard input would be held in "
                    "memory: give a file");
        if (!model.device().is_cpu())
            throw UnsupportedError("--offload disk decodes on the CPU only so far (device " +
                                   model.device().str() + ")");
    }
    const std::vector<int32_t> prompt_ids = tokenizer.encode(options.prompt);
    // An offloaded cache is made once for everything it will hold: the packets, BOS, the prompt
    // and the tokens to generate.
    auto planned_tokens = [&] {
        // (assemble_packets asks for 64 tokens to spare after each packet.)
        int64_t tokens = 2 + 64 + options.max_new_tokens + static_cast<int64_t>(prompt_ids.size());
        for (const std::string& spec : options.caches) {
            const CacheSelection selection = parse_cache_selection(spec);
            const CacheReader reader(selection.file);
            for (const PacketInfo& info : reader.packets())
                if (selection.id.empty() || info.id == selection.id) tokens += info.stored_length;
        }
        return tokens;
    };
    KvCache cache = offload_to_disk
                        ? KvCache::on_disk(config.num_layers, config.num_kv_heads, config.head_dim,
                                           model.dtype(), planned_tokens(), options.offload_dir)
                        : model.new_cache(256);
    stats.offloaded_bytes = cache.offloaded_bytes();
    const auto prefill_start = Clock::now();

    // Baked packets first, in order, each realigned to follow the previous one.
    const AssembledContext assembled = assemble_packets(
        model, tokenizer, runtime.cache_info, options.caches, has_bos, options.max_new_tokens + 64,
        cache, [&](Packet& packet) {
            if (!sparse) return;
            if (packet.padded())
                throw UnsupportedError("packet " + kv::quoted(packet.id) +
                                       " keeps different numbers of tokens per head; sparse "
                                       "attention (--attention " +
                                       options.attention +
                                       ") does not handle that yet: use --attention full");
            sparse->add_stored_index(cache.length(), cache.next_position(),
                                     std::move(packet.index));
        });
    stats.cache_load_seconds = assembled.read_seconds;
    stats.cache_bytes_read = assembled.bytes_read;
    if (assembled.bos_added) streamer.push(tokenizer.bos_id());
    // Adapter soft tokens (id -1) have no text.
    for (int32_t id : assembled.tokens)
        if (id >= 0 && id < tokenizer.vocab_size()) streamer.push(id);
    stats.cache_tokens = static_cast<int64_t>(assembled.tokens.size());

    stats.recompute = options.recompute;
    if (options.recompute != "none") {
        if (assembled.packets.empty())
            throw UsageError("--recompute " + options.recompute + " needs --cache packets");
        if (assembled.per_head || sparse)
            throw UnsupportedError(
                "--recompute needs packets that keep the same tokens in every head, decoded with "
                "--attention full");
        std::vector<int64_t> slots;
        std::vector<int32_t> ids;
        const int64_t first_slot = assembled.packets.front().first_slot;
        for (const PlacedPacket& placed : assembled.packets) {
            const int64_t take = options.recompute == "epic"
                                     ? std::min(placed.stored, options.recompute_tokens)
                                     : placed.stored;
            for (int64_t slot = placed.first_slot; slot < placed.first_slot + take; ++slot) {
                const int32_t id = assembled.tokens[static_cast<std::size_t>(slot - first_slot)];
                if (id < 0)
                    throw UnsupportedError(
                        "--recompute needs packets baked without an adapter: "
                        "soft tokens have no token id to recompute from");
                slots.push_back(slot);
                ids.push_back(id);
            }
        }
        stats.recomputed_per_layer =
            model.recompute(cache, torch::tensor(slots, torch::kInt64), ids,
                            options.recompute == "cacheblend" ? options.recompute_ratio : 1.0, 1);
    }

    torch::Tensor logits;
    if (!options.document.empty()) {
        std::vector<int32_t> document;
        if (has_bos) document.push_back(tokenizer.bos_id());
        for (int32_t id : tokenizer.encode(options.document))
            document.push_back(id);
        stats.document_tokens = static_cast<int64_t>(document.size());
        if (stats.document_tokens >= context)
            throw MismatchError("the document is " + std::to_string(stats.document_tokens) +
                                " tokens, the model's context is " + std::to_string(context));
        for (int32_t id : document)
            streamer.push(id);
        const auto document_start = Clock::now();
        cache.reserve(stats.document_tokens + options.max_new_tokens + 64);
        if (sparse && sparse_options.method == SparseMethod::icecache && !model.device().is_cpu()) {
            // The layers compute on the accelerator while the host indexes the finished ones.
            IndexWorker worker(*sparse, cache);
            logits = model.prefill_by_layer(document, cache, options.prefill_chunk,
                                            [&](int64_t layer) { worker.layer_done(layer); });
            const auto wait_start = Clock::now();
            worker.finish();
            stats.index_wait_seconds = seconds_since(wait_start);
        } else if (sparse && sparse_options.method == SparseMethod::icecache) {
            // On the host the prefill already keeps every core busy: a worker thread only
            // competed with it (scripts/bench-document, when the worker ran on the CPU too:
            // 0.90x at 2k tokens, 0.88x at 8k, one run each), so each layer is indexed on all
            // cores as soon as it is done.
            logits = model.prefill_by_layer(
                document, cache, options.prefill_chunk,
                [&](int64_t layer) { sparse->prepare_layer(layer, cache.keys(layer)); });
        } else {
            logits = model.prefill_by_layer(document, cache, options.prefill_chunk);
        }
        stats.document_seconds = seconds_since(document_start);
    }

    std::vector<int32_t> prompt;
    if (cache.length() == 0 && has_bos) prompt.push_back(tokenizer.bos_id());
    prompt.insert(prompt.end(), prompt_ids.begin(), prompt_ids.end());
    if (prompt.empty() && options.document.empty())
        throw UsageError("the prompt is empty and the tokenizer has no BOS token to start from");
    stats.prompt_tokens = static_cast<int64_t>(prompt.size());
    if (cache.next_position() + stats.prompt_tokens >= context)
        throw MismatchError(
            "the prompt is " + std::to_string(stats.prompt_tokens) + " tokens" +
            (cache.length() ? " after " + std::to_string(cache.next_position()) + " cached" : "") +
            ", the model's context is " + std::to_string(context));

    if (options.echo) emit(options.prompt);
    cache.reserve(cache.length() + stats.prompt_tokens + options.max_new_tokens + 1);
    // The streamer applies the leading-space rule after BOS; prompt text was emitted as typed.
    for (int32_t id : prompt)
        streamer.push(id);

    const auto prompt_start = Clock::now();
    // The indexes of an offloaded cache are restored before the prompt goes through the sparse
    // attention, so that they keep their keys on disk too (SparseAttention::prepare).
    if (sparse && offload_to_disk) sparse->prepare(cache);
    // Without a prompt (a document alone) decoding continues from the document's logits.
    // An offloaded cache goes through the sparse attention for the prompt too: a dense prefill
    // would read every page of the context.
    if (!prompt.empty() && sparse && (options.sparse_prompt || offload_to_disk)) {
        for (std::size_t i = 0; i < prompt.size(); ++i)
            logits = model.prefill(std::span<const int32_t>(prompt).subspan(i, 1), cache, 1,
                                   sparse.get());
    } else if (!prompt.empty()) {
        logits = model.prefill(prompt, cache, options.prefill_chunk);
    }
    // Restoring the stored indexes is setup: it belongs to the time to first token, not to
    // the first decoding step.
    if (sparse) sparse->prepare(cache);
    cache.release_pages();
    stats.prefill_seconds = seconds_since(prompt_start);
    stats.total_context_tokens = cache.next_position();
    stats.stop_reason = "length";

    Clock::time_point decode_start;
    int32_t token_buffer[1];
    while (stats.generated_tokens < options.max_new_tokens) {
        const int32_t next = sampler.sample(as_span(logits));
        if (stats.generated_tokens == 0) {
            stats.time_to_first_token_seconds = seconds_since(prefill_start);
            decode_start = Clock::now();
        }
        if (!options.ignore_eos && tokenizer.is_end_of_generation(next)) {
            stats.stop_reason = "eos";
            break;
        }
        ++stats.generated_tokens;
        // Models may have more rows than the tokenizer has tokens (padding to a round size);
        // such ids have no text.
        const std::string text =
            next < tokenizer.vocab_size() ? streamer.push(next) : std::string();
        if (!text.empty()) emit(text);
        if (stats.generated_tokens == options.max_new_tokens) break;
        if (cache.next_position() >= context) {
            stats.stop_reason = "context";
            break;
        }
        token_buffer[0] = next;
        logits = model.prefill(std::span<const int32_t>(token_buffer, 1), cache, 1, sparse.get());
    }
    const std::string rest = streamer.finish();
    if (!rest.empty()) emit(rest);
    if (stats.generated_tokens > 1) {
        stats.decode_seconds = seconds_since(decode_start);
        stats.time_per_output_token_seconds =
            stats.decode_seconds / static_cast<double>(stats.generated_tokens - 1);
        stats.decode_tokens_per_second =
            static_cast<double>(stats.generated_tokens - 1) / stats.decode_seconds;
    }
    if (sparse) {
        const SparseStats& sparse_stats = sparse->stats();
        // Only measured recall is reported; a layer with no sparse step (dense) attends to
        // every token, so its recall is exactly 1.
        for (std::size_t layer = 0;
             options.measure_recall && layer < sparse_stats.recall_sum.size(); ++layer)
            stats.attention_recall.push_back(
                sparse_stats.recall_count[layer] > 0
                    ? sparse_stats.recall_sum[layer] /
                          static_cast<double>(sparse_stats.recall_count[layer])
                    : 1.0);
        if (sparse_stats.selections > 0)
            stats.attended_tokens = static_cast<double>(sparse_stats.selected_tokens) /
                                    static_cast<double>(sparse_stats.selections);
        stats.index_dot_products = sparse_stats.index_dot_products;
        stats.indexed_tokens = sparse_stats.indexed_tokens;
        stats.index_seconds = sparse_stats.index_seconds;
        stats.select_seconds = sparse_stats.select_seconds;
        stats.offloaded_bytes += sparse_stats.offloaded_index_bytes;
    }
    if (stats.prefill_seconds > 0)
        stats.prefill_tokens_per_second =
            static_cast<double>(stats.prompt_tokens) / stats.prefill_seconds;
    return stats;
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
        result.set("index_dot_products", stats.index_dot_products);
        result.set("indexed_tokens", stats.indexed_tokens);
        result.set("index_seconds", stats.index_seconds);
        result.set("select_seconds", stats.select_seconds);
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
