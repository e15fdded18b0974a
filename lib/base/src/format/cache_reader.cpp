#include "kv/format/cache_reader.hpp"

#include "adapter_codec.hpp"
#include "direct_read.hpp"
#include "hdf5_file.hpp"
#include "head_positions_codec.hpp"
#include "index_codec.hpp"
#include "kv/error.hpp"
#include "kv/format/quantize.hpp"
#include "kv/mapped_file.hpp"
#include "kv/memory.hpp"
#include "packet_rules.hpp"
#include "quantized_codec.hpp"
#include "spec.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <tuple>
#include <unordered_map>
#include <utility>

static_assert(std::endian::native == std::endian::little,
              "tensors cross the cache file API as little-endian bytes");

namespace kv {

using namespace format;

struct CacheReader::State {
    std::string source;
    std::string version;
    CacheModelInfo model;
    Provenance provenance;
    // The directory (section 6.1): every entry once read whole (index_read), else the entries
    // found through /packet_ids so far (found), with their entry numbers.
    hsize_t count = 0;
    bool index_read = false;
    std::vector<PacketInfo> packets;
    std::unordered_map<std::string, std::size_t> by_id;
    std::unordered_map<std::string, std::pair<PacketInfo, std::size_t>> found;
    // Guards the three above (written under HDF5's lock as well): an entry found before is
    // looked up without HDF5's lock, which another thread's read may hold for a millisecond
    // (kvserve-once --requests reads the next request's packets ahead).
    mutable std::mutex directory_mutex;
    // Under HDF5's lock: lookups through /packet_ids so far, and whether reading the directory
    // whole failed (then the lookups go on one by one, each entry checked as it is found).
    std::size_t links_followed = 0;
    bool directory_unreadable = false;
    // The index's datasets, kept open for the entries read one at a time, and /packet_ids.
    struct IndexDatasets {
        Handle group, id, text_sha256, adapter_fingerprint, logical_length, stored_length,
            header_tokens, trailer_tokens, packet_ids;
    } index;
    std::vector<char> image;       // standard input, which the file image views in place
    RawSource raw;                 // the file's bytes, for checks HDF5 does not make
    bool raw_checks = false;       // heap ids can be checked (no user block before the superblock)
    bool ragged_declared = false;  // required_features lists ragged-heads
    bool quantized_declared = false;     // and quantized-kv
    bool index_layers_declared = false;  // and index-layers
    int threads = 0;                     // for reading keys and values (0: one per core)
    Handle file;
    Handle f16_type;

    ~State() {
        if (raw.fd >= 0) ::close(raw.fd);
    }
};

CacheReader::CacheReader(const std::filesystem::path& path) : state_(std::make_unique<State>()) {
    State& s = *state_;
    const bool from_stdin = path == "-";
    s.source = from_stdin ? "standard input" : kv::quoted(path.string());
    const FileReader in(s.source, &s.raw);
    if (from_stdin) {
        const std::string bytes = read_standard_input();
        s.image.assign(bytes.begin(), bytes.end());
        if (s.image.empty()) in.fail("empty input, not a cache file");
        s.raw.image = reinterpret_cast<const std::byte*>(s.image.data());
        s.raw.size = s.image.size();
    } else {
        s.raw.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (s.raw.fd < 0) throw IoError("cannot open " + s.source + ": " + system_reason());
        struct stat info {};
        if (::fstat(s.raw.fd, &info) != 0 || !S_ISREG(info.st_mode))
            throw IoError("cannot open " + s.source + ": not a regular file");
        s.raw.size = static_cast<std::size_t>(info.st_size);
    }
    // HDF5 looks for its signature at 0, 512, 1024, 2048, ... (after a user block).
    static const char signature[] = "\x89HDF\r\n\x1a\n";
    bool found = false;
    for (uint64_t at = 0; !found && at + 8 <= s.raw.size; at = at ? at * 2 : 512) {
        char bytes[8];
        found = s.raw.read(at, 8, bytes) && std::memcmp(bytes, signature, 8) == 0;
        s.raw_checks = found && at == 0;
    }
    if (!found) in.fail("not an HDF5 file");

    const Lock lock = lock_hdf5();
    take_read_driver_problem();
    {
        Handle access(make_checked_read_access(s.raw), H5Pclose);
        if (!access.valid()) in.fail_hdf5("cannot set up reading");
        s.file = Handle(
            H5Fopen(from_stdin ? "standard input" : path.c_str(), H5F_ACC_RDONLY, access.get()),
            H5Fclose);
        // Now: closing `access` would clear the error stack.
        if (!s.file.valid()) in.fail_hdf5("cannot open the HDF5 file");
    }
    const hid_t root = s.file.get();

    // Identity and version first: they decide whether anything else can be understood.
    if (!FileReader::has_attribute(root, "format", s.source))
        in.fail("not a kvtools cache (no 'format' attribute)");
    const std::string format = in.string_attribute(root, "format", "/");
    if (format != format_name)
        in.fail("not a kvtools cache (format is " + kv::quoted(format) + ", expected " +
                kv::quoted(format_name) + ")");
    s.version = in.string_attribute(root, "format_version", "/");
    int major = -1, minor = -1;
    char rest = 0;
    if (std::sscanf(s.version.c_str(), "%d.%d%c", &major, &minor, &rest) != 2 || major < 0 ||
        minor < 0)
        in.fail("invalid format_version " + kv::quoted(s.version) + " (expected MAJOR.MINOR)");
    if (major != format_major)
        in.fail("format version " + s.version + " is not supported (this reader reads " +
                std::to_string(format_major) + ".x, up to " + std::to_string(format_major) + "." +
                std::to_string(format_minor) + ")");
    std::vector<std::string> unknown;
    for (const std::string& feature : in.string_list_attribute(root, "required_features", "/")) {
        if (!known_features.count(feature)) unknown.push_back(kv::quoted(feature));
        if (feature == ragged_feature) s.ragged_declared = true;
        if (feature == quantized_feature) s.quantized_declared = true;
        if (feature == index_layers_feature) s.index_layers_declared = true;
    }
    if (!unknown.empty()) {
        std::string list;
        for (const std::string& name : unknown)
            list += (list.empty() ? "" : ", ") + name;
        in.fail("requires " + std::string(unknown.size() == 1 ? "feature " : "features ") + list +
                ", which this reader does not implement");
    }
    if (!FileReader::has_attribute(root, "complete", s.source) ||
        in.integer_attribute(root, "complete", "/") != 1)
        in.fail("incomplete file (no 'complete' mark): its writer did not finish");
    const std::string dtype = in.string_attribute(root, "dtype", "/");
    try {
        s.model.dtype = parse_cache_dtype(dtype);
    } catch (const FormatError&) {
        in.fail("unknown dtype " + kv::quoted(dtype) + " (expected f32, bf16 or f16)");
    }
    const int64_t after_rope = in.integer_attribute(root, "keys_after_rope", "/");
    if (after_rope != 1)
        in.fail("keys_after_rope is " + std::to_string(after_rope) +
                "; only keys stored after RoPE (1) are supported");

    {
        Handle group = in.open_group(root, "model", "/model");
        const hid_t g = group.get();
        CacheModelInfo& m = s.model;
        m.model_fingerprint = in.string_attribute(g, "fingerprint", "/model");
        m.model_name = in.string_attribute_or(g, "name", "/model", "");
        m.architecture = in.string_attribute(g, "architecture", "/model");
        m.num_layers = in.integer_attribute(g, "num_layers", "/model");
        m.num_kv_heads = in.integer_attribute(g, "num_kv_heads", "/model");
        m.head_dim = in.integer_attribute(g, "head_dim", "/model");
        m.rope_layout = in.string_attribute(g, "rope_layout", "/model");
        m.rope_theta = in.float_attribute(g, "rope_theta", "/model");
        m.rope_scaling = in.string_attribute_or(g, "rope_scaling", "/model", "");
        m.tokenizer_fingerprint = in.string_attribute(g, "tokenizer_fingerprint", "/model");
        for (const auto& [name, value] :
             {std::pair<const char*, int64_t>{"num_layers", m.num_layers},
              {"num_kv_heads", m.num_kv_heads},
              {"head_dim", m.head_dim}})
            if (value <= 0 || value > (int64_t{1} << 24))
                in.fail("invalid " + std::string(name) + " " + std::to_string(value));
        // What every consumer that rotates keys relies on (section 4.1).
        if (m.rope_layout != "half_split" && m.rope_layout != "interleaved")
            in.fail("unknown rope_layout " + kv::quoted(m.rope_layout) +
                    " (expected half_split or interleaved)");
        if (!(m.rope_theta > 0) || !std::isfinite(m.rope_theta))
            in.fail("rope_theta " + number_text(m.rope_theta) + " is not a positive number");
        if (m.head_dim % 2 != 0)
            in.fail("head_dim " + std::to_string(m.head_dim) +
                    " is odd (RoPE rotates pairs of dimensions)");
    }
    {
        Handle group = in.open_group(root, "provenance", "/provenance");
        const hid_t g = group.get();
        s.provenance.tool = in.string_attribute(g, "tool", "/provenance");
        s.provenance.version = in.string_attribute(g, "version", "/provenance");
        s.provenance.command_line = in.string_attribute(g, "command_line", "/provenance");
        s.provenance.created = in.string_attribute_or(g, "created", "/provenance", "");
    }

    {
        // Only the shape of the directory: its entries are read whole by packets(), or found
        // one by one through /packet_ids (read_directory, find).
        State::IndexDatasets& d = s.index;
        d.group = in.open_group(root, "packet_index", "/packet_index");
        const hid_t g = d.group.get();
        d.id = in.open_dataset(g, "id", "/packet_index/id");
        const std::vector<hsize_t> dims =
            in.dataset_dims(d.id.get(), kv::quoted("/packet_index/id"));
        if (dims.size() != 1) in.fail("'/packet_index/id' is not 1-D");
        s.count = dims[0];
        if (s.count > memory_bytes() / 256)
            in.fail("the packet index lists " + std::to_string(s.count) +
                    " packets, more than this machine's memory can list");
        const std::string length_name = "'/packet_index/id'";
        // The messages of read_directory's whole reads, for the lengths alone.
        auto open = [&](const char* name, bool strings) {
            const std::string what = "/packet_index/" + std::string(name);
            Handle dataset = in.open_dataset(g, name, what);
            const std::vector<hsize_t> shape = in.dataset_dims(dataset.get(), kv::quoted(what));
            if (shape.size() != 1)
                in.fail(kv::quoted(what) + " has shape " + shape_text(shape) + ", not 1-D");
            if (shape[0] != s.count)
                in.fail(kv::quoted(what) + " has " + std::to_string(shape[0]) + " entries, " +
                        length_name + (strings ? " has " : " is ") + std::to_string(s.count));
            return dataset;
        };
        d.text_sha256 = open("text_sha256", true);
        d.adapter_fingerprint = open("adapter_fingerprint", true);
        d.logical_length = open("logical_length", false);
        d.stored_length = open("stored_length", false);
        d.header_tokens = open("header_tokens", false);
        d.trailer_tokens = open("trailer_tokens", false);
        if (s.count > 0) in.open_group(root, "packets", "/packets");
        if (H5Lexists(root, "packet_ids", H5P_DEFAULT) > 0)
            d.packet_ids = in.open_group(root, "packet_ids", "/packet_ids");
        else
            H5Eclear2(H5E_DEFAULT);
        // A file without /packet_ids (before 1.6) has its directory read now, as it always had:
        // finding an id in it means reading every id anyway.
        if (!d.packet_ids.valid()) read_directory();
    }
    s.f16_type = make_f16_type();
}

CacheReader::~CacheReader() {
    if (!state_) return;
    const Lock lock = lock_hdf5();
    state_->index = {};
    state_->f16_type.reset();
    state_->file.reset();
}

namespace {

// The checks section 6.1 asks of every entry, with the messages the whole read has always given.
void check_entry(const FileReader& in, const PacketInfo& info, std::size_t entry) {
    const std::string what = "packet " + kv::quoted(info.id);
    if (info.id.empty())
        in.fail("packet index entry " + std::to_string(entry) + " has an empty id");
    if (!valid_utf8(info.id))
        in.fail("packet index entry " + std::to_string(entry) + " has an id that is not UTF-8");
    if (info.stored_length < 0)
        in.fail(what + ": negative stored_length " + std::to_string(info.stored_length));
    if (info.logical_length < info.stored_length)
        in.fail(what + ": logical_length " + std::to_string(info.logical_length) +
                " is less than stored_length " + std::to_string(info.stored_length));
    if (info.header_tokens < 0 || info.trailer_tokens < 0 ||
        info.header_tokens > info.logical_length - info.trailer_tokens)
        in.fail(what + ": adapter tokens (" + std::to_string(info.header_tokens) + " + " +
                std::to_string(info.trailer_tokens) + ") exceed logical_length " +
                std::to_string(info.logical_length));
}

[[noreturn]] void fail_duplicate(const FileReader& in, const std::string& id, std::size_t a,
                                 std::size_t b) {
    in.fail("duplicate packet id " + kv::quoted(id) + " (entries " +
            std::to_string(std::min(a, b)) + " and " + std::to_string(std::max(a, b)) + ")");
}

// The entry number a /packet_ids link names ("/packets/" and 8 digits), -1 for another value.
int64_t linked_entry(const std::string& value) {
    const std::string prefix = "/packets/";
    if (value.size() != prefix.size() + 8 || value.compare(0, prefix.size(), prefix) != 0)
        return -1;
    int64_t entry = 0;
    for (std::size_t i = prefix.size(); i < value.size(); ++i) {
        if (value[i] < '0' || value[i] > '9') return -1;
        entry = entry * 10 + (value[i] - '0');
    }
    return entry;
}

// The value of the soft link `name` of `group`; nullopt when there is no such link. Throws (by
// `in`) when it is not a soft link.
std::optional<std::string> soft_link(const FileReader& in, hid_t group, const std::string& name,
                                     const std::string& what) {
    const htri_t exists = H5Lexists(group, name.c_str(), H5P_DEFAULT);
    if (exists <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return std::nullopt;
    }
    H5L_info_t info{};
    if (H5Lget_info(group, name.c_str(), &info, H5P_DEFAULT) < 0)
        in.fail_hdf5("cannot read " + what);
    if (info.type != H5L_TYPE_SOFT) in.fail(what + " is not a soft link");
    if (info.u.val_size == 0 || info.u.val_size > 4096) in.fail(what + " is not a packet's path");
    std::string value(info.u.val_size, '\0');
    if (H5Lget_val(group, name.c_str(), value.data(), value.size(), H5P_DEFAULT) < 0)
        in.fail_hdf5("cannot read " + what);
    value.resize(std::strlen(value.c_str()));
    return value;
}

}  // namespace

void CacheReader::read_directory() const {
    State& s = *state_;
    const Lock lock = lock_hdf5();
    if (s.index_read) return;
    const FileReader in(s.source);
    const FileReader checked(s.source, s.raw_checks ? &s.raw : nullptr);
    const State::IndexDatasets& d = s.index;
    const std::string length_name = "'/packet_index/id'";
    auto strings = [&](const Handle& dataset, const char* name) {
        return checked.read_strings(dataset.get(), true, "/packet_index/" + std::string(name), "");
    };
    auto integers = [&](const Handle& dataset, const char* name) {
        std::vector<int64_t> values(s.count);
        if (!values.empty() && read_dataset(dataset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL,
                                            H5P_DEFAULT, values.data()) < 0)
            in.fail_hdf5("cannot read " + kv::quoted("/packet_index/" + std::string(name)));
        return values;
    };
    for (const auto& [dataset, name] :
         {std::pair<const Handle*, const char*>{&d.logical_length, "logical_length"},
          {&d.stored_length, "stored_length"},
          {&d.header_tokens, "header_tokens"},
          {&d.trailer_tokens, "trailer_tokens"}}) {
        Handle type(H5Dget_type(dataset->get()), H5Tclose);
        if (H5Tget_class(type.get()) != H5T_INTEGER)
            in.fail(kv::quoted("/packet_index/" + std::string(name)) + " is not integer");
    }
    const std::vector<std::string> ids = strings(d.id, "id");
    const std::vector<std::string> hashes = strings(d.text_sha256, "text_sha256");
    const std::vector<std::string> adapters = strings(d.adapter_fingerprint, "adapter_fingerprint");
    const std::vector<int64_t> logical = integers(d.logical_length, "logical_length");
    const std::vector<int64_t> stored = integers(d.stored_length, "stored_length");
    const std::vector<int64_t> headers = integers(d.header_tokens, "header_tokens");
    const std::vector<int64_t> trailers = integers(d.trailer_tokens, "trailer_tokens");
    std::vector<PacketInfo> packets;
    std::unordered_map<std::string, std::size_t> by_id;
    packets.reserve(s.count);
    for (std::size_t i = 0; i < s.count; ++i) {
        PacketInfo info{ids[i],      hashes[i],  logical[i], stored[i],
                        adapters[i], headers[i], trailers[i]};
        check_entry(in, info, i);
        const auto [at, inserted] = by_id.emplace(info.id, i);
        if (!inserted) fail_duplicate(in, info.id, at->second, i);
        packets.push_back(std::move(info));
    }
    const std::lock_guard directory(s.directory_mutex);
    s.packets = std::move(packets);
    s.by_id = std::move(by_id);
    s.index_read = true;  // (the entries found before stay: callers may hold them)
}

std::pair<const PacketInfo*, std::size_t> CacheReader::find(const std::string& id) const {
    State& s = *state_;
    auto known = [&]() -> std::optional<std::pair<const PacketInfo*, std::size_t>> {
        const std::lock_guard directory(s.directory_mutex);
        if (const auto at = s.found.find(id); at != s.found.end())
            return std::pair(&at->second.first, at->second.second);
        if (s.index_read) {
            const auto at = s.by_id.find(id);
            if (at == s.by_id.end()) return std::pair<const PacketInfo*, std::size_t>(nullptr, 0);
            return std::pair(&s.packets[at->second], at->second);
        }
        return std::nullopt;
    };
    if (const auto answer = known()) return *answer;
    const Lock lock = lock_hdf5();
    if (const auto answer = known()) return *answer;  // found meanwhile
    // Past a 32nd of the store (and 64), reading the directory whole costs less than the lookups
    // to come: ~25 ms for 10,000 entries against ~0.1 ms a lookup.
    if (!s.directory_unreadable &&
        ++s.links_followed > std::max<std::size_t>(64, static_cast<std::size_t>(s.count) / 32)) {
        try {
            read_directory();
        } catch (const FormatError&) {
            s.directory_unreadable = true;
        }
        if (const auto answer = known()) return *answer;
    }
    // One lookup of the packet's link (section 6.1); the group it leads to gives the entry.
    const FileReader in(s.source);
    const FileReader checked(s.source, s.raw_checks ? &s.raw : nullptr);
    const State::IndexDatasets& d = s.index;
    const std::string link = "/packet_ids/" + packet_link_name(id);
    const std::string what = "packet " + kv::quoted(id) + ": its link " + kv::quoted(link);
    const std::optional<std::string> value =
        soft_link(in, d.packet_ids.get(), packet_link_name(id), what);
    if (!value) return {nullptr, 0};
    const int64_t entry = linked_entry(*value);
    if (entry < 0 || static_cast<hsize_t>(entry) >= s.count)
        in.fail(what + " leads to " + kv::quoted(*value) + ", not to a packet of the index (" +
                std::to_string(s.count) + ")");
    const auto ordinal = static_cast<std::size_t>(entry);
    Handle group = in.open_group(s.file.get(), *value, *value);
    const hid_t g = group.get();
    PacketInfo info;
    info.id = checked.string_attribute(g, "id", *value);
    if (info.id != id)
        in.fail(what + " leads to " + kv::quoted(*value) + ", whose id is " + kv::quoted(info.id));
    info.logical_length = in.integer_attribute(g, "logical_length", *value);
    info.stored_length = in.integer_attribute(g, "stored_length", *value);
    // The optional ones from the group, else from the index entry.
    auto text = [&](const char* name, const Handle& dataset) {
        return FileReader::has_attribute(g, name)
                   ? checked.string_attribute(g, name, *value)
                   : checked.string_element(dataset.get(), ordinal,
                                            "/packet_index/" + std::string(name));
    };
    auto number = [&](const char* name, const Handle& dataset) {
        return FileReader::has_attribute(g, name)
                   ? in.integer_attribute(g, name, *value)
                   : in.integer_element(dataset.get(), ordinal,
                                        "/packet_index/" + std::string(name));
    };
    info.text_sha256 = text("text_sha256", d.text_sha256);
    info.adapter_fingerprint = text("adapter_fingerprint", d.adapter_fingerprint);
    info.header_tokens = number("header_tokens", d.header_tokens);
    info.trailer_tokens = number("trailer_tokens", d.trailer_tokens);
    check_entry(in, info, ordinal);
    const std::lock_guard directory(s.directory_mutex);
    const auto at = s.found.emplace(id, std::pair(std::move(info), ordinal)).first;
    return {&at->second.first, at->second.second};
}

void CacheReader::check_packet_ids() const {
    const State& s = *state_;
    const std::vector<PacketInfo>& all = packets();
    const Lock lock = lock_hdf5();
    const hid_t group = s.index.packet_ids.get();
    if (group < 0) return;
    const FileReader in(s.source);
    H5G_info_t info{};
    if (H5Gget_info(group, &info) < 0) in.fail_hdf5("cannot read '/packet_ids'");
    for (std::size_t i = 0; i < all.size(); ++i) {
        const std::string link = "/packet_ids/" + packet_link_name(all[i].id);
        const std::string what =
            "packet " + kv::quoted(all[i].id) + ": its link " + kv::quoted(link);
        const std::optional<std::string> value =
            soft_link(in, group, packet_link_name(all[i].id), what);
        if (!value) in.fail("packet " + kv::quoted(all[i].id) + " has no link in '/packet_ids'");
        if (*value != "/packets/" + packet_group_name(i))
            in.fail(what + " leads to " + kv::quoted(*value) + ", not to " +
                    kv::quoted("/packets/" + packet_group_name(i)));
    }
    if (info.nlinks != all.size())
        in.fail("'/packet_ids' holds " + std::to_string(info.nlinks) + " links for " +
                std::to_string(all.size()) + " packets");
}

const std::string& CacheReader::source() const {
    return state_->source;
}
const std::string& CacheReader::format_version() const {
    return state_->version;
}
const CacheModelInfo& CacheReader::model() const {
    return state_->model;
}
const Provenance& CacheReader::provenance() const {
    return state_->provenance;
}
const std::vector<PacketInfo>& CacheReader::packets() const {
    read_directory();
    return state_->packets;
}

bool CacheReader::has_packet(const std::string& id) const {
    return find(id).first != nullptr;
}

const PacketInfo& CacheReader::packet_info(const std::string& id) const {
    return *entry(id).first;
}

std::pair<const PacketInfo*, std::size_t> CacheReader::entry(const std::string& id) const {
    const auto found = find(id);
    if (!found.first) {
        const State& s = *state_;
        // Name a few of the ids it does hold: the usual cause is a typo or the wrong file.
        std::string held;
        {
            const Lock lock = lock_hdf5();
            const FileReader checked(s.source, s.raw_checks ? &s.raw : nullptr);
            for (std::size_t i = 0; i < s.count && i < 5; ++i)
                held += (i ? ", " : "") +
                        kv::quoted(s.index_read ? s.packets[i].id
                                                : checked.string_element(s.index.id.get(), i,
                                                                         "/packet_index/id"));
        }
        if (s.count > 5) held += ", ...";
        throw FormatError("no packet " + kv::quoted(id) + " in " + s.source +
                          (held.empty()
                               ? " (it holds no packet)"
                               : " (it holds " + std::to_string(s.count) + ": " + held + ")"));
    }
    return found;
}

Packet CacheReader::read(const std::string& id) const {
    return read_packet(id, true, nullptr);
}

Packet CacheReader::read_without_tensors(const std::string& id) const {
    return read_packet(id, false, nullptr);
}

Packet CacheReader::read_without_tensors_or_layouts(const std::string& id) const {
    return read_packet(id, false, nullptr, false);
}

DciLayout CacheReader::read_index_layout(const std::string& id, int64_t layer, int64_t head,
                                         int64_t segment) const {
    const State& s = *state_;
    const auto [found, ordinal] = entry(id);
    const PacketInfo& info = *found;
    const CacheModelInfo& m = s.model;
    if (layer < 0 || layer >= m.num_layers || head < 0 || head >= m.num_kv_heads || segment < 0)
        throw UsageError("no index layout for layer " + std::to_string(layer) + ", kv-head " +
                         std::to_string(head) + ", segment " + std::to_string(segment) + " in " +
                         s.source);
    const FileReader in(s.source + ": packet " + kv::quoted(id), s.raw_checks ? &s.raw : nullptr);
    const std::string path = "/packets/" + packet_group_name(ordinal);
    const Lock lock = lock_hdf5();
    Handle group = in.open_group(s.file.get(), path, path);
    PacketIndex index = read_index(
        in, group.get(), m, info.stored_length,
        {LayoutChoice::Which::one, static_cast<std::size_t>(layer * m.num_kv_heads + head),
         static_cast<std::size_t>(segment)});
    if (index.empty()) in.fail("has no index");
    if (index.layouts.size() != 1)
        in.fail("has no index of layer " + std::to_string(layer) + " (it covers layers " + [&] {
            std::string list;
            for (int64_t covered : index.layers)
                list += (list.empty() ? "" : ", ") + std::to_string(covered);
            return list;
        }() + ")");
    const std::string problem = index_layout_problem(
        index.layouts.front(), index.segments.at(static_cast<std::size_t>(segment)).count,
        index.page_size);
    if (!problem.empty())
        in.fail("invalid index of layer " + std::to_string(layer) + ", kv-head " +
                std::to_string(head) + ", segment " + std::to_string(segment) + ": " + problem);
    return std::move(index.layouts.front());
}

void CacheReader::read_planes(const std::string& id, const PlaneReceiver& receive) const {
    read_packet(id, false, &receive);
}

namespace {

// The planes of a contiguous [L, H, T, D] tensor of `row_bytes` rows.
PlaneTargets contiguous_planes(std::byte* data, int64_t layers, int64_t heads, int64_t tokens,
                               std::size_t row_bytes) {
    PlaneTargets planes;
    planes.head_stride = static_cast<std::size_t>(tokens) * row_bytes;
    for (int64_t layer = 0; layer < layers; ++layer)
        planes.layers.push_back(data +
                                static_cast<std::size_t>(layer * heads) * planes.head_stride);
    return planes;
}

}  // namespace

Packet CacheReader::read_into(const std::string& id, std::span<std::byte> keys,
                              std::span<std::byte> values) const {
    const CacheModelInfo& m = state_->model;
    const PacketInfo& info = packet_info(id);
    const std::size_t row_bytes = static_cast<std::size_t>(m.head_dim) * cache_dtype_size(m.dtype);
    std::size_t bytes = 0;
    try {
        bytes = checked_elements({m.num_layers, m.num_kv_heads, info.stored_length, m.head_dim}) *
                cache_dtype_size(m.dtype);
    } catch (const FormatError&) {
        throw FormatError(state_->source + ": packet " + kv::quoted(id) + ": stored_length " +
                          std::to_string(info.stored_length) + " is too large");
    }
    if (keys.size() != bytes || values.size() != bytes)
        throw UsageError(state_->source + ": packet " + kv::quoted(id) +
                         ": its keys and values are " + std::to_string(bytes) +
                         " bytes each, not " + std::to_string(keys.size()) + " and " +
                         std::to_string(values.size()));
    const std::pair<PlaneTargets, PlaneTargets> into(
        contiguous_planes(keys.data(), m.num_layers, m.num_kv_heads, info.stored_length, row_bytes),
        contiguous_planes(values.data(), m.num_layers, m.num_kv_heads, info.stored_length,
                          row_bytes));
    return read_packet(id, false, nullptr, true, &into);
}

Packet CacheReader::read_into(const std::string& id, const PlaneTargets& keys,
                              const PlaneTargets& values, bool with_layouts) const {
    const CacheModelInfo& m = state_->model;
    if (keys.layers.size() != static_cast<std::size_t>(m.num_layers) ||
        values.layers.size() != keys.layers.size())
        throw UsageError(state_->source + ": packet " + kv::quoted(id) + ": planes for " +
                         std::to_string(keys.layers.size()) + " and " +
                         std::to_string(values.layers.size()) + " layers, the file has " +
                         std::to_string(m.num_layers));
    const std::pair<PlaneTargets, PlaneTargets> into(keys, values);
    return read_packet(id, false, nullptr, with_layouts, &into);
}

Packet CacheReader::read_packet(const std::string& id, bool with_tensors,
                                const PlaneReceiver* receive, bool with_layouts,
                                const std::pair<PlaneTargets, PlaneTargets>* into) const {
    const State& s = *state_;
    const auto [found, ordinal] = entry(id);
    const PacketInfo& info = *found;
    const FileReader in(s.source + ": packet " + kv::quoted(id), s.raw_checks ? &s.raw : nullptr);
    const std::string path = "/packets/" + packet_group_name(ordinal);
    const CacheModelInfo& m = s.model;

    // An entry found through /packet_ids was read from this very group (find checked its id and
    // took the lengths from it); one from the directory is checked against the group here.
    bool read_from_group = false;
    {
        const std::lock_guard directory(state_->directory_mutex);
        const auto at = s.found.find(id);
        read_from_group = at != s.found.end() && &at->second.first == found;
    }
    const Lock lock = lock_hdf5();
    Handle group = in.open_group(s.file.get(), path, path);
    const hid_t g = group.get();
    if (!read_from_group) {
        if (in.string_attribute(g, "id", path) != id)
            in.fail("the id of group " + kv::quoted(path) + " differs from the packet index");
        for (const auto& [name, value] :
             {std::pair<const char*, int64_t>{"logical_length", info.logical_length},
              {"stored_length", info.stored_length}})
            if (in.integer_attribute(g, name, path) != value)
                in.fail(std::string(name) + " of group " + kv::quoted(path) +
                        " differs from the packet index");
    }

    Packet packet;
    packet.id = info.id;
    packet.text_sha256 = info.text_sha256;
    packet.logical_length = info.logical_length;
    packet.adapter_fingerprint = info.adapter_fingerprint;
    packet.header_tokens = info.header_tokens;
    packet.trailer_tokens = info.trailer_tokens;
    const hsize_t length = static_cast<hsize_t>(info.stored_length);

    if (info.stored_length > static_cast<int64_t>(memory_bytes() / 16))
        in.fail("stored_length " + std::to_string(info.stored_length) +
                " exceeds this machine's memory");
    const std::vector<int64_t> token_ids =
        in.integer_dataset(g, "token_ids", "token_ids", length, "stored_length");
    packet.token_ids.reserve(token_ids.size());
    for (int64_t token : token_ids) {
        if (token < -1 || token > std::numeric_limits<int32_t>::max())
            in.fail("invalid token id " + std::to_string(token));
        packet.token_ids.push_back(static_cast<int32_t>(token));
    }
    packet.positions = in.integer_dataset(g, "positions", "positions", length, "stored_length");
    for (int64_t position : packet.positions)
        if (position < 0 || position >= info.logical_length)
            in.fail("position " + std::to_string(position) + " is outside [0, logical_length " +
                    std::to_string(info.logical_length) + ")");

    const bool quantized = H5Lexists(g, "quantized", H5P_DEFAULT) > 0;
    std::size_t bytes = 0;
    try {
        bytes = checked_elements({m.num_layers, m.num_kv_heads, info.stored_length, m.head_dim}) *
                cache_dtype_size(m.dtype);
    } catch (const FormatError&) {
        in.fail("stored_length " + std::to_string(info.stored_length) + " is too large");
    }
    // A sparse or hostile file can declare more than fits; fail rather than meet the OOM killer.
    if ((with_tensors || quantized) && bytes > memory_bytes() / 2)
        in.fail("its keys and values need " + std::to_string(2 * bytes) +
                " bytes, more than this machine's memory");
    // A dataset of keys or values in the file's dtype and of the given shape, and the memory
    // type it is read as.
    auto open_tensor = [&](hid_t parent, const std::string& name, hsize_t tokens) {
        const std::vector<hsize_t> expected = {static_cast<hsize_t>(m.num_layers),
                                               static_cast<hsize_t>(m.num_kv_heads), tokens,
                                               static_cast<hsize_t>(m.head_dim)};
        Handle dataset = in.open_dataset(parent, name, name);
        const std::vector<hsize_t> dims = in.dataset_dims(dataset.get(), kv::quoted(name));
        if (dims != expected)
            in.fail(kv::quoted(name) + " has shape " + shape_text(dims) + ", expected " +
                    shape_text(expected) + " (layers, kv-heads, tokens, head_dim)");
        Handle type(H5Dget_type(dataset.get()), H5Tclose);
        const H5T_class_t type_class = H5Tget_class(type.get());
        const std::size_t size = H5Tget_size(type.get());
        in.require_stored(dataset.get(),
                          static_cast<double>(m.num_layers) * m.num_kv_heads *
                              static_cast<double>(tokens) * m.head_dim * size,
                          name);
        hid_t memory_type = H5T_NATIVE_FLOAT;
        bool matches = false;
        switch (m.dtype) {
            case CacheDtype::f32:
                matches = type_class == H5T_FLOAT && size == 4;
                break;
            case CacheDtype::f16: {
                std::size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
                matches = type_class == H5T_FLOAT && size == 2 &&
                          H5Tget_fields(type.get(), &spos, &epos, &esize, &mpos, &msize) >= 0 &&
                          spos == 15 && epos == 10 && esize == 5 && mpos == 0 && msize == 10 &&
                          H5Tget_ebias(type.get()) == 15;
                memory_type = s.f16_type.get();
                break;
            }
            case CacheDtype::bf16:
                matches = type_class == H5T_INTEGER && size == 2 &&
                          H5Tget_sign(type.get()) == H5T_SGN_NONE;
                if (matches && in.string_attribute_or(dataset.get(), "dtype", name, "") != "bf16")
                    in.fail(kv::quoted(name) + " lacks the attribute dtype = 'bf16'");
                memory_type = H5T_NATIVE_UINT16;
                break;
        }
        if (!matches)
            in.fail(kv::quoted(name) + " are not stored as " + cache_dtype_name(m.dtype) +
                    " (the file's dtype)");
        // Whether the stored bytes are the memory type's, so that they can be read without
        // HDF5's conversion (little-endian, and f32 the IEEE layout).
        const bool same_bytes =
            H5Tget_order(type.get()) == H5T_ORDER_LE &&
            (m.dtype != CacheDtype::f32 || H5Tequal(type.get(), H5T_IEEE_F32LE) > 0);
        H5Eclear2(H5E_DEFAULT);
        return std::tuple<Handle, hid_t, bool>(std::move(dataset), memory_type, same_bytes);
    };
    const std::size_t row_bytes = static_cast<std::size_t>(m.head_dim) * cache_dtype_size(m.dtype);
    // A whole tensor (keys, values, a quantised residual), into the planes of `target`.
    auto read_opened_tensor_to = [&](std::tuple<Handle, hid_t, bool> opened,
                                     const std::string& name, hsize_t tokens,
                                     const PlaneTargets& target) {
        auto [dataset, memory_type, same_bytes] = std::move(opened);
        if (tokens == 0 || m.num_layers == 0 || m.num_kv_heads == 0 || m.head_dim == 0) return;
        // Chunks read, checked and decompressed on every core straight into `target` where the
        // layout allows (section 7); else, or when a chunk is not as it should be, through
        // HDF5's filter pipeline, which reports what is wrong in its words.
        const hsize_t dims[4] = {static_cast<hsize_t>(m.num_layers),
                                 static_cast<hsize_t>(m.num_kv_heads), tokens,
                                 static_cast<hsize_t>(m.head_dim)};
        if (same_bytes && s.raw_checks &&
            read_tensor_directly(dataset.get(), s.raw, cache_dtype_size(m.dtype), dims, target,
                                 s.threads))
            return;
        // Read by HDF5: every plane has landed when it returns.
        auto report_landed = [&] {
            if (!target.landed) return;
            for (hsize_t layer = 0; layer < dims[0]; ++layer)
                for (hsize_t head = 0; head < dims[1]; ++head)
                    target.landed(layer, head, 0, tokens);
        };
        const std::size_t plane_bytes = static_cast<std::size_t>(tokens) * row_bytes;
        bool contiguous = target.head_stride == plane_bytes;
        for (std::size_t layer = 1; contiguous && layer < target.layers.size(); ++layer)
            contiguous = target.layers[layer] == target.layers[0] + layer * dims[1] * plane_bytes;
        if (contiguous) {
            if (read_dataset(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                             target.layers[0]) < 0)
                in.fail_hdf5("cannot read " + kv::quoted(name));
            report_landed();
            return;
        }
        // A layer at a time into its planes, `head_stride` apart: a memory dataspace of heads
        // that long, of which the first T rows of each are selected.
        if (target.head_stride % row_bytes != 0 || target.head_stride < plane_bytes)
            throw UsageError(s.source + ": packet planes " + std::to_string(target.head_stride) +
                             " bytes apart cannot hold " + std::to_string(tokens) + " rows of " +
                             std::to_string(row_bytes) + " bytes");
        const hsize_t memory_dims[3] = {dims[1], target.head_stride / row_bytes, dims[3]};
        const hsize_t memory_start[3] = {0, 0, 0}, memory_count[3] = {dims[1], tokens, dims[3]};
        Handle memory_space(H5Screate_simple(3, memory_dims, nullptr), H5Sclose);
        Handle file_space(H5Dget_space(dataset.get()), H5Sclose);
        if (H5Sselect_hyperslab(memory_space.get(), H5S_SELECT_SET, memory_start, nullptr,
                                memory_count, nullptr) < 0)
            in.fail_hdf5("cannot read " + kv::quoted(name));
        for (hsize_t layer = 0; layer < dims[0]; ++layer) {
            const hsize_t start[4] = {layer, 0, 0, 0}, count[4] = {1, dims[1], tokens, dims[3]};
            if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, count,
                                    nullptr) < 0 ||
                read_dataset(dataset.get(), memory_type, memory_space.get(), file_space.get(),
                             H5P_DEFAULT, target.layers[layer]) < 0)
                in.fail_hdf5("cannot read " + kv::quoted(name));
        }
        report_landed();
    };
    auto read_tensor_to = [&](hid_t parent, const std::string& name, hsize_t tokens,
                              const PlaneTargets& target) {
        read_opened_tensor_to(open_tensor(parent, name, tokens), name, tokens, target);
    };
    // Opened (its shape and stored bytes checked) before its memory is set aside.
    auto read_tensor = [&](hid_t parent, const std::string& name, hsize_t tokens,
                           std::vector<std::byte>& target) {
        auto opened = open_tensor(parent, name, tokens);
        resize_for_bulk_read(
            target, static_cast<std::size_t>(m.num_layers * m.num_kv_heads) * tokens * row_bytes);
        read_opened_tensor_to(std::move(opened), name, tokens,
                              contiguous_planes(target.data(), m.num_layers, m.num_kv_heads,
                                                static_cast<int64_t>(tokens), row_bytes));
    };
    if (receive && !quantized) {
        // One (layer, kv-head) plane at a time, in pieces of at most 16,384 tokens: the chunks
        // [1, 1, T, D] are read in order and memory holds one piece, however long the packet.
        const auto row_bytes = static_cast<std::size_t>(m.head_dim) * cache_dtype_size(m.dtype);
        const hsize_t piece_tokens = std::min<hsize_t>(length, 16384);
        std::vector<std::byte> piece(static_cast<std::size_t>(piece_tokens) * row_bytes);
        for (const bool keys : {true, false}) {
            const char* name = keys ? "keys" : "values";
            auto [dataset, memory_type, same_bytes] = open_tensor(g, name, length);
            (void)same_bytes;
            Handle file_space(H5Dget_space(dataset.get()), H5Sclose);
            for (int64_t layer = 0; layer < m.num_layers; ++layer)
                for (int64_t head = 0; head < m.num_kv_heads; ++head)
                    for (hsize_t first = 0; first < length; first += piece_tokens) {
                        const hsize_t count[4] = {1, 1, std::min(piece_tokens, length - first),
                                                  static_cast<hsize_t>(m.head_dim)};
                        const hsize_t start[4] = {static_cast<hsize_t>(layer),
                                                  static_cast<hsize_t>(head), first, 0};
                        Handle memory_space(H5Screate_simple(4, count, nullptr), H5Sclose);
                        if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr,
                                                count, nullptr) < 0 ||
                            read_dataset(dataset.get(), memory_type, memory_space.get(),
                                         file_space.get(), H5P_DEFAULT, piece.data()) < 0)
                            in.fail_hdf5("cannot read " + kv::quoted(name));
                        (*receive)(layer, head, keys, static_cast<int64_t>(first),
                                   std::span<const std::byte>(piece).first(
                                       static_cast<std::size_t>(count[2]) * row_bytes));
                    }
        }
    }
    if (quantized && (with_tensors || receive || into)) {
        if (!s.quantized_declared)
            in.fail("is quantised but the file does not list the feature " +
                    kv::quoted(quantized_feature));
        read_quantized(in, g, m, info.stored_length, read_tensor, packet);
        if (into) {  // dequantised, then copied plane by plane
            const std::size_t plane_bytes =
                static_cast<std::size_t>(info.stored_length) * row_bytes;
            for (int64_t layer = 0; layer < m.num_layers; ++layer)
                for (int64_t head = 0; head < m.num_kv_heads; ++head) {
                    const std::size_t at =
                        static_cast<std::size_t>(layer * m.num_kv_heads + head) * plane_bytes;
                    const auto l = static_cast<std::size_t>(layer),
                               h = static_cast<std::size_t>(head);
                    std::memcpy(into->first.plane(l, h), packet.keys.data() + at, plane_bytes);
                    std::memcpy(into->second.plane(l, h), packet.values.data() + at, plane_bytes);
                    const auto rows = static_cast<std::size_t>(info.stored_length);
                    if (into->first.landed) into->first.landed(l, h, 0, rows);
                    if (into->second.landed) into->second.landed(l, h, 0, rows);
                }
            packet.keys = {};
            packet.values = {};
        }
    } else if (into) {
        read_tensor_to(g, "keys", length, into->first);
        read_tensor_to(g, "values", length, into->second);
    } else if (with_tensors) {
        read_tensor(g, "keys", length, packet.keys);
        read_tensor(g, "values", length, packet.values);
    }
    if (receive && quantized) {
        // Dequantised whole (the codes are read in one piece), then handed out plane by plane.
        const std::size_t plane_bytes = static_cast<std::size_t>(info.stored_length) *
                                        static_cast<std::size_t>(m.head_dim) *
                                        cache_dtype_size(m.dtype);
        for (const bool keys : {true, false}) {
            std::vector<std::byte>& tensor = keys ? packet.keys : packet.values;
            for (int64_t layer = 0; layer < m.num_layers; ++layer)
                for (int64_t head = 0; head < m.num_kv_heads; ++head)
                    (*receive)(
                        layer, head, keys, 0,
                        std::span<const std::byte>(tensor).subspan(
                            static_cast<std::size_t>(layer * m.num_kv_heads + head) * plane_bytes,
                            plane_bytes));
            tensor = {};
        }
        packet.stored_quantized.reset();
    }
    if (format::has_head_positions(g)) {
        if (!s.ragged_declared)
            in.fail(
                "has per-head kept tokens (head_lengths) but the file does not list the "
                "feature " +
                kv::quoted(ragged_feature));
        read_head_positions(in, g, m, packet);
    }
    packet.index =
        read_index(in, g, m, info.stored_length,
                   {with_layouts ? LayoutChoice::Which::all : LayoutChoice::Which::none});
    if (packet.padded() && !packet.index.empty())
        in.fail("has an index over heads of unequal lengths, which is not defined");
    if (!packet.index.layers.empty() && !s.index_layers_declared)
        in.fail("has an index over some layers only but the file does not list the feature " +
                kv::quoted(index_layers_feature));
    // What decoding and packing rely on (packet_rules.hpp).
    if (!packet.ragged()) {
        const std::string problem = positions_problem(packet.positions);
        if (!problem.empty()) in.fail(problem);
    }
    if (!packet.index.empty()) {
        std::string problem = index_segments_problem(packet.index, packet.positions);
        if (!problem.empty()) in.fail("invalid index: " + problem);
        const std::size_t segments = packet.index.segments.size();
        for (std::size_t i = 0; i < packet.index.layouts.size(); ++i) {
            const std::size_t row = i / segments / static_cast<std::size_t>(m.num_kv_heads);
            problem = index_layout_problem(packet.index.layouts[i],
                                           packet.index.segments[i % segments].count,
                                           packet.index.page_size);
            if (!problem.empty())
                in.fail("invalid index of layer " +
                        std::to_string(packet.index.layers.empty() ? static_cast<int64_t>(row)
                                                                   : packet.index.layers.at(row)) +
                        ", kv-head " +
                        std::to_string(i / segments % static_cast<std::size_t>(m.num_kv_heads)) +
                        ", segment " + std::to_string(i % segments) + ": " + problem);
        }
    }
    return packet;
}

bool CacheReader::packet_has(const std::string& id, const char* child) const {
    const State& s = *state_;
    const std::string path = "/packets/" + packet_group_name(entry(id).second) + "/" + child;
    const Lock lock = lock_hdf5();
    const htri_t exists = H5Lexists(s.file.get(), path.c_str(), H5P_DEFAULT);
    if (exists < 0) H5Eclear2(H5E_DEFAULT);
    return exists > 0;
}

void CacheReader::set_threads(int threads) {
    state_->threads = std::max(threads, 0);
}

bool CacheReader::has_index(const std::string& id) const {
    return packet_has(id, "index");
}

Quantization CacheReader::quantization(const std::string& id) const {
    const State& s = *state_;
    const Lock lock = lock_hdf5();
    if (!packet_has(id, "quantized")) return {};
    const FileReader in(s.source + ": packet " + kv::quoted(id), s.raw_checks ? &s.raw : nullptr);
    const std::string path = "/packets/" + packet_group_name(entry(id).second) + "/quantized";
    Handle group = in.open_group(s.file.get(), path, path);
    return read_quantization(in, group.get());
}

TensorLayout CacheReader::tensor_layout() const {
    const State& s = *state_;
    const Lock lock = lock_hdf5();
    const FileReader in(s.source);
    TensorLayout layout;
    layout.name = in.string_attribute_or(s.file.get(), "tensor_layout", "/", "");
    for (const PacketInfo& info : packets()) {
        if (info.stored_length == 0) continue;
        const std::string path = "/packets/" + packet_group_name(entry(info.id).second) + "/keys";
        const htri_t exists = H5Lexists(s.file.get(), path.c_str(), H5P_DEFAULT);
        if (exists <= 0) {
            H5Eclear2(H5E_DEFAULT);
            continue;
        }
        Handle dataset = in.open_dataset(s.file.get(), path, path);
        const TensorStorage storage = tensor_storage(dataset.get());
        layout.storage = storage.layout;
        layout.chunk_tokens = storage.chunk_tokens;
        layout.filters = storage.filters;
        layout.zstd_level = storage.zstd_level;
        break;
    }
    return layout;
}

bool CacheReader::has_adapter() const {
    const Lock lock = lock_hdf5();
    const htri_t exists = H5Lexists(state_->file.get(), "adapter", H5P_DEFAULT);
    if (exists < 0) H5Eclear2(H5E_DEFAULT);
    return exists > 0;
}

Adapter CacheReader::read_adapter() const {
    const State& s = *state_;
    if (!has_adapter())
        throw FormatError(s.source + " holds no adapter (kvtrain writes adapter files)");
    const Lock lock = lock_hdf5();
    const FileReader in(s.source, s.raw_checks ? &s.raw : nullptr);
    return format::read_adapter(in, s.file.get());
}

bool CacheReader::has_head_positions(const std::string& id) const {
    return packet_has(id, "head_lengths");
}

}  // namespace kv
