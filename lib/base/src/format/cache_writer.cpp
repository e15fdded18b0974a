#include "kv/format/cache_writer.hpp"

#include "adapter_codec.hpp"
#include "hdf5_checksum.hpp"
#include "hdf5_file.hpp"
#include "head_positions_codec.hpp"
#include "index_codec.hpp"
#include "kv/error.hpp"
#include "kv/format/quantize.hpp"
#include "kv/output_path.hpp"
#include "packet_rules.hpp"
#include "quantized_codec.hpp"
#include "spec.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <unordered_set>

static_assert(std::endian::native == std::endian::little,
              "tensors cross the cache file API as little-endian bytes");

namespace kv {

using namespace format;

namespace {

void write_all(int fd, const void* data, std::size_t size, const std::string& what) {
    const auto* bytes = static_cast<const char*>(data);
    while (size > 0) {
        const ssize_t n = ::write(fd, bytes, size);
        if (n < 0) {
            if (errno == EINTR) continue;
            throw IoError("cannot write " + what + ": " + system_reason());
        }
        bytes += n;
        size -= static_cast<std::size_t>(n);
    }
}

// H5Fget_file_image clears the superblock's status flags in the image without recomputing the
// checksum of version 2 and 3 superblocks, so the image does not open (HDF5 issue #1915, fixed
// in 2025). Recomputing it is right whether or not the library has the fix.
void fix_superblock_checksum(std::vector<char>& image) {
    auto* bytes = reinterpret_cast<unsigned char*>(image.data());
    if (image.size() < 12 || std::memcmp(bytes, "\x89HDF\r\n\x1a\n", 8) != 0) return;
    if (bytes[8] != 2 && bytes[8] != 3) return;
    // signature, version, offset and length sizes, flags, then 4 addresses, then the checksum.
    const std::size_t checked = 12 + 4 * std::size_t{bytes[9]};
    if (image.size() < checked + 4) return;
    const uint32_t checksum = hdf5_lookup3(bytes, checked);
    for (int i = 0; i < 4; ++i)
        bytes[checked + i] = static_cast<unsigned char>(checksum >> (8 * i));
}

}  // namespace

struct CacheWriter::State {
    std::filesystem::path path;
    std::string source;  // quoted, for messages
    bool to_stdout = false;
    std::optional<OutputPath> output;  // where the file goes (not for stdout)
    bool in_memory = false;  // built as an image: standard output, a device or a FIFO
    std::filesystem::path temporary;  // the file being written (empty when in memory)
    CacheModelInfo model;
    Provenance provenance;
    CacheWriteOptions options;
    Handle file;
    Handle packets;
    Handle packet_ids;     // a soft link per packet, named by its id (section 6.1)
    Handle link_creation;  // UTF-8 link names
    Handle key_type;  // file datatype of keys and values
    std::vector<PacketInfo> infos;
    std::unordered_set<std::string> ids;
    bool finished = false;
    bool broken = false;  // an HDF5 write failed midway: the file cannot be finished
    bool has_ragged = false;
    bool has_quantized = false;
    bool has_index_layers = false;  // an index covers only some layers
    std::optional<Adapter> adapter;

    void discard() {  // with the HDF5 lock held
        packets.reset();
        packet_ids.reset();
        link_creation.reset();
        key_type.reset();
        file.reset();
        if (!temporary.empty()) ::unlink(temporary.c_str());
        temporary.clear();
    }
};

CacheWriter::CacheWriter(const std::filesystem::path& path, const CacheModelInfo& model,
                         const Provenance& provenance, const CacheWriteOptions& options)
    : state_(std::make_unique<State>()) {
    State& s = *state_;
    s.path = path;
    s.to_stdout = path == "-";
    s.source = s.to_stdout ? "standard output" : kv::quoted(path.string());
    s.model = model;
    s.provenance = provenance;
    s.options = options;
    if (model.num_layers <= 0 || model.num_kv_heads <= 0 || model.head_dim <= 0)
        throw UsageError("cache shapes must be positive (num_layers " +
                         std::to_string(model.num_layers) + ", num_kv_heads " +
                         std::to_string(model.num_kv_heads) + ", head_dim " +
                         std::to_string(model.head_dim) + ")");
    if (options.zstd_level < 0 || options.zstd_level > 22)
        throw UsageError("zstd level " + std::to_string(options.zstd_level) +
                         " is out of range (0-22)");
    if (options.chunk_tokens < 0)
        throw UsageError("chunk_tokens must be positive (or 0: chunks of 1 MiB), not " +
                         std::to_string(options.chunk_tokens));
    if (s.to_stdout && !options.force && ::isatty(STDOUT_FILENO))
        throw UsageError(
            "refusing to write binary cache data to a terminal (use -o FILE, or --force)");
    if (!s.to_stdout) s.output.emplace(path);
    // HDF5 seeks: a device or a FIFO gets the file's image, as standard output does.
    s.in_memory = s.to_stdout || s.output->stream();

    const Lock lock = lock_hdf5();
    Handle access(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    // The 1.10 object formats make a small packet ~2.5 KB instead of ~17 KB (compact groups,
    // fixed-array chunk indexes); pinning the upper bound keeps files readable by HDF5 1.10 when
    // written by a later library.
    H5Pset_libver_bounds(access.get(), H5F_LIBVER_V110, H5F_LIBVER_V110);
    // The root group is created with the file: its times come from the file creation list.
    Handle creation(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
    H5Pset_obj_track_times(creation.get(), false);
    if (s.in_memory) {
        H5Pset_fapl_core(access.get(), 1 << 20, false);
        // The core driver tells files apart by name: each image gets its own.
        static int64_t images = 0;
        const std::string name =
            "kvcache-image-" + std::to_string(::getpid()) + "-" + std::to_string(++images);
        s.file =
            Handle(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, creation.get(), access.get()), H5Fclose);
        if (!s.file.valid())
            throw IoError("cannot create an in-memory cache file: " + hdf5_error_detail());
    } else {
        // Created by us first (with the mode and owner of the file it replaces): the system's
        // reason reads better than HDF5's.
        s.temporary = s.output->create_temporary();
#if H5_VERSION_GE(1, 10, 7)
        H5Pset_file_locking(access.get(), false, true);
#endif
        s.file = Handle(H5Fcreate(s.temporary.c_str(), H5F_ACC_TRUNC, creation.get(), access.get()),
                        H5Fclose);
        if (!s.file.valid()) {
            const std::string detail = hdf5_error_detail();
            s.discard();
            throw IoError("cannot create " + s.source + ": " + detail);
        }
    }

    try {
        const FileWriter out(s.source);
        const hid_t root = s.file.get();
        out.write_string(root, "format", format_name);
        // finish() writes the version the file ends up needing (section 3.1).
        out.write_string(root, "format_version", std::to_string(format_major) + ".0");
        out.write_string(root, "dtype", cache_dtype_name(model.dtype));
        out.write_integer(root, "keys_after_rope", 1);

        Handle group = out.create_group(root, "model");
        out.write_string(group.get(), "fingerprint", model.model_fingerprint);
        out.write_string(group.get(), "name", model.model_name);
        out.write_string(group.get(), "architecture", model.architecture);
        out.write_integer(group.get(), "num_layers", model.num_layers);
        out.write_integer(group.get(), "num_kv_heads", model.num_kv_heads);
        out.write_integer(group.get(), "head_dim", model.head_dim);
        out.write_string(group.get(), "rope_layout", model.rope_layout);
        out.write_double(group.get(), "rope_theta", model.rope_theta);
        out.write_string(group.get(), "rope_scaling", model.rope_scaling);
        out.write_string(group.get(), "tokenizer_fingerprint", model.tokenizer_fingerprint);

        group = out.create_group(root, "provenance");
        out.write_string(group.get(), "tool", provenance.tool);
        out.write_string(group.get(), "version", provenance.version);
        out.write_string(group.get(), "command_line", provenance.command_line);
        if (!provenance.created.empty())
            out.write_string(group.get(), "created", provenance.created);

        s.packets = out.create_group(root, "packets");
        s.packet_ids = out.create_group(root, "packet_ids");
        s.link_creation = Handle(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
        H5Pset_char_encoding(s.link_creation.get(), H5T_CSET_UTF8);
        switch (model.dtype) {
            case CacheDtype::f32:
                s.key_type = Handle(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
                break;
            case CacheDtype::f16:
                s.key_type = make_f16_type();
                break;
            case CacheDtype::bf16:
                s.key_type = Handle(H5Tcopy(H5T_STD_U16LE), H5Tclose);
                break;
        }
    } catch (...) {
        s.discard();
        throw;
    }
}

CacheWriter::~CacheWriter() {
    if (!state_) return;
    const Lock lock = lock_hdf5();
    state_->discard();
}

void CacheWriter::add(const Packet& packet) {
    State& s = *state_;
    if (s.finished) throw UsageError("cannot add packets to a finished cache file");
    if (s.broken) throw IoError("cannot write " + s.source + ": an earlier write failed");
    const std::string what = s.source + ": packet " + kv::quoted(packet.id);
    if (packet.id.empty()) throw UsageError(s.source + ": a packet id must not be empty");
    if (!valid_utf8(packet.id))
        throw UsageError(s.source + ": packet id " + kv::quoted(packet.id) + " is not valid UTF-8");
    if (s.ids.count(packet.id))
        throw UsageError(s.source + ": duplicate packet id " + kv::quoted(packet.id));
    const int64_t stored = packet.stored_length();
    if (static_cast<int64_t>(packet.positions.size()) != stored)
        throw FormatError(what + ": " + std::to_string(packet.positions.size()) +
                          " positions for " + std::to_string(stored) + " token ids");
    if (packet.logical_length < stored)
        throw FormatError(what + ": logical_length " + std::to_string(packet.logical_length) +
                          " is less than stored_length " + std::to_string(stored));
    if (packet.header_tokens < 0 || packet.trailer_tokens < 0 ||
        packet.header_tokens + packet.trailer_tokens > packet.logical_length)
        throw FormatError(what + ": adapter tokens (" + std::to_string(packet.header_tokens) +
                          " + " + std::to_string(packet.trailer_tokens) +
                          ") exceed logical_length " + std::to_string(packet.logical_length));
    for (int32_t id : packet.token_ids)
        if (id < -1) throw FormatError(what + ": invalid token id " + std::to_string(id));
    for (int64_t position : packet.positions)
        if (position < 0 || position >= packet.logical_length)
            throw FormatError(what + ": position " + std::to_string(position) +
                              " is outside [0, logical_length " +
                              std::to_string(packet.logical_length) + ")");
    const CacheModelInfo& m = s.model;
    const std::size_t expected =
        checked_elements({m.num_layers, m.num_kv_heads, stored, m.head_dim}) *
        cache_dtype_size(m.dtype);
    for (const auto* tensor : {&packet.keys, &packet.values})
        if (tensor->size() != expected)
            throw FormatError(what + ": " + (tensor == &packet.keys ? "keys" : "values") +
                              " hold " + std::to_string(tensor->size()) + " bytes, expected " +
                              std::to_string(expected) + " (" + std::to_string(m.num_layers) +
                              " x " + std::to_string(m.num_kv_heads) + " x " +
                              std::to_string(stored) + " x " + std::to_string(m.head_dim) + " " +
                              cache_dtype_name(m.dtype) + ")");

    if (!packet.index.empty()) {
        check_index(packet.index, m, stored, what);
        std::string problem = index_segments_problem(packet.index, packet.positions);
        for (std::size_t i = 0; problem.empty() && i < packet.index.layouts.size(); ++i)
            problem = index_layout_problem(
                packet.index.layouts[i],
                packet.index.segments[i % packet.index.segments.size()].count,
                packet.index.page_size);
        if (!problem.empty()) throw FormatError(what + ": invalid index: " + problem);
    }
    if (!packet.ragged()) {
        const std::string problem = positions_problem(packet.positions);
        if (!problem.empty()) throw FormatError(what + ": " + problem);
    }
    if (packet.ragged()) {
        const std::string problem = ragged_problem(packet, m.num_layers, m.num_kv_heads);
        if (!problem.empty()) throw FormatError(what + ": " + problem);
        if (packet.padded() && !packet.index.empty())
            throw FormatError(what + ": an index over heads of unequal lengths is not defined");
    } else if (!packet.head_positions.empty()) {
        throw FormatError(what + ": head_positions without head_lengths");
    }

    const Quantization quantization =
        s.options.quantization ? *s.options.quantization : packet.quantization;
    if (quantization.enabled()) check_quantization(quantization, m.head_dim, what);

    const Lock lock = lock_hdf5();
    const FileWriter out(s.source);
    s.broken = true;  // until everything below is written
    const std::string group_name = packet_group_name(s.infos.size());
    Handle group = out.create_group(s.packets.get(), group_name);
    if (H5Lcreate_soft(("/packets/" + group_name).c_str(), s.packet_ids.get(),
                       packet_link_name(packet.id).c_str(), s.link_creation.get(),
                       H5P_DEFAULT) < 0)
        out.fail_hdf5("cannot link packet " + kv::quoted(packet.id) + " in /packet_ids");
    out.write_string(group.get(), "id", packet.id);
    out.write_string(group.get(), "text_sha256", packet.text_sha256);
    out.write_integer(group.get(), "logical_length", packet.logical_length);
    out.write_integer(group.get(), "stored_length", stored);
    out.write_string(group.get(), "adapter_fingerprint", packet.adapter_fingerprint);
    out.write_integer(group.get(), "header_tokens", packet.header_tokens);
    out.write_integer(group.get(), "trailer_tokens", packet.trailer_tokens);

    const hsize_t length = static_cast<hsize_t>(stored);
    const std::vector<hsize_t> chunk_1d = {std::min<hsize_t>(length, max_1d_chunk)};
    out.write_dataset(group.get(), "token_ids", H5T_STD_I32LE, H5T_NATIVE_INT32, {length}, chunk_1d,
                      s.options, true, packet.token_ids.data());
    out.write_dataset(group.get(), "positions", H5T_STD_I64LE, H5T_NATIVE_INT64, {length}, chunk_1d,
                      s.options, true, packet.positions.data());
    const std::vector<hsize_t> dims = {static_cast<hsize_t>(m.num_layers),
                                       static_cast<hsize_t>(m.num_kv_heads), length,
                                       static_cast<hsize_t>(m.head_dim)};
    const std::vector<hsize_t> chunk = {
        1, 1,
        std::min<hsize_t>(length,
                          tensor_chunk_tokens(s.options, dims[3] * cache_dtype_size(m.dtype))),
        dims[3]};
    const char* dtype_attribute = m.dtype == CacheDtype::bf16 ? "bf16" : nullptr;
    if (quantization.enabled()) {
        write_quantized(out, group.get(), packet, quantization, m, s.options, s.key_type.get());
        s.has_quantized = true;
    } else {
        // The memory type is the file type: the bytes are already little-endian in the dtype.
        out.write_dataset(group.get(), "keys", s.key_type.get(), s.key_type.get(), dims, chunk,
                          s.options, true, packet.keys.data(), dtype_attribute);
        out.write_dataset(group.get(), "values", s.key_type.get(), s.key_type.get(), dims, chunk,
                          s.options, true, packet.values.data(), dtype_attribute);
    }
    if (packet.ragged()) {
        write_head_positions(out, group.get(), packet, m, s.options);
        s.has_ragged = true;
    }
    if (!packet.index.empty()) {
        write_index(out, group.get(), packet.index, m, stored, s.options);
        s.has_index_layers = s.has_index_layers || !packet.index.layers.empty();
    }
    s.broken = false;

    s.ids.insert(packet.id);
    s.infos.push_back({packet.id, packet.text_sha256, packet.logical_length, stored,
                       packet.adapter_fingerprint, packet.header_tokens, packet.trailer_tokens});
}

void CacheWriter::set_adapter(const Adapter& adapter) {
    State& s = *state_;
    if (s.finished) throw UsageError("cannot add an adapter to a finished cache file");
    if (s.adapter) throw UsageError(s.source + ": a cache file holds at most one adapter");
    const std::string problem = adapter_problem(adapter);
    if (!problem.empty()) throw FormatError(s.source + ": cannot store the adapter: " + problem);
    s.adapter = adapter;
}

void CacheWriter::finish() {
    State& s = *state_;
    if (s.finished) throw UsageError("the cache file was already finished");
    if (s.broken) throw IoError("cannot write " + s.source + ": an earlier write failed");
    const Lock lock = lock_hdf5();
    const FileWriter out(s.source);
    std::vector<char> image;
    try {
        Handle index = out.create_group(s.file.get(), "packet_index");
        std::vector<std::string> ids, hashes, adapters;
        std::vector<int64_t> logical, stored, headers, trailers;
        for (const PacketInfo& info : s.infos) {
            ids.push_back(info.id);
            hashes.push_back(info.text_sha256);
            adapters.push_back(info.adapter_fingerprint);
            logical.push_back(info.logical_length);
            stored.push_back(info.stored_length);
            headers.push_back(info.header_tokens);
            trailers.push_back(info.trailer_tokens);
        }
        const hsize_t count = s.infos.size();
        const std::vector<hsize_t> chunk = {std::min<hsize_t>(count, max_1d_chunk)};
        out.write_string_dataset(index.get(), "id", ids, s.options);
        out.write_string_dataset(index.get(), "text_sha256", hashes, s.options);
        for (const auto& [name, values] :
             {std::pair<const char*, const std::vector<int64_t>*>{"logical_length", &logical},
              {"stored_length", &stored},
              {"header_tokens", &headers},
              {"trailer_tokens", &trailers}})
            out.write_dataset(index.get(), name, H5T_STD_I64LE, H5T_NATIVE_INT64, {count}, chunk,
                              s.options, true, values->data());
        out.write_string_dataset(index.get(), "adapter_fingerprint", adapters, s.options);
        index.reset();

        if (s.adapter) write_adapter(out, s.file.get(), *s.adapter, s.options);
        // Every file has /packet_ids and tensor_layout, the latest addition: the lowest version
        // that describes it is 1.7, whatever else it holds (an index, per-head tokens, quantised
        // packets, an adapter, partial indexes and /packet_ids came before).
        out.write_string(s.file.get(), "tensor_layout", tensor_layout_name(s.options));
        if (H5Adelete(s.file.get(), "format_version") < 0)
            out.fail_hdf5("cannot update the format version");
        out.write_string(s.file.get(), "format_version",
                         std::to_string(format_major) + "." + std::to_string(tensor_layout_minor));
        std::vector<std::string> features;
        if (s.has_ragged) features.push_back(ragged_feature);
        if (s.has_quantized) features.push_back(quantized_feature);
        if (s.has_index_layers) features.push_back(index_layers_feature);
        if (!features.empty()) out.write_string_list(s.file.get(), "required_features", features);
        // Last, so that a file that has it is whole (readers refuse one without it).
        out.write_integer(s.file.get(), "complete", 1);
        s.packets.reset();
        s.packet_ids.reset();
        s.link_creation.reset();
        s.key_type.reset();
        if (s.in_memory) {
            if (H5Fflush(s.file.get(), H5F_SCOPE_GLOBAL) < 0) out.fail_hdf5("cannot flush");
            const ssize_t size = H5Fget_file_image(s.file.get(), nullptr, 0);
            if (size < 0) out.fail_hdf5("cannot get the file image");
            image.resize(static_cast<std::size_t>(size));
            if (H5Fget_file_image(s.file.get(), image.data(), image.size()) != size)
                out.fail_hdf5("cannot get the file image");
            fix_superblock_checksum(image);
        }
        if (!s.file.close()) out.fail_hdf5("cannot close");
    } catch (...) {
        s.broken = true;
        throw;
    }
    s.finished = true;

    if (s.to_stdout) {
        std::fflush(stdout);  // whatever the caller printed first stays first
        write_all(STDOUT_FILENO, image.data(), image.size(), "to standard output");
        return;
    }
    if (s.in_memory) {  // a device or a FIFO, written in place
        const int fd = s.output->open_stream();
        if (!s.options.force && ::isatty(fd)) {
            ::close(fd);
            throw UsageError(
                "refusing to write binary cache data to a terminal (use -o FILE, or --force)");
        }
        try {
            write_all(fd, image.data(), image.size(), s.source);
        } catch (...) {
            ::close(fd);
            throw;
        }
        if (::close(fd) != 0) throw IoError("cannot write " + s.source + ": " + system_reason());
        return;
    }
    const int fd = ::open(s.temporary.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) {
        const std::string reason = system_reason();
        if (fd >= 0) ::close(fd);
        s.discard();
        throw IoError("cannot sync " + s.source + ": " + reason);
    }
    ::close(fd);
    const std::filesystem::path temporary = std::exchange(s.temporary, {});
    s.output->commit(temporary, s.options.no_replace);
}

}  // namespace kv
