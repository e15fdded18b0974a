// Chat templates: the subset of Jinja that Hugging Face models' `chat_template`s are written in,
// rendered as transformers renders them.
//
// transformers compiles a chat template with jinja2's ImmutableSandboxedEnvironment
// (trim_blocks=True, lstrip_blocks=True, the loopcontrols extension), adds `raise_exception`,
// `strftime_now` and its own `tojson` (json.dumps with ensure_ascii=False), and renders it with
// `messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's special tokens.
// ChatTemplate does the same with Python's semantics for the values (str() and repr() of lists
// and numbers, integer and true division, truthiness, equality across int and float), so that the
// prompt is the one the model was trained on, byte for byte (tests/chat_templates checks it
// against python3-jinja2 over the templates of real model families).
//
// What is not supported (template inheritance, includes, recursive loops, a filter or test
// outside the subset, a case change of non-ASCII text that would need Unicode's tables) is
// refused with kv::UnsupportedError naming the construct and its line and column, when the
// template is parsed or when the construct is reached; a syntax error is a kv::FormatError; an
// error while rendering (raise_exception, an attribute of an undefined value, "a" + 1) is a
// ChatTemplateError. Nothing is ever rendered silently wrong.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "kv/error.hpp"
#include "kv/json.hpp"

namespace kv::text {

/// An error while rendering: the template's raise_exception(), or an operation that Python and
/// Jinja refuse. The message names the template position: "chat template line 3 column 7: ...".
class ChatTemplateError : public Error {
  public:
    ChatTemplateError(const std::string& message, int line, int column);
    int line() const { return line_; }
    int column() const { return column_; }
    /// True when the template itself refused (raise_exception), as opposed to a type error.
    bool raised_by_template() const { return raised_; }

  private:
    friend struct ChatTemplateAccess;
    int line_, column_;
    bool raised_ = false;
};

struct ChatRenderOptions {
    /// The time strftime_now() formats, in seconds since the epoch (local time); the current
    /// time when absent.
    std::optional<int64_t> now;
};

/// A parsed chat template; render() may be called many times and from several threads.
class ChatTemplate {
  public:
    /// Parses the template; throws kv::FormatError (syntax) or kv::UnsupportedError.
    explicit ChatTemplate(std::string_view source);
    ~ChatTemplate();
    ChatTemplate(ChatTemplate&&) noexcept;
    ChatTemplate& operator=(ChatTemplate&&) noexcept;

    /// Renders with the variables of a JSON object (messages, add_generation_prompt, bos_token,
    /// ...). JSON null is Python's None; an absent variable is Jinja's undefined.
    std::string render(const json::Value& variables, const ChatRenderOptions& options = {}) const;

    struct Program;

  private:
    std::shared_ptr<const Program> program_;
};

/// A model's chat template and what transformers renders it with.
struct ModelChatTemplate {
    std::string source;
    /// The tokenizer's special tokens as transformers' special_tokens_map gives them to the
    /// template (bos_token, eos_token, unk_token, pad_token, ...: strings; absent when unset).
    json::Value special_tokens = json::Value::object();
    std::filesystem::path file;  ///< where it was read, for messages
};

/// The chat template of a model folder's tokenizer_config.json ("chat_template" as a string, or
/// the entry named "default" of a list of named templates, as transformers chooses); nullopt when
/// the folder has no tokenizer_config.json or it has no template. `model` may also be a file
/// inside the folder.
std::optional<ModelChatTemplate> read_chat_template(const std::filesystem::path& model);

/// The variables transformers' apply_chat_template renders with: messages, tools and documents
/// (None), add_generation_prompt, and the special tokens.
json::Value chat_variables(const ModelChatTemplate& model, json::Value messages,
                           bool add_generation_prompt);

/// A conversation of an optional system message and one user message.
json::Value chat_messages(std::string_view system, std::string_view user);

/// The template's preamble for KV Packet: what comes before the documents (the system prefix and
/// the start of the user turn) and after them (the rest of the user turn and the generation
/// prompt). The template is rendered once with a user message made of a unique marker around
/// the question's place, and split at the marker; throws kv::UnsupportedError when the template
/// changes or repeats the marker (so that no split would be faithful).
struct ChatPreamble {
    std::string before;  ///< rendered prefix: BOS, system turn, user turn up to its content
    std::string after;   ///< after the user's content: end of turn, generation prompt
};
ChatPreamble chat_preamble(const ModelChatTemplate& model, std::string_view system);

}  // namespace kv::text
