// Hugging Face tokenizer.json files with a BPE model, encoding as the tokenizers library does:
// split off added tokens, normalize, pre-tokenize into words, then merge each word by rank.
//
// Two families are covered: byte-level models (GPT-2, Llama 3, Qwen), whose ByteLevel
// pre-tokenizer maps every byte to a printable character before BPE, and sentencepiece-style
// models (Llama 2, Mistral), which mark spaces with U+2581 and fall back to <0xNN> byte tokens.

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "../utf8.hpp"
#include "kv/error.hpp"
#include "loaders.hpp"
#include "pair_merges.hpp"
#include "unicode.hpp"

namespace kv::tokenizer_detail {

namespace {

namespace fs = std::filesystem;
using json::Value;

constexpr std::string_view metaspace = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK
constexpr std::string_view gpt2_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Word cache entries kept per tokenizer; like the tokenizers library, it stops filling when full.
constexpr size_t word_cache_capacity = 100'000;

struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
template <typename T>
using StringMap = std::unordered_map<std::string, T, StringHash, std::equal_to<>>;

// GPT-2's reversible byte-to-character table: printable Latin-1 bytes stand for themselves, the
// rest are shifted to U+0100 and up, so that BPE never sees a space or a control character.
struct ByteLevelAlphabet {
    std::array<std::string, 256> character_of_byte;
    std::unordered_map<uint32_t, uint8_t> byte_of_code_point;

    ByteLevelAlphabet() {
        uint32_t shifted = 256;
        for (uint32_t byte = 0; byte < 256; ++byte) {
            bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) ||
                             (byte >= 0xAE && byte <= 0xFF);
            uint32_t code_point = printable ? byte : shifted++;
            utf8::append(character_of_byte[byte], code_point);
            byte_of_code_point[code_point] = static_cast<uint8_t>(byte);
        }
    }

    static const ByteLevelAlphabet& get() {
        static const ByteLevelAlphabet alphabet;
        return alphabet;
    }
};

struct FreeJitStack {
    void operator()(pcre2_jit_stack* stack) const { pcre2_jit_stack_free(stack); }
};

// A compiled PCRE2 pattern with Unicode properties; shareable between threads.
class Regex {
  public:
    Regex(const std::string& pattern, const std::string& where) {
        int error = 0;
        PCRE2_SIZE offset = 0;
        code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
        if (!code_) {
            PCRE2_UCHAR message[256];
            pcre2_get_error_message(error, message, sizeof message);
            throw UnsupportedError("unsupported regex " + kv::quoted(pattern) + " in " + where +
                                   ": " + reinterpret_cast<const char*>(message) + " at offset " +
                                   std::to_string(offset));
        }
        pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // the interpreter remains if JIT fails
    }
    Regex(const Regex&) = delete;
    Regex& operator=(const Regex&) = delete;
    ~Regex() { pcre2_code_free(code_); }

    /// Byte ranges of the successive matches in text, which must be valid UTF-8. An empty match
    /// moves the search on by one character, as the tokenizers library's find_iter does.
    std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const {
        // Long runs of spaces make patterns like \s+(?!\S) backtrack deeply; each thread gets a
        // JIT stack that can grow well past PCRE2's 32 KiB default.
        thread_local std::unique_ptr<pcre2_jit_stack, FreeJitStack> jit_stack(
            pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr));
        std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> context(
            pcre2_match_context_create(nullptr), &pcre2_match_context_free);
        std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
            pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
        if (!context || !match) throw Error("out of memory for a regex match");
        if (jit_stack) pcre2_jit_stack_assign(context.get(), nullptr, jit_stack.get());

        std::vector<std::pair<size_t, size_t>> matches;
        auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
        size_t offset = 0;
        while (offset <= text.size()) {
            int rc = pcre2_match(code_, subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                                 match.get(), context.get());
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc < 0) {
                PCRE2_UCHAR message[256];
                pcre2_get_error_message(rc, message, sizeof message);
                throw Error(std::string("pre-tokenizer regex failed: ") +
                            reinterpret_cast<const char*>(message));
            }
            PCRE2_SIZE* range = pcre2_get_ovector_pointer(match.get());
            matches.emplace_back(range[0], range[1]);
            if (range[1] > range[0]) {
                offset = range[1];
            } else if (range[1] < text.size()) {
                offset = range[1] + utf8::valid_length(text, range[1]);
            } else {
                break;
            }
        }
        return matches;
    }

  private:
    pcre2_code* code_ = nullptr;
};

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// A stretch of text on its way through normalization and pre-tokenization.
struct Piece {
    std::string text;
    bool at_text_start = false;  // begins at offset 0 of the input (Metaspace's "first" scheme)
    bool opaque = false;         // one byte of invalid UTF-8: passes every split unchanged
};

// Splits piece at the matches as the tokenizers library's NormalizedString::split does.
void split_piece(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                 SplitBehavior behavior, bool invert, std::vector<Piece>& out) {
    // (start, end, is_match) over the whole piece, gaps included.
    struct Range {
        size_t start, end;
        bool is_match;
    };
    std::vector<Range> ranges;
    size_t previous = 0;
    for (auto [start, end] : matches) {
        if (previous != start) ranges.push_back({previous, start, invert});
        ranges.push_back({start, end, !invert});
        previous = end;
    }
    if (previous != piece.text.size()) ranges.push_back({previous, piece.text.size(), invert});

    std::vector<Range> kept;
    bool previous_match = false;
    switch (behavior) {
        case SplitBehavior::isolated:
            kept = ranges;
            break;
        case SplitBehavior::removed:
            for (const Range& range : ranges) {
                if (!range.is_match) kept.push_back(range);
            }
            break;
        case SplitBehavior::contiguous:
            for (const Range& range : ranges) {
                if (!kept.empty() && range.is_match == previous_match) {
                    kept.back().end = range.end;
                } else {
                    kept.push_back(range);
                }
                previous_match = range.is_match;
            }
            break;
        case SplitBehavior::merged_with_previous:
            for (const Range& range : ranges) {
                if (range.is_match && !previous_match && !kept.empty()) {
                    kept.back().end = range.end;
                } else {
                    kept.push_back(range);
                }
                previous_match = range.is_match;
            }
            break;
        case SplitBehavior::merged_with_next:
            for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
                if (it->is_match && !previous_match && !kept.empty()) {
                    kept.back().start = it->start;
                } else {
                    kept.push_back(*it);
                }
                previous_match = it->is_match;
            }
            std::reverse(kept.begin(), kept.end());
            break;
    }
    for (const Range& range : kept) {
        if (range.start == range.end) continue;
        out.push_back({piece.text.substr(range.start, range.end - range.start),
                       piece.at_text_start && range.start == 0, false});
    }
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
    if (from.empty()) return std::string(text);
    std::string out;
    size_t at = 0;
    for (size_t found; (found = text.find(from, at)) != std::string_view::npos;
         at = found + from.size()) {
        out.append(text, at, found - at);
        out += to;
    }
    out.append(text, at);
    return out;
}

bool is_ascii_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

struct NormalizerStep {
    enum class Kind { prepend, replace, nfc, strip } kind;
    std::string text;                  // prepend: what; replace: the pattern
    std::string replacement;           // replace: with what
    bool left = false, right = false;  // strip
};

struct PreTokenizerStep {
    enum class Kind { split, byte_level, metaspace } kind;
    std::shared_ptr<Regex> regex;  // split and byte_level with use_regex
    std::string literal;           // split on a plain string
    SplitBehavior behavior = SplitBehavior::isolated;
    bool invert = false;
    bool add_prefix_space = false;  // byte_level
    std::string replacement;        // metaspace
    enum class Prepend { always, first, never } prepend = Prepend::always;
    bool split = true;  // metaspace
};

struct AddedToken {
    std::string content;
    int32_t id;
    bool special, lstrip, rstrip, single_word;
};

// The pieces of the input text: runs of plain text and added tokens found in it.
struct Segment {
    size_t start, end;
    int32_t added_id;  // -1 for plain text
};

class HfBpeTokenizer final : public Tokenizer {
  public:
    HfBpeTokenizer(const fs::path& path, std::string_view bytes, const ModelConfigs& configs,
                   std::string_view fingerprint_bytes)
        : where_(kv::quoted(path.string())) {
        Value root;
        try {
            root = json::parse(bytes);
        } catch (const FormatError& error) {
            throw FormatError(where_ + ": " + error.what());
        }
        try {
            if (!root.is_object()) malformed("expected an object at the top level");
            // Counted before anything is checked: load_model reports a vocabulary of the wrong
            // kind with its own message.
            auto entries = [](const Value* value) -> int64_t {
                if (!value) return 0;
                if (value->is_object()) return static_cast<int64_t>(value->as_object().size());
                if (value->is_array()) return static_cast<int64_t>(value->as_array().size());
                return 0;
            };
            const Value* model = root.find("model");
            declared_tokens_ =
                entries(model && model->is_object() ? model->find("vocab") : nullptr) +
                entries(root.find("added_tokens"));
            id_limit_ = std::min<int64_t>(INT32_MAX, 4 * declared_tokens_ + 1024);
            load_model(root.at("model"));
            load_added_tokens(root.find("added_tokens"));
            load_normalizer(root.find("normalizer"));
            load_pre_tokenizer(root.find("pre_tokenizer"));
            decide_kind(root.find("decoder"));
            build_token_bytes();
            resolve_special_tokens(root.find("post_processor"), configs);
        } catch (const FormatError& error) {
            // Both the file's own problems and the JSON accessors' type errors land here.
            throw FormatError("invalid tokenizer " + where_ + ": " + error.what());
        }
        set_fingerprint(fingerprint_bytes.empty() ? bytes : fingerprint_bytes);
    }

    int32_t vocab_size() const override { return static_cast<int32_t>(token_bytes_.size()); }

    std::string token_bytes(int32_t id) const override {
        check_id(id);
        return token_bytes_[static_cast<size_t>(id)];
    }

    std::vector<int32_t> encode(std::string_view text) const override {
        std::vector<int32_t> ids;
        for (const Segment& segment : split_added_tokens(text)) {
            if (segment.added_id >= 0) {
                ids.push_back(segment.added_id);
            } else {
                encode_text(text.substr(segment.start, segment.end - segment.start),
                            segment.start == 0, ids);
            }
        }
        return ids;
    }

  private:
    // Thrown while loading; the constructor adds "invalid tokenizer 'path': ".
    [[noreturn]] static void malformed(const std::string& what) { throw FormatError(what); }
    [[noreturn]] void unsupported(const std::string& what) const {
        throw UnsupportedError("unsupported " + what + " in " + where_);
    }

    static const std::string& type_of(const Value& component) {
        static const std::string none;
        const Value* type = component.find("type");
        return type && type->is_string() ? type->as_string() : none;
    }

    static bool flag(const Value& object, std::string_view key, bool fallback) {
        const Value* value = object.find(key);
        return value && value->is_bool() ? value->as_bool() : fallback;
    }

    static std::string string_field(const Value& object, std::string_view key) {
        const Value* value = object.find(key);
        return value && value->is_string() ? value->as_string() : "";
    }

    // ---- loading ----

    void set_token(const std::string& token, int64_t id) {
        // Ids are dense in real files; a bound proportional to the number of tokens keeps a
        // corrupt id from sizing the tables (found by fuzzing: one id of 2e9 asked for 64 GB).
        if (id < 0 || id >= id_limit_) {
            malformed("token id " + std::to_string(id) + " of " + kv::quoted(token) +
                      " is out of range (the file has " + std::to_string(declared_tokens_) +
                      " tokens; ids must lie below " + std::to_string(id_limit_) + ")");
        }
        if (static_cast<size_t>(id) >= id_to_token_.size()) {
            id_to_token_.resize(static_cast<size_t>(id) + 1);
            has_token_.resize(static_cast<size_t>(id) + 1, false);
        }
        id_to_token_[static_cast<size_t>(id)] = token;
        has_token_[static_cast<size_t>(id)] = true;
    }

    int32_t vocab_id(std::string_view token) const {
        auto it = vocab_.find(token);
        return it == vocab_.end() ? -1 : it->second;
    }

    void load_model(const Value& model) {
        std::string type = type_of(model);
        if (type.empty() && model.find("merges")) type = "BPE";  // files older than the field
        if (type != "BPE") unsupported("model type " + kv::quoted(type.empty() ? "?" : type));
        for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
            if (!string_field(model, key).empty()) unsupported(std::string("BPE ") + key);
        }
        const auto& vocab = model.at("vocab").as_object();
        vocab_.reserve(vocab.size());
        for (const auto& [token, id] : vocab) {
            int64_t value = id.as_int();
            set_token(token, value);
            vocab_.insert_or_assign(token, static_cast<int32_t>(value));
        }
        byte_fallback_ = flag(model, "byte_fallback", false);
        fuse_unk_ = flag(model, "fuse_unk", false);
        ignore_merges_ = flag(model, "ignore_merges", false);
        std::string unk = string_field(model, "unk_token");
        if (!unk.empty()) {
            unk_id_ = vocab_id(unk);
            if (unk_id_ < 0)
                malformed("unk_token " + kv::quoted(unk) + " is not in the vocabulary");
        }

        const auto& merges = model.at("merges").as_array();
        merges_.reserve(merges.size());
        std::string joined;
        for (size_t rank = 0; rank < merges.size(); ++rank) {
            const Value& merge = merges[rank];
            std::string_view left, right;
            if (merge.is_string()) {
                std::string_view text = merge.as_string();
                size_t space = text.find(' ');
                if (space == std::string_view::npos) {
                    malformed("merge " + std::to_string(rank) + " " +
                              kv::quoted(std::string(text)) + " is not two tokens");
                }
                left = text.substr(0, space);
                right = text.substr(space + 1);
            } else if (merge.is_array() && merge.size() == 2) {
                left = merge[0].as_string();
                right = merge[1].as_string();
            } else {
                malformed("merge " + std::to_string(rank) +
                          " is neither \"a b\" nor [\"a\", \"b\"]");
            }
            joined.assign(left);
            joined += right;
            int32_t left_id = vocab_id(left), right_id = vocab_id(right);
            int32_t merged_id = vocab_id(joined);
            if (left_id < 0 || right_id < 0 || merged_id < 0) {
                malformed("merge " + std::to_string(rank) + " " +
                          kv::quoted(std::string(left) + " " + std::string(right)) +
                          " uses a token that is not in the vocabulary");
            }
            // A repeated merge takes its last rank, as in the tokenizers library.
            merges_.insert_or_assign(pair_key(left_id, right_id),
                                     Merge{static_cast<int32_t>(rank), merged_id});
        }
    }

    static uint64_t pair_key(int32_t left, int32_t right) {
        return static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32 |
               static_cast<uint32_t>(right);
    }

    void load_added_tokens(const Value* added_tokens) {
        if (!added_tokens || added_tokens->is_null()) return;
        for (const Value& entry : added_tokens->as_array()) {
            const int64_t id = entry.at("id").as_int();
            set_token(entry.at("content").as_string(), id);  // checks the range first
            AddedToken token{entry.at("content").as_string(), static_cast<int32_t>(id),
                             flag(entry, "special", false),   flag(entry, "lstrip", false),
                             flag(entry, "rstrip", false),    flag(entry, "single_word", false)};
            if (token.content.empty()) continue;
            added_lengths_.push_back(token.content.size());
            added_first_bytes_[static_cast<unsigned char>(token.content[0])] = true;
            added_by_content_.insert_or_assign(token.content, added_tokens_.size());
            added_tokens_.push_back(std::move(token));
        }
        std::sort(added_lengths_.begin(), added_lengths_.end(), std::greater<>());
        added_lengths_.erase(std::unique(added_lengths_.begin(), added_lengths_.end()),
                             added_lengths_.end());
    }

    void load_normalizer(const Value* normalizer) {
        if (!normalizer || normalizer->is_null()) return;
        const std::string& type = type_of(*normalizer);
        if (type == "Sequence") {
            for (const Value& step : normalizer->at("normalizers").as_array()) {
                load_normalizer(&step);
            }
        } else if (type == "Prepend") {
            normalizers_.push_back({NormalizerStep::Kind::prepend,
                                    normalizer->at("prepend").as_string(), "", false, false});
        } else if (type == "Replace") {
            const Value& pattern = normalizer->at("pattern");
            const Value* literal = pattern.find("String");
            if (!literal) unsupported("Replace normalizer with a regex pattern");
            normalizers_.push_back({NormalizerStep::Kind::replace, literal->as_string(),
                                    normalizer->at("content").as_string(), false, false});
        } else if (type == "NFC") {
            normalizers_.push_back({NormalizerStep::Kind::nfc, "", "", false, false});
        } else if (type == "Strip") {
            normalizers_.push_back({NormalizerStep::Kind::strip, "", "",
                                    flag(*normalizer, "strip_left", true),
                                    flag(*normalizer, "strip_right", true)});
        } else {
            unsupported("normalizer " + kv::quoted(type.empty() ? "?" : type));
        }
    }

    SplitBehavior split_behavior(const Value& split) const {
        std::string behavior = string_field(split, "behavior");
        if (behavior == "Isolated") return SplitBehavior::isolated;
        if (behavior == "Removed") return SplitBehavior::removed;
        if (behavior == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
        if (behavior == "MergedWithNext") return SplitBehavior::merged_with_next;
        if (behavior == "Contiguous") return SplitBehavior::contiguous;
        unsupported("Split behavior " + kv::quoted(behavior));
    }

    void load_pre_tokenizer(const Value* pre_tokenizer) {
        if (!pre_tokenizer || pre_tokenizer->is_null()) return;
        const std::string& type = type_of(*pre_tokenizer);
        PreTokenizerStep step{};
        if (type == "Sequence") {
            for (const Value& inner : pre_tokenizer->at("pretokenizers").as_array()) {
                load_pre_tokenizer(&inner);
            }
            return;
        } else if (type == "Split") {
            step.kind = PreTokenizerStep::Kind::split;
            const Value& pattern = pre_tokenizer->at("pattern");
            if (const Value* regex = pattern.find("Regex")) {
                step.regex = std::make_shared<Regex>(regex->as_string(), where_);
            } else {
                step.literal = pattern.at("String").as_string();
            }
            step.behavior = split_behavior(*pre_tokenizer);
            step.invert = flag(*pre_tokenizer, "invert", false);
        } else if (type == "ByteLevel") {
            step.kind = PreTokenizerStep::Kind::byte_level;
            step.add_prefix_space = flag(*pre_tokenizer, "add_prefix_space", true);
            if (flag(*pre_tokenizer, "use_regex", true)) {
                step.regex = std::make_shared<Regex>(std::string(gpt2_pattern), where_);
            }
        } else if (type == "Metaspace") {
            step.kind = PreTokenizerStep::Kind::metaspace;
            step.replacement = string_field(*pre_tokenizer, "replacement");
            if (step.replacement.empty()) step.replacement = metaspace;
            std::string scheme = string_field(*pre_tokenizer, "prepend_scheme");
            if (scheme.empty()) {
                bool add_prefix_space = flag(*pre_tokenizer, "add_prefix_space", true);
                scheme = add_prefix_space ? "always" : "never";
            }
            if (scheme == "always") {
                step.prepend = PreTokenizerStep::Prepend::always;
            } else if (scheme == "first") {
                step.prepend = PreTokenizerStep::Prepend::first;
            } else if (scheme == "never") {
                step.prepend = PreTokenizerStep::Prepend::never;
            } else {
                unsupported("Metaspace prepend_scheme " + kv::quoted(scheme));
            }
            step.split = flag(*pre_tokenizer, "split", true);
        } else if (type == "Digits") {
            step.kind = PreTokenizerStep::Kind::split;
            step.regex = std::make_shared<Regex>(R"(\p{N})", where_);
            step.behavior = flag(*pre_tokenizer, "individual_digits", false)
                                ? SplitBehavior::isolated
                                : SplitBehavior::contiguous;
        } else {
            unsupported("pre_tokenizer " + kv::quoted(type.empty() ? "?" : type));
        }
        pre_tokenizers_.push_back(std::move(step));
    }

    void decide_kind(const Value* decoder) {
        bool byte_level = false, metaspace_prefix = false, metaspace_marks = false;
        for (const PreTokenizerStep& step : pre_tokenizers_) {
            if (step.kind == PreTokenizerStep::Kind::byte_level) byte_level = true;
            if (step.kind == PreTokenizerStep::Kind::metaspace) {
                metaspace_marks = true;
                metaspace_prefix |= step.prepend != PreTokenizerStep::Prepend::never;
            }
        }
        for (const NormalizerStep& step : normalizers_) {
            if (step.kind == NormalizerStep::Kind::prepend && step.text == metaspace) {
                metaspace_prefix = true;
            }
            if (step.kind == NormalizerStep::Kind::replace && step.replacement == metaspace) {
                metaspace_marks = true;
            }
        }
        if (byte_level && metaspace_marks) unsupported("mix of ByteLevel and Metaspace");
        if (byte_level) {
            kind_ = "hf-bpe-bytelevel";
        } else if (metaspace_marks) {
            kind_ = "hf-bpe-metaspace";
            strips_leading_space_ = metaspace_prefix;
        } else {
            std::string decoder_type = decoder ? type_of(*decoder) : "";
            unsupported("BPE tokenizer without a ByteLevel or Metaspace pre-tokenizer (decoder " +
                        kv::quoted(decoder_type.empty() ? "none" : decoder_type) + ")");
        }
    }

    void build_token_bytes() {
        token_bytes_.resize(id_to_token_.size());
        for (size_t id = 0; id < id_to_token_.size(); ++id) {
            if (has_token_[id]) token_bytes_[id] = decoded_bytes(id_to_token_[id]);
        }
        // Special added tokens are not written at all; the others go through the decoder like
        // any token, as in the tokenizers library (Gemma's "▁▁" is two spaces).
        for (const AddedToken& token : added_tokens_) {
            token_bytes_[static_cast<size_t>(token.id)] =
                token.special ? "" : decoded_bytes(token.content);
        }
        if (unk_id_ >= 0) token_bytes_[static_cast<size_t>(unk_id_)] = "";
    }

    // What the decoder makes of one token: ByteLevel maps each character back to its byte and
    // keeps the token as it is when one is outside the byte alphabet; the sentencepiece-style
    // decoders turn <0xNN> into its byte (with byte fallback) and metaspaces into spaces.
    std::string decoded_bytes(const std::string& token) const {
        if (kind_ != "hf-bpe-bytelevel") {
            int byte = byte_fallback_ ? byte_of_piece(token) : -1;
            return byte >= 0 ? std::string(1, static_cast<char>(byte))
                             : replace_all(token, metaspace, " ");
        }
        const auto& alphabet = ByteLevelAlphabet::get();
        std::string bytes;
        auto* p = reinterpret_cast<const unsigned char*>(token.data());
        auto* end = p + token.size();
        while (p < end) {
            size_t length = utf8::valid_length(p, end);
            auto it = length ? alphabet.byte_of_code_point.find(utf8::decode(p, length))
                             : alphabet.byte_of_code_point.end();
            if (it == alphabet.byte_of_code_point.end()) return token;
            bytes += static_cast<char>(it->second);
            p += length;
        }
        return bytes;
    }

    static int byte_of_piece(std::string_view piece) {
        if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
        auto hex = [](char c) {
            if (c >= '0' && c <= '9') return c - '0';
            if (c >= 'A' && c <= 'F') return c - 'A' + 10;
            if (c >= 'a' && c <= 'f') return c - 'a' + 10;
            return -1;
        };
        int high = hex(piece[3]), low = hex(piece[4]);
        return high < 0 || low < 0 ? -1 : high * 16 + low;
    }

    int32_t token_id(const std::string& content) const {
        if (content.empty()) return -1;
        auto added = added_by_content_.find(content);
        if (added != added_by_content_.end()) return added_tokens_[added->second].id;
        return vocab_id(content);
    }

    // BOS, EOS and add_bos from tokenizer_config.json, else the post-processor's template, else
    // config.json and generation_config.json; every listed EOS ends a generation.
    void resolve_special_tokens(const Value* post_processor, const ModelConfigs& configs) {
        const std::optional<Template> processing = single_template(post_processor);
        const int32_t template_bos =
            processing && !processing->prefix.empty() ? processing->prefix.front() : -1;
        const Value* tokenizer_config =
            configs.tokenizer_config ? &*configs.tokenizer_config : nullptr;
        const Value* model_config = configs.model_config ? &*configs.model_config : nullptr;
        const Value* generation = configs.generation_config ? &*configs.generation_config : nullptr;
        auto config_ids = [](const Value* config, const char* key) {
            return config ? config_token_ids(config->find(key)) : std::vector<int32_t>{};
        };
        auto valid = [&](int32_t id) { return id >= 0 && id < vocab_size() ? id : -1; };

        if (tokenizer_config) {
            bos_id_ = token_id(special_token_content(tokenizer_config->find("bos_token")));
            eos_id_ = token_id(special_token_content(tokenizer_config->find("eos_token")));
        }
        if (bos_id_ < 0) bos_id_ = template_bos;
        for (const Value* config : {model_config, generation}) {
            auto bos = config_ids(config, "bos_token_id");
            if (bos_id_ < 0 && !bos.empty()) bos_id_ = valid(bos.front());
            auto eos = config_ids(config, "eos_token_id");
            if (eos_id_ < 0 && !eos.empty()) eos_id_ = valid(eos.front());
        }

        const Value* add_bos = tokenizer_config ? tokenizer_config->find("add_bos_token") : nullptr;
        add_bos_ = add_bos && add_bos->is_bool() ? add_bos->as_bool() : template_bos >= 0;
        if (add_bos_ && bos_id_ < 0) add_bos_ = false;

        // What add_special_tokens=True adds: the template, except that transformers rebuilds it
        // for Llama-style tokenizers from add_bos_token (default true) and add_eos_token
        // (default false).
        const std::string tokenizer_class =
            tokenizer_config ? string_field(*tokenizer_config, "tokenizer_class") : "";
        if (is_llama_style_class(tokenizer_class)) {
            auto config_flag = [&](const char* key, bool fallback) {
                const Value* value = tokenizer_config->find(key);
                return value && value->is_bool() ? value->as_bool() : fallback;
            };
            if (config_flag("add_bos_token", true) && bos_id_ >= 0) special_prefix_ = {bos_id_};
            if (config_flag("add_eos_token", false) && eos_id_ >= 0) special_suffix_ = {eos_id_};
        } else if (processing) {
            special_prefix_ = processing->prefix;
            special_suffix_ = processing->suffix;
        }

        add_end_of_generation(eos_id_);
        for (const Value* config : {model_config, generation}) {
            for (int32_t id : config_ids(config, "eos_token_id"))
                add_end_of_generation(valid(id));
        }
        // Chat models end turns with tokens of their own that configs do not always list.
        for (const char* name : {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>",
                                 "<|endoftext|>", "<|end|>", "<end_of_turn>"}) {
            auto it = added_by_content_.find(std::string_view(name));
            if (it != added_by_content_.end() && added_tokens_[it->second].special) {
                add_end_of_generation(added_tokens_[it->second].id);
                if (eos_id_ < 0) eos_id_ = added_tokens_[it->second].id;
            }
        }
    }

    // What a TemplateProcessing's "single" template puts before and after the text ($A).
    struct Template {
        std::vector<int32_t> prefix, suffix;
    };

    // The TemplateProcessing of the post-processor (alone or in a Sequence), or nullopt.
    std::optional<Template> single_template(const Value* processor) const {
        if (!processor || !processor->is_object()) return std::nullopt;
        const std::string& type = type_of(*processor);
        if (type == "Sequence") {
            const Value* processors = processor->find("processors");
            if (!processors || !processors->is_array()) return std::nullopt;
            for (const Value& inner : processors->as_array()) {
                if (auto found = single_template(&inner)) return found;
            }
            return std::nullopt;
        }
        if (type != "TemplateProcessing") return std::nullopt;
        const Value* single = processor->find("single");
        if (!single || !single->is_array()) return std::nullopt;
        Template result;
        bool after_text = false;
        for (const Value& piece : single->as_array()) {
            if (piece.find("Sequence")) {
                after_text = true;
                continue;
            }
            const Value* special = piece.find("SpecialToken");
            if (!special) continue;
            std::vector<int32_t> ids = special_token_ids(*processor, string_field(*special, "id"));
            auto& side = after_text ? result.suffix : result.prefix;
            side.insert(side.end(), ids.begin(), ids.end());
        }
        return result;
    }

    // The ids of a template's special token: its entry in "special_tokens", else the token.
    std::vector<int32_t> special_token_ids(const Value& processor, const std::string& name) const {
        std::vector<int32_t> ids;
        if (const Value* table = processor.find("special_tokens")) {
            if (const Value* entry = table->find(name)) {
                if (const Value* listed = entry->find("ids"); listed && listed->is_array()) {
                    for (const Value& id : listed->as_array()) {
                        if (id.is_integer() && id.as_int() >= 0 && id.as_int() < vocab_size()) {
                            ids.push_back(static_cast<int32_t>(id.as_int()));
                        }
                    }
                    return ids;
                }
            }
        }
        if (int32_t id = token_id(name); id >= 0) ids.push_back(id);
        return ids;
    }

    static bool is_llama_style_class(std::string_view name) {
        if (name.ends_with("Fast")) name.remove_suffix(4);
        return name == "LlamaTokenizer" || name == "CodeLlamaTokenizer" || name == "GemmaTokenizer";
    }

    // ---- encoding ----

    // Leftmost-longest matches of added tokens, widened over the whitespace that lstrip and
    // rstrip tokens take with them.
    std::vector<Segment> split_added_tokens(std::string_view text) const {
        std::vector<Segment> segments;
        size_t text_start = 0;
        size_t at = 0;
        while (at < text.size()) {
            if (!added_first_bytes_[static_cast<unsigned char>(text[at])]) {
                ++at;
                continue;
            }
            const AddedToken* found = nullptr;
            size_t length = 0;
            for (size_t candidate : added_lengths_) {
                if (candidate > text.size() - at) continue;
                auto it = added_by_content_.find(text.substr(at, candidate));
                if (it == added_by_content_.end()) continue;
                const AddedToken& token = added_tokens_[it->second];
                if (token.single_word && !is_single_word(text, at, at + candidate)) continue;
                found = &token;
                length = candidate;
                break;
            }
            if (!found) {
                ++at;
                continue;
            }
            size_t start = at, end = at + length;
            if (found->lstrip) {
                while (start > text_start && is_ascii_space(text[start - 1]))
                    --start;
            }
            if (found->rstrip) {
                while (end < text.size() && is_ascii_space(text[end]))
                    ++end;
            }
            if (start > text_start) segments.push_back({text_start, start, -1});
            segments.push_back({start, end, found->id});
            text_start = at = end;
        }
        if (text_start < text.size()) segments.push_back({text_start, text.size(), -1});
        return segments;
    }

    static bool is_single_word(std::string_view text, size_t start, size_t end) {
        auto is_word_byte = [](char c) {
            auto byte = static_cast<unsigned char>(c);
            return std::isalnum(byte) || c == '_' || byte >= 0x80;
        };
        return (start == 0 || !is_word_byte(text[start - 1])) &&
               (end == text.size() || !is_word_byte(text[end]));
    }

    std::string normalize(std::string_view text) const {
        std::string out(text);
        for (const NormalizerStep& step : normalizers_) {
            switch (step.kind) {
                case NormalizerStep::Kind::prepend:
                    if (!out.empty()) out.insert(0, step.text);
                    break;
                case NormalizerStep::Kind::replace:
                    out = replace_all(out, step.text, step.replacement);
                    break;
                case NormalizerStep::Kind::nfc:
                    out = unicode::nfc(out);
                    break;
                case NormalizerStep::Kind::strip: {
                    size_t begin = 0, end = out.size();
                    if (step.left) {
                        while (begin < end && is_ascii_space(out[begin]))
                            ++begin;
                    }
                    if (step.right) {
                        while (end > begin && is_ascii_space(out[end - 1]))
                            --end;
                    }
                    out = out.substr(begin, end - begin);
                    break;
                }
            }
        }
        return out;
    }

    void encode_text(std::string_view text, bool at_text_start, std::vector<int32_t>& ids) const {
        std::string normalized = normalize(text);
        std::vector<Piece> pieces = split_invalid_bytes(normalized, at_text_start);
        for (const PreTokenizerStep& step : pre_tokenizers_) {
            std::vector<Piece> next;
            next.reserve(pieces.size());
            for (Piece& piece : pieces)
                apply(step, piece, next);
            pieces = std::move(next);
        }
        for (const Piece& piece : pieces)
            encode_word(piece.text, ids);
    }

    // Text may hold bytes that are not UTF-8; they travel as pieces of their own that no regex
    // sees, and BPE gives them byte tokens.
    static std::vector<Piece> split_invalid_bytes(const std::string& text, bool at_text_start) {
        std::vector<Piece> pieces;
        size_t run_start = 0;
        size_t at = 0;
        while (at < text.size()) {
            size_t length = utf8::valid_length(text, at);
            if (length > 0) {
                at += length;
                continue;
            }
            if (at > run_start) {
                pieces.push_back({text.substr(run_start, at - run_start),
                                  at_text_start && run_start == 0, false});
            }
            pieces.push_back({text.substr(at, 1), at_text_start && at == 0, true});
            run_start = ++at;
        }
        if (at > run_start || text.empty()) {
            pieces.push_back({text.substr(run_start), at_text_start && run_start == 0, false});
        }
        return pieces;
    }

    void apply(const PreTokenizerStep& step, Piece& piece, std::vector<Piece>& out) const {
        switch (step.kind) {
            case PreTokenizerStep::Kind::split:
                if (piece.opaque) {
                    out.push_back(std::move(piece));
                } else if (step.regex) {
                    split_piece(piece, step.regex->find_all(piece.text), step.behavior, step.invert,
                                out);
                } else {
                    split_piece(piece, find_literal(piece.text, step.literal), step.behavior,
                                step.invert, out);
                }
                return;
            case PreTokenizerStep::Kind::byte_level: {
                if (step.add_prefix_space && !piece.text.starts_with(' ')) {
                    piece.text.insert(0, " ");
                }
                std::vector<Piece> words;
                if (step.regex && !piece.opaque) {
                    split_piece(piece, step.regex->find_all(piece.text), SplitBehavior::isolated,
                                false, words);
                } else {
                    words.push_back(std::move(piece));
                }
                const auto& alphabet = ByteLevelAlphabet::get();
                for (Piece& word : words) {
                    std::string mapped;
                    mapped.reserve(word.text.size() * 2);
                    for (char byte : word.text) {
                        mapped += alphabet.character_of_byte[static_cast<unsigned char>(byte)];
                    }
                    out.push_back({std::move(mapped), word.at_text_start, false});
                }
                return;
            }
            case PreTokenizerStep::Kind::metaspace: {
                piece.text = replace_all(piece.text, " ", step.replacement);
                bool prepend =
                    step.prepend == PreTokenizerStep::Prepend::always ||
                    (step.prepend == PreTokenizerStep::Prepend::first && piece.at_text_start);
                if (prepend && !piece.text.starts_with(step.replacement)) {
                    piece.text.insert(0, step.replacement);
                }
                if (step.split && !piece.opaque) {
                    split_piece(piece, find_literal(piece.text, step.replacement),
                                SplitBehavior::merged_with_next, false, out);
                } else {
                    out.push_back(std::move(piece));
                }
                return;
            }
        }
    }

    static std::vector<std::pair<size_t, size_t>> find_literal(std::string_view text,
                                                               std::string_view literal) {
        std::vector<std::pair<size_t, size_t>> matches;
        if (literal.empty()) return matches;
        for (size_t at = text.find(literal); at != std::string_view::npos;
             at = text.find(literal, at + literal.size())) {
            matches.emplace_back(at, at + literal.size());
        }
        return matches;
    }

    void encode_word(const std::string& word, std::vector<int32_t>& ids) const {
        if (word.empty()) return;
        if (ignore_merges_) {
            if (int32_t id = vocab_id(word); id >= 0) {
                ids.push_back(id);
                return;
            }
        }
        {
            std::lock_guard lock(cache_mutex_);
            auto it = cache_.find(word);
            if (it != cache_.end()) {
                ids.insert(ids.end(), it->second.begin(), it->second.end());
                return;
            }
        }
        std::vector<int32_t> word_ids = merge_word(word);
        ids.insert(ids.end(), word_ids.begin(), word_ids.end());
        std::lock_guard lock(cache_mutex_);
        if (cache_.size() < word_cache_capacity) cache_.emplace(word, std::move(word_ids));
    }

    // Characters to ids (byte tokens or <unk> for unknown ones), then the lowest-ranked
    // adjacent pair merges first, the leftmost on a tie, as in the tokenizers library.
    std::vector<int32_t> merge_word(std::string_view word) const {
        std::vector<int32_t> symbols;
        int32_t pending_unk = -1;  // fuse_unk folds a run of unknown characters into one
        auto flush_unk = [&] {
            if (pending_unk >= 0) symbols.push_back(pending_unk);
            pending_unk = -1;
        };
        size_t at = 0;
        while (at < word.size()) {
            size_t length = std::max<size_t>(1, utf8::valid_length(word, at));
            std::string_view character = word.substr(at, length);
            at += length;
            if (int32_t id = vocab_id(character); id >= 0) {
                flush_unk();
                symbols.push_back(id);
                continue;
            }
            if (byte_fallback_ && append_byte_tokens(character, symbols, pending_unk)) continue;
            if (unk_id_ >= 0) {
                if (!fuse_unk_) flush_unk();
                pending_unk = unk_id_;
            }
            // Without an unk token the character is dropped, as the tokenizers library does.
        }
        flush_unk();
        if (symbols.size() < 2 || merges_.empty()) return symbols;

        // Lower ranks merge first: the priority is the rank negated.
        merge_pairs<int32_t>(symbols, [&](int32_t left, int32_t right) {
            std::optional<PairMerge<int32_t>> merge;
            if (auto it = merges_.find(pair_key(left, right)); it != merges_.end())
                merge = PairMerge<int32_t>{-it->second.rank, it->second.id};
            return merge;
        });
        return symbols;
    }

    // <0xNN> tokens for each byte of character; false (and nothing added) unless all exist.
    bool append_byte_tokens(std::string_view character, std::vector<int32_t>& symbols,
                            int32_t& pending_unk) const {
        static const char* const hex = "0123456789ABCDEF";
        int32_t byte_ids[4];
        for (size_t i = 0; i < character.size(); ++i) {
            auto byte = static_cast<unsigned char>(character[i]);
            char name[7] = {'<', '0', 'x', hex[byte >> 4], hex[byte & 0xF], '>', '\0'};
            byte_ids[i] = vocab_id(std::string_view(name, 6));
            if (byte_ids[i] < 0) return false;
        }
        if (pending_unk >= 0) symbols.push_back(pending_unk);
        pending_unk = -1;
        symbols.insert(symbols.end(), byte_ids, byte_ids + character.size());
        return true;
    }

    struct Merge {
        int32_t rank;
        int32_t id;
    };

    std::string where_;
    int64_t declared_tokens_ = 0;  // vocab entries plus added tokens
    int64_t id_limit_ = INT32_MAX;
    // The model.
    StringMap<int32_t> vocab_;
    std::unordered_map<uint64_t, Merge> merges_;
    bool byte_fallback_ = false;
    bool fuse_unk_ = false;
    bool ignore_merges_ = false;
    int32_t unk_id_ = -1;
    // Every id's text (vocab and added tokens) and the bytes it decodes to.
    std::vector<std::string> id_to_token_;
    std::vector<bool> has_token_;
    std::vector<std::string> token_bytes_;
    // Added tokens, found in text by content: candidate lengths longest first.
    std::vector<AddedToken> added_tokens_;
    StringMap<size_t> added_by_content_;
    std::vector<size_t> added_lengths_;
    std::array<bool, 256> added_first_bytes_{};
    // The pipeline.
    std::vector<NormalizerStep> normalizers_;
    std::vector<PreTokenizerStep> pre_tokenizers_;
    // Word to ids; encode() is const and may run on several threads.
    mutable std::mutex cache_mutex_;
    mutable StringMap<std::vector<int32_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer_json(const fs::path& path, std::string bytes,
                                                  const ModelConfigs& configs,
                                                  std::string_view fingerprint_bytes) {
    return std::make_unique<HfBpeTokenizer>(path, bytes, configs, fingerprint_bytes);
}

}  // namespace kv::tokenizer_detail
