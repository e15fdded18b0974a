// tokenizer.json on arbitrary bytes: load it, then encode and decode a text that reaches the
// byte fallback, pre-tokenizer splits and the special tokens.
#include "fuzz_input.hpp"
#include "kv/tokenizer.hpp"

#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    const auto path = kv::fuzz::scratch_file("tokenizer.json", data, size);
    kv::fuzz::expect_clean_outcome([&] {
        const auto tokenizer = kv::load_tokenizer(path);
        constexpr std::string_view text =
            "The code of Ada is 48613.\n  Ünïcödé \xF0\x9F\x98\x80 <s>x";
        const std::vector<int32_t> ids = tokenizer->encode(text);
        tokenizer->decode(ids);
        for (int32_t id = 0; id < tokenizer->vocab_size() && id < 512; ++id)
            tokenizer->token_bytes(id);
    });
    return 0;
}
