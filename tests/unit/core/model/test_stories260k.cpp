// Greedy decoding of the real stories260K model against llama2.c's run.c, token for token, from
// the llama2.c checkpoint and from the same model converted to a Hugging Face folder.
#include "kv/json.hpp"
#include "kv/mapped_file.hpp"
#include "kv/model/model.hpp"
#include "kv/safetensors.hpp"
#include "kv/sampler.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

using namespace kv;

namespace {

struct Golden {
    std::vector<int32_t> prompt_ids, generated_ids;
};

Golden read_golden(const std::string& name) {
    const json::Value value =
        json::parse(read_file_text(std::filesystem::path(KV_TEST_DATA_DIR) / "stories260K" / name));
    Golden golden;
    for (const json::Value& id : value.at("prompt_ids").as_array())
        golden.prompt_ids.push_back(static_cast<int32_t>(id.as_int()));
    for (const json::Value& id : value.at("generated_ids").as_array())
        golden.generated_ids.push_back(static_cast<int32_t>(id.as_int()));
    return golden;
}

std::vector<int32_t> greedy_decode(const Model& model, const std::vector<int32_t>& prompt,
                                   std::size_t count) {
    torch::NoGradGuard no_grad;
    KvCache cache = model.new_cache();
    torch::Tensor logits = model.prefill(prompt, cache);
    std::vector<int32_t> generated;
    while (generated.size() < count) {
        const int32_t next =
            argmax({logits.data_ptr<float>(), static_cast<std::size_t>(logits.numel())});
        generated.push_back(next);
        logits = model.prefill(std::span<const int32_t>(&generated.back(), 1), cache);
    }
    return generated;
}

// Meta's interleaved RoPE pairs (2i, 2i+1); Hugging Face's half-split pairs (i, i + D/2).
// Reordering the rows of Wq and Wk within each head turns one layout into the other.
torch::Tensor permute_for_half_split(const torch::Tensor& weight, int64_t heads) {
    const int64_t rows = weight.size(0), columns = weight.size(1);
    return weight.view({heads, rows / heads / 2, 2, columns})
        .transpose(1, 2)
        .reshape({rows, columns})
        .contiguous();
}

void write_hf_folder(const LoadedWeights& loaded, const std::filesystem::path& folder) {
    ModelConfig config = loaded.config;
    config.architecture = "LlamaForCausalLM";
    config.rope_layout = RopeLayout::half_split;
    std::filesystem::create_directories(folder);
    const std::string config_text = json::dump(config_to_hf_json(config), 2);
    write_file_atomic(folder / "config.json", config_text.data(), config_text.size());

    std::vector<torch::Tensor> keep_alive;
    std::vector<SafetensorsTensorView> views;
    for (const auto& [name, tensor] : loaded.weights) {
        torch::Tensor stored = tensor.contiguous();
        if (name.ends_with("q_proj.weight"))
            stored = permute_for_half_split(stored, config.num_heads);
        if (name.ends_with("k_proj.weight"))
            stored = permute_for_half_split(stored, config.num_kv_heads);
        keep_alive.push_back(stored);
        views.push_back({name, "F32", stored.sizes().vec(), stored.data_ptr(),
                         static_cast<std::size_t>(stored.nbytes())});
    }
    write_safetensors(folder / "model.safetensors", views);
}

}  // namespace

TEST_CASE("stories260K decodes greedily exactly as llama2.c run.c", "[model]") {
    const auto checkpoint = test::shared_model_file("stories260K/stories260K.bin");
    if (checkpoint.empty()) return;
    const auto model = Model::load({checkpoint, "f32", "cpu"});
    CHECK(model->config().rope_layout == RopeLayout::interleaved);
    CHECK(model->config().num_kv_heads == 4);
    for (const std::string name : {"golden-empty.json", "golden-prompt.json"}) {
        DYNAMIC_SECTION(name) {
            const Golden golden = read_golden(name);
            REQUIRE(golden.generated_ids.size() >= 200);
            CHECK(greedy_decode(*model, golden.prompt_ids, golden.generated_ids.size()) ==
                  golden.generated_ids);
        }
    }
}

TEST_CASE("stories260K converted to a Hugging Face folder decodes identically", "[model]") {
    const auto checkpoint = test::shared_model_file("stories260K/stories260K.bin");
    if (checkpoint.empty()) return;
    test::TempDir directory;
    write_hf_folder(load_llama2c_checkpoint(checkpoint), directory.path() / "stories260K-hf");

    const auto model = Model::load({directory.path() / "stories260K-hf", "auto", "cpu"});
    CHECK(model->config().architecture == "LlamaForCausalLM");
    CHECK(model->config().rope_layout == RopeLayout::half_split);
    CHECK(model->dtype() == torch::kFloat32);
    for (const std::string name : {"golden-empty.json", "golden-prompt.json"}) {
        DYNAMIC_SECTION(name) {
            const Golden golden = read_golden(name);
            CHECK(greedy_decode(*model, golden.prompt_ids, golden.generated_ids.size()) ==
                  golden.generated_ids);
        }
    }
}
