// HDF5 as the cache format uses it: one process-wide lock around the library (1.10 keeps global
// state without locks), handles that close themselves, and readers and writers of attributes and
// datasets whose errors name the file and the object. Private to lib/base/src/format.
#pragma once

#include "hdf5_filters.hpp"
#include "hdf5_read_driver.hpp"
#include "hdf5_zstd.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/memory.hpp"

#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kv::format {

/// Every call into HDF5 holds this lock (recursive: public functions call each other). Taking it
/// the first time also sets HDF5 up: silent (errors become exceptions), the zstd filter
/// registered, its clean-up at exit off.
using Lock = std::unique_lock<std::recursive_mutex>;
Lock lock_hdf5();

/// The innermost message of HDF5's error stack (the most specific: "truncated file: eof = ...",
/// "data error detected by Fletcher32 checksum"), which is then cleared.
std::string hdf5_error_detail();

/// Tokens per chunk of a [L, H, S, row] tensor dataset (section 7): the writer's chunk_tokens,
/// or for 0 (since 1.7) as many as fill 1 MiB (`tensor_chunk_bytes`) of one plane, at least 256.
inline constexpr int64_t tensor_chunk_bytes = int64_t{1} << 20;
inline hsize_t tensor_chunk_tokens(const CacheWriteOptions& options, hsize_t row_bytes) {
    if (options.chunk_tokens > 0) return static_cast<hsize_t>(options.chunk_tokens);
    return std::max<hsize_t>(
        256, static_cast<hsize_t>(tensor_chunk_bytes) / std::max<hsize_t>(row_bytes, 1));
}
/// The name of the layout the root attribute tensor_layout records (section 7).
inline std::string tensor_layout_name(const CacheWriteOptions& options) {
    return options.chunk_tokens > 0 ? "chunks-" + std::to_string(options.chunk_tokens)
                                    : "chunks-1mib";
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

/// Physical memory: an upper bound for anything a file may ask to allocate.
std::size_t memory_bytes();
/// strerror(errno).
std::string system_reason();
/// "[2, 3, 4]".
std::string shape_text(const std::vector<hsize_t>& dims);
bool valid_utf8(const std::string& text);
/// The IEEE binary16 type exactly as h5py builds it for numpy.float16, so that h5py reads f16
/// tensors as float16 and not as an opaque or wider type.
Handle make_f16_type();
Handle make_string_type(H5T_cset_t cset = H5T_CSET_UTF8);
/// The product of `dims`, throwing FormatError when it overflows (with room for 4-byte values).
std::size_t checked_elements(const std::vector<int64_t>& dims);

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

    /// Fails unless `dataset`'s stored bytes can hold `bytes` of values: a dataset's shape is
    /// metadata a crafted file controls, and none of the format's filters makes more than 32,768
    /// bytes of one stored byte (zstd's run-length blocks, 4 bytes for 128 KiB). Called before
    /// memory is set aside for the values (found by fuzzing: 9.6 GB asked of a 54 KB file).
    void require_stored(hid_t dataset, double bytes, const std::string& what) const {
        const double stored = static_cast<double>(H5Dget_storage_size(dataset));
        if (bytes > 0 && stored == 0)
            fail(kv::quoted(what) + " stores no values (the dataset was never written)");
        if (bytes > stored * 32768.0)
            fail(kv::quoted(what) + " would be " + kv::human_size(bytes) + ", more than its " +
                 std::to_string(static_cast<uint64_t>(stored)) + " stored bytes can hold");
    }

    Handle open_group(hid_t parent, const std::string& name, const std::string& where) const {
        const htri_t exists = H5Lexists(parent, name.c_str(), H5P_DEFAULT);
        if (exists < 0) fail_hdf5("cannot open group " + kv::quoted(where));
        if (exists == 0) fail("missing required group " + kv::quoted(where));
        Handle group(H5Gopen2(parent, name.c_str(), H5P_DEFAULT), H5Gclose);
        if (!group.valid()) fail_hdf5("cannot open group " + kv::quoted(where));
        return group;
    }

    Handle open_dataset(hid_t parent, const std::string& name, const std::string& where) const {
        const htri_t exists = H5Lexists(parent, name.c_str(), H5P_DEFAULT);
        if (exists < 0) fail_hdf5("cannot open dataset " + kv::quoted(where));
        if (exists == 0) fail("missing required dataset " + kv::quoted(where));
        Handle dataset(H5Dopen2(parent, name.c_str(), H5P_DEFAULT), H5Dclose);
        if (!dataset.valid()) fail_hdf5("cannot open dataset " + kv::quoted(where));
        return dataset;
    }

    // Whether `object` has the attribute. When HDF5 cannot tell (the object's attribute storage
    // is corrupt), FormatError naming `source`: "missing" would mislead.
    static bool has_attribute(hid_t object, const char* name, const std::string& source = "") {
        const htri_t exists = H5Aexists(object, name);
        if (exists < 0)
            throw FormatError((source.empty() ? "" : source + ": ") + "cannot read attribute " +
                              kv::quoted(name) + ": " + hdf5_error_detail());
        return exists > 0;
    }
    bool has(hid_t object, const char* name) const { return has_attribute(object, name, source_); }

    // Opens an attribute that must hold exactly one element (scalar or one-element 1-D).
    Handle open_scalar_attribute(hid_t object, const char* name, const std::string& where) const {
        if (!has(object, name))
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
        return has(object, name) ? string_attribute(object, name, where) : fallback;
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
        return has(object, name) ? integer_attribute(object, name, where) : fallback;
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
        if (!has(object, name)) return {};
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
            return is_dataset
                       ? read_dataset(object, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buffer)
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

    // Element `index` of a 1-D string dataset, variable- or fixed-length: read_strings for one
    // element (its heap id checked first as read_strings checks them all), for a search that
    // reads a few entries of a long directory.
    std::string string_element(hid_t dataset, hsize_t index, const std::string& name) const {
        Handle type(H5Dget_type(dataset), H5Tclose);
        const std::string what = "dataset " + kv::quoted(name);
        if (H5Tget_class(type.get()) != H5T_STRING) fail(what + " is not a string");
        const H5T_cset_t cset = H5Tget_cset(type.get());
        const hsize_t one = 1;
        Handle file_space(H5Dget_space(dataset), H5Sclose);
        Handle memory_space(H5Screate_simple(1, &one, nullptr), H5Sclose);
        if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &index, nullptr, &one, nullptr) <
            0)
            fail_hdf5("cannot read " + what);
        auto read = [&](hid_t memory_type, void* buffer) {
            const VlenGuard guard(raw_);
            return read_dataset(dataset, memory_type, memory_space.get(), file_space.get(),
                                element_transfer(), buffer);
        };
        if (H5Tis_variable_str(type.get()) > 0) {
            if (raw_) check_heap_ids_of(dataset, 1, what, index);
            Handle memory_type = make_string_type(cset);
            char* pointer = nullptr;
            const int status = read(memory_type.get(), &pointer);
            std::string value = status >= 0 && pointer ? pointer : "";
            H5Dvlen_reclaim(memory_type.get(), memory_space.get(), H5P_DEFAULT, &pointer);
            if (status < 0) fail_hdf5("cannot read " + what);
            return value;
        }
        const std::size_t size = H5Tget_size(type.get());
        if (size == 0) fail(what + " has an invalid string size");
        Handle memory_type(H5Tcopy(H5T_C_S1), H5Tclose);
        H5Tset_size(memory_type.get(), size);
        H5Tset_cset(memory_type.get(), cset);
        H5Tset_strpad(memory_type.get(), H5T_STR_NULLPAD);
        std::vector<char> buffer(size);
        if (read(memory_type.get(), buffer.data()) < 0) fail_hdf5("cannot read " + what);
        return std::string(buffer.data(), strnlen(buffer.data(), size));
    }

    // Element `index` of a 1-D integer dataset, as int64.
    int64_t integer_element(hid_t dataset, hsize_t index, const std::string& what) const {
        Handle type(H5Dget_type(dataset), H5Tclose);
        if (H5Tget_class(type.get()) != H5T_INTEGER) fail(kv::quoted(what) + " is not integer");
        const hsize_t one = 1;
        Handle file_space(H5Dget_space(dataset), H5Sclose);
        Handle memory_space(H5Screate_simple(1, &one, nullptr), H5Sclose);
        int64_t value = 0;
        if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &index, nullptr, &one, nullptr) <
                0 ||
            read_dataset(dataset, H5T_NATIVE_INT64, memory_space.get(), file_space.get(),
                         element_transfer(), &value) < 0)
            fail_hdf5("cannot read " + kv::quoted(what));
        return value;
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
        require_stored(dataset.get(), static_cast<double>(dims[0]) * H5Tget_size(type.get()), what);
        std::vector<int64_t> values(dims[0]);
        if (!values.empty() && read_dataset(dataset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL,
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
            read_dataset(dataset, memory_type, memory_space.get(), file_space.get(), H5P_DEFAULT,
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
        require_stored(dataset.get(), static_cast<double>(count) * sizeof(T), what);
        std::vector<T> values(count);
        if (count > 0 && read_dataset(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                      values.data()) < 0)
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
    // The transfer list of reads of one element (made once; the HDF5 lock is held): HDF5
    // clears its type conversion buffer, 1 MiB by default, at every read, which made reading one
    // string cost 40 us.
    static hid_t element_transfer() {
        static const hid_t transfer = [] {
            const hid_t list = H5Pcreate(H5P_DATASET_XFER);
            H5Pset_buffer(list, 4096, nullptr, nullptr);
            return list;
        }();
        return transfer;
    }

    // HDF5 1.10 follows heap ids without bounds checks (hdf5_read_driver.hpp): check those of a
    // contiguous dataset first. Other layouts are rare for strings and left to HDF5.
    // `first`: the first of the `count` elements checked.
    void check_heap_ids_of(hid_t dataset, std::size_t count, const std::string& what,
                           hsize_t first = 0) const {
        Handle properties(H5Dget_create_plist(dataset), H5Pclose);
        if (H5Pget_layout(properties.get()) != H5D_CONTIGUOUS) return;
        const haddr_t offset = H5Dget_offset(dataset);
        if (offset == HADDR_UNDEF) {
            H5Eclear2(H5E_DEFAULT);
            return;
        }
        const std::string problem = check_heap_ids(*raw_, offset + 16 * first, count);
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

}  // namespace kv::format
