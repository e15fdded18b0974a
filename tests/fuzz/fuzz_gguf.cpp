// The GGUF reader on arbitrary bytes, with what is read from its metadata: the decoder's config
// and the tokenizer. Every byte of every tensor is touched, so that an offset outside the file is
// caught by AddressSanitizer.
#include "fuzz_input.hpp"
#include "kv/gguf.hpp"
#include "kv/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    const auto path = kv::fuzz::scratch_file("model.gguf", data, size);
    kv::fuzz::expect_clean_outcome([&] {
        const kv::GgufFile file = kv::GgufFile::open(path);
        unsigned checksum = 0;
        for (const kv::GgufTensorInfo& tensor : file.tensors()) {
            const std::byte* bytes = file.tensor_data(tensor);
            for (uint64_t i = 0; i < tensor.size; ++i)
                checksum += static_cast<unsigned>(bytes[i]);
        }
        volatile unsigned sink = checksum;
        (void)sink;
        kv::fuzz::expect_clean_outcome([&] { kv::gguf_model_config(file); });
        const auto tokenizer = kv::load_tokenizer(path);
        const std::vector<int32_t> ids = tokenizer->encode("Hello w\xC3\xB6rld 42 <s>\n");
        (void)tokenizer->decode(ids);
    });
    return 0;
}
