#include "kv/model/config.hpp"

#include "kv/error.hpp"
#include "kv/json.hpp"

#include <array>
#include <string_view>

namespace kv {
namespace {

int64_t int_field(const json::Value& config, std::string_view key, const std::string& source) {
    const json::Value* value = config.find(key);
    if (!value || !value->is_integer())
        throw FormatError(source + ": missing or non-integer field '" + std::string(key) + "'");
    return value->as_int();
}

int64_t int_field_or(const json::Value& config, std::string_view key, int64_t fallback) {
    const json::Value* value = config.find(key);
    return value && value->is_integer() ? value->as_int() : fallback;
}

double number_field_or(const json::Value& config, std::string_view key, double fallback) {
    const json::Value* value = config.find(key);
    return value && value->is_number() ? value->as_double() : fallback;
}

bool bool_field_or(const json::Value& config, std::string_view key, bool fallback) {
    const json::Value* value = config.find(key);
    return value && value->is_bool() ? value->as_bool() : fallback;
}

// eos_token_id may be one id or a list; the first is the canonical one.
int64_t first_token_id(const json::Value& config, std::string_view key) {
    const json::Value* value = config.find(key);
    if (!value) return -1;
    if (value->is_integer()) return value->as_int();
    if (value->is_array() && value->size() > 0 && (*value)[0].is_integer())
        return (*value)[0].as_int();
    return -1;
}

RopeScaling parse_rope_scaling(const json::Value& config, const std::string& source) {
    RopeScaling scaling;
    const json::Value* node = config.find("rope_scaling");
    if (!node || node->is_null()) return scaling;
    if (!node->is_object()) throw FormatError(source + ": 'rope_scaling' is not an object");
    const json::Value* type = node->find("rope_type");
    if (!type) type = node->find("type");
    const std::string type_name = type && type->is_string() ? type->as_string() : "";
    if (type_name == "default" || type_name.empty()) return scaling;
    scaling.factor = number_field_or(*node, "factor", 1.0);
    if (type_name == "linear") {
        scaling.type = RopeScalingType::linear;
    } else if (type_name == "llama3") {
        scaling.type = RopeScalingType::llama3;
        scaling.low_freq_factor = number_field_or(*node, "low_freq_factor", 1.0);
        scaling.high_freq_factor = number_field_or(*node, "high_freq_factor", 4.0);
        scaling.original_max_position_embeddings =
            int_field_or(*node, "original_max_position_embeddings", 8192);
        if (scaling.high_freq_factor <= scaling.low_freq_factor)
            throw FormatError(source +
                              ": llama3 rope_scaling needs high_freq_factor > low_freq_factor");
    } else {
        // yarn, longrope and dynamic scale attention or depend on the sequence length: keys
        // baked with them could not be realigned by a plain rotation.
        throw UnsupportedError(source + ": rope scaling '" + type_name +
                               "' is not supported (supported: linear, llama3)");
    }
    if (!(scaling.factor > 0)) throw FormatError(source + ": rope_scaling factor must be positive");
    return scaling;
}

}  // namespace

ModelConfig parse_hf_config(const json::Value& config, const std::string& source) {
    if (!config.is_object()) throw FormatError(source + ": not a JSON object");
    ModelConfig result;
    const json::Value* architectures = config.find("architectures");
    if (!architectures || !architectures->is_array() || architectures->size() == 0 ||
        !(*architectures)[0].is_string())
        throw FormatError(source + ": missing 'architectures'");
    result.architecture = (*architectures)[0].as_string();

    static constexpr std::array supported = {"LlamaForCausalLM", "MistralForCausalLM",
                                             "Qwen2ForCausalLM", "Qwen3ForCausalLM"};
    bool known = false;
    for (const char* name : supported)
        known = known || result.architecture == name;
    if (!known)
        throw UnsupportedError(
            source + ": architecture '" + result.architecture +
            "' is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
            "Qwen2ForCausalLM, Qwen3ForCausalLM)");

    const json::Value* activation = config.find("hidden_act");
    if (activation && activation->is_string() && activation->as_string() != "silu")
        throw UnsupportedError(source + ": activation '" + activation->as_string() +
                               "' is not supported (supported: silu)");
    if (bool_field_or(config, "mlp_bias", false))
        throw UnsupportedError(source + ": 'mlp_bias' is not supported");
    if (bool_field_or(config, "use_sliding_window", false))
        throw UnsupportedError(
            source + ": per-layer sliding windows ('use_sliding_window') are not supported");

    result.vocab_size = int_field(config, "vocab_size", source);
    result.hidden_size = int_field(config, "hidden_size", source);
    result.intermediate_size = int_field(config, "intermediate_size", source);
    result.num_layers = int_field(config, "num_hidden_layers", source);
    result.num_heads = int_field(config, "num_attention_heads", source);
    result.num_kv_heads = int_field_or(config, "num_key_value_heads", result.num_heads);
    result.head_dim = int_field_or(
        config, "head_dim", result.num_heads > 0 ? result.hidden_size / result.num_heads : 0);
    result.max_position_embeddings = int_field_or(config, "max_position_embeddings", 2048);
    result.rms_norm_eps = number_field_or(config, "rms_norm_eps", 1e-6);
    result.rope_theta = number_field_or(config, "rope_theta", 10000.0);
    result.rope_scaling = parse_rope_scaling(config, source);
    result.rope_layout = RopeLayout::half_split;
    result.tie_word_embeddings = bool_field_or(config, "tie_word_embeddings", false);
    result.bos_token_id = first_token_id(config, "bos_token_id");
    result.eos_token_id = first_token_id(config, "eos_token_id");

    const bool is_qwen2 = result.architecture == "Qwen2ForCausalLM";
    const bool is_qwen3 = result.architecture == "Qwen3ForCausalLM";
    // Qwen2's attention always has q/k/v biases; the others say so in the config.
    result.attention_bias = is_qwen2 || bool_field_or(config, "attention_bias", false);
    result.qk_norm = is_qwen3;
    if (result.architecture == "MistralForCausalLM")
        result.sliding_window = int_field_or(config, "sliding_window", 0);

    const json::Value* dtype = config.find("torch_dtype");
    if (!dtype) dtype = config.find("dtype");
    if (dtype && dtype->is_string()) {
        const std::string& name = dtype->as_string();
        if (name == "bfloat16")
            result.weights_dtype = "bf16";
        else if (name == "float16")
            result.weights_dtype = "f16";
        else
            result.weights_dtype = "f32";
    }
    validate_config(result, source);
    return result;
}

void validate_config(const ModelConfig& config, const std::string& source) {
    auto positive = [&](int64_t value, const char* name) {
        if (value <= 0 || value > (int64_t{1} << 40))
            throw FormatError(source + ": '" + name + "' must be positive, got " +
                              std::to_string(value));
    };
    positive(config.vocab_size, "vocab_size");
    positive(config.hidden_size, "hidden_size");
    positive(config.intermediate_size, "intermediate_size");
    positive(config.num_layers, "num_hidden_layers");
    positive(config.num_heads, "num_attention_heads");
    positive(config.num_kv_heads, "num_key_value_heads");
    positive(config.head_dim, "head_dim");
    positive(config.max_position_embeddings, "max_position_embeddings");
    if (config.num_heads % config.num_kv_heads != 0)
        throw FormatError(source + ": num_attention_heads (" + std::to_string(config.num_heads) +
                          ") is not a multiple of num_key_value_heads (" +
                          std::to_string(config.num_kv_heads) + ")");
    if (config.head_dim % 2 != 0)
        throw FormatError(source + ": head_dim must be even for RoPE, got " +
                          std::to_string(config.head_dim));
    if (!(config.rope_theta > 0)) throw FormatError(source + ": rope_theta must be positive");
    if (!(config.rms_norm_eps > 0)) throw FormatError(source + ": rms_norm_eps must be positive");
    if (config.sliding_window < 0)
        throw FormatError(source + ": sliding_window must not be negative");
}

json::Value config_to_hf_json(const ModelConfig& config) {
    json::Value result = json::Value::object();
    json::Value architectures = json::Value::array();
    architectures.push_back(config.architecture);
    result.set("architectures", std::move(architectures));
    result.set("hidden_act", "silu");
    result.set("vocab_size", config.vocab_size);
    result.set("hidden_size", config.hidden_size);
    result.set("intermediate_size", config.intermediate_size);
    result.set("num_hidden_layers", config.num_layers);
    result.set("num_attention_heads", config.num_heads);
    result.set("num_key_value_heads", config.num_kv_heads);
    result.set("head_dim", config.head_dim);
    result.set("max_position_embeddings", config.max_position_embeddings);
    result.set("rms_norm_eps", config.rms_norm_eps);
    result.set("rope_theta", config.rope_theta);
    result.set("tie_word_embeddings", config.tie_word_embeddings);
    if (config.architecture == "LlamaForCausalLM" || config.architecture == "Qwen3ForCausalLM")
        result.set("attention_bias", config.attention_bias);
    if (config.sliding_window > 0) result.set("sliding_window", config.sliding_window);
    if (config.bos_token_id >= 0) result.set("bos_token_id", config.bos_token_id);
    if (config.eos_token_id >= 0) result.set("eos_token_id", config.eos_token_id);
    result.set("torch_dtype", config.weights_dtype == "bf16"  ? "bfloat16"
                              : config.weights_dtype == "f16" ? "float16"
                                                              : "float32");
    if (config.rope_scaling.type != RopeScalingType::none) {
        json::Value scaling = json::Value::object();
        const bool llama3 = config.rope_scaling.type == RopeScalingType::llama3;
        scaling.set("rope_type", llama3 ? "llama3" : "linear");
        scaling.set("factor", config.rope_scaling.factor);
        if (llama3) {
            scaling.set("low_freq_factor", config.rope_scaling.low_freq_factor);
            scaling.set("high_freq_factor", config.rope_scaling.high_freq_factor);
            scaling.set("original_max_position_embeddings",
                        config.rope_scaling.original_max_position_embeddings);
        }
        result.set("rope_scaling", std::move(scaling));
    }
    return result;
}

}  // namespace kv
