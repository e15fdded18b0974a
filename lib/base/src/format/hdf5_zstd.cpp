#include "hdf5_zstd.hpp"

#include <zstd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace kv {
namespace {

// HDF5 cannot store a chunk of 4 GiB or more, so no valid chunk decompresses to more; the cap
// also keeps a corrupt frame header from asking for an absurd allocation.
constexpr std::size_t max_chunk_bytes = (std::size_t{1} << 32) - 1;

struct CompressContext {
    ZSTD_CCtx* context = ZSTD_createCCtx();
    ~CompressContext() { ZSTD_freeCCtx(context); }
};
struct DecompressContext {
    ZSTD_DCtx* context = ZSTD_createDCtx();
    ~DecompressContext() { ZSTD_freeDCtx(context); }
};

// Contexts are reused: creating one per chunk costs more than compressing a small chunk. HDF5
// calls filters from the thread that called it, so one per thread needs no lock.
ZSTD_CCtx* compress_context() {
    thread_local CompressContext holder;
    return holder.context;
}
ZSTD_DCtx* decompress_context() {
    thread_local DecompressContext holder;
    return holder.context;
}

// The frames' content size is unknown or they are several: decompress as a stream into a
// growing buffer.
std::size_t decompress_stream(const void* input, std::size_t input_size, void** output,
                              std::size_t* output_capacity) {
    ZSTD_DCtx* context = decompress_context();
    if (!context) return 0;
    ZSTD_DCtx_reset(context, ZSTD_reset_session_only);
    std::size_t capacity =
        std::min(max_chunk_bytes, std::max<std::size_t>(input_size * 4, 1 << 16));
    void* buffer = std::malloc(capacity);
    if (!buffer) return 0;
    ZSTD_inBuffer in{input, input_size, 0};
    ZSTD_outBuffer out{buffer, capacity, 0};
    for (;;) {
        if (out.pos == out.size) {
            if (capacity == max_chunk_bytes) break;
            capacity = std::min(max_chunk_bytes, capacity * 2);
            void* grown = std::realloc(buffer, capacity);
            if (!grown) break;
            buffer = grown;
            out.dst = buffer;
            out.size = capacity;
        }
        const std::size_t hint = ZSTD_decompressStream(context, &out, &in);
        if (ZSTD_isError(hint)) break;
        // 0: a frame ended and is flushed; with no input left, that is the end.
        if (hint == 0 && in.pos == in.size) {
            *output = buffer;
            *output_capacity = capacity;
            return out.pos;
        }
        // Input consumed, room left, frame unfinished: truncated.
        if (in.pos == in.size && out.pos < out.size) break;
    }
    std::free(buffer);
    return 0;
}

std::size_t decompress(std::size_t nbytes, std::size_t* buf_size, void** buf) {
    const unsigned long long content = ZSTD_getFrameContentSize(*buf, nbytes);
    if (content == ZSTD_CONTENTSIZE_ERROR) return 0;
    void* output = nullptr;
    std::size_t capacity = 0;
    std::size_t size = 0;
    const bool one_frame = ZSTD_findFrameCompressedSize(*buf, nbytes) == nbytes;
    if (content != ZSTD_CONTENTSIZE_UNKNOWN && one_frame) {
        if (content > max_chunk_bytes) return 0;
        capacity = std::max<std::size_t>(static_cast<std::size_t>(content), 1);
        output = std::malloc(capacity);
        if (!output) return 0;
        ZSTD_DCtx* context = decompress_context();
        size = context ? ZSTD_decompressDCtx(context, output, capacity, *buf, nbytes) : 0;
        if (!context || ZSTD_isError(size) || size != content) {
            std::free(output);
            return 0;
        }
    } else {
        size = decompress_stream(*buf, nbytes, &output, &capacity);
        if (!output) return 0;
    }
    std::free(*buf);
    *buf = output;
    *buf_size = capacity;
    return size;
}

std::size_t compress(std::size_t cd_nelmts, const unsigned int cd_values[], std::size_t nbytes,
                     std::size_t* buf_size, void** buf) {
    // hdf5plugin stores the (possibly negative) level as an unsigned int.
    const int level = cd_nelmts > 0 ? static_cast<int>(cd_values[0]) : 3;
    ZSTD_CCtx* context = compress_context();
    if (!context) return 0;
    const std::size_t capacity = ZSTD_compressBound(nbytes);
    void* output = std::malloc(capacity);
    if (!output) return 0;
    const std::size_t size = ZSTD_compressCCtx(context, output, capacity, *buf, nbytes, level);
    if (ZSTD_isError(size)) {
        std::free(output);
        return 0;
    }
    std::free(*buf);
    *buf = output;
    *buf_size = capacity;
    return size;
}

// HDF5's filter callback: returns the size of the result in *buf, or 0 on failure (HDF5 then
// reports an error; nothing here may throw or abort).
std::size_t zstd_filter(unsigned int flags, std::size_t cd_nelmts, const unsigned int cd_values[],
                        std::size_t nbytes, std::size_t* buf_size, void** buf) {
    if (flags & H5Z_FLAG_REVERSE) return decompress(nbytes, buf_size, buf);
    return compress(cd_nelmts, cd_values, nbytes, buf_size, buf);
}

}  // namespace

const H5Z_class2_t zstd_filter_class = {
    H5Z_CLASS_T_VERS, zstd_filter_id, 1,           1, "Zstandard compression: http://www.zstd.net",
    nullptr,          nullptr,        zstd_filter,
};

}  // namespace kv
