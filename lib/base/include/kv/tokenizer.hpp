// Tokenizers: text to token ids and back.
//
// Four kinds load through load_tokenizer(): llama2.c tok*.bin files, Hugging Face tokenizer.json
// files with a BPE model (byte-level like Llama 3, Qwen and GPT-2, or sentencepiece-style with a
// metaspace like Llama 2 and Mistral), and sentencepiece tokenizer.model files. All of them are
// immutable once loaded, so one tokenizer may encode from several threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kv {

class Tokenizer {
  public:
    virtual ~Tokenizer() = default;

    /// Plain text to ids. Never adds BOS or EOS: the caller does, using bos_id() and add_bos(),
    /// or calls encode_with_special_tokens().
    /// For tokenizer.json models, special-token strings in the text (e.g. "<|eot_id|>") become
    /// their ids. Text that is not valid UTF-8 still encodes: stray bytes become byte tokens.
    virtual std::vector<int32_t> encode(std::string_view text) const = 0;

    /// The raw bytes a token stands for, possibly part of a UTF-8 sequence. Special and control
    /// tokens give "" so that they are never printed. Throws kv::FormatError for an id outside
    /// [0, vocab_size()).
    virtual std::string token_bytes(int32_t id) const = 0;

    virtual int32_t vocab_size() const = 0;

    /// -1 when the tokenizer has none.
    int32_t bos_id() const { return bos_id_; }
    int32_t eos_id() const { return eos_id_; }
    /// Whether prompts start with BOS by default.
    bool add_bos() const { return add_bos_; }
    /// The ids that Hugging Face's add_special_tokens=True puts before and after one text: BOS
    /// for Llama and Mistral, nothing for GPT-2 and Qwen, whatever a tokenizer.json's
    /// TemplateProcessing says (Whisper's two start tokens and EOS after the text), as
    /// transformers rebuilds it for Llama-style tokenizers from add_bos_token and add_eos_token;
    /// for sentencepiece models BOS when add_bos() and EOS when add_eos_token says so; llama2.c's
    /// BOS. add_bos() may differ: it follows add_bos_token whatever the tokenizer class.
    const std::vector<int32_t>& special_prefix() const { return special_prefix_; }
    const std::vector<int32_t>& special_suffix() const { return special_suffix_; }
    /// special_prefix(), encode(text), special_suffix().
    std::vector<int32_t> encode_with_special_tokens(std::string_view text) const;
    /// EOS and the other tokens that end a turn (Llama 3's <|eot_id|>, Qwen's <|im_end|>...).
    bool is_end_of_generation(int32_t id) const;
    const std::vector<int32_t>& end_of_generation_ids() const { return end_of_generation_ids_; }

    /// Sentencepiece-style models prepend a space to the text (the "dummy prefix"), so decoding
    /// drops one leading space from the first piece of text; llama2.c tok*.bin tokenizers also
    /// from the piece right after every BOS, as llama2.c does.
    bool strips_leading_space() const { return strips_leading_space_; }

    /// The concatenated bytes of the ids, with the leading-space rule applied: decode(encode(s))
    /// gives s back. Special tokens decode to nothing; elsewhere than in llama2.c's tokenizers a
    /// BOS inside the ids does not start the text again, as in Hugging Face's decode with
    /// skip_special_tokens=True and sentencepiece's.
    std::string decode(std::span<const int32_t> ids) const;

    /// Hex SHA-256 over the tokenizer file's bytes and the special-token settings (BOS, EOS,
    /// add_bos, end-of-generation ids), which may come from the config files beside it: two
    /// tokenizers with the same fingerprint turn the same text into the same ids.
    const std::string& fingerprint() const { return fingerprint_; }

    /// "llama2c", "hf-bpe-bytelevel", "hf-bpe-metaspace" or "sentencepiece".
    const std::string& kind() const { return kind_; }

  protected:
    /// Called by loaders once the fields are set: hashes them with the file's bytes.
    void set_fingerprint(std::string_view file_bytes);
    void add_end_of_generation(int32_t id);
    /// Throws kv::FormatError unless 0 <= id < vocab_size().
    void check_id(int32_t id) const;

    int32_t bos_id_ = -1;
    int32_t eos_id_ = -1;
    bool add_bos_ = false;
    bool strips_leading_space_ = false;
    bool strips_space_after_every_bos_ = false;  // llama2.c's rule
    std::vector<int32_t> special_prefix_;
    std::vector<int32_t> special_suffix_;
    std::vector<int32_t> end_of_generation_ids_;
    std::string fingerprint_;
    std::string kind_;
};

/// Turns a stream of ids into printable UTF-8 text: holds back the bytes of a character until
/// its last byte arrives, writes U+FFFD for bytes that can never form one, and drops the leading
/// space of the piece right after BOS. Push the prompt's ids too (BOS included) so that the rule
/// sees where the text starts.
class TextStreamer {
  public:
    explicit TextStreamer(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
    /// The text that became complete with this id (often "", sometimes several characters).
    std::string push(int32_t id);
    /// What is still held back, as U+FFFD; the streamer can be reused afterwards.
    std::string finish();

  private:
    const Tokenizer& tokenizer_;
    std::string pending_;
    int32_t previous_id_ = -1;
};

/// Loads a tokenizer from a model directory (tokenizer.json preferred, else tokenizer.model), a
/// tokenizer.json file, a sentencepiece .model file, a GGUF model file (its tokenizer.ggml.*
/// metadata: "llama" and "gpt2" models) or a llama2.c tok*.bin file. Beside a
/// tokenizer.json or tokenizer.model, tokenizer_config.json, config.json and
/// generation_config.json are read when present for BOS, EOS, add_bos and the end tokens.
/// Throws kv::IoError, kv::FormatError or kv::UnsupportedError naming the file.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& path);

}  // namespace kv
