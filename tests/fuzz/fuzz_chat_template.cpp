// Chat templates (a model's tokenizer_config.json or GGUF metadata is input like any other): the
// lexer, the parser and the renderer over a conversation with a system message, tools and the
// special tokens.
#include "fuzz_input.hpp"
#include "kv/json.hpp"
#include "kv/text/chat_template.hpp"

#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    static const kv::json::Value variables = kv::json::parse(R"({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi {{ x }} ü"},
                     {"role": "assistant", "content": "Hello", "tool_calls": [
                         {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                     {"role": "tool", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "documents": null, "add_generation_prompt": true,
        "bos_token": "<s>", "eos_token": "</s>"})");
    kv::fuzz::expect_clean_outcome([&] {
        const kv::text::ChatTemplate tmpl(
            std::string_view(reinterpret_cast<const char*>(data), size));
        kv::text::ChatRenderOptions options;
        options.now = 0;
        tmpl.render(variables, options);
    });
    return 0;
}
