#include "kv/cache_file.hpp"

#include "hdf5_read_driver.hpp"
#include "hdf5_zstd.hpp"
#include "kv/error.hpp"
#include "kv/mapped_file.hpp"
#include "kv/memory.hpp"
#include "kv/sha256.hpp"
#include "utf8.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

static_assert(std::endian::native == std::endian::little,
              "tensors cross the cache file API as little-endian bytes");

namespace kv {
namespace {

constexpr const char* format_name = "kvtools-kvcache";
constexpr int format_major = 1;
// Writers write the lowest version that describes the file: 1.0, 1.1 once a packet has an index
// (6.5), 1.2 once one keeps different tokens per head (6.3), 1.3 once one is quantised (6.6),
// 1.4 when the file holds an adapter (6.7).
constexpr int format_minor = 4;
constexpr int index_minor = 1;
constexpr int ragged_minor = 2;
constexpr const char* ragged_feature = "ragged-heads";
constexpr int quantized_minor = 3;
constexpr const char* quantized_feature = "quantized-kv";
constexpr int adapter_minor = 4;
constexpr int64_t max_1d_chunk = 65536;
/// Features this reader implements.
const std::set<std::string> known_features = {ragged_feature, quantized_feature};

// HDF5 1.10 serial keeps global state without locks: every call into it from this module holds
// this mutex. Recursive, because public functions call each other.
std::recursive_mutex& hdf5_mutex() {
    static std::recursive_mutex mutex;
    return mutex;
}

// Once per process: silence HDF5's error printing (the library never prints; errors become
// exceptions) and register the zstd filter, so that no plugin path is needed. HDF5's own
// clean-up at exit is turned off: after a write failed (a full disk) it closes the broken file
// again and crashes (HDF5 1.10.8); every file is closed by its owner before that anyway.
void init_hdf5() {
    static const bool done = [] {
        H5dont_atexit();
        H5open();
        H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
        H5Zregister(&zstd_filter_class);
        install_vlen_guard();
        return true;
    }();
    (void)done;
}

using Lock = std::unique_lock<std::recursive_mutex>;
Lock lock_hdf5() {
    Lock lock(hdf5_mutex());
    init_hdf5();
    return lock;
}

// The innermost message of HDF5's error stack (the most specific: "truncated file: eof = ...",
// "data error detected by Fletcher32 checksum"), which is then cleared.
std::string hdf5_error_detail() {
    std::vector<std::string> messages;
    H5Ewalk2(
        H5E_DEFAULT, H5E_WALK_DOWNWARD,
        [](unsigned, const H5E_error2_t* error, void* data) -> herr_t {
            auto* list = static_cast<std::vector<std::string>*>(data);
            if (error->desc && *error->desc) list->push_back(error->desc);
            return 0;
        },
        &messages);
    H5Eclear2(H5E_DEFAULT);
    // The checking read driver knows better than HDF5's "read failed".
    std::string detail = take_read_driver_problem();
    if (detail.empty()) detail = messages.empty() ? "HDF5 error" : messages.back();
    // A failed system call reads "file write failed: time = ..., filename = ..., errno = 28,
    // error message = 'No space left on device', buf = ...": the system's reason is what counts.
    const std::string marker = "error message = '";
    if (const std::size_t at = detail.find(marker); at != std::string::npos) {
        const std::size_t begin = at + marker.size(), end = detail.find('\'', begin);
        if (end != std::string::npos) detail = detail.substr(begin, end - begin);
    }
    std::replace(detail.begin(), detail.end(), '\n', ' ');
    return detail;
}

// An HDF5 identifier closed by the right function when it goes out of scope. Only used with the
// mutex held.
class Handle {
  public:
    Handle() = default;
    Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
    Handle(Handle&& other) noexcept
        : id_(std::exchange(other.id_, H5I_INVALID_HID)), close_(other.close_) {}
    Handle& operator=(Handle&& other) noexcept {
        if (this != &other) {
            reset();
            id_ = std::exchange(other.id_, H5I_INVALID_HID);
            close_ = other.close_;
        }
        return *this;
    }
    ~Handle() { reset(); }
    void reset() {
        if (id_ >= 0 && close_) close_(id_);
        id_ = H5I_INVALID_HID;
    }
    hid_t get() const { return id_; }
    bool valid() const { return id_ >= 0; }
    /// Closes now and reports whether closing worked (closing a file flushes it).
    bool close() {
        const herr_t status = id_ >= 0 && close_ ? close_(id_) : 0;
        id_ = H5I_INVALID_HID;
        return status >= 0;
    }

  private:
    hid_t id_ = H5I_INVALID_HID;
    herr_t (*close_)(hid_t) = nullptr;
};

std::string packet_group_name(std::size_t ordinal) {
    char name[32];
    std::snprintf(name, sizeof name, "%08zu", ordinal);
    return name;
}

// Physical memory: an upper bound for anything a file may ask to allocate.
std::size_t memory_bytes() {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return std::numeric_limits<std::size_t>::max();
    return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
}

std::string system_reason() {
    return std::strerror(errno);
}

std::string shape_text(const std::vector<hsize_t>& dims) {
    std::string text = "[";
    for (std::size_t i = 0; i < dims.size(); ++i)
        text += (i ? ", " : "") + std::to_string(dims[i]);
    return text + "]";
}

bool valid_utf8(const std::string& text) {
    for (std::size_t at = 0; at < text.size();) {
        const std::size_t length = utf8::valid_length(text, at);
        if (length == 0) return false;
        at += length;
    }
    return true;
}

// The IEEE binary16 type exactly as h5py builds it for numpy.float16, so that h5py reads f16
// tensors as float16 and not as an opaque or wider type.
Handle make_f16_type() {
    Handle type(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
    H5Tset_fields(type.get(), 15, 10, 5, 0, 10);
    H5Tset_size(type.get(), 2);
    H5Tset_ebias(type.get(), 15);
    H5Tset_precision(type.get(), 16);
    return type;
}

Handle make_string_type(H5T_cset_t cset = H5T_CSET_UTF8) {
    Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(type.get(), H5T_VARIABLE);
    H5Tset_cset(type.get(), cset);
    return type;
}

// ---------------------------------------------------------------------------------------------
// Reading attributes and datasets, with errors that name the file and the object.

class FileReader {
  public:
    /// `raw` (optional) gives the file's bytes, for checking heap ids before HDF5 follows them.
    explicit FileReader(std::string source, const RawSource* raw = nullptr)
        : source_(std::move(source)), raw_(raw) {}
    const std::string& source() const { return source_; }

    [[noreturn]] void fail(const std::string& what) const {
        throw FormatError(source_ + ": " + what);
    }
    [[noreturn]] void fail_hdf5(const std::string& what) const {
        throw FormatError(source_ + ": " + what + ": " + hdf5_error_detail());
    }

    Handle open_group(hid_t parent, const std::string& name, const std::string& where) const {
        if (H5Lexists(parent, name.c_str(), H5P_DEFAULT) <= 0) {
            H5Eclear2(H5E_DEFAULT);
            fail("missing required group " + kv::quoted(where));
        }
        Handle group(H5Gopen2(parent, name.c_str(), H5P_DEFAULT), H5Gclose);
        if (!group.valid()) fail_hdf5("cannot open group " + kv::quoted(where));
        return group;
    }

    Handle open_dataset(hid_t parent, const std::string& name, const std::string& where) const {
        if (H5Lexists(parent, name.c_str(), H5P_DEFAULT) <= 0) {
            H5Eclear2(H5E_DEFAULT);
            fail("missing required dataset " + kv::quoted(where));
        }
        Handle dataset(H5Dopen2(parent, name.c_str(), H5P_DEFAULT), H5Dclose);
        if (!dataset.valid()) fail_hdf5("cannot open dataset " + kv::quoted(where));
        return dataset;
    }

    static bool has_attribute(hid_t object, const char* name) {
        const htri_t exists = H5Aexists(object, name);
        if (exists < 0) H5Eclear2(H5E_DEFAULT);
        return exists > 0;
    }

    // Opens an attribute that must hold exactly one element (scalar or one-element 1-D).
    Handle open_scalar_attribute(hid_t object, const char* name, const std::string& where) const {
        if (!has_attribute(object, name))
            fail("missing required attribute " + kv::quoted(name) + " of " + kv::quoted(where));
        Handle attribute(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
        if (!attribute.valid()) fail_hdf5("cannot open attribute " + kv::quoted(name));
        Handle space(H5Aget_space(attribute.get()), H5Sclose);
        if (H5Sget_simple_extent_npoints(space.get()) != 1)
            fail("attribute " + kv::quoted(name) + " of " + kv::quoted(where) +
                 " is not a single value");
        return attribute;
    }

    std::string string_attribute(hid_t object, const char* name, const std::string& where) const {
        Handle attribute = open_scalar_attribute(object, name, where);
        std::vector<std::string> values = read_strings(attribute.get(), false, name, where);
        return values.at(0);
    }
    std::string string_attribute_or(hid_t object, const char* name, const std::string& where,
                                    const std::string& fallback) const {
        return has_attribute(object, name) ? string_attribute(object, name, where) : fallback;
    }

    int64_t integer_attribute(hid_t object, const char* name, const std::string& where) const {
        Handle attribute = open_scalar_attribute(object, name, where);
        Handle type(H5Aget_type(attribute.get()), H5Tclose);
        if (H5Tget_class(type.get()) != H5T_INTEGER)
            fail("attribute " + kv::quoted(name) + " of " + kv::quoted(where) +
                 " is not an integer");
        int64_t value = 0;
        if (H5Aread(attribute.get(), H5T_NATIVE_INT64, &value) < 0)
            fail_hdf5("cannot read attribute " + kv::quoted(name));
        return value;
    }
    int64_t integer_attribute_or(hid_t object, const char* name, const std::string& where,
                                 int64_t fallback) const {
        return has_attribute(object, name) ? integer_attribute(object, name, where) : fallback;
    }

    double float_attribute(hid_t object, const char* name, const std::string& where) const {
        Handle attribute = open_scalar_attribute(object, name, where);
        Handle type(H5Aget_type(attribute.get()), H5Tclose);
        const H5T_class_t type_class = H5Tget_class(type.get());
        if (type_class != H5T_FLOAT && type_class != H5T_INTEGER)
            fail("attribute " + kv::quoted(name) + " of " + kv::quoted(where) + " is not a number");
        double value = 0;
        if (H5Aread(attribute.get(), H5T_NATIVE_DOUBLE, &value) < 0)
            fail_hdf5("cannot read attribute " + kv::quoted(name));
        return value;
    }

    // A string list attribute: a 1-D array of strings or a scalar string.
    std::vector<std::string> string_list_attribute(hid_t object, const char* name,
                                                   const std::string& where) const {
        if (!has_attribute(object, name)) return {};
        Handle attribute(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
        if (!attribute.valid()) fail_hdf5("cannot open attribute " + kv::quoted(name));
        return read_strings(attribute.get(), false, name, where);
    }

    // Every string of an attribute (is_dataset false) or a dataset, variable- or fixed-length.
    std::vector<std::string> read_strings(hid_t object, bool is_dataset, const std::string& name,
                                          const std::string& where) const {
        Handle type(is_dataset ? H5Dget_type(object) : H5Aget_type(object), H5Tclose);
        Handle space(is_dataset ? H5Dget_space(object) : H5Aget_space(object), H5Sclose);
        const std::string what = (is_dataset ? "dataset " : "attribute ") + kv::quoted(name) +
                                 (is_dataset ? "" : " of " + kv::quoted(where));
        if (H5Tget_class(type.get()) != H5T_STRING) fail(what + " is not a string");
        const hssize_t count = H5Sget_simple_extent_npoints(space.get());
        if (count < 0) fail_hdf5("cannot read " + what);
        std::vector<std::string> values(static_cast<std::size_t>(count));
        if (count == 0) return values;
        const H5T_cset_t cset = H5Tget_cset(type.get());
        auto read = [&](hid_t memory_type, void* buffer) {
            // Heap ids of variable-length strings are checked before HDF5 follows them.
            const VlenGuard guard(raw_);
            return is_dataset ? H5Dread(object, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buffer)
                              : H5Aread(object, memory_type, buffer);
        };
        if (H5Tis_variable_str(type.get()) > 0) {
            if (is_dataset && raw_) check_heap_ids_of(object, values.size(), what);
            Handle memory_type = make_string_type(cset);
            std::vector<char*> pointers(values.size(), nullptr);
            // A read that fails midway has allocated the strings before the failure: free them
            // on every path (found by fuzzing).
            const int status = read(memory_type.get(), pointers.data());
            for (std::size_t i = 0; i < values.size() && status >= 0; ++i)
                if (pointers[i]) values[i] = pointers[i];
            H5Dvlen_reclaim(memory_type.get(), space.get(), H5P_DEFAULT, pointers.data());
            if (status < 0) fail_hdf5("cannot read " + what);
        } else {
            const std::size_t size = H5Tget_size(type.get());
            if (size == 0) fail(what + " has an invalid string size");
            Handle memory_type(H5Tcopy(H5T_C_S1), H5Tclose);
            H5Tset_size(memory_type.get(), size);
            H5Tset_cset(memory_type.get(), cset);
            H5Tset_strpad(memory_type.get(), H5T_STR_NULLPAD);
            std::vector<char> buffer(size * values.size());
            if (read(memory_type.get(), buffer.data()) < 0) fail_hdf5("cannot read " + what);
            for (std::size_t i = 0; i < values.size(); ++i) {
                const char* begin = buffer.data() + i * size;
                values[i].assign(begin, strnlen(begin, size));
            }
        }
        return values;
    }

    std::vector<hsize_t> dataset_dims(hid_t dataset, const std::string& what) const {
        Handle space(H5Dget_space(dataset), H5Sclose);
        const int rank = H5Sget_simple_extent_ndims(space.get());
        if (rank < 0) fail_hdf5("cannot read the shape of " + what);
        std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
        if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
        return dims;
    }

    // A 1-D integer dataset of `length` entries, read as int64.
    std::vector<int64_t> integer_dataset(hid_t parent, const std::string& name,
                                         const std::string& what, std::optional<hsize_t> length,
                                         const std::string& length_name) const {
        Handle dataset = open_dataset(parent, name, what);
        const std::vector<hsize_t> dims = dataset_dims(dataset.get(), kv::quoted(what));
        if (dims.size() != 1)
            fail(kv::quoted(what) + " has shape " + shape_text(dims) + ", not 1-D");
        if (length && dims[0] != *length)
            fail(kv::quoted(what) + " has " + std::to_string(dims[0]) + " entries, " + length_name +
                 " is " + std::to_string(*length));
        Handle type(H5Dget_type(dataset.get()), H5Tclose);
        if (H5Tget_class(type.get()) != H5T_INTEGER) fail(kv::quoted(what) + " is not integer");
        std::vector<int64_t> values(dims[0]);
        if (!values.empty() && H5Dread(dataset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL,
                                       H5P_DEFAULT, values.data()) < 0)
            fail_hdf5("cannot read " + kv::quoted(what));
        return values;
    }

    // A numeric dataset of the given shape (0: any extent), opened and checked, not read.
    Handle numeric_dataset_checked(hid_t parent, const std::string& name, const std::string& what,
                                   const std::vector<hsize_t>& shape,
                                   std::vector<hsize_t>* dims_out = nullptr) const {
        Handle dataset = open_dataset(parent, name, what);
        const std::vector<hsize_t> dims = dataset_dims(dataset.get(), kv::quoted(what));
        bool matches = dims.size() == shape.size();
        for (std::size_t i = 0; matches && i < dims.size(); ++i)
            matches = shape[i] == 0 || shape[i] == dims[i];
        if (!matches)
            fail(kv::quoted(what) + " has shape " + shape_text(dims) + ", expected " +
                 shape_text(shape));
        Handle type(H5Dget_type(dataset.get()), H5Tclose);
        const H5T_class_t type_class = H5Tget_class(type.get());
        if (type_class != H5T_INTEGER && type_class != H5T_FLOAT)
            fail(kv::quoted(what) + " is not numeric");
        if (dims_out) *dims_out = dims;
        return dataset;
    }

    // Elements [from, from + count) of row (layer, head) of a checked 3-D numeric dataset, as T.
    template <typename T>
    void read_row(hid_t dataset, const std::string& what, hid_t memory_type, hsize_t layer,
                  hsize_t head, hsize_t from, hsize_t count, std::vector<T>& out) const {
        out.resize(static_cast<std::size_t>(count));
        if (count == 0) return;
        const hsize_t start[3] = {layer, head, from}, extent[3] = {1, 1, count};
        Handle file_space(H5Dget_space(dataset), H5Sclose);
        Handle memory_space(H5Screate_simple(3, extent, nullptr), H5Sclose);
        if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, extent, nullptr) <
                0 ||
            H5Dread(dataset, memory_type, memory_space.get(), file_space.get(), H5P_DEFAULT,
                    out.data()) < 0)
            fail_hdf5("cannot read " + kv::quoted(what));
    }

    // A numeric dataset of the given shape (0: any extent), read as T through `memory_type`.
    template <typename T>
    std::vector<T> numeric_dataset(hid_t parent, const std::string& name, const std::string& what,
                                   const std::vector<hsize_t>& shape, hid_t memory_type,
                                   std::vector<hsize_t>* dims_out = nullptr) const {
        std::vector<hsize_t> dims;
        Handle dataset = numeric_dataset_checked(parent, name, what, shape, &dims);
        std::size_t count = 1;
        for (hsize_t dim : dims)
            count *= static_cast<std::size_t>(dim);
        if (count > memory_bytes() / (4 * sizeof(T))) fail(kv::quoted(what) + " is too large");
        std::vector<T> values(count);
        if (count > 0 &&
            H5Dread(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0)
            fail_hdf5("cannot read " + kv::quoted(what));
        if (dims_out) *dims_out = dims;
        return values;
    }

    std::vector<std::string> string_dataset(hid_t parent, const std::string& name,
                                            const std::string& what, hsize_t length,
                                            const std::string& length_name) const {
        Handle dataset = open_dataset(parent, name, what);
        const std::vector<hsize_t> dims = dataset_dims(dataset.get(), kv::quoted(what));
        if (dims.size() != 1)
            fail(kv::quoted(what) + " has shape " + shape_text(dims) + ", not 1-D");
        if (dims[0] != length)
            fail(kv::quoted(what) + " has " + std::to_string(dims[0]) + " entries, " + length_name +
                 " has " + std::to_string(length));
        return read_strings(dataset.get(), true, what, "");
    }

  private:
    // HDF5 1.10 follows heap ids without bounds checks (hdf5_read_driver.hpp): check those of a
    // contiguous dataset first. Other layouts are rare for strings and left to HDF5.
    void check_heap_ids_of(hid_t dataset, std::size_t count, const std::string& what) const {
        Handle properties(H5Dget_create_plist(dataset), H5Pclose);
        if (H5Pget_layout(properties.get()) != H5D_CONTIGUOUS) return;
        const haddr_t offset = H5Dget_offset(dataset);
        if (offset == HADDR_UNDEF) {
            H5Eclear2(H5E_DEFAULT);
            return;
        }
        const std::string problem = check_heap_ids(*raw_, offset, count);
        if (!problem.empty()) fail("cannot read " + what + ": " + problem);
    }

    std::string source_;
    const RawSource* raw_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Writing.

class FileWriter {
  public:
    explicit FileWriter(std::string source) : source_(std::move(source)) {}

    [[noreturn]] void fail_hdf5(const std::string& what) const {
        throw IoError("cannot write " + source_ + ": " + what + ": " + hdf5_error_detail());
    }

    Handle create_group(hid_t parent, const std::string& name) const {
        Handle properties(H5Pcreate(H5P_GROUP_CREATE), H5Pclose);
        H5Pset_obj_track_times(properties.get(), false);  // byte-identical output for same input
        Handle group(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, properties.get(), H5P_DEFAULT),
                     H5Gclose);
        if (!group.valid()) fail_hdf5("cannot create group " + kv::quoted(name));
        return group;
    }

    void write_string(hid_t object, const char* name, const std::string& value) const {
        Handle type = make_string_type();
        Handle space(H5Screate(H5S_SCALAR), H5Sclose);
        Handle attribute(
            H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
        const char* pointer = value.c_str();
        if (!attribute.valid() || H5Awrite(attribute.get(), type.get(), &pointer) < 0)
            fail_hdf5("cannot write attribute " + kv::quoted(name));
    }

    void write_string_list(hid_t object, const char* name,
                           const std::vector<std::string>& values) const {
        Handle type = make_string_type();
        const hsize_t count = values.size();
        Handle space(H5Screate_simple(1, &count, nullptr), H5Sclose);
        Handle attribute(
            H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
        std::vector<const char*> pointers;
        for (const std::string& value : values)
            pointers.push_back(value.c_str());
        if (!attribute.valid() || H5Awrite(attribute.get(), type.get(), pointers.data()) < 0)
            fail_hdf5("cannot write attribute " + kv::quoted(name));
    }

    void write_integer(hid_t object, const char* name, int64_t value) const {
        write_number(object, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
    }
    void write_double(hid_t object, const char* name, double value) const {
        write_number(object, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
    }

    /// Dataset creation properties: chunked by `chunk` (none when empty), shuffle and zstd as
    /// the options say, Fletcher32 always when chunked.
    Handle dataset_properties(const std::vector<hsize_t>& chunk, const CacheWriteOptions& options,
                              bool shuffle) const {
        Handle properties(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
        H5Pset_obj_track_times(properties.get(), false);
        if (chunk.empty()) return properties;
        bool ok = H5Pset_chunk(properties.get(), static_cast<int>(chunk.size()), chunk.data()) >= 0;
        if (shuffle && options.shuffle && options.zstd_level > 0)
            ok = ok && H5Pset_shuffle(properties.get()) >= 0;
        if (options.zstd_level > 0) {
            const unsigned int level = static_cast<unsigned int>(options.zstd_level);
            ok = ok && H5Pset_filter(properties.get(), zstd_filter_id, H5Z_FLAG_MANDATORY, 1,
                                     &level) >= 0;
        }
        ok = ok && H5Pset_fletcher32(properties.get()) >= 0;
        if (!ok) fail_hdf5("cannot set up chunks and filters");
        return properties;
    }

    void write_dataset(hid_t parent, const std::string& name, hid_t file_type, hid_t memory_type,
                       const std::vector<hsize_t>& dims, const std::vector<hsize_t>& chunk,
                       const CacheWriteOptions& options, bool shuffle, const void* data,
                       const char* dtype_attribute = nullptr) const {
        Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                     H5Sclose);
        bool empty = false;
        for (hsize_t dim : dims)
            empty = empty || dim == 0;
        Handle properties =
            dataset_properties(empty ? std::vector<hsize_t>{} : chunk, options, shuffle);
        Handle dataset(H5Dcreate2(parent, name.c_str(), file_type, space.get(), H5P_DEFAULT,
                                  properties.get(), H5P_DEFAULT),
                       H5Dclose);
        if (!dataset.valid()) fail_hdf5("cannot create dataset " + kv::quoted(name));
        if (dtype_attribute) write_string(dataset.get(), "dtype", dtype_attribute);
        if (!empty && H5Dwrite(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
            fail_hdf5("cannot write dataset " + kv::quoted(name));
    }

    void write_string_dataset(hid_t parent, const std::string& name,
                              const std::vector<std::string>& values,
                              const CacheWriteOptions& options) const {
        Handle type = make_string_type();
        std::vector<const char*> pointers;
        pointers.reserve(values.size());
        for (const std::string& value : values)
            pointers.push_back(value.c_str());
        // Contiguous: HDF5 filters (Fletcher32 included) refuse variable-length data, whose
        // bytes live in the global heap anyway.
        write_dataset(parent, name, type.get(), type.get(), {values.size()}, {}, options, false,
                      pointers.data());
    }

  private:
    void write_number(hid_t object, const char* name, hid_t file_type, hid_t memory_type,
                      const void* value) const {
        Handle space(H5Screate(H5S_SCALAR), H5Sclose);
        Handle attribute(H5Acreate2(object, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                         H5Aclose);
        if (!attribute.valid() || H5Awrite(attribute.get(), memory_type, value) < 0)
            fail_hdf5("cannot write attribute " + kv::quoted(name));
    }

    std::string source_;
};

std::size_t checked_elements(const std::vector<int64_t>& dims) {
    std::size_t elements = 1;
    for (int64_t dim : dims) {
        if (dim < 0 || (dim > 0 && elements > std::numeric_limits<std::size_t>::max() /
                                                  static_cast<std::size_t>(dim) / 4))
            throw FormatError("tensor shape too large");
        elements *= static_cast<std::size_t>(dim);
    }
    return elements;
}

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

// Bob Jenkins' lookup3 hashlittle(), the checksum of HDF5 metadata (H5_checksum_lookup3).
uint32_t lookup3(const unsigned char* data, std::size_t length, uint32_t initial = 0) {
    auto rotate = [](uint32_t x, int k) { return (x << k) | (x >> (32 - k)); };
    auto word = [](const unsigned char* p) {
        return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
    };
    uint32_t a, b, c;
    a = b = c = 0xdeadbeef + static_cast<uint32_t>(length) + initial;
    while (length > 12) {
        a += word(data);
        b += word(data + 4);
        c += word(data + 8);
        a -= c, a ^= rotate(c, 4), c += b;
        b -= a, b ^= rotate(a, 6), a += c;
        c -= b, c ^= rotate(b, 8), b += a;
        a -= c, a ^= rotate(c, 16), c += b;
        b -= a, b ^= rotate(a, 19), a += c;
        c -= b, c ^= rotate(b, 4), b += a;
        length -= 12;
        data += 12;
    }
    if (length == 0) return c;
    unsigned char tail[12] = {};
    std::memcpy(tail, data, length);
    a += word(tail);
    b += word(tail + 4);
    c += word(tail + 8);
    c ^= b, c -= rotate(b, 14);
    a ^= c, a -= rotate(c, 11);
    b ^= a, b -= rotate(a, 25);
    c ^= b, c -= rotate(b, 16);
    a ^= c, a -= rotate(c, 4);
    b ^= a, b -= rotate(a, 14);
    c ^= b, c -= rotate(b, 24);
    return c;
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
    const uint32_t checksum = lookup3(bytes, checked);
    for (int i = 0; i < 4; ++i)
        bytes[checked + i] = static_cast<unsigned char>(checksum >> (8 * i));
}

std::string short_fingerprint(const std::string& fingerprint, const std::string& other) {
    const std::size_t length = fingerprint.compare(0, 12, other, 0, 12) == 0 ? 64 : 12;
    return fingerprint.substr(0, length);
}

std::string describe_model(const CacheModelInfo& model, const std::string& other_fingerprint) {
    std::string text = model.model_name.empty() ? "" : kv::quoted(model.model_name) + " ";
    return text + "(fingerprint " + short_fingerprint(model.model_fingerprint, other_fingerprint) +
           ")";
}

}  // namespace

// ---------------------------------------------------------------------------------------------

const char* cache_dtype_name(CacheDtype dtype) {
    switch (dtype) {
        case CacheDtype::f32:
            return "f32";
        case CacheDtype::bf16:
            return "bf16";
        case CacheDtype::f16:
            return "f16";
    }
    return "unknown";
}

CacheDtype parse_cache_dtype(const std::string& name) {
    if (name == "f32") return CacheDtype::f32;
    if (name == "bf16") return CacheDtype::bf16;
    if (name == "f16") return CacheDtype::f16;
    throw FormatError("unknown cache dtype " + kv::quoted(name) + " (expected f32, bf16 or f16)");
}

std::size_t cache_dtype_size(CacheDtype dtype) {
    return dtype == CacheDtype::f32 ? 4 : 2;
}

void check_compatible(const CacheModelInfo& expected, const CacheModelInfo& found,
                      const std::string& what) {
    // `what` usually comes from CacheReader::source(): already quoted, or "standard input".
    const bool formatted = (!what.empty() && what.front() == '\'') || what == "standard input";
    const std::string subject = "cache " + (formatted ? what : kv::quoted(what));
    if (found.model_fingerprint != expected.model_fingerprint)
        throw MismatchError(subject + " was baked with model " +
                            describe_model(found, expected.model_fingerprint) + ", not " +
                            describe_model(expected, found.model_fingerprint));
    if (found.tokenizer_fingerprint != expected.tokenizer_fingerprint)
        throw MismatchError(
            subject + " was baked with another tokenizer (fingerprint " +
            short_fingerprint(found.tokenizer_fingerprint, expected.tokenizer_fingerprint) +
            ") than the one in use (fingerprint " +
            short_fingerprint(expected.tokenizer_fingerprint, found.tokenizer_fingerprint) + ")");
    auto differ = [&](const std::string& field, const std::string& got, const std::string& want) {
        if (got != want)
            throw MismatchError(subject + " has " + field + " " + got + ", expected " + want);
    };
    differ("architecture", kv::quoted(found.architecture), kv::quoted(expected.architecture));
    differ("num_layers", std::to_string(found.num_layers), std::to_string(expected.num_layers));
    differ("num_kv_heads", std::to_string(found.num_kv_heads),
           std::to_string(expected.num_kv_heads));
    differ("head_dim", std::to_string(found.head_dim), std::to_string(expected.head_dim));
    differ("rope_layout", kv::quoted(found.rope_layout), kv::quoted(expected.rope_layout));
    auto exact = [](double value) {
        char text[32];
        std::snprintf(text, sizeof text, "%.17g", value);
        return std::string(text);
    };
    differ("rope_theta", exact(found.rope_theta), exact(expected.rope_theta));
    differ("rope_scaling", kv::quoted(found.rope_scaling), kv::quoted(expected.rope_scaling));
    differ("dtype", cache_dtype_name(found.dtype), cache_dtype_name(expected.dtype));
}

// ---------------------------------------------------------------------------------------------
// CacheWriter

struct CacheWriter::State {
    std::filesystem::path path;
    std::string source;  // quoted, for messages
    bool to_stdout = false;
    std::filesystem::path temporary;  // the file being written (empty for stdout)
    CacheModelInfo model;
    Provenance provenance;
    CacheWriteOptions options;
    Handle file;
    Handle packets;
    Handle key_type;  // file datatype of keys and values
    std::vector<PacketInfo> infos;
    std::unordered_set<std::string> ids;
    bool finished = false;
    bool broken = false;  // an HDF5 write failed midway: the file cannot be finished
    bool has_index = false;
    bool has_ragged = false;
    bool has_quantized = false;
    std::optional<Adapter> adapter;

    void discard() {  // with the HDF5 lock held
        packets.reset();
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
    if (options.chunk_tokens <= 0)
        throw UsageError("chunk_tokens must be positive, not " +
                         std::to_string(options.chunk_tokens));
    if (s.to_stdout && !options.force && ::isatty(STDOUT_FILENO))
        throw UsageError(
            "refusing to write binary cache data to a terminal (use -o FILE, or --force)");

    const Lock lock = lock_hdf5();
    Handle access(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    // The 1.10 object formats make a small packet ~2.5 KB instead of ~17 KB (compact groups,
    // fixed-array chunk indexes); pinning the upper bound keeps files readable by HDF5 1.10 when
    // written by a later library.
    H5Pset_libver_bounds(access.get(), H5F_LIBVER_V110, H5F_LIBVER_V110);
    // The root group is created with the file: its times come from the file creation list.
    Handle creation(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
    H5Pset_obj_track_times(creation.get(), false);
    if (s.to_stdout) {
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
        std::error_code error;
        if (std::filesystem::is_directory(path, error))
            throw IoError("cannot write " + s.source + ": Is a directory");
        const std::filesystem::path directory = path.has_parent_path() ? path.parent_path() : ".";
        std::random_device entropy;
        s.temporary = directory / ("." + path.filename().string() + ".tmp-" +
                                   std::to_string(::getpid()) + "-" + std::to_string(entropy()));
        // Create it ourselves first: the system's reason reads better than HDF5's.
        const int fd = ::open(s.temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) {
            const std::string reason = system_reason();
            s.temporary.clear();
            throw IoError("cannot create " + s.source + ": " + reason);
        }
        ::close(fd);
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
        // The lowest version that describes the file: 1.0 until a packet brings an index.
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

namespace {

// What is wrong with a packet's per-head kept tokens (section 6.3), "" when nothing is: the sizes,
// each head's used slots at increasing positions inside the packet, and no slot position above
// the packet's `positions` entry for it (which readers without per-head masks rely on).
std::string ragged_problem(const Packet& packet, int64_t layers, int64_t heads) {
    const int64_t slots = packet.stored_length();
    const auto planes = static_cast<std::size_t>(layers * heads);
    if (packet.head_lengths.size() != planes)
        return "head_lengths has " + std::to_string(packet.head_lengths.size()) +
               " entries, expected " + std::to_string(planes) + " (layers x kv-heads)";
    if (packet.head_positions.size() != planes * static_cast<std::size_t>(slots))
        return "head_positions has " + std::to_string(packet.head_positions.size()) +
               " entries, expected " + std::to_string(planes * static_cast<std::size_t>(slots)) +
               " (layers x kv-heads x stored_length)";
    for (std::size_t plane = 0; plane < planes; ++plane) {
        const int64_t used = packet.head_lengths[plane];
        const std::string where =
            "layer " + std::to_string(plane / static_cast<std::size_t>(heads)) + ", kv-head " +
            std::to_string(plane % static_cast<std::size_t>(heads));
        if (used < 0 || used > slots)
            return "head_lengths of " + where + " is " + std::to_string(used) +
                   ", outside [0, stored_length " + std::to_string(slots) + "]";
        const int64_t* positions =
            packet.head_positions.data() + plane * static_cast<std::size_t>(slots);
        for (int64_t slot = 0; slot < used; ++slot) {
            const int64_t position = positions[slot];
            if (position < 0 || position >= packet.logical_length)
                return "head position " + std::to_string(position) + " of " + where +
                       " is outside [0, logical_length " + std::to_string(packet.logical_length) +
                       ")";
            if (slot > 0 && position <= positions[slot - 1])
                return "head positions of " + where + " do not increase";
            if (position > packet.positions[static_cast<std::size_t>(slot)])
                return "head position " + std::to_string(position) + " of " + where +
                       " exceeds the slot's position " +
                       std::to_string(packet.positions[static_cast<std::size_t>(slot)]);
        }
    }
    return "";
}

// The sizes of an index must match its packet before anything is written.
void check_index(const PacketIndex& index, const CacheModelInfo& m, int64_t stored,
                 const std::string& what) {
    auto fail = [&](const std::string& problem) {
        throw FormatError(what + ": invalid index: " + problem);
    };
    if (static_cast<int64_t>(index.projection.size()) != m.head_dim + 1)
        fail("the projection needs head_dim + 1 values");
    if (index.page_size < 2) fail("page_size below 2");
    int64_t next = 0;
    for (const IndexSegment& segment : index.segments) {
        if (segment.first != next || segment.count <= 0) fail("segments must tile the tokens");
        next += segment.count;
    }
    if (next != stored) fail("segments must tile the tokens");
    if (static_cast<int64_t>(index.layouts.size()) !=
        m.num_layers * m.num_kv_heads * static_cast<int64_t>(index.segments.size()))
        fail("one layout per layer, kv-head and segment is needed");
    for (std::size_t i = 0; i < index.layouts.size(); ++i) {
        const DciLayout& layout = index.layouts[i];
        const auto count =
            static_cast<std::size_t>(index.segments[i % index.segments.size()].count);
        int64_t paged = 0;
        for (int32_t size : layout.page_sizes)
            paged += size;
        if (layout.levels.size() != count || layout.parents.size() != count ||
            layout.page_tokens.size() != count || paged != static_cast<int64_t>(count))
            fail("a layout does not match its segment's length");
    }
}

void write_index(const FileWriter& out, hid_t packet_group, const PacketIndex& index,
                 const CacheModelInfo& m, int64_t stored, const CacheWriteOptions& options) {
    Handle group = out.create_group(packet_group, "index");
    const hid_t g = group.get();
    out.write_string(g, "method", "mdci");
    out.write_integer(g, "page_size", index.page_size);
    out.write_double(g, "promotion_first", index.promotion_first);
    out.write_double(g, "promotion_rest", index.promotion_rest);
    const auto layers = static_cast<hsize_t>(m.num_layers),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    const auto segments = static_cast<hsize_t>(index.segments.size());
    const auto tokens = static_cast<hsize_t>(stored);
    out.write_dataset(g, "projection", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {index.projection.size()},
                      {}, options, false, index.projection.data());
    std::vector<int64_t> segment_table;
    for (const IndexSegment& segment : index.segments)
        segment_table.insert(segment_table.end(), {segment.first, segment.count, segment.delta});
    out.write_dataset(g, "segments", H5T_STD_I64LE, H5T_NATIVE_INT64, {segments, 3}, {}, options,
                      false, segment_table.data());

    std::vector<double> norms;
    std::vector<int32_t> page_counts;
    std::vector<int8_t> levels;
    std::vector<int32_t> parents, page_tokens;
    std::vector<std::vector<int32_t>> sizes_per_plane(layers * heads);
    std::size_t widest = 1;
    for (std::size_t plane = 0; plane < layers * heads; ++plane) {
        for (std::size_t segment = 0; segment < segments; ++segment) {
            const DciLayout& layout = index.layouts[plane * segments + segment];
            norms.push_back(layout.max_squared_norm);
            page_counts.push_back(static_cast<int32_t>(layout.page_sizes.size()));
            levels.insert(levels.end(), layout.levels.begin(), layout.levels.end());
            parents.insert(parents.end(), layout.parents.begin(), layout.parents.end());
            page_tokens.insert(page_tokens.end(), layout.page_tokens.begin(),
                               layout.page_tokens.end());
            sizes_per_plane[plane].insert(sizes_per_plane[plane].end(), layout.page_sizes.begin(),
                                          layout.page_sizes.end());
        }
        widest = std::max(widest, sizes_per_plane[plane].size());
    }
    std::vector<int32_t> page_sizes(layers * heads * widest, 0);
    for (std::size_t plane = 0; plane < layers * heads; ++plane)
        std::copy(sizes_per_plane[plane].begin(), sizes_per_plane[plane].end(),
                  page_sizes.begin() + static_cast<std::ptrdiff_t>(plane * widest));
    const std::vector<hsize_t> per_token = {layers, heads, tokens};
    const std::vector<hsize_t> token_chunk = {
        1, 1, std::max<hsize_t>(1, std::min<hsize_t>(tokens, max_1d_chunk))};
    out.write_dataset(g, "max_squared_norm", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                      {layers, heads, segments}, {}, options, false, norms.data());
    out.write_dataset(g, "page_counts", H5T_STD_I32LE, H5T_NATIVE_INT32, {layers, heads, segments},
                      {}, options, false, page_counts.data());
    out.write_dataset(g, "levels", H5T_STD_I8LE, H5T_NATIVE_INT8, per_token, token_chunk, options,
                      true, levels.data());
    out.write_dataset(g, "parents", H5T_STD_I32LE, H5T_NATIVE_INT32, per_token, token_chunk,
                      options, true, parents.data());
    out.write_dataset(g, "page_tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, per_token, token_chunk,
                      options, true, page_tokens.data());
    out.write_dataset(g, "page_sizes", H5T_STD_I32LE, H5T_NATIVE_INT32,
                      {layers, heads, static_cast<hsize_t>(widest)},
                      {1, 1, std::min<hsize_t>(widest, max_1d_chunk)}, options, true,
                      page_sizes.data());
}

// Section 6.6: group `quantized` with codes, f16 scales and offsets, and the residual window,
// instead of `keys` and `values`.
void write_quantized(const FileWriter& out, hid_t packet_group, const Packet& packet,
                     const Quantization& quantization, const CacheModelInfo& m,
                     const CacheWriteOptions& options, hid_t key_type) {
    const int64_t planes = m.num_layers * m.num_kv_heads, slots = packet.stored_length();
    Handle group = out.create_group(packet_group, "quantized");
    out.write_integer(group.get(), "bits", quantization.bits);
    out.write_integer(group.get(), "group_size", quantization.group_size);
    out.write_integer(group.get(), "residual_tokens", quantization.residual_tokens);
    const auto layers = static_cast<hsize_t>(m.num_layers),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    // The codes read from a file, when nothing changed since: quantising their dequantised
    // values again would move them by rounding at every rewrite (kvindex, merge, append).
    // Checked here, on the rare rewrite, rather than by hashing every load.
    const QuantizedPayload* stored = packet.stored_quantized.get();
    auto unchanged = [&](const QuantizedTensor& tensor, const std::vector<std::byte>& bytes) {
        return dequantize_tensor(tensor, m.dtype, planes, slots, m.head_dim, quantization) == bytes;
    };
    const bool reuse = stored && stored->quantization == quantization &&
                       unchanged(stored->keys, packet.keys) &&
                       unchanged(stored->values, packet.values);
    for (const bool keys : {true, false}) {
        const QuantizedTensor tensor =
            reuse ? (keys ? stored->keys : stored->values)
                  : quantize_tensor((keys ? packet.keys : packet.values).data(), m.dtype, planes,
                                    slots, m.head_dim, quantization);
        const std::string prefix = keys ? "key_" : "value_";
        const auto quantized = static_cast<hsize_t>(tensor.quantized_slots);
        const auto residual = static_cast<hsize_t>(slots - tensor.quantized_slots);
        const auto code_bytes = static_cast<hsize_t>(m.head_dim * quantization.bits / 8);
        const auto groups = static_cast<hsize_t>(m.head_dim / quantization.group_size);
        const auto chunk_tokens = static_cast<hsize_t>(options.chunk_tokens);
        out.write_dataset(
            group.get(), prefix + "codes", H5T_STD_U8LE, H5T_NATIVE_UINT8,
            {layers, heads, quantized, code_bytes},
            {1, 1, std::max<hsize_t>(1, std::min(quantized, chunk_tokens)), code_bytes}, options,
            false, tensor.codes.data());
        for (const auto& [name, values] :
             {std::pair<const char*, const std::vector<float>*>{"scales", &tensor.scales},
              {"offsets", &tensor.offsets}})
            out.write_dataset(
                group.get(), prefix + name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                {layers, heads, quantized, groups},
                {1, 1, std::max<hsize_t>(1, std::min(quantized, chunk_tokens)), groups}, options,
                true, values->data());
        out.write_dataset(group.get(), prefix + "residual", key_type, key_type,
                          {layers, heads, residual, static_cast<hsize_t>(m.head_dim)},
                          {1, 1, std::max<hsize_t>(1, std::min(residual, chunk_tokens)),
                           static_cast<hsize_t>(m.head_dim)},
                          options, true, tensor.residual.data(),
                          m.dtype == CacheDtype::bf16 ? "bf16" : nullptr);
    }
}

}  // namespace

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

    if (!packet.index.empty()) check_index(packet.index, m, stored, what);
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
    Handle group = out.create_group(s.packets.get(), packet_group_name(s.infos.size()));
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
        1, 1, std::min<hsize_t>(length, static_cast<hsize_t>(s.options.chunk_tokens)), dims[3]};
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
        const hsize_t layers = static_cast<hsize_t>(m.num_layers),
                      heads = static_cast<hsize_t>(m.num_kv_heads);
        out.write_dataset(group.get(), "head_lengths", H5T_STD_I64LE, H5T_NATIVE_INT64,
                          {layers, heads}, {}, s.options, false, packet.head_lengths.data());
        out.write_dataset(group.get(), "head_positions", H5T_STD_I64LE, H5T_NATIVE_INT64,
                          {layers, heads, length},
                          {1, 1, std::max<hsize_t>(1, std::min<hsize_t>(length, max_1d_chunk))},
                          s.options, true, packet.head_positions.data());
        s.has_ragged = true;
    }
    if (!packet.index.empty()) {
        write_index(out, group.get(), packet.index, m, stored, s.options);
        s.has_index = true;
    }
    s.broken = false;

    s.ids.insert(packet.id);
    s.infos.push_back({packet.id, packet.text_sha256, packet.logical_length, stored,
                       packet.adapter_fingerprint, packet.header_tokens, packet.trailer_tokens});
}

namespace {

// Why `adapter` cannot be stored, or "".
std::string adapter_problem(const Adapter& adapter) {
    if (adapter.hidden_size <= 0) return "hidden size " + std::to_string(adapter.hidden_size);
    const std::size_t width = static_cast<std::size_t>(adapter.hidden_size);
    for (const auto* vectors : {&adapter.header, &adapter.trailer})
        if (vectors->size() % width != 0)
            return std::to_string(vectors->size()) + " values are not rows of " +
                   std::to_string(width);
    if (adapter.header.empty() && adapter.trailer.empty()) return "no soft tokens";
    for (const auto* vectors : {&adapter.header, &adapter.trailer})
        for (float value : *vectors)
            if (!std::isfinite(value)) return "a soft token holds a value that is not finite";
    if (adapter.has_optimizer_state() &&
        (adapter.header_moment.size() != adapter.header.size() ||
         adapter.header_second_moment.size() != adapter.header.size() ||
         adapter.trailer_moment.size() != adapter.trailer.size() ||
         adapter.trailer_second_moment.size() != adapter.trailer.size() ||
         adapter.optimizer_step < 0))
        return "optimizer state does not match the soft tokens";
    return "";
}

void write_adapter(const FileWriter& out, hid_t root, const Adapter& adapter,
                   const CacheWriteOptions& options) {
    Handle group = out.create_group(root, "adapter");
    const hid_t g = group.get();
    out.write_string(g, "fingerprint", adapter.fingerprint());
    out.write_integer(g, "header_tokens", adapter.header_tokens());
    out.write_integer(g, "trailer_tokens", adapter.trailer_tokens());
    out.write_integer(g, "hidden_size", adapter.hidden_size);
    out.write_double(g, "init_mean", adapter.init_mean);
    out.write_double(g, "init_std", adapter.init_std);
    out.write_string(g, "training", adapter.training);
    const hsize_t width = static_cast<hsize_t>(adapter.hidden_size);
    auto write_rows = [&](hid_t parent, const char* name, const std::vector<float>& values) {
        const hsize_t rows = values.size() / width;
        out.write_dataset(parent, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {rows, width},
                          {std::max<hsize_t>(rows, 1), width}, options, true, values.data());
    };
    write_rows(g, "header", adapter.header);
    write_rows(g, "trailer", adapter.trailer);
    if (adapter.has_optimizer_state()) {
        Handle optimizer = out.create_group(g, "optimizer");
        out.write_integer(optimizer.get(), "step", adapter.optimizer_step);
        write_rows(optimizer.get(), "header_moment", adapter.header_moment);
        write_rows(optimizer.get(), "header_second_moment", adapter.header_second_moment);
        write_rows(optimizer.get(), "trailer_moment", adapter.trailer_moment);
        write_rows(optimizer.get(), "trailer_second_moment", adapter.trailer_second_moment);
    }
}

}  // namespace

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
        const int minor = s.adapter         ? adapter_minor
                          : s.has_quantized ? quantized_minor
                          : s.has_ragged    ? ragged_minor
                          : s.has_index     ? index_minor
                                            : 0;
        if (minor > 0) {
            if (H5Adelete(s.file.get(), "format_version") < 0)
                out.fail_hdf5("cannot update the format version");
            out.write_string(s.file.get(), "format_version",
                             std::to_string(format_major) + "." + std::to_string(minor));
        }
        std::vector<std::string> features;
        if (s.has_ragged) features.push_back(ragged_feature);
        if (s.has_quantized) features.push_back(quantized_feature);
        if (!features.empty()) out.write_string_list(s.file.get(), "required_features", features);
        // Last, so that a file that has it is whole (readers refuse one without it).
        out.write_integer(s.file.get(), "complete", 1);
        s.packets.reset();
        s.key_type.reset();
        if (s.to_stdout) {
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
    const int fd = ::open(s.temporary.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) {
        const std::string reason = system_reason();
        if (fd >= 0) ::close(fd);
        s.discard();
        throw IoError("cannot sync " + s.source + ": " + reason);
    }
    ::close(fd);
    if (s.options.no_replace) {
        // link() fails with EEXIST where rename() would replace: the first writer wins.
        if (::link(s.temporary.c_str(), s.path.c_str()) != 0) {
            const std::string reason =
                errno == EEXIST ? "another process created it meanwhile; run again to append to it"
                                : system_reason();
            s.discard();
            throw IoError("cannot create " + s.source + ": " + reason);
        }
        ::unlink(s.temporary.c_str());
    } else if (::rename(s.temporary.c_str(), s.path.c_str()) != 0) {
        const std::string reason = system_reason();
        s.discard();
        throw IoError("cannot rename onto " + s.source + ": " + reason);
    }
    s.temporary.clear();
    // Make the rename itself durable.
    const std::filesystem::path directory = s.path.has_parent_path() ? s.path.parent_path() : ".";
    const int dir = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
        ::fsync(dir);
        ::close(dir);
    }
}

// ---------------------------------------------------------------------------------------------
// CacheReader

struct CacheReader::State {
    std::string source;
    std::string version;
    CacheModelInfo model;
    Provenance provenance;
    std::vector<PacketInfo> packets;
    std::unordered_map<std::string, std::size_t> by_id;
    std::vector<char> image;       // standard input, which the file image views in place
    RawSource raw;                 // the file's bytes, for checks HDF5 does not make
    bool raw_checks = false;       // heap ids can be checked (no user block before the superblock)
    bool ragged_declared = false;  // required_features lists ragged-heads
    bool quantized_declared = false;  // and quantized-kv
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
    const FileReader checked(s.source, s.raw_checks ? &s.raw : nullptr);
    const hid_t root = s.file.get();

    // Identity and version first: they decide whether anything else can be understood.
    if (!FileReader::has_attribute(root, "format"))
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
    }
    if (!unknown.empty()) {
        std::string list;
        for (const std::string& name : unknown)
            list += (list.empty() ? "" : ", ") + name;
        in.fail("requires " + std::string(unknown.size() == 1 ? "feature " : "features ") + list +
                ", which this reader does not implement");
    }
    if (!FileReader::has_attribute(root, "complete") ||
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
        Handle group = in.open_group(root, "packet_index", "/packet_index");
        const hid_t g = group.get();
        Handle ids_dataset = in.open_dataset(g, "id", "/packet_index/id");
        const std::vector<hsize_t> dims =
            in.dataset_dims(ids_dataset.get(), kv::quoted("/packet_index/id"));
        if (dims.size() != 1) in.fail("'/packet_index/id' is not 1-D");
        const hsize_t count = dims[0];
        if (count > memory_bytes() / 256)
            in.fail("the packet index lists " + std::to_string(count) +
                    " packets, more than this machine's memory can list");
        const std::vector<std::string> ids =
            checked.read_strings(ids_dataset.get(), true, "/packet_index/id", "");
        const std::string length_name = "'/packet_index/id'";
        auto strings = [&](const char* name) {
            return checked.string_dataset(g, name, "/packet_index/" + std::string(name), count,
                                          length_name);
        };
        auto integers = [&](const char* name) {
            return in.integer_dataset(g, name, "/packet_index/" + std::string(name), count,
                                      length_name);
        };
        const std::vector<std::string> hashes = strings("text_sha256");
        const std::vector<std::string> adapters = strings("adapter_fingerprint");
        const std::vector<int64_t> logical = integers("logical_length");
        const std::vector<int64_t> stored = integers("stored_length");
        const std::vector<int64_t> headers = integers("header_tokens");
        const std::vector<int64_t> trailers = integers("trailer_tokens");
        s.packets.reserve(count);
        for (std::size_t i = 0; i < count; ++i) {
            PacketInfo info{ids[i],      hashes[i],  logical[i], stored[i],
                            adapters[i], headers[i], trailers[i]};
            const std::string what = "packet " + kv::quoted(info.id);
            if (info.id.empty())
                in.fail("packet index entry " + std::to_string(i) + " has an empty id");
            if (!valid_utf8(info.id))
                in.fail("packet index entry " + std::to_string(i) + " has an id that is not UTF-8");
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
            const auto [at, inserted] = s.by_id.emplace(info.id, i);
            if (!inserted)
                in.fail("duplicate packet id " + kv::quoted(info.id) + " (entries " +
                        std::to_string(at->second) + " and " + std::to_string(i) + ")");
            s.packets.push_back(std::move(info));
        }
        if (count > 0) in.open_group(root, "packets", "/packets");
    }
    s.f16_type = make_f16_type();
}

CacheReader::~CacheReader() {
    if (!state_) return;
    const Lock lock = lock_hdf5();
    state_->f16_type.reset();
    state_->file.reset();
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
    return state_->packets;
}

bool CacheReader::has_packet(const std::string& id) const {
    return state_->by_id.count(id) != 0;
}

const PacketInfo& CacheReader::packet_info(const std::string& id) const {
    const auto found = state_->by_id.find(id);
    if (found == state_->by_id.end()) {
        // Name a few of the ids it does hold: the usual cause is a typo or the wrong file.
        std::string held;
        for (std::size_t i = 0; i < state_->packets.size() && i < 5; ++i)
            held += (i ? ", " : "") + kv::quoted(state_->packets[i].id);
        if (state_->packets.size() > 5) held += ", ...";
        throw FormatError("no packet " + kv::quoted(id) + " in " + state_->source +
                          (held.empty() ? " (it holds no packet)"
                                        : " (it holds " + std::to_string(state_->packets.size()) +
                                              ": " + held + ")"));
    }
    return state_->packets[found->second];
}

namespace {

// The packet's index group (6.5), or an empty index when it has none or one of another method.
// The attributes of a packet's `quantized` group (section 6.6), unchecked.
Quantization read_quantization(const FileReader& in, hid_t group) {
    Quantization quantization;
    quantization.bits = static_cast<int>(in.integer_attribute(group, "bits", "quantized"));
    quantization.group_size = in.integer_attribute(group, "group_size", "quantized");
    quantization.residual_tokens = in.integer_attribute(group, "residual_tokens", "quantized");
    return quantization;
}

// Which of an index's per-token layouts read_index reads.
struct LayoutChoice {
    enum class Which { all, none, one } which = Which::all;
    std::size_t plane = 0, segment = 0;  ///< for `one`
};

PacketIndex read_index(const FileReader& in, hid_t packet_group, const CacheModelInfo& m,
                       int64_t stored, LayoutChoice choice = {}) {
    PacketIndex index;
    if (H5Lexists(packet_group, "index", H5P_DEFAULT) <= 0) return index;
    Handle group = in.open_group(packet_group, "index", "index");
    const hid_t g = group.get();
    if (in.string_attribute(g, "method", "index") != "mdci") return index;
    index.page_size = in.integer_attribute(g, "page_size", "index");
    index.promotion_first = in.float_attribute(g, "promotion_first", "index");
    index.promotion_rest = in.float_attribute(g, "promotion_rest", "index");
    if (index.page_size < 2 || index.page_size > (1 << 20))
        in.fail("index: page_size " + std::to_string(index.page_size) + " out of range");
    const auto dim = static_cast<hsize_t>(m.head_dim);
    index.projection =
        in.numeric_dataset<float>(g, "projection", "index/projection", {dim + 1}, H5T_NATIVE_FLOAT);
    std::vector<hsize_t> dims;
    const std::vector<int64_t> table = in.numeric_dataset<int64_t>(g, "segments", "index/segments",
                                                                   {0, 3}, H5T_NATIVE_INT64, &dims);
    const auto segments = dims[0];
    int64_t next = 0;
    for (hsize_t i = 0; i < segments; ++i) {
        const IndexSegment segment{table[i * 3], table[i * 3 + 1], table[i * 3 + 2]};
        if (segment.first != next || segment.count <= 0)
            in.fail("index: segments do not tile the packet's tokens");
        next += segment.count;
        index.segments.push_back(segment);
    }
    if (next != stored) in.fail("index: segments do not tile the packet's tokens");
    const auto layers = static_cast<hsize_t>(m.num_layers),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    const auto tokens = static_cast<hsize_t>(stored);
    const auto norms = in.numeric_dataset<double>(g, "max_squared_norm", "index/max_squared_norm",
                                                  {layers, heads, segments}, H5T_NATIVE_DOUBLE);
    const auto page_counts = in.numeric_dataset<int32_t>(
        g, "page_counts", "index/page_counts", {layers, heads, segments}, H5T_NATIVE_INT32);
    // Read one (layer, kv-head) row at a time straight into its layouts: memory never holds
    // the datasets twice (a long packet's index is tens of bytes per token and plane).
    const Handle levels =
        in.numeric_dataset_checked(g, "levels", "index/levels", {layers, heads, tokens});
    const Handle parents =
        in.numeric_dataset_checked(g, "parents", "index/parents", {layers, heads, tokens});
    const Handle page_tokens =
        in.numeric_dataset_checked(g, "page_tokens", "index/page_tokens", {layers, heads, tokens});
    const Handle page_sizes =
        in.numeric_dataset_checked(g, "page_sizes", "index/page_sizes", {layers, heads, 0}, &dims);
    const std::size_t widest = dims[2];
    if (choice.which == LayoutChoice::Which::none) return index;
    // The caller checked the plane; a segment beyond the index's is the caller's mistake too.
    if (choice.which == LayoutChoice::Which::one &&
        (choice.plane >= layers * heads || choice.segment >= segments))
        throw UsageError(in.source() + ": no index layout for plane " +
                         std::to_string(choice.plane) + ", segment " +
                         std::to_string(choice.segment) + " (the index has " +
                         std::to_string(segments) + " segment" + (segments == 1 ? "" : "s") + ")");
    std::vector<int32_t> plane_page_sizes;
    for (std::size_t plane = 0; plane < layers * heads; ++plane) {
        if (choice.which == LayoutChoice::Which::one && plane != choice.plane) continue;
        const hsize_t layer = plane / heads, head = plane % heads;
        in.read_row(page_sizes.get(), "index/page_sizes", H5T_NATIVE_INT32, layer, head, 0, widest,
                    plane_page_sizes);
        std::size_t page = 0;
        for (std::size_t s = 0; s < segments; ++s) {
            const IndexSegment& segment = index.segments[s];
            const auto from = static_cast<hsize_t>(segment.first);
            const auto count = static_cast<hsize_t>(segment.count);
            const int32_t pages = page_counts[plane * segments + s];
            if (pages < 0 || page + static_cast<std::size_t>(pages) > widest)
                in.fail("index: page_counts exceed page_sizes");
            if (choice.which == LayoutChoice::Which::one && s != choice.segment) {
                page += static_cast<std::size_t>(pages);  // an earlier segment's pages
                continue;
            }
            DciLayout layout;
            layout.max_squared_norm = norms[plane * segments + s];
            in.read_row(levels.get(), "index/levels", H5T_NATIVE_INT8, layer, head, from, count,
                        layout.levels);
            in.read_row(parents.get(), "index/parents", H5T_NATIVE_INT32, layer, head, from, count,
                        layout.parents);
            in.read_row(page_tokens.get(), "index/page_tokens", H5T_NATIVE_INT32, layer, head, from,
                        count, layout.page_tokens);
            int64_t held = 0;
            for (int32_t p = 0; p < pages; ++p, ++page) {
                const int32_t size = plane_page_sizes[page];
                if (size <= 0 || size > index.page_size) in.fail("index: a page size out of range");
                held += size;
                layout.page_sizes.push_back(size);
            }
            if (held != segment.count) in.fail("index: pages do not hold the segment's tokens");
            index.layouts.push_back(std::move(layout));
        }
    }
    return index;
}

}  // namespace

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
    const PacketInfo& info = packet_info(id);
    const CacheModelInfo& m = s.model;
    if (layer < 0 || layer >= m.num_layers || head < 0 || head >= m.num_kv_heads || segment < 0)
        throw UsageError("no index layout for layer " + std::to_string(layer) + ", kv-head " +
                         std::to_string(head) + ", segment " + std::to_string(segment) + " in " +
                         s.source);
    const FileReader in(s.source + ": packet " + kv::quoted(id));
    const std::string path = "/packets/" + packet_group_name(s.by_id.at(id));
    const Lock lock = lock_hdf5();
    Handle group = in.open_group(s.file.get(), path, path);
    PacketIndex index = read_index(
        in, group.get(), m, info.stored_length,
        {LayoutChoice::Which::one, static_cast<std::size_t>(layer * m.num_kv_heads + head),
         static_cast<std::size_t>(segment)});
    if (index.layouts.size() != 1) in.fail("has no index");
    return std::move(index.layouts.front());
}

void CacheReader::read_planes(const std::string& id, const PlaneReceiver& receive) const {
    read_packet(id, false, &receive);
}

Packet CacheReader::read_packet(const std::string& id, bool with_tensors,
                                const PlaneReceiver* receive, bool with_layouts) const {
    const State& s = *state_;
    const PacketInfo& info = packet_info(id);
    const std::size_t ordinal = s.by_id.at(id);
    const FileReader in(s.source + ": packet " + kv::quoted(id));
    const std::string path = "/packets/" + packet_group_name(ordinal);
    const CacheModelInfo& m = s.model;

    const Lock lock = lock_hdf5();
    Handle group = in.open_group(s.file.get(), path, path);
    const hid_t g = group.get();
    if (in.string_attribute(g, "id", path) != id)
        in.fail("the id of group " + kv::quoted(path) + " differs from the packet index");
    for (const auto& [name, value] :
         {std::pair<const char*, int64_t>{"logical_length", info.logical_length},
          {"stored_length", info.stored_length}})
        if (in.integer_attribute(g, name, path) != value)
            in.fail(std::string(name) + " of group " + kv::quoted(path) +
                    " differs from the packet index");

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
        return std::pair<Handle, hid_t>(std::move(dataset), memory_type);
    };
    // A whole tensor (keys, values, a quantised residual).
    auto read_tensor = [&](hid_t parent, const std::string& name, hsize_t tokens,
                           std::vector<std::byte>& target) {
        auto [dataset, memory_type] = open_tensor(parent, name, tokens);
        resize_for_bulk_read(target, static_cast<std::size_t>(m.num_layers * m.num_kv_heads) *
                                         tokens * static_cast<std::size_t>(m.head_dim) *
                                         cache_dtype_size(m.dtype));
        if (!target.empty() &&
            H5Dread(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, target.data()) < 0)
            in.fail_hdf5("cannot read " + kv::quoted(name));
    };
    if (receive && !quantized) {
        // One (layer, kv-head) plane at a time, in pieces of at most 16,384 tokens: the chunks
        // [1, 1, T, D] are read in order and memory holds one piece, however long the packet.
        const auto row_bytes = static_cast<std::size_t>(m.head_dim) * cache_dtype_size(m.dtype);
        const hsize_t piece_tokens = std::min<hsize_t>(length, 16384);
        std::vector<std::byte> piece(static_cast<std::size_t>(piece_tokens) * row_bytes);
        for (const bool keys : {true, false}) {
            const char* name = keys ? "keys" : "values";
            auto [dataset, memory_type] = open_tensor(g, name, length);
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
                            H5Dread(dataset.get(), memory_type, memory_space.get(),
                                    file_space.get(), H5P_DEFAULT, piece.data()) < 0)
                            in.fail_hdf5("cannot read " + kv::quoted(name));
                        (*receive)(layer, head, keys, static_cast<int64_t>(first),
                                   std::span<const std::byte>(piece).first(
                                       static_cast<std::size_t>(count[2]) * row_bytes));
                    }
        }
    }
    if (quantized && (with_tensors || receive)) {
        if (!s.quantized_declared)
            in.fail("is quantised but the file does not list the feature " +
                    kv::quoted(quantized_feature));
        Handle quantized = in.open_group(g, "quantized", "quantized");
        const hid_t q = quantized.get();
        Quantization& quantization = packet.quantization;
        quantization = read_quantization(in, q);
        try {
            check_quantization(quantization, m.head_dim, "quantized");
        } catch (const FormatError& error) {
            in.fail(error.what());
        }
        const int64_t planes = m.num_layers * m.num_kv_heads;
        const auto residual =
            static_cast<hsize_t>(std::min(info.stored_length, quantization.residual_tokens));
        const auto quantized_slots = length - residual;
        const auto layers = static_cast<hsize_t>(m.num_layers),
                   heads = static_cast<hsize_t>(m.num_kv_heads);
        const auto code_bytes = static_cast<hsize_t>(m.head_dim * quantization.bits / 8);
        const auto groups = static_cast<hsize_t>(m.head_dim / quantization.group_size);
        auto payload = std::make_shared<QuantizedPayload>();
        payload->quantization = quantization;
        for (const bool keys : {true, false}) {
            const std::string prefix = keys ? "key_" : "value_";
            QuantizedTensor& tensor = keys ? payload->keys : payload->values;
            tensor.quantized_slots = static_cast<int64_t>(quantized_slots);
            tensor.codes = in.numeric_dataset<uint8_t>(q, prefix + "codes", prefix + "codes",
                                                       {layers, heads, quantized_slots, code_bytes},
                                                       H5T_NATIVE_UINT8);
            for (auto [name, target] :
                 {std::pair<const char*, std::vector<float>*>{"scales", &tensor.scales},
                  {"offsets", &tensor.offsets}})
                *target = in.numeric_dataset<float>(q, prefix + name, prefix + name,
                                                    {layers, heads, quantized_slots, groups},
                                                    H5T_NATIVE_FLOAT);
            read_tensor(q, prefix + "residual", residual, tensor.residual);
            (keys ? packet.keys : packet.values) = dequantize_tensor(
                tensor, m.dtype, planes, info.stored_length, m.head_dim, quantization);
        }
        packet.stored_quantized = std::move(payload);
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
    if (H5Lexists(g, "head_lengths", H5P_DEFAULT) > 0 ||
        H5Lexists(g, "head_positions", H5P_DEFAULT) > 0) {
        if (!s.ragged_declared)
            in.fail(
                "has per-head kept tokens (head_lengths) but the file does not list the "
                "feature " +
                kv::quoted(ragged_feature));
        const auto layers = static_cast<hsize_t>(m.num_layers),
                   heads = static_cast<hsize_t>(m.num_kv_heads);
        packet.head_lengths = in.numeric_dataset<int64_t>(g, "head_lengths", "head_lengths",
                                                          {layers, heads}, H5T_NATIVE_INT64);
        packet.head_positions = in.numeric_dataset<int64_t>(
            g, "head_positions", "head_positions", {layers, heads, length}, H5T_NATIVE_INT64);
        const std::string problem = ragged_problem(packet, m.num_layers, m.num_kv_heads);
        if (!problem.empty()) in.fail(problem);
    }
    packet.index =
        read_index(in, g, m, info.stored_length,
                   {with_layouts ? LayoutChoice::Which::all : LayoutChoice::Which::none});
    if (packet.padded() && !packet.index.empty())
        in.fail("has an index over heads of unequal lengths, which is not defined");
    return packet;
}

bool CacheReader::packet_has(const std::string& id, const char* child) const {
    const State& s = *state_;
    packet_info(id);
    const std::string path = "/packets/" + packet_group_name(s.by_id.at(id)) + "/" + child;
    const Lock lock = lock_hdf5();
    const htri_t exists = H5Lexists(s.file.get(), path.c_str(), H5P_DEFAULT);
    if (exists < 0) H5Eclear2(H5E_DEFAULT);
    return exists > 0;
}

bool CacheReader::has_index(const std::string& id) const {
    return packet_has(id, "index");
}

Quantization CacheReader::quantization(const std::string& id) const {
    const State& s = *state_;
    const Lock lock = lock_hdf5();
    if (!packet_has(id, "quantized")) return {};
    const FileReader in(s.source + ": packet " + kv::quoted(id));
    const std::string path = "/packets/" + packet_group_name(s.by_id.at(id)) + "/quantized";
    Handle group = in.open_group(s.file.get(), path, path);
    return read_quantization(in, group.get());
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
    Handle group = in.open_group(s.file.get(), "adapter", "/adapter");
    const hid_t g = group.get();
    Adapter adapter;
    const std::string fingerprint = in.string_attribute(g, "fingerprint", "/adapter");
    const int64_t header_tokens = in.integer_attribute(g, "header_tokens", "/adapter");
    const int64_t trailer_tokens = in.integer_attribute(g, "trailer_tokens", "/adapter");
    adapter.hidden_size = in.integer_attribute(g, "hidden_size", "/adapter");
    adapter.init_mean = FileReader::has_attribute(g, "init_mean")
                            ? in.float_attribute(g, "init_mean", "/adapter")
                            : 0.0;
    adapter.init_std = FileReader::has_attribute(g, "init_std")
                           ? in.float_attribute(g, "init_std", "/adapter")
                           : 0.0;
    adapter.training = in.string_attribute_or(g, "training", "/adapter", "");
    constexpr int64_t most_tokens = 1 << 16, widest = 1 << 20;
    for (const auto& [name, value, most] :
         {std::tuple<const char*, int64_t, int64_t>{"header_tokens", header_tokens, most_tokens},
          {"trailer_tokens", trailer_tokens, most_tokens},
          {"hidden_size", adapter.hidden_size, widest}})
        if (value < 0 || value > most || (value == 0 && std::string(name) == "hidden_size"))
            in.fail("/adapter: invalid " + std::string(name) + " " + std::to_string(value));
    const hsize_t width = static_cast<hsize_t>(adapter.hidden_size);
    auto rows = [&](hid_t parent, const char* name, const std::string& where, int64_t count) {
        return in.numeric_dataset<float>(parent, name, where + "/" + name,
                                         {static_cast<hsize_t>(count), width}, H5T_NATIVE_FLOAT);
    };
    adapter.header = rows(g, "header", "/adapter", header_tokens);
    adapter.trailer = rows(g, "trailer", "/adapter", trailer_tokens);
    if (H5Lexists(g, "optimizer", H5P_DEFAULT) > 0) {
        Handle optimizer = in.open_group(g, "optimizer", "/adapter/optimizer");
        const hid_t o = optimizer.get();
        const std::string where = "/adapter/optimizer";
        adapter.optimizer_step = in.integer_attribute(o, "step", where);
        adapter.header_moment = rows(o, "header_moment", where, header_tokens);
        adapter.header_second_moment = rows(o, "header_second_moment", where, header_tokens);
        adapter.trailer_moment = rows(o, "trailer_moment", where, trailer_tokens);
        adapter.trailer_second_moment = rows(o, "trailer_second_moment", where, trailer_tokens);
    }
    H5Eclear2(H5E_DEFAULT);
    const std::string problem = adapter_problem(adapter);
    if (!problem.empty()) in.fail("/adapter: " + problem);
    if (adapter.fingerprint() != fingerprint)
        in.fail(
            "/adapter: the soft tokens do not match the adapter's fingerprint (the file is "
            "damaged)");
    return adapter;
}

int64_t Adapter::header_tokens() const {
    return hidden_size > 0 ? static_cast<int64_t>(header.size()) / hidden_size : 0;
}

int64_t Adapter::trailer_tokens() const {
    return hidden_size > 0 ? static_cast<int64_t>(trailer.size()) / hidden_size : 0;
}

std::string Adapter::fingerprint() const {
    Sha256 hash;
    hash.update("kvtools-adapter-v1\n" + std::to_string(header_tokens()) + " " +
                std::to_string(trailer_tokens()) + " " + std::to_string(hidden_size) + "\n");
    hash.update(header.data(), header.size() * sizeof(float));
    hash.update(trailer.data(), trailer.size() * sizeof(float));
    return hash.hex();
}

bool CacheReader::has_head_positions(const std::string& id) const {
    return packet_has(id, "head_lengths");
}

// ---------------------------------------------------------------------------------------------

void merge_cache_files(const std::vector<std::filesystem::path>& inputs,
                       const std::filesystem::path& output, const Provenance& provenance,
                       const CacheWriteOptions& options) {
    if (inputs.empty()) throw UsageError("nothing to merge: no input files");
    if (std::count(inputs.begin(), inputs.end(), std::filesystem::path("-")) > 1)
        throw UsageError("standard input ('-') can be read only once");
    std::vector<std::unique_ptr<CacheReader>> readers;
    for (const std::filesystem::path& input : inputs)
        readers.push_back(std::make_unique<CacheReader>(input));

    const CacheReader& first = *readers.front();
    std::unordered_map<std::string, const CacheReader*> owner;
    for (const auto& reader : readers) {
        if (reader.get() != &first) {
            try {
                check_compatible(first.model(), reader->model(), reader->source());
            } catch (const MismatchError& error) {
                throw MismatchError("cannot merge " + reader->source() + " with " + first.source() +
                                    ": " + error.what());
            }
        }
        for (const PacketInfo& info : reader->packets()) {
            const auto [at, inserted] = owner.emplace(info.id, reader.get());
            if (!inserted)
                throw MismatchError("cannot merge: packet id " + kv::quoted(info.id) +
                                    " is in both " + at->second->source() + " and " +
                                    reader->source());
        }
    }

    CacheWriter writer(output, first.model(), provenance, options);
    for (const auto& reader : readers)
        for (const PacketInfo& info : reader->packets())
            writer.add(reader->read(info.id));
    writer.finish();
}

CacheFileLock::CacheFileLock(const std::filesystem::path& path) {
    const std::string source = kv::quoted(path.string());
    for (int attempt = 0; attempt < 100; ++attempt) {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT) return;
            throw IoError("cannot open " + source + ": " + system_reason());
        }
        if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const bool busy = errno == EWOULDBLOCK;
            const std::string reason = system_reason();
            ::close(fd);
            throw IoError(busy ? source +
                                     " is locked: another process is writing it (try again "
                                     "when it has finished)"
                               : "cannot lock " + source + ": " + reason);
        }
        // The holder before us may have replaced the file: then our lock is on the old one.
        struct stat locked {
        }, named{};
        if (::fstat(fd, &locked) == 0 && ::stat(path.c_str(), &named) == 0 &&
            locked.st_dev == named.st_dev && locked.st_ino == named.st_ino) {
            fd_ = fd;
            return;
        }
        ::close(fd);
    }
    throw IoError("cannot lock " + source + ": it keeps being replaced");
}

CacheFileLock::~CacheFileLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
}

bool Packet::padded() const {
    const int64_t slots = stored_length();
    for (int64_t used : head_lengths)
        if (used != slots) return true;
    return false;
}

CacheSelection parse_cache_selection(const std::string& spec) {
    const std::size_t colon = spec.rfind(':');
    if (spec != "-" && colon != std::string::npos && colon > 0 && !std::filesystem::exists(spec) &&
        std::filesystem::exists(spec.substr(0, colon)))
        return {spec.substr(0, colon), spec.substr(colon + 1)};
    return {spec, ""};
}

}  // namespace kv
