// Sentencepiece tokenizer.model files. The model is written here as a protobuf by hand (the
// trainer cannot run in this process: see lib/base/spm-module/kv_spm.h), a unigram model whose best
// segmentations are easy to work out.

#include <catch2/catch.hpp>

#include <cstring>
#include <map>

#include "kv/error.hpp"
#include "kv/tokenizer.hpp"
#include "test_support.hpp"

using kv::test::TempDir;
using Ids = std::vector<int32_t>;

namespace {

const std::string mark = "\xE2\x96\x81";  // U+2581

// Just enough of the protobuf wire format to write a ModelProto.
class ProtoWriter {
  public:
    void integer(int field, int64_t value) {
        tag(field, 0);
        varint(static_cast<uint64_t>(value));
    }
    void boolean(int field, bool value) { integer(field, value ? 1 : 0); }
    void real(int field, float value) {
        tag(field, 5);
        char bytes[4];
        std::memcpy(bytes, &value, 4);
        out_.append(bytes, 4);
    }
    void bytes(int field, std::string_view value) {
        tag(field, 2);
        varint(value.size());
        out_ += value;
    }
    const std::string& str() const { return out_; }

  private:
    void tag(int field, int wire_type) { varint(static_cast<uint64_t>(field) << 3 | wire_type); }
    void varint(uint64_t value) {
        while (value >= 0x80) {
            out_ += static_cast<char>(value | 0x80);
            value >>= 7;
        }
        out_ += static_cast<char>(value);
    }
    std::string out_;
};

enum PieceType { normal = 1, unknown = 2, control = 3, byte_piece = 6 };

struct SpmModel {
    std::vector<std::tuple<std::string, float, PieceType>> pieces;
    std::map<std::string, int32_t> ids;

    SpmModel() {
        auto add = [&](const std::string& piece, float score, PieceType type) {
            ids[piece] = static_cast<int32_t>(pieces.size());
            pieces.emplace_back(piece, score, type);
        };
        add("<unk>", 0, unknown);
        add("<s>", 0, control);
        add("</s>", 0, control);
        for (int byte = 0; byte < 256; ++byte) {
            char name[8];
            std::snprintf(name, sizeof name, "<0x%02X>", byte);
            add(name, 0, byte_piece);
        }
        add(mark, -2, normal);
        add(mark + "hello", -1, normal);
        add(mark + "world", -1, normal);
        for (const char* letter : {"h", "e", "l", "o", "w", "r", "d"})
            add(letter, -5, normal);
        add("ll", -3, normal);
    }

    std::string serialize(bool add_dummy_prefix = true) const {
        ProtoWriter model;
        for (const auto& [piece, score, type] : pieces) {
            ProtoWriter entry;
            entry.bytes(1, piece);
            entry.real(2, score);
            entry.integer(3, type);
            model.bytes(1, entry.str());
        }
        ProtoWriter trainer;
        trainer.integer(3, 1);  // model_type UNIGRAM
        trainer.integer(4, static_cast<int64_t>(pieces.size()));
        trainer.boolean(35, true);  // byte_fallback
        trainer.integer(40, 0);     // unk_id
        trainer.integer(41, 1);     // bos_id
        trainer.integer(42, 2);     // eos_id
        trainer.integer(43, -1);    // pad_id
        model.bytes(2, trainer.str());
        ProtoWriter normalizer;
        normalizer.bytes(1, "identity");
        normalizer.boolean(3, add_dummy_prefix);
        normalizer.boolean(4, false);  // remove_extra_whitespaces
        normalizer.boolean(5, true);   // escape_whitespaces
        model.bytes(3, normalizer.str());
        return model.str();
    }
};

}  // namespace

TEST_CASE("sentencepiece model encodes, decodes and names its specials", "[tokenizer]") {
    TempDir dir;
    SpmModel model;
    auto& id = model.ids;
    kv::test::write_file(dir / "tokenizer.model", model.serialize());
    auto tokenizer = kv::load_tokenizer(dir.path());
    CHECK(tokenizer->kind() == "sentencepiece");
    CHECK(tokenizer->vocab_size() == static_cast<int32_t>(model.pieces.size()));
    CHECK(tokenizer->bos_id() == 1);
    CHECK(tokenizer->eos_id() == 2);
    CHECK(tokenizer->add_bos());
    CHECK(tokenizer->strips_leading_space());
    CHECK(tokenizer->is_end_of_generation(2));
    CHECK(tokenizer->fingerprint().size() == 64);

    CHECK(tokenizer->encode("hello world") == Ids{id[mark + "hello"], id[mark + "world"]});
    CHECK(tokenizer->encode("é") == Ids{id[mark], id["<0xC3>"], id["<0xA9>"]});
    CHECK(tokenizer->token_bytes(id[mark + "hello"]) == " hello");
    CHECK(tokenizer->token_bytes(id["<0x41>"]) == "A");
    CHECK(tokenizer->token_bytes(0).empty());
    CHECK(tokenizer->token_bytes(1).empty());
    CHECK(tokenizer->decode(Ids{1, id[mark + "hello"], id[mark + "world"], 2}) == "hello world");
    for (std::string text :
         {"hello world", "  two  spaces", "日本語 😀", "tab\tnew\nline", "hello\xC3\xA9world"}) {
        INFO("text: " << text);
        CHECK(tokenizer->decode(tokenizer->encode(text)) == text);
    }

    kv::TextStreamer streamer(*tokenizer);
    std::string streamed;
    streamed += streamer.push(1);
    for (int32_t piece : tokenizer->encode("hello é world"))
        streamed += streamer.push(piece);
    streamed += streamer.finish();
    CHECK(streamed == "hello é world");
}

TEST_CASE("sentencepiece reads the configs beside the model", "[tokenizer]") {
    TempDir dir;
    SpmModel model;
    kv::test::write_file(dir / "tokenizer.model", model.serialize());
    kv::test::write_file(dir / "tokenizer_config.json", R"({"add_bos_token": false})");
    kv::test::write_file(dir / "generation_config.json", R"({"eos_token_id": [2, 5]})");
    auto tokenizer = kv::load_tokenizer(dir / "tokenizer.model");
    CHECK_FALSE(tokenizer->add_bos());
    CHECK(tokenizer->is_end_of_generation(5));
    CHECK(tokenizer->is_end_of_generation(2));

    // Without the dummy prefix nothing is stripped.
    kv::test::write_file(dir / "plain.model", model.serialize(false));
    auto plain = kv::load_tokenizer(dir / "plain.model");
    CHECK_FALSE(plain->strips_leading_space());
    CHECK(plain->decode(plain->encode("hello")) == "hello");
    CHECK(plain->encode("hello").front() != model.ids[mark + "hello"]);
}

TEST_CASE("sentencepiece refuses a file that is not a model", "[tokenizer]") {
    TempDir dir;
    kv::test::write_file(dir / "tokenizer.model", "\x0A\x05not a model at all");
    CHECK_THROWS_AS(kv::load_tokenizer(dir / "tokenizer.model"), kv::FormatError);
    CHECK_THROWS_WITH(kv::load_tokenizer(dir / "tokenizer.model"),
                      Catch::StartsWith("invalid sentencepiece model " +
                                        kv::quoted((dir / "tokenizer.model").string()) + ": "));
}
