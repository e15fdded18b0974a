#include <catch2/catch.hpp>

#include <map>
#include <thread>

#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/tokenizer.hpp"
#include "test_support.hpp"

using kv::json::Value;
using kv::test::TempDir;
using Ids = std::vector<int32_t>;

namespace {

const std::string mark = "\xE2\x96\x81";  // U+2581, the metaspace

std::string gpt2_byte_character(int byte) {
    bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) ||
                     (byte >= 0xAE && byte <= 0xFF);
    int code_point = byte;
    if (!printable) {
        code_point = 256;
        for (int b = 0; b < byte; ++b) {
            bool p = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            code_point += !p;
        }
    }
    std::string out;
    if (code_point < 0x80) {
        out += static_cast<char>(code_point);
    } else {
        out += static_cast<char>(0xC0 | (code_point >> 6));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    }
    return out;
}

Value added_token(int id, const std::string& content, bool special, bool lstrip = false,
                  bool rstrip = false) {
    Value token = Value::object();
    token.set("id", id);
    token.set("content", content);
    token.set("single_word", false);
    token.set("lstrip", lstrip);
    token.set("rstrip", rstrip);
    token.set("normalized", false);
    token.set("special", special);
    return token;
}

// A Llama 2 style tokenizer: <unk> <s> </s>, byte pieces, then pieces for "hello world".
struct MetaspaceModel {
    Value vocab = Value::object();
    Value merges = Value::array();
    std::map<std::string, int32_t> ids;

    MetaspaceModel() {
        auto add = [&](const std::string& token) {
            ids[token] = static_cast<int32_t>(vocab.size());
            vocab.set(token, static_cast<int>(vocab.size()));
        };
        for (const char* token : {"<unk>", "<s>", "</s>"})
            add(token);
        for (int byte = 0; byte < 256; ++byte) {
            char name[8];
            std::snprintf(name, sizeof name, "<0x%02X>", byte);
            add(name);
        }
        for (std::string token :
             {mark, std::string("h"), std::string("e"), std::string("l"), std::string("o"),
              std::string("w"), std::string("r"), std::string("d")}) {
            add(token);
        }
        for (auto [left, right] :
             std::vector<std::pair<std::string, std::string>>{{mark, "h"},
                                                              {"l", "l"},
                                                              {mark + "h", "e"},
                                                              {"ll", "o"},
                                                              {mark + "he", "llo"},
                                                              {mark, "w"},
                                                              {"o", "r"},
                                                              {mark + "w", "or"},
                                                              {"l", "d"},
                                                              {mark + "wor", "ld"}}) {
            add(left + right);
            merges.push_back(left + " " + right);
        }
    }

    // prepend: "legacy" (Prepend + Replace normalizers) or "first"/"always" (Metaspace).
    std::string json(const std::string& prepend, bool byte_fallback = true, bool fuse_unk = true,
                     bool with_unk = true) const {
        Value root = Value::object();
        root.set("version", "1.0");
        Value& added = root.set("added_tokens", Value::array());
        added.push_back(added_token(0, "<unk>", true));
        added.push_back(added_token(1, "<s>", true));
        added.push_back(added_token(2, "</s>", true));
        if (prepend == "legacy") {
            Value& normalizer = root.set("normalizer", Value::object());
            normalizer.set("type", "Sequence");
            Value& steps = normalizer.set("normalizers", Value::array());
            Value& first = steps.push_back(Value::object());
            first.set("type", "Prepend");
            first.set("prepend", mark);
            Value& second = steps.push_back(Value::object());
            second.set("type", "Replace");
            second.set("pattern", Value::object()).set("String", " ");
            second.set("content", mark);
            root.set("pre_tokenizer", nullptr);
        } else {
            root.set("normalizer", nullptr);
            Value& pre = root.set("pre_tokenizer", Value::object());
            pre.set("type", "Metaspace");
            pre.set("replacement", mark);
            pre.set("prepend_scheme", prepend);
            pre.set("split", false);
        }
        Value& model = root.set("model", Value::object());
        model.set("type", "BPE");
        model.set("dropout", nullptr);
        model.set("unk_token", with_unk ? Value("<unk>") : Value());
        model.set("fuse_unk", fuse_unk);
        model.set("byte_fallback", byte_fallback);
        model.set("vocab", vocab);
        model.set("merges", merges);
        return kv::json::dump(root, 2);
    }
};

// A byte-level model whose vocabulary is the 256 byte characters, "Ġh", "Ġhi" and added tokens.
std::string byte_level_json(const std::string& pre_tokenizer_type = "ByteLevel",
                            const std::string& normalizer_type = "") {
    Value root = Value::object();
    Value vocab = Value::object();
    for (int byte = 0; byte < 256; ++byte)
        vocab.set(gpt2_byte_character(byte), byte);
    vocab.set("\xC4\xA0h", 256);
    vocab.set("\xC4\xA0hi", 257);
    Value& added = root.set("added_tokens", Value::array());
    added.push_back(added_token(258, "<|begin_of_text|>", true));
    added.push_back(added_token(259, "<|eot_id|>", true, true, false));
    added.push_back(added_token(260, "<|end_of_text|>", true));
    added.push_back(added_token(261, "<think>", false));
    added.push_back(added_token(262, "<|eot_id|>x", true));
    if (normalizer_type.empty()) {
        root.set("normalizer", nullptr);
    } else {
        root.set("normalizer", Value::object()).set("type", normalizer_type);
    }
    Value& pre = root.set("pre_tokenizer", Value::object());
    pre.set("type", pre_tokenizer_type);
    pre.set("add_prefix_space", false);
    pre.set("use_regex", true);
    if (pre_tokenizer_type != "ByteLevel") pre.set("pretokenizers", Value::array());
    Value& model = root.set("model", Value::object());
    model.set("type", "BPE");
    model.set("vocab", vocab);
    Value& merges = model.set("merges", Value::array());
    Value pair = Value::array();
    pair.push_back("\xC4\xA0");
    pair.push_back("h");
    merges.push_back(pair);
    merges.push_back("\xC4\xA0h i");
    return kv::json::dump(root);
}

std::string message_of_load(const std::filesystem::path& path) {
    try {
        kv::load_tokenizer(path);
    } catch (const kv::Error& error) {
        return error.what();
    }
    return "no error";
}

}  // namespace

TEST_CASE("metaspace BPE with Prepend and Replace normalizers (Llama 2 legacy)", "[tokenizer]") {
    TempDir dir;
    MetaspaceModel model;
    kv::test::write_file(dir / "tokenizer.json", model.json("legacy"));
    auto tokenizer = kv::load_tokenizer(dir.path());
    auto& id = model.ids;
    CHECK(tokenizer->kind() == "hf-bpe-metaspace");
    CHECK(tokenizer->strips_leading_space());
    CHECK(tokenizer->vocab_size() == static_cast<int32_t>(model.vocab.size()));
    CHECK(tokenizer->encode("") == Ids{});
    CHECK(tokenizer->encode("hello world") == Ids{id[mark + "hello"], id[mark + "world"]});
    CHECK(tokenizer->encode("hello  world") ==
          Ids{id[mark + "hello"], id[mark], id[mark + "world"]});
    CHECK(tokenizer->encode("é") == Ids{id[mark], id["<0xC3>"], id["<0xA9>"]});
    // Normalizers run on every stretch between added tokens, so "hello" gets its mark again.
    CHECK(tokenizer->encode("<s>hello</s>") == Ids{1, id[mark + "hello"], 2});
    CHECK(tokenizer->decode(tokenizer->encode("hello world é")) == "hello world é");
    CHECK(tokenizer->decode(Ids{1, id[mark + "hello"]}) == "hello");
    CHECK(tokenizer->token_bytes(id["<0xC3>"]) == "\xC3");
    CHECK(tokenizer->token_bytes(id[mark + "world"]) == " world");
    CHECK(tokenizer->token_bytes(1).empty());
    CHECK(tokenizer->token_bytes(0).empty());
    // No configs: BOS and EOS are unknown, and end tokens are only the ones found by name.
    CHECK(tokenizer->bos_id() == -1);
    CHECK_FALSE(tokenizer->add_bos());
}

TEST_CASE("metaspace BPE with a Metaspace pre-tokenizer", "[tokenizer]") {
    TempDir dir;
    MetaspaceModel model;
    auto& id = model.ids;
    SECTION("prepend_scheme first: only the text's start gets a mark") {
        kv::test::write_file(dir / "tokenizer.json", model.json("first"));
        auto tokenizer = kv::load_tokenizer(dir / "tokenizer.json");
        CHECK(tokenizer->encode("hello") == Ids{id[mark + "hello"]});
        CHECK(tokenizer->encode("<s>hello") == Ids{1, id["h"], id["e"], id["llo"]});
        CHECK(tokenizer->encode(" hello") == Ids{id[mark + "hello"]});
        CHECK(tokenizer->strips_leading_space());
    }
    SECTION("prepend_scheme always") {
        kv::test::write_file(dir / "tokenizer.json", model.json("always"));
        auto tokenizer = kv::load_tokenizer(dir / "tokenizer.json");
        CHECK(tokenizer->encode("<s>hello") == Ids{1, id[mark + "hello"]});
    }
    SECTION("prepend_scheme never") {
        kv::test::write_file(dir / "tokenizer.json", model.json("never"));
        auto tokenizer = kv::load_tokenizer(dir / "tokenizer.json");
        CHECK(tokenizer->encode("hello") == Ids{id["h"], id["e"], id["llo"]});
        CHECK_FALSE(tokenizer->strips_leading_space());
    }
    SECTION("unknown characters become <unk>, fused or not, without byte fallback") {
        kv::test::write_file(dir / "tokenizer.json", model.json("first", false, true));
        auto fused = kv::load_tokenizer(dir / "tokenizer.json");
        CHECK(fused->encode("ééhé") == Ids{id[mark], 0, id["h"], 0});
        kv::test::write_file(dir / "tokenizer.json", model.json("first", false, false));
        auto unfused = kv::load_tokenizer(dir / "tokenizer.json");
        CHECK(unfused->encode("ééh") == Ids{id[mark], 0, 0, id["h"]});
        kv::test::write_file(dir / "tokenizer.json", model.json("first", false, false, false));
        auto dropping = kv::load_tokenizer(dir / "tokenizer.json");
        CHECK(dropping->encode("éhé") == Ids{id[mark + "h"]});  // dropped, so ▁ and h merge
    }
    SECTION("invalid UTF-8 falls back to byte tokens") {
        kv::test::write_file(dir / "tokenizer.json", model.json("first"));
        auto tokenizer = kv::load_tokenizer(dir / "tokenizer.json");
        CHECK(tokenizer->encode("h\xFF") == Ids{id[mark + "h"], id["<0xFF>"]});
        CHECK(tokenizer->decode(tokenizer->encode("he\xC3llo")) == "he\xC3llo");
    }
}

TEST_CASE("byte-level BPE splits added tokens before pre-tokenizing", "[tokenizer]") {
    TempDir dir;
    kv::test::write_file(dir / "tokenizer.json", byte_level_json());
    auto tokenizer = kv::load_tokenizer(dir / "tokenizer.json");
    auto byte = [](char c) { return static_cast<int32_t>(static_cast<unsigned char>(c)); };
    CHECK(tokenizer->kind() == "hf-bpe-bytelevel");
    CHECK_FALSE(tokenizer->strips_leading_space());
    CHECK(tokenizer->vocab_size() == 263);
    CHECK(tokenizer->encode("hi hi") == Ids{byte('h'), byte('i'), 257});
    CHECK(tokenizer->encode(" h") == Ids{256});
    // <|eot_id|> takes the space before it (lstrip); the longer <|eot_id|>x wins where it fits.
    CHECK(tokenizer->encode("a <|eot_id|> b") == Ids{byte('a'), 259, byte(' '), byte('b')});
    CHECK(tokenizer->encode("<|eot_id|>x") == Ids{262});
    CHECK(tokenizer->encode("<|begin_of_text|><think>") == Ids{258, 261});
    CHECK(tokenizer->encode("<|eot_id") == Ids{byte('<'), byte('|'), byte('e'), byte('o'),
                                               byte('t'), byte('_'), byte('i'), byte('d')});
    CHECK(tokenizer->token_bytes(259).empty());
    CHECK(tokenizer->token_bytes(261) == "<think>");
    CHECK(tokenizer->token_bytes(257) == " hi");
    CHECK(tokenizer->token_bytes(byte(' ')) == " ");
    CHECK(tokenizer->token_bytes(byte('\n')) == "\n");
    // Every byte round-trips, valid UTF-8 or not.
    std::string all_bytes;
    for (int b = 1; b < 256; ++b)
        all_bytes += static_cast<char>(b);
    CHECK(tokenizer->decode(tokenizer->encode(all_bytes)) == all_bytes);
    std::string text = "日本語 😀 hi\n\n\t  x";
    CHECK(tokenizer->decode(tokenizer->encode(text)) == text);
    // End tokens found by name when no config lists them.
    CHECK(tokenizer->is_end_of_generation(259));
    CHECK(tokenizer->is_end_of_generation(260));
    CHECK(tokenizer->eos_id() == 259);
}

TEST_CASE("byte-level BPE reads BOS, EOS and end tokens from the configs", "[tokenizer]") {
    TempDir dir;
    kv::test::write_file(dir / "tokenizer.json", byte_level_json());
    SECTION("tokenizer_config.json and generation_config.json") {
        kv::test::write_file(dir / "tokenizer_config.json",
                             R"({"bos_token": "<|begin_of_text|>", "add_bos_token": true,
                                 "eos_token": {"content": "<|end_of_text|>", "lstrip": false}})");
        kv::test::write_file(dir / "generation_config.json", R"({"eos_token_id": [260, 259]})");
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->bos_id() == 258);
        CHECK(tokenizer->eos_id() == 260);
        CHECK(tokenizer->add_bos());
        CHECK(tokenizer->is_end_of_generation(259));
        CHECK(tokenizer->is_end_of_generation(260));
        CHECK_FALSE(tokenizer->is_end_of_generation(258));
    }
    SECTION("config.json ids") {
        kv::test::write_file(dir / "config.json", R"({"bos_token_id": 258, "eos_token_id": 260})");
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->bos_id() == 258);
        CHECK(tokenizer->eos_id() == 260);
        CHECK_FALSE(tokenizer->add_bos());
    }
    SECTION("the post-processor's template") {
        Value root = kv::json::parse(byte_level_json());
        std::string text = kv::json::dump(root);
        std::string processor = R"("post_processor":{"type":"Sequence","processors":[
            {"type":"ByteLevel"},{"type":"TemplateProcessing",
             "single":[{"SpecialToken":{"id":"<|begin_of_text|>","type_id":0}},
                       {"Sequence":{"id":"A","type_id":0}}],
             "special_tokens":{"<|begin_of_text|>":{"id":"<|begin_of_text|>","ids":[258],
                                                     "tokens":["<|begin_of_text|>"]}}}]},)";
        text.insert(1, processor);
        kv::test::write_file(dir / "tokenizer.json", text);
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->bos_id() == 258);
        CHECK(tokenizer->add_bos());
        // encode() still adds nothing.
        CHECK(tokenizer->encode("hi") == Ids{'h', 'i'});
    }
    SECTION("configs change the fingerprint, file names do not") {
        auto plain = kv::load_tokenizer(dir.path());
        kv::test::write_file(dir / "tokenizer_config.json", R"({"add_bos_token": false})");
        auto same = kv::load_tokenizer(dir.path());
        CHECK(plain->fingerprint() == same->fingerprint());
        CHECK(plain->fingerprint().size() == 64);
        kv::test::write_file(dir / "tokenizer_config.json",
                             R"({"bos_token": "<|begin_of_text|>", "add_bos_token": true})");
        auto with_bos = kv::load_tokenizer(dir.path());
        CHECK(with_bos->fingerprint() != plain->fingerprint());
    }
}

TEST_CASE("byte-level BPE applies NFC when the normalizer asks", "[tokenizer]") {
    TempDir dir;
    kv::test::write_file(dir / "tokenizer.json", byte_level_json("ByteLevel", "NFC"));
    auto tokenizer = kv::load_tokenizer(dir / "tokenizer.json");
    auto decode_encode = [&](const std::string& text) {
        return tokenizer->decode(tokenizer->encode(text));
    };
    CHECK(decode_encode("e\xCC\x81") == "\xC3\xA9");                      // e + U+0301 -> é
    CHECK(decode_encode("\xE1\x84\x80\xE1\x85\xA1") == "\xEA\xB0\x80");   // jamo -> 가
    CHECK(decode_encode("\xE2\x84\xAB") == "\xC3\x85");                   // Angstrom sign -> Å
    CHECK(decode_encode("a\xCC\xA3\xCC\x87") == "\xE1\xBA\xA1\xCC\x87");  // ạ + dot above
    CHECK(decode_encode("plain ascii") == "plain ascii");
    CHECK(decode_encode("x\xFF\xCC\x81") == "x\xFF\xCC\x81");  // stray bytes pass
}

TEST_CASE("tokenizer.json problems are typed errors naming the file", "[tokenizer]") {
    TempDir dir;
    auto path = dir / "tokenizer.json";
    std::string where = kv::quoted(path.string());

    kv::test::write_file(path, R"({"model": {"type": "WordPiece", "vocab": {}}})");
    CHECK_THROWS_AS(kv::load_tokenizer(path), kv::UnsupportedError);
    CHECK(message_of_load(path) == "unsupported model type 'WordPiece' in " + where);

    kv::test::write_file(path, R"({"model": {"type": "Unigram", "vocab": []}})");
    CHECK(message_of_load(path) == "unsupported model type 'Unigram' in " + where);

    Value with_bert = kv::json::parse(byte_level_json());
    std::string text = kv::json::dump(with_bert);
    text.replace(text.find(R"("normalizer":null)"), 17,
                 R"("normalizer":{"type":"BertNormalizer"})");
    kv::test::write_file(path, text);
    CHECK(message_of_load(path) == "unsupported normalizer 'BertNormalizer' in " + where);

    text = kv::json::dump(with_bert);
    text.replace(text.find(R"("type":"ByteLevel")"), 18, R"("type":"Whitespace")");
    kv::test::write_file(path, text);
    CHECK(message_of_load(path) == "unsupported pre_tokenizer 'Whitespace' in " + where);

    kv::test::write_file(path, "{\"model\": ");
    CHECK_THROWS_AS(kv::load_tokenizer(path), kv::FormatError);
    CHECK(message_of_load(path) ==
          where + ": invalid JSON at line 1 column 11: unexpected end of input, expected a value");

    kv::test::write_file(path, R"({"version": "1.0"})");
    CHECK(message_of_load(path) == "invalid tokenizer " + where + ": missing key 'model'");

    kv::test::write_file(path, R"({"pre_tokenizer": {"type": "ByteLevel"},
                  "model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})");
    CHECK(message_of_load(path) ==
          "invalid tokenizer " + where +
              ": merge 0 'a b' uses a token that is not in the vocabulary");

    kv::test::write_file(path,
                         R"({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(unclosed"},
                  "behavior": "Isolated"}, "model": {"type": "BPE", "vocab": {}, "merges": []}})");
    CHECK_THROWS_AS(kv::load_tokenizer(path), kv::UnsupportedError);

    kv::test::write_file(path,
                         R"({"model": {"type": "BPE", "vocab": {"a": "zero"}, "merges": []}})");
    CHECK(message_of_load(path) ==
          "invalid tokenizer " + where + ": expected an integer, got a string");
}

TEST_CASE("load_tokenizer finds files and reports missing ones", "[tokenizer]") {
    TempDir dir;
    CHECK(message_of_load(dir.path()) ==
          "no tokenizer.json or tokenizer.model in " + kv::quoted(dir.path().string()));
    CHECK_THROWS_AS(kv::load_tokenizer(dir.path()), kv::IoError);
    CHECK(message_of_load(dir / "absent.json") == "cannot read " +
                                                      kv::quoted((dir / "absent.json").string()) +
                                                      ": No such file or directory");

    // Without a telling extension, JSON content is recognised.
    kv::test::write_file(dir / "vocab-file", byte_level_json());
    CHECK(kv::load_tokenizer(dir / "vocab-file")->kind() == "hf-bpe-bytelevel");

    // A broken config beside the tokenizer is named in the error.
    kv::test::write_file(dir / "tokenizer.json", byte_level_json());
    kv::test::write_file(dir / "config.json", "{");
    CHECK(message_of_load(dir.path()) == kv::quoted((dir / "config.json").string()) +
                                             ": invalid JSON at line 1 column 2: unexpected end "
                                             "of input, expected a string key");
}

TEST_CASE("byte-level BPE encodes from several threads at once", "[tokenizer]") {
    TempDir dir;
    kv::test::write_file(dir / "tokenizer.json", byte_level_json());
    auto tokenizer = kv::load_tokenizer(dir / "tokenizer.json");
    std::vector<std::string> texts;
    for (int i = 0; i < 200; ++i) {
        texts.push_back("hi " + std::to_string(i) + " hi<|eot_id|>  h" + std::string(i % 7, 'x'));
    }
    std::vector<Ids> expected;
    for (const auto& text : texts)
        expected.push_back(tokenizer->encode(text));
    std::vector<int> failures(4, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            for (int round = 0; round < 20; ++round) {
                for (size_t i = 0; i < texts.size(); ++i) {
                    failures[t] += tokenizer->encode(texts[(i + t * 13) % texts.size()]) !=
                                   expected[(i + t * 13) % texts.size()];
                }
            }
        });
    }
    for (auto& thread : threads)
        thread.join();
    CHECK(failures == std::vector<int>(4, 0));
}

// Found by the conformance suite (tests/tokenizers): kvtools had no notion of what
// add_special_tokens=True puts around a text beyond a BOS (Whisper's template adds two start
// tokens and EOS after the text).
TEST_CASE("the special tokens around a text follow the post-processor's template", "[tokenizer]") {
    TempDir dir;
    Value root = kv::json::parse(byte_level_json());
    Value processor = kv::json::parse(R"({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                   {"SpecialToken": {"id": "<think>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [258],
                                                 "tokens": ["<|begin_of_text|>"]},
                           "<|end_of_text|>": {"id": "<|end_of_text|>", "ids": [260],
                                               "tokens": ["<|end_of_text|>"]}}})");
    SECTION("a template with two tokens before the text and one after") {
        root.set("post_processor", processor);
        kv::test::write_file(dir / "tokenizer.json", kv::json::dump(root));
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->special_prefix() == Ids{258, 261});
        CHECK(tokenizer->special_suffix() == Ids{260});
        CHECK(tokenizer->encode_with_special_tokens("hi") == Ids{258, 261, 'h', 'i', 260});
        CHECK(tokenizer->encode("hi") == Ids{'h', 'i'});
        CHECK(tokenizer->bos_id() == 258);
        CHECK(tokenizer->add_bos());
    }
    SECTION("the same inside a Sequence, and a fingerprint of its own") {
        kv::test::write_file(dir / "tokenizer.json", kv::json::dump(root));
        auto plain = kv::load_tokenizer(dir.path());
        CHECK(plain->special_prefix().empty());
        CHECK(plain->special_suffix().empty());
        CHECK(plain->encode_with_special_tokens("hi") == Ids{'h', 'i'});
        Value sequence = kv::json::parse(R"({"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": false}]})");
        sequence.set("processors", Value::array()).push_back(processor);
        root.set("post_processor", sequence);
        kv::test::write_file(dir / "tokenizer.json", kv::json::dump(root));
        auto templated = kv::load_tokenizer(dir.path());
        CHECK(templated->encode_with_special_tokens("hi") == Ids{258, 261, 'h', 'i', 260});
        CHECK(templated->fingerprint() != plain->fingerprint());
    }
    SECTION("a tokenizer class other than Llama's ignores add_bos_token, as transformers does") {
        kv::test::write_file(dir / "tokenizer.json", kv::json::dump(root));
        kv::test::write_file(dir / "tokenizer_config.json",
                             R"({"bos_token": "<|begin_of_text|>", "add_bos_token": true,
                                 "tokenizer_class": "PreTrainedTokenizerFast"})");
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->add_bos());  // kvtools' prompts still start with it
        CHECK(tokenizer->special_prefix().empty());
    }
}

TEST_CASE("Llama-style tokenizer classes take BOS and EOS from add_bos_token and add_eos_token",
          "[tokenizer]") {
    TempDir dir;
    MetaspaceModel model;
    kv::test::write_file(dir / "tokenizer.json", model.json("first"));  // no post-processor
    auto& id = model.ids;
    SECTION("add_bos_token defaults to true, add_eos_token to false") {
        kv::test::write_file(dir / "tokenizer_config.json",
                             R"({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                 "eos_token": "</s>"})");
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->encode_with_special_tokens("hello") == Ids{1, id[mark + "hello"]});
    }
    SECTION("EOS after the text, no BOS") {
        kv::test::write_file(dir / "tokenizer_config.json",
                             R"({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>",
                                 "eos_token": "</s>", "add_bos_token": false,
                                 "add_eos_token": true})");
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->encode_with_special_tokens("hello") == Ids{id[mark + "hello"], 2});
        CHECK_FALSE(tokenizer->add_bos());
    }
}

// Found by the conformance suite: decode() dropped the leading space of the piece after every
// BOS, as llama2.c does, where Hugging Face (skip_special_tokens=True) and sentencepiece only
// drop the one at the start of the text ("a<s>b" decodes to "a b" with Mistral's tokenizer).
TEST_CASE("a BOS inside the ids does not start the text again", "[tokenizer]") {
    TempDir dir;
    MetaspaceModel model;
    auto& id = model.ids;
    for (std::string prepend : {"legacy", "first"}) {
        INFO(prepend);
        kv::test::write_file(dir / "tokenizer.json", model.json(prepend));
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->decode(Ids{1, id[mark + "hello"], 1, id[mark + "world"]}) ==
              "hello world");
        CHECK(tokenizer->decode(Ids{id[mark + "hello"], 1, id[mark + "world"]}) == "hello world");
        CHECK(tokenizer->decode(Ids{1, 2, id[mark + "hello"]}) == "hello");
    }
}

// Found by the conformance suite with Gemma 3's tokenizer: added tokens that are not special
// were written as their content, where the tokenizers library passes them through the decoder
// like any token (Gemma's "▁▁" decodes to two spaces).
TEST_CASE("added tokens that are not special decode through the decoder", "[tokenizer]") {
    TempDir dir;
    SECTION("metaspace") {
        MetaspaceModel model;
        Value root = kv::json::parse(model.json("first"));
        const int32_t next = static_cast<int32_t>(model.vocab.size());
        Value added = root.at("added_tokens");
        added.push_back(added_token(next, mark + mark, false));
        added.push_back(added_token(next + 1, "<0x41>", false));
        root.set("added_tokens", added);
        kv::test::write_file(dir / "tokenizer.json", kv::json::dump(root));
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->token_bytes(next) == "  ");
        CHECK(tokenizer->token_bytes(next + 1) == "A");  // ByteFallback reads it as a byte
        CHECK(tokenizer->decode(Ids{model.ids[mark + "hello"], next, model.ids["w"]}) ==
              "hello  w");
    }
    SECTION("byte-level: every character maps back to its byte, or the token stays as it is") {
        Value root = kv::json::parse(byte_level_json());
        Value added = root.at("added_tokens");
        added.push_back(added_token(263, "\xC4\xA0x", false));   // "Ġx"
        added.push_back(added_token(264, "  ", false));          // spaces: not in the alphabet
        added.push_back(added_token(265, "\xC4\xA0 x", false));  // "Ġ x": kept whole
        added.push_back(added_token(266, "\xC4\xA0y", true));    // special: never written
        root.set("added_tokens", added);
        kv::test::write_file(dir / "tokenizer.json", kv::json::dump(root));
        auto tokenizer = kv::load_tokenizer(dir.path());
        CHECK(tokenizer->token_bytes(263) == " x");
        CHECK(tokenizer->token_bytes(264) == "  ");
        CHECK(tokenizer->token_bytes(265) == "\xC4\xA0 x");
        CHECK(tokenizer->token_bytes(266) == "");
        CHECK(tokenizer->token_bytes(261) == "<think>");
    }
}
