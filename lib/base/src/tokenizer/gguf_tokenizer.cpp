// Tokenizers stored in GGUF metadata (tokenizer.ggml.*), turned into the tokenizer.json that
// Hugging Face's own converter would have made of them, so that one tested BPE implementation
// (hf_bpe.cpp) encodes both.
//
// "gpt2" files hold a byte-level BPE as it is: tokens, merges and the name of the
// pre-tokenizer (tokenizer.ggml.pre), for which the original regular expressions are restored.
// "llama" files hold a sentencepiece BPE as tokens, scores and token types without merges:
// merges are derived from the scores as sentencepiece applies them (a pair merges before another
// when the piece it makes scores higher), which is what transformers' GGUF loader does too; the
// text is prepared as llama.cpp does (a space before the text unless add_space_prefix is false,
// spaces as U+2581, bytes of unknown characters as <0xNN> tokens).
#include "kv/error.hpp"
#include "kv/gguf.hpp"
#include "loaders.hpp"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace kv::tokenizer_detail {

namespace {

// llama.cpp's token types (tokenizer.ggml.token_type).
enum TokenType : int64_t {
    normal = 1,
    unknown = 2,
    control = 3,
    user_defined = 4,
    unused = 5,
    byte = 6,
};

constexpr std::string_view metaspace = "\xE2\x96\x81";

std::string quote_json(std::string_view text) {
    return json::dump(json::Value(text));
}

// The pre-tokenizers of tokenizer.json for the names llama.cpp's converter writes into
// tokenizer.ggml.pre, as the original files spell them (llama.cpp itself rewrites some of these
// expressions for its own regex engine; kvtools runs the originals through PCRE2).
struct PreTokenizer {
    std::string normalizer;     // JSON, "null" for none
    std::string pre_tokenizer;  // JSON
    bool ignore_merges = false;
    bool add_bos = false;  // llama.cpp's default where the file does not say
};

std::string byte_level(bool use_regex) {
    return std::string(R"({"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,)") +
           R"("use_regex":)" + (use_regex ? "true" : "false") + "}";
}

std::string split_then_byte_level(std::string_view regex) {
    return R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":)" +
           quote_json(regex) + R"(},"behavior":"Isolated","invert":false},)" + byte_level(false) +
           "]}";
}

std::optional<PreTokenizer> pre_tokenizer_for(const std::string& name) {
    if (name == "gpt-2" || name == "phi-2")
        return PreTokenizer{"null", byte_level(true), false, false};
    if (name == "llama-bpe" || name == "llama3" || name == "llama-v3")
        return PreTokenizer{"null",
                            split_then_byte_level(
                                R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|)"
                                R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"),
                            true, true};
    if (name == "qwen2")
        return PreTokenizer{
            R"({"type":"NFC"})",
            split_then_byte_level(R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|)"
                                  R"(\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"),
            false, false};
    if (name == "smollm" || name == "starcoder")
        return PreTokenizer{"null",
                            R"({"type":"Sequence","pretokenizers":[{"type":"Digits",)"
                            R"("individual_digits":true},)" +
                                byte_level(true) + "]}",
                            false, false};
    return std::nullopt;
}

constexpr std::string_view supported_pre =
    "gpt-2, phi-2, llama-bpe, llama3, qwen2, smollm, starcoder";

// Sentencepiece's BPE merges, from the scores: every way of cutting a normal piece into two
// normal pieces (at character boundaries) is a merge, ranked by the score of the piece it makes,
// higher first; ties by the made piece's id, then the left part's.
std::string merges_from_scores(const std::vector<std::string>& tokens,
                               const std::vector<double>& scores,
                               const std::vector<int64_t>& types) {
    std::unordered_map<std::string_view, int64_t> normal_id;
    for (std::size_t id = 0; id < tokens.size(); ++id)
        if (types[id] == normal) normal_id.emplace(tokens[id], static_cast<int64_t>(id));
    struct Merge {
        int64_t merged, left, right;
    };
    std::vector<Merge> merges;
    for (std::size_t id = 0; id < tokens.size(); ++id) {
        if (types[id] != normal) continue;
        const std::string_view piece = tokens[id];
        for (std::size_t cut = 1; cut < piece.size(); ++cut) {
            if ((static_cast<unsigned char>(piece[cut]) & 0xC0) == 0x80) continue;
            const auto left = normal_id.find(piece.substr(0, cut));
            const auto right = normal_id.find(piece.substr(cut));
            if (left != normal_id.end() && right != normal_id.end())
                merges.push_back({static_cast<int64_t>(id), left->second, right->second});
        }
    }
    std::sort(merges.begin(), merges.end(), [&](const Merge& a, const Merge& b) {
        const double score_a = scores[static_cast<std::size_t>(a.merged)];
        const double score_b = scores[static_cast<std::size_t>(b.merged)];
        if (score_a != score_b) return score_a > score_b;
        if (a.merged != b.merged) return a.merged < b.merged;
        return a.left < b.left;
    });
    std::string text = "[";
    for (std::size_t i = 0; i < merges.size(); ++i) {
        text += i ? ",[" : "[";
        text += quote_json(tokens[static_cast<std::size_t>(merges[i].left)]) + "," +
                quote_json(tokens[static_cast<std::size_t>(merges[i].right)]) + "]";
    }
    return text + "]";
}

}  // namespace

std::unique_ptr<Tokenizer> load_gguf_tokenizer(const std::filesystem::path& path) {
    const GgufFile file = GgufFile::open(path);
    const std::string& source = file.source();
    const std::optional<std::string> model = file.string("tokenizer.ggml.model");
    if (!model) throw FormatError(source + ": no tokenizer in it (no 'tokenizer.ggml.model')");
    if (*model != "llama" && *model != "gpt2")
        throw UnsupportedError(source + ": tokenizer model '" + *model +
                               "' is not supported (supported: llama, gpt2)");
    const bool spm = *model == "llama";
    const std::vector<std::string>* tokens = file.strings("tokenizer.ggml.tokens");
    if (!tokens || tokens->empty())
        throw FormatError(source + ": missing metadata 'tokenizer.ggml.tokens'");
    const std::size_t count = tokens->size();
    std::vector<int64_t> types(count, normal);
    if (const auto* listed = file.integers("tokenizer.ggml.token_type")) {
        if (listed->size() != count)
            throw FormatError(source + ": 'tokenizer.ggml.token_type' has " +
                              std::to_string(listed->size()) + " entries for " +
                              std::to_string(count) + " tokens");
        types = *listed;
    }
    auto token_id = [&](const char* key) -> int64_t {
        const std::optional<int64_t> id = file.integer(key);
        if (!id) return -1;
        if (*id < 0 || static_cast<uint64_t>(*id) >= count)
            throw FormatError(source + ": '" + key + "' is " + std::to_string(*id) +
                              ", outside the " + std::to_string(count) + " tokens");
        return *id;
    };
    const int64_t bos = token_id("tokenizer.ggml.bos_token_id");
    const int64_t eos = token_id("tokenizer.ggml.eos_token_id");
    const int64_t unk = token_id("tokenizer.ggml.unknown_token_id");
    std::vector<int64_t> end_ids = {eos, token_id("tokenizer.ggml.eot_token_id"),
                                    token_id("tokenizer.ggml.eom_token_id")};

    // Unused tokens are left out of the vocabulary. Most are the [PADn] tokens
    // convert_hf_to_gguf.py writes up to the embedding's rows, absent from the tokenizer.json
    // they came from: left out, they decode to nothing and ids past the last token in use are
    // past vocab_size(), as from the model's folder. A sentencepiece model's own unused pieces
    // decode to nothing too, as llama.cpp and kvtools' sentencepiece reader print them (Hugging
    // Face's decode would print their text). One that a merge names or makes, or that the
    // metadata names BOS, EOS or unknown, stays.
    const std::vector<std::string>* listed_merges =
        spm ? nullptr : file.strings("tokenizer.ggml.merges");
    auto named = [&](std::size_t id) {
        const auto as_id = static_cast<int64_t>(id);
        return as_id == bos || as_id == eos || as_id == unk;
    };
    std::unordered_set<std::string_view> unused_texts, merged;
    for (std::size_t id = 0; id < count; ++id)
        if (types[id] == unused && !named(id)) unused_texts.insert((*tokens)[id]);
    if (!unused_texts.empty() && listed_merges) {
        std::string made;
        for (const std::string& merge : *listed_merges) {
            const std::size_t space = merge.find(' ');
            if (space == std::string::npos) continue;
            made.assign(merge, 0, space);
            made.append(merge, space + 1);
            for (std::string_view text :
                 {std::string_view(merge).substr(0, space),
                  std::string_view(merge).substr(space + 1), std::string_view(made)})
                if (const auto found = unused_texts.find(text); found != unused_texts.end())
                    merged.insert(*found);
        }
    }
    auto in_use = [&](std::size_t id) {
        return types[id] != unused || named(id) || merged.count((*tokens)[id]) > 0;
    };
    bool leaves_out = false;
    for (std::size_t id = 0; id < count && !leaves_out; ++id)
        leaves_out = !in_use(id);
    // `every_json`, where tokens are left out: the vocabulary with them, as kvtools built it
    // before it left them out: the fingerprint is taken over it, so that packets baked from
    // such a GGUF before are read as before (the ids of every text are the same: no text
    // encodes to an unused token).
    std::string vocab_json = "{", every_json = "{";
    std::string added_json = "[";
    bool first_vocab = true, first_every = true, first_added = true;
    for (std::size_t id = 0; id < count; ++id) {
        const std::string& token = (*tokens)[id];
        const std::string entry = quote_json(token) + ":" + std::to_string(id);
        if (leaves_out) {
            every_json += first_every ? "" : ",";
            first_every = false;
            every_json += entry;
        }
        if (!in_use(id)) continue;
        const int64_t type = types[id];
        const bool added = type == control || type == user_defined || (spm && type == unknown);
        // Every token in use is in the vocabulary (a later duplicate wins, as in llama.cpp's
        // lookup); control and user-defined ones are also added tokens, matched in the text first.
        vocab_json += first_vocab ? "" : ",";
        first_vocab = false;
        vocab_json += entry;
        if (added) {
            added_json += first_added ? "" : ",";
            first_added = false;
            added_json +=
                R"({"id":)" + std::to_string(id) + R"(,"content":)" + quote_json(token) +
                R"(,"single_word":false,"lstrip":false,"rstrip":false,"normalized":false,)"
                R"("special":)" +
                (type == user_defined ? "false" : "true") + "}";
        }
    }
    vocab_json += "}";
    every_json += "}";
    added_json += "]";

    std::string normalizer = "null", pre = "null", decoder, merges;
    std::string model_options;
    bool add_bos = spm;
    if (spm) {
        const std::vector<double>* scores = file.numbers("tokenizer.ggml.scores");
        if (!scores || scores->size() != count)
            throw FormatError(source + ": 'tokenizer.ggml.scores' must hold one score per token (" +
                              std::to_string(count) + ")");
        merges = merges_from_scores(*tokens, *scores, types);
        const bool space_prefix = file.boolean("tokenizer.ggml.add_space_prefix").value_or(true);
        const std::string replace = R"({"type":"Replace","pattern":{"String":" "},"content":)" +
                                    quote_json(metaspace) + "}";
        normalizer = space_prefix ? R"({"type":"Sequence","normalizers":[{"type":"Prepend",)"
                                    R"("prepend":)" +
                                        quote_json(metaspace) + "}," + replace + "]}"
                                  : replace;
        decoder = R"({"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":)" +
                  quote_json(metaspace) +
                  R"(},"content":" "},{"type":"ByteFallback"},)"
                  R"({"type":"Fuse"}]})";
        model_options = R"(,"byte_fallback":true,"fuse_unk":true)";
        if (unk >= 0) model_options += R"(,"unk_token":)" + quote_json((*tokens)[unk]);
    } else {
        if (!listed_merges)
            throw FormatError(source + ": missing metadata 'tokenizer.ggml.merges'");
        merges = "[";
        for (std::size_t i = 0; i < listed_merges->size(); ++i)
            merges += (i ? "," : "") + quote_json((*listed_merges)[i]);
        merges += "]";
        const std::string name = file.string("tokenizer.ggml.pre").value_or("default");
        const std::optional<PreTokenizer> found = pre_tokenizer_for(name);
        if (!found)
            throw UnsupportedError(source + ": pre-tokenizer '" + name +
                                   "' (tokenizer.ggml.pre) is not supported " +
                                   "(supported: " + std::string(supported_pre) +
                                   "); name the model's tokenizer.json with --tokenizer");
        normalizer = found->normalizer;
        pre = found->pre_tokenizer;
        decoder = byte_level(true);
        add_bos = found->add_bos;
        if (found->ignore_merges) model_options = R"(,"ignore_merges":true)";
    }
    add_bos = file.boolean("tokenizer.ggml.add_bos_token").value_or(add_bos);
    const bool add_eos = file.boolean("tokenizer.ggml.add_eos_token").value_or(false);

    auto tokenizer_json = [&](const std::string& vocabulary) {
        return R"({"version":"1.0","added_tokens":)" + added_json + R"(,"normalizer":)" +
               normalizer + R"(,"pre_tokenizer":)" + pre + R"(,"post_processor":null,"decoder":)" +
               decoder + R"(,"model":{"type":"BPE","vocab":)" + vocabulary + R"(,"merges":)" +
               merges + model_options + "}}";
    };

    // BOS, EOS and the end-of-generation ids by id, as the file gives them; add_bos and add_eos
    // decide what add_special_tokens puts around a text, the rule transformers applies to
    // Llama-style tokenizer classes.
    ModelConfigs configs;
    json::Value tokenizer_config = json::Value::object();
    tokenizer_config.set("tokenizer_class", "LlamaTokenizerFast");
    tokenizer_config.set("add_bos_token", add_bos && bos >= 0);
    tokenizer_config.set("add_eos_token", add_eos && eos >= 0);
    if (const auto chat_template = file.string("tokenizer.chat_template"))
        tokenizer_config.set("chat_template", *chat_template);
    configs.tokenizer_config = std::move(tokenizer_config);
    json::Value model_config = json::Value::object();
    if (bos >= 0) model_config.set("bos_token_id", bos);
    json::Value end = json::Value::array();
    for (int64_t id : end_ids)
        if (id >= 0) end.push_back(id);
    model_config.set("eos_token_id", std::move(end));
    configs.model_config = std::move(model_config);
    const std::string used = tokenizer_json(vocab_json);
    return load_hf_tokenizer_json(path, used, configs,
                                  leaves_out ? tokenizer_json(every_json) : std::string());
}

}  // namespace kv::tokenizer_detail
