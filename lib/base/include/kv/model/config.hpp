// The shape of a Llama-family decoder, read from a Hugging Face config.json or a llama2.c header.
//
// One struct describes every supported architecture (LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, and llama2.c checkpoints): the differences between them are
// flags here (q/k/v bias, per-head q/k norm, RoPE layout and scaling), not separate code paths.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace kv {

namespace json {
class Value;
}

/// How a head's dimensions are paired for rotation.
enum class RopeLayout {
    half_split,   ///< Hugging Face: dimension i rotates with i + head_dim/2
    interleaved,  ///< Meta / llama2.c: dimension 2i rotates with 2i+1
};

enum class RopeScalingType { none, linear, llama3 };

struct RopeScaling {
    RopeScalingType type = RopeScalingType::none;
    double factor = 1.0;
    double low_freq_factor = 1.0;                     ///< llama3 only
    double high_freq_factor = 4.0;                    ///< llama3 only
    int64_t original_max_position_embeddings = 8192;  ///< llama3 only
};

struct ModelConfig {
    std::string architecture;  ///< e.g. "LlamaForCausalLM"; "llama2.c" for llama2.c checkpoints
    int64_t vocab_size = 0;
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;
    int64_t num_layers = 0;
    int64_t num_heads = 0;
    int64_t num_kv_heads = 0;
    int64_t head_dim = 0;
    int64_t max_position_embeddings = 0;  ///< the context length the model was trained for
    int64_t sliding_window = 0;           ///< 0: attention spans the whole context
    double rms_norm_eps = 1e-5;
    double rope_theta = 10000.0;
    RopeScaling rope_scaling;
    RopeLayout rope_layout = RopeLayout::half_split;
    bool attention_bias = false;  ///< q/k/v projections carry a bias (Qwen2)
    bool qk_norm = false;         ///< per-head RMSNorm of q and k before RoPE (Qwen3)
    bool tie_word_embeddings = false;
    std::string weights_dtype = "f32";  ///< "f32", "bf16" or "f16": how the weights are stored
    int64_t bos_token_id = -1;
    int64_t eos_token_id = -1;

    int64_t group_size() const { return num_heads / num_kv_heads; }
    int64_t kv_dim() const { return num_kv_heads * head_dim; }
};

/// Reads a Hugging Face config.json. Throws UnsupportedError for an architecture or RoPE scaling
/// this runtime does not implement, FormatError for missing or inconsistent fields.
ModelConfig parse_hf_config(const json::Value& config, const std::string& source_name);

/// Checks the invariants every loader relies on (positive sizes, heads divide evenly, even
/// head_dim); throws FormatError naming the source.
void validate_config(const ModelConfig& config, const std::string& source_name);

/// Writes the fields parse_hf_config reads, so that a converted model loads back the same.
json::Value config_to_hf_json(const ModelConfig& config);

}  // namespace kv
