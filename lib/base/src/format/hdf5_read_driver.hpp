// A read-only HDF5 file driver that checks what HDF5 1.10 trusts blindly, internal to the
// library.
//
// HDF5 1.10's global heap (where variable-length strings live) has no checksum, and its reader
// follows object sizes and indexes without bounds checks: one flipped byte there crashes the
// process or loops forever (fixed upstream only in later releases). This driver reads files or
// in-memory images like the sec2 and core drivers, but refuses a global heap collection whose
// objects do not fit it, and object headers whose messages HDF5 would follow out of bounds
// (object_header_problem in the .cpp says which) or that reach outside the file (external
// storage, external links, virtual datasets), so that HDF5 reports a read error instead. Heap ids stored in
// contiguous string datasets are checked against their collections by check_heap_ids before
// HDF5 follows them. Every function here must be called with the library's HDF5 lock held.
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kv {

/// Where the bytes of a file come from: a file descriptor, or a memory image (kept alive by the
/// caller while the file is open).
struct RawSource {
    int fd = -1;
    const std::byte* image = nullptr;
    std::size_t size = 0;  ///< of the image, or of the file
    /// The global heap collections check_heap_ids has walked (address -> each object's size by
    /// its index, none for unused indexes), so that strings read one at a time from a long
    /// dataset (a search of the packet index) walk each collection once, not once per string.
    /// The bytes of an open file do not change.
    mutable std::map<uint64_t, std::vector<uint64_t>> walked_collections;

    /// Reads exactly `length` bytes at `offset`; false past the end or on error.
    bool read(uint64_t offset, std::size_t length, void* buffer) const;
};

/// The name a memory image is opened under (H5Fopen's name): the driver opens no other.
constexpr const char* image_file_name = "standard input";

/// A file access property list that opens the file of `source` (by name: the one file whose
/// descriptor `source` holds) or its image (opened as image_file_name) through the checking
/// driver, which opens no other file (an external link's, a virtual dataset's source). The
/// property list must be closed by the caller.
hid_t make_checked_read_access(const RawSource& source);

/// What the driver refused during the last failed HDF5 call, or "" (and forgets it).
std::string take_read_driver_problem();

/// Checks that every heap id of a contiguous dataset of `count` variable-length strings, stored
/// at `offset` in `source`, names an object of its collection that holds the string's length.
/// Returns "" or the problem.
std::string check_heap_ids(const RawSource& source, uint64_t offset, std::size_t count);

/// Puts a check in front of HDF5's variable-length conversion (once per process): heap ids of
/// strings read while a VlenGuard is active are checked against its file first, so that a
/// corrupt one inside an attribute (whose bytes nothing else sees) fails the read instead of
/// crashing HDF5. False when HDF5 would not take it (then only datasets are checked).
bool install_vlen_guard();

/// Makes `source` the file whose heap ids the conversion check uses, for its lifetime.
class VlenGuard {
  public:
    explicit VlenGuard(const RawSource* source);
    ~VlenGuard();
    VlenGuard(const VlenGuard&) = delete;
    VlenGuard& operator=(const VlenGuard&) = delete;

  private:
    const RawSource* previous_;
};

}  // namespace kv
