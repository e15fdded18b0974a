// Small models with seeded random weights, built twice: as runtime weights (libtorch) and as the
// float64 reference, from the same numbers.
#pragma once

#include "kv/model/model.hpp"
#include "reference.hpp"

#include <random>

namespace kv::testing {

struct TwinModel {
    LoadedWeights weights;
    reference::Model reference;
};

inline TwinModel make_random_model(const ModelConfig& config, uint64_t seed) {
    std::mt19937_64 generator(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    TwinModel twin;
    twin.weights.config = config;
    twin.weights.source = "'random model'";
    reference::Model& ref = twin.reference;
    ref.heads = static_cast<int>(config.num_heads);
    ref.kv_heads = static_cast<int>(config.num_kv_heads);
    ref.head_dim = static_cast<int>(config.head_dim);
    ref.eps = config.rms_norm_eps;
    ref.rope.theta = config.rope_theta;
    ref.rope.head_dim = static_cast<int>(config.head_dim);
    ref.rope.interleaved = config.rope_layout == RopeLayout::interleaved;
    if (config.rope_scaling.type == RopeScalingType::llama3) {
        ref.rope.llama3_factor = config.rope_scaling.factor;
        ref.rope.low_freq_factor = config.rope_scaling.low_freq_factor;
        ref.rope.high_freq_factor = config.rope_scaling.high_freq_factor;
        ref.rope.original_context =
            static_cast<double>(config.rope_scaling.original_max_position_embeddings);
    }

    auto matrix = [&](const std::string& name, int64_t rows, int64_t columns, double scale) {
        reference::Matrix values(static_cast<std::size_t>(rows),
                                 reference::Vector(static_cast<std::size_t>(columns)));
        torch::Tensor tensor = torch::empty({rows, columns}, torch::kFloat32);
        auto access = tensor.accessor<float, 2>();
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < columns; ++c) {
                // Round through float so both sides hold exactly the same numbers.
                const float value = static_cast<float>(normal(generator) * scale);
                access[r][c] = value;
                values[r][c] = value;
            }
        twin.weights.weights[name] = tensor;
        return values;
    };
    auto vector = [&](const std::string& name, int64_t size, double mean, double scale) {
        reference::Matrix as_matrix = matrix(name, 1, size, scale);
        for (double& v : as_matrix[0])
            v = static_cast<float>(v + mean);
        twin.weights.weights[name] =
            torch::tensor(std::vector<float>(as_matrix[0].begin(), as_matrix[0].end()));
        return as_matrix[0];
    };

    const int64_t hidden = config.hidden_size, q_dim = config.num_heads * config.head_dim;
    const int64_t kv_dim = config.kv_dim(), inner = config.intermediate_size;
    const double projection_scale = 1.0 / std::sqrt(static_cast<double>(hidden));
    ref.embedding = matrix("model.embed_tokens.weight", config.vocab_size, hidden, 1.0);
    for (int64_t i = 0; i < config.num_layers; ++i) {
        const std::string p = "model.layers." + std::to_string(i) + ".";
        reference::Layer layer;
        layer.attention_norm = vector(p + "input_layernorm.weight", hidden, 1.0, 0.1);
        layer.wq = matrix(p + "self_attn.q_proj.weight", q_dim, hidden, projection_scale);
        layer.wk = matrix(p + "self_attn.k_proj.weight", kv_dim, hidden, projection_scale);
        layer.wv = matrix(p + "self_attn.v_proj.weight", kv_dim, hidden, projection_scale);
        layer.wo = matrix(p + "self_attn.o_proj.weight", hidden, q_dim,
                          1.0 / std::sqrt(static_cast<double>(q_dim)));
        if (config.attention_bias) {
            layer.q_bias = vector(p + "self_attn.q_proj.bias", q_dim, 0.0, 0.5);
            layer.k_bias = vector(p + "self_attn.k_proj.bias", kv_dim, 0.0, 0.5);
            layer.v_bias = vector(p + "self_attn.v_proj.bias", kv_dim, 0.0, 0.5);
        }
        if (config.qk_norm) {
            layer.q_norm = vector(p + "self_attn.q_norm.weight", config.head_dim, 1.0, 0.3);
            layer.k_norm = vector(p + "self_attn.k_norm.weight", config.head_dim, 1.0, 0.3);
        }
        layer.mlp_norm = vector(p + "post_attention_layernorm.weight", hidden, 1.0, 0.1);
        layer.gate = matrix(p + "mlp.gate_proj.weight", inner, hidden, projection_scale);
        layer.up = matrix(p + "mlp.up_proj.weight", inner, hidden, projection_scale);
        layer.down = matrix(p + "mlp.down_proj.weight", hidden, inner,
                            1.0 / std::sqrt(static_cast<double>(inner)));
        ref.layers.push_back(std::move(layer));
    }
    ref.final_norm = vector("model.norm.weight", hidden, 1.0, 0.1);
    ref.lm_head = config.tie_word_embeddings
                      ? ref.embedding
                      : matrix("lm_head.weight", config.vocab_size, hidden, 1.0);
    return twin;
}

/// A small config of the given architecture; the flags follow what each architecture implies.
inline ModelConfig small_config(const std::string& architecture) {
    ModelConfig config;
    config.architecture = architecture;
    config.vocab_size = 37;
    config.hidden_size = 32;
    config.intermediate_size = 48;
    config.num_layers = 2;
    config.num_heads = 4;
    config.num_kv_heads = 2;
    config.head_dim = 8;
    config.max_position_embeddings = 4096;
    config.rope_theta = 10000;
    config.rms_norm_eps = 1e-5;
    if (architecture == "Qwen2ForCausalLM") {
        config.attention_bias = true;
        config.rope_theta = 1e6;
    }
    if (architecture == "Qwen3ForCausalLM") {
        config.qk_norm = true;
        config.head_dim = 16;  // Qwen3 decouples head_dim from hidden_size / heads
        config.tie_word_embeddings = true;
    }
    if (architecture == "llama2.c") {
        config.rope_layout = RopeLayout::interleaved;
        config.tie_word_embeddings = true;
    }
    return config;
}

}  // namespace kv::testing
