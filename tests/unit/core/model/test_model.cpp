// The whole decoder against the float64 reference, for every architecture's flags.
#include "kv/model/model.hpp"
#include "random_model.hpp"

#include <catch2/catch.hpp>

#include <numeric>

using namespace kv;

namespace {

double max_logit_difference(const torch::Tensor& logits,
                            const std::vector<reference::Vector>& expected,
                            std::size_t first_row = 0) {
    double worst = 0;
    const torch::Tensor cpu = logits.to(torch::kFloat64).contiguous();
    for (int64_t t = 0; t < cpu.size(0); ++t)
        for (int64_t v = 0; v < cpu.size(1); ++v)
            worst =
                std::max(worst, std::abs(cpu[t][v].item<double>() - expected[first_row + t][v]));
    return worst;
}

torch::Tensor positions_range(int64_t begin, int64_t end) {
    return torch::arange(begin, end, torch::kInt64);
}

}  // namespace

TEST_CASE("the decoder matches the float64 reference for every architecture", "[decoder]") {
    const std::vector<int> tokens = {1, 5, 9, 2, 33, 17, 4, 4, 30, 11};
    std::vector<int32_t> ids(tokens.begin(), tokens.end());
    for (const std::string architecture :
         {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
          "llama2.c", "llama3-scaled"}) {
        DYNAMIC_SECTION(architecture) {
            ModelConfig config = testing::small_config(
                architecture == "llama3-scaled" ? "LlamaForCausalLM" : architecture);
            if (architecture == "llama3-scaled") {
                config.rope_theta = 500000;
                config.rope_scaling = {RopeScalingType::llama3, 8.0, 1.0, 4.0, 64};
            }
            testing::TwinModel twin = testing::make_random_model(config, 42);
            const auto expected = twin.reference.forward(tokens);
            auto model = Model::from_weights(std::move(twin.weights), torch::kFloat32, torch::kCPU);
            torch::NoGradGuard no_grad;

            // One pass over every token.
            KvCache whole = model->new_cache();
            const torch::Tensor all = model->logits(model->forward(
                model->embed(ids), positions_range(0, static_cast<int64_t>(ids.size())), whole));
            CHECK(max_logit_difference(all, expected) < 1e-4);

            // Chunked prefill then token-by-token decode agree with it.
            KvCache incremental = model->new_cache(2);  // forces the cache to grow
            const torch::Tensor first =
                model->prefill(std::span<const int32_t>(ids).first(3), incremental, 2);
            CHECK(max_logit_difference(first.unsqueeze(0), expected, 2) < 1e-4);
            for (std::size_t t = 3; t < ids.size(); ++t) {
                const torch::Tensor step =
                    model->prefill(std::span<const int32_t>(ids).subspan(t, 1), incremental);
                CHECK(max_logit_difference(step.unsqueeze(0), expected, t) < 1e-4);
            }
            CHECK(incremental.length() == static_cast<int64_t>(ids.size()));
            CHECK(incremental.next_position() == static_cast<int64_t>(ids.size()));

            // Layer by layer (kvserve-once --document), after two tokens prefilled as usual, in
            // chunks of 3: the same logits and the same cache, each layer reported once, in order.
            KvCache by_layer = model->new_cache(2);
            model->prefill(std::span<const int32_t>(ids).first(2), by_layer);
            std::vector<int64_t> finished;
            const torch::Tensor last = model->prefill_by_layer(
                std::span<const int32_t>(ids).subspan(2), by_layer, 3, [&](int64_t layer) {
                    finished.push_back(layer);
                    // Its keys are final while later layers compute.
                    CHECK(torch::allclose(by_layer.keys(layer), whole.keys(layer), 1e-5, 1e-5));
                });
            CHECK(max_logit_difference(last.unsqueeze(0), expected, ids.size() - 1) < 1e-4);
            std::vector<int64_t> every_layer(static_cast<std::size_t>(config.num_layers));
            std::iota(every_layer.begin(), every_layer.end(), 0);
            CHECK(finished == every_layer);
            REQUIRE(by_layer.length() == static_cast<int64_t>(ids.size()));
            CHECK(by_layer.next_position() == static_cast<int64_t>(ids.size()));
            for (int64_t layer = 0; layer < config.num_layers; ++layer) {
                CHECK(torch::allclose(by_layer.keys(layer), whole.keys(layer), 1e-5, 1e-5));
                CHECK(torch::allclose(by_layer.values(layer), whole.values(layer), 1e-5, 1e-5));
            }
        }
    }
}

TEST_CASE("a block-diagonal mask makes documents attend only to themselves", "[decoder]") {
    ModelConfig config = testing::small_config("Qwen3ForCausalLM");
    testing::TwinModel twin = testing::make_random_model(config, 7);
    const std::vector<int> tokens = {3, 8, 13, 21, 5, 6, 7};
    const std::vector<int> document = {0, 0, 0, 1, 1, 2, 2};
    const auto expected = twin.reference.forward(tokens, document);
    auto model = Model::from_weights(std::move(twin.weights), torch::kFloat32, torch::kCPU);
    torch::NoGradGuard no_grad;
    torch::Tensor allow = torch::zeros({7, 7}, torch::kBool);
    for (int i = 0; i < 7; ++i)
        for (int j = 0; j < 7; ++j)
            allow[i][j] = document[i] == document[j];
    KvCache cache = model->new_cache();
    std::vector<int32_t> ids(tokens.begin(), tokens.end());
    const torch::Tensor logits =
        model->logits(model->forward(model->embed(ids), positions_range(0, 7), cache, allow));
    CHECK(max_logit_difference(logits, expected) < 1e-4);
}

TEST_CASE("bf16 compute stays close to f32", "[decoder]") {
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    testing::TwinModel twin = testing::make_random_model(config, 3);
    const std::vector<int> tokens = {1, 2, 3, 4, 5, 6};
    const auto expected = twin.reference.forward(tokens);
    auto model = Model::from_weights(std::move(twin.weights), torch::kBFloat16, torch::kCPU);
    std::vector<int32_t> ids(tokens.begin(), tokens.end());
    KvCache cache = model->new_cache();
    const torch::Tensor last = model->prefill(ids, cache);
    CHECK(last.scalar_type() == torch::kFloat32);
    CHECK(max_logit_difference(last.unsqueeze(0), expected, 5) < 0.25);
}

TEST_CASE("weights with the wrong shape or missing are named in the error", "[decoder]") {
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    testing::TwinModel twin = testing::make_random_model(config, 1);
    SECTION("missing") {
        twin.weights.weights.erase("model.layers.1.mlp.up_proj.weight");
        CHECK_THROWS_WITH(
            Model::from_weights(std::move(twin.weights), torch::kFloat32, torch::kCPU),
            Catch::Contains("missing tensor 'model.layers.1.mlp.up_proj.weight'"));
    }
    SECTION("wrong shape") {
        twin.weights.weights["model.norm.weight"] = torch::ones({3});
        CHECK_THROWS_WITH(
            Model::from_weights(std::move(twin.weights), torch::kFloat32, torch::kCPU),
            Catch::Contains("'model.norm.weight' has shape [3], the config needs [32]"));
    }
}

TEST_CASE("the differentiable sequence forward matches the reference and its gradients",
          "[decoder]") {
    const std::vector<int> tokens = {1, 5, 9, 2, 33, 17, 4, 4, 30, 11};
    const std::vector<int32_t> ids(tokens.begin(), tokens.end());
    const ModelConfig config = testing::small_config("LlamaForCausalLM");
    testing::TwinModel twin = testing::make_random_model(config, 5);
    const auto expected = twin.reference.forward(tokens);
    const torch::Tensor positions = positions_range(0, static_cast<int64_t>(ids.size()));

    SECTION("logits") {
        auto model = Model::from_weights(std::move(twin.weights), torch::kFloat32, torch::kCPU);
        const torch::Tensor logits =
            model->logits(model->forward_sequence(model->embed(ids), positions));
        CHECK(max_logit_difference(logits, expected) < 1e-4);
    }
    SECTION("gradients reach the query and key projections (central differences, float64)") {
        // Training learns where to attend only through these: a path that silently detached
        // them would still let the model learn unigram statistics, and nothing else.
        for (auto& [name, tensor] : twin.weights.weights)
            tensor = tensor.to(torch::kFloat64);
        const LoadedWeights base = twin.weights;
        auto loss_with = [&](const std::string& name, int64_t index, double delta,
                             torch::Tensor* gradient) {
            LoadedWeights copy = base;
            for (auto& [n, tensor] : copy.weights)
                tensor = tensor.clone();
            torch::Tensor& weight = copy.weights.at(name);
            weight.view(-1)[index] += delta;
            if (gradient) weight.requires_grad_();
            auto model = Model::from_weights(copy, torch::kFloat64, torch::kCPU, false);
            const torch::Tensor logits =
                model->logits(model->forward_sequence(model->embed(ids), positions));
            // Cross-entropy against the next token, as training computes it.
            const torch::Tensor targets =
                torch::tensor(std::vector<int64_t>(tokens.begin() + 1, tokens.end()));
            const torch::Tensor loss =
                -torch::log_softmax(logits.narrow(0, 0, static_cast<int64_t>(tokens.size()) - 1)
                                        .to(torch::kFloat64),
                                    -1)
                     .gather(1, targets.unsqueeze(1))
                     .mean();
            if (gradient) {
                loss.backward();
                *gradient = weight.grad().view(-1)[index];
            }
            return loss.item<double>();
        };
        for (const std::string name :
             {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
              "model.layers.0.self_attn.v_proj.weight"}) {
            for (const int64_t index : {3, 40}) {
                torch::Tensor analytic;
                loss_with(name, index, 0.0, &analytic);
                const double h = 1e-5;
                const double numeric =
                    (loss_with(name, index, h, nullptr) - loss_with(name, index, -h, nullptr)) /
                    (2 * h);
                INFO(name << "[" << index << "]: autograd " << analytic.item<double>()
                          << ", central difference " << numeric);
                CHECK(std::abs(numeric) > 1e-8);
                CHECK(analytic.item<double>() == Approx(numeric).epsilon(1e-4).margin(1e-9));
            }
        }
    }
}
