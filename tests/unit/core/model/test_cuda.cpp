// The CUDA path against the float64 reference and the CPU: the decoder, its cache, the decoding
// attention and RoPE on a GPU. Tagged [.][gpu]: hidden from a plain run of kv_unit_tests and
// discovered as ctest's `gpu` label (tests/CMakeLists.txt), which `scripts/test` leaves out by
// default and scripts/device-check runs. Where CUDA is unavailable (a CPU-only libtorch, or no
// GPU) each test exits 77 with the reason on stderr, which ctest reports as skipped.
//
// Each test also prints what it measured as lines "gpu-measure: NAME VALUE" (worst absolute
// differences), which scripts/device-check collects into its table. With KV_GPU_TESTS_ON_CPU=1
// they run on the CPU instead (a check of the tests themselves, without a GPU):
//   KV_GPU_TESTS_ON_CPU=1 build/bin/kv_unit_tests "[gpu]"
#include "kv/model/model.hpp"
#include "kv/model/row_attention.hpp"
#include "random_model.hpp"
#include "test_support.hpp"

#include <torch/cuda.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <numeric>

using namespace kv;

namespace {

// The GPU these tests run on. KV_GPU_TESTS_ON_CPU=1 runs them on the CPU instead (f16 left out:
// libtorch's CPU kernels lack it), to check the tests themselves where there is no GPU.
torch::Device gpu_or_skip() {
    if (const char* on_cpu = std::getenv("KV_GPU_TESTS_ON_CPU"); on_cpu && *on_cpu == '1')
        return torch::kCPU;
    if (!torch::cuda::is_available()) {
        std::fprintf(stderr,
                     "skipped: CUDA is not available (this libtorch has no CUDA, or this machine "
                     "has no GPU)\n");
        std::fflush(nullptr);
        std::exit(77);
    }
    return torch::Device(torch::kCUDA, 0);
}

/// The reduced precisions the device computes in, and those after float32.
std::vector<torch::ScalarType> half_types(torch::Device device) {
    if (device.is_cuda()) return {torch::kBFloat16, torch::kFloat16};
    return {torch::kBFloat16};
}

std::vector<torch::ScalarType> with_f32(std::vector<torch::ScalarType> types) {
    types.insert(types.begin(), torch::kFloat32);
    return types;
}

void measure(const std::string& name, double value) {
    std::cout << "gpu-measure: " << name << " " << value << std::endl;
}

double max_difference(const torch::Tensor& a, const torch::Tensor& b) {
    return (a.to(torch::kCPU, torch::kFloat64) - b.to(torch::kCPU, torch::kFloat64))
        .abs()
        .max()
        .item<double>();
}

/// Worst difference of logits [T, vocab] (any device) from the reference's rows from
/// `first_row` on.
double max_logit_difference(const torch::Tensor& logits,
                            const std::vector<reference::Vector>& expected,
                            std::size_t first_row = 0) {
    const torch::Tensor host = logits.to(torch::kCPU, torch::kFloat64).contiguous();
    double worst = 0;
    for (int64_t t = 0; t < host.size(0); ++t)
        for (int64_t v = 0; v < host.size(1); ++v)
            worst = std::max(worst, std::abs(host[t][v].item<double>() -
                                             expected[first_row + static_cast<std::size_t>(t)]
                                                     [static_cast<std::size_t>(v)]));
    return worst;
}

std::vector<double> to_vector(const torch::Tensor& tensor) {
    const torch::Tensor flat = tensor.to(torch::kCPU, torch::kFloat64).contiguous().view({-1});
    return {flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel()};
}

/// The float64 attention of queries [Hq, T, D] over keys and values [Hkv, S, D] (any device),
/// query t of head h seeing the keys `visible(h, t, j)` allows.
template <typename Visible>
torch::Tensor reference_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, Visible visible) {
    const int64_t query_heads = q.size(0), tokens = q.size(1), dim = q.size(2);
    const int64_t group = query_heads / k.size(0), keys_count = k.size(1);
    std::vector<double> out;
    for (int64_t h = 0; h < query_heads; ++h) {
        std::vector<reference::Vector> keys, values;
        for (int64_t j = 0; j < keys_count; ++j) {
            keys.push_back(to_vector(k[h / group][j]));
            values.push_back(to_vector(v[h / group][j]));
        }
        for (int64_t t = 0; t < tokens; ++t) {
            std::vector<bool> seen(static_cast<std::size_t>(keys_count));
            for (int64_t j = 0; j < keys_count; ++j)
                seen[static_cast<std::size_t>(j)] = visible(h, t, j);
            const auto row = reference::attend(to_vector(q[h][t]), keys, values, seen);
            out.insert(out.end(), row.begin(), row.end());
        }
    }
    return torch::tensor(out, torch::kFloat64).view({query_heads, tokens, dim});
}

torch::Tensor positions_range(int64_t begin, int64_t end) {
    return torch::arange(begin, end, torch::kInt64);
}

}  // namespace

TEST_CASE("devices resolve to CUDA", "[.][gpu]") {
    const torch::Device device = gpu_or_skip();
    if (!device.is_cuda()) return;  // KV_GPU_TESTS_ON_CPU: nothing to resolve
    CHECK(resolve_device("cuda") == device);
    CHECK(resolve_device("cuda:0") == device);
    CHECK(resolve_device("auto").is_cuda());
    const std::string beyond = "cuda:" + std::to_string(torch::cuda::device_count());
    CHECK_THROWS(resolve_device(beyond));
    // f16 is computed only on a GPU.
    CHECK(resolve_dtype("f16", "bf16", device) == torch::kFloat16);
    CHECK(resolve_dtype("auto", "f16", device) == torch::kFloat16);
}

TEST_CASE("the decoder on CUDA matches the float64 reference and the CPU", "[.][gpu]") {
    const torch::Device device = gpu_or_skip();
    const std::vector<int> tokens = {1, 5, 9, 2, 33, 17, 4, 4, 30, 11};
    const std::vector<int32_t> ids(tokens.begin(), tokens.end());
    const auto count = static_cast<int64_t>(ids.size());
    double worst_reference = 0, worst_cpu = 0;
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
            auto gpu = Model::from_weights(std::move(twin.weights), torch::kFloat32, device);
            auto cpu = Model::from_weights(testing::make_random_model(config, 42).weights,
                                           torch::kFloat32, torch::kCPU);
            REQUIRE(gpu->device() == device);
            torch::NoGradGuard no_grad;

            // One pass over every token: the cache and the logits stay on the GPU.
            KvCache whole = gpu->new_cache();
            CHECK(whole.device() == device);
            const torch::Tensor all =
                gpu->logits(gpu->forward(gpu->embed(ids), positions_range(0, count), whole));
            CHECK(all.device() == device);
            const double to_reference = max_logit_difference(all, expected);
            CHECK(to_reference < 1e-4);
            worst_reference = std::max(worst_reference, to_reference);
            KvCache host = cpu->new_cache();
            const torch::Tensor all_cpu =
                cpu->logits(cpu->forward(cpu->embed(ids), positions_range(0, count), host));
            const double to_cpu = max_difference(all, all_cpu);
            CHECK(to_cpu < 1e-4);
            worst_cpu = std::max(worst_cpu, to_cpu);
            for (int64_t layer = 0; layer < config.num_layers; ++layer) {
                CHECK(max_difference(whole.keys(layer), host.keys(layer)) < 1e-5);
                CHECK(max_difference(whole.values(layer), host.values(layer)) < 1e-5);
            }

            // Chunked prefill, then token by token: a growing cache on the GPU.
            KvCache incremental = gpu->new_cache(2);
            const torch::Tensor first =
                gpu->prefill(std::span<const int32_t>(ids).first(3), incremental, 2);
            CHECK(first.device().is_cpu());  // prefill's logits come back to the host
            CHECK(max_logit_difference(first.unsqueeze(0), expected, 2) < 1e-4);
            for (std::size_t t = 3; t < ids.size(); ++t) {
                const torch::Tensor step =
                    gpu->prefill(std::span<const int32_t>(ids).subspan(t, 1), incremental);
                const double difference = max_logit_difference(step.unsqueeze(0), expected, t);
                CHECK(difference < 1e-4);
                worst_reference = std::max(worst_reference, difference);
            }
            CHECK(incremental.length() == count);

            // Layer by layer (kvserve-once --document), each layer reported once, in order.
            KvCache by_layer = gpu->new_cache(2);
            gpu->prefill(std::span<const int32_t>(ids).first(2), by_layer);
            std::vector<int64_t> finished;
            const torch::Tensor last =
                gpu->prefill_by_layer(std::span<const int32_t>(ids).subspan(2), by_layer, 3,
                                      [&](int64_t layer) { finished.push_back(layer); });
            CHECK(max_logit_difference(last.unsqueeze(0), expected, ids.size() - 1) < 1e-4);
            std::vector<int64_t> every_layer(static_cast<std::size_t>(config.num_layers));
            std::iota(every_layer.begin(), every_layer.end(), 0);
            CHECK(finished == every_layer);
            for (int64_t layer = 0; layer < config.num_layers; ++layer)
                CHECK(max_difference(by_layer.keys(layer), whole.keys(layer)) < 1e-5);
            // Catch2 runs the test case once per section: one measure per architecture.
            measure("decoder_f32_vs_float64_max_abs_" + architecture, worst_reference);
            measure("decoder_f32_vs_cpu_max_abs_" + architecture, worst_cpu);
        }
    }
}

TEST_CASE("bf16 and f16 compute on CUDA stay close to float64", "[.][gpu]") {
    const torch::Device device = gpu_or_skip();
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    const std::vector<int> tokens = {1, 2, 3, 4, 5, 6};
    const std::vector<int32_t> ids(tokens.begin(), tokens.end());
    for (const torch::ScalarType dtype : half_types(device)) {
        testing::TwinModel twin = testing::make_random_model(config, 3);
        const auto expected = twin.reference.forward(tokens);
        auto model = Model::from_weights(std::move(twin.weights), dtype, device);
        KvCache cache = model->new_cache();
        CHECK(cache.dtype() == dtype);
        const torch::Tensor last = model->prefill(ids, cache);
        CHECK(last.scalar_type() == torch::kFloat32);
        const double difference = max_logit_difference(last.unsqueeze(0), expected, 5);
        // The CPU's bound for bf16 (test_model.cpp); f16 keeps 3 more mantissa bits.
        CHECK(difference < (dtype == torch::kBFloat16 ? 0.25 : 0.05));
        measure(std::string("decoder_") + dtype_name(dtype) + "_vs_float64_max_abs", difference);
    }
}

TEST_CASE("the differentiable forward and its gradients on CUDA match the CPU", "[.][gpu]") {
    // kvtrain on a GPU: the sequence forward and the gradient that reaches the embeddings.
    const torch::Device device = gpu_or_skip();
    const ModelConfig config = testing::small_config("Qwen3ForCausalLM");
    const std::vector<int32_t> ids = {1, 5, 9, 2, 33, 17, 4};
    const torch::Tensor positions = positions_range(0, static_cast<int64_t>(ids.size()));
    std::vector<torch::Tensor> logits, gradients;
    for (const torch::Device on : {torch::Device(torch::kCPU), device}) {
        auto model =
            Model::from_weights(testing::make_random_model(config, 9).weights, torch::kFloat32, on);
        const torch::Tensor embeddings = model->embed(ids).detach().requires_grad_();
        const torch::Tensor out = model->logits(model->forward_sequence(embeddings, positions));
        out.logsumexp(-1).sum().backward();
        logits.push_back(out.detach());
        gradients.push_back(embeddings.grad());
    }
    CHECK(gradients[1].device() == device);
    const double logit_difference = max_difference(logits[0], logits[1]);
    const double gradient_difference = max_difference(gradients[0], gradients[1]);
    CHECK(logit_difference < 1e-4);
    CHECK(gradient_difference < 1e-4);
    measure("sequence_forward_vs_cpu_max_abs", logit_difference);
    measure("embedding_gradient_vs_cpu_max_abs", gradient_difference);
}

TEST_CASE("a KvCache on CUDA holds exactly what one on the CPU does", "[.][gpu]") {
    const torch::Device device = gpu_or_skip();
    const int64_t layers = 2, kv_heads = 2, dim = 8;
    for (const torch::ScalarType dtype : with_f32(half_types(device))) {
        CAPTURE(dtype_name(dtype));
        KvCache gpu(layers, kv_heads, dim, dtype, device, 2);  // grows as tokens come
        KvCache cpu(layers, kv_heads, dim, dtype, torch::kCPU, 2);
        CHECK(gpu.device() == device);
        torch::manual_seed(5);
        // Three appends through begin_append/write/commit, the second written in parts.
        int64_t next = 0;
        for (const int64_t tokens : {3, 4, 1}) {
            const torch::Tensor positions = positions_range(next, next + tokens) * 2;
            next += tokens;
            gpu.begin_append(positions.to(device));
            cpu.begin_append(positions);
            for (int64_t layer = 0; layer < layers; ++layer) {
                const torch::Tensor k = torch::randn({kv_heads, tokens, dim}).to(dtype);
                const torch::Tensor v = torch::randn({kv_heads, tokens, dim}).to(dtype);
                if (tokens == 4) {
                    gpu.write_part(layer, 0, k.narrow(1, 0, 1).to(device),
                                   v.narrow(1, 0, 1).to(device));
                    gpu.write_part(layer, 1, k.narrow(1, 1, 3).to(device),
                                   v.narrow(1, 1, 3).to(device));
                } else {
                    gpu.write(layer, k.to(device), v.to(device));
                }
                cpu.write(layer, k, v);
            }
            gpu.commit();
            cpu.commit();
        }
        // A rolled-back append leaves nothing behind.
        gpu.begin_append(torch::full({2}, 100, torch::kInt64).to(device));
        gpu.rollback();
        // Whole tokens from a file, with padding slots in the second kv head (used 1 of 2).
        std::vector<torch::Tensor> keys, values, used;
        for (int64_t layer = 0; layer < layers; ++layer) {
            keys.push_back(torch::randn({kv_heads, 2, dim}));
            values.push_back(torch::randn({kv_heads, 2, dim}));
            used.push_back(torch::tensor(std::vector<int64_t>{2, 1}));
        }
        const torch::Tensor appended = torch::tensor(std::vector<int64_t>{20, 21});
        gpu.append(keys, values, appended, used);
        cpu.append(keys, values, appended, used);

        REQUIRE(gpu.length() == cpu.length());
        CHECK(gpu.next_position() == cpu.next_position());
        CHECK(gpu.positions().device() == device);
        CHECK(torch::equal(gpu.positions().cpu(), cpu.positions()));
        REQUIRE(gpu.has_padding());
        for (int64_t layer = 0; layer < layers; ++layer) {
            CHECK(gpu.keys(layer).device() == device);
            CHECK(torch::equal(gpu.keys(layer).cpu(), cpu.keys(layer)));
            CHECK(torch::equal(gpu.values(layer).cpu(), cpu.values(layer)));
            CHECK(torch::equal(gpu.key_valid(layer).cpu(), cpu.key_valid(layer)));
            // What sparse methods and the staging buffer read, whichever device holds the rows.
            const std::vector<int64_t> rows = {0, 2, 3, 4, 9};
            for (int64_t head = 0; head < kv_heads; ++head) {
                const auto row_bytes = static_cast<std::size_t>(dim) * c10::elementSize(dtype);
                std::vector<std::byte> gathered_gpu(rows.size() * row_bytes),
                    gathered_cpu(rows.size() * row_bytes);
                std::vector<std::byte> values_gpu(rows.size() * row_bytes),
                    values_cpu(rows.size() * row_bytes);
                gpu.gather(layer, head, rows, gathered_gpu.data(), values_gpu.data());
                cpu.gather(layer, head, rows, gathered_cpu.data(), values_cpu.data());
                CHECK(gathered_gpu == gathered_cpu);
                CHECK(values_gpu == values_cpu);
                std::vector<std::byte> range_gpu(4 * row_bytes), range_cpu(4 * row_bytes);
                gpu.gather_range(layer, head, 3, 4, range_gpu.data(), nullptr);
                cpu.gather_range(layer, head, 3, 4, range_cpu.data(), nullptr);
                CHECK(range_gpu == range_cpu);
                const torch::Tensor read = gpu.read_keys(layer, head, 1, 5);
                CHECK(read.device().is_cpu());
                CHECK(read.scalar_type() == torch::kFloat32);
                CHECK(torch::equal(read, cpu.read_keys(layer, head, 1, 5)));
                CHECK(torch::equal(gpu.gather_keys(layer, head, rows),
                                   cpu.gather_keys(layer, head, rows)));
            }
        }
    }
}

TEST_CASE("decoding attention on CUDA matches float64", "[.][gpu]") {
    const torch::Device device = gpu_or_skip();
    torch::NoGradGuard no_grad;
    // One token over [Hkv, S, D] views of a larger cache buffer, as the decoding step reads.
    const int64_t query_heads = 8, kv_heads = 2, head_dim = 24, capacity = 300;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    double worst_f32 = 0;
    for (const int64_t keys_count : {1, 33, 257}) {
        for (const torch::ScalarType dtype : with_f32(half_types(device))) {
            CAPTURE(keys_count, dtype_name(dtype));
            torch::manual_seed(30);
            const torch::Tensor buffer_k =
                torch::randn({kv_heads, capacity, head_dim}).to(device, dtype);
            const torch::Tensor buffer_v =
                torch::randn({kv_heads, capacity, head_dim}).to(device, dtype);
            const torch::Tensor k = buffer_k.narrow(1, 0, keys_count);
            const torch::Tensor v = buffer_v.narrow(1, 0, keys_count);
            const torch::Tensor q = torch::randn({query_heads, 1, head_dim}).to(device, dtype);
            const AttentionMask mask{torch::full({1}, keys_count - 1, torch::kInt64).to(device),
                                     torch::arange(keys_count, torch::kInt64).to(device),
                                     0,
                                     {},
                                     {}};
            const torch::Tensor got = attention(q, k, v, mask, scale);
            CHECK(got.device() == device);
            CHECK(got.scalar_type() == dtype);
            const double difference = max_difference(
                got, reference_attention(q, k, v, [](int64_t, int64_t, int64_t) { return true; }));
            CHECK(difference < (dtype == torch::kFloat32 ? 1e-5 : 2e-2));
            if (dtype == torch::kFloat32) worst_f32 = std::max(worst_f32, difference);
        }
    }
    measure("decode_attention_f32_vs_float64_max_abs", worst_f32);

    SECTION("a prefill block with a sliding window, an extra mask and padding slots") {
        const int64_t tokens = 5, keys_count = 12;
        torch::manual_seed(31);
        const torch::Tensor q = torch::randn({query_heads, tokens, head_dim}).to(device);
        const torch::Tensor k = torch::randn({kv_heads, keys_count, head_dim}).to(device);
        const torch::Tensor v = torch::randn({kv_heads, keys_count, head_dim}).to(device);
        torch::Tensor allow = torch::ones({tokens, keys_count}, torch::kBool);
        allow[1][6] = false;
        allow[3][9] = false;
        torch::Tensor valid = torch::ones({kv_heads, keys_count}, torch::kBool);
        valid[1][8] = false;
        const torch::Tensor query_positions = positions_range(keys_count - tokens, keys_count);
        const AttentionMask mask{query_positions.to(device),
                                 positions_range(0, keys_count).to(device), 4, allow.to(device),
                                 valid.to(device)};
        const torch::Tensor got = attention(q, k, v, mask, scale);
        const int64_t group = query_heads / kv_heads;
        const double difference =
            max_difference(got, reference_attention(q, k, v, [&](int64_t h, int64_t t, int64_t j) {
                               const int64_t position = keys_count - tokens + t;
                               return j <= position && j > position - 4 &&
                                      allow[t][j].item<bool>() && valid[h / group][j].item<bool>();
                           }));
        CHECK(difference < 1e-5);
        measure("masked_attention_f32_vs_float64_max_abs", difference);
    }

    SECTION("chosen rows, from a cache on the GPU and staged from one on disk") {
        // Sparse decoding's attention (attention_over_rows) and the host tier's: rows gathered
        // into pinned memory and moved to the GPU in one transfer (attention_over_staged_rows),
        // and a dense layer of a cache on disk streamed in chunks (attention_streamed).
        test::TempDir dir;
        const int64_t layers = 1, dim = 16, stored = 40;
        KvCache gpu(layers, kv_heads, dim, torch::kFloat32, device, stored);
        KvCache disk = KvCache::on_disk(layers, kv_heads, dim, torch::kFloat32, stored, dir.path());
        torch::manual_seed(32);
        const torch::Tensor keys = torch::randn({kv_heads, stored, dim});
        const torch::Tensor values = torch::randn({kv_heads, stored, dim});
        const torch::Tensor positions = positions_range(0, stored);
        gpu.append({keys}, {values}, positions);
        disk.append({keys}, {values}, positions);
        const torch::Tensor queries = torch::randn({query_heads, 1, dim}).to(device);
        const std::vector<std::vector<int64_t>> rows = {{0, 1, 2, 7, 9, 31}, {3, 4, 5, 6, 39}};
        const int64_t group = query_heads / kv_heads;
        const torch::Tensor expected =
            reference_attention(queries, keys, values, [&](int64_t h, int64_t, int64_t j) {
                const auto& chosen = rows[static_cast<std::size_t>(h / group)];
                return std::find(chosen.begin(), chosen.end(), j) != chosen.end();
            });
        const double scale16 = 0.25;  // 1/sqrt(dim), the reference's scale
        const torch::Tensor over_rows =
            attention_over_rows(queries, gpu.keys(0), gpu.values(0), rows, scale16);
        CHECK(over_rows.device() == device);
        CHECK(max_difference(over_rows, expected) < 1e-5);
        for (const KvCache* cache : {&gpu, &disk}) {
            const torch::Tensor staged =
                attention_over_staged_rows(queries, *cache, 0, rows, scale16);
            CHECK(staged.device() == device);
            CHECK(max_difference(staged, expected) < 1e-5);
        }
        const torch::Tensor every = reference_attention(
            queries, keys, values, [](int64_t, int64_t, int64_t) { return true; });
        for (const int64_t chunk : {1, 7, 4096}) {
            const torch::Tensor streamed = attention_streamed(queries, disk, 0, scale16, chunk);
            CHECK(streamed.device() == device);
            CHECK(max_difference(streamed, every) < 1e-5);
        }
    }
}

TEST_CASE("RoPE on CUDA rotates as on the CPU", "[.][gpu]") {
    const torch::Device device = gpu_or_skip();
    double worst = 0;
    for (const std::string architecture : {"LlamaForCausalLM", "llama2.c"}) {
        const Rope rope(testing::small_config(architecture));
        torch::manual_seed(40);
        const torch::Tensor x = torch::randn({2, 6, 8});
        const torch::Tensor positions = torch::tensor(std::vector<int64_t>{0, 3, 7, 100, 4095, 9});
        const torch::Tensor applied = rope.apply(x.to(device), positions.to(device));
        CHECK(applied.device() == device);
        worst = std::max(worst, max_difference(applied, rope.apply(x, positions)));
        // kvpack's realignment on a GPU goes through apply(); on the CPU through its own kernel.
        const torch::Tensor shifted = rope.shift(x.to(device), 37);
        CHECK(shifted.device() == device);
        worst = std::max(worst, max_difference(shifted, rope.shift(x, 37)));
    }
    CHECK(worst < 1e-5);
    measure("rope_vs_cpu_max_abs", worst);
}
