// Models loaded from GGUF files against the same weights loaded from Hugging Face's layout. The
// test converts them itself as llama.cpp's convert_hf_to_gguf.py does: GGUF names, shapes
// reversed, q and k permuted for llama-architecture files, norms and biases kept in F32, the
// matrices in F32, F16, BF16 or Q8_0 (ggml's quantize_row_q8_0_ref).
#include "kv/error.hpp"
#include "kv/float_convert.hpp"
#include "kv/gguf.hpp"
#include "kv/model/model.hpp"
#include "kv/safetensors.hpp"

#include "gguf_writer.hpp"
#include "random_model.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>

using namespace kv;
using kv::test::GgufWriter;

namespace {

const std::filesystem::path demo_model =
    std::filesystem::path(KV_TEST_DATA_DIR) / "../../models/demo";

// convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from Hugging Face's halves to
// llama.cpp's interleaved pairs.
torch::Tensor permute(const torch::Tensor& weights, int64_t heads) {
    std::vector<int64_t> sizes = weights.sizes().vec();
    std::vector<int64_t> split = {heads, 2, sizes[0] / heads / 2};
    split.insert(split.end(), sizes.begin() + 1, sizes.end());
    return weights.reshape(split).transpose(1, 2).reshape(sizes).contiguous();
}

// ggml's quantize_row_q8_0_ref: per block of 32, d = max|x| / 127, q = round(x / d).
std::string quantize_q8_0(const torch::Tensor& tensor) {
    const torch::Tensor values = tensor.to(torch::kFloat32).contiguous().reshape({-1});
    const float* x = values.data_ptr<float>();
    std::string out;
    for (int64_t block = 0; block < values.numel() / 32; ++block) {
        float amax = 0;
        for (int j = 0; j < 32; ++j)
            amax = std::max(amax, std::abs(x[block * 32 + j]));
        const float d = amax / 127.0f;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        const uint16_t scale = float_to_f16(d);
        out.append(reinterpret_cast<const char*>(&scale), 2);
        for (int j = 0; j < 32; ++j)
            out.push_back(
                static_cast<char>(static_cast<int8_t>(std::round(x[block * 32 + j] * id))));
    }
    return out;
}

std::string tensor_bytes(const torch::Tensor& tensor, uint32_t type) {
    if (type == ggml_type::q8_0) return quantize_q8_0(tensor);
    const torch::ScalarType dtype = type == ggml_type::f32   ? torch::kFloat32
                                    : type == ggml_type::f16 ? torch::kFloat16
                                                             : torch::kBFloat16;
    const torch::Tensor converted = tensor.to(dtype).contiguous();
    return std::string(static_cast<const char*>(converted.data_ptr()), converted.nbytes());
}

struct Conversion {
    uint32_t matrix_type = ggml_type::f32;
    std::string chat_template;
};

// Hugging Face weights to a GGUF file of the architecture the config names.
std::string to_gguf(const LoadedWeights& loaded, const Conversion& conversion) {
    const ModelConfig& c = loaded.config;
    const std::string architecture = c.architecture == "Qwen2ForCausalLM"   ? "qwen2"
                                     : c.architecture == "Qwen3ForCausalLM" ? "qwen3"
                                                                            : "llama";
    const std::string p = architecture + ".";
    GgufWriter writer;
    writer.string("general.architecture", architecture)
        .u32(p + "context_length", static_cast<uint32_t>(c.max_position_embeddings))
        .u32(p + "embedding_length", static_cast<uint32_t>(c.hidden_size))
        .u32(p + "block_count", static_cast<uint32_t>(c.num_layers))
        .u32(p + "feed_forward_length", static_cast<uint32_t>(c.intermediate_size))
        .u32(p + "attention.head_count", static_cast<uint32_t>(c.num_heads))
        .u32(p + "attention.head_count_kv", static_cast<uint32_t>(c.num_kv_heads))
        .u32(p + "attention.key_length", static_cast<uint32_t>(c.head_dim))
        .u32(p + "attention.value_length", static_cast<uint32_t>(c.head_dim))
        .u32(p + "rope.dimension_count", static_cast<uint32_t>(c.head_dim))
        .f32(p + "rope.freq_base", static_cast<float>(c.rope_theta))
        .f32(p + "attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
    if (c.bos_token_id >= 0)
        writer.u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(c.bos_token_id));
    if (c.eos_token_id >= 0)
        writer.u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(c.eos_token_id));
    if (!conversion.chat_template.empty())
        writer.string("tokenizer.chat_template", conversion.chat_template);

    const std::pair<std::string, std::string> global[] = {
        {"model.embed_tokens.weight", "token_embd.weight"},
        {"model.norm.weight", "output_norm.weight"},
        {"lm_head.weight", "output.weight"}};
    const std::pair<std::string, std::string> per_layer[] = {
        {"input_layernorm.weight", "attn_norm.weight"},
        {"self_attn.q_proj.weight", "attn_q.weight"},
        {"self_attn.k_proj.weight", "attn_k.weight"},
        {"self_attn.v_proj.weight", "attn_v.weight"},
        {"self_attn.o_proj.weight", "attn_output.weight"},
        {"self_attn.q_proj.bias", "attn_q.bias"},
        {"self_attn.k_proj.bias", "attn_k.bias"},
        {"self_attn.v_proj.bias", "attn_v.bias"},
        {"self_attn.q_norm.weight", "attn_q_norm.weight"},
        {"self_attn.k_norm.weight", "attn_k_norm.weight"},
        {"post_attention_layernorm.weight", "ffn_norm.weight"},
        {"mlp.gate_proj.weight", "ffn_gate.weight"},
        {"mlp.up_proj.weight", "ffn_up.weight"},
        {"mlp.down_proj.weight", "ffn_down.weight"}};
    auto add = [&](const std::string& hf, const std::string& gguf) {
        const auto found = loaded.weights.find(hf);
        if (found == loaded.weights.end()) return;
        torch::Tensor tensor = found->second;
        if (architecture == "llama" && (hf.find("q_proj") != std::string::npos))
            tensor = permute(tensor, c.num_heads);
        if (architecture == "llama" && (hf.find("k_proj") != std::string::npos))
            tensor = permute(tensor, c.num_kv_heads);
        // The converter keeps vectors (norms, biases) in F32 whatever the output type.
        const uint32_t type = tensor.dim() == 1 ? ggml_type::f32 : conversion.matrix_type;
        writer.tensor(gguf, tensor.sizes().vec(), type, tensor_bytes(tensor, type));
    };
    for (const auto& [hf, gguf] : global)
        add(hf, gguf);
    for (int64_t layer = 0; layer < c.num_layers; ++layer)
        for (const auto& [hf, gguf] : per_layer)
            add("model.layers." + std::to_string(layer) + "." + hf,
                "blk." + std::to_string(layer) + "." + gguf);
    return writer.bytes();
}

torch::Tensor logits_of(const Model& model, const std::vector<int32_t>& ids) {
    torch::NoGradGuard no_grad;
    KvCache cache = model.new_cache();
    const torch::Tensor positions = torch::arange(static_cast<int64_t>(ids.size()), torch::kInt64);
    return model.logits(model.forward(model.embed(ids), positions, cache));
}

double max_difference(const torch::Tensor& logits, const std::vector<reference::Vector>& expected) {
    double worst = 0;
    const torch::Tensor cpu = logits.to(torch::kFloat64).contiguous();
    for (int64_t t = 0; t < cpu.size(0); ++t)
        for (int64_t v = 0; v < cpu.size(1); ++v)
            worst = std::max(worst, std::abs(cpu[t][v].item<double>() - expected[t][v]));
    return worst;
}

}  // namespace

TEST_CASE("the demo model from GGUF decodes bit for bit as from its folder", "[gguf][decoder]") {
    test::TempDir dir;
    const LoadedWeights folder = load_weights(demo_model);
    const std::vector<int32_t> ids = {1020, 17, 300, 45, 900, 2, 2, 611, 80, 1019, 5, 64};
    for (const auto& [name, type] :
         {std::pair<std::string, uint32_t>{"bf16", ggml_type::bf16}, {"f32", ggml_type::f32}}) {
        DYNAMIC_SECTION(name) {
            const std::filesystem::path path = dir / ("demo-" + name + ".gguf");
            test::write_file(path, to_gguf(folder, {type, "{{ messages }}"}));
            // Each in its default dtype: bf16 for both bf16 files, f32 for the f32 GGUF (the
            // folder asked for f32 explicitly).
            const auto from_gguf = Model::load({path, "auto", "cpu"});
            const auto from_folder = Model::load({demo_model, name, "cpu"});
            CHECK(from_gguf->dtype() == from_folder->dtype());
            CHECK(from_gguf->config().architecture == "LlamaForCausalLM");
            CHECK(from_gguf->config().rms_norm_eps == from_folder->config().rms_norm_eps);
            CHECK(from_gguf->chat_template() == "{{ messages }}");
            CHECK(from_folder->chat_template().empty());
            const torch::Tensor expected = logits_of(*from_folder, ids);
            const torch::Tensor actual = logits_of(*from_gguf, ids);
            CHECK(torch::equal(actual, expected));

            // And by chunked prefill and decode, through the cache.
            KvCache a = from_gguf->new_cache(), b = from_folder->new_cache();
            torch::NoGradGuard no_grad;
            CHECK(torch::equal(from_gguf->prefill(ids, a, 5), from_folder->prefill(ids, b, 5)));
            for (int64_t layer = 0; layer < from_gguf->config().num_layers; ++layer)
                CHECK(torch::equal(a.keys(layer), b.keys(layer)));
        }
    }
}

TEST_CASE("GGUF files of every architecture decode as the Hugging Face weights",
          "[gguf][decoder]") {
    const std::vector<int> tokens = {1, 5, 9, 2, 33, 17, 4, 4, 30, 11};
    const std::vector<int32_t> ids(tokens.begin(), tokens.end());
    test::TempDir dir;
    for (const std::string architecture :
         {"LlamaForCausalLM", "llama with biases", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}) {
        DYNAMIC_SECTION(architecture) {
            const bool biases = architecture == "llama with biases";
            ModelConfig config = testing::small_config(biases ? "LlamaForCausalLM" : architecture);
            config.attention_bias = config.attention_bias || biases;
            testing::TwinModel twin = testing::make_random_model(config, 11);
            const auto expected = twin.reference.forward(tokens);
            const std::filesystem::path path = dir / "model.gguf";
            test::write_file(path, to_gguf(twin.weights, {ggml_type::f32, ""}));
            const auto from_gguf = Model::load({path, "auto", "cpu"});
            const auto direct = Model::from_weights(twin.weights, torch::kFloat32, torch::kCPU);
            CHECK(from_gguf->config().attention_bias == config.attention_bias);
            CHECK(from_gguf->config().qk_norm == config.qk_norm);
            CHECK(from_gguf->config().tie_word_embeddings == config.tie_word_embeddings);
            const torch::Tensor logits = logits_of(*from_gguf, ids);
            CHECK(torch::equal(logits, logits_of(*direct, ids)));
            CHECK(max_difference(logits, expected) < 1e-4);
        }
    }
}

// F16 and Q8_0 change the weights: each weight loads as exactly what ggml's dequantisation gives
// (F16 widened, Q8_0 scale times int8), and against the float64 reference of the original float32
// weights the logits (up to 25.7 here) stay within three times what these weights were measured
// to give: F16 0.0103 (4e-4 of the largest logit), Q8_0 0.377 (1.5%).
TEST_CASE("F16 and Q8_0 GGUF weights decode within their precision of float64", "[gguf][decoder]") {
    const std::vector<int> tokens = {1, 5, 9, 2, 33, 17, 4, 4, 30, 11};
    const std::vector<int32_t> ids(tokens.begin(), tokens.end());
    test::TempDir dir;
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    config.hidden_size = 64;  // rows of Q8_0 blocks of 32
    config.intermediate_size = 96;
    config.head_dim = 16;
    testing::TwinModel twin = testing::make_random_model(config, 5);
    const auto expected = twin.reference.forward(tokens);
    for (const auto& [name, type, tolerance] :
         {std::tuple<std::string, uint32_t, double>{"F16", ggml_type::f16, 0.031},
          {"Q8_0", ggml_type::q8_0, 1.13}}) {
        DYNAMIC_SECTION(name) {
            const std::filesystem::path path = dir / "model.gguf";
            test::write_file(path, to_gguf(twin.weights, {type, ""}));
            const LoadedWeights loaded = load_weights(path);
            for (const auto& [weight, original] : twin.weights.weights) {
                if (original.dim() != 2) continue;
                INFO(weight);
                REQUIRE(loaded.weights.count(weight));
                torch::Tensor expected_weight = original.to(torch::kFloat16).to(torch::kFloat32);
                if (type == ggml_type::q8_0) {
                    const std::string blocks = quantize_q8_0(original);
                    expected_weight = torch::empty_like(original);
                    float* out = expected_weight.data_ptr<float>();
                    for (std::size_t block = 0; block < blocks.size() / 34; ++block) {
                        uint16_t scale;
                        std::memcpy(&scale, blocks.data() + block * 34, 2);
                        for (std::size_t j = 0; j < 32; ++j)
                            out[block * 32 + j] =
                                f16_to_float(scale) *
                                static_cast<float>(static_cast<int8_t>(blocks[block * 34 + 2 + j]));
                    }
                }
                CHECK(torch::equal(loaded.weights.at(weight).to(torch::kFloat32), expected_weight));
            }
            const auto model = Model::load({path, "auto", "cpu"});
            CHECK(model->dtype() == torch::kFloat32);
            const double difference = max_difference(logits_of(*model, ids), expected);
            double scale = 0;
            for (const reference::Vector& row : expected)
                for (double logit : row)
                    scale = std::max(scale, std::abs(logit));
            INFO(name << " differs from float64 by " << difference << " of logits up to " << scale);
            CHECK(difference < tolerance);
            CHECK(difference > 0);  // the weights did change
        }
    }
}

TEST_CASE("GGUF tensors kvtools cannot use are refused by name", "[gguf][decoder]") {
    test::TempDir dir;
    testing::TwinModel twin =
        testing::make_random_model(testing::small_config("LlamaForCausalLM"), 3);
    auto error_of = [&](const std::string& bytes) -> std::string {
        test::write_file(dir / "m.gguf", bytes);
        try {
            Model::load({dir / "m.gguf", "auto", "cpu"});
        } catch (const kv::Error& error) {
            return error.what();
        }
        return "no error";
    };
    const std::string where = "'" + (dir / "m.gguf").string() + "'";
    std::string bytes = to_gguf(twin.weights, {ggml_type::f32, ""});
    // The type of blk.1.ffn_up.weight rewritten to Q4_K (12), its 48 x 32 floats being enough
    // bytes for the 6 blocks of 256 it then holds.
    const std::string name = "blk.1.ffn_up.weight";
    const std::size_t at = bytes.find(name);
    REQUIRE(at != std::string::npos);
    const std::size_t type_field = at + name.size() + 4 + 2 * 8;
    REQUIRE(bytes[type_field] == 0);
    std::string q4k = bytes;
    q4k[type_field] = 12;
    // Q4_K needs rows of 256: this one has 32, so the reader refuses it before the loader would.
    CHECK(error_of(q4k) == where +
                               ": tensor 'blk.1.ffn_up.weight' of type Q4_K has 32 elements "
                               "per row, not a multiple of its block of 256");
    std::string i32 = bytes;
    i32[type_field] = 26;  // I32, the same size as F32
    CHECK(error_of(i32) == where +
                               ": tensor 'blk.1.ffn_up.weight' has type I32 (supported: F32, "
                               "F16, BF16, and Q8_0 dequantised to F32 at load)");
    std::string renamed = bytes;
    renamed.replace(at, name.size(), "blk.1.ffn_xx.weight");
    CHECK(error_of(renamed) ==
          where +
              ": tensor 'blk.1.ffn_xx.weight' is not one of a Llama, Mistral or Qwen decoder's");
    test::write_file(dir / "t.gguf", bytes.substr(0, bytes.size() - 1));
    CHECK_THROWS_AS(Model::load({dir / "t.gguf", "auto", "cpu"}), FormatError);
}
