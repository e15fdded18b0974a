#include "kv/api/train.hpp"

#include "kv/api/chat.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/json.hpp"
#include "kv/mapped_file.hpp"
#include "kv/model/adapter.hpp"
#include "kv/model/distill.hpp"
#include "kv/runtime.hpp"
#include "kv/sha256.hpp"
#include "runtime.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

namespace kv {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---------------------------------------------------------------------------------------------
// The teacher: the frozen model's greedy answer from the whole context, with its most likely
// next tokens at every answer step.

// The teacher file: one header line naming what the answers depend on, then one record per
// sample, appended as soon as it is answered, so that an interrupted run loses at most the
// sample in progress. A record: 'R', u32 payload size, the payload, SHA-256 of the payload. The
// payload: the sample's 32-byte key, u32 answer length n, u32 k, n i32 tokens, n*k i32
// candidates, n*k f32 log-probabilities (little-endian). A torn or damaged tail is cut off.
class TeacherFile {
  public:
    TeacherFile(std::filesystem::path path, std::string header)
        : path_(std::move(path)), header_(std::move(header)) {
        std::error_code error;
        if (std::filesystem::exists(path_, error)) load();
        file_ = std::fopen(path_.c_str(), answers_.empty() && !exists_ ? "wb" : "ab");
        if (!file_)
            throw IoError("cannot open teacher file " + kv::quoted(path_.string()) + ": " +
                          std::strerror(errno));
        if (!exists_) write(header_.data(), header_.size());
        std::fflush(file_);
    }
    ~TeacherFile() {
        if (file_) std::fclose(file_);
    }
    TeacherFile(const TeacherFile&) = delete;
    TeacherFile& operator=(const TeacherFile&) = delete;

    const TeacherAnswer* find(const std::string& key) const {
        const auto found = answers_.find(key);
        return found == answers_.end() ? nullptr : &found->second;
    }

    void add(const std::string& key, TeacherAnswer answer) {
        std::string payload = key;
        auto put = [&](const void* data, std::size_t size) {
            payload.append(static_cast<const char*>(data), size);
        };
        const uint32_t length = static_cast<uint32_t>(answer.tokens.size());
        const uint32_t top_k = static_cast<uint32_t>(answer.top_k);
        put(&length, 4);
        put(&top_k, 4);
        put(answer.tokens.data(), answer.tokens.size() * 4);
        put(answer.candidates.data(), answer.candidates.size() * 4);
        put(answer.log_probabilities.data(), answer.log_probabilities.size() * 4);
        const uint32_t size = static_cast<uint32_t>(payload.size());
        Sha256 hash;
        hash.update(payload);
        const std::array<uint8_t, 32> digest = hash.digest();
        write("R", 1);
        write(&size, 4);
        write(payload.data(), payload.size());
        write(digest.data(), digest.size());
        if (std::fflush(file_) != 0)
            throw IoError("cannot write teacher file " + kv::quoted(path_.string()) + ": " +
                          std::strerror(errno));
        answers_.emplace(key, std::move(answer));
    }

  private:
    void write(const void* data, std::size_t size) {
        if (std::fwrite(data, 1, size, file_) != size)
            throw IoError("cannot write teacher file " + kv::quoted(path_.string()) + ": " +
                          std::strerror(errno));
    }

    void load() {
        std::ifstream in(path_, std::ios::binary);
        if (!in)
            throw IoError("cannot read teacher file " + kv::quoted(path_.string()) + ": " +
                          std::strerror(errno));
        std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        if (bytes.compare(0, header_.size(), header_) != 0) {
            const std::string found = bytes.substr(0, bytes.find('\n'));
            throw MismatchError("teacher file " + kv::quoted(path_.string()) +
                                " holds answers for other settings (" + kv::quoted(found) +
                                "): remove it, or name another with --teacher-file");
        }
        exists_ = true;
        std::size_t at = header_.size();
        while (at < bytes.size()) {
            auto fits = [&](std::size_t size) { return size <= bytes.size() - at; };
            if (!fits(5) || bytes[at] != 'R') break;
            uint32_t size = 0;
            std::memcpy(&size, bytes.data() + at + 1, 4);
            at += 5;
            if (size < 40 || !fits(std::size_t{size} + 32)) break;
            const std::string payload = bytes.substr(at, size);
            Sha256 hash;
            hash.update(payload);
            const std::array<uint8_t, 32> digest = hash.digest();
            if (std::memcmp(digest.data(), bytes.data() + at + size, 32) != 0) break;
            uint32_t length = 0, top_k = 0;
            std::memcpy(&length, payload.data() + 32, 4);
            std::memcpy(&top_k, payload.data() + 36, 4);
            const std::size_t expected =
                40 + std::size_t{length} * 4 + 2 * std::size_t{length} * top_k * 4;
            if (expected != size) break;
            TeacherAnswer answer;
            answer.top_k = top_k;
            answer.tokens.resize(length);
            answer.candidates.resize(std::size_t{length} * top_k);
            answer.log_probabilities.resize(std::size_t{length} * top_k);
            const char* p = payload.data() + 40;
            std::memcpy(answer.tokens.data(), p, length * 4);
            p += length * 4;
            std::memcpy(answer.candidates.data(), p, answer.candidates.size() * 4);
            p += answer.candidates.size() * 4;
            std::memcpy(answer.log_probabilities.data(), p, answer.log_probabilities.size() * 4);
            answers_.emplace(payload.substr(0, 32), std::move(answer));
            at += std::size_t{size} + 32;
            valid_end_ = at;
        }
        if (valid_end_ == 0) valid_end_ = header_.size();
        // A torn record at the end (an interrupted run) is cut off before appending.
        if (valid_end_ < bytes.size() && ::truncate(path_.c_str(), static_cast<off_t>(valid_end_)))
            throw IoError("cannot repair teacher file " + kv::quoted(path_.string()) + ": " +
                          std::strerror(errno));
    }

    std::filesystem::path path_;
    std::string header_;
    std::map<std::string, TeacherAnswer> answers_;
    std::FILE* file_ = nullptr;
    bool exists_ = false;
    std::size_t valid_end_ = 0;
};

struct Prepared {
    std::vector<std::vector<int32_t>> documents;  // each tokenized alone, no BOS
    std::vector<int32_t> question;
    std::string key;  // 32 raw bytes: SHA-256 of the token ids
    const TeacherAnswer* teacher = nullptr;
};

TeacherAnswer answer_greedily(const Model& model, const Tokenizer& tokenizer,
                              const std::vector<int32_t>& prompt, const TrainOptions& options) {
    torch::NoGradGuard no_grad;
    KvCache cache = model.new_cache(static_cast<int64_t>(prompt.size()) + options.answer_tokens);
    torch::Tensor logits = model.prefill(prompt, cache);
    TeacherAnswer answer;
    const int64_t vocab = logits.size(0);
    answer.top_k = options.teacher_top_k <= 0 ? vocab : std::min(options.teacher_top_k, vocab);
    for (int64_t step = 0; step < options.answer_tokens; ++step) {
        const torch::Tensor log_probabilities = torch::log_softmax(logits.to(torch::kFloat32), 0);
        const auto [values, indices] = log_probabilities.topk(answer.top_k);
        const int32_t next = static_cast<int32_t>(indices[0].item<int64_t>());
        const torch::Tensor ids = indices.to(torch::kInt32).contiguous();
        const torch::Tensor kept = values.contiguous();
        answer.candidates.insert(answer.candidates.end(), ids.data_ptr<int32_t>(),
                                 ids.data_ptr<int32_t>() + answer.top_k);
        answer.log_probabilities.insert(answer.log_probabilities.end(), kept.data_ptr<float>(),
                                        kept.data_ptr<float>() + answer.top_k);
        answer.tokens.push_back(next);
        if (tokenizer.is_end_of_generation(next)) break;
        if (options.answer_stop == AnswerStop::newline && next < tokenizer.vocab_size() &&
            tokenizer.token_bytes(next).find('\n') != std::string::npos)
            break;
        if (step + 1 == options.answer_tokens) break;
        const int32_t token = next;
        logits = model.prefill(std::span<const int32_t>(&token, 1), cache, 1);
    }
    return answer;
}

// ---------------------------------------------------------------------------------------------
// The student and its loss.

// The student's answer-token logits: the documents as packets (kvbake + kvpack), then the
// question and the teacher's answer but its last token (teacher forcing).
torch::Tensor student_logits(const Model& model, const AdapterTensors& adapter,
                             std::span<const int32_t> preamble, const Prepared& sample) {
    const PacketContext context = packet_context(model, &adapter, preamble, sample.documents);
    std::vector<int32_t> tail = sample.question;
    const std::vector<int32_t>& answer = sample.teacher->tokens;
    tail.insert(tail.end(), answer.begin(), answer.end() - 1);
    const int64_t count = static_cast<int64_t>(tail.size());
    const torch::Tensor positions =
        torch::arange(context.next_position, context.next_position + count, torch::kInt64);
    const torch::Tensor hidden = model.forward_sequence(model.embed(tail), positions, {}, nullptr,
                                                        &context.keys_values, context.positions);
    const int64_t answer_length = static_cast<int64_t>(answer.size());
    // The LM head only where the loss needs it.
    return model.logits(hidden.narrow(0, count - answer_length, answer_length));
}

// A permutation of [0, count) that depends only on the seed (std::shuffle's algorithm is the
// library's choice; this one is fixed, so that a resumed run sees the same order).
std::vector<std::size_t> sample_order(std::size_t count, uint64_t seed) {
    std::vector<std::size_t> order(count);
    for (std::size_t i = 0; i < count; ++i)
        order[i] = i;
    std::mt19937_64 generator(seed);
    for (std::size_t i = count; i > 1; --i)
        std::swap(order[i - 1], order[generator() % i]);
    return order;
}

}  // namespace

std::vector<TrainSample> read_train_samples(const std::filesystem::path& path,
                                            std::string* sha256) {
    const std::string text = read_file_text(path);
    if (sha256) *sha256 = sha256_hex(text);
    std::istringstream in(text);
    std::vector<TrainSample> samples;
    std::string line;
    int64_t number = 0;
    while (std::getline(in, line)) {
        ++number;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        const std::string origin = kv::quoted(path.string()) + " line " + std::to_string(number);
        TrainSample sample;
        sample.origin = origin;
        try {
            const json::Value root = json::parse(line);
            if (!root.is_object()) throw FormatError("not a JSON object");
            const json::Value* documents = root.find("documents");
            if (!documents || !documents->is_array() || documents->as_array().empty())
                throw FormatError("\"documents\" must be a non-empty array of strings");
            for (const json::Value& document : documents->as_array()) {
                if (!document.is_string())
                    throw FormatError("\"documents\" must be a non-empty array of strings");
                sample.documents.push_back(document.as_string());
            }
            const json::Value* question = root.find("question");
            if (!question || !question->is_string() || question->as_string().empty())
                throw FormatError("\"question\" must be a non-empty string");
            sample.question = question->as_string();
        } catch (const Error& error) {
            throw FormatError(origin + ": " + error.what());
        }
        samples.push_back(std::move(sample));
    }
    if (samples.empty()) throw FormatError(kv::quoted(path.string()) + " holds no samples");
    return samples;
}

TrainReport train_adapter(const TrainOptions& options) {
    if (options.epochs < 1) throw UsageError("epochs must be at least 1");
    if (options.batch < 1) throw UsageError("the batch must hold at least one sample");
    if (options.answer_tokens < 1) throw UsageError("answer tokens must be at least 1");
    if (!(options.learning_rate > 0) || !std::isfinite(options.learning_rate))
        throw UsageError("the learning rate must be positive");
    if (options.output == "-")
        throw UsageError(
            "kvtrain writes its adapter to a file (-o FILE), which is also its "
            "checkpoint, not to standard output");
    set_compute_threads(options.threads);
    std::string data_sha256;
    const std::vector<TrainSample> samples = read_train_samples(options.data, &data_sha256);

    const Runtime runtime = load_runtime(
        {options.model, options.tokenizer, options.dtype, options.device, options.use_mmap});
    const Model& model = *runtime.model;
    const Tokenizer& tokenizer = *runtime.tokenizer;
    const int64_t context_limit = model.config().max_position_embeddings;

    // KV Packet's preamble: BOS alone, or the chat template's start (and the end of the user's
    // turn after each question).
    std::vector<int32_t> preamble;
    std::string text_before, question_tail;
    if (options.chat_preamble) {
        const ChatPreambleTokens chat = chat_preamble_tokens(
            model_chat_template(options.model, options.tokenizer, std::nullopt, "--chat-preamble"),
            tokenizer, options.system);
        preamble = chat.before;
        text_before = chat.text.before;
        question_tail = chat.text.after;
    } else if (tokenizer.add_bos() && tokenizer.bos_id() >= 0) {
        preamble.push_back(tokenizer.bos_id());
    }

    // The settings a checkpoint must share to be resumed.
    json::Value settings = json::Value::object();
    settings.set("data_sha256", data_sha256);
    settings.set("samples", static_cast<int64_t>(samples.size()));
    settings.set("epochs", options.epochs);
    settings.set("batch", options.batch);
    settings.set("learning_rate", options.learning_rate);
    settings.set("answer_tokens", options.answer_tokens);
    settings.set("answer_stop", options.answer_stop == AnswerStop::eos ? "eos" : "newline");
    settings.set("teacher_top_k", options.teacher_top_k);
    settings.set("seed", static_cast<int64_t>(options.seed));
    if (options.chat_preamble) {
        // the preamble as the template rendered it: another template or system message is
        // another training (and the adapter file says which it was trained with)
        json::Value chat = json::Value::object();
        chat.set("system", options.system);
        chat.set("before", text_before);
        chat.set("after", question_tail);
        settings.set("chat_preamble", std::move(chat));
    }

    Adapter adapter;
    int64_t step = 0;
    if (options.resume) {
        std::error_code error;
        if (!std::filesystem::exists(options.output, error))
            throw UsageError("--resume: " + kv::quoted(options.output.string()) +
                             " does not exist (run without --resume to start)");
        adapter = load_adapter(options.output, model, runtime.cache_info);
        if (!adapter.has_optimizer_state())
            throw FormatError("--resume: " + kv::quoted(options.output.string()) +
                              " holds no optimizer state to resume from");
        const json::Value recorded = json::parse(adapter.training);
        const json::Value* before = recorded.find("settings");
        if (!before || json::dump(*before) != json::dump(settings))
            throw MismatchError("--resume: " + kv::quoted(options.output.string()) +
                                " was trained with other data or settings (" +
                                (before ? json::dump(*before) : std::string("none recorded")) +
                                "); run without --resume to start again");
        step = adapter.optimizer_step;
        if (adapter.header_tokens() != options.header_tokens ||
            adapter.trailer_tokens() != options.trailer_tokens)
            throw MismatchError("--resume: the checkpoint has " +
                                std::to_string(adapter.header_tokens()) + " + " +
                                std::to_string(adapter.trailer_tokens()) + " soft tokens, not " +
                                std::to_string(options.header_tokens) + " + " +
                                std::to_string(options.trailer_tokens));
    } else {
        adapter =
            initialize_adapter(model, options.header_tokens, options.trailer_tokens, options.seed);
    }

    TrainReport report;
    report.samples = static_cast<int64_t>(samples.size());

    // Tokenize, and answer each sample from the whole context (once; kept in the teacher file).
    const std::filesystem::path teacher_path =
        options.teacher_file ? *options.teacher_file
                             : std::filesystem::path(options.output.string() + ".teacher");
    TeacherFile teacher_file(
        teacher_path, "kvtools-teacher 1 model=" + runtime.cache_info.model_fingerprint +
                          " tokenizer=" + runtime.cache_info.tokenizer_fingerprint +
                          " dtype=" + dtype_name(model.dtype()) +
                          " answer_tokens=" + std::to_string(options.answer_tokens) +
                          " stop=" + (options.answer_stop == AnswerStop::eos ? "eos" : "newline") +
                          " top_k=" + std::to_string(options.teacher_top_k) + "\n");
    std::vector<Prepared> prepared(samples.size());
    const auto teacher_start = Clock::now();
    for (std::size_t i = 0; i < samples.size(); ++i) {
        Prepared& item = prepared[i];
        std::vector<int32_t> prompt = preamble;
        for (const std::string& text : samples[i].documents) {
            item.documents.push_back(tokenizer.encode(text));
            if (item.documents.back().empty())
                throw FormatError(samples[i].origin + ": a document is empty");
            // The teacher reads exactly the tokens the packets hold, so that the two differ
            // only in how the documents see each other.
            prompt.insert(prompt.end(), item.documents.back().begin(), item.documents.back().end());
        }
        item.question = tokenizer.encode(samples[i].question + question_tail);
        prompt.insert(prompt.end(), item.question.begin(), item.question.end());
        const int64_t wrapped = static_cast<int64_t>(prompt.size()) +
                                static_cast<int64_t>(item.documents.size()) *
                                    (options.header_tokens + options.trailer_tokens) +
                                options.answer_tokens;
        if (wrapped > context_limit)
            throw MismatchError(samples[i].origin + ": " + std::to_string(wrapped) +
                                " tokens with soft tokens and answer, the model's context is " +
                                std::to_string(context_limit));
        Sha256 hash;
        hash.update(prompt.data(), prompt.size() * sizeof(int32_t));
        const std::array<uint8_t, 32> digest = hash.digest();
        item.key.assign(reinterpret_cast<const char*>(digest.data()), digest.size());
        item.teacher = teacher_file.find(item.key);
        if (item.teacher) {
            ++report.teacher_reused;
        } else {
            teacher_file.add(item.key, answer_greedily(model, tokenizer, prompt, options));
            item.teacher = teacher_file.find(item.key);
            ++report.teacher_answered;
        }
        report.answer_tokens += static_cast<int64_t>(item.teacher->tokens.size());
        if (options.progress)
            options.progress({"teacher", static_cast<int64_t>(i + 1),
                              static_cast<int64_t>(samples.size()), 0, 0,
                              seconds_since(teacher_start)});
    }
    report.teacher_seconds = seconds_since(teacher_start);

    // Training.
    const int64_t count = static_cast<int64_t>(samples.size());
    const int64_t steps_per_epoch = (count + options.batch - 1) / options.batch;
    const int64_t total_steps = steps_per_epoch * options.epochs;
    report.total_steps = total_steps;
    const torch::Device device = model.device();
    const int64_t width = adapter.hidden_size;
    AdapterTensors tensors = adapter_tensors(adapter, device);
    tensors.header.set_requires_grad(true);
    tensors.trailer.set_requires_grad(true);
    AdamW header_optimizer, trailer_optimizer;
    if (adapter.has_optimizer_state()) {
        header_optimizer = {float_rows(adapter.header_moment, width, device),
                            float_rows(adapter.header_second_moment, width, device)};
        trailer_optimizer = {float_rows(adapter.trailer_moment, width, device),
                             float_rows(adapter.trailer_second_moment, width, device)};
    } else {
        header_optimizer = {torch::zeros_like(tensors.header), torch::zeros_like(tensors.header)};
        trailer_optimizer = {torch::zeros_like(tensors.trailer),
                             torch::zeros_like(tensors.trailer)};
    }
    json::Value history = json::Value::array();
    if (options.resume) {
        const json::Value recorded = json::parse(adapter.training);
        if (const json::Value* losses = recorded.find("loss_per_step")) history = *losses;
    }

    auto save = [&] {
        store_adapter_tensors(tensors, adapter);
        adapter.optimizer_step = step;
        adapter.header_moment = float_values(header_optimizer.moment);
        adapter.header_second_moment = float_values(header_optimizer.second_moment);
        adapter.trailer_moment = float_values(trailer_optimizer.moment);
        adapter.trailer_second_moment = float_values(trailer_optimizer.second_moment);
        json::Value training = json::Value::object();
        training.set("tool", options.provenance.tool);
        training.set("settings", settings);
        training.set("step", step);
        training.set("total_steps", total_steps);
        training.set("loss_per_step", history);
        adapter.training = json::dump(training);
        CacheWriter writer(options.output, runtime.cache_info, options.provenance);
        writer.set_adapter(adapter);
        writer.finish();
    };

    const auto train_start = Clock::now();
    int64_t steps_this_run = 0;
    while (step < total_steps && (options.max_steps <= 0 || steps_this_run < options.max_steps)) {
        const int64_t epoch = step / steps_per_epoch;
        const int64_t batch_index = step % steps_per_epoch;
        const std::vector<std::size_t> order =
            sample_order(samples.size(), options.seed + static_cast<uint64_t>(epoch));
        const int64_t first = batch_index * options.batch;
        const int64_t last = std::min(count, first + options.batch);
        double loss_sum = 0;
        int64_t tokens = 0;
        for (int64_t i = first; i < last; ++i) {
            const Prepared& sample = prepared[order[static_cast<std::size_t>(i)]];
            const torch::Tensor logits = student_logits(model, tensors, preamble, sample);
            const torch::Tensor loss = distillation_loss(logits, *sample.teacher);
            // Summed over samples, not averaged, as the KV Packet authors do.
            loss.backward();
            loss_sum += loss.item<double>();
            tokens += static_cast<int64_t>(sample.teacher->tokens.size());
        }
        // Linear decay to 0 over the whole run, no warm-up (torch LinearLR, 1.0 to 0.0).
        const double learning_rate =
            options.learning_rate *
            (1.0 - static_cast<double>(step) / static_cast<double>(total_steps));
        ++step;
        ++steps_this_run;
        // An empty header or trailer (--header 0) gets no gradient at all.
        for (auto [parameter, optimizer] : {std::pair{&tensors.header, &header_optimizer},
                                            std::pair{&tensors.trailer, &trailer_optimizer}}) {
            if (!parameter->grad().defined()) continue;
            optimizer->step(*parameter, parameter->grad(), step, learning_rate);
            parameter->mutable_grad().zero_();
        }
        const double loss_per_token = tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0;
        if (!std::isfinite(loss_per_token))
            throw Error("training diverged at step " + std::to_string(step) +
                        " (the loss is not finite); the last checkpoint is kept");
        history.push_back(loss_per_token);
        if (steps_this_run == 1) report.first_loss = loss_per_token;
        report.last_loss = loss_per_token;
        if (options.progress)
            options.progress({"train", step, total_steps, epoch + 1, loss_per_token,
                              seconds_since(train_start)});
        if (options.checkpoint_every > 0 && step % options.checkpoint_every == 0 &&
            step < total_steps)
            save();
    }
    save();
    report.steps = step;
    report.train_seconds = seconds_since(train_start);
    report.fingerprint = adapter.fingerprint();
    return report;
}

ProgressLine progress_line(const TrainProgress& progress) {
    const bool last = progress.done == progress.total;
    if (progress.phase == "teacher")
        return {
            format_text("teacher %lld/%lld samples, %.0f s", static_cast<long long>(progress.done),
                        static_cast<long long>(progress.total), progress.seconds),
            last, last};
    const int width = 24;
    const int filled =
        static_cast<int>(width * progress.done / std::max<int64_t>(progress.total, 1));
    return {
        format_text("[%.*s%*s] step %lld/%lld epoch %lld loss %.4f, %.0f s", filled,
                    "########################", width - filled, "",
                    static_cast<long long>(progress.done), static_cast<long long>(progress.total),
                    static_cast<long long>(progress.epoch), progress.loss, progress.seconds),
        last};
}

json::Value to_json(const TrainReport& report) {
    json::Value value = json::Value::object();
    value.set("samples", report.samples);
    value.set("teacher_answered", report.teacher_answered);
    value.set("teacher_reused", report.teacher_reused);
    value.set("answer_tokens", report.answer_tokens);
    value.set("steps", report.steps);
    value.set("total_steps", report.total_steps);
    value.set("first_loss", report.first_loss);
    value.set("last_loss", report.last_loss);
    value.set("teacher_seconds", report.teacher_seconds);
    value.set("train_seconds", report.train_seconds);
    value.set("adapter_fingerprint", report.fingerprint);
    return value;
}

std::string summary(const TrainReport& report) {
    return format_text(
        "%lld samples (%lld answered, %lld reused), step %lld/%lld, loss %.4f -> %.4f per answer "
        "token, %.1f s; adapter %.12s",
        static_cast<long long>(report.samples), static_cast<long long>(report.teacher_answered),
        static_cast<long long>(report.teacher_reused), static_cast<long long>(report.steps),
        static_cast<long long>(report.total_steps), report.first_loss, report.last_loss,
        report.teacher_seconds + report.train_seconds, report.fingerprint.c_str());
}

}  // namespace kv
