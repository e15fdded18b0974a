#include "kv/api/chat.hpp"

#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/gguf.hpp"
#include "kv/sha256.hpp"

namespace kv {
namespace {

// A GGUF file's tokenizer.chat_template, with the text of the special tokens its metadata names
// by id (transformers' special_tokens_map, as llama.cpp's converter took them from it).
std::optional<text::ModelChatTemplate> gguf_chat_template(const std::filesystem::path& path) {
    const GgufFile file = GgufFile::open(path);
    std::optional<std::string> source = file.string("tokenizer.chat_template");
    if (!source || source->empty()) return std::nullopt;
    text::ModelChatTemplate found;
    found.source = std::move(*source);
    found.file = path;
    const std::vector<std::string>* tokens = file.strings("tokenizer.ggml.tokens");
    const std::pair<const char*, const char*> special[] = {
        {"tokenizer.ggml.bos_token_id", "bos_token"},
        {"tokenizer.ggml.eos_token_id", "eos_token"},
        {"tokenizer.ggml.unknown_token_id", "unk_token"},
        {"tokenizer.ggml.seperator_token_id", "sep_token"},
        {"tokenizer.ggml.padding_token_id", "pad_token"}};
    for (const auto& [key, name] : special) {
        const std::optional<int64_t> id = file.integer(key);
        if (!tokens || !id || *id < 0 || *id >= static_cast<int64_t>(tokens->size())) continue;
        if (!(*tokens)[*id].empty()) found.special_tokens.set(name, (*tokens)[*id]);
    }
    return found;
}

}  // namespace

text::ModelChatTemplate model_chat_template(const std::filesystem::path& model,
                                            const std::optional<std::filesystem::path>& tokenizer,
                                            const std::optional<text::ModelChatTemplate>& embedded,
                                            std::string_view option) {
    std::string looked_at;
    for (const auto& place : {tokenizer, std::optional<std::filesystem::path>(model)}) {
        if (!place) continue;
        if (auto found = text::read_chat_template(*place)) return *found;
        std::error_code error;
        const std::filesystem::path folder =
            std::filesystem::is_directory(*place, error) ? *place : place->parent_path();
        looked_at +=
            (looked_at.empty() ? "" : ", ") + quoted((folder / "tokenizer_config.json").string());
    }
    if (embedded && !embedded->source.empty()) return *embedded;
    if (is_gguf_file(model)) {
        if (auto found = gguf_chat_template(model)) return *found;
        looked_at += (looked_at.empty() ? "" : ", ") + std::string("the GGUF file's metadata");
    }
    throw UnsupportedError(std::string(option) + ": the model has no chat template (no " +
                           "chat_template in " + looked_at + ")");
}

ChatPreambleTokens chat_preamble_tokens(const text::ModelChatTemplate& model,
                                        const Tokenizer& tokenizer, std::string_view system) {
    ChatPreambleTokens result;
    result.text = text::chat_preamble(model, system);
    result.before = tokenizer.encode(result.text.before);
    return result;
}

bool context_starts_with_chat_preamble(const std::vector<std::string>& caches,
                                       const std::string& before) {
    if (caches.empty()) return false;
    const CacheSelection first = parse_cache_selection(caches.front());
    if (first.file == "-") return false;
    if (!first.id.empty() && first.id != chat_preamble_packet_id) return false;
    const CacheReader reader(first.file);
    const std::vector<PacketInfo>& packets = reader.packets();
    if (packets.empty()) return false;
    const PacketInfo& info =
        first.id.empty() ? packets.front() : reader.packet_info(chat_preamble_packet_id);
    if (info.id != chat_preamble_packet_id) return false;
    if (info.text_sha256 != sha256_hex(before))
        throw MismatchError("the " + quoted(chat_preamble_packet_id) + " packet of " +
                            quoted(first.file) +
                            " holds another start of the chat template than --chat renders "
                            "(another template or --system message)");
    return true;
}

}  // namespace kv
