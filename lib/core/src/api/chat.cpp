#include "kv/api/chat.hpp"

#include "kv/error.hpp"

namespace kv {

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

}  // namespace kv
