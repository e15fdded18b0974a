// Reading keys and values without HDF5's filter pipeline (formats/kvcache.md, section 7): the
// chunks' places are asked of HDF5 once, then their bytes are read from the file, checked
// (Fletcher32, as HDF5 computes it), decompressed (zstd) and unshuffled by every core, each
// straight into its place in the caller's tensor. Where a dataset's layout, filters or type are
// not the ones this path knows, or anything about a chunk is not as expected (a checksum that
// does not match, a frame that does not decompress to the chunk), it reports that it did not
// read, and the caller reads through HDF5, which reads what it can and reports the rest with
// its own message. Private to lib/base/src/format.
#pragma once

#include "hdf5_read_driver.hpp"
#include "kv/format/cache_reader.hpp"

#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kv::format {

/// HDF5's Fletcher32 (H5_checksum_fletcher32: 16-bit big-endian words, sums folded every 360
/// words), fed in pieces: every piece but the last a multiple of 720 bytes.
class Fletcher32 {
  public:
    void update(const std::byte* data, std::size_t bytes);
    uint32_t value() const;

  private:
    uint32_t sum1_ = 0, sum2_ = 0;
};
/// The checksum of `bytes` at once.
uint32_t fletcher32(const std::byte* data, std::size_t bytes);
/// Whether `stored`, the 4 bytes after a chunk (the checksum, little-endian), hold `computed` as
/// HDF5 accepts it (also byte-swapped within each half, as HDF5 before 1.6.3 wrote it).
bool fletcher32_matches(const void* stored, uint32_t computed);

/// HDF5's byte unshuffle of `elements` values of `size` bytes: byte b of value i is at
/// input[b * total + i], for the first `elements` of `total` values.
void unshuffle(const std::byte* input, std::size_t total, std::size_t size, std::size_t elements,
               std::byte* output);

/// How a keys or values dataset [L, H, S, D] is stored, as kvinspect show names it.
struct TensorStorage {
    std::string layout;                ///< "contiguous", "chunked", "compact"
    int64_t chunk_tokens = 0;          ///< T of [1, 1, T, D] chunks; 0 for other chunk shapes
    std::vector<std::string> filters;  ///< in pipeline order: "shuffle", "zstd", "fletcher32", ...
    int zstd_level = 0;                ///< the zstd filter's level as recorded (0 without one)
    bool direct = false;  ///< read_tensor_directly can read it (given the memory type matches)
};
/// With the HDF5 lock held.
TensorStorage tensor_storage(hid_t dataset);

/// Reads the whole dataset [L, H, S, D] of `element_size`-byte values, whose file type is the
/// memory type byte for byte (the caller checks), into the planes of `target` (S rows of
/// D*element_size bytes each), with up to `threads` threads (0: one per core), one for each
/// `bytes_per_thread` of the tensor (a thread costs more to start than a small read takes). Call
/// with the HDF5 lock held (HDF5 is asked for the chunks' places; the threads never call it).
/// False: it did not read (anything may have been written to the planes), and the caller reads
/// through HDF5.
constexpr std::size_t read_bytes_per_thread = std::size_t{512} << 10;
bool read_tensor_directly(hid_t dataset, const RawSource& raw, std::size_t element_size,
                          const hsize_t (&dims)[4], const PlaneTargets& target, int threads,
                          std::size_t bytes_per_thread = read_bytes_per_thread);

/// The threads read_tensor_directly uses for 0: the cores this process may run on.
int default_read_threads();

/// The threads read_tensor_directly starts for `bytes` of output: one per `per_thread` bytes,
/// at least 1 and at most `threads` (at least 1).
int threads_for(std::size_t bytes, int threads, std::size_t per_thread);

}  // namespace kv::format
