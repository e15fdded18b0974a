// Tokenizers read from GGUF metadata against the Hugging Face files they were converted from:
// the test converts them as llama.cpp's convert_hf_to_gguf.py does (tokens with their types,
// merges or sentencepiece scores, the special ids) and checks the same ids, special tokens and
// decoded text over a corpus.
#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/tokenizer.hpp"

#include "gguf_writer.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <random>

using namespace kv;
using kv::test::GgufWriter;

namespace {

const std::filesystem::path tokenizers =
    std::filesystem::path(KV_TEST_DATA_DIR) / "../tokenizers/data";

// llama.cpp's token types.
constexpr int32_t normal = 1, control = 3, user_defined = 4, unused = 5;

json::Value read_json(const std::filesystem::path& path) {
    return json::parse(test::read_text(path));
}

int32_t id_of(const std::vector<std::string>& tokens, const std::string& content) {
    for (std::size_t id = 0; id < tokens.size(); ++id)
        if (tokens[id] == content) return static_cast<int32_t>(id);
    return -1;
}

// A byte-level BPE tokenizer.json as convert_hf_to_gguf.py writes it ("gpt2" model): its
// tokens padded with unused [PADn] ones up to `pad_to` (the embedding's rows), and the tokens
// named in `unused_ones` typed unused.
std::string byte_level_gguf(const std::filesystem::path& folder, const std::string& pre,
                            std::size_t pad_to = 0,
                            const std::vector<std::string>& unused_ones = {}) {
    const json::Value tokenizer = read_json(folder / "tokenizer.json");
    const json::Value config = read_json(folder / "tokenizer_config.json");
    std::vector<std::string> tokens;
    std::vector<int32_t> types;
    auto place = [&](int64_t id, const std::string& content, int32_t type) {
        if (static_cast<std::size_t>(id) >= tokens.size()) {
            for (std::size_t pad = tokens.size(); pad <= static_cast<std::size_t>(id); ++pad) {
                tokens.push_back("[PAD" + std::to_string(pad) + "]");
                types.push_back(unused);
            }
        }
        tokens[static_cast<std::size_t>(id)] = content;
        types[static_cast<std::size_t>(id)] = type;
    };
    for (const auto& [token, id] : tokenizer.at("model").at("vocab").as_object())
        place(id.as_int(), token, normal);
    for (const json::Value& added : tokenizer.at("added_tokens").as_array())
        place(added.at("id").as_int(), added.at("content").as_string(),
              added.at("special").as_bool() ? control : user_defined);
    if (pad_to > tokens.size())
        place(static_cast<int64_t>(pad_to) - 1, "[PAD" + std::to_string(pad_to - 1) + "]", unused);
    for (const std::string& content : unused_ones)
        types[static_cast<std::size_t>(id_of(tokens, content))] = unused;
    std::vector<std::string> merges;
    for (const json::Value& merge : tokenizer.at("model").at("merges").as_array())
        merges.push_back(merge.is_string() ? merge.as_string()
                                           : merge[0].as_string() + " " + merge[1].as_string());
    GgufWriter writer;
    writer.string("general.architecture", "llama")
        .string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", pre)
        .strings("tokenizer.ggml.tokens", tokens)
        .i32s("tokenizer.ggml.token_type", types)
        .strings("tokenizer.ggml.merges", merges);
    if (const json::Value* bos = config.find("bos_token"))
        writer.u32("tokenizer.ggml.bos_token_id", id_of(tokens, bos->as_string()));
    if (const json::Value* eos = config.find("eos_token"))
        writer.u32("tokenizer.ggml.eos_token_id", id_of(tokens, eos->as_string()));
    if (const json::Value* add_bos = config.find("add_bos_token"))
        writer.boolean("tokenizer.ggml.add_bos_token", add_bos->as_bool());
    return writer.bytes();
}

// Reads the pieces of a sentencepiece ModelProto (field 1: piece = 1, score = 2, type = 3), the
// way convert_hf_to_gguf.py's _create_vocab_sentencepiece takes them from tokenizer.model.
struct SentencePieces {
    std::vector<std::string> pieces;
    std::vector<float> scores;
    std::vector<int32_t> types;
};

SentencePieces read_sentencepiece(const std::string& bytes) {
    std::size_t at = 0;
    auto varint = [&](std::size_t& position, std::size_t end) {
        uint64_t value = 0;
        for (int shift = 0; position < end; shift += 7) {
            const auto byte = static_cast<unsigned char>(bytes[position++]);
            value |= static_cast<uint64_t>(byte & 0x7F) << shift;
            if (!(byte & 0x80)) break;
        }
        return value;
    };
    auto skip = [&](std::size_t& position, std::size_t end, uint64_t wire) {
        if (wire == 0)
            varint(position, end);
        else if (wire == 1)
            position += 8;
        else if (wire == 2)
            position += varint(position, end);
        else if (wire == 5)
            position += 4;
    };
    SentencePieces result;
    while (at < bytes.size()) {
        const uint64_t key = varint(at, bytes.size());
        if (key != (1 << 3 | 2)) {
            skip(at, bytes.size(), key & 7);
            continue;
        }
        const std::size_t end = at + varint(at, bytes.size());
        std::string piece;
        float score = 0;
        int32_t type = normal;
        while (at < end) {
            const uint64_t field = varint(at, end);
            if (field == (1 << 3 | 2)) {
                const std::size_t length = varint(at, end);
                piece = bytes.substr(at, length);
                at += length;
            } else if (field == (2 << 3 | 5)) {
                std::memcpy(&score, bytes.data() + at, 4);
                at += 4;
            } else if (field == (3 << 3 | 0)) {
                type = static_cast<int32_t>(varint(at, end));
            } else {
                skip(at, end, field & 7);
            }
        }
        result.pieces.push_back(piece);
        result.scores.push_back(score);
        result.types.push_back(type);
    }
    return result;
}

std::vector<std::string> corpus(bool with_special_tokens, const std::string& special) {
    std::vector<std::string> texts = {
        "Hello world",
        "Once upon a time, there was a little girl named Lily.",
        "  leading spaces",
        "trailing spaces  ",
        "tabs\tand\nnew\n\nlines\r\n",
        "numbers 1234567, 3.14159 and 2024-01-02",
        "don't you're I'll we've they'd IT'S",
        "CJK \xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C and "
        "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E",
        "emoji \xF0\x9F\x98\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD!",
        "combining e\xCC\x81 and precomposed \xC3\xA9",
        "code: for (int i = 0; i < n; ++i) { total += x[i]; }",
        "    indented(4)\n        indented(8)",
        "",
        "a",
        " ",
        "UPPER lower MiXeD",
        "\xC3\x9C"
        "n\xC3\xAF"
        "c\xC3\xB6"
        "d\xC3\xA9 w\xC3\xB6"
        "rds",
        "https://example.com/path?q=1&r=two#frag",
        "\xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 \xD0\xBC\xD0\xB8\xD1\x80",
    };
    if (with_special_tokens) {
        texts.push_back("a" + special + "b");
        texts.push_back(special + " text after " + special);
    }
    // Random mixtures of the pieces above and of single characters.
    const std::vector<std::string> pieces = {"the",
                                             " ",
                                             "  ",
                                             "\n",
                                             "\t",
                                             "7",
                                             "42",
                                             "'s",
                                             "e\xCC\x81",
                                             "\xE4\xBD\xA0",
                                             "!",
                                             "?",
                                             "\xF0\x9F\x98\x80",
                                             "Lily",
                                             " cat",
                                             "...",
                                             "<",
                                             ">",
                                             "x_y",
                                             "\xC3\xA9",
                                             "--",
                                             "0x1F"};
    std::mt19937 generator(7);
    for (int i = 0; i < 200; ++i) {
        std::string text;
        const int count = static_cast<int>(generator() % 12);
        for (int j = 0; j < count; ++j)
            text += pieces[generator() % pieces.size()];
        texts.push_back(text);
    }
    return texts;
}

void check_same_tokenizer(const Tokenizer& gguf, const Tokenizer& folder,
                          const std::vector<std::string>& texts) {
    CHECK(gguf.vocab_size() == folder.vocab_size());
    CHECK(gguf.bos_id() == folder.bos_id());
    CHECK(gguf.eos_id() == folder.eos_id());
    CHECK(gguf.add_bos() == folder.add_bos());
    CHECK(gguf.special_prefix() == folder.special_prefix());
    CHECK(gguf.special_suffix() == folder.special_suffix());
    CHECK(gguf.strips_leading_space() == folder.strips_leading_space());
    CHECK(gguf.is_end_of_generation(folder.eos_id()));
    std::size_t same = 0;
    for (const std::string& text : texts) {
        INFO("text: " << text);
        const std::vector<int32_t> ids = folder.encode_with_special_tokens(text);
        CHECK(gguf.encode_with_special_tokens(text) == ids);
        CHECK(gguf.decode(ids) == folder.decode(ids));
        same += gguf.encode(text) == folder.encode(text);
    }
    CHECK(same == texts.size());
}

}  // namespace

TEST_CASE("a GGUF byte-level BPE tokenizer encodes as its tokenizer.json", "[gguf][tokenizer]") {
    test::TempDir dir;
    for (const std::string name : {"gpt2", "phi-2"}) {
        DYNAMIC_SECTION(name) {
            const std::filesystem::path folder = tokenizers / name;
            test::write_file(dir / (name + ".gguf"), byte_level_gguf(folder, "gpt-2"));
            const auto gguf = load_tokenizer(dir / (name + ".gguf"));
            const auto hf = load_tokenizer(folder);
            CHECK(gguf->kind() == "hf-bpe-bytelevel");
            check_same_tokenizer(*gguf, *hf, corpus(true, "<|endoftext|>"));
            if (name == "phi-2") {
                // A user-defined token (a run of spaces) is matched in the text, not merged.
                const std::vector<int32_t> spaces = gguf->encode("a\t\tb");
                CHECK(spaces == hf->encode("a\t\tb"));
                CHECK(std::find(spaces.begin(), spaces.end(), 50294) != spaces.end());
            }
        }
    }
}

TEST_CASE("a GGUF tokenizer leaves its unused tokens out as its tokenizer.json has none",
          "[gguf][tokenizer]") {
    // convert_hf_to_gguf.py pads GPT-2's 50,257 tokens to the embedding's rows (here 50,304)
    // with [PADn] tokens typed unused: the tokenizer.json has no such tokens, and llama.cpp
    // prints nothing for them.
    test::TempDir dir;
    const std::filesystem::path folder = tokenizers / "gpt2";
    const auto hf = load_tokenizer(folder);
    REQUIRE(hf->vocab_size() == 50257);
    auto gguf = [&](const std::string& name, std::size_t pad_to,
                    const std::vector<std::string>& unused_ones) {
        test::write_file(dir / name, byte_level_gguf(folder, "gpt-2", pad_to, unused_ones));
        return load_tokenizer(dir / name);
    };
    const auto padded = gguf("padded.gguf", 50304, {});
    check_same_tokenizer(*padded, *hf, corpus(true, "<|endoftext|>"));
    // Tokens the merges need stay, unused or not: one a merge makes and no merge uses
    // ("Ġyesterday"), one merges use and none makes ("Ġ"); and BOS/EOS, which the metadata names.
    const std::string text = " yesterday in the garden";
    for (const std::string unused_one : {"\xC4\xA0yesterday", "\xC4\xA0", "<|endoftext|>"}) {
        INFO(unused_one);
        const auto kept = gguf("kept.gguf", 50304, {unused_one});
        CHECK(kept->vocab_size() == hf->vocab_size());
        CHECK(kept->bos_id() == hf->bos_id());
        CHECK(kept->encode(text) == hf->encode(text));
        CHECK(kept->decode(hf->encode(text)) == text);
    }
    // The fingerprint is over every token, as before they were left out (packets baked from a
    // padded GGUF then are read now): another name for a [PADn] token is another fingerprint.
    std::string renamed = byte_level_gguf(folder, "gpt-2", 50304);
    const std::string pad = "[PAD50303]";
    renamed.replace(renamed.find(pad), pad.size(), "[PAD50999]");
    test::write_file(dir / "renamed.gguf", renamed);
    const auto other = load_tokenizer(dir / "renamed.gguf");
    CHECK(other->encode(text) == padded->encode(text));
    CHECK(other->fingerprint() != padded->fingerprint());
}

// The reference is sentencepiece itself, as llama.cpp follows it: Mistral's tokenizer.json
// (Metaspace, prepend_scheme "first") differs from it on text that starts with a space.
TEST_CASE("a GGUF sentencepiece tokenizer (llama model) encodes as its tokenizer.model",
          "[gguf][tokenizer]") {
    const SentencePieces spm =
        read_sentencepiece(test::read_text(tokenizers / "mistral-7b-v0.1-spm/tokenizer.model"));
    REQUIRE(spm.pieces.size() == 32000);
    CHECK(spm.types[0] == 2);  // <unk>
    CHECK(spm.types[1] == control);
    CHECK(spm.types[3] == 6);  // <0x00>
    GgufWriter writer;
    writer.string("general.architecture", "llama")
        .string("tokenizer.ggml.model", "llama")
        .strings("tokenizer.ggml.tokens", spm.pieces)
        .f32s("tokenizer.ggml.scores", spm.scores)
        .i32s("tokenizer.ggml.token_type", spm.types)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .u32("tokenizer.ggml.unknown_token_id", 0)
        .boolean("tokenizer.ggml.add_bos_token", true)
        .boolean("tokenizer.ggml.add_eos_token", false)
        .string("tokenizer.chat_template", "{{ bos_token }}{{ messages[0]['content'] }}");
    test::TempDir dir;
    test::write_file(dir / "mistral.gguf", writer.bytes());
    const auto gguf = load_tokenizer(dir / "mistral.gguf");
    const auto spm_model = load_tokenizer(tokenizers / "mistral-7b-v0.1-spm");
    CHECK(gguf->kind() == "hf-bpe-metaspace");
    check_same_tokenizer(*gguf, *spm_model, corpus(false, ""));
    // A special token written in the text is its id (sentencepiece reads it as text), and the
    // text after it starts with a space mark again, as in llama.cpp.
    const std::vector<int32_t> after = gguf->encode("</s>Hello");
    REQUIRE(after.size() >= 2);
    CHECK(after[0] == 2);
    CHECK(std::vector<int32_t>(after.begin() + 1, after.end()) == spm_model->encode("Hello"));
}

TEST_CASE("GGUF tokenizers kvtools cannot read are refused by name", "[gguf][tokenizer]") {
    test::TempDir dir;
    auto error_of = [&](const GgufWriter& writer) -> std::string {
        test::write_file(dir / "t.gguf", writer.bytes());
        try {
            load_tokenizer(dir / "t.gguf");
        } catch (const kv::Error& error) {
            return error.what();
        }
        return "no error";
    };
    const std::string where = "'" + (dir / "t.gguf").string() + "'";
    GgufWriter none;
    none.string("general.architecture", "llama");
    CHECK(error_of(none) == where + ": no tokenizer in it (no 'tokenizer.ggml.model')");
    GgufWriter bert;
    bert.string("tokenizer.ggml.model", "bert");
    CHECK(error_of(bert) ==
          where + ": tokenizer model 'bert' is not supported (supported: llama, gpt2)");
    GgufWriter unknown_pre;
    unknown_pre.string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", "deepseek-llm")
        .strings("tokenizer.ggml.tokens", {"a", "b", "ab"})
        .strings("tokenizer.ggml.merges", {"a b"});
    CHECK(error_of(unknown_pre) ==
          where +
              ": pre-tokenizer 'deepseek-llm' (tokenizer.ggml.pre) is not supported "
              "(supported: gpt-2, phi-2, llama-bpe, llama3, qwen2, smollm, starcoder); name "
              "the model's tokenizer.json with --tokenizer");
    GgufWriter bad_types;
    bad_types.string("tokenizer.ggml.model", "llama")
        .strings("tokenizer.ggml.tokens", {"a", "b"})
        .f32s("tokenizer.ggml.scores", {0, 0})
        .i32s("tokenizer.ggml.token_type", {1});
    CHECK(error_of(bad_types) ==
          where + ": 'tokenizer.ggml.token_type' has 1 entries for 2 tokens");
    GgufWriter bad_bos;
    bad_bos.string("tokenizer.ggml.model", "llama")
        .strings("tokenizer.ggml.tokens", {"a", "b"})
        .f32s("tokenizer.ggml.scores", {0, 0})
        .u32("tokenizer.ggml.bos_token_id", 9);
    CHECK(error_of(bad_bos) ==
          where + ": 'tokenizer.ggml.bos_token_id' is 9, outside the 2 tokens");
    GgufWriter no_scores;
    no_scores.string("tokenizer.ggml.model", "llama").strings("tokenizer.ggml.tokens", {"a"});
    CHECK(error_of(no_scores) ==
          where + ": 'tokenizer.ggml.scores' must hold one score per token (1)");
}
