// The tokenizer kinds behind load_tokenizer() (internal to the library).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "kv/json.hpp"
#include "kv/tokenizer.hpp"

namespace kv::tokenizer_detail {

/// The Hugging Face config files found beside a tokenizer, parsed; absent ones are nullopt.
struct ModelConfigs {
    std::optional<json::Value> tokenizer_config;   // tokenizer_config.json
    std::optional<json::Value> model_config;       // config.json
    std::optional<json::Value> generation_config;  // generation_config.json

    static ModelConfigs read_from(const std::filesystem::path& directory);
};

/// The whole file; throws kv::IoError "cannot read 'path': <reason>".
std::string read_file(const std::filesystem::path& path);

/// A JSON file parsed; its errors name the file.
json::Value read_json_file(const std::filesystem::path& path);

/// A special-token entry of tokenizer_config.json: a string or {"content": ...}; "" if neither.
std::string special_token_content(const json::Value* entry);

/// An id or the ids of a list in a config file ("eos_token_id": 2 or [128001, 128009]).
std::vector<int32_t> config_token_ids(const json::Value* entry);

std::unique_ptr<Tokenizer> load_llama2c(const std::filesystem::path& path, std::string bytes);
/// `fingerprint_bytes`: what the fingerprint hashes in place of `bytes` (a GGUF's tokenizer.json
/// as kvtools built it before leaving its unused tokens out); empty: `bytes`.
std::unique_ptr<Tokenizer> load_hf_tokenizer_json(const std::filesystem::path& path,
                                                  std::string bytes, const ModelConfigs& configs,
                                                  std::string_view fingerprint_bytes = {});
std::unique_ptr<Tokenizer> load_sentencepiece(const std::filesystem::path& path, std::string bytes,
                                              const ModelConfigs& configs);
/// The tokenizer in a GGUF file's metadata (gguf_tokenizer.cpp).
std::unique_ptr<Tokenizer> load_gguf_tokenizer(const std::filesystem::path& path);

}  // namespace kv::tokenizer_detail
