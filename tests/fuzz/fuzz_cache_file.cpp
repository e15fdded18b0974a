// The cache-file reader (formats/kvcache.md) on arbitrary bytes: open, list, read every packet
// with its tensors and index, and the adapter.
//
// Under libFuzzer the mutator repairs the HDF5 checksums after mutating (hdf5_checksums.hpp) in
// three mutations out of four, so that inputs reach what HDF5 trusts once a checksum matches: the
// file of an attacker, not of a failing disk. The fourth keeps the checksums as they were (what
// a failing disk gives).
#include "fuzz_input.hpp"
#include "hdf5_checksums.hpp"
#include "kv/format/cache_reader.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    const auto path = kv::fuzz::scratch_file("input.kvc", data, size);
    kv::fuzz::expect_clean_outcome([&] {
        kv::CacheReader reader(path);
        for (const kv::PacketInfo& info : reader.packets()) {
            reader.has_index(info.id);
            kv::fuzz::expect_clean_outcome([&] { reader.read(info.id); });
        }
        if (reader.has_adapter()) reader.read_adapter();
    });
    return 0;
}

#ifdef KV_LIBFUZZER
extern "C" std::size_t LLVMFuzzerMutate(uint8_t* data, std::size_t size, std::size_t max_size);

extern "C" std::size_t LLVMFuzzerCustomMutator(uint8_t* data, std::size_t size,
                                               std::size_t max_size, unsigned int seed) {
    size = LLVMFuzzerMutate(data, size, max_size);
    if (seed % 4 != 0) kv::fuzz::repair_hdf5_checksums(data, size);
    return size;
}
#endif
