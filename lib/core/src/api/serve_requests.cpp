// kvserve-once --requests: serve_once's stages for every request of a JSONL stream, over one
// loaded model and one PacketCache (kv/format/packet_source.hpp) that keeps each store open and
// the packets read in memory, least recently used out first.
#include "kv/api/serve.hpp"
#include "kv/error.hpp"
#include "kv/format/packet_source.hpp"
#include "kv/sparse/options.hpp"
#include "runtime.hpp"
#include "serve_session.hpp"

#include <chrono>
#include <istream>
#include <limits>

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

RequestsReport serve_requests(const ServeOptions& defaults, std::istream& input,
                              const RequestsOptions& options) {
    if (!defaults.document.empty())
        throw UsageError(
            "--document is one long context for one question; --requests serves questions over "
            "--cache packets");
    if (options.cache_memory < 0) throw UsageError("the memory for loaded packets must be >= 0");
    RequestsReport report;
    report.cache_memory = options.cache_memory;
    report.threads = set_compute_threads(defaults.runtime.threads);
    const auto load_start = Clock::now();
    const Runtime runtime = load_runtime(defaults.runtime);
    report.load_seconds = seconds_since(load_start);

    PacketCache packets(options.cache_memory, report.threads);
    std::optional<KvCache> kept_cache;  // the last question's, for the next one
    int64_t disk_packets_read = 0, disk_bytes_read = 0;
    const auto start = Clock::now();
    int64_t number = 0;
    for (std::string line; std::getline(input, line);) {
        ++number;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        RequestResult result;
        result.line = number;
        const auto request_start = Clock::now();
        try {
            const json::Value fields = json::parse(line);
            if (const json::Value* id = fields.find("id")) result.id = *id;
            const ServeOptions request = request_options(fields, defaults);
            result.stats = serve_loaded(
                request, runtime, packets, [&](std::string_view text) { result.text += text; },
                report.threads, &kept_cache);
            result.ok = true;
        } catch (const std::exception& error) {
            result.error = one_line(error.what());
            result.text.clear();
        }
        result.seconds = seconds_since(request_start);
        ++report.requests;
        ++(result.ok ? report.answered : report.failed);
        report.seconds = seconds_since(start);
        // Offloaded to disk, a request's packets are copied from their files plane by plane and
        // never pass through the PacketCache: its own counts are the only record of them.
        if (result.ok && result.stats.offload == "disk") {
            disk_packets_read += result.stats.packets_read;
            disk_bytes_read += result.stats.cache_bytes_read;
        }
        const PacketCache::Stats& kept = packets.stats();
        report.stores = kept.stores;
        report.packets_read = kept.misses + disk_packets_read;
        report.packets_from_memory = kept.hits;
        report.bytes_read = kept.bytes_read + disk_bytes_read;
        report.packets_evicted = kept.evictions;
        report.kept_bytes = kept.kept_bytes;
        report.peak_kept_bytes = kept.peak_bytes;
        if (options.answer) options.answer(result);
        if (options.progress) options.progress(report);
    }
    if (input.bad()) throw IoError("cannot read the requests after line " + std::to_string(number));
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
