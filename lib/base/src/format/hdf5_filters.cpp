#include "hdf5_filters.hpp"

#include "direct_read.hpp"
#include "hdf5_zstd.hpp"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

// HDF5's H5Zregister refuses the ids of its own filters (below 256: "unable to modify predefined
// filters"); the function behind it, which HDF5's shared libraries (1.8 to 1.14) export, replaces
// them. Weak: where a build of HDF5 hides it, only zstd is held to the chunk.
extern "C" herr_t H5Z_register(const H5Z_class2_t* filter) __attribute__((weak));

namespace kv::format {
namespace {

// HDF5 stores no chunk of 4 GiB or more.
constexpr std::size_t max_chunk_bytes = (std::size_t{1} << 32) - 1;

// What the reads on this thread expect: the bytes of one chunk (0: no read is guarded) and the
// filter first in the dataset's pipeline, whose reverse runs last.
struct Expectation {
    std::size_t bytes = 0;
    H5Z_filter_t last = -1;
};
thread_local Expectation expected;
thread_local std::string filter_problem;

// Fails a stage, saying why.
std::size_t refuse(std::string why) {
    filter_problem = std::move(why);
    return 0;
}

// The problem of a chunk that decodes to `size` bytes where a guarded read expects a chunk's.
std::size_t refuse_size(uint64_t size) {
    return refuse("a chunk that decodes to " + std::to_string(size) +
                  " bytes where the dataset's chunks hold " + std::to_string(expected.bytes));
}

// A reverse stage's result (`size` bytes in *buf; 0 is a failure) held to the chunk: the last
// stage must give the chunk's bytes exactly; any stage's buffer is grown to hold a chunk, its
// bytes after the result zeros, because a chunk whose filter mask skips the last filter ends at
// another stage.
std::size_t held_to_chunk(H5Z_filter_t id, std::size_t size, std::size_t* buf_size, void** buf) {
    const std::size_t chunk = expected.bytes;
    if (size == 0 || chunk == 0) return size;
    if (id == expected.last && size != chunk) return refuse_size(size);
    if (*buf_size < chunk) {
        void* grown = H5resize_memory(*buf, chunk);
        if (!grown) return 0;
        *buf = grown;
        *buf_size = chunk;
    }
    if (size < chunk) std::memset(static_cast<char*>(*buf) + size, 0, chunk - size);
    return size;
}

// Replaces *buf by `output` of `capacity` bytes.
void replace_buffer(void* output, std::size_t capacity, std::size_t* buf_size, void** buf) {
    H5free_memory(*buf);
    *buf = output;
    *buf_size = capacity;
}

// HDF5's byte shuffle: byte b of element i at b * elements + i; the bytes after the last whole
// element (and buffers of one element, or of 1-byte elements) unchanged.
std::size_t shuffle_filter(unsigned flags, std::size_t cd_nelmts, const unsigned cd_values[],
                           std::size_t nbytes, std::size_t* buf_size, void** buf) {
    if (cd_nelmts != 1 || cd_values[0] == 0) return refuse("a shuffle filter without its size");
    const std::size_t size = cd_values[0];
    const std::size_t elements = nbytes / size;
    const bool reverse = (flags & H5Z_FLAG_REVERSE) != 0;
    if (size > 1 && elements > 1) {
        auto* output = static_cast<unsigned char*>(H5allocate_memory(nbytes, false));
        if (!output) return 0;
        const auto* input = static_cast<const unsigned char*>(*buf);
        if (reverse) {
            unshuffle(reinterpret_cast<const std::byte*>(input), elements, size, elements,
                      reinterpret_cast<std::byte*>(output));
        } else {
            for (std::size_t b = 0; b < size; ++b)
                for (std::size_t i = 0; i < elements; ++i)
                    output[b * elements + i] = input[i * size + b];
        }
        const std::size_t whole = elements * size;
        std::memcpy(output + whole, input + whole, nbytes - whole);
        replace_buffer(output, nbytes, buf_size, buf);
    }
    return reverse ? held_to_chunk(H5Z_FILTER_SHUFFLE, nbytes, buf_size, buf) : nbytes;
}

// The shuffle's size is the dataset's element size, set when the dataset is created.
herr_t shuffle_set_local(hid_t properties, hid_t type, hid_t) {
    unsigned flags = 0;
    std::size_t count = 1;
    unsigned values[1] = {0};
    if (H5Pget_filter_by_id2(properties, H5Z_FILTER_SHUFFLE, &flags, &count, values, 0, nullptr,
                             nullptr) < 0)
        return -1;
    const std::size_t size = H5Tget_size(type);
    if (size == 0 || size > UINT_MAX) return -1;
    values[0] = static_cast<unsigned>(size);
    return H5Pmodify_filter(properties, H5Z_FILTER_SHUFFLE, flags, 1, values);
}

// HDF5's Fletcher32: the checksum appended little-endian; on reading, checked (unless error
// detection is off for the read) and dropped.
std::size_t fletcher32_filter(unsigned flags, std::size_t, const unsigned[], std::size_t nbytes,
                              std::size_t* buf_size, void** buf) {
    const auto* input = static_cast<const unsigned char*>(*buf);
    if (flags & H5Z_FLAG_REVERSE) {
        if (nbytes < 4) return refuse("a chunk too short for its Fletcher32 checksum");
        const std::size_t data = nbytes - 4;
        if (!(flags & H5Z_FLAG_SKIP_EDC)) {
            if (!fletcher32_matches(input + data,
                                    fletcher32(reinterpret_cast<const std::byte*>(input), data)))
                return refuse("data error detected by Fletcher32 checksum");
        }
        return held_to_chunk(H5Z_FILTER_FLETCHER32, data, buf_size, buf);
    }
    const uint32_t sum = fletcher32(reinterpret_cast<const std::byte*>(input), nbytes);
    auto* output = static_cast<unsigned char*>(H5allocate_memory(nbytes + 4, false));
    if (!output) return 0;
    std::memcpy(output, input, nbytes);
    for (int i = 0; i < 4; ++i)
        output[nbytes + i] = static_cast<unsigned char>(sum >> (8 * i));
    replace_buffer(output, nbytes + 4, buf_size, buf);
    return nbytes + 4;
}

// Deflate (zlib), the level in cd_values[0]. Inflating stops at the chunk's size where this is
// the last stage of a guarded read, at 4 GiB otherwise.
std::size_t deflate_filter(unsigned flags, std::size_t cd_nelmts, const unsigned cd_values[],
                           std::size_t nbytes, std::size_t* buf_size, void** buf) {
    if (cd_nelmts != 1 || cd_values[0] > 9) return refuse("a deflate filter of an unknown level");
    if (nbytes > max_chunk_bytes) return 0;
    if (!(flags & H5Z_FLAG_REVERSE)) {
        uLongf size = compressBound(static_cast<uLong>(nbytes));
        void* output = H5allocate_memory(size, false);
        if (!output) return 0;
        if (compress2(static_cast<Bytef*>(output), &size, static_cast<const Bytef*>(*buf),
                      static_cast<uLong>(nbytes), static_cast<int>(cd_values[0])) != Z_OK) {
            H5free_memory(output);
            return 0;
        }
        replace_buffer(output, compressBound(static_cast<uLong>(nbytes)), buf_size, buf);
        return size;
    }
    const bool last = expected.bytes != 0 && expected.last == H5Z_FILTER_DEFLATE;
    const std::size_t limit = last ? expected.bytes + 1 : max_chunk_bytes;
    std::size_t capacity =
        last ? limit : std::min(limit, std::max<std::size_t>(*buf_size, 1 << 16));
    auto* output = static_cast<unsigned char*>(H5allocate_memory(capacity, false));
    if (!output) return 0;
    z_stream stream{};
    stream.next_in = static_cast<Bytef*>(*buf);
    stream.avail_in = static_cast<uInt>(nbytes);
    if (inflateInit(&stream) != Z_OK) {
        H5free_memory(output);
        return 0;
    }
    std::size_t size = 0;
    for (;;) {
        stream.next_out = output + size;
        stream.avail_out = static_cast<uInt>(capacity - size);
        const int status = inflate(&stream, Z_NO_FLUSH);
        size = capacity - stream.avail_out;
        if (status == Z_STREAM_END) break;
        const bool full = stream.avail_out == 0;
        if ((status != Z_OK && status != Z_BUF_ERROR) || !full || capacity == limit) {
            inflateEnd(&stream);
            H5free_memory(output);
            return refuse(full ? "a deflate chunk that decodes to more than its dataset's chunks"
                               : "a deflate chunk that does not decompress");
        }
        capacity = std::min(limit, capacity * 2);
        void* grown = H5resize_memory(output, capacity);
        if (!grown) {
            inflateEnd(&stream);
            H5free_memory(output);
            return 0;
        }
        output = static_cast<unsigned char*>(grown);
    }
    inflateEnd(&stream);
    replace_buffer(output, capacity, buf_size, buf);
    return held_to_chunk(H5Z_FILTER_DEFLATE, size, buf_size, buf);
}

// zstd (hdf5_zstd.cpp), its frame's recorded size checked before it is allocated where this is
// the last stage of a guarded read.
std::size_t zstd_checked_filter(unsigned flags, std::size_t cd_nelmts, const unsigned cd_values[],
                                std::size_t nbytes, std::size_t* buf_size, void** buf) {
    if ((flags & H5Z_FLAG_REVERSE) && expected.bytes != 0 && expected.last == zstd_filter_id &&
        ZSTD_findFrameCompressedSize(*buf, nbytes) == nbytes) {
        const unsigned long long content = ZSTD_getFrameContentSize(*buf, nbytes);
        if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != ZSTD_CONTENTSIZE_ERROR &&
            content != expected.bytes)
            return refuse_size(content);
    }
    const std::size_t size =
        zstd_filter_class.filter(flags, cd_nelmts, cd_values, nbytes, buf_size, buf);
    return flags & H5Z_FLAG_REVERSE ? held_to_chunk(zstd_filter_id, size, buf_size, buf) : size;
}

// The names are HDF5's: a version-1 pipeline message stores them.
const H5Z_class2_t shuffle_class = {H5Z_CLASS_T_VERS,  H5Z_FILTER_SHUFFLE, 1, 1, "shuffle", nullptr,
                                    shuffle_set_local, shuffle_filter};
const H5Z_class2_t fletcher32_class = {
    H5Z_CLASS_T_VERS, H5Z_FILTER_FLETCHER32, 1, 1, "fletcher32", nullptr,
    nullptr,          fletcher32_filter};
const H5Z_class2_t deflate_class = {H5Z_CLASS_T_VERS, H5Z_FILTER_DEFLATE, 1, 1, "deflate", nullptr,
                                    nullptr,          deflate_filter};

// A chunk the read's selection touches whose filter mask skips every filter, stored in fewer
// bytes than a chunk: no filter stage runs to hold it to its size, and HDF5 1.10.8 copies a whole
// chunk out of the stored bytes (found by fuzzing: 144 bytes out of 38). The chunks are looked up
// in the selection's bounding box, up to 2^22 of them (a sound read never touches that many).
std::string unfiltered_chunk_problem(hid_t dataset, hid_t file_space, int rank,
                                     const hsize_t* chunk, int filters, std::size_t bytes) {
    hsize_t first[H5S_MAX_RANK], last[H5S_MAX_RANK];
    bool bounded = false;
    if (file_space == H5S_ALL) {
        const hid_t space = H5Dget_space(dataset);
        hsize_t dims[H5S_MAX_RANK];
        bounded = space >= 0 && H5Sget_simple_extent_ndims(space) == rank &&
                  H5Sget_simple_extent_dims(space, dims, nullptr) == rank;
        for (int i = 0; i < rank && bounded; ++i) {
            first[i] = 0;
            bounded = dims[i] > 0;
            last[i] = dims[i] - 1;
        }
        if (space >= 0) H5Sclose(space);
    } else {
        bounded = H5Sget_simple_extent_ndims(file_space) == rank &&
                  H5Sget_select_npoints(file_space) > 0 &&
                  H5Sget_select_bounds(file_space, first, last) >= 0;
    }
    if (!bounded) return "";
    uint64_t count = 1;
    hsize_t at[H5S_MAX_RANK];
    for (int i = 0; i < rank; ++i) {
        first[i] = first[i] / chunk[i] * chunk[i];
        at[i] = first[i];
        const uint64_t span = (last[i] - first[i]) / chunk[i] + 1;
        count = span != 0 && count > (uint64_t{1} << 22) / span ? UINT64_MAX : count * span;
    }
    if (count > (uint64_t{1} << 22)) return "";
    const unsigned every = (1u << filters) - 1;
    for (uint64_t n = 0; n < count; ++n) {
        unsigned mask = 0;
        haddr_t address = HADDR_UNDEF;
        hsize_t size = 0;
        if (H5Dget_chunk_info_by_coord(dataset, at, &mask, &address, &size) >= 0 &&
            address != HADDR_UNDEF && (mask & every) == every && size < bytes)
            return "a chunk stored unfiltered in " + std::to_string(size) +
                   " bytes where the dataset's chunks hold " + std::to_string(bytes);
        for (int i = rank - 1; i >= 0; --i) {  // the next chunk, the last dimension fastest
            at[i] += chunk[i];
            if (at[i] <= last[i]) break;
            at[i] = first[i];
        }
    }
    H5Eclear2(H5E_DEFAULT);
    return "";
}

// For its lifetime, chunks read on this thread are held to the size of `dataset`'s chunks, or
// problem() says why the dataset must not be read (chunks of `file_space`'s selection checked).
class ChunkReadGuard {
  public:
    ChunkReadGuard(hid_t dataset, hid_t file_space);
    ~ChunkReadGuard() { expected = previous_; }
    ChunkReadGuard(const ChunkReadGuard&) = delete;
    ChunkReadGuard& operator=(const ChunkReadGuard&) = delete;

    const std::string& problem() const { return problem_; }

  private:
    std::string problem_;
    Expectation previous_ = expected;
};

ChunkReadGuard::ChunkReadGuard(hid_t dataset, hid_t file_space) {
    expected = {};
    filter_problem.clear();
    const hid_t properties = H5Dget_create_plist(dataset);
    if (properties < 0) return;
    const int filters = H5Pget_layout(properties) == H5D_CHUNKED ? H5Pget_nfilters(properties) : 0;
    hsize_t chunk[H5S_MAX_RANK];
    const int rank = filters > 0 ? H5Pget_chunk(properties, H5S_MAX_RANK, chunk) : 0;
    const hid_t type = rank > 0 ? H5Dget_type(dataset) : -1;
    std::size_t bytes = type >= 0 ? H5Tget_size(type) : 0;
    for (int i = 0; i < rank && bytes != 0; ++i)
        bytes = chunk[i] != 0 && bytes <= max_chunk_bytes / chunk[i] ? bytes * chunk[i] : 0;
    H5Z_filter_t first = -1;
    for (int i = 0; i < filters && problem_.empty(); ++i) {
        unsigned filter_flags = 0;
        std::size_t count = 0;
        const H5Z_filter_t id = H5Pget_filter2(properties, static_cast<unsigned>(i), &filter_flags,
                                               &count, nullptr, 0, nullptr, nullptr);
        if (id != H5Z_FILTER_SHUFFLE && id != H5Z_FILTER_FLETCHER32 && id != H5Z_FILTER_DEFLATE &&
            id != zstd_filter_id)
            problem_ = "a dataset compressed with HDF5 filter " + std::to_string(id) +
                       ", which kvtools does not read (it reads shuffle, deflate, zstd and "
                       "Fletcher32)";
        for (int j = 0; j < i && problem_.empty(); ++j)
            if (H5Pget_filter2(properties, static_cast<unsigned>(j), &filter_flags, &count, nullptr,
                               0, nullptr, nullptr) == id)
                problem_ =
                    "a dataset whose filter pipeline gives filter " + std::to_string(id) + " twice";
        if (i == 0) first = id;
    }
    if (problem_.empty() && rank > 0 && bytes == 0)
        problem_ = "a dataset whose chunks are larger than HDF5 can store";
    if (problem_.empty() && rank > 0)
        problem_ = unfiltered_chunk_problem(dataset, file_space, rank, chunk, filters, bytes);
    if (type >= 0) H5Tclose(type);
    H5Pclose(properties);
    if (problem_.empty() && filters > 0 && bytes != 0) expected = {bytes, first};
}

}  // namespace

void register_checked_filters() {
    H5Z_class2_t checked_zstd = zstd_filter_class;
    checked_zstd.filter = zstd_checked_filter;
    const H5Z_class2_t* const filters[] = {&shuffle_class, &fletcher32_class, &deflate_class,
                                           &checked_zstd};
    for (const H5Z_class2_t* filter : filters)
        if (filter->id >= H5Z_FILTER_RESERVED)
            H5Zregister(filter);
        else if (H5Z_register)
            H5Z_register(filter);
}

herr_t read_dataset(hid_t dataset, hid_t memory_type, hid_t memory_space, hid_t file_space,
                    hid_t transfer, void* buffer) {
    const ChunkReadGuard guard(dataset, file_space);
    if (!guard.problem().empty()) {
        filter_problem = guard.problem();
        return -1;
    }
    return H5Dread(dataset, memory_type, memory_space, file_space, transfer, buffer);
}

std::string take_filter_problem() {
    std::string problem = std::move(filter_problem);
    filter_problem.clear();
    return problem;
}

}  // namespace kv::format
