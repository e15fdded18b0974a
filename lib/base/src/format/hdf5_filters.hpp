// The filters kvtools reads (formats/kvcache.md, section 7), registered in place of HDF5's own:
// shuffle, Fletcher32 and deflate, written byte for byte as HDF5 writes them, and zstd. Reading,
// they hold each chunk to its size. HDF5 1.10.8 copies a whole chunk out of whatever its filter
// pipeline returned: a crafted file whose stored chunk decoded a byte short made it read past
// the buffer (found by fuzzing, with the file's checksums recomputed). In a read_dataset, the last
// stage of each chunk's pipeline must give exactly the chunk's bytes, and every stage leaves a
// buffer at least that large. Private to lib/base/src/format.
#pragma once

#include <hdf5.h>

#include <string>

namespace kv::format {

/// Registers the four filters with HDF5, replacing its shuffle, Fletcher32 and deflate (through
/// HDF5's internal H5Z_register, where the library exports it, as Debian's does). Once, with the
/// HDF5 lock held.
void register_checked_filters();

/// H5Dread with `dataset`'s chunks held to their size. A dataset that must not be read (a filter
/// kvtools does not read, one given twice, chunks too large for HDF5) fails as a read does: -1,
/// its problem left for take_filter_problem.
herr_t read_dataset(hid_t dataset, hid_t memory_type, hid_t memory_space, hid_t file_space,
                    hid_t transfer, void* buffer);

/// The last chunk a filter refused on this thread, as a sentence; "" when none. Clears it.
std::string take_filter_problem();

}  // namespace kv::format
