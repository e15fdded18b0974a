#include "hdf5_file.hpp"

#include "spec.hpp"
#include "utf8.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <limits>

namespace kv::format {
namespace {

// HDF5 1.10 serial keeps global state without locks: every call into it from this module holds
// this mutex. Recursive, because public functions call each other.
std::recursive_mutex& hdf5_mutex() {
    static std::recursive_mutex mutex;
    return mutex;
}

// Once per process: silence HDF5's error printing (the library never prints; errors become
// exceptions) and register the filters kvtools reads (zstd among them, so that no plugin path is
// needed; hdf5_filters.hpp says why HDF5's own are replaced). HDF5's own
// clean-up at exit is turned off: after a write failed (a full disk) it closes the broken file
// again and crashes (HDF5 1.10.8); every file is closed by its owner before that anyway.
void init_hdf5() {
    static const bool done = [] {
        H5dont_atexit();
        H5open();
        H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
        register_checked_filters();
        install_vlen_guard();
        return true;
    }();
    (void)done;
}

}  // namespace

Lock lock_hdf5() {
    Lock lock(hdf5_mutex());
    init_hdf5();
    // A thread-safe HDF5 keeps an error stack, and its printing, per thread: silenced in every
    // thread that calls it (kvserve-once --requests reads packets ahead on a thread of its own).
    thread_local const bool silenced = [] {
        H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
        return true;
    }();
    (void)silenced;
    return lock;
}

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
    if (detail.empty()) detail = take_filter_problem();
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

Handle make_f16_type() {
    Handle type(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
    H5Tset_fields(type.get(), 15, 10, 5, 0, 10);
    H5Tset_size(type.get(), 2);
    H5Tset_ebias(type.get(), 15);
    H5Tset_precision(type.get(), 16);
    return type;
}

Handle make_string_type(H5T_cset_t cset) {
    Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(type.get(), H5T_VARIABLE);
    H5Tset_cset(type.get(), cset);
    return type;
}

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

}  // namespace kv::format
