#include "kv/api/inspect.hpp"
#include "kv/format/quantize.hpp"

#include "kv/error.hpp"
#include "kv/float_convert.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/output_path.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace kv {
namespace {

std::string format(const char* pattern, auto... args) {
    char buffer[512];
    std::snprintf(buffer, sizeof buffer, pattern, args...);
    return buffer;
}

// Control characters in ids would break the one-line-per-item layout of the text output.
std::string printable(const std::string& text) {
    std::string out;
    for (unsigned char c : text) {
        if (c < 0x20 || c == 0x7f)
            out += format("\\x%02x", c);
        else
            out += static_cast<char>(c);
    }
    return out;
}

std::string quoted_id(const std::string& id) {
    return kv::quoted(printable(id));
}

json::Value packet_info_json(const PacketInfo& info) {
    json::Value packet = json::Value::object();
    packet.set("id", info.id);
    packet.set("text_sha256", info.text_sha256);
    packet.set("logical_length", info.logical_length);
    packet.set("stored_length", info.stored_length);
    packet.set("adapter_fingerprint", info.adapter_fingerprint);
    packet.set("header_tokens", info.header_tokens);
    packet.set("trailer_tokens", info.trailer_tokens);
    return packet;
}

json::Value model_json(const CacheModelInfo& model) {
    json::Value object = json::Value::object();
    object.set("fingerprint", model.model_fingerprint);
    object.set("name", model.model_name);
    object.set("architecture", model.architecture);
    object.set("num_layers", model.num_layers);
    object.set("num_kv_heads", model.num_kv_heads);
    object.set("head_dim", model.head_dim);
    object.set("rope_layout", model.rope_layout);
    object.set("rope_theta", model.rope_theta);
    object.set("rope_scaling", model.rope_scaling);
    object.set("tokenizer_fingerprint", model.tokenizer_fingerprint);
    return object;
}

json::Value provenance_json(const Provenance& provenance) {
    json::Value object = json::Value::object();
    object.set("tool", provenance.tool);
    object.set("version", provenance.version);
    object.set("command_line", provenance.command_line);
    if (!provenance.created.empty()) object.set("created", provenance.created);
    return object;
}

std::vector<int64_t> shape_without_dim(const CacheModelInfo& model, int64_t slots) {
    return {model.num_layers, model.num_kv_heads, slots};
}

// How a packet's tensors are stored: the dtype, or "int8" / "int4+128" (quantised), with
// ", per-head" when its heads keep different tokens. Reads no tensor.
std::string packet_storage(const CacheReader& reader, const std::string& id) {
    const Quantization quantization = reader.quantization(id);
    std::string how = quantization.enabled() ? quantization_name(quantization)
                                             : cache_dtype_name(reader.model().dtype);
    if (reader.has_head_positions(id)) how += ", per-head";
    return how;
}

std::string human_bytes(int64_t bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double value = static_cast<double>(bytes);
    int unit = 0;
    while (value >= 1024 && unit < 4) {
        value /= 1024;
        ++unit;
    }
    return unit == 0 ? std::to_string(bytes) + " B" : format("%.1f %s", value, units[unit]);
}

// Counts the values of a [layers, heads, tokens, dim] tensor that are not finite and describes
// the first one, or returns "" when all are.
std::string describe_non_finite(const std::vector<std::byte>& bytes, const CacheModelInfo& model,
                                int64_t stored_length) {
    const std::vector<float> values = to_float(bytes, model.dtype);
    std::size_t count = 0, first = 0;
    for (std::size_t i = 0; i < values.size(); ++i)
        if (!std::isfinite(values[i]) && count++ == 0) first = i;
    if (count == 0) return "";
    const auto dim = static_cast<std::size_t>(model.head_dim);
    const auto tokens = static_cast<std::size_t>(stored_length);
    const auto heads = static_cast<std::size_t>(model.num_kv_heads);
    return std::to_string(count) + (count == 1 ? " value that is" : " values that are") +
           " not finite (first: " + (std::isnan(values[first]) ? "NaN" : "infinity") +
           " at layer " + std::to_string(first / dim / tokens / heads) + ", kv-head " +
           std::to_string(first / dim / tokens % heads) + ", token " +
           std::to_string(first / dim % tokens) + ", dimension " + std::to_string(first % dim) +
           ")";
}

// Where export writes (kv/output_path.hpp): a temporary file renamed into place by commit(), or
// in place to standard output, a device or a FIFO.
class OutputFile {
  public:
    OutputFile(const std::filesystem::path& path, bool force) : output_(path) {
        if (output_.standard_output()) {
            if (!force && ::isatty(STDOUT_FILENO))
                throw UsageError(
                    "refusing to write binary data to a terminal (use -o FILE, or --force)");
            std::fflush(stdout);
            fd_ = STDOUT_FILENO;
            return;
        }
        if (output_.stream()) {
            fd_ = output_.open_stream();
            if (!force && ::isatty(fd_)) {
                ::close(fd_);
                throw UsageError(
                    "refusing to write binary data to a terminal (use -o FILE, or --force)");
            }
            return;
        }
        temporary_ = output_.create_temporary();
        fd_ = ::open(temporary_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
        if (fd_ < 0) {
            const std::string reason = std::strerror(errno);
            ::unlink(temporary_.c_str());
            temporary_.clear();
            throw IoError("cannot create " + output_.name() + ": " + reason);
        }
    }
    OutputFile(const OutputFile&) = delete;
    OutputFile& operator=(const OutputFile&) = delete;
    ~OutputFile() {
        if (output_.stream() && fd_ >= 0) ::close(fd_);
        if (temporary_.empty()) return;
        ::close(fd_);
        ::unlink(temporary_.c_str());
    }

    void write(const void* data, std::size_t size) {
        const auto* bytes = static_cast<const char*>(data);
        while (size > 0) {
            const ssize_t n = ::write(fd_, bytes, size);
            if (n < 0) {
                if (errno == EINTR) continue;
                throw IoError("cannot write " + output_.name() + ": " + std::strerror(errno));
            }
            bytes += n;
            size -= static_cast<std::size_t>(n);
        }
    }

    void commit() {
        if (output_.stream()) {
            const int fd = std::exchange(fd_, -1);
            if (::close(fd) != 0)
                throw IoError("cannot write " + output_.name() + ": " + std::strerror(errno));
            return;
        }
        if (temporary_.empty()) return;
        if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
            const std::string reason = std::strerror(errno);
            ::unlink(temporary_.c_str());
            temporary_.clear();
            throw IoError("cannot write " + output_.name() + ": " + reason);
        }
        output_.commit(std::exchange(temporary_, {}));
    }

  private:
    OutputPath output_;
    std::filesystem::path temporary_;
    int fd_ = -1;
};

}  // namespace

// "8 + 8 soft tokens of width 256, fingerprint ab12..., trained 180 of 180 steps (loss ...)".
std::string describe_adapter(const Adapter& adapter) {
    std::string text =
        format("%lld + %lld soft tokens of width %lld, fingerprint %s",
               static_cast<long long>(adapter.header_tokens()),
               static_cast<long long>(adapter.trailer_tokens()),
               static_cast<long long>(adapter.hidden_size), adapter.fingerprint().c_str());
    if (adapter.training.empty()) return text + ", untrained";
    try {
        const json::Value training = json::parse(adapter.training);
        const json::Value* step = training.find("step");
        const json::Value* total = training.find("total_steps");
        const json::Value* losses = training.find("loss_per_step");
        if (step && total && step->is_integer() && total->is_integer())
            text += format(", trained %lld of %lld steps", static_cast<long long>(step->as_int()),
                           static_cast<long long>(total->as_int()));
        if (losses && losses->is_array() && !losses->as_array().empty() &&
            losses->as_array().back().is_number())
            text +=
                format(" (last loss %.4g per answer token)", losses->as_array().back().as_double());
    } catch (const Error&) {
        text += ", training notes unreadable";
    }
    return text;
}

// "chunks-1mib: keys and values in chunks of 8192 tokens, shuffle + zstd + fletcher32" (section
// 7): the layout the file names (since 1.7) and what its first packet's keys have.
std::string describe_layout(const TensorLayout& layout) {
    std::string text = layout.name.empty() ? "before 1.7" : printable(layout.name);
    if (layout.storage.empty()) return text;
    text += ": keys and values ";
    if (layout.storage == "chunked" && layout.chunk_tokens > 0)
        text += format("in chunks of %lld tokens", static_cast<long long>(layout.chunk_tokens));
    else
        text += layout.storage;
    std::string filters;
    for (const std::string& filter : layout.filters)
        filters += (filters.empty() ? "" : " + ") + filter;
    return text + ", " + (filters.empty() ? "no filters" : filters);
}

json::Value layout_json(const TensorLayout& layout) {
    json::Value value = json::Value::object();
    value.set("name", layout.name);
    value.set("storage", layout.storage);
    value.set("chunk_tokens", layout.chunk_tokens);
    json::Value filters = json::Value::array();
    for (const std::string& filter : layout.filters)
        filters.push_back(filter);
    value.set("filters", std::move(filters));
    return value;
}

std::string describe_cache_text(const CacheReader& reader) {
    const CacheModelInfo& model = reader.model();
    const Provenance& provenance = reader.provenance();
    int64_t stored = 0, logical = 0, bytes = 0;
    std::size_t id_width = 2;
    for (const PacketInfo& info : reader.packets()) {
        stored += info.stored_length;
        logical += info.logical_length;
        bytes += packet_tensor_bytes(model, info.stored_length);
        id_width = std::max(id_width, printable(info.id).size());
    }
    std::string text;
    text += "file:        " + reader.source() + "\n";
    text += "format:      kvtools-kvcache " + reader.format_version() + "\n";
    text += "layout:      " + describe_layout(reader.tensor_layout()) + "\n";
    text += "model:       " + (model.model_name.empty() ? "" : kv::quoted(model.model_name) + " ") +
            model.architecture + ", fingerprint " + model.model_fingerprint + "\n";
    text +=
        format("shape:       %lld layers, %lld kv-heads, head_dim %lld\n",
               static_cast<long long>(model.num_layers), static_cast<long long>(model.num_kv_heads),
               static_cast<long long>(model.head_dim));
    text += "rope:        " + model.rope_layout + ", theta " + format("%g", model.rope_theta) +
            (model.rope_scaling.empty() ? "" : ", scaling " + model.rope_scaling) + "\n";
    text += "tokenizer:   fingerprint " + model.tokenizer_fingerprint + "\n";
    text += std::string("dtype:       ") + cache_dtype_name(model.dtype) + "\n";
    text += "written by:  " + provenance.tool + " " + provenance.version +
            (provenance.created.empty() ? "" : ", " + provenance.created) + "\n";
    text += "command:     " + printable(provenance.command_line) + "\n";
    text += format("packets:     %zu, %lld tokens stored of %lld, %s of keys and values\n",
                   reader.packets().size(), static_cast<long long>(stored),
                   static_cast<long long>(logical), human_bytes(bytes).c_str());
    std::size_t indexed = 0;
    for (const PacketInfo& info : reader.packets())
        indexed += reader.has_index(info.id);
    if (indexed > 0)
        text += format("indexed:     %zu of %zu packets carry an IceCache index\n", indexed,
                       reader.packets().size());
    if (reader.has_adapter())
        text += "adapter:     " + describe_adapter(reader.read_adapter()) + "\n";
    if (reader.packets().empty()) return text;
    // A storage column only for files that use per-head tokens or quantisation (1.2, 1.3).
    std::vector<std::string> storage;
    bool special = false;
    for (const PacketInfo& info : reader.packets()) {
        std::string how = packet_storage(reader, info.id);
        special = special || how != cache_dtype_name(reader.model().dtype);
        storage.push_back(std::move(how));
    }
    text += "\n";
    const int width = static_cast<int>(id_width);
    if (special)
        text += format("%-*s %8s %8s  %-16s %s\n", width, "id", "stored", "logical", "storage",
                       "adapter");
    else
        text += format("%-*s %8s %8s  %s\n", width, "id", "stored", "logical", "adapter");
    for (std::size_t i = 0; i < reader.packets().size(); ++i) {
        const PacketInfo& info = reader.packets()[i];
        std::string adapter = "-";
        if (!info.adapter_fingerprint.empty())
            adapter = info.adapter_fingerprint.substr(0, 12) +
                      format(" (%lld+%lld)", static_cast<long long>(info.header_tokens),
                             static_cast<long long>(info.trailer_tokens));
        if (special)
            text += format("%-*s %8lld %8lld  %-16s %s\n", width, printable(info.id).c_str(),
                           static_cast<long long>(info.stored_length),
                           static_cast<long long>(info.logical_length), storage[i].c_str(),
                           adapter.c_str());
        else
            text += format("%-*s %8lld %8lld  %s\n", width, printable(info.id).c_str(),
                           static_cast<long long>(info.stored_length),
                           static_cast<long long>(info.logical_length), adapter.c_str());
    }
    return text;
}

json::Value describe_cache_json(const CacheReader& reader) {
    json::Value report = json::Value::object();
    report.set("format", "kvtools-kvcache");
    report.set("format_version", reader.format_version());
    report.set("layout", layout_json(reader.tensor_layout()));
    report.set("dtype", cache_dtype_name(reader.model().dtype));
    report.set("model", model_json(reader.model()));
    report.set("provenance", provenance_json(reader.provenance()));
    int64_t stored = 0, logical = 0, bytes = 0;
    json::Value packets = json::Value::array();
    for (const PacketInfo& info : reader.packets()) {
        stored += info.stored_length;
        logical += info.logical_length;
        bytes += packet_tensor_bytes(reader.model(), info.stored_length);
        json::Value packet = packet_info_json(info);
        packet.set("storage", packet_storage(reader, info.id));
        packets.push_back(std::move(packet));
    }
    report.set("stored_tokens", stored);
    report.set("logical_tokens", logical);
    report.set("tensor_bytes", bytes);
    report.set("packets", std::move(packets));
    if (reader.has_adapter()) {
        const Adapter adapter = reader.read_adapter();
        json::Value value = json::Value::object();
        value.set("fingerprint", adapter.fingerprint());
        value.set("header_tokens", adapter.header_tokens());
        value.set("trailer_tokens", adapter.trailer_tokens());
        value.set("hidden_size", adapter.hidden_size);
        value.set("training",
                  adapter.training.empty() ? json::Value() : json::parse(adapter.training));
        report.set("adapter", std::move(value));
    }
    return report;
}

CheckReport check_cache(const std::filesystem::path& path) {
    CheckReport report;
    std::vector<std::string>& problems = report.problems;
    report.source = path == "-" ? "standard input" : kv::quoted(path.string());
    std::unique_ptr<CacheReader> reader;
    try {
        reader = std::make_unique<CacheReader>(path);
    } catch (const Error& error) {
        problems.push_back(error.what());
        return report;
    }
    report.source = reader->source();
    try {
        // The directory whole (opening read only its shape), and the links to its packets.
        report.packets = static_cast<int64_t>(reader->packets().size());
        reader->check_packet_ids();
    } catch (const Error& error) {
        problems.push_back(error.what());
        return report;
    }
    const CacheModelInfo& model = reader->model();
    if (reader->has_adapter()) {
        try {
            reader->read_adapter();
        } catch (const Error& error) {
            problems.push_back(error.what());
        }
    }
    for (const PacketInfo& info : reader->packets()) {
        try {
            const Packet packet = reader->read(info.id);
            for (const auto& [name, tensor] :
                 {std::pair<const char*, const std::vector<std::byte>*>{"keys", &packet.keys},
                  {"values", &packet.values}}) {
                const std::string found = describe_non_finite(*tensor, model, info.stored_length);
                if (!found.empty())
                    problems.push_back(reader->source() + ": packet " + quoted_id(info.id) + ": " +
                                       name + " hold " + found);
            }
        } catch (const Error& error) {
            problems.push_back(error.what());
        }
    }
    return report;
}

std::vector<std::string> check_cache_file(const std::filesystem::path& path) {
    return check_cache(path).problems;
}

std::string summary(const CheckReport& report) {
    const std::size_t problems = report.problems.size();
    return report.source + ": " +
           (problems ? format("%zu problem%s", problems, problems == 1 ? "" : "s") : "sound") +
           format(", %lld packet%s", static_cast<long long>(report.packets),
                  report.packets == 1 ? "" : "s");
}

DiffReport diff_cache_files(const std::filesystem::path& a, const std::filesystem::path& b,
                            const DiffOptions& options) {
    if (a == "-" && b == "-") throw UsageError("standard input ('-') can be read only once");
    if (!(options.tolerance >= 0)) throw UsageError("the tolerance must be a number >= 0");
    const CacheReader first(a);
    const CacheReader second(b);
    DiffReport report;
    report.a = first.source();
    report.b = second.source();
    const CacheModelInfo& ma = first.model();
    const CacheModelInfo& mb = second.model();
    const std::string both = " (" + report.a + " vs " + report.b + ")";
    if (ma.model_fingerprint != mb.model_fingerprint)
        report.notes.push_back("model fingerprints differ: " + ma.model_fingerprint.substr(0, 12) +
                               " vs " + mb.model_fingerprint.substr(0, 12) + both);
    if (ma.tokenizer_fingerprint != mb.tokenizer_fingerprint)
        report.notes.push_back(
            "tokenizer fingerprints differ: " + ma.tokenizer_fingerprint.substr(0, 12) + " vs " +
            mb.tokenizer_fingerprint.substr(0, 12) + both);
    const bool shapes_agree = ma.num_layers == mb.num_layers &&
                              ma.num_kv_heads == mb.num_kv_heads && ma.head_dim == mb.head_dim;
    if (!shapes_agree)
        report.notes.push_back(
            format("shapes differ: %lld layers x %lld kv-heads x head_dim %lld "
                   "vs %lld x %lld x %lld",
                   static_cast<long long>(ma.num_layers), static_cast<long long>(ma.num_kv_heads),
                   static_cast<long long>(ma.head_dim), static_cast<long long>(mb.num_layers),
                   static_cast<long long>(mb.num_kv_heads), static_cast<long long>(mb.head_dim)) +
            both);

    if (ma.dtype != mb.dtype)
        report.remarks.push_back(std::string("dtypes differ: ") + cache_dtype_name(ma.dtype) +
                                 " vs " + cache_dtype_name(mb.dtype) +
                                 " (values are compared as float)");

    auto wanted = [&](const std::string& id) { return !options.packet || *options.packet == id; };
    std::unordered_set<std::string> in_a, in_b;
    for (const PacketInfo& info : first.packets())
        in_a.insert(info.id);
    for (const PacketInfo& info : second.packets())
        in_b.insert(info.id);
    if (options.packet && !in_a.count(*options.packet) && !in_b.count(*options.packet))
        throw UsageError("no packet " + quoted_id(*options.packet) + " in " + report.a + " or " +
                         report.b);
    for (const PacketInfo& info : first.packets())
        if (wanted(info.id) && !in_b.count(info.id))
            report.notes.push_back("packet " + quoted_id(info.id) + " is only in " + report.a);
    for (const PacketInfo& info : second.packets())
        if (wanted(info.id) && !in_a.count(info.id))
            report.notes.push_back("packet " + quoted_id(info.id) + " is only in " + report.b);

    for (const PacketInfo& info : first.packets()) {
        if (!wanted(info.id) || !in_b.count(info.id)) continue;
        PacketDifference result;
        result.id = info.id;
        result.stored_length = info.stored_length;
        const PacketInfo& other = second.packet_info(info.id);
        auto compare = [&](const char* what, auto x, auto y) {
            if (x != y)
                result.mismatches.push_back(std::string(what) + " differ: " + std::to_string(x) +
                                            " vs " + std::to_string(y));
        };
        compare("stored lengths", info.stored_length, other.stored_length);
        compare("logical lengths", info.logical_length, other.logical_length);
        if (info.text_sha256 != other.text_sha256)
            result.mismatches.push_back("text hashes differ");
        if (info.adapter_fingerprint != other.adapter_fingerprint ||
            info.header_tokens != other.header_tokens ||
            info.trailer_tokens != other.trailer_tokens)
            result.mismatches.push_back("adapters differ");
        if (!shapes_agree) result.mismatches.push_back("not compared: the shapes differ");
        if (result.mismatches.empty()) {
            const Packet pa = first.read(info.id);
            const Packet pb = second.read(info.id);
            for (std::size_t i = 0; i < pa.token_ids.size(); ++i)
                if (pa.token_ids[i] != pb.token_ids[i]) {
                    result.mismatches.push_back(format("token ids differ (first at %zu: %d vs %d)",
                                                       i, pa.token_ids[i], pb.token_ids[i]));
                    break;
                }
            if (pa.head_lengths != pb.head_lengths || pa.head_positions != pb.head_positions)
                result.mismatches.push_back(pa.ragged() == pb.ragged()
                                                ? "per-head kept tokens differ"
                                                : "one keeps tokens per head, the other does not");
            for (std::size_t i = 0; i < pa.positions.size(); ++i)
                if (pa.positions[i] != pb.positions[i]) {
                    result.mismatches.push_back(
                        format("positions differ (first at %zu: %lld vs %lld)", i,
                               static_cast<long long>(pa.positions[i]),
                               static_cast<long long>(pb.positions[i])));
                    break;
                }
            if (result.mismatches.empty()) {
                const std::size_t per_layer =
                    static_cast<std::size_t>(ma.num_kv_heads * info.stored_length * ma.head_dim);
                result.layers.resize(static_cast<std::size_t>(ma.num_layers));
                for (const bool keys : {true, false}) {
                    const std::vector<float> x = to_float(keys ? pa.keys : pa.values, ma.dtype);
                    const std::vector<float> y = to_float(keys ? pb.keys : pb.values, mb.dtype);
                    for (std::size_t layer = 0; layer < result.layers.size(); ++layer) {
                        double largest = 0, sum = 0;
                        for (std::size_t i = layer * per_layer; i < (layer + 1) * per_layer; ++i) {
                            const double u = x[i], v = y[i];
                            // Bit-identical values (NaN included) do not differ.
                            double error = 0;
                            if (std::isnan(u) || std::isnan(v))
                                error = std::isnan(u) && std::isnan(v)
                                            ? 0
                                            : std::numeric_limits<double>::infinity();
                            else if (u != v)
                                error = std::fabs(u - v);
                            largest = std::max(largest, error);
                            sum += error;
                        }
                        const double mean = per_layer ? sum / static_cast<double>(per_layer) : 0;
                        LayerDifference& target = result.layers[layer];
                        (keys ? target.keys_max : target.values_max) = largest;
                        (keys ? target.keys_mean : target.values_mean) = mean;
                    }
                }
            }
        }
        result.same = result.mismatches.empty();
        for (const LayerDifference& layer : result.layers)
            if (!(layer.keys_max <= options.tolerance && layer.values_max <= options.tolerance))
                result.same = false;
        report.packets.push_back(std::move(result));
    }
    report.same = report.notes.empty();
    for (const PacketDifference& packet : report.packets)
        report.same = report.same && packet.same;
    return report;
}

std::string format_diff_report(const DiffReport& report, double tolerance) {
    std::string text;
    for (const std::string& remark : report.remarks)
        text += remark + "\n";
    for (const std::string& note : report.notes)
        text += note + "\n";
    std::size_t different = 0;
    for (const PacketDifference& packet : report.packets) {
        if (!packet.same) ++different;
        text += "packet " + quoted_id(packet.id) +
                format(", %lld tokens: ", static_cast<long long>(packet.stored_length));
        if (!packet.mismatches.empty()) {
            for (std::size_t i = 0; i < packet.mismatches.size(); ++i)
                text += (i ? "; " : "") + packet.mismatches[i];
            text += "\n";
            continue;
        }
        text += packet.same ? "same\n" : "different\n";
        text += format("  %5s %11s %11s %11s %11s\n", "layer", "keys max", "keys mean",
                       "values max", "values mean");
        for (std::size_t layer = 0; layer < packet.layers.size(); ++layer) {
            const LayerDifference& d = packet.layers[layer];
            text += format("  %5zu %11.4g %11.4g %11.4g %11.4g\n", layer, d.keys_max, d.keys_mean,
                           d.values_max, d.values_mean);
        }
    }
    text += format("%zu %s compared, %zu different", report.packets.size(),
                   report.packets.size() == 1 ? "packet" : "packets", different);
    if (tolerance > 0) text += format(" (tolerance %g)", tolerance);
    text += report.same ? ": same\n" : ": different\n";
    return text;
}

ExportReport export_safetensors(const std::filesystem::path& input,
                                const std::filesystem::path& output, bool force) {
    // Exporting a store over itself would replace the store with its export.
    refuse_output_among_inputs(output, {input});
    const CacheReader reader(input);
    const CacheModelInfo& model = reader.model();
    const char* dtype = model.dtype == CacheDtype::f32    ? "F32"
                        : model.dtype == CacheDtype::bf16 ? "BF16"
                                                          : "F16";
    // The header is known from the index alone, so packets can follow one at a time.
    json::Value header = json::Value::object();
    json::Value metadata = json::Value::object();
    metadata.set("format", "kvtools-kvcache export");
    metadata.set("format_version", reader.format_version());
    metadata.set("dtype", cache_dtype_name(model.dtype));
    metadata.set("model", json::dump(model_json(model)));
    metadata.set("provenance", json::dump(provenance_json(reader.provenance())));
    json::Value packets = json::Value::array();
    for (const PacketInfo& info : reader.packets())
        packets.push_back(packet_info_json(info));
    metadata.set("packets", json::dump(packets));
    // An adapter file (6.7) is exported whole, or the export would silently lose what the file
    // is for: its attributes in the metadata, its vectors (and optimizer state) as tensors.
    std::optional<Adapter> adapter;
    if (reader.has_adapter()) {
        adapter = reader.read_adapter();
        json::Value value = json::Value::object();
        value.set("fingerprint", adapter->fingerprint());
        value.set("header_tokens", adapter->header_tokens());
        value.set("trailer_tokens", adapter->trailer_tokens());
        value.set("hidden_size", adapter->hidden_size);
        value.set("init_mean", adapter->init_mean);
        value.set("init_std", adapter->init_std);
        value.set("training", adapter->training);
        if (adapter->has_optimizer_state()) value.set("optimizer_step", adapter->optimizer_step);
        metadata.set("adapter", json::dump(value));
    }
    header.set("__metadata__", std::move(metadata));
    int64_t offset = 0;
    auto add = [&](const std::string& name, const char* type, std::vector<int64_t> shape,
                   int64_t bytes) {
        json::Value entry = json::Value::object();
        entry.set("dtype", type);
        json::Value dims = json::Value::array();
        for (int64_t dim : shape)
            dims.push_back(dim);
        entry.set("shape", std::move(dims));
        json::Value offsets = json::Value::array();
        offsets.push_back(offset);
        offsets.push_back(offset + bytes);
        entry.set("data_offsets", std::move(offsets));
        header.set(name, std::move(entry));
        offset += bytes;
    };
    for (const PacketInfo& info : reader.packets()) {
        const int64_t s = info.stored_length;
        const std::vector<int64_t> shape = {model.num_layers, model.num_kv_heads, s,
                                            model.head_dim};
        const int64_t bytes = packet_tensor_bytes(model, info.stored_length) / 2;
        add(info.id + ".keys", dtype, shape, bytes);
        add(info.id + ".values", dtype, shape, bytes);
        add(info.id + ".token_ids", "I32", {s}, 4 * s);
        add(info.id + ".positions", "I64", {s}, 8 * s);
        if (reader.has_head_positions(info.id)) {
            const int64_t planes = model.num_layers * model.num_kv_heads;
            add(info.id + ".head_lengths", "I64", {model.num_layers, model.num_kv_heads},
                8 * planes);
            add(info.id + ".head_positions", "I64", shape_without_dim(model, s), 8 * planes * s);
        }
    }
    // The adapter's tensors, [tokens, hidden_size] float32 each; an empty one (no trailer, say)
    // is left out, its count being in the metadata.
    std::vector<std::pair<std::string, const std::vector<float>*>> adapter_tensors;
    if (adapter) {
        adapter_tensors = {
            {"adapter.header", &adapter->header},
            {"adapter.trailer", &adapter->trailer},
            {"adapter.optimizer.header_moment", &adapter->header_moment},
            {"adapter.optimizer.header_second_moment", &adapter->header_second_moment},
            {"adapter.optimizer.trailer_moment", &adapter->trailer_moment},
            {"adapter.optimizer.trailer_second_moment", &adapter->trailer_second_moment}};
        std::erase_if(adapter_tensors, [](const auto& tensor) { return tensor.second->empty(); });
        for (const auto& [name, values] : adapter_tensors) {
            const int64_t count = static_cast<int64_t>(values->size());
            add(name, "F32", {count / adapter->hidden_size, adapter->hidden_size}, 4 * count);
        }
    }
    std::string text = json::dump(header);
    text.append((8 - text.size() % 8) % 8, ' ');  // keeps tensor data 8-byte aligned
    ExportReport report;
    report.output = output == "-" ? "standard output" : kv::quoted(output.string());
    report.packets = static_cast<int64_t>(reader.packets().size());
    report.tensors = static_cast<int64_t>(header.size()) - 1;  // less __metadata__
    report.bytes = 8 + static_cast<int64_t>(text.size()) + offset;
    std::string prefix(8, '\0');
    for (int i = 0; i < 8; ++i)
        prefix[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);

    OutputFile out(output, force);
    out.write(prefix.data(), prefix.size());
    out.write(text.data(), text.size());
    for (const PacketInfo& info : reader.packets()) {
        const Packet packet = reader.read(info.id);
        out.write(packet.keys.data(), packet.keys.size());
        out.write(packet.values.data(), packet.values.size());
        out.write(packet.token_ids.data(), packet.token_ids.size() * sizeof(int32_t));
        out.write(packet.positions.data(), packet.positions.size() * sizeof(int64_t));
        if (packet.ragged()) {
            out.write(packet.head_lengths.data(), packet.head_lengths.size() * sizeof(int64_t));
            out.write(packet.head_positions.data(), packet.head_positions.size() * sizeof(int64_t));
        }
    }
    for (const auto& tensor : adapter_tensors)
        out.write(tensor.second->data(), tensor.second->size() * sizeof(float));
    out.commit();
    return report;
}

std::string summary(const ExportReport& report) {
    return format("exported %lld packet%s as %lld tensors to %s (%lld bytes)",
                  static_cast<long long>(report.packets), report.packets == 1 ? "" : "s",
                  static_cast<long long>(report.tensors), report.output.c_str(),
                  static_cast<long long>(report.bytes));
}

std::string summary(const MergeReport& report, const std::filesystem::path& output) {
    const std::string target = output == "-" ? "standard output" : kv::quoted(output.string());
    return format(
        "merged %lld file%s into %s: %lld packet%s, %lld tokens (%lld stored), %lld "
        "bytes of keys and values",
        static_cast<long long>(report.files), report.files == 1 ? "" : "s", target.c_str(),
        static_cast<long long>(report.packets), report.packets == 1 ? "" : "s",
        static_cast<long long>(report.tokens), static_cast<long long>(report.stored_tokens),
        static_cast<long long>(report.bytes));
}

}  // namespace kv
