// llama2.c tokenizer files (tok*.bin), encoding exactly as karpathy/llama2.c run.c does.
//
// File layout: int32 max_token_length, then until the end of the file one record per token:
// float32 score, int32 byte length, the bytes. Ids 0, 1, 2 are <unk>, <s>, </s>; ids 3 to 258
// are the byte-fallback pieces <0x00> to <0xFF>.

#include <cmath>
#include <cstring>
#include <optional>
#include <unordered_map>

#include "kv/error.hpp"
#include "loaders.hpp"
#include "pair_merges.hpp"

namespace kv::tokenizer_detail {

namespace {

struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};

// "<0xNN>" pieces stand for one raw byte.
int byte_of_piece(std::string_view piece) {
    if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
    auto hex = [](char c) {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
    };
    int high = hex(piece[3]);
    int low = hex(piece[4]);
    return high < 0 || low < 0 ? -1 : high * 16 + low;
}

class Llama2cTokenizer final : public Tokenizer {
  public:
    Llama2cTokenizer(const std::filesystem::path& path, std::string_view bytes) : path_(path) {
        kind_ = "llama2c";
        auto fail = [&](const std::string& what) {
            throw FormatError("invalid llama2.c tokenizer " + kv::quoted(path.string()) + ": " +
                              what);
        };
        auto read_int32 = [&](size_t at) {
            int32_t value;
            std::memcpy(&value, bytes.data() + at, 4);
            return value;
        };
        if (bytes.size() < 4) fail("shorter than its 4-byte header");
        int32_t max_token_length = read_int32(0);
        if (max_token_length <= 0) {
            fail("max token length " + std::to_string(max_token_length) + " is not positive");
        }
        size_t at = 4;
        while (at < bytes.size()) {
            if (bytes.size() - at < 8) fail("truncated at token " + std::to_string(pieces_.size()));
            float score;
            std::memcpy(&score, bytes.data() + at, 4);
            int32_t length = read_int32(at + 4);
            at += 8;
            if (length < 0 || static_cast<size_t>(length) > bytes.size() - at) {
                fail("token " + std::to_string(pieces_.size()) + " has length " +
                     std::to_string(length) + " beyond the end of the file");
            }
            pieces_.emplace_back(bytes.substr(at, static_cast<size_t>(length)));
            scores_.push_back(score);
            at += static_cast<size_t>(length);
        }
        if (pieces_.size() < 3) {
            fail("has " + std::to_string(pieces_.size()) +
                 " tokens, fewer than <unk>, <s> and </s>");
        }
        if (pieces_.size() > INT32_MAX) fail("has too many tokens");
        // run.c looks pieces up as C strings, so a piece ends at its first NUL byte. Of equal
        // pieces the lowest id wins (run.c's binary search has no defined choice).
        for (size_t id = 0; id < pieces_.size(); ++id) {
            std::string key = pieces_[id].substr(0, pieces_[id].find('\0'));
            id_of_piece_.emplace(std::move(key), static_cast<int32_t>(id));
        }
        bos_id_ = 1;
        eos_id_ = 2;
        add_bos_ = true;
        special_prefix_ = {bos_id_};
        strips_leading_space_ = true;
        strips_space_after_every_bos_ = true;
        add_end_of_generation(1);  // run.c ends a story when the model starts the next one
        add_end_of_generation(2);
        set_fingerprint(bytes);
    }

    int32_t vocab_size() const override { return static_cast<int32_t>(pieces_.size()); }

    std::string token_bytes(int32_t id) const override {
        check_id(id);
        if (id <= 2) return "";  // <unk>, <s>, </s>
        const std::string& piece = pieces_[static_cast<size_t>(id)];
        int byte = byte_of_piece(piece);
        if (byte >= 0) return std::string(1, static_cast<char>(byte));
        return piece;
    }

    std::vector<int32_t> encode(std::string_view text) const override {
        std::vector<int32_t> ids;
        if (text.empty()) return ids;
        ids.reserve(text.size() + 1);
        ids.push_back(lookup_or_fail(" ", "the dummy prefix ' '"));
        append_code_point_ids(text, ids);
        merge_pairs(ids);
        return ids;
    }

  private:
    int32_t lookup(std::string_view piece) const {
        auto it = id_of_piece_.find(piece);
        return it == id_of_piece_.end() ? -1 : it->second;
    }

    // A piece as run.c's string functions see it: up to its first NUL byte.
    std::string_view c_string(int32_t id) const {
        std::string_view piece = pieces_[static_cast<size_t>(id)];
        return piece.substr(0, piece.find('\0'));
    }

    int32_t lookup_or_fail(std::string_view piece, const std::string& what) const {
        int32_t id = lookup(piece);
        if (id < 0) {
            throw FormatError("llama2.c tokenizer " + kv::quoted(path_.string()) +
                              " has no token for " + what);
        }
        return id;
    }

    // One id per UTF-8 character found in the vocabulary, else one byte-fallback id per byte.
    // Grouping follows run.c: a character is a non-continuation byte and at most three more
    // continuation bytes, whatever their validity.
    void append_code_point_ids(std::string_view text, std::vector<int32_t>& ids) const {
        auto is_continuation = [](char c) {
            return (static_cast<unsigned char>(c) & 0xC0) == 0x80;
        };
        size_t i = 0;
        while (i < text.size()) {
            size_t length = 1;
            while (i + length < text.size() && is_continuation(text[i + length]) && length < 4) {
                ++length;
            }
            std::string_view character = text.substr(i, length);
            // A NUL ends the text for run.c; here it is just another byte.
            int32_t id = character.find('\0') == std::string_view::npos ? lookup(character) : -1;
            if (id >= 0) {
                ids.push_back(id);
            } else {
                for (char byte : character) {
                    int32_t byte_id = static_cast<unsigned char>(byte) + 3;
                    if (byte_id >= vocab_size()) {
                        throw FormatError("llama2.c tokenizer " + kv::quoted(path_.string()) +
                                          " has no byte-fallback tokens");
                    }
                    ids.push_back(byte_id);
                }
            }
            i += length;
        }
    }

    // run.c merges, over and over, the adjacent pair whose concatenation is the best-scoring
    // token (the leftmost on a tie). The same choice comes out of a heap of candidate pairs over
    // a linked list, in O(n log n) instead of O(n^2) per text.
    void merge_pairs(std::vector<int32_t>& ids) const {
        std::string joined;
        tokenizer_detail::merge_pairs<float>(ids, [&](int32_t left, int32_t right) {
            std::optional<tokenizer_detail::PairMerge<float>> merge;
            joined = c_string(left);
            joined += c_string(right);
            const int32_t merged = lookup(joined);
            // run.c starts its search at -1e10, so pieces scored at or below never merge.
            if (merged >= 0 && scores_[static_cast<size_t>(merged)] > -1e10f)
                merge = tokenizer_detail::PairMerge<float>{scores_[static_cast<size_t>(merged)],
                                                           merged};
            return merge;
        });
    }

    std::filesystem::path path_;
    std::vector<std::string> pieces_;
    std::vector<float> scores_;
    std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> id_of_piece_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_llama2c(const std::filesystem::path& path, std::string bytes) {
    return std::make_unique<Llama2cTokenizer>(path, bytes);
}

}  // namespace kv::tokenizer_detail
