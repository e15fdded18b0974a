// The model's own chat template, as the tools use it: kvserve-once --chat renders the user's
// message with it, and --chat-preamble (kvtrain, kvserve-once with packets) puts its start
// before the packets, KV Packet's preamble, where the paper puts the chat template's start.
#pragma once

#include "kv/text/chat_template.hpp"
#include "kv/tokenizer.hpp"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kv {

/// The id of the packet kvbake --chat-preamble bakes from the chat template's start.
inline constexpr const char* chat_preamble_packet_id = "chat-preamble";

/// The chat template of the model at `model` (a folder, or a file in one), read from the
/// tokenizer_config.json of `tokenizer` when given (kvtools' --tokenizer: the template belongs
/// to the tokenizer, as in transformers), else of the model's folder; then `embedded`, a template
/// given with its special tokens, or else the tokenizer.chat_template of a GGUF model file (with
/// the tokens its metadata names by id as bos_token, eos_token, ...). Throws kv::UnsupportedError
/// naming the files looked at, and the option that asked (`option`), when there is none.
text::ModelChatTemplate model_chat_template(const std::filesystem::path& model,
                                            const std::optional<std::filesystem::path>& tokenizer,
                                            const std::optional<text::ModelChatTemplate>& embedded,
                                            std::string_view option);

/// KV Packet's preamble from a chat template, as tokens: `before` goes in front of the packets
/// (instead of BOS) and `after` follows the question, so that documents, question and answer sit
/// where a chat puts the user's message and the reply. Each part is tokenized on its own, with
/// the special tokens the template writes as text recognised, and no BOS added (the template
/// writes it where the model wants it, as transformers' apply_chat_template tokenizes).
struct ChatPreambleTokens {
    text::ChatPreamble text;
    std::vector<int32_t> before;
};
ChatPreambleTokens chat_preamble_tokens(const text::ModelChatTemplate& model,
                                        const Tokenizer& tokenizer, std::string_view system);

/// Whether the context of `caches` (FILE[:ID] as kvserve-once --cache takes them) starts with
/// the packet kvbake --chat-preamble bakes, so that it is the preamble and nothing is put before
/// it. Throws kv::MismatchError when that packet holds another text than `before` (another
/// template or system message). Standard input ("-") cannot be looked at first: false.
bool context_starts_with_chat_preamble(const std::vector<std::string>& caches,
                                       const std::string& before);

}  // namespace kv
