#include "hdf5_read_driver.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <new>
#include <tuple>
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

std::string check_collection(const unsigned char* p, std::size_t size) {
    const uint64_t declared = load_le(p + 8, 8);
    if (declared < heap_header_size) return "a global heap collection with an invalid size";
    // A first read may be shorter than the collection: HDF5 then reads it whole, and that read
    // is checked.
    if (declared > size) return "";
    return walk_collection(p, static_cast<std::size_t>(declared), [](uint64_t, uint64_t) {});
}

struct DriverInfo {
    const std::byte* image;
    std::size_t size;
};

struct CheckedFile {
    H5FD_t base;  // first: HDF5 sees this struct as its H5FD_t
    RawSource source;
    bool owns_fd;
    dev_t device;
    ino_t inode;
    haddr_t eoa;
};

constexpr haddr_t max_address = (haddr_t{1} << 62) - 1;

H5FD_t* driver_open(const char* name, unsigned flags, hid_t access, haddr_t max) {
    if ((flags & H5F_ACC_RDWR) || (flags & H5F_ACC_CREAT) || max == 0 || max > max_address)
        return nullptr;
    const auto* info = static_cast<const DriverInfo*>(H5Pget_driver_info(access));
    auto* file = new (std::nothrow) CheckedFile{};
    if (!file) return nullptr;
    if (info && info->image) {
        file->source.image = info->image;
        file->source.size = info->size;
        file->owns_fd = false;
    } else {
        const int fd = ::open(name, O_RDONLY | O_CLOEXEC);
        struct stat status {};
        if (fd < 0 || ::fstat(fd, &status) != 0) {
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

herr_t driver_query(const H5FD_t*, unsigned long* flags) {
    if (flags) *flags = H5FD_FEAT_ACCUMULATE_METADATA_READ | H5FD_FEAT_DATA_SIEVE;
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

// A version-1 object header (HDF5's earliest format, h5py's default) carries no checksum, and
// HDF5 1.10 decodes its attribute messages trusting the sizes inside them (found by fuzzing: a
// dataspace claiming 56 KB in a 72-byte message overflowed the heap). Walks the header's chunks
// (following continuation messages) and checks that every message fits its chunk and every
// attribute message holds its name, datatype and dataspace. Returns "" or the problem.
std::string check_v1_object_header(const RawSource& source, uint64_t address,
                                   const unsigned char* prefix) {
    const uint64_t messages = load_le(prefix + 2, 2);
    const uint64_t first_size = load_le(prefix + 8, 4);
    std::vector<std::pair<uint64_t, uint64_t>> chunks = {{address + 16, first_size}};
    std::string problem;
    uint64_t seen = 0;
    for (std::size_t next = 0; next < chunks.size(); ++next) {
        // Anything that does not parse as a whole header is not judged here: bytes that only
        // look like a header prefix (a continuation chunk starting with a dataspace message
        // does), or a header HDF5 itself will find corrupt.
        if (chunks.size() > 4096) return "";
        const auto [start, length] = chunks[next];
        if (start > source.size || length > source.size - start) return "";
        std::vector<unsigned char> chunk(static_cast<std::size_t>(length));
        if (!source.read(start, chunk.size(), chunk.data())) return "";
        std::size_t at = 0;
        while (at + 8 <= chunk.size()) {
            const uint64_t type = load_le(&chunk[at], 2);
            const uint64_t size = load_le(&chunk[at + 2], 2);
            const std::size_t data = at + 8;
            if (size > chunk.size() - data) return "";
            ++seen;
            if (type == 0x10 && size >= 16) {  // continuation: address, length
                chunks.emplace_back(load_le(&chunk[data], 8), load_le(&chunk[data + 8], 8));
            } else if (type == 0x0C && size >= 8 && problem.empty()) {  // attribute
                const unsigned version = chunk[data];
                const uint64_t name = load_le(&chunk[data + 2], 2);
                const uint64_t datatype = load_le(&chunk[data + 4], 2);
                const uint64_t dataspace = load_le(&chunk[data + 6], 2);
                auto pad8 = [](uint64_t n) { return (n + 7) / 8 * 8; };
                const uint64_t needed = version == 1
                                            ? 8 + pad8(name) + pad8(datatype) + pad8(dataspace)
                                        : version == 2 ? 8 + name + datatype + dataspace
                                        : version == 3 ? 9 + name + datatype + dataspace
                                                       : UINT64_MAX;
                if (needed > size) problem = "an attribute message larger than its space";
            }
            at = data + static_cast<std::size_t>(size);
        }
        if (at != chunk.size()) return "";  // messages tile a real chunk exactly
    }
    return seen == messages ? problem : "";
}

herr_t driver_read(H5FD_t* base, H5FD_mem_t type, hid_t, haddr_t address, size_t size,
                   void* buffer) {
    const auto* file = reinterpret_cast<const CheckedFile*>(base);
    if (address > max_address || size > max_address - address) return -1;
    // As sec2 and core do: bytes past the end of the file read as zeros.
    const uint64_t end = file->source.size;
    const std::size_t available =
        address >= end ? 0 : static_cast<std::size_t>(std::min<uint64_t>(size, end - address));
    if (available > 0 && !file->source.read(address, available, buffer)) return -1;
    std::memset(static_cast<char*>(buffer) + available, 0, size - available);
    // The prefix of a version-1 object header: version 1, a reserved zero, the message count,
    // reference count and first chunk size, four zero bytes of padding.
    if (type == H5FD_MEM_OHDR && size >= 16) {
        const auto* bytes = static_cast<const unsigned char*>(buffer);
        if (bytes[0] == 1 && bytes[1] == 0 && load_le(bytes + 12, 4) == 0) {
            const std::string problem = check_v1_object_header(file->source, address, bytes);
            if (!problem.empty()) {
                last_problem() = "corrupt object header (" + problem + ")";
                return -1;
            }
        }
    }
    // HDF5 reads global heap collections as raw data (H5F_block_read maps the type).
    if (type == H5FD_MEM_DRAW || type == H5FD_MEM_GHEAP) {
        const auto* bytes = static_cast<const unsigned char*>(buffer);
        if (is_collection(bytes, size)) {
            const std::string problem = check_collection(bytes, size);
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
    const DriverInfo info{source.image, source.size};
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
