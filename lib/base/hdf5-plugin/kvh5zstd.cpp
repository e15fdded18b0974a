// libkvh5zstd.so: the library's zstd filter (filter id 32015) as a dynamic HDF5 plugin, for
// HDF5 programs that have none (h5dump, and h5py where hdf5plugin ships no filter binaries, as
// on Debian 12). Point HDF5_PLUGIN_PATH at the directory holding it.
#include "hdf5_zstd.hpp"

#include <H5PLextern.h>

extern "C" H5PL_type_t H5PLget_plugin_type(void) {
    return H5PL_TYPE_FILTER;
}

extern "C" const void* H5PLget_plugin_info(void) {
    return &kv::zstd_filter_class;
}
