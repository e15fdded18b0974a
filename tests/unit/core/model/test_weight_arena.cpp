// Weights copied out of their (mapped) files into one arena at load.
#include "kv/model/weight_arena.hpp"

#include <catch2/catch.hpp>

#include <vector>

using namespace kv;

TEST_CASE("copy_weights_to_arena copies the tensors of the compute dtype, on every thread",
          "[model][load]") {
    // A "file": tensors viewing one buffer, as a mapped safetensors file's do. The large one
    // spans several of the copy's pieces (4 MiB), the transposed one is not contiguous.
    std::vector<float> file(3'000'000 + 64 + 6);
    for (std::size_t i = 0; i < file.size(); ++i)
        file[i] = static_cast<float>(i % 1000) * 0.5f - 7.0f;
    auto view = [&](std::size_t offset, std::vector<int64_t> shape) {
        return torch::from_blob(file.data() + offset, shape, torch::kFloat32);
    };
    WeightMap weights;
    weights["large"] = view(0, {1000, 3000});
    weights["transposed"] = view(3'000'000, {8, 8}).t();
    weights["bf16"] = view(3'000'064, {6}).to(torch::kBFloat16);
    const std::vector<torch::Tensor> expected = {
        weights["large"].clone(), weights["transposed"].clone(), weights["bf16"].clone()};
    const void* bf16_data = weights["bf16"].data_ptr();

    copy_weights_to_arena(weights, torch::kFloat32);

    CHECK(torch::equal(weights["large"], expected[0]));
    CHECK(torch::equal(weights["transposed"], expected[1]));
    CHECK(weights["large"].is_contiguous());
    CHECK(weights["transposed"].is_contiguous());
    // Copies: the file's bytes can go away or change.
    const auto* begin = reinterpret_cast<const std::byte*>(file.data());
    const auto* end = begin + file.size() * sizeof(float);
    for (const char* name : {"large", "transposed"}) {
        const auto* data = static_cast<const std::byte*>(weights[name].data_ptr());
        CHECK((data < begin || data >= end));
    }
    std::fill(file.begin(), file.end(), 0.0f);
    CHECK(torch::equal(weights["large"], expected[0]));
    // Another dtype is left for the caller to convert.
    CHECK(weights["bf16"].data_ptr() == bf16_data);
    CHECK(torch::equal(weights["bf16"], expected[2]));
    // The arena lives as long as any copy does.
    const torch::Tensor kept = weights["transposed"];
    weights.clear();
    CHECK(torch::equal(kept, expected[1]));
}
