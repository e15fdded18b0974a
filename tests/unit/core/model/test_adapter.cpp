// KV Packet's adapters: the student that kvtrain differentiates is exactly the context kvbake and
// kvpack serve (and one block-masked pass), gradients reach the soft tokens correctly, the loss
// and the optimizer agree with references, and adapter files round-trip and refuse damage.
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/model/adapter.hpp"
#include "kv/model/distill.hpp"
#include "kv/model/packets.hpp"
#include "random_model.hpp"
#include "test_support.hpp"

#include <torch/optim/adamw.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>

using namespace kv;

namespace {

const std::vector<int32_t> preamble = {1};
const std::vector<std::vector<int32_t>> documents = {{4, 9, 16, 25}, {2, 3, 5, 7, 11}, {6, 8}};
const std::vector<int32_t> question = {12, 14, 10};

Adapter small_adapter(const Model& model, int64_t header, int64_t trailer) {
    Adapter adapter = initialize_adapter(model, header, trailer, 3);
    // Larger than the embeddings' own spread, so that a wrong placement shows.
    for (float& value : adapter.header)
        value *= 3;
    return adapter;
}

// Logits of the question over a context given as past keys and values.
torch::Tensor question_logits(const Model& model, const PacketContext& context) {
    const int64_t count = static_cast<int64_t>(question.size());
    const torch::Tensor positions =
        torch::arange(context.next_position, context.next_position + count, torch::kInt64);
    return model.logits(model.forward_sequence(model.embed(question), positions, {}, nullptr,
                                               &context.keys_values, context.positions));
}

// The same, as one forward pass over everything with a block-diagonal mask (each packet sees
// itself, the preamble itself, the question everything before it).
torch::Tensor block_masked_logits(const Model& model, const AdapterTensors& adapter) {
    std::vector<torch::Tensor> parts = {model.embed(preamble)};
    std::vector<int64_t> lengths = {static_cast<int64_t>(preamble.size())};
    for (const auto& document : documents) {
        parts.push_back(wrap_document(model, &adapter, document));
        lengths.push_back(parts.back().size(0));
    }
    parts.push_back(model.embed(question));
    const torch::Tensor embeddings = torch::cat(parts);
    const int64_t total = embeddings.size(0), count = static_cast<int64_t>(question.size());
    torch::Tensor allow = torch::zeros({total, total}, torch::kBool);
    int64_t begin = 0;
    for (int64_t length : lengths) {
        allow.narrow(0, begin, length).narrow(1, begin, length).fill_(true);
        begin += length;
    }
    allow.narrow(0, begin, count).fill_(true);
    const torch::Tensor hidden =
        model.forward_sequence(embeddings, torch::arange(total, torch::kInt64), allow);
    return model.logits(hidden.narrow(0, total - count, count));
}

// As served: every document baked alone into a packet (kvbake), appended with its keys rotated
// (kvpack / kvserve-once --cache), then the question prefilled on top.
torch::Tensor served_logits(const Model& model, const AdapterTensors& adapter,
                            const Adapter& file_adapter) {
    torch::NoGradGuard no_grad;
    KvCache cache = model.new_cache();
    model.prefill(preamble, cache);
    for (const auto& document : documents) {
        KvCache alone = model.new_cache();
        const torch::Tensor embeddings = wrap_document(model, &adapter, document);
        const int64_t length = embeddings.size(0);
        model.forward(embeddings, torch::arange(length, torch::kInt64), alone);
        Packet packet;
        packet.id = "doc";
        packet.token_ids.assign(static_cast<std::size_t>(length), -1);
        for (int64_t i = 0; i < length; ++i)
            packet.positions.push_back(i);
        packet.logical_length = length;
        packet.header_tokens = file_adapter.header_tokens();
        packet.trailer_tokens = file_adapter.trailer_tokens();
        copy_cache_to_packet(alone, 0, length, CacheDtype::f32, packet);
        append_packet(model.rope(), cache, packet, CacheDtype::f32);
    }
    torch::Tensor all;
    std::vector<torch::Tensor> rows;
    // One token at a time, to read every question position's logits.
    for (int32_t token : question)
        rows.push_back(model.prefill(std::span<const int32_t>(&token, 1), cache, 1));
    return torch::stack(rows);
}

std::shared_ptr<Model> model_for(const std::string& architecture, torch::ScalarType dtype) {
    ModelConfig config = testing::small_config(architecture);
    if (architecture == "LlamaForCausalLM") {
        config.rope_theta = 500000;
        config.rope_scaling = {RopeScalingType::llama3, 8.0, 1.0, 4.0, 64};
    }
    return Model::from_weights(testing::make_random_model(config, 17).weights, dtype, torch::kCPU);
}

}  // namespace

TEST_CASE(
    "packets computed apart and realigned equal the block-masked single pass, with "
    "adapters, for both RoPE layouts",
    "[adapter]") {
    for (const std::string architecture : {"LlamaForCausalLM", "llama2.c"}) {
        DYNAMIC_SECTION(architecture) {
            auto model = model_for(architecture, torch::kFloat64);
            const Adapter adapter = small_adapter(*model, 3, 2);
            const AdapterTensors tensors = adapter_tensors(adapter, torch::kCPU);
            const PacketContext context = packet_context(*model, &tensors, preamble, documents);
            CHECK(context.next_position == 1 + (4 + 5) + (5 + 5) + (2 + 5));
            const torch::Tensor student = question_logits(*model, context);
            const torch::Tensor joint = block_masked_logits(*model, tensors);
            const torch::Tensor served = served_logits(*model, tensors, adapter);
            INFO("largest difference " << (student - joint).abs().max().item<double>());
            // RoPE angle tables are float32 (as in llama2.c and Hugging Face): a rotation by p
            // then by delta differs from one by p + delta in the last bits.
            CHECK(torch::allclose(student, joint, 1e-5, 1e-5));
            CHECK(torch::allclose(student, served.to(torch::kFloat64), 1e-4, 1e-4));
            // The adapter matters: without it the question sees another context.
            const PacketContext plain = packet_context(*model, nullptr, preamble, documents);
            CHECK_FALSE(torch::allclose(question_logits(*model, plain), student, 1e-3, 1e-3));
        }
    }
}

TEST_CASE("gradients reach the soft tokens as finite differences say", "[adapter]") {
    auto model = model_for("LlamaForCausalLM", torch::kFloat64);
    const Adapter adapter = small_adapter(*model, 2, 2);
    AdapterTensors tensors = adapter_tensors(adapter, torch::kCPU);
    tensors.header = tensors.header.to(torch::kFloat64).set_requires_grad(true);
    tensors.trailer = tensors.trailer.to(torch::kFloat64).set_requires_grad(true);
    auto objective = [&](const AdapterTensors& at) {
        const torch::Tensor logits =
            question_logits(*model, packet_context(*model, &at, preamble, documents));
        return (logits.to(torch::kFloat64).log_softmax(1).select(1, 5)).sum();
    };
    objective(tensors).backward();
    // The trailer is seen only by the question; the header by the documents and the question.
    for (const bool header : {true, false}) {
        const torch::Tensor& parameter = header ? tensors.header : tensors.trailer;
        const torch::Tensor gradient = parameter.grad();
        for (const auto& [row, column] : {std::pair<int64_t, int64_t>{0, 3}, {1, 20}}) {
            torch::NoGradGuard no_grad;
            const double epsilon = 1e-6;
            AdapterTensors plus{tensors.header.detach().clone(), tensors.trailer.detach().clone()};
            AdapterTensors minus{tensors.header.detach().clone(), tensors.trailer.detach().clone()};
            (header ? plus.header : plus.trailer)[row][column] += epsilon;
            (header ? minus.header : minus.trailer)[row][column] -= epsilon;
            const double numeric =
                (objective(plus).item<double>() - objective(minus).item<double>()) / (2 * epsilon);
            const double analytic = gradient[row][column].item<double>();
            CHECK(analytic == Approx(numeric).epsilon(1e-5).margin(1e-8));
            CHECK(std::abs(analytic) > 1e-8);
        }
    }
}

TEST_CASE("the distillation loss is the forward KL, with the rest of the vocabulary pooled",
          "[adapter]") {
    const int64_t vocab = 7, length = 3;
    torch::manual_seed(5);
    const torch::Tensor teacher_logits = torch::randn({length, vocab}, torch::kFloat64) * 2;
    const torch::Tensor student_logits = torch::randn({length, vocab}, torch::kFloat64);
    for (const int64_t top_k : {vocab, int64_t{3}}) {
        TeacherAnswer teacher;
        teacher.top_k = top_k;
        double expected = 0;
        for (int64_t t = 0; t < length; ++t) {
            // float64 reference, written as loops.
            std::vector<double> p(vocab), q(vocab);
            double p_sum = 0, q_sum = 0;
            for (int64_t v = 0; v < vocab; ++v) {
                p[v] = std::exp(teacher_logits[t][v].item<double>());
                q[v] = std::exp(student_logits[t][v].item<double>());
                p_sum += p[v];
                q_sum += q[v];
            }
            std::vector<int64_t> order(vocab);
            for (int64_t v = 0; v < vocab; ++v)
                order[v] = v;
            std::sort(order.begin(), order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b]; });
            double p_rest = 1, q_rest = 1;
            for (int64_t i = 0; i < top_k; ++i) {
                const int64_t v = order[i];
                const double pv = p[v] / p_sum, qv = q[v] / q_sum;
                expected += pv * (std::log(pv) - std::log(qv));
                p_rest -= pv;
                q_rest -= qv;
                teacher.candidates.push_back(static_cast<int32_t>(v));
                teacher.log_probabilities.push_back(static_cast<float>(std::log(pv)));
            }
            if (top_k < vocab) expected += p_rest * (std::log(p_rest) - std::log(q_rest));
            teacher.tokens.push_back(static_cast<int32_t>(order[0]));
        }
        const double loss = distillation_loss(student_logits, teacher).item<double>();
        CHECK(loss == Approx(expected).epsilon(1e-5));
        CHECK(loss > 0);
    }
}

TEST_CASE("AdamW matches libtorch's AdamW step for step", "[adapter]") {
    torch::manual_seed(9);
    torch::Tensor mine = torch::randn({3, 4});
    torch::Tensor theirs = mine.clone().set_requires_grad(true);
    AdamW optimizer{torch::zeros_like(mine), torch::zeros_like(mine)};
    torch::optim::AdamW reference({theirs}, torch::optim::AdamWOptions(0.01).weight_decay(0.0));
    for (int64_t step = 1; step <= 5; ++step) {
        const torch::Tensor gradient = torch::randn({3, 4});
        optimizer.step(mine, gradient, step, 0.01);
        theirs.mutable_grad() = gradient.clone();
        reference.step();
    }
    CHECK(torch::allclose(mine, theirs.detach(), 1e-6, 1e-7));
}

TEST_CASE("adapter files round-trip, and damage or another model is refused", "[adapter]") {
    auto model = model_for("llama2.c", torch::kFloat32);
    Adapter adapter = small_adapter(*model, 2, 3);
    // N(mean, std) of the embedding matrix.
    const torch::Tensor table = model->input_embeddings().to(torch::kFloat64);
    CHECK(adapter.init_mean == Approx(table.mean().item<double>()));
    CHECK(adapter.init_std == Approx(table.std().item<double>()));
    adapter.training = R"({"step":1})";
    adapter.optimizer_step = 4;
    adapter.header_moment.assign(adapter.header.size(), 0.5f);
    adapter.header_second_moment.assign(adapter.header.size(), 0.25f);
    adapter.trailer_moment.assign(adapter.trailer.size(), 0.125f);
    adapter.trailer_second_moment.assign(adapter.trailer.size(), 1.0f);

    CacheModelInfo info;
    info.model_fingerprint = model->fingerprint();
    info.architecture = "llama2.c";
    info.num_layers = model->config().num_layers;
    info.num_kv_heads = model->config().num_kv_heads;
    info.head_dim = model->config().head_dim;
    info.rope_layout = "interleaved";
    info.rope_theta = model->config().rope_theta;
    info.tokenizer_fingerprint = "tok";
    const test::TempDir dir;
    const std::filesystem::path path = dir / "adapter.kvc";
    {
        CacheWriter writer(path, info, {"test", "0", "test", ""});
        writer.set_adapter(adapter);
        writer.finish();
    }
    const Adapter loaded = load_adapter(path, *model, info);
    CHECK(loaded.header == adapter.header);
    CHECK(loaded.trailer == adapter.trailer);
    CHECK(loaded.fingerprint() == adapter.fingerprint());
    CHECK(loaded.training == adapter.training);
    CHECK(loaded.optimizer_step == 4);
    CHECK(loaded.trailer_moment == adapter.trailer_moment);
    CHECK(CacheReader(path).format_version() == "1.7");  // 1.4 for the adapter; tensor_layout

    CacheModelInfo other = info;
    other.model_fingerprint = "another";
    CHECK_THROWS_AS(load_adapter(path, *model, other), MismatchError);
    CHECK_THROWS_WITH(load_adapter(path, *model, other),
                      Catch::Contains("does not belong to this model"));

    // A file without an adapter.
    const std::filesystem::path store = dir / "store.kvc";
    {
        CacheWriter writer(store, info, {"test", "0", "test", ""});
        writer.finish();
    }
    CHECK_THROWS_WITH(load_adapter(store, *model, info), Catch::Contains("holds no adapter"));

    // Not finite values are never written.
    Adapter broken = adapter;
    broken.header[0] = std::nanf("");
    CacheWriter writer(dir / "nan.kvc", info, {"test", "0", "test", ""});
    CHECK_THROWS_AS(writer.set_adapter(broken), FormatError);
}
