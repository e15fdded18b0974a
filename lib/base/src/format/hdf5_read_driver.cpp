#include "hdf5_read_driver.hpp"

#include "kv/error.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <map>
#include <new>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace kv {
namespace {

// Global heap layout (HDF5 file format 1.10, III.E) with 8-byte lengths and offsets, as every
// file kvtools and h5py write has: "GCOL", version 1, 3 reserved bytes, the collection size;
// then objects: index (2 bytes), reference count (2), reserved (4), size (8), data padded to 8.
constexpr std::size_t heap_header_size = 16;
constexpr std::size_t object_header_size = 16;

std::string& last_problem() {
    static std::string problem;
    return problem;
}

uint64_t load_le(const unsigned char* p, int bytes) {
    uint64_t value = 0;
    for (int i = bytes - 1; i >= 0; --i)
        value = value << 8 | p[i];
    return value;
}

bool is_collection(const unsigned char* p, std::size_t size) {
    return size >= heap_header_size && std::memcmp(p, "GCOL\x01", 5) == 0;
}

// Walks the objects of a collection the way HDF5's H5HG__cache_heap_deserialize does, checking
// what it does not. Calls visit(index, object size) for each object. Returns "" or the problem.
template <typename Visit>
std::string walk_collection(const unsigned char* p, std::size_t size, Visit visit) {
    std::size_t at = heap_header_size;
    while (at < size) {
        if (at + object_header_size > size) break;  // a tail too small for a header: free space
        const uint64_t index = load_le(p + at, 2);
        const uint64_t object = load_le(p + at + 8, 8);
        const std::size_t left = size - at;
        uint64_t need;
        if (index == 0) {
            need = object;  // free space: its size counts its header
            if (need == 0 || need > left) return "a free-space object that does not fit";
        } else {
            if (object > left - object_header_size) return "an object larger than its collection";
            need = object_header_size + (object + 7) / 8 * 8;
            if (need > left) return "an object larger than its collection";
            visit(index, object);
        }
        at += static_cast<std::size_t>(need);
    }
    return "";
}

std::string check_collection(const unsigned char* p, std::size_t size, uint64_t file_left) {
    const uint64_t declared = load_le(p + 8, 8);
    if (declared < heap_header_size) return "a global heap collection with an invalid size";
    // A first read may be shorter than the collection: HDF5 then reads it whole, and that read
    // is checked. It allocates the declared size first: one larger than the file is refused now.
    if (declared > file_left) return "a global heap collection larger than the file";
    if (declared > size) return "";
    return walk_collection(p, static_cast<std::size_t>(declared), [](uint64_t, uint64_t) {});
}

struct DriverInfo {
    const std::byte* image;
    std::size_t size;
    int fd;  ///< the file the reader opened (when not an image): the only one this driver opens
};

struct CheckedFile {
    H5FD_t base;  // first: HDF5 sees this struct as its H5FD_t
    RawSource source;
    bool owns_fd;
    dev_t device;
    ino_t inode;
    haddr_t eoa;
    // The continuation chunks of the headers parsed so far, where HDF5 reads them after their
    // header: bytes there are messages, checked with their header, not a header's prefix.
    std::unordered_set<uint64_t> continuation_chunks;
};

constexpr haddr_t max_address = (haddr_t{1} << 62) - 1;

H5FD_t* driver_open(const char* name, unsigned flags, hid_t access, haddr_t max) {
    if ((flags & H5F_ACC_RDWR) || (flags & H5F_ACC_CREAT) || max == 0 || max > max_address)
        return nullptr;
    const auto* info = static_cast<const DriverInfo*>(H5Pget_driver_info(access));
    // The driver opens the file it was set up for and nothing else: an external link or a
    // virtual dataset's source file (which HDF5 opens with the same access list) would read
    // another file, or block forever on a named pipe. Links to other files are not part of the
    // format (formats/kvcache.md 2).
    auto refuse = [&] {
        last_problem() = "a link to another file (" + kv::quoted(name ? name : "") +
                         "), which the format does not allow";
        return nullptr;
    };
    if (info && info->image && (!name || std::strcmp(name, image_file_name) != 0)) return refuse();
    struct stat status {};
    if (info && !info->image && info->fd >= 0) {
        struct stat expected {};
        if (!name || ::stat(name, &status) != 0 || ::fstat(info->fd, &expected) != 0 ||
            !S_ISREG(status.st_mode) || status.st_dev != expected.st_dev ||
            status.st_ino != expected.st_ino)
            return refuse();
    }
    auto* file = new (std::nothrow) CheckedFile{};
    if (!file) return nullptr;
    if (info && info->image) {
        file->source.image = info->image;
        file->source.size = info->size;
        file->owns_fd = false;
    } else {
        const int fd = ::open(name, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        if (fd < 0 || ::fstat(fd, &status) != 0 || !S_ISREG(status.st_mode)) {
            if (fd >= 0) ::close(fd);
            delete file;
            return nullptr;
        }
        file->source.fd = fd;
        file->source.size = static_cast<std::size_t>(status.st_size);
        file->owns_fd = true;
        file->device = status.st_dev;
        file->inode = status.st_ino;
    }
    return &file->base;
}

herr_t driver_close(H5FD_t* base) {
    auto* file = reinterpret_cast<CheckedFile*>(base);
    if (file->owns_fd) ::close(file->source.fd);
    delete file;
    return 0;
}

int driver_compare(const H5FD_t* a, const H5FD_t* b) {
    const auto* x = reinterpret_cast<const CheckedFile*>(a);
    const auto* y = reinterpret_cast<const CheckedFile*>(b);
    auto key = [](const CheckedFile* f) {
        return f->owns_fd ? std::make_tuple(uint64_t{0}, uint64_t(f->device), uint64_t(f->inode))
                          : std::make_tuple(uint64_t{1}, uint64_t(0),
                                            reinterpret_cast<uintptr_t>(f->source.image));
    };
    return key(x) < key(y) ? -1 : key(y) < key(x) ? 1 : 0;
}

// No metadata accumulator: HDF5 1.10's (H5F__accum_read) computes its copies from addresses it
// has not checked, and an address of a corrupt header (HADDR_UNDEF, say, in an attribute info
// message) made it copy from outside its buffer. Without it every read comes here, where the
// address is checked.
herr_t driver_query(const H5FD_t*, unsigned long* flags) {
    if (flags) *flags = H5FD_FEAT_DATA_SIEVE;
    return 0;
}

haddr_t driver_get_eoa(const H5FD_t* base, H5FD_mem_t) {
    return reinterpret_cast<const CheckedFile*>(base)->eoa;
}

herr_t driver_set_eoa(H5FD_t* base, H5FD_mem_t, haddr_t address) {
    reinterpret_cast<CheckedFile*>(base)->eoa = address;
    return 0;
}

haddr_t driver_get_eof(const H5FD_t* base, H5FD_mem_t) {
    return reinterpret_cast<const CheckedFile*>(base)->source.size;
}

// One message of an object header: its type, flags and bytes.
struct Message {
    uint64_t type;
    unsigned flags;
    std::vector<unsigned char> data;
};

// The messages of the object header at `address` (addresses inside it count from `base`, the
// superblock's place), version 1 (HDF5's earliest format, h5py's
// default; no signature) or 2 ("OHDR"), following continuation messages. False when the bytes do
// not parse as a whole header: then nothing is judged here (bytes that only look like a header
// prefix, as a continuation chunk starting with a dataspace message does, or a header HDF5 itself
// will find corrupt).
// Where the bytes cannot be a look-alike, what fails to parse is `damage`: a chunk that reaches
// past the end of the file, in a version-2 header ("OHDR" and its checksum make it one) or longer
// than 16 MiB (HDF5 allocates the size it reads before reading: a 15 KB file asked for 21 GB);
// in a version-2 header or a chunk a continuation led to, a continuation that cannot be followed.
bool read_object_header(const RawSource& source, uint64_t base, uint64_t address,
                        const unsigned char* prefix, std::size_t prefix_size,
                        std::vector<Message>& messages, std::string& damage,
                        std::vector<uint64_t>& continuations) {
    damage.clear();
    const bool v2 = prefix_size >= 7 && std::memcmp(prefix, "OHDR", 4) == 0 && prefix[4] == 2;
    std::vector<std::pair<uint64_t, uint64_t>> chunks;  // [start, length) of message bytes
    uint64_t expected = 0;
    bool creation_order = false;
    if (v2) {
        const unsigned flags = prefix[5];
        creation_order = (flags & 0x04) != 0;
        const uint64_t size_at = 6 + ((flags & 0x20) ? 16 : 0) + ((flags & 0x10) ? 4 : 0);
        const int size_bytes = 1 << (flags & 3);
        unsigned char size[8] = {};
        if (!source.read(address + size_at, static_cast<std::size_t>(size_bytes), size))
            return false;
        chunks.emplace_back(address + size_at + static_cast<uint64_t>(size_bytes),
                            load_le(size, size_bytes));
    } else {
        expected = load_le(prefix + 2, 2);
        chunks.emplace_back(address + 16, load_le(prefix + 8, 4));
    }
    const std::size_t header = v2 ? (creation_order ? 6 : 4) : 8;
    // The chunks' starts, for the loop check: a hostile header's 4,096 chunks compared each with
    // all before it were 8 million comparisons.
    std::unordered_set<uint64_t> starts = {chunks.front().first};
    for (std::size_t next = 0; next < chunks.size(); ++next) {
        const auto [start, length] = chunks[next];
        if (start > source.size || length > source.size - start) {
            if (v2 || length > (1u << 24)) damage = "larger than the file";
            return false;
        }
        std::vector<unsigned char> chunk(static_cast<std::size_t>(length));
        if (!source.read(start, chunk.size(), chunk.data())) return false;
        std::size_t at = 0;
        while (at + header <= chunk.size()) {
            const uint64_t type = v2 ? chunk[at] : load_le(&chunk[at], 2);
            const uint64_t size = v2 ? load_le(&chunk[at + 1], 2) : load_le(&chunk[at + 2], 2);
            const unsigned flags = v2 ? chunk[at + 3] : chunk[at + 4];
            const std::size_t data = at + header;
            // HDF5 refuses such a header itself, but not before decoding the messages before
            // it (found by fuzzing: an attribute among them read past its values).
            if (size > chunk.size() - data) {
                damage = "a message larger than its chunk";
                return false;
            }
            messages.push_back(
                {type, flags,
                 std::vector<unsigned char>(chunk.begin() + data, chunk.begin() + data + size)});
            // HDF5 decodes a continuation's 16 bytes whatever the message's size, and allocates
            // the chunk they describe before reading it (found by fuzzing: a 0-byte continuation
            // whose next message's bytes made 4 GiB). Damage in a version-2 header or in a chunk
            // a continuation led to, where look-alike bytes cannot be the cause.
            if (type == 0x10 && size < 16 && (v2 || next > 0)) {
                damage = "a continuation message too short";
                return false;
            }
            if (type == 0x10 && size >= 16) {  // continuation: address, length
                const uint64_t bytes = load_le(&chunk[data + 8], 8);
                const uint64_t where = load_le(&chunk[data], 8);
                // Where look-alike bytes cannot be the cause, a continuation that cannot be
                // followed is damage: a header checked in part is not checked.
                const bool sure = v2 || next > 0;
                if (where > UINT64_MAX - 8 - base) {
                    if (sure) damage = "a continuation past the largest address";
                    return false;
                }
                // A chunk listed again loops (HDF5 read such a header without the messages
                // after the loop). A version-2 header of kvtools' has a few chunks; a version-1
                // header may have as many as messages, which it counts (checked below).
                const uint64_t chunk_start = v2 ? base + where + 4 : base + where;
                const bool listed = starts.count(chunk_start) > 0;
                if (listed || chunks.size() == 4096) {
                    if (sure && (listed || v2))
                        damage = listed ? "a continuation to a chunk already listed"
                                        : "more than 4096 chunks";
                    return false;
                }
                if (v2 && bytes < 8) {  // "OCHK", messages, checksum
                    damage = "a continuation chunk too short for its signature and checksum";
                    return false;
                }
                continuations.push_back(base + where);
                chunks.emplace_back(chunk_start, v2 ? bytes - 8 : bytes);
                starts.insert(chunk_start);
            }
            at = data + static_cast<std::size_t>(size);
        }
        // Version 1 messages tile a real chunk exactly; version 2 leaves a gap too small for a
        // message header, where the loop above stops.
        if (!v2 && at != chunk.size()) return false;
    }
    // HDF5 1.10 decodes a version-1 header whose message count is not its messages' (it
    // enforces the count only when built with strict format checks): found by fuzzing, a root
    // group of 35 messages counted as 12 (most of them empty), whose attributes went unchecked
    // and one was read past its values.
    if (!v2 && messages.size() != expected) {
        damage = "a version-1 header of " + std::to_string(messages.size()) +
                 " messages that counts " + std::to_string(expected);
        return false;
    }
    return true;
}

std::string check_heap_id_bytes(const RawSource& source, const unsigned char* ids,
                                std::size_t count, std::size_t stride);

// An encoded datatype (a datatype message, or the one inside an attribute message).
bool is_vlen_string(const unsigned char* type, std::size_t size) {
    return size >= 8 && (type[0] & 0x0f) == 9 && (type[1] & 0x0f) == 1;
}
uint64_t datatype_size(const unsigned char* type) {
    return load_le(type + 4, 4);
}
// What HDF5 1.10 would trust in a datatype, or "": a variable-length type whose elements have an
// absurd size (it allocates and converts length x size bytes per value: found by fuzzing, a
// string of 4-gigabyte characters that never finished), or whose own size is not what its
// values take in the file, a length (4), a heap address (8) and an index (4): HDF5 sizes the
// stored values by the one and copies them by the other (found by fuzzing: a string attribute
// typed 14 bytes, read 16 past its message).
std::string datatype_problem(const unsigned char* type, std::size_t size) {
    if (size == 0) return "";  // HDF5 refuses an empty datatype message itself
    // HDF5 decodes a datatype's 8-byte header (class, bits, size) whatever the message's size.
    if (size < 8) return "a datatype that does not fit its message";
    const unsigned type_class = type[0] & 0x0f;
    // The format's values are numbers and strings. HDF5 decodes the member names of compound
    // and enumeration types, and an opaque type's tag, with strdup, unbounded.
    if (type_class == 5 || type_class == 6 || type_class == 8 || type_class == 10)
        return std::string(type_class == 5   ? "an opaque"
                           : type_class == 6 ? "a compound"
                           : type_class == 8 ? "an enumeration"
                                             : "an array") +
               " type, which the format does not use";
    if ((type_class == 0 || type_class == 1) && size >= 12) {
        // A number's bits (offset, precision; a float's exponent and mantissa within them) inside
        // its bytes: HDF5 converts them by bit position (found by fuzzing: an integer attribute
        // whose bits lay past its bytes, SEGV in H5T__bit_find).
        const uint64_t bits = 8 * datatype_size(type);
        const uint64_t offset = load_le(type + 8, 2), precision = load_le(type + 10, 2);
        if (precision == 0 || offset + precision > bits)
            return "a number of " + std::to_string(bits / 8) + " bytes whose " +
                   std::to_string(precision) + " bits start at bit " + std::to_string(offset);
        if (type_class == 1 && size >= 16 &&
            (type[12] + uint64_t{type[13]} > precision ||
             type[14] + uint64_t{type[15]} > precision || type[13] == 0 || type[15] == 0))
            return "a floating-point number whose exponent or mantissa lies outside its bits";
    }
    if (size < 16 || type_class != 9) return "";
    if (datatype_size(type) != 16)
        return "a variable-length type of " + std::to_string(datatype_size(type)) +
               " bytes (HDF5 stores 16)";
    const uint64_t element = datatype_size(type + 8);
    const bool string = (type[1] & 0x0f) == 1;
    if (string ? element != 1 : element == 0 || element > 1024)
        return "a variable-length type of " + std::to_string(element) + "-byte elements";
    return "";
}
// The number of elements of an encoded dataspace (scalar: 1, null: 0), or -1 when it does not
// parse. Version 1 has 5 reserved bytes before the dimensions, version 2 none.
int64_t dataspace_elements(const unsigned char* space, std::size_t size) {
    if (size < 4) return -1;
    const unsigned rank = space[1];
    if (space[0] == 2 && space[3] == 2) return 0;
    const std::size_t first = space[0] == 1 ? 8 : 4;
    const bool has_max = (space[2] & 1) != 0;  // maximum dimensions follow the dimensions
    if (size < first + (has_max ? 16 : 8) * std::size_t{rank}) return -1;
    uint64_t count = 1;
    for (unsigned i = 0; i < rank; ++i) {
        const uint64_t dim = load_le(space + first + 8 * i, 8);
        if (dim != 0 && count > (uint64_t{1} << 62) / dim) return -1;
        count *= dim;
    }
    return static_cast<int64_t>(count);
}

// A fill value message: new (0x05; version 1 and 2: allocation time, write time, "defined", then
// the value's size (4) and the value, in version 2 only where defined; version 3: flags, then
// size and value where flag 0x20 says so) or old (0x04: size, value). HDF5 1.10 copies as many
// bytes as the size says without checking them against the message (found by fuzzing: 4,616
// bytes out of a 2-byte message).
std::string fill_value_problem(uint64_t type, const unsigned char* d, std::size_t size) {
    std::size_t at = 0;
    if (type == 0x05) {
        if (size < 1) return "a fill value message too short";
        const unsigned version = d[0];
        if (version == 3) {
            if (size < 2) return "a fill value message too short";
            if ((d[1] & 0x20) == 0) return "";
            at = 2;
        } else {
            if (size < 4) return "a fill value message too short";
            if (version == 2 && d[3] == 0) return "";
            at = 4;
        }
    }
    if (size < at + 4) return "a fill value message too short";
    if (load_le(d + at, 4) > size - at - 4) return "a fill value longer than its message";
    return "";
}

// A link message (in an object header, or a group's fractal heap): version 1, flags, [type],
// [creation order (8)], [character set], the name's length (1, 2, 4 or 8 bytes), the name, then
// the target. HDF5 1.10 decodes it without checking it against its size. Links to other files
// (external, or user-defined types) are not part of the format.
std::string link_message_problem(const unsigned char* d, std::size_t size) {
    if (size < 2) return "a link message too short";
    const unsigned flags = d[1];
    std::size_t at = 2;
    unsigned type = 0;
    if (flags & 0x08) {
        if (size < at + 1) return "a link message too short";
        type = d[at++];
    }
    if (flags & 0x04) at += 8;
    if (flags & 0x10) at += 1;
    const std::size_t length_bytes = std::size_t{1} << (flags & 3);
    if (size < at + length_bytes) return "a link message too short";
    const uint64_t name = load_le(d + at, static_cast<int>(length_bytes));
    at += length_bytes;
    if (name == 0 || name > size - at) return "a link whose name does not fit its message";
    at += static_cast<std::size_t>(name);
    if (type >= 64) return "a link to another file, which the format does not allow";
    if (type == 0) return size - at >= 8 ? "" : "a link whose target does not fit its message";
    if (size - at < 2 || load_le(d + at, 2) > size - at - 2)
        return "a link whose target does not fit its message";
    return "";
}

// A filter pipeline message: version 1 has 6 reserved bytes after the version and the count,
// then per filter its id (2), name length (2, a multiple of 8), flags (2), parameter count (2),
// name and parameters (4 each, padded to 8); version 2 gives a name length only for ids from 256
// and pads nothing. HDF5 1.10 sizes each name with strlen: a name without its zero is read past.
std::string pipeline_message_problem(const unsigned char* d, std::size_t size) {
    if (size < 2 || (d[0] != 1 && d[0] != 2)) return "";  // HDF5 refuses other versions
    const bool v1 = d[0] == 1;
    std::size_t at = v1 ? 8 : 2;
    const char* const too_short = "a filter pipeline message shorter than its filters";
    for (unsigned filter = 0; filter < d[1]; ++filter) {
        if (size < at + 2) return too_short;
        const uint64_t id = load_le(d + at, 2);
        at += 2;
        uint64_t name = 0;
        if (v1 || id >= 256) {
            if (size < at + 2) return too_short;
            name = load_le(d + at, 2);
            at += 2;
        }
        if (size < at + 4) return too_short;
        const uint64_t values = load_le(d + at + 2, 2);
        at += 4;
        if (name > size - at) return too_short;
        if (name > 0 && std::memchr(d + at, 0, name) == nullptr)
            return "a filter whose name has no end";
        at += name;
        const uint64_t value_bytes = 4 * values + (v1 && values % 2 ? 4 : 0);
        if (value_bytes > size - at) return too_short;
        at += value_bytes;
    }
    return "";
}

// An attribute message (in an object header, or an object's fractal heap): its name, datatype,
// dataspace and data must fit it (a dataspace claiming 56 KB in a 72-byte message overflowed
// the heap), its datatype be sane, its strings' heap ids name objects of their collections.
std::string attribute_message_problem(const RawSource& source, uint64_t base,
                                      const unsigned char* d, std::size_t size) {
    auto pad8 = [](uint64_t n) { return (n + 7) / 8 * 8; };
    if (size < 8) return "an attribute message too short";
    const unsigned version = d[0];
    const uint64_t name = load_le(d + 2, 2);
    const uint64_t type = load_le(d + 4, 2);
    const uint64_t space = load_le(d + 6, 2);
    const uint64_t header = version == 3 ? 9 : 8;
    auto padded = [&](uint64_t n) { return version == 1 ? pad8(n) : n; };
    const uint64_t needed = version >= 1 && version <= 3
                                ? header + padded(name) + padded(type) + padded(space)
                                : UINT64_MAX;
    if (needed > size) return "an attribute message larger than its space";
    // The name's bytes end with its terminating zero: HDF5 copies it with strdup (found by
    // fuzzing: a name without one, read past its message).
    if (name == 0 || std::memchr(d + header, 0, name) == nullptr)
        return "an attribute whose name has no end";
    const unsigned char* type_at = d + header + padded(name);
    const unsigned char* space_at = type_at + padded(type);
    if (version >= 2 && (d[1] & 0x03) != 0) return "";  // shared datatype or dataspace
    const std::string type_problem = datatype_problem(type_at, type);
    if (!type_problem.empty()) return "an attribute of " + type_problem;
    // HDF5 decodes the datatype's 8-byte header and the dataspace's dimensions whatever sizes
    // the message gives them, then copies as many bytes of values as they make (found by
    // fuzzing: a 4-byte dataspace of rank 1, its dimension read from the bytes after it).
    if (type < 8) return "an attribute whose datatype does not fit its message";
    const int64_t elements = dataspace_elements(space_at, space);
    if (elements < 0) return "an attribute whose dataspace does not fit its message";
    const uint64_t element = datatype_size(type_at);
    const uint64_t data = size - needed;
    if (element != 0 && static_cast<uint64_t>(elements) > data / element)
        return "an attribute whose values do not fit its message";
    // Strings in the global heap (the reader's vlen guard checks them too, where it knows the
    // file).
    if (base == 0 && is_vlen_string(type_at, type) && element == 16) {
        const std::string problem =
            check_heap_id_bytes(source, d + needed, static_cast<std::size_t>(elements), 16);
        if (!problem.empty()) return "an attribute string: " + problem;
    }
    return "";
}

// Dense storage of an object's links or attributes: a fractal heap of messages and a v2 B-tree
// of their heap ids by name. HDF5 1.10 decodes the messages it finds there as unchecked as those
// of a header (found by fuzzing: an attribute read past its heap object), so each is checked as
// a header's would be: the B-tree's root leaf and the heap's root direct block (what groups and
// objects of kvtools' size have), others are left to HDF5.
// A version-2 B-tree at `address` whose header ("BTHD", version, type) names another kind of
// index than the one its referrer expects (`expected`: attribute or link names or creation
// order, dataset chunks). HDF5 1.10 checks only that the type is one it knows, then opens the
// tree with its referrer's context taken for the type's (found by fuzzing: an attribute name
// index typed as a chunk index, SEGV in H5F_sizeof_addr from H5B2__hdr_init). "" when it is of
// an expected type, or not a B-tree header at all (HDF5 rejects those itself).
std::string btree_type_problem(const RawSource& source, uint64_t base, uint64_t address,
                               std::initializer_list<unsigned> expected, const char* what) {
    unsigned char header[6];
    if (address == UINT64_MAX || address > UINT64_MAX - base ||
        !source.read(base + address, sizeof header, header) || std::memcmp(header, "BTHD", 4) != 0)
        return "";
    for (unsigned type : expected)
        if (header[5] == type) return "";
    return "a B-tree of type " + std::to_string(header[5]) + " where an index of " + what +
           " belongs";
}

std::string dense_storage_problem(const RawSource& source, uint64_t base, uint64_t heap,
                                  uint64_t btree, bool attributes) {
    if (heap == UINT64_MAX || btree == UINT64_MAX || heap > UINT64_MAX - base ||
        btree > UINT64_MAX - base)
        return "";
    unsigned char h[146], b[38];
    if (!source.read(base + heap, sizeof h, h) || std::memcmp(h, "FRHP", 4) != 0 ||
        !source.read(base + btree, sizeof b, b) || std::memcmp(b, "BTHD", 4) != 0)
        return "";
    // The heap's B-tree of huge objects (after the largest managed object's size and the next
    // huge object's id) is one of the four kinds a heap keeps.
    if (std::string problem = btree_type_problem(source, base, load_le(h + 22, 8), {1u, 2u, 3u, 4u},
                                                 "huge heap objects");
        !problem.empty())
        return problem;
    // The index records hold heap ids of a fixed size (H5O_FHEAP_ID_LEN, H5G_DENSE_FHEAP_ID_LEN),
    // whatever length the heap header declares: HDF5 decodes them by the heap's offset and length
    // sizes only (found by fuzzing: a declared length of 58,888 bytes hid the heap from this
    // check, and an attribute in it was read past its object).
    const uint64_t id_length = attributes ? 8 : 7;
    const uint64_t filters = load_le(h + 7, 2);
    const unsigned flags = h[9];
    const uint64_t max_object = load_le(h + 10, 4);
    const uint64_t block = load_le(h + 112, 8);
    const uint64_t max_direct = load_le(h + 120, 8);
    const uint64_t heap_bits = load_le(h + 128, 2);
    const uint64_t root = load_le(h + 132, 8);
    const uint64_t rows = load_le(h + 140, 2);
    // HDF5 builds the heap's doubling table from these before reading anything else
    // (H5HF_dtable_init, H5HF_hdr_finish_init_phase2) and trusts them: a width or block size
    // that is not a power of two, a largest direct block below the first, or a heap size in bits
    // too small for the first row (its row count is an unsigned difference) read past its tables
    // (found by fuzzing with the checksums repaired: SEGV in H5HF_hdr_finish_init_phase2).
    const uint64_t width = load_le(h + 110, 2);
    auto power_of_two = [](uint64_t v) { return v != 0 && (v & (v - 1)) == 0; };
    auto log2_floor = [](uint64_t v) {
        uint64_t bits = 0;
        while (v >>= 1)
            ++bits;
        return bits;
    };
    if (!power_of_two(width) || !power_of_two(block) || !power_of_two(max_direct) ||
        max_direct < block || heap_bits > 64 || heap_bits < log2_floor(block) + log2_floor(width) ||
        log2_floor(max_direct) > heap_bits)
        return "a fractal heap whose doubling table is impossible (width " + std::to_string(width) +
               ", first block " + std::to_string(block) + ", largest direct block " +
               std::to_string(max_direct) + ", heap size " + std::to_string(heap_bits) + " bits)";
    if (filters != 0 || rows != 0 || root == UINT64_MAX || root > UINT64_MAX - base || block == 0 ||
        block > (1u << 24))
        return "";
    auto bytes_for = [](uint64_t value) {  // H5VM_limit_enc_size: floor(log2) / 8 + 1
        int bits = 0;
        while (value >>= 1)
            ++bits;
        return static_cast<uint64_t>(bits / 8 + 1);
    };
    uint64_t direct_bits = 0;
    for (uint64_t v = max_direct; v > 1; v >>= 1)
        ++direct_bits;
    const uint64_t offset_bytes = (heap_bits + 7) / 8;
    const uint64_t length_bytes = std::min((direct_bits + 7) / 8, bytes_for(max_object));
    if (offset_bytes == 0 || offset_bytes > 8 || length_bytes == 0 || length_bytes > 8 ||
        id_length < 1 + offset_bytes + length_bytes)
        return "";
    std::vector<unsigned char> direct(static_cast<std::size_t>(block));
    if (!source.read(base + root, direct.size(), direct.data()) ||
        std::memcmp(direct.data(), "FHDB", 4) != 0)
        return "";
    const uint64_t block_header = 4 + 1 + 8 + offset_bytes + ((flags & 2) ? 4 : 0);
    // The B-tree: its root leaf's records hold the heap ids (attributes: id, flags, creation
    // order, hash; links: hash, id).
    const uint64_t record = load_le(b + 10, 2), depth = load_le(b + 12, 2);
    const uint64_t leaf = load_le(b + 16, 8), records = load_le(b + 24, 2);
    if (depth != 0 || leaf == UINT64_MAX || leaf > UINT64_MAX - base || records == 0) return "";
    const uint64_t id_at = attributes ? 0 : 4;
    if (record < id_at + id_length || records > (1u << 16)) return "";
    std::vector<unsigned char> node(static_cast<std::size_t>(6 + records * record));
    if (!source.read(base + leaf, node.size(), node.data()) ||
        std::memcmp(node.data(), "BTLF", 4) != 0)
        return "";
    for (uint64_t i = 0; i < records; ++i) {
        const unsigned char* id = node.data() + 6 + i * record + id_at;
        if ((id[0] & 0xf0) != 0) continue;  // not a managed object: tiny or huge, left to HDF5
        const uint64_t offset = load_le(id + 1, static_cast<int>(offset_bytes));
        const uint64_t length = load_le(id + 1 + offset_bytes, static_cast<int>(length_bytes));
        if (offset < block_header || offset > block || length > block - offset || length == 0)
            return "a heap id outside its heap";
        const unsigned char* object = direct.data() + offset;
        const std::string problem = attributes
                                        ? attribute_message_problem(source, base, object, length)
                                        : link_message_problem(object, length);
        if (!problem.empty()) return problem;
    }
    return "";
}

// The problem HDF5 1.10 would trust in an object header's messages, or "". Found by fuzzing, on
// files whose checksums were recomputed after the change (an attacker's, not a disk's):
//  - an attribute message whose name, datatype and dataspace do not fit it (a dataspace claiming
//    56 KB in a 72-byte message overflowed the heap);
//  - a chunked dataset indexed by a fixed array that holds fewer entries than the dataset has
//    chunks (H5FA_get reads past its elements);
//  - a compact dataset whose stored bytes are fewer than its shape needs (H5VM_memcpyvv).
// And what the format leaves out (formats/kvcache.md 2): external storage, which HDF5 reads
// from other files with plain open(), virtual datasets, and links to other files.
std::string object_header_problem(const RawSource& source, uint64_t base,
                                  const std::vector<Message>& messages) {
    const Message* dataspace = nullptr;
    const Message* datatype = nullptr;
    const Message* layout = nullptr;
    for (const Message& message : messages) {
        const std::vector<unsigned char>& d = message.data;
        const bool shared = (message.flags & 0x02) != 0;
        switch (message.type) {
            case 0x01:
                if (!shared) dataspace = &message;
                break;
            case 0x03:
                if (!shared) {
                    datatype = &message;
                    const std::string problem = datatype_problem(d.data(), d.size());
                    if (!problem.empty()) return "a dataset of " + problem;
                }
                break;
            case 0x08:
                layout = &message;
                break;
            case 0x07:
                return "a dataset stored in external files, which the format does not allow";
            case 0x04:
            case 0x05:
                if (!shared) {
                    const std::string problem =
                        fill_value_problem(message.type, d.data(), d.size());
                    if (!problem.empty()) return problem;
                }
                break;
            case 0x0B: {
                const std::string problem = pipeline_message_problem(d.data(), d.size());
                if (!problem.empty()) return problem;
                break;
            }
            case 0x0D:  // an object comment, which HDF5 copies with strdup
                if (d.empty() || std::memchr(d.data(), 0, d.size()) == nullptr)
                    return "an object comment that has no end";
                break;
            case 0x06: {
                const std::string problem = link_message_problem(d.data(), d.size());
                if (!problem.empty()) return problem;
                break;
            }
            case 0x0C: {
                const std::string problem =
                    attribute_message_problem(source, base, d.data(), d.size());
                if (!problem.empty()) return problem;
                break;
            }
            case 0x02:    // link info: version, flags, [max creation order (8)], heap, name index
            case 0x15: {  // attribute info: the same, with a 2-byte max creation order
                const std::size_t order =
                    (d.size() >= 2 && (d[1] & 1)) ? (message.type == 0x02 ? 8 : 2) : 0;
                if (d.size() < 2 + order + 16) break;
                const bool attributes = message.type == 0x15;
                std::string problem = btree_type_problem(
                    source, base, load_le(&d[2 + order + 8], 8), {attributes ? 8u : 5u},
                    attributes ? "attribute names" : "link names");
                if (problem.empty() && (d[1] & 2) && d.size() >= 2 + order + 24)
                    problem = btree_type_problem(
                        source, base, load_le(&d[2 + order + 16], 8), {attributes ? 9u : 6u},
                        attributes ? "attribute creation order" : "link creation order");
                if (problem.empty())
                    problem = dense_storage_problem(source, base, load_le(&d[2 + order], 8),
                                                    load_le(&d[2 + order + 8], 8), attributes);
                if (!problem.empty()) return problem;
                break;
            }
        }
    }
    if (!layout || layout->data.size() < 2) return "";
    const std::vector<unsigned char>& l = layout->data;
    const unsigned version = l[0], layout_class = l[1];
    // Versions 1 and 2 (HDF5 before 1.6.3) size a compact dataset's bytes differently; HDF5
    // 1.10.8 read a 17-value one with no bytes from a null pointer (found by fuzzing). Every
    // writer since, h5py's earliest format included, writes version 3 or 4.
    if (version < 3)
        return "a dataset layout of version " + std::to_string(version) + ", older than the format";
    if (layout_class == 3) return "a virtual dataset, which the format does not allow";
    // The dataset's extent (maximum dimensions where given) from its dataspace message:
    // version 1 has 5 reserved bytes, version 2 none; dimensions are 8 bytes each.
    std::vector<uint64_t> dims;
    if (dataspace && dataspace->data.size() >= 4) {
        const std::vector<unsigned char>& d = dataspace->data;
        const unsigned rank = d[1], flags = d[2];
        const std::size_t first = d[0] == 1 ? 8 : 4;
        const bool has_max = (flags & 1) != 0;
        if (d[0] == 2 && d[3] == 2) {
            dims.push_back(0);  // a null dataspace: no element
        } else if (d.size() >= first + (has_max ? 16 : 8) * rank) {
            for (unsigned i = 0; i < rank; ++i) {
                // A chunk index is as large as the maximum dimensions make it, and HDF5 1.10
                // indexes it by the chunks of the current ones (found by fuzzing: a fixed array
                // read far past its elements in H5FA_get). Unlimited is all ones.
                const uint64_t current = load_le(&d[first + i * 8], 8);
                if (has_max && load_le(&d[first + (rank + i) * 8], 8) < current)
                    return "a dataspace whose maximum dimensions are smaller than its dimensions";
                dims.push_back(load_le(&d[first + (has_max ? rank + i : i) * 8], 8));
            }
        }
    }
    if (!dataspace) return "";
    // HDF5 reads the dimensions a dataspace's rank says, whether or not its message holds them.
    if (dataspace->data.size() < 4 || (dims.empty() && dataspace->data[1] > 0))
        return "a dataspace whose dimensions do not fit its message";
    // The bytes the dataset's current extent needs (saturating; the dimensions, not `dims`' maximum
    // ones, are what a reader copies), which contiguous and compact storage must hold.
    const int64_t elements = dataspace_elements(dataspace->data.data(), dataspace->data.size());
    const uint64_t element =
        datatype && datatype->data.size() >= 8 ? datatype_size(datatype->data.data()) : 0;
    const uint64_t needed = elements < 0 ? UINT64_MAX
                            : element != 0 && static_cast<uint64_t>(elements) > UINT64_MAX / element
                                ? UINT64_MAX
                                : static_cast<uint64_t>(elements) * element;
    // Contiguous: address (8), size (8).
    if (layout_class == 1 && l.size() >= 18 && load_le(&l[2], 8) != UINT64_MAX &&
        load_le(&l[10], 8) < needed)
        return "a contiguous dataset with fewer bytes than its shape needs";
    if (layout_class == 0 && l.size() >= 4 && datatype && datatype->data.size() >= 8) {
        // Compact: size (2 bytes), then the data. Variable-length types (class 9) store heap ids.
        const unsigned type_class = datatype->data[0] & 0x0f;
        const uint64_t stored = load_le(&l[2], 2);
        if (type_class != 9 && (stored < needed || l.size() < 4 + stored))
            return "a compact dataset with fewer bytes than its shape needs";
        if (base == 0 && is_vlen_string(datatype->data.data(), datatype->data.size()) &&
            datatype_size(datatype->data.data()) == 16) {
            if (elements < 0 || l.size() < 4 + stored ||
                static_cast<uint64_t>(elements) > stored / 16)
                return "a compact dataset with fewer bytes than its shape needs";
            const std::string problem =
                check_heap_id_bytes(source, &l[4], static_cast<std::size_t>(elements), 16);
            if (!problem.empty()) return "a compact dataset of strings: " + problem;
        }
    }
    // Chunked, version 3: rank + 1, the chunk index's address (8), the chunk's dimensions (4 bytes
    // each, the last the element size). HDF5 1.10 divides by each (found by fuzzing: a dimension
    // of 0, SIGFPE in H5D__chunk_set_info); version 4 is checked below.
    if (layout_class == 2 && version == 3 && l.size() >= 3) {
        const unsigned rank = l[2];
        if (rank < 2) return "a chunked layout of " + std::to_string(rank) + " dimensions";
        if (l.size() < 3 + 8 + 4 * std::size_t{rank})
            return "a chunked layout that does not fit its message";
        for (unsigned i = 0; i < rank; ++i)
            if (load_le(&l[11 + 4 * i], 4) == 0) return "a chunk dimension of 0";
    }
    if (layout_class == 2 && version == 4 && l.size() >= 5) {
        // Chunked, version 4: flags, rank + 1, bytes per dimension, the chunk's dimensions (the
        // last is the element size), the index type, its parameters, its address.
        const unsigned rank = l[3], bytes = l[4];
        // At least one dimension and the element size: HDF5 1.10 takes fewer and divides by
        // the dimension before the element size (found by fuzzing: SIGFPE in
        // H5D__chunk_set_info).
        if (rank < 2) return "a chunked layout of " + std::to_string(rank) + " dimensions";
        // HDF5 1.10 decodes the dimensions, the index's parameters and its address whatever the
        // message's size (found by fuzzing: a fixed array's address read from the bytes after
        // the message, whose array held fewer chunks than the dataset, read past in H5FA_get).
        if (bytes < 1 || bytes > 8)
            return "a chunked layout of " + std::to_string(bytes) + "-byte dimensions";
        const std::size_t index_at = 5 + std::size_t{rank} * bytes;
        if (l.size() < index_at + 1) return "a chunked layout that does not fit its message";
        const unsigned index_type = l[index_at];
        // The index's parameters before its address: a single chunk's size and filter mask when
        // filtered (flag 2), a fixed array's page bits, an extensible array's five, a version-2
        // B-tree's node size and percentages; type 0 (version-1 B-trees) is version 3's.
        std::size_t parameters = 0;
        switch (index_type) {
            case 1:
                parameters = (l[2] & 0x02) ? 12 : 0;
                break;
            case 2:
                parameters = 0;
                break;
            case 3:
                parameters = 1;
                break;
            case 4:
                parameters = 5;
                break;
            case 5:
                parameters = 6;
                break;
            default:
                return "a chunk index of type " + std::to_string(index_type);
        }
        if (l.size() < index_at + 1 + parameters + 8)
            return "a chunked layout that does not fit its message";
        std::vector<uint64_t> chunk;
        for (unsigned i = 0; i < rank; ++i) {
            chunk.push_back(load_le(&l[5 + i * bytes], bytes));
            // HDF5 1.10 keeps chunk dimensions in 32 bits: 2^32 would be 0 to it.
            if (chunk.back() == 0 || chunk.back() > UINT32_MAX)
                return "a chunk dimension of " + std::to_string(chunk.back());
        }
        // Its element size is the datatype's (HDF5 1.10 sizes its copies by one, its buffers by
        // the other: a mismatch read past them).
        if (datatype && datatype->data.size() >= 8 &&
            chunk.back() != datatype_size(datatype->data.data()))
            return "a chunked dataset whose element size differs from its datatype's";
        // A version-2 B-tree: node size (4), split and merge percent, then its address.
        if (index_type == 5)
            return btree_type_problem(source, base, load_le(&l[index_at + 7], 8), {10u, 11u},
                                      "dataset chunks");
        if (index_type != 3) return "";  // not a fixed array
        if (dims.size() + 1 != chunk.size()) return "a chunked dataset whose chunk rank differs";
        uint64_t chunks = 1;  // no chunk dimension is 0: each was checked as it was read
        for (std::size_t i = 0; i < dims.size(); ++i) {
            const uint64_t count = dims[i] / chunk[i] + (dims[i] % chunk[i] != 0);
            chunks = count != 0 && chunks > UINT64_MAX / count ? UINT64_MAX : chunks * count;
        }
        const uint64_t array = load_le(&l[index_at + 2], 8);
        unsigned char header[16];
        if (array == UINT64_MAX || chunks == 0) return "";  // not written yet: fill values
        if (array > UINT64_MAX - base || !source.read(base + array, sizeof header, header) ||
            std::memcmp(header, "FAHD", 4) != 0)
            return "a chunk index outside the file";
        // HDF5 sizes the array by its own count (a huge one is allocated) and indexes it by the
        // dataset's chunks (a smaller one is read past): it makes them equal.
        if (load_le(header + 8, 8) != chunks)
            return "a chunk index whose size is not the dataset's number of chunks";
    }
    return "";
}

// The header of a version-2 B-tree (dense attribute and link storage): "BTHD", version, type,
// node size (4), record size (2), depth (2), split and merge percent, root address, records in
// the root (2), records in all (8). HDF5 1.10 sizes a node's records by these without checking
// them against the node (found by fuzzing: a record size of 32,785 read past a 512-byte leaf),
// and follows a shared attribute's record into a table the file does not have. Returns "" or
// the problem.
std::string btree_header_problem(const RawSource& source, uint64_t base,
                                 const unsigned char* header) {
    const unsigned type = header[5];
    const uint64_t node = load_le(header + 6, 4);
    const uint64_t record = load_le(header + 10, 2);
    const uint64_t depth = load_le(header + 12, 2);
    const uint64_t root = load_le(header + 16, 8);
    const uint64_t records = load_le(header + 24, 2);
    constexpr uint64_t prefix = 10;  // "BTLF" or "BTIN", version, type, checksum
    if (record == 0 || node <= prefix || node > (1u << 24) || record > node - prefix)
        return "a B-tree whose records do not fit its nodes";
    if (records * record > node - prefix) return "a B-tree root with more records than fit";
    if (depth != 0 || type != 8 || root == UINT64_MAX || records == 0) return "";
    // An attribute name index's root leaf: heap id (8), message flags (1), creation order (4),
    // name hash (4) per record.
    if (record != 17 || root > UINT64_MAX - base) return "";
    std::vector<unsigned char> leaf(static_cast<std::size_t>(6 + records * record));
    if (!source.read(base + root, leaf.size(), leaf.data()) ||
        std::memcmp(leaf.data(), "BTLF", 4) != 0)
        return "";
    for (uint64_t i = 0; i < records; ++i)
        if (leaf[6 + i * record + 8] & 0x02)
            return "a shared attribute, which this reader does not read";
    return "";
}

herr_t driver_read(H5FD_t* base_in, H5FD_mem_t type, hid_t, haddr_t address, size_t size,
                   void* buffer) {
    auto* file = reinterpret_cast<CheckedFile*>(base_in);
    if (address > max_address || size > max_address - address) {
        last_problem() = "corrupt metadata (an address outside the file)";
        return -1;
    }
    // As sec2 and core do: bytes past the end of the file read as zeros.
    const uint64_t end = file->source.size;
    const std::size_t available =
        address >= end ? 0 : static_cast<std::size_t>(std::min<uint64_t>(size, end - address));
    if (available > 0 && !file->source.read(address, available, buffer)) return -1;
    std::memset(static_cast<char*>(buffer) + available, 0, size - available);
    // HDF5 reads an object header's prefix before it knows the header's size, no further than
    // the end of the file or of allocation, and decodes the prefix from whatever that read gave
    // it: a header whose prefix is cut short there (an address moved to the file's last bytes,
    // checksums recomputed) had HDF5 checksum a length computed from garbage (found by fuzzing:
    // a 1-byte read, then SEGV in H5_checksum_lookup3). No header or continuation chunk is
    // shorter than 8 bytes; a version-2 prefix is 6 bytes, its optional times and attribute
    // limits, and its first chunk's size.
    if (type == H5FD_MEM_OHDR && size < 16) {
        const auto* bytes = static_cast<const unsigned char*>(buffer);
        const bool v2 = size >= 6 && std::memcmp(bytes, "OHDR", 4) == 0;
        const std::size_t prefix = v2 ? 6 + ((bytes[5] & 0x20) ? 16 : 0) +
                                            ((bytes[5] & 0x10) ? 4 : 0) +
                                            (std::size_t{1} << (bytes[5] & 3))
                                      : 8;
        if (size < prefix) {
            last_problem() = "corrupt object header (cut short by the end of the file)";
            return -1;
        }
    }
    // An object header: version 1 (version 1, a reserved zero, the message count, reference
    // count and first chunk size, four zero bytes of padding) or 2 ("OHDR", version 2).
    if (type == H5FD_MEM_OHDR && size >= 16) {
        const auto* bytes = static_cast<const unsigned char*>(buffer);
        const bool v1 = bytes[0] == 1 && bytes[1] == 0 && load_le(bytes + 12, 4) == 0;
        const bool v2 = std::memcmp(bytes, "OHDR", 4) == 0 && bytes[4] == 2;
        std::vector<Message> messages;
        const uint64_t base = base_in->base_addr;
        std::string damage;
        std::vector<uint64_t> continuations;
        // A version-1 continuation chunk has no signature: its first message can look like a
        // header's prefix (a dataspace message's does), and is not one.
        const bool continuation = v1 && file->continuation_chunks.count(address) != 0;
        const bool parsed = (v1 || v2) && !continuation &&
                            read_object_header(file->source, base, address, bytes, size, messages,
                                               damage, continuations);
        file->continuation_chunks.insert(continuations.begin(), continuations.end());
        if (!damage.empty()) {
            last_problem() = "corrupt object header (" + damage + ")";
            return -1;
        }
        if (parsed) {
            const std::string problem = object_header_problem(file->source, base, messages);
            if (!problem.empty()) {
                // What the format leaves out is refused as such; the rest is damage.
                last_problem() =
                    problem.find("which the format does not allow") != std::string::npos
                        ? problem
                        : "corrupt object header (" + problem + ")";
                return -1;
            }
        }
    }
    if (type == H5FD_MEM_BTREE && size >= 34) {
        const auto* bytes = static_cast<const unsigned char*>(buffer);
        if (std::memcmp(bytes, "BTHD", 4) == 0) {
            const std::string problem =
                btree_header_problem(file->source, base_in->base_addr, bytes);
            if (!problem.empty()) {
                last_problem() = "corrupt B-tree (" + problem + ")";
                return -1;
            }
        }
    }
    // HDF5 reads global heap collections as raw data (H5F_block_read maps the type).
    if (type == H5FD_MEM_DRAW || type == H5FD_MEM_GHEAP) {
        const auto* bytes = static_cast<const unsigned char*>(buffer);
        if (is_collection(bytes, size)) {
            const uint64_t left = address < file->source.size ? file->source.size - address : 0;
            const std::string problem = check_collection(bytes, size, left);
            if (!problem.empty()) {
                last_problem() = "corrupt global heap (" + problem + ")";
                return -1;
            }
        }
    }
    return 0;
}

herr_t driver_write(H5FD_t*, H5FD_mem_t, hid_t, haddr_t, size_t, const void*) {
    return -1;  // read-only
}

hid_t driver_id() {
    static const hid_t id = [] {
        static H5FD_class_t driver = {};
        driver.name = "kvtools-checked-read";
        driver.maxaddr = max_address;
        driver.fc_degree = H5F_CLOSE_WEAK;
        driver.fapl_size = sizeof(DriverInfo);
        driver.open = driver_open;
        driver.close = driver_close;
        driver.cmp = driver_compare;
        driver.query = driver_query;
        driver.get_eoa = driver_get_eoa;
        driver.set_eoa = driver_set_eoa;
        driver.get_eof = driver_get_eof;
        driver.read = driver_read;
        driver.write = driver_write;
        const H5FD_mem_t map[H5FD_MEM_NTYPES] = H5FD_FLMAP_DICHOTOMY;
        std::memcpy(driver.fl_map, map, sizeof map);
        return H5FDregister(&driver);
    }();
    return id;
}

}  // namespace

bool RawSource::read(uint64_t offset, std::size_t length, void* buffer) const {
    if (offset > size || length > size - offset) return false;
    if (image) {
        std::memcpy(buffer, image + offset, length);
        return true;
    }
    auto* out = static_cast<char*>(buffer);
    while (length > 0) {
        const ssize_t n = ::pread(fd, out, length, static_cast<off_t>(offset));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        out += n;
        offset += static_cast<uint64_t>(n);
        length -= static_cast<std::size_t>(n);
    }
    return true;
}

hid_t make_checked_read_access(const RawSource& source) {
    const hid_t access = H5Pcreate(H5P_FILE_ACCESS);
    if (access < 0) return access;
    const DriverInfo info{source.image, source.size, source.fd};
    if (H5Pset_driver(access, driver_id(), &info) < 0) {
        H5Pclose(access);
        return H5I_INVALID_HID;
    }
    return access;
}

std::string take_read_driver_problem() {
    std::string problem;
    problem.swap(last_problem());
    return problem;
}

namespace {

// Checks `count` disk heap ids (length 4, collection address 8, index 4, little-endian) laid out
// `stride` bytes apart, against the collections they name in `source`.
std::string check_heap_id_bytes(const RawSource& source, const unsigned char* ids,
                                std::size_t count, std::size_t stride) {
    constexpr uint64_t none = ~uint64_t{0};
    std::map<uint64_t, std::vector<uint64_t>>& collections = source.walked_collections;
    for (std::size_t i = 0; i < count; ++i) {
        const unsigned char* p = ids + i * stride;
        const uint64_t length = load_le(p, 4);
        const uint64_t address = load_le(p + 4, 8);
        const uint64_t index = load_le(p + 12, 4);
        // Only a null address spares the heap: HDF5 follows the id of an empty string too (which
        // writers store as an object of size 0), so its index must name an object (found by
        // fuzzing: an empty string whose index was changed crashed H5HG_read).
        if (address == 0) continue;
        auto found = collections.find(address);
        if (found == collections.end()) {
            unsigned char header[heap_header_size];
            if (!source.read(address, sizeof header, header) ||
                !is_collection(header, sizeof header))
                return "a string points outside the global heap";
            const uint64_t size = load_le(header + 8, 8);
            if (size < heap_header_size || size > source.size - address)
                return "a global heap collection with an invalid size";
            std::vector<unsigned char> bytes(static_cast<std::size_t>(size));
            if (!source.read(address, bytes.size(), bytes.data()))
                return "a global heap collection outside the file";
            std::vector<uint64_t> objects;  // indexes have 16 bits
            const std::string problem =
                walk_collection(bytes.data(), bytes.size(), [&](uint64_t at, uint64_t object) {
                    if (at >= objects.size()) objects.resize(at + 1, none);
                    objects[at] = object;
                });
            if (!problem.empty()) return "corrupt global heap (" + problem + ")";
            found = collections.emplace(address, std::move(objects)).first;
        }
        if (index >= found->second.size() || found->second[index] == none ||
            found->second[index] != length)
            return "a string points to a missing or wrong global heap object";
    }
    return "";
}

const RawSource*& guarded_source() {
    static const RawSource* source = nullptr;
    return source;
}

H5T_conv_t& library_vlen_conversion() {
    static H5T_conv_t function = nullptr;
    return function;
}

// In front of HDF5's own variable-length conversion: before it follows the heap ids of strings
// read from the guarded file (attributes included, whose bytes no other check sees), they are
// checked; a bad one fails the conversion instead of crashing H5HG_read (HDF5 1.10 only asserts
// the index).
herr_t guarded_vlen_conversion(hid_t source_type, hid_t target_type, H5T_cdata_t* data,
                               size_t count, size_t stride, size_t background_stride, void* buffer,
                               void* background, hid_t transfer) {
    const RawSource* source = guarded_source();
    if (data->command == H5T_CONV_CONV) {
        // The elements' size, as the datatype_problem check of a header has it: that check
        // sees only the headers it can parse whole, and HDF5 allocates sequence length x
        // element size per value (found by fuzzing: an attribute string of 4-gigabyte
        // characters in a header whose other messages did not parse, a 12.8 GB allocation;
        // then the same in a read no file was guarded for, 21 GB). It needs no file: always.
        const hid_t base = H5Tget_super(source_type);
        const std::size_t element = base >= 0 ? H5Tget_size(base) : 0;
        if (base >= 0) H5Tclose(base);
        H5Eclear2(H5E_DEFAULT);
        const bool string = H5Tis_variable_str(source_type) > 0;
        if (base >= 0 && (string ? element != 1 : element == 0 || element > 1024)) {
            last_problem() =
                "a variable-length type of " + std::to_string(element) + "-byte elements";
            return -1;
        }
    }
    if (data->command == H5T_CONV_CONV && source && buffer && count > 0 &&
        H5Tis_variable_str(source_type) > 0 && H5Tget_size(source_type) == 16) {
        const std::string problem = check_heap_id_bytes(
            *source, static_cast<const unsigned char*>(buffer), count, stride ? stride : 16);
        if (!problem.empty()) {
            last_problem() = problem;
            return -1;
        }
    }
    return library_vlen_conversion()(source_type, target_type, data, count, stride,
                                     background_stride, buffer, background, transfer);
}

}  // namespace

std::string check_heap_ids(const RawSource& source, uint64_t offset, std::size_t count) {
    constexpr std::size_t element = 16;  // length (4), collection address (8), index (4)
    if (count > source.size / element) return "variable-length data outside the file";
    std::vector<unsigned char> raw(count * element);
    if (!source.read(offset, raw.size(), raw.data()))
        return "variable-length data outside the file";
    return check_heap_id_bytes(source, raw.data(), count, element);
}

bool install_vlen_guard() {
    static const bool installed = [] {
        const hid_t ints = H5Tvlen_create(H5T_NATIVE_INT);
        const hid_t longs = H5Tvlen_create(H5T_NATIVE_LLONG);
        H5T_cdata_t* data = nullptr;
        library_vlen_conversion() = H5Tfind(ints, longs, &data);
        const bool ok =
            library_vlen_conversion() && H5Tregister(H5T_PERS_SOFT, "kvtools-checked-vlen", ints,
                                                     longs, guarded_vlen_conversion) >= 0;
        H5Tclose(ints);
        H5Tclose(longs);
        H5Eclear2(H5E_DEFAULT);
        return ok;
    }();
    return installed;
}

VlenGuard::VlenGuard(const RawSource* source) : previous_(guarded_source()) {
    guarded_source() = source;
}

VlenGuard::~VlenGuard() {
    guarded_source() = previous_;
}

}  // namespace kv
