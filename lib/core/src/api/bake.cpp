#include "kv/api/bake.hpp"

#include "kv/api/chat.hpp"
#include "kv/documents.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/model/adapter.hpp"
#include "kv/model/compress.hpp"
#include "kv/model/packets.hpp"
#include "kv/output_path.hpp"
#include "kv/runtime.hpp"
#include "kv/sha256.hpp"
#include "runtime.hpp"

#include <chrono>
#include <memory>
#include <optional>

namespace kv {
namespace {

using Clock = std::chrono::steady_clock;

struct Tokenized {
    const Document* document;
    std::vector<int32_t> ids;
};

struct BakeAdapter {
    AdapterTensors tensors;
    std::string fingerprint;
    int64_t header_tokens = 0;
    int64_t trailer_tokens = 0;
};

// Bakes `batch` (documents whose tokens add up to at most batch_tokens, or one longer document)
// and hands each packet to the writer, in input order.
void bake_batch(const Model& model, const std::vector<Tokenized>& batch,
                const CacheModelInfo& cache_info, int64_t chunk, const BakeAdapter* adapter,
                const CompressionSettings* compress, CacheWriter& writer, int64_t& stored_tokens) {
    torch::NoGradGuard no_grad;
    const int64_t wrapping = adapter ? adapter->header_tokens + adapter->trailer_tokens : 0;
    int64_t total = 0;
    for (const Tokenized& item : batch)
        total += static_cast<int64_t>(item.ids.size()) + wrapping;
    KvCache cache = model.new_cache(total);
    std::unique_ptr<QueryRecorder> recorder;
    if (compress && compression_needs_queries(compress->method)) {
        if (batch.size() != 1)
            throw Error("bake: query-aware compression bakes one document at a time");
        recorder = std::make_unique<QueryRecorder>(*compress, model.rope(), cache_info.num_layers);
    }
    if (batch.size() == 1) {
        const torch::Tensor embeddings =
            wrap_document(model, adapter ? &adapter->tensors : nullptr, batch.front().ids);
        // In chunks from position 0, as prefill() does, to bound the attention's memory.
        for (int64_t begin = 0; begin < total; begin += chunk) {
            const int64_t count = std::min(chunk, total - begin);
            model.forward(embeddings.narrow(0, begin, count),
                          torch::arange(begin, begin + count, torch::kInt64), cache, {}, nullptr,
                          recorder.get());
        }
    } else {
        std::vector<torch::Tensor> embeddings;
        std::vector<int64_t> positions;
        torch::Tensor allow = torch::zeros({total, total}, torch::kBool);
        int64_t begin = 0;
        for (const Tokenized& item : batch) {
            embeddings.push_back(
                wrap_document(model, adapter ? &adapter->tensors : nullptr, item.ids));
            const int64_t count = embeddings.back().size(0);
            for (int64_t i = 0; i < count; ++i)
                positions.push_back(i);
            allow.narrow(0, begin, count).narrow(1, begin, count).fill_(true);
            begin += count;
        }
        model.forward(torch::cat(embeddings), torch::tensor(positions, torch::kInt64), cache,
                      allow);
    }
    int64_t begin = 0;
    for (const Tokenized& item : batch) {
        const int64_t count = static_cast<int64_t>(item.ids.size()) + wrapping;
        Packet packet;
        packet.id = item.document->id;
        packet.text_sha256 = sha256_hex(item.document->text);
        if (adapter) {
            // Soft tokens have no vocabulary id (formats/kvcache.md 6.2).
            packet.token_ids.assign(static_cast<std::size_t>(adapter->header_tokens), -1);
            packet.token_ids.insert(packet.token_ids.end(), item.ids.begin(), item.ids.end());
            packet.token_ids.insert(packet.token_ids.end(),
                                    static_cast<std::size_t>(adapter->trailer_tokens), -1);
            packet.adapter_fingerprint = adapter->fingerprint;
            packet.header_tokens = adapter->header_tokens;
            packet.trailer_tokens = adapter->trailer_tokens;
        } else {
            packet.token_ids = item.ids;
        }
        packet.positions.resize(static_cast<std::size_t>(count));
        for (int64_t i = 0; i < count; ++i)
            packet.positions[i] = i;
        packet.logical_length = count;
        copy_cache_to_packet(cache, begin, count, cache_info.dtype, packet);
        if (compress)
            packet = compress_packet(packet, cache_info, model.rope(), *compress, recorder.get());
        stored_tokens += packet.stored_length();
        writer.add(packet);
        begin += count;
    }
}

}  // namespace

BakeReport bake(const BakeOptions& options) {
    if (options.shard_count < 1 || options.shard_index < 0 ||
        options.shard_index >= options.shard_count)
        throw UsageError("invalid shard " + std::to_string(options.shard_index) + "/" +
                         std::to_string(options.shard_count) + " (expected I/N with 0 <= I < N)");
    if (options.batch_tokens < 1) throw UsageError("batch tokens must be positive");
    if (options.inputs.empty()) throw UsageError("no input documents");
    set_compute_threads(options.threads);
    if (options.compress) validate_compression_settings(*options.compress);
    const bool one_per_batch =
        options.compress && compression_needs_queries(options.compress->method);

    if (options.append && options.output == "-")
        throw UsageError("--append needs an output file (-o FILE), not standard output");
    // Before any work: an output that is one of the inputs would destroy it (the store of
    // --append is the output by design, rewritten under its lock below).
    {
        std::vector<std::filesystem::path> inputs(options.inputs.begin(), options.inputs.end());
        if (options.adapter) inputs.push_back(*options.adapter);
        if (options.tokenizer) inputs.push_back(*options.tokenizer);
        for (const std::filesystem::path& file : model_input_files(options.model))
            inputs.push_back(file);
        refuse_output_among_inputs(options.output, inputs);
    }
    BakeReport report;
    // Read and check everything before the model loads: a bad input fails in a second.
    const DocumentProblems problems{options.keep_going ? &report.skipped : nullptr};
    const std::vector<Document> all_documents = read_documents(options.inputs, problems.sink);

    // The lock is held from before the store is read until its replacement is in place.
    std::optional<CacheFileLock> store_lock;
    std::unique_ptr<CacheReader> store;
    if (options.append) {
        store_lock.emplace(options.output);
        if (store_lock->locked()) store = std::make_unique<CacheReader>(options.output);
    }
    const bool bake_preamble = options.chat_preamble && options.shard_index == 0;
    if (bake_preamble) {
        for (const Document& document : all_documents)
            if (document.id == chat_preamble_packet_id)
                throw UsageError(describe(document) + " has the id " +
                                 quoted(chat_preamble_packet_id) +
                                 ", which --chat-preamble gives the chat template's start");
        if (store && store->has_packet(chat_preamble_packet_id))
            throw MismatchError(store->source() + " already holds a " +
                                quoted(chat_preamble_packet_id) + " packet");
    }
    std::vector<const Document*> documents;
    for (std::size_t i = 0; i < all_documents.size(); ++i) {
        if (static_cast<int64_t>(i) % options.shard_count != options.shard_index) continue;
        const Document& document = all_documents[i];
        if (store && store->has_packet(document.id)) {
            problems.report(
                MismatchError(describe(document) + " is already in " + store->source()));
            continue;
        }
        documents.push_back(&document);
    }

    const Runtime runtime = load_runtime(
        {options.model, options.tokenizer, options.dtype, options.device, options.use_mmap});
    const Model& model = *runtime.model;
    const Tokenizer& tokenizer = *runtime.tokenizer;
    if (store) {
        try {
            check_compatible(runtime.cache_info, store->model(), store->source());
        } catch (const MismatchError& error) {
            throw MismatchError("cannot append to " + store->source() + ": " + error.what());
        }
    }
    std::optional<BakeAdapter> adapter;
    if (options.adapter) {
        const Adapter loaded = load_adapter(*options.adapter, model, runtime.cache_info);
        adapter = BakeAdapter{adapter_tensors(loaded, model.device()), loaded.fingerprint(),
                              loaded.header_tokens(), loaded.trailer_tokens()};
    }
    // The chat template's start, as kvserve-once --chat and kvtrain --chat-preamble render it.
    std::optional<ChatPreambleTokens> chat;
    Document preamble_document;
    if (bake_preamble) {
        chat = chat_preamble_tokens(
            model_chat_template(options.model, options.tokenizer, std::nullopt, "--chat-preamble"),
            tokenizer, options.system);
        if (chat->before.empty())
            throw UnsupportedError(
                "--chat-preamble: the model's chat template writes nothing before the user's "
                "message");
        preamble_document =
            Document{chat_preamble_packet_id, chat->text.before, "the chat template's start"};
    }
    const int64_t wrapping = adapter ? adapter->header_tokens + adapter->trailer_tokens : 0;
    const int64_t context = model.config().max_position_embeddings - wrapping;
    // A wrapped document starts with the header, its attention sink, never with BOS.
    const bool with_bos =
        !adapter && options.add_bos && tokenizer.add_bos() && tokenizer.bos_id() >= 0;

    const auto start = Clock::now();
    std::vector<Tokenized> tokenized;
    for (const Document* document : documents) {
        Tokenized item{document, {}};
        if (with_bos) item.ids.push_back(tokenizer.bos_id());
        for (int32_t id : tokenizer.encode(document->text))
            item.ids.push_back(id);
        if (item.ids.empty() || (with_bos && item.ids.size() == 1)) {
            problems.report(FormatError(describe(*document) + " is empty"));
            continue;
        }
        if (static_cast<int64_t>(item.ids.size()) > context) {
            if (!options.truncate) {
                problems.report(
                    MismatchError(describe(*document) + " is " + std::to_string(item.ids.size()) +
                                  " tokens, the model's context is " + std::to_string(context) +
                                  (wrapping ? " beside the adapter's soft tokens" : "") +
                                  " (--truncate cuts it)"));
                continue;
            }
            item.ids.resize(static_cast<std::size_t>(context));
            ++report.truncated;
        }
        tokenized.push_back(std::move(item));
    }
    if (tokenized.empty() && !report.skipped.empty() && !options.append)
        throw FormatError("no document left to bake: all " + std::to_string(report.skipped.size()) +
                          " were skipped (first: " + report.skipped.front() + ")");

    CacheWriteOptions write = options.write;
    write.no_replace = options.append && !store;
    CacheWriter writer(options.output, runtime.cache_info, options.provenance, write);
    if (store) {
        // The store as it was, every part kept (its adapter too, when it holds one).
        if (store->has_adapter()) writer.set_adapter(store->read_adapter());
        for (const PacketInfo& info : store->packets())
            writer.add(store->read(info.id));
        report.kept_documents = static_cast<int64_t>(store->packets().size());
    }
    if (chat) {
        // Baked as it is: from position 0, neither wrapped by the adapter nor compressed.
        const std::vector<Tokenized> preamble{Tokenized{&preamble_document, chat->before}};
        bake_batch(model, preamble, runtime.cache_info, options.batch_tokens, nullptr, nullptr,
                   writer, report.stored_tokens);
    }
    BakeProgress progress;
    progress.documents_total = static_cast<int64_t>(tokenized.size());
    std::vector<Tokenized> batch;
    int64_t batch_size = 0;
    auto flush = [&] {
        if (batch.empty()) return;
        bake_batch(model, batch, runtime.cache_info, options.batch_tokens,
                   adapter ? &*adapter : nullptr, options.compress ? &*options.compress : nullptr,
                   writer, report.stored_tokens);
        progress.documents_done += static_cast<int64_t>(batch.size());
        progress.tokens_done += batch_size;
        progress.seconds = std::chrono::duration<double>(Clock::now() - start).count();
        if (options.progress) options.progress(progress);
        batch.clear();
        batch_size = 0;
    };
    for (Tokenized& item : tokenized) {
        const int64_t size = static_cast<int64_t>(item.ids.size());
        if (batch_size + size > options.batch_tokens || one_per_batch) flush();
        batch_size += size;
        batch.push_back(std::move(item));
    }
    flush();
    writer.finish();

    report.documents = progress.documents_done;
    report.tokens = progress.tokens_done;
    report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    report.tokens_per_second =
        report.seconds > 0 ? static_cast<double>(report.tokens) / report.seconds : 0;
    return report;
}

ProgressLine progress_line(const BakeProgress& progress) {
    return {format_text("%lld/%lld documents, %lld tokens, %.0f tokens/s",
                        static_cast<long long>(progress.documents_done),
                        static_cast<long long>(progress.documents_total),
                        static_cast<long long>(progress.tokens_done),
                        progress.seconds > 0 ? progress.tokens_done / progress.seconds : 0.0)};
}

json::Value to_json(const BakeReport& report, const BakeOptions& options) {
    json::Value value = json::Value::object();
    value.set("documents", report.documents);
    value.set("tokens", report.tokens);
    value.set("seconds", report.seconds);
    value.set("tokens_per_second", report.tokens_per_second);
    value.set("truncated", report.truncated);
    if (options.compress) {
        value.set("compress", compression_method_name(options.compress->method));
        value.set("stored_tokens", report.stored_tokens);
    }
    json::Value skipped = json::Value::array();
    for (const std::string& problem : report.skipped)
        skipped.push_back(problem);
    value.set("skipped", std::move(skipped));
    if (options.append) value.set("kept_documents", report.kept_documents);
    return value;
}

std::string summary(const BakeReport& report, const BakeOptions& options) {
    std::string extra;
    if (options.append) extra += ", appended to " + std::to_string(report.kept_documents) + " kept";
    if (report.truncated) extra += ", " + std::to_string(report.truncated) + " truncated";
    if (options.compress)
        extra += ", compressed by " +
                 std::string(compression_method_name(options.compress->method)) + " to " +
                 std::to_string(report.stored_tokens) + " tokens per head";
    if (!report.skipped.empty()) extra += ", " + std::to_string(report.skipped.size()) + " skipped";
    return format_text("%lld documents, %lld tokens in %.2f s (%.0f tokens/s)",
                       static_cast<long long>(report.documents),
                       static_cast<long long>(report.tokens), report.seconds,
                       report.tokens_per_second) +
           extra;
}

}  // namespace kv
