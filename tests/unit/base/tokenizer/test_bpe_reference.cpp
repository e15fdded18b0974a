// Byte-level BPE checked against tests/tools/ref_bpe.py, an independent Python implementation
// (hand-written pre-tokenizer patterns, GPT-2's original merge loop) that also learns the
// vocabulary and merges the C++ side loads.

#include <catch2/catch.hpp>

#include <cstdlib>
#include <random>

#include "kv/json.hpp"
#include "kv/tokenizer.hpp"
#include "test_support.hpp"

namespace {

const char* const python = "/usr/bin/python3";

std::filesystem::path reference_script() {
    return std::filesystem::path(KV_TEST_DATA_DIR) / ".." / "tools" / "ref_bpe.py";
}

std::string shell_quoted(const std::string& text) {
    std::string out = "'";
    for (char c : text) {
        if (c == '\'') {
            out += "'\\''";
        } else {
            out += c;
        }
    }
    return out + "'";
}

int run(const std::string& command) {
    INFO("command: " << command);
    return std::system(command.c_str());
}

std::vector<std::string> fixed_texts() {
    return {
        "",
        " ",
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "It's the dog's day; they're sure we've seen what I'm saying, you'll know we'd agree.",
        "IT'S THE DOG'S DAY; THEY'RE SURE WE'VE SEEN, I'M, YOU'LL, WE'D, DON'T",
        "It'S mixed 'Re 'vE 'Ll 'D case",
        "'s't're've'm'll'd ''s",
        "In 2023, 1,234,567 people paid $89.99 each -- 110 million... or 3.14159?",
        "1234567890 12 123 1234 0001 9,999,999",
        "Hello!!! What?? (a) [b] {c} <d> \"e\" 'f' `g` ~h~ @i #j $k %l ^m &n *o",
        "a\nb\n\nc\r\nd\n \ne\n\n\n",
        "\n\n\nleading newlines",
        "a  b   c    d     e",
        "  two leading spaces",
        "trailing spaces   ",
        "tabs\tand\t\ttabs \t mixed",
        "Café au lait, naïve résumé, crème brûlée, façade, Ångström, Straße, Ærøskøbing.",
        "e\xCC\x81 combining acute, a\xCC\x8A ring",
        "Привет, как дела? Всё хорошо. Ελληνικά κείμενα. עברית: العربية.",
        "日本語のテキストです。中文文本在这里。한국어 텍스트입니다.",
        "Emoji time 😀🎉👍🏽 and family 👨‍👩‍👧 and flags 🇫🇷🇯🇵.",
        "symbols ✓ ★ → ∞ ≠ ½ ² Ⅻ ٣٤٥ ௰",
        "non\xC2\xA0"
        "breaking\xE2\x80\xAF"
        "spaces\xE3\x80\x80"
        "ideographic\xE2\x80\xA8"
        "line",
        "next\xC2\x85line",
        "Email: someone@example.com, path C:\\Users\\fox, code: x = y*2 + f(z)[3]; // done",
        "<|endoftext|>",
        "a<|eot_id|>b",
        "<|eot_id|><|begin_of_text|>x<|endoftext|> y",
        "<|eot_id| partial <|eot_id|",
        "The quick brown fox jumps over the lazy dog. It's the dog's day; they're sure we've seen\n"
        "what I'm saying, and you'll know we'd agree. THE DOG'S BONE WASN'T THERE!\n",
    };
}

std::vector<std::string> random_texts(int count) {
    const std::vector<std::string> pool = {
        "a",          "b",  "Z",  "the", "dog",      "'s",       "'T",       "'re", "'",
        " ",          " ",  "  ", "\n",  "\r\n",     "\t",       "1",        "23",  "456",
        ".",          ",",  "!",  "?",   "--",       "$",        "é",        "ß",   "Å",
        "日",         "本", "한", "😀",   "👍🏽", "\xCC\x81", "\xC2\xA0", "½",   "٣",
        "<|eot_id|>", "<|", "|>", "Ω",   "я",        "ق"};
    std::mt19937 rng(2024);
    std::vector<std::string> texts;
    for (int i = 0; i < count; ++i) {
        std::string text;
        int length = static_cast<int>(rng() % 24);
        for (int j = 0; j < length; ++j)
            text += pool[rng() % pool.size()];
        texts.push_back(text);
    }
    return texts;
}

void compare_with_reference(const std::string& style) {
    kv::test::TempDir dir;
    std::string script = shell_quoted(reference_script().string());
    REQUIRE(run(std::string(python) + " " + script + " build " + shell_quoted(dir.path()) +
                " --style " + style) == 0);
    auto tokenizer = kv::load_tokenizer(dir.path());
    REQUIRE(tokenizer->kind() == "hf-bpe-bytelevel");

    std::vector<std::string> texts = fixed_texts();
    for (auto& text : random_texts(300))
        texts.push_back(std::move(text));
    kv::json::Value list = kv::json::Value::array();
    for (const auto& text : texts)
        list.push_back(text);
    kv::test::write_file(dir / "texts.json", kv::json::dump(list));
    REQUIRE(run(std::string(python) + " " + script + " encode " +
                shell_quoted(dir / "tokenizer.json") + " " + shell_quoted(dir / "texts.json") +
                " > " + shell_quoted(dir / "ids.json")) == 0);
    kv::json::Value expected = kv::json::parse(kv::test::read_text(dir / "ids.json"));
    REQUIRE(expected.size() == texts.size());

    size_t merged_tokens = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
        std::vector<int32_t> reference;
        for (const auto& id : expected[i].as_array()) {
            reference.push_back(static_cast<int32_t>(id.as_int()));
            merged_tokens += id.as_int() >= 256 && id.as_int() < 556;
        }
        INFO("style " << style << ", text " << i << ": " << kv::json::dump(texts[i]));
        auto ids = tokenizer->encode(texts[i]);
        CHECK(ids == reference);
        if (texts[i].find("<|") == std::string::npos) {
            CHECK(tokenizer->decode(ids) == texts[i]);
        }
    }
    CHECK(merged_tokens > 100);  // the learned merges are really exercised
}

}  // namespace

TEST_CASE("byte-level BPE matches the Python reference", "[tokenizer]") {
    if (!std::filesystem::exists(python)) {
        WARN("skipped: " << python << " is absent, so the Python reference cannot run");
        return;
    }
    REQUIRE(std::filesystem::exists(reference_script()));
    SECTION("GPT-2 ByteLevel pre-tokenizer with its own regex") {
        compare_with_reference("gpt2");
    }
    SECTION("Llama 3 Split regex, then ByteLevel, with ignore_merges") {
        compare_with_reference("llama3");
    }
}

TEST_CASE("the NFC normalizer matches Python's unicodedata", "[tokenizer]") {
    if (!std::filesystem::exists(python)) {
        WARN("skipped: " << python << " is absent, so the Python reference cannot run");
        return;
    }
    kv::test::TempDir dir;
    std::string script = shell_quoted(reference_script().string());
    REQUIRE(run(std::string(python) + " " + script + " build " + shell_quoted(dir.path()) +
                " --style gpt2") == 0);
    // The learned tokenizer with an NFC normalizer: decode(encode(text)) is NFC(text).
    kv::json::Value document = kv::json::parse(kv::test::read_text(dir / "tokenizer.json"));
    kv::json::Value rebuilt = kv::json::Value::object();
    for (const auto& [key, value] : document.as_object()) {
        if (key == "normalizer") {
            kv::json::Value normalizer = kv::json::Value::object();
            normalizer.set("type", "NFC");
            rebuilt.set(key, normalizer);
        } else {
            rebuilt.set(key, value);
        }
    }
    kv::test::write_file(dir / "tokenizer.json", kv::json::dump(rebuilt));
    auto tokenizer = kv::load_tokenizer(dir.path());

    // Letters, combining marks of several classes, Hangul jamo and syllables, singletons and
    // composition exclusions.
    const std::vector<std::string> pool = {"a",
                                           "e",
                                           "o",
                                           "u",
                                           "A",
                                           "E",
                                           "s",
                                           "d",
                                           " ",
                                           "\xCC\x81",
                                           "\xCC\x80",
                                           "\xCC\x88",
                                           "\xCC\xA3",
                                           "\xCC\xA7",
                                           "\xCC\x87",
                                           "\xCC\x82",
                                           "\xCD\x85",
                                           "\xE1\x84\x80",
                                           "\xE1\x85\xA1",
                                           "\xE1\x86\xA8",
                                           "\xEA\xB0\x80",
                                           "\xE2\x84\xAB",
                                           "\xE2\x84\xA6",
                                           "\xE0\xA5\x98",
                                           "\xE0\xA4\x95",
                                           "\xE0\xA4\xBC",
                                           "\xC3\xA9",
                                           "\xC3\x85",
                                           "\xE1\xBA\xA1",
                                           "\xCE\xB1",
                                           "\xCD\x82",
                                           "\xE3\x81\x8B",
                                           "\xE3\x82\x99",
                                           "\xF0\x9D\x85\x97",
                                           "\xF0\x9D\x85\xA5",
                                           "\xEF\xAC\xAB"};
    std::mt19937 rng(5);
    std::vector<std::string> texts;
    for (int i = 0; i < 500; ++i) {
        std::string text;
        int length = static_cast<int>(rng() % 12);
        for (int j = 0; j < length; ++j)
            text += pool[rng() % pool.size()];
        texts.push_back(text);
    }
    kv::json::Value list = kv::json::Value::array();
    for (const auto& text : texts)
        list.push_back(text);
    kv::test::write_file(dir / "texts.json", kv::json::dump(list));
    REQUIRE(run(std::string(python) + " " + script + " nfc " + shell_quoted(dir / "texts.json") +
                " > " + shell_quoted(dir / "nfc.json")) == 0);
    kv::json::Value expected = kv::json::parse(kv::test::read_text(dir / "nfc.json"));
    REQUIRE(expected.size() == texts.size());
    for (size_t i = 0; i < texts.size(); ++i) {
        INFO("text " << i << ": " << kv::json::dump(texts[i]));
        CHECK(tokenizer->decode(tokenizer->encode(texts[i])) == expected[i].as_string());
    }
}
