// The cache-file reader (formats/kvcache.md) on arbitrary bytes: open, list, read every packet
// with its tensors and index.
#include "fuzz_input.hpp"
#include "kv/format/cache_reader.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    const auto path = kv::fuzz::scratch_file("input.kvc", data, size);
    kv::fuzz::expect_clean_outcome([&] {
        kv::CacheReader reader(path);
        for (const kv::PacketInfo& info : reader.packets()) {
            reader.has_index(info.id);
            kv::fuzz::expect_clean_outcome([&] { reader.read(info.id); });
        }
    });
    return 0;
}
