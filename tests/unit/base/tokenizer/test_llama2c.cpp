#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <map>
#include <random>

#include "kv/error.hpp"
#include "kv/tokenizer.hpp"
#include "test_support.hpp"

using kv::test::TempDir;

namespace {

struct Piece {
    std::string text;
    float score;
};

std::string llama2c_file(const std::vector<Piece>& pieces, int32_t max_token_length = 16) {
    std::string bytes(reinterpret_cast<const char*>(&max_token_length), 4);
    for (const Piece& piece : pieces) {
        auto length = static_cast<int32_t>(piece.text.size());
        bytes.append(reinterpret_cast<const char*>(&piece.score), 4);
        bytes.append(reinterpret_cast<const char*>(&length), 4);
        bytes += piece.text;
    }
    return bytes;
}

// <unk>, <s>, </s>, the 256 byte pieces, then the given pieces.
std::vector<Piece> vocabulary_with(const std::vector<Piece>& extra) {
    std::vector<Piece> pieces = {{"<unk>", 0}, {"\n<s>\n", 0}, {"\n</s>\n", 0}};
    for (int byte = 0; byte < 256; ++byte) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", byte);
        pieces.push_back({name, 0});
    }
    pieces.insert(pieces.end(), extra.begin(), extra.end());
    return pieces;
}

// run.c's encode(text, bos=0, eos=0) written out plainly: quadratic, and the reference.
std::vector<int32_t> reference_encode(const std::vector<Piece>& pieces, const std::string& text) {
    std::map<std::string, int32_t> ids;
    for (size_t i = 0; i < pieces.size(); ++i) {
        ids.emplace(pieces[i].text, static_cast<int32_t>(i));
    }
    auto lookup = [&](const std::string& s) {
        auto it = ids.find(s);
        return it == ids.end() ? -1 : it->second;
    };
    std::vector<int32_t> tokens;
    if (text.empty()) return tokens;
    tokens.push_back(lookup(" "));
    for (size_t i = 0; i < text.size();) {
        size_t length = 1;
        while (i + length < text.size() && (text[i + length] & 0xC0) == 0x80 && length < 4) {
            ++length;
        }
        int32_t id = lookup(text.substr(i, length));
        if (id >= 0) {
            tokens.push_back(id);
        } else {
            for (size_t j = 0; j < length; ++j) {
                tokens.push_back(static_cast<unsigned char>(text[i + j]) + 3);
            }
        }
        i += length;
    }
    while (true) {
        float best_score = -1e10f;
        int32_t best_id = -1;
        size_t best_index = 0;
        for (size_t i = 0; i + 1 < tokens.size(); ++i) {
            int32_t id = lookup(pieces[tokens[i]].text + pieces[tokens[i + 1]].text);
            if (id >= 0 && pieces[id].score > best_score) {
                best_score = pieces[id].score;
                best_id = id;
                best_index = i;
            }
        }
        if (best_id < 0) break;
        tokens[best_index] = best_id;
        tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_index) + 1);
    }
    return tokens;
}

std::vector<Piece> read_pieces(const std::filesystem::path& path) {
    std::string bytes = kv::test::read_text(path);
    std::vector<Piece> pieces;
    for (size_t at = 4; at + 8 <= bytes.size();) {
        Piece piece;
        int32_t length;
        std::memcpy(&piece.score, bytes.data() + at, 4);
        std::memcpy(&length, bytes.data() + at + 4, 4);
        piece.text = bytes.substr(at + 8, static_cast<size_t>(length));
        pieces.push_back(piece);
        at += 8 + static_cast<size_t>(length);
    }
    return pieces;
}

std::string random_text(std::mt19937& rng, const std::vector<std::string>& words, int count) {
    std::string text;
    for (int i = 0; i < count; ++i) {
        text += words[rng() % words.size()];
        if (rng() % 3 == 0) text += ' ';
    }
    return text;
}

const std::vector<std::string> mixed_words = {
    "Tom",  "and",  "his",      "dog",  " ",     "  ",  "went", "to", "the",  "big", "lake",
    ".",    ",",    "\n",       "ab",   "abc",   "bca", "caab", "é",  "日本", "😀",   "\xFF",
    "\x80", "\xC3", "\xE2\x82", "Lily", "happy", "'s",  "!",    "1",  "23",   "\t"};

std::filesystem::path tok512() {
    return kv::test::shared_models_dir() / "stories260K" / "tok512.bin";
}

}  // namespace

TEST_CASE("llama2c merges the best-scoring pair first, the leftmost on a tie", "[tokenizer]") {
    TempDir dir;
    auto pieces = vocabulary_with({{" ", -1},
                                   {"a", -2},
                                   {"b", -2},
                                   {"c", -2},
                                   {"ab", 5},
                                   {"bc", 5},
                                   {"abc", 7},
                                   {" a", 1},
                                   {"ca", 6}});
    kv::test::write_file(dir / "tok.bin", llama2c_file(pieces));
    auto tokenizer = kv::load_tokenizer(dir / "tok.bin");
    auto id = [&](const std::string& text) {
        for (size_t i = 0; i < pieces.size(); ++i) {
            if (pieces[i].text == text) return static_cast<int32_t>(i);
        }
        return -1;
    };
    CHECK(tokenizer->kind() == "llama2c");
    CHECK(tokenizer->vocab_size() == static_cast<int32_t>(pieces.size()));
    CHECK(tokenizer->encode("").empty());
    // " abc": " a"(1) ab(5) bc(5) tie -> ab; then "abc"(7).
    CHECK(tokenizer->encode("abc") == std::vector<int32_t>{id(" "), id("abc")});
    // "bca": bc(5) ca(6) -> ca first, leaving b.
    CHECK(tokenizer->encode("bca") == std::vector<int32_t>{id(" "), id("b"), id("ca")});
    // Unknown characters fall back to their bytes: 'é' is C3 A9.
    CHECK(tokenizer->encode("é") == std::vector<int32_t>{id(" "), 0xC3 + 3, 0xA9 + 3});

    std::mt19937 rng(7);
    for (int trial = 0; trial < 300; ++trial) {
        std::string text = random_text(rng, mixed_words, static_cast<int>(rng() % 20));
        INFO("text: " << text);
        CHECK(tokenizer->encode(text) == reference_encode(pieces, text));
    }
}

TEST_CASE("llama2c decodes bytes, specials and the leading space", "[tokenizer]") {
    TempDir dir;
    auto pieces = vocabulary_with({{" ", -1}, {"h", -1}, {"i", -1}, {" hi", 3}, {"hi", 2}});
    kv::test::write_file(dir / "tok.bin", llama2c_file(pieces));
    auto tokenizer = kv::load_tokenizer(dir / "tok.bin");
    CHECK(tokenizer->bos_id() == 1);
    CHECK(tokenizer->eos_id() == 2);
    CHECK(tokenizer->add_bos());
    CHECK(tokenizer->strips_leading_space());
    CHECK(tokenizer->is_end_of_generation(1));
    CHECK(tokenizer->is_end_of_generation(2));
    CHECK_FALSE(tokenizer->is_end_of_generation(3));
    CHECK(tokenizer->token_bytes(1).empty());
    CHECK(tokenizer->token_bytes(0x41 + 3) == "A");
    CHECK(tokenizer->token_bytes(0x00 + 3) == std::string(1, '\0'));
    CHECK_THROWS_AS(tokenizer->token_bytes(-1), kv::FormatError);
    CHECK_THROWS_AS(tokenizer->token_bytes(tokenizer->vocab_size()), kv::FormatError);

    auto ids = tokenizer->encode("hi hi");
    CHECK(tokenizer->decode(ids) == "hi hi");
    std::vector<int32_t> with_bos = {1};
    with_bos.insert(with_bos.end(), ids.begin(), ids.end());
    CHECK(tokenizer->decode(with_bos) == "hi hi");
    for (std::string text : {"é", "日本語 and emoji 😀", "\x01\x02 tab\t",
                             "a\xFF"
                             "b"}) {
        CHECK(tokenizer->decode(tokenizer->encode(text)) == text);
    }
}

TEST_CASE("llama2c refuses malformed files", "[tokenizer]") {
    TempDir dir;
    auto message_of = [&](const std::string& bytes) {
        kv::test::write_file(dir / "bad.bin", bytes);
        try {
            kv::load_tokenizer(dir / "bad.bin");
        } catch (const kv::FormatError& error) {
            return std::string(error.what());
        }
        return std::string("no error");
    };
    std::string where = "invalid llama2.c tokenizer " + kv::quoted((dir / "bad.bin").string());
    CHECK(message_of("ab") == where + ": shorter than its 4-byte header");
    CHECK(message_of(llama2c_file({}, 0)) == where + ": max token length 0 is not positive");
    std::string good = llama2c_file(vocabulary_with({{" ", 0}}));
    CHECK(message_of(good.substr(0, good.size() - 1)) ==
          where + ": token 259 has length 1 beyond the end of the file");
    CHECK(message_of(good + "abc") == where + ": truncated at token 260");
    CHECK(message_of(llama2c_file({{"<unk>", 0}})) ==
          where + ": has 1 tokens, fewer than <unk>, <s> and </s>");

    // Too small for byte fallback, and no " " for the dummy prefix: errors, not bad ids.
    kv::test::write_file(dir / "small.bin", llama2c_file({{"<unk>", 0}, {"<s>", 0}, {"</s>", 0}}));
    auto small = kv::load_tokenizer(dir / "small.bin");
    CHECK_THROWS_WITH(small->encode("x"), Catch::Contains("no token for the dummy prefix"));
    CHECK(small->encode("").empty());
}

TEST_CASE("llama2c encodes long texts in linear-looking time", "[tokenizer]") {
    TempDir dir;
    auto pieces = vocabulary_with(
        {{" ", -1}, {"a", -1}, {"b", -1}, {"ab", 1}, {"ba", 2}, {"abab", 3}, {" a", 0}});
    kv::test::write_file(dir / "tok.bin", llama2c_file(pieces));
    auto tokenizer = kv::load_tokenizer(dir / "tok.bin");
    std::string text;
    for (int i = 0; i < 100'000; ++i)
        text += "ab"[i % 3 == 0];
    auto start = std::chrono::steady_clock::now();
    auto ids = tokenizer->encode(text);
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(seconds < 2.0);  // run.c's loop takes minutes here
    CHECK(tokenizer->decode(ids) == text);
    std::string shorter = text.substr(0, 700);
    CHECK(tokenizer->encode(shorter) == reference_encode(pieces, shorter));
}

TEST_CASE("llama2c tok512 matches run.c", "[tokenizer][model]") {
    if (!std::filesystem::exists(tok512())) {
        WARN("skipped: " << tok512() << " is absent");
        return;
    }
    auto tokenizer = kv::load_tokenizer(tok512());
    CHECK(tokenizer->vocab_size() == 512);
    std::vector<int32_t> ids = {tokenizer->bos_id()};
    for (int32_t id : tokenizer->encode("Tom and his dog went to the big lake"))
        ids.push_back(id);
    CHECK(ids == std::vector<int32_t>{1, 274, 287, 269, 345, 400, 428, 263, 377, 267, 265, 370, 278,
                                      412, 354});
    CHECK(tokenizer->decode(ids) == "Tom and his dog went to the big lake");

    auto pieces = read_pieces(tok512());
    REQUIRE(pieces.size() == 512);
    std::mt19937 rng(11);
    for (int trial = 0; trial < 200; ++trial) {
        std::string text = random_text(rng, mixed_words, static_cast<int>(rng() % 40));
        INFO("text: " << text);
        auto encoded = tokenizer->encode(text);
        CHECK(encoded == reference_encode(pieces, text));
        CHECK(tokenizer->decode(encoded) == text);
    }

    std::string story;
    while (story.size() < 100'000)
        story += "Once upon a time, Lily saw a big red ball. ";
    auto start = std::chrono::steady_clock::now();
    auto story_ids = tokenizer->encode(story);
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(seconds < 1.0);
    CHECK(tokenizer->decode(story_ids) == story);
}

TEST_CASE("text streamer holds back partial characters", "[tokenizer]") {
    TempDir dir;
    auto pieces = vocabulary_with({{" ", -1}, {"h", -1}, {"i", -1}, {" hi", 3}});
    kv::test::write_file(dir / "tok.bin", llama2c_file(pieces));
    auto tokenizer = kv::load_tokenizer(dir / "tok.bin");
    kv::TextStreamer streamer(*tokenizer);
    int32_t hi = static_cast<int32_t>(pieces.size()) - 1;
    CHECK(streamer.push(1).empty());
    CHECK(streamer.push(hi) == "hi");  // the leading space after BOS goes
    CHECK(streamer.push(hi) == " hi");
    CHECK(streamer.push(0xE6 + 3).empty());  // 日 is E6 97 A5
    CHECK(streamer.push(0x97 + 3).empty());
    CHECK(streamer.push(0xA5 + 3) == "日");
    CHECK(streamer.push(0xFF + 3) == "\xEF\xBF\xBD");  // never valid: replaced at once
    CHECK(streamer.push(0xC3 + 3).empty());
    CHECK(streamer.push(0x41 + 3) ==
          "\xEF\xBF\xBD"
          "A");  // C3 then A cannot be one character
    CHECK(streamer.push(0xF0 + 3).empty());
    CHECK(streamer.finish() == "\xEF\xBF\xBD");
    CHECK(streamer.finish().empty());
    CHECK(streamer.push(2).empty());
}
