// The model's chat template as the tools take it (kv/api/chat.hpp), on Phi-3-mini's real files
// (tests/tokenizers/data/phi-3-mini, MIT).
#include <catch2/catch.hpp>

#include "gguf_writer.hpp"
#include "kv/api/chat.hpp"
#include "kv/error.hpp"
#include "test_support.hpp"

namespace {

const std::filesystem::path phi3 =
    std::filesystem::path(KV_TEST_DATA_DIR) / ".." / "tokenizers" / "data" / "phi-3-mini";

std::string error_of(const std::filesystem::path& model) {
    try {
        kv::model_chat_template(model, std::nullopt, std::nullopt, "--chat");
    } catch (const kv::UnsupportedError& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_CASE("chat: a model folder's template, and KV Packet's preamble cut from it", "[chat]") {
    const auto tokenizer = kv::load_tokenizer(phi3);
    const kv::text::ModelChatTemplate tmpl =
        kv::model_chat_template(phi3, std::nullopt, std::nullopt, "--chat");
    CHECK(tmpl.special_tokens.at("bos_token").as_string() == "<s>");
    CHECK(tmpl.special_tokens.at("eos_token").as_string() == "<|endoftext|>");

    const kv::ChatPreambleTokens preamble = kv::chat_preamble_tokens(tmpl, *tokenizer, "Be brief.");
    CHECK(preamble.text.before == "<|system|>\nBe brief.<|end|>\n<|user|>\n");
    CHECK(preamble.text.after == "<|end|>\n<|assistant|>\n");
    // the special tokens written by the template are the tokenizer's special tokens
    const std::vector<int32_t> system = tokenizer->encode("<|system|>");
    REQUIRE(system.size() == 1);
    REQUIRE_FALSE(preamble.before.empty());
    CHECK(preamble.before.front() == system.front());
    CHECK(preamble.before == tokenizer->encode(preamble.text.before));

    // Without a system message the template starts with the user's turn.
    CHECK(kv::chat_preamble_tokens(tmpl, *tokenizer, "").text.before == "<|user|>\n");
}

TEST_CASE("chat: the tokenizer's folder first, a template the model file carries last", "[chat]") {
    kv::test::TempDir dir;
    kv::test::write_file(dir / "config.json", "{}");
    // No tokenizer_config.json with a template: refused, naming what was looked at.
    CHECK(error_of(dir.path()) == "--chat: the model has no chat template (no chat_template in '" +
                                      (dir / "tokenizer_config.json").string() + "')");
    // --tokenizer's folder holds it.
    CHECK(kv::model_chat_template(dir.path(), phi3, std::nullopt, "--chat").file ==
          phi3 / "tokenizer_config.json");
    // A template carried by the model file (GGUF's) when no tokenizer_config.json has one.
    kv::text::ModelChatTemplate carried;
    carried.source = "{{ bos_token }}";
    carried.special_tokens.set("bos_token", "<s>");
    CHECK(kv::model_chat_template(dir.path(), std::nullopt, carried, "--chat").source ==
          carried.source);
    CHECK(kv::model_chat_template(phi3, std::nullopt, carried, "--chat").source != carried.source);
}

TEST_CASE("chat: a GGUF file's template, with the special tokens its metadata names by id",
          "[chat]") {
    kv::test::TempDir dir;
    kv::test::GgufWriter writer;
    writer.string("general.architecture", "llama")
        .string("tokenizer.chat_template",
                "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
        .strings("tokenizer.ggml.tokens", {"<unk>", "<|start|>", "<|stop|>", "a"})
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .u32("tokenizer.ggml.padding_token_id", 9);  // out of range: left out
    kv::test::write_file(dir / "model.gguf", writer.bytes());
    const kv::text::ModelChatTemplate found =
        kv::model_chat_template(dir / "model.gguf", std::nullopt, std::nullopt, "--chat");
    CHECK(found.file == dir / "model.gguf");
    CHECK(found.special_tokens.at("bos_token").as_string() == "<|start|>");
    CHECK(found.special_tokens.at("eos_token").as_string() == "<|stop|>");
    CHECK_FALSE(found.special_tokens.find("pad_token"));
    CHECK(kv::text::ChatTemplate(found.source)
              .render(kv::text::chat_variables(found, kv::text::chat_messages("", "hi"), true)) ==
          "<|start|>hi<|stop|>");

    kv::test::GgufWriter bare;
    bare.string("general.architecture", "llama");
    kv::test::write_file(dir / "bare.gguf", bare.bytes());
    CHECK(error_of(dir / "bare.gguf") ==
          "--chat: the model has no chat template (no chat_template in '" +
              (dir / "tokenizer_config.json").string() + "', the GGUF file's metadata)");
}
