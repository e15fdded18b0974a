// kvserve-once --requests: serve_once's stages for every request of a JSONL stream, over one
// loaded model and one PacketCache (kv/format/packet_source.hpp) that keeps each store open and
// the packets read in memory, least recently used out first.
#include "kv/api/serve.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/format/packet_source.hpp"
#include "kv/sparse/options.hpp"
#include "runtime.hpp"
#include "serve_session.hpp"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <istream>
#include <limits>
#include <mutex>
#include <thread>

namespace kv {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

// The fields a request may give, in the order the messages list them.
const char* const request_fields[] = {"id",
                                      "prompt",
                                      "cache",
                                      "n_predict",
                                      "temp",
                                      "top_p",
                                      "seed",
                                      "echo",
                                      "ignore_eos",
                                      "attention",
                                      "budget",
                                      "dense_layers",
                                      "reuse_layers",
                                      "field_of_view",
                                      "sparse_prompt",
                                      "measure_recall",
                                      "recompute",
                                      "recompute_ratio",
                                      "recompute_tokens"};

[[noreturn]] void bad_field(const std::string& name, const std::string& expected,
                            const json::Value& value) {
    throw UsageError("field " + kv::quoted(name) + " must be " + expected + ", not " +
                     (value.is_string() ? kv::quoted(value.as_string()) : json::dump(value)));
}

int64_t integer_field(const std::string& name, const json::Value& value, int64_t low,
                      int64_t high) {
    const std::string range =
        high == std::numeric_limits<int64_t>::max()
            ? "an integer >= " + std::to_string(low)
            : "an integer in [" + std::to_string(low) + ", " + std::to_string(high) + "]";
    if (!value.is_integer()) bad_field(name, range, value);
    const int64_t number = value.as_int();
    if (number < low || number > high) bad_field(name, range, value);
    return number;
}

double number_field(const std::string& name, const json::Value& value, double low, double high) {
    const std::string range = high == std::numeric_limits<double>::infinity()
                                  ? "a number >= " + json::dump(json::Value(low))
                                  : "a number in [" + json::dump(json::Value(low)) + ", " +
                                        json::dump(json::Value(high)) + "]";
    if (!value.is_number()) bad_field(name, range, value);
    const double number = value.as_double();
    if (!(number >= low && number <= high)) bad_field(name, range, value);
    return number;
}

bool bool_field(const std::string& name, const json::Value& value) {
    if (!value.is_bool()) bad_field(name, "true or false", value);
    return value.as_bool();
}

std::string string_field(const std::string& name, const json::Value& value) {
    if (!value.is_string()) bad_field(name, "a string", value);
    return value.as_string();
}

std::string one_line(const char* message) {
    std::string text = message ? message : "";
    const std::size_t end = text.find('\n');
    return end == std::string::npos ? text : text.substr(0, end);
}

/// What the read-ahead thread read for one request: its stores and packets as the PacketCache
/// gave them, and how long that took.
struct ReadAheadPackets {
    std::vector<std::pair<std::string, std::shared_ptr<const CacheReader>>> stores;  // by FILE
    std::vector<std::pair<std::pair<const CacheReader*, std::string>, SourcedPacket>> packets;
    double seconds = 0;
};

/// Reads the packets that the request on `line` names (FILE:ID each) into `cache`, where they
/// will be found when the request is served. Whatever fails here is left for then: served, the
/// request fails again and reports it.
ReadAheadPackets read_request_packets(const std::string& line, const ServeOptions& defaults,
                                      PacketCache& cache) {
    ReadAheadPackets out;
    const auto start = Clock::now();
    try {
        const ServeOptions request = request_options(json::parse(line), defaults);
        for (const std::string& spec : request.caches) {
            const CacheSelection selection = parse_cache_selection(spec);
            if (selection.file == "-" || selection.id.empty()) continue;  // read when served
            std::shared_ptr<const CacheReader> store = cache.store(selection.file);
            out.stores.emplace_back(selection.file.string(), store);
            // A large packet waits for its request: held here, it would be memory beyond the
            // bound.
            if (packet_tensor_bytes(store->model(),
                                    store->packet_info(selection.id).stored_length) >
                cache.capacity() / 4)
                continue;
            out.packets.push_back({{store.get(), selection.id}, cache.packet(store, selection.id)});
        }
    } catch (const std::exception&) {
    }
    out.seconds = seconds_since(start);
    return out;
}

/// One thread that reads the packets of the requests given to it, in order, one request at a
/// time, while the calling thread serves the requests before them.
class ReadAheadThread {
  public:
    ReadAheadThread(PacketCache& cache, const ServeOptions& defaults)
        : cache_(cache), defaults_(defaults), thread_([this] { run(); }) {}
    ReadAheadThread(const ReadAheadThread&) = delete;
    ReadAheadThread& operator=(const ReadAheadThread&) = delete;
    /// Finishes the request in hand (a few packets at most) and drops the others.
    ~ReadAheadThread() {
        {
            const std::lock_guard lock(mutex_);
            stopping_ = true;
            jobs_.clear();
        }
        wake_.notify_one();
        thread_.join();
    }

    std::future<ReadAheadPackets> read(std::string line) {
        std::packaged_task<ReadAheadPackets()> job([this, line = std::move(line)] {
            return read_request_packets(line, defaults_, cache_);
        });
        std::future<ReadAheadPackets> done = job.get_future();
        {
            const std::lock_guard lock(mutex_);
            jobs_.push_back(std::move(job));
        }
        wake_.notify_one();
        return done;
    }

  private:
    void run() {
        for (;;) {
            std::packaged_task<ReadAheadPackets()> job;
            {
                std::unique_lock lock(mutex_);
                wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
                if (stopping_) return;
                job = std::move(jobs_.front());
                jobs_.pop_front();
            }
            job();
        }
    }

    PacketCache& cache_;
    const ServeOptions& defaults_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<std::packaged_task<ReadAheadPackets()>> jobs_;
    bool stopping_ = false;
    std::thread thread_;  // last: it starts when everything above exists
};

/// One request's packets: those read ahead for it (waited for at the first call), then the
/// cache's.
class RequestPackets final : public PacketSource {
  public:
    RequestPackets(PacketCache& cache, std::future<ReadAheadPackets>* ahead)
        : cache_(cache), pending_(ahead && ahead->valid() ? ahead : nullptr) {}

    std::shared_ptr<const CacheReader> store(const std::filesystem::path& file) override {
        take_ahead();
        for (const auto& [name, reader] : ahead_.stores)
            if (name == file.string()) return reader;
        return cache_.store(file);
    }
    SourcedPacket packet(const std::shared_ptr<const CacheReader>& store,
                         const std::string& id) override {
        take_ahead();
        if (const std::size_t at = read_ahead_index(*store, id); at < ahead_.packets.size()) {
            SourcedPacket packet = std::move(ahead_.packets[at].second);
            ahead_.packets.erase(ahead_.packets.begin() + static_cast<std::ptrdiff_t>(at));
            return packet;
        }
        return cache_.packet(store, id);
    }
    // A packet neither read ahead nor kept for later (--cache-memory 0, or a packet larger than
    // it) is read straight into the question's cache, as a question alone reads it: through a
    // packet of its own, a 32k packet of a 1B shape took 1 GiB of fresh memory and a copy
    // (0.2-1.4 s more to the first token on this machine).
    bool keeps(const CacheReader& store, const PacketInfo& info) const override {
        return read_ahead_index(store, info.id) < ahead_.packets.size() ||
               cache_.keeps(store, info);
    }

    bool read_ahead() const { return read_ahead_; }
    double read_seconds() const { return ahead_.seconds; }
    double waited_seconds() const { return waited_; }

  private:
    // Where the packet `id` of `store` is among those read ahead; their count when it is not.
    std::size_t read_ahead_index(const CacheReader& store, const std::string& id) const {
        std::size_t at = 0;
        while (at < ahead_.packets.size() &&
               (ahead_.packets[at].first.first != &store || ahead_.packets[at].first.second != id))
            ++at;
        return at;
    }
    void take_ahead() {
        if (!pending_) return;
        const auto start = Clock::now();
        ahead_ = pending_->get();
        waited_ = seconds_since(start);
        pending_ = nullptr;
        read_ahead_ = true;
    }

    PacketCache& cache_;
    std::future<ReadAheadPackets>* pending_;
    ReadAheadPackets ahead_;
    bool read_ahead_ = false;
    double waited_ = 0;
};

}  // namespace

ServeOptions request_options(const json::Value& request, const ServeOptions& defaults) {
    if (!request.is_object())
        throw UsageError("a request is a JSON object, not " +
                         std::string(json::type_name(request.type())));
    ServeOptions options = defaults;
    options.progress = {};  // a request's stages are not reported one by one
    const json::Value* id = request.find("id");
    if (!id) throw UsageError("the request has no \"id\"");
    if (!id->is_string() && !id->is_integer()) bad_field("id", "a string or an integer", *id);
    for (const auto& [name, value] : request.as_object()) {
        SparseOptions& attention = options.attention;
        if (name == "id") {
        } else if (name == "prompt") {
            options.prompt = string_field(name, value);
        } else if (name == "cache") {
            options.caches.clear();
            if (value.is_string()) {
                options.caches.push_back(value.as_string());
            } else if (value.is_array()) {
                for (const json::Value& item : value.as_array())
                    options.caches.push_back(
                        string_field("cache", item.is_string() ? item : json::Value(nullptr)));
            } else {
                bad_field(name, "an array of FILE[:ID] strings", value);
            }
        } else if (name == "n_predict") {
            options.max_new_tokens =
                integer_field(name, value, 0, std::numeric_limits<int64_t>::max());
        } else if (name == "temp") {
            options.sampling.temperature =
                number_field(name, value, 0, std::numeric_limits<double>::infinity());
        } else if (name == "top_p") {
            options.sampling.top_p = number_field(name, value, 0, 1);
        } else if (name == "seed") {
            options.sampling.seed = static_cast<uint64_t>(
                integer_field(name, value, 0, std::numeric_limits<int64_t>::max()));
        } else if (name == "echo") {
            options.echo = bool_field(name, value);
        } else if (name == "ignore_eos") {
            options.ignore_eos = bool_field(name, value);
        } else if (name == "attention") {
            attention.method = string_field(name, value);
            check_sparse_method(attention.method);
        } else if (name == "budget") {
            attention.budget = integer_field(name, value, 64, int64_t{1} << 30);
        } else if (name == "dense_layers") {
            attention.dense_layers =
                integer_field(name, value, 0, std::numeric_limits<int64_t>::max());
        } else if (name == "reuse_layers") {
            attention.reuse_layers =
                integer_field(name, value, 1, std::numeric_limits<int64_t>::max());
        } else if (name == "field_of_view") {
            attention.field_of_view =
                integer_field(name, value, 0, std::numeric_limits<int64_t>::max());
        } else if (name == "sparse_prompt") {
            options.sparse_prompt = bool_field(name, value);
        } else if (name == "measure_recall") {
            attention.measure_recall = bool_field(name, value);
        } else if (name == "recompute") {
            options.recompute.method = string_field(name, value);
            const std::string& method = options.recompute.method;
            if (method != "none" && method != "epic" && method != "cacheblend" && method != "all")
                bad_field(name, "none, epic, cacheblend or all", value);
        } else if (name == "recompute_ratio") {
            options.recompute.ratio = number_field(name, value, 0, 1);
        } else if (name == "recompute_tokens") {
            options.recompute.tokens =
                integer_field(name, value, 0, std::numeric_limits<int64_t>::max());
        } else {
            std::string known;
            for (const char* field : request_fields)
                known += (known.empty() ? "" : ", ") + std::string(field);
            throw UsageError("unknown field " + kv::quoted(name) + " (a request has " + known +
                             ")");
        }
    }
    return options;
}

namespace {

/// The lines of a requests input, blank ones skipped, numbered from 1.
class RequestLines {
  public:
    explicit RequestLines(std::istream& input) : input_(input) {}
    /// The next line that is not blank; false at the end of the input.
    bool next(int64_t& line, std::string& text) {
        for (std::string read; std::getline(input_, read);) {
            ++number_;
            if (read.find_first_not_of(" \t\r") == std::string::npos) continue;
            line = number_;
            text = std::move(read);
            return true;
        }
        return false;
    }
    /// Whether a line is already in the input (its buffer, a file, a pipe's contents), so that
    /// next() waits for no one: a caller that writes the next request after reading this one's
    /// answer is never waited for while answers are owed.
    bool waiting() const { return input_.rdbuf() && input_.rdbuf()->in_avail() > 0; }
    int64_t number() const { return number_; }
    bool bad() const { return input_.bad(); }

  private:
    std::istream& input_;
    int64_t number_ = 0;
};

/// One request, served over `source`: its answer, or the one line of its error.
RequestResult serve_line(int64_t line, const std::string& text, const ServeOptions& defaults,
                         const Runtime& runtime, PacketSource& source, int threads,
                         KeptBetweenQuestions& kept) {
    RequestResult result;
    result.line = line;
    const auto start = Clock::now();
    try {
        const json::Value fields = json::parse(text);
        if (const json::Value* id = fields.find("id")) result.id = *id;
        const ServeOptions request = request_options(fields, defaults);
        result.stats = serve_loaded(
            request, runtime, source, [&](std::string_view piece) { result.text += piece; },
            threads, &kept);
        result.ok = true;
    } catch (const std::exception& error) {
        result.error = one_line(error.what());
        result.text.clear();
    }
    result.seconds = seconds_since(start);
    return result;
}

}  // namespace

RequestsReport serve_requests(const ServeOptions& defaults, std::istream& input,
                              const RequestsOptions& options) {
    if (!defaults.document.empty())
        throw UsageError(
            "--document is one long context for one question; --requests serves questions over "
            "--cache packets");
    if (options.cache_memory < 0) throw UsageError("the memory for loaded packets must be >= 0");
    if (options.read_ahead < 0) throw UsageError("the requests to read ahead must be >= 0");
    RequestsReport report;
    report.cache_memory = options.cache_memory;
    report.threads = set_compute_threads(defaults.runtime.threads);
    const auto load_start = Clock::now();
    const Runtime runtime = load_runtime(defaults.runtime);
    report.load_seconds = seconds_since(load_start);

    PacketCache packets(options.cache_memory, report.threads);
    // Nothing to read ahead where every request's packets stay on disk.
    std::optional<ReadAheadThread> read_ahead;
    if (options.read_ahead > 0 && defaults.offload != "disk") read_ahead.emplace(packets, defaults);
    KeptBetweenQuestions kept;  // from the last question, for the next one
    int64_t uncached_packets_read = 0, uncached_bytes_read = 0;
    const auto start = Clock::now();
    RequestLines lines(input);
    struct Waiting {
        int64_t line = 0;
        std::string text;
        std::future<ReadAheadPackets> packets;  // not valid where not read ahead
    };
    std::deque<Waiting> waiting;
    bool ended = false;
    // Every request's packets go through the read-ahead thread, in input order: each is read,
    // or found in memory, exactly as when the requests are served one after another.
    auto take_line = [&] {
        Waiting next;
        if (ended || !lines.next(next.line, next.text)) {
            ended = true;
            return false;
        }
        if (read_ahead) next.packets = read_ahead->read(next.text);
        waiting.push_back(std::move(next));
        return true;
    };
    for (;;) {
        if (waiting.empty() && !take_line()) break;
        while (read_ahead && waiting.size() <= static_cast<std::size_t>(options.read_ahead) &&
               lines.waiting() && take_line()) {
        }
        Waiting request = std::move(waiting.front());
        waiting.pop_front();
        RequestPackets request_packets(packets, &request.packets);
        RequestResult result = serve_line(request.line, request.text, defaults, runtime,
                                          request_packets, report.threads, kept);
        result.read_ahead = request_packets.read_ahead();
        result.read_ahead_seconds = request_packets.read_seconds();
        result.read_ahead_wait_seconds = request_packets.waited_seconds();

        ++report.requests;
        ++(result.ok ? report.answered : report.failed);
        report.read_ahead += result.read_ahead;
        report.seconds = seconds_since(start);
        // Packets read straight into a request's cache (in place, or plane by plane offloaded
        // to disk) never pass through the PacketCache: the request's counts are the only record
        // of them.
        if (result.ok) {
            uncached_packets_read += result.stats.packets_read_directly;
            uncached_bytes_read += result.stats.bytes_read_directly;
        }
        const PacketCache::Stats kept = packets.stats();
        report.stores = kept.stores;
        report.packets_read = kept.misses + uncached_packets_read;
        report.packets_from_memory = kept.hits;
        report.bytes_read = kept.bytes_read + uncached_bytes_read;
        report.packets_evicted = kept.evictions;
        report.kept_bytes = kept.kept_bytes;
        report.peak_kept_bytes = kept.peak_bytes;
        if (options.answer) options.answer(result);
        if (options.progress) options.progress(report);
    }
    if (lines.bad())
        throw IoError("cannot read the requests after line " + std::to_string(lines.number()));
    report.seconds = seconds_since(start);
    return report;
}

json::Value to_json(const RequestResult& result) {
    json::Value line = json::Value::object();
    line.set("id", result.id);
    if (!result.ok) {
        line.set("line", result.line);
        line.set("error", result.error);
        return line;
    }
    line.set("text", result.text);
    json::Value stats = json::Value::object();
    const json::Value all = stats_to_json(result.stats);
    for (const auto& [name, value] : all.as_object())
        if (name != "load_seconds") stats.set(name, value);
    stats.set("packets_read", result.stats.packets_read);
    stats.set("packets_from_memory", result.stats.packets_from_memory);
    stats.set("seconds", result.seconds);
    stats.set("read_ahead", result.read_ahead);
    stats.set("read_ahead_seconds", result.read_ahead_seconds);
    stats.set("read_ahead_wait_seconds", result.read_ahead_wait_seconds);
    line.set("stats", std::move(stats));
    return line;
}

json::Value to_json(const RequestsReport& report) {
    json::Value value = json::Value::object();
    value.set("requests", report.requests);
    value.set("answered", report.answered);
    value.set("failed", report.failed);
    value.set("load_seconds", report.load_seconds);
    value.set("seconds", report.seconds);
    value.set("requests_per_second",
              report.seconds > 0 ? static_cast<double>(report.requests) / report.seconds : 0.0);
    value.set("threads", report.threads);
    value.set("cache_memory", report.cache_memory);
    value.set("read_ahead", report.read_ahead);
    value.set("stores", report.stores);
    value.set("packets_read", report.packets_read);
    value.set("packets_from_memory", report.packets_from_memory);
    value.set("packets_evicted", report.packets_evicted);
    value.set("kept_bytes", report.kept_bytes);
    value.set("peak_kept_bytes", report.peak_kept_bytes);
    value.set("cache_bytes_read", report.bytes_read);
    return value;
}

ProgressLine progress_line(const RequestsReport& report) {
    ProgressLine line;
    line.text = format_text(
        "%lld requests: %lld answered, %lld failed, %.1f/s; packets %lld read, %lld from "
        "memory (%.1f MiB kept)",
        static_cast<long long>(report.requests), static_cast<long long>(report.answered),
        static_cast<long long>(report.failed),
        report.seconds > 0 ? static_cast<double>(report.requests) / report.seconds : 0.0,
        static_cast<long long>(report.packets_read),
        static_cast<long long>(report.packets_from_memory),
        static_cast<double>(report.kept_bytes) / (1 << 20));
    line.plain = false;  // a line per request would drown the log: the summary says it all
    return line;
}

std::string summary(const RequestsReport& report) {
    return progress_line(report).text + format_text(" in %.2f s after loading the model in %.2f s",
                                                    report.seconds, report.load_seconds);
}

}  // namespace kv
