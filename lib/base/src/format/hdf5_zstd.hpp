// The zstd filter of HDF5 (filter id 32015), internal to the library.
//
// Byte-compatible with hdf5plugin's Zstd and HDF5Plugin-Zstandard: cd_values[0] is the level,
// each chunk is one zstd frame that records its content size. The same code is built into the
// library (registered in-process by the cache file module) and into libkvh5zstd.so, a dynamic
// HDF5 plugin for tools without a zstd filter of their own (h5py on Debian, h5dump).
#pragma once

#include <hdf5.h>

namespace kv {

inline constexpr H5Z_filter_t zstd_filter_id = 32015;

/// The filter class to pass to H5Zregister.
extern const H5Z_class2_t zstd_filter_class;

}  // namespace kv
