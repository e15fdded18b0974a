// The safetensors reader on arbitrary bytes; every byte a view hands out is touched, so an
// out-of-bounds offset is caught by AddressSanitizer.
#include "fuzz_input.hpp"
#include "kv/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    const auto path = kv::fuzz::scratch_file("model.safetensors", data, size);
    kv::fuzz::expect_clean_outcome([&] {
        const kv::SafetensorsFile file = kv::SafetensorsFile::open(path);
        unsigned checksum = 0;
        for (const kv::SafetensorsEntry& entry : file.entries()) {
            const std::byte* bytes = file.data(entry);
            for (std::size_t i = 0; i < entry.size; ++i)
                checksum += static_cast<unsigned>(bytes[i]);
        }
        volatile unsigned sink = checksum;
        (void)sink;
    });
    return 0;
}
