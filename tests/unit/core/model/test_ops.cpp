// Each numerical piece against the float64 reference.
#include "kv/float_convert.hpp"
#include "kv/model/attention_rows.hpp"
#include "kv/model/gemv.hpp"
#include "kv/model/ops.hpp"
#include "kv/rope.hpp"
#include "reference.hpp"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/function.h>
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>

using namespace kv;

namespace {

std::vector<double> to_vector(const torch::Tensor& tensor) {
    const torch::Tensor flat = tensor.to(torch::kFloat64).contiguous().view({-1});
    return {flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel()};
}

torch::Tensor random_tensor(std::vector<int64_t> shape, uint64_t seed) {
    torch::manual_seed(seed);
    return torch::randn(shape, torch::kFloat32);
}

// The libtorch paths of rms_norm and Rope::apply, which a tensor that needs gradients takes; the
// host loops must give their bits.
torch::Tensor rms_norm_through_libtorch(const torch::Tensor& x, const torch::Tensor& weight,
                                        double eps) {
    torch::AutoGradMode gradients(true);
    return rms_norm(x.detach().clone().requires_grad_(true), weight, eps).detach();
}

torch::Tensor rope_through_libtorch(const Rope& rope, const torch::Tensor& x,
                                    const torch::Tensor& positions) {
    torch::AutoGradMode gradients(true);
    return rope.apply(x.detach().clone().requires_grad_(true), positions).detach();
}

// A llama3-scaled RoPE of theta 500,000 (factor `factor`, low and high frequency factors 1 and 4,
// 8,192 original positions), as Llama 3.1 and 3.2 configure it.
ModelConfig llama3_rope_config(int64_t head_dim, RopeLayout layout, double factor) {
    ModelConfig config;
    config.head_dim = head_dim;
    config.rope_theta = 500000;
    config.rope_layout = layout;
    config.rope_scaling = {RopeScalingType::llama3, factor, 1.0, 4.0, 8192};
    return config;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
        worst = std::max(worst, std::abs(a[i] - b[i]));
    return worst;
}

}  // namespace

TEST_CASE("rms_norm matches the float64 reference", "[ops]") {
    const torch::Tensor x = random_tensor({3, 16}, 1) * 3.0;
    const torch::Tensor weight = random_tensor({16}, 2);
    const auto got = to_vector(rms_norm(x, weight, 1e-5));
    std::vector<double> expected;
    const auto w = to_vector(weight);
    for (int64_t row = 0; row < 3; ++row) {
        const auto out = reference::rms_norm(to_vector(x[row]), w, 1e-5);
        expected.insert(expected.end(), out.begin(), out.end());
    }
    CHECK(max_abs_difference(got, expected) < 1e-5);

    SECTION("bf16 input keeps float32 statistics") {
        const auto bf16 =
            to_vector(rms_norm(x.to(torch::kBFloat16), weight.to(torch::kBFloat16), 1e-5));
        CHECK(max_abs_difference(bf16, expected) < 0.1);
    }
}

TEST_CASE("swiglu matches the float64 reference", "[ops]") {
    const torch::Tensor gate = random_tensor({2, 10}, 3), up = random_tensor({2, 10}, 4);
    const auto got = to_vector(swiglu(gate, up));
    const auto g = to_vector(gate), u = to_vector(up);
    std::vector<double> expected;
    for (std::size_t i = 0; i < g.size(); ++i)
        expected.push_back(reference::silu(g[i]) * u[i]);
    CHECK(max_abs_difference(got, expected) < 1e-6);
}

TEST_CASE("linear with and without bias, one row and many", "[ops]") {
    const torch::Tensor weight = random_tensor({7, 5}, 5), bias = random_tensor({7}, 6);
    for (int64_t rows : {1, 4}) {
        const torch::Tensor x = random_tensor({rows, 5}, 7);
        const auto got = to_vector(kv::linear(x, weight, bias));
        std::vector<double> expected;
        reference::Matrix w;
        for (int64_t r = 0; r < 7; ++r)
            w.push_back(to_vector(weight[r]));
        const auto b = to_vector(bias);
        for (int64_t r = 0; r < rows; ++r) {
            auto y = reference::multiply(w, to_vector(x[r]));
            for (std::size_t i = 0; i < y.size(); ++i)
                y[i] += b[i];
            expected.insert(expected.end(), y.begin(), y.end());
        }
        CHECK(max_abs_difference(got, expected) < 1e-5);
    }
}

TEST_CASE("bf16 widening and rounding give at::BFloat16's bits, ties, NaN and tails included",
          "[ops][gemv]") {
    std::mt19937 random(17);
    std::uniform_int_distribution<uint32_t> any_bits;
    std::vector<float> values = {0.0f,
                                 -0.0f,
                                 1.0f,
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(),
                                 -std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::denorm_min(),
                                 std::numeric_limits<float>::max(),
                                 3.3895314e38f};  // rounds up to infinity
    for (uint32_t tie : {0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x3f807fffu}) {  // ties, odd/even
        float value;
        std::memcpy(&value, &tie, sizeof value);
        values.push_back(value);
    }
    while (values.size() < 1000) {
        const uint32_t bits = any_bits(random);
        float value;
        std::memcpy(&value, &bits, sizeof value);
        values.push_back(value);
    }
    for (int64_t count : {0, 1, 15, 16, 17, 1000}) {  // whole vectors and tails
        std::vector<uint16_t> rounded(static_cast<std::size_t>(count));
        kv::round_to_bf16(values.data(), rounded.data(), count);
        std::vector<float> widened(static_cast<std::size_t>(count));
        kv::widen_bf16(rounded.data(), widened.data(), count);
        for (int64_t i = 0; i < count; ++i) {
            const at::BFloat16 expected(values[static_cast<std::size_t>(i)]);
            INFO("value " << values[static_cast<std::size_t>(i)] << " at " << i << " of " << count);
            CHECK(rounded[static_cast<std::size_t>(i)] == expected.x);
            const float back = static_cast<float>(expected);
            CHECK(std::memcmp(&widened[static_cast<std::size_t>(i)], &back, sizeof back) == 0);
        }
    }
    // libtorch's own conversion of a tensor agrees (its vectorised path), NaNs aside.
    const torch::Tensor x = torch::randn({1, 1000}, torch::kFloat32) * 1000;
    const torch::Tensor theirs = x.to(torch::kBFloat16);
    std::vector<uint16_t> ours(1000);
    kv::round_to_bf16(x.data_ptr<float>(), ours.data(), 1000);
    CHECK(std::memcmp(ours.data(), theirs.data_ptr(), ours.size() * sizeof(uint16_t)) == 0);
}

TEST_CASE("linear's own kernels give bf16 tokens the bits of libtorch's conversions",
          "[ops][gemv]") {
    // One token (gemv) and a few after a cached context (the few-token kernel), bf16 in and out:
    // the same as widening with .to(float32), the kernel, and rounding with .to(bf16).
    const torch::Tensor weight = (torch::randn({96, 64}) * 0.1).to(torch::kBFloat16);
    for (int64_t tokens : {1, 5}) {
        const torch::Tensor x = torch::randn({tokens, 64}).to(torch::kBFloat16);
        if (tokens > 1 && !kv::gemm_few_bf16_fits(tokens, 64)) {
            WARN("neither AVX-512 nor AVX2: the few-token kernel is not used here");
            continue;
        }
        const torch::Tensor got = kv::linear(x, weight, {}, /*after_context=*/true);
        REQUIRE(got.scalar_type() == torch::kBFloat16);
        const torch::Tensor wide = x.to(torch::kFloat32).contiguous();
        torch::Tensor expected = torch::empty({tokens, 96}, torch::kFloat32);
        const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
        if (tokens == 1)
            kv::gemv_bf16(w, wide.data_ptr<float>(), expected.data_ptr<float>(), 96, 64);
        else
            kv::gemm_few_bf16(w, wide.data_ptr<float>(), expected.data_ptr<float>(), tokens, 96,
                              64);
        CHECK(torch::equal(got, expected.to(torch::kBFloat16)));
    }
}

TEST_CASE("gemv over many rows gives each row the bits of that row alone, near float64",
          "[ops][gemv]") {
    // Rows go through the kernel 4 at a time, the rest one by one, split between threads in
    // chunks: every row must come out as a one-row call gives it.
    for (int64_t columns : {32, 96, 256, 640, 2048, 40}) {
        for (int64_t rows : {1, 3, 16, 17, 35, 64, 1030}) {
            INFO(rows << " rows of " << columns << " columns");
            const torch::Tensor weight =
                (random_tensor({rows, columns}, static_cast<uint64_t>(rows * 7 + columns)) * 0.1)
                    .to(torch::kBFloat16);
            const torch::Tensor x = random_tensor({columns}, static_cast<uint64_t>(columns));
            const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
            std::vector<float> all(static_cast<std::size_t>(rows)), one(all.size());
            kv::gemv_bf16(w, x.data_ptr<float>(), all.data(), rows, columns);
            for (int64_t r = 0; r < rows; ++r)
                kv::gemv_bf16(w + r * columns, x.data_ptr<float>(),
                              &one[static_cast<std::size_t>(r)], 1, columns);
            CHECK(std::memcmp(all.data(), one.data(), all.size() * sizeof(float)) == 0);
            // The float64 reference of the products of the bf16 weights and x as the kernel
            // rounds it (with AVX512-BF16) or as it is (without): within float32's sums.
            const torch::Tensor x_used = std::string(kv::gemv_isa()) == "avx512-bf16"
                                             ? x.to(torch::kBFloat16).to(torch::kFloat64)
                                             : x.to(torch::kFloat64);
            const torch::Tensor reference = torch::mv(weight.to(torch::kFloat64), x_used);
            const torch::Tensor got = torch::from_blob(all.data(), {rows}, torch::kFloat32);
            CHECK(torch::allclose(got.to(torch::kFloat64), reference, 1e-4, 1e-4));
        }
    }
}

TEST_CASE("rms_norm's host loop gives the bits of libtorch's operations", "[ops]") {
    torch::NoGradGuard no_gradients;
    // A decoding step's row, a prefill's rows, a transposed view; values over a wide range.
    const torch::Tensor wide =
        random_tensor({4, 8, 256}, 41) * torch::exp(random_tensor({256}, 42) * 4);
    for (const torch::Tensor& x : {wide.select(0, 0).narrow(0, 0, 1), wide.select(0, 1),
                                   wide.transpose(0, 1).narrow(2, 0, 64)}) {
        for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
            const torch::Tensor input = x.to(dtype);
            const torch::Tensor weight = random_tensor({x.size(-1)}, 43).to(dtype);
            for (double eps : {1e-5, 1e-6}) {
                const torch::Tensor fast = rms_norm(input, weight, eps);
                const torch::Tensor general = rms_norm_through_libtorch(input, weight, eps);
                CHECK(fast.scalar_type() == dtype);
                CHECK(fast.sizes() == general.sizes());
                CHECK(torch::equal(fast, general));
            }
        }
    }
}

TEST_CASE("rms_norm's own mean of squares gives libtorch's bits at every width", "[ops]") {
    torch::NoGradGuard no_gradients;
    // Widths below a vector (libtorch's then), around its cascade of 16 x 4 vectors, with tails
    // after the last whole vector and after the last group of four, and models' hidden sizes.
    for (int64_t width : {8, 15, 16, 17, 33, 64, 100, 128, 255, 256, 1000, 1024, 1031, 2048, 3072,
                          4100, 5120, 8192, 16400}) {
        // Debian's libtorch 1.13 (the tested one) sums as rms_norm does from 16 floats on.
        if (width >= 16 && !rms_norm_in_one_loop(width))
            WARN("rms_norm takes libtorch's operations for width " << width);
        for (int64_t rows : {1, 5}) {
            const torch::Tensor x =
                random_tensor({rows, width}, static_cast<uint64_t>(width * 10 + rows)) *
                torch::exp(random_tensor({width}, 7) * 3);
            for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
                INFO("width " << width << ", rows " << rows << ", " << c10::toString(dtype));
                const torch::Tensor input = x.to(dtype);
                const torch::Tensor weight = random_tensor({width}, 9).to(dtype);
                CHECK(torch::equal(rms_norm(input, weight, 1e-5),
                                   rms_norm_through_libtorch(input, weight, 1e-5)));
            }
        }
    }
}

TEST_CASE("Rope::apply's host rows give the bits of libtorch's operations", "[ops][rope]") {
    torch::NoGradGuard no_gradients;
    for (RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
        const ModelConfig config = llama3_rope_config(64, layout, 32.0);
        const Rope rope(config);
        torch::Tensor keys = random_tensor({32, 7, 64}, 44);
        // -0 turned by angle 0 with a negative partner: -0 - (-1 x 0) is +0, where not rotating
        // at position 0 would leave -0.
        keys[0][0][0] = -0.0f;
        keys[0][0][1] = -1.0f;
        keys[0][0][32] = -1.0f;
        const torch::Tensor positions =
            torch::tensor(std::vector<int64_t>{0, 1, 2, 9, -5, 4000, 131071});
        for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
            const torch::Tensor x = keys.to(dtype);
            // A decoding step ([heads, 1, dim]), a prefill ([heads, T, dim]) and a
            // [T, heads, dim] projection seen as [heads, T, dim].
            const torch::Tensor one = x.narrow(1, 0, 1),
                                projection = x.transpose(0, 1).contiguous().transpose(0, 1);
            for (const torch::Tensor& input : {one, x, projection}) {
                const torch::Tensor at = positions.narrow(0, 0, input.size(1));
                const torch::Tensor fast = rope.apply(input, at);
                CHECK(fast.scalar_type() == dtype);
                CHECK(torch::equal(fast, rope_through_libtorch(rope, input, at)));
            }
            CHECK_FALSE(std::signbit(rope.apply(x, positions)[0][0][0].item<float>()));
            CHECK_FALSE(
                std::signbit(rope_through_libtorch(rope, x, positions)[0][0][0].item<float>()));
        }
    }
}

TEST_CASE("RoPE in both layouts matches the float64 reference", "[ops][rope]") {
    for (RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
        ModelConfig config;
        config.head_dim = 16;
        config.rope_theta = 10000;
        config.rope_layout = layout;
        const Rope rope(config);
        reference::RopeSpec spec;
        spec.head_dim = 16;
        spec.theta = 10000;
        spec.interleaved = layout == RopeLayout::interleaved;

        const torch::Tensor x = random_tensor({2, 4, 16}, 8);  // [heads, tokens, dim]
        const std::vector<int64_t> positions = {0, 1, 17, 3000};
        const auto got = to_vector(rope.apply(x, torch::tensor(positions)));
        std::vector<double> expected;
        for (int64_t h = 0; h < 2; ++h)
            for (int64_t t = 0; t < 4; ++t) {
                const auto y =
                    reference::rope(spec, to_vector(x[h][t]), static_cast<double>(positions[t]));
                expected.insert(expected.end(), y.begin(), y.end());
            }
        // Float angles at position 3000 carry ~1e-4 relative error, as in llama2.c and HF.
        CHECK(max_abs_difference(got, expected) < 2e-3);
    }
}

TEST_CASE("RoPE rotations compose: shifting a rotated key equals rotating it further",
          "[ops][rope]") {
    for (RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
        const ModelConfig config = llama3_rope_config(32, layout, 8.0);
        const Rope rope(config);
        const torch::Tensor x = random_tensor({3, 5, 32}, 9);
        const torch::Tensor positions = torch::tensor(std::vector<int64_t>{0, 1, 2, 50, 99});
        const torch::Tensor shifted = rope.shift(rope.apply(x, positions), 1234);
        const torch::Tensor direct = rope.apply(x, positions + 1234);
        CHECK(max_abs_difference(to_vector(shifted), to_vector(direct)) < 1e-3);
    }
}

TEST_CASE("Rope::shift's in-place path equals rotating by position tables, for every dtype",
          "[ops][rope]") {
    // shift() rotates host tensors with rotate_keys, split across threads; apply() with a
    // constant position is the general path (GPU tensors, gradients): they must agree exactly.
    for (RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
        const ModelConfig config = llama3_rope_config(64, layout, 32.0);
        const Rope rope(config);
        // 3 heads x 5,000 rows: more than one parallel chunk of 4,096 rows.
        const torch::Tensor keys = random_tensor({3, 5000, 64}, 31);
        for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
            const torch::Tensor x = keys.to(dtype);
            for (int64_t delta : {int64_t{1}, int64_t{-77}, int64_t{131000}}) {
                const torch::Tensor fast = rope.shift(x, delta);
                const torch::Tensor general =
                    rope_through_libtorch(rope, x, torch::full({x.size(-2)}, delta, torch::kInt64));
                CHECK(fast.scalar_type() == dtype);
                CHECK(torch::equal(fast, general));
            }
            CHECK(torch::equal(rope.shift(x, 0), x));
            // In place, on a slice of a larger cache-like tensor (rows contiguous per head,
            // heads apart): the same bits, and nothing outside the slice touched.
            const torch::Tensor cache = torch::cat({x, x}, 1).contiguous();
            const torch::Tensor before = cache.clone();
            const torch::Tensor slice = cache.narrow(1, 1000, 3000);
            REQUIRE(rope.shift_in_place(slice, -77));
            CHECK(torch::equal(slice, rope.shift(before.narrow(1, 1000, 3000), -77)));
            CHECK(torch::equal(cache.narrow(1, 0, 1000), before.narrow(1, 0, 1000)));
            CHECK(torch::equal(cache.narrow(1, 4000, 6000), before.narrow(1, 4000, 6000)));
            // Rows that are not contiguous are left alone.
            CHECK_FALSE(rope.shift_in_place(cache.transpose(0, 1), 5));
            CHECK(torch::equal(cache.narrow(1, 0, 1000), before.narrow(1, 0, 1000)));
        }
        // A non-contiguous view rotates like its contiguous copy, and the input is untouched.
        const torch::Tensor view = keys.transpose(0, 1);
        const torch::Tensor before = view.clone();
        CHECK(torch::equal(rope.shift(view, 9), rope.shift(view.contiguous(), 9)));
        CHECK(torch::equal(view, before));
        // Gradients still flow through a shift (kvtrain realigns adapter keys).
        const torch::Tensor leaf = keys.narrow(1, 0, 4).clone().requires_grad_(true);
        rope.shift(leaf, 5).sum().backward();
        REQUIRE(leaf.grad().defined());
        CHECK(leaf.grad().abs().sum().item<double>() > 0);
    }
}

TEST_CASE("kvpack's rotate_keys matches the float64 rotation and the runtime's Rope::shift",
          "[ops][rope]") {
    // kvpack realigns stored keys without libtorch; it must agree with both.
    const int64_t head_dim = 32, rows = 6, delta = 1234;
    for (RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
        const ModelConfig config = llama3_rope_config(head_dim, layout, 8.0);
        RopeSettings settings;
        settings.layout = layout;
        settings.head_dim = head_dim;
        settings.inverse_frequencies = rope_inverse_frequencies(config);
        const torch::Tensor keys = random_tensor({rows, head_dim}, 21);

        // Float64 reference: each pair turned by delta * frequency.
        const std::vector<double> original = to_vector(keys);
        std::vector<double> expected(original.size());
        const int64_t half = head_dim / 2;
        for (int64_t row = 0; row < rows; ++row)
            for (int64_t i = 0; i < half; ++i) {
                const int64_t a = layout == RopeLayout::half_split ? i : 2 * i;
                const int64_t b = layout == RopeLayout::half_split ? i + half : 2 * i + 1;
                const double angle = static_cast<double>(delta) * settings.inverse_frequencies[i];
                const double x = original[row * head_dim + a], y = original[row * head_dim + b];
                expected[row * head_dim + a] = x * std::cos(angle) - y * std::sin(angle);
                expected[row * head_dim + b] = y * std::cos(angle) + x * std::sin(angle);
            }

        torch::Tensor rotated = keys.clone();
        rotate_keys(reinterpret_cast<std::byte*>(rotated.data_ptr<float>()), CacheDtype::f32, rows,
                    settings, delta);
        // Angles are float32 products, as in run.c: ~1e-4 rad at this distance.
        CHECK(max_abs_difference(to_vector(rotated), expected) < 2e-3);
        const Rope rope(config);
        CHECK(torch::equal(rotated, rope.shift(keys.unsqueeze(0), delta).squeeze(0)));

        torch::Tensor rotated_bf16 = keys.to(torch::kBFloat16).contiguous();
        rotate_keys(reinterpret_cast<std::byte*>(rotated_bf16.data_ptr()), CacheDtype::bf16, rows,
                    settings, delta);
        CHECK(max_abs_difference(to_vector(rotated_bf16), expected) < 5e-2);
        CHECK(torch::equal(rotated_bf16,
                           rope.shift(keys.to(torch::kBFloat16).unsqueeze(0), delta).squeeze(0)));

        // A rotation there and back returns the keys, up to float32 rounding.
        rotate_keys(reinterpret_cast<std::byte*>(rotated.data_ptr<float>()), CacheDtype::f32, rows,
                    settings, -delta);
        CHECK(max_abs_difference(to_vector(rotated), original) < 1e-5);
    }
}

TEST_CASE("rotate_keys gives the scalar float32 rotation's bits at every width and layout",
          "[ops][rope]") {
    // The vector path (16 values at a time, lanes masked at the end of a row) against the
    // rotation written out in float32 as the scalar loop computes it, rounded to bf16 by
    // float_to_bf16; widths with and without a tail, and infinities and NaNs among the keys.
    // Interleaved rows' tails of 1, 3, 7 and 4 angles (6, 14, 30, 40), half-split ones of 3,
    // 7, 12, 15, 4 and 8 values.
    for (int64_t head_dim : {6, 14, 24, 30, 32, 40, 64, 80, 128}) {
        for (RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
            for (CacheDtype dtype : {CacheDtype::f32, CacheDtype::bf16}) {
                CAPTURE(head_dim, layout == RopeLayout::interleaved, dtype == CacheDtype::bf16);
                ModelConfig config;
                config.head_dim = head_dim;
                config.rope_theta = 10000;
                RopeSettings settings;
                settings.layout = layout;
                settings.head_dim = head_dim;
                settings.inverse_frequencies = rope_inverse_frequencies(config);
                const int64_t rows = 37, delta = 4097;
                const torch::Tensor random = random_tensor({rows, head_dim}, 70).contiguous();
                std::vector<float> values(random.data_ptr<float>(),
                                          random.data_ptr<float>() + random.numel());
                values[5] = std::numeric_limits<float>::infinity();
                values[static_cast<std::size_t>(head_dim) + 3] = std::nanf("");
                values[static_cast<std::size_t>(2 * head_dim)] = -0.0f;
                const bool bf16 = dtype == CacheDtype::bf16;
                std::vector<std::byte> bytes(values.size() * (bf16 ? 2 : 4));
                for (std::size_t i = 0; i < values.size(); ++i)
                    store_float(bytes.data(), dtype, i, values[i]);
                std::vector<std::byte> want = bytes;
                const int64_t half = head_dim / 2;
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t i = 0; i < half; ++i) {
                        const float angle =
                            static_cast<float>(delta) *
                            settings.inverse_frequencies[static_cast<std::size_t>(i)];
                        const float c = cosf(angle), s = sinf(angle);
                        const auto a = static_cast<std::size_t>(
                            r * head_dim + (layout == RopeLayout::interleaved ? 2 * i : i));
                        const auto b = static_cast<std::size_t>(
                            r * head_dim +
                            (layout == RopeLayout::interleaved ? 2 * i + 1 : i + half));
                        const float x = load_float(bytes.data(), dtype, a),
                                    y = load_float(bytes.data(), dtype, b);
                        const float first = x * c, second = y * s, third = y * c, fourth = x * s;
                        store_float(want.data(), dtype, a, first - second);
                        store_float(want.data(), dtype, b, third + fourth);
                    }
                rotate_keys(bytes.data(), dtype, static_cast<std::size_t>(rows), settings, delta);
                CHECK(std::memcmp(bytes.data(), want.data(), bytes.size()) == 0);
            }
        }
    }
}

TEST_CASE("rotating bf16 rows rounds once: float_to_bf16 of the float32 rotation of their values",
          "[ops][rope]") {
    // IceCache restores a stored index's keys this way, a bf16 row at a time, where it rotated a
    // float32 copy of the head and rounded that (icecache.cpp, read_rotated_bf16).
    ModelConfig config;
    config.head_dim = 64;
    config.rope_theta = 500000;
    const RopeSettings settings{RopeLayout::half_split, 64, rope_inverse_frequencies(config)};
    const int64_t rows = 33;
    const torch::Tensor random = (random_tensor({rows, 64}, 71) * 3).to(torch::kBFloat16);
    std::vector<uint16_t> narrow(static_cast<std::size_t>(rows * 64));
    std::memcpy(narrow.data(), random.data_ptr(), narrow.size() * 2);
    narrow[3] = 0x7f81;   // a signalling NaN
    narrow[70] = 0x0001;  // the smallest denormal
    narrow[71] = 0xff80;  // -infinity
    for (const int64_t delta : {int64_t{1}, int64_t{-7}, int64_t{32768}}) {
        CAPTURE(delta);
        std::vector<float> wide(narrow.size());
        for (std::size_t i = 0; i < wide.size(); ++i)
            wide[i] = bf16_to_float(narrow[i]);
        rotate_keys(reinterpret_cast<std::byte*>(wide.data()), CacheDtype::f32,
                    static_cast<std::size_t>(rows), settings, delta);
        std::vector<uint16_t> rotated = narrow;
        rotate_keys(reinterpret_cast<std::byte*>(rotated.data()), CacheDtype::bf16,
                    static_cast<std::size_t>(rows), settings, delta);
        for (std::size_t i = 0; i < wide.size(); ++i)
            CHECK(rotated[i] == float_to_bf16(wide[i]));
    }
    // Unrotated, the round trip changes a signalling NaN only: it comes back quiet.
    CHECK(float_to_bf16(bf16_to_float(0x7f81)) == 0x7fc1);
    CHECK(float_to_bf16(bf16_to_float(0x0001)) == 0x0001);
}

TEST_CASE("llama3 RoPE scaling matches Meta's formula in float64", "[ops][rope]") {
    ModelConfig config;
    config.head_dim = 128;
    config.rope_theta = 500000;
    config.rope_scaling = {RopeScalingType::llama3, 8.0, 1.0, 4.0, 8192};
    const std::vector<float> got = rope_inverse_frequencies(config);
    reference::RopeSpec spec;
    spec.head_dim = 128;
    spec.theta = 500000;
    spec.llama3_factor = 8;
    int scaled = 0, kept = 0, smoothed = 0;
    for (int i = 0; i < 64; ++i) {
        const double expected = reference::inverse_frequency(spec, i);
        const double unscaled = 1.0 / std::pow(500000.0, 2.0 * i / 128);
        CHECK(got[i] == Approx(expected).epsilon(1e-5));
        if (std::abs(expected - unscaled) < 1e-12 * unscaled)
            ++kept;
        else if (std::abs(expected - unscaled / 8) < 1e-9 * unscaled)
            ++scaled;
        else
            ++smoothed;
    }
    // All three bands occur for Llama 3.1's settings.
    CHECK(kept > 0);
    CHECK(scaled > 0);
    CHECK(smoothed > 0);

    config.rope_scaling = {RopeScalingType::linear, 4.0};
    const std::vector<float> linear = rope_inverse_frequencies(config);
    CHECK(linear[3] == Approx(1.0 / std::pow(500000.0, 6.0 / 128) / 4).epsilon(1e-6));
}

TEST_CASE("attention with grouped-query heads matches the float64 reference", "[ops][attention]") {
    const int64_t query_heads = 6, kv_heads = 2, head_dim = 8, cached = 3, tokens = 4;
    const int64_t keys_count = cached + tokens;
    const torch::Tensor q = random_tensor({query_heads, tokens, head_dim}, 10);
    const torch::Tensor k = random_tensor({kv_heads, keys_count, head_dim}, 11);
    const torch::Tensor v = random_tensor({kv_heads, keys_count, head_dim}, 12);
    const std::vector<int64_t> key_positions = {0, 1, 2, 3, 4, 5, 6};
    const std::vector<int64_t> query_positions = {3, 4, 5, 6};
    torch::Tensor allow = torch::ones({tokens, keys_count}, torch::kBool);
    allow[2][0] = false;  // an extra restriction on top of causality
    allow[2][4] = false;

    for (bool restricted : {false, true}) {
        AttentionMask mask{torch::tensor(query_positions),
                           torch::tensor(key_positions),
                           0,
                           restricted ? allow : torch::Tensor(),
                           {}};
        const auto got = to_vector(attention(q, k, v, mask, 1.0 / std::sqrt(8.0)));
        std::vector<double> expected;
        for (int64_t h = 0; h < query_heads; ++h) {
            const int64_t kv_head = h / (query_heads / kv_heads);
            std::vector<reference::Vector> keys, values;
            for (int64_t j = 0; j < keys_count; ++j) {
                keys.push_back(to_vector(k[kv_head][j]));
                values.push_back(to_vector(v[kv_head][j]));
            }
            for (int64_t t = 0; t < tokens; ++t) {
                std::vector<bool> visible(keys_count);
                for (int64_t j = 0; j < keys_count; ++j)
                    visible[j] = key_positions[j] <= query_positions[t] &&
                                 (!restricted || allow[t][j].item<bool>());
                const auto out = reference::attend(to_vector(q[h][t]), keys, values, visible);
                expected.insert(expected.end(), out.begin(), out.end());
            }
        }
        CHECK(max_abs_difference(got, expected) < 1e-5);
    }

    SECTION("a query that may see nothing gets zeros, not NaN") {
        torch::Tensor none = torch::zeros({tokens, keys_count}, torch::kBool);
        AttentionMask mask{
            torch::tensor(query_positions), torch::tensor(key_positions), 0, none, {}};
        const torch::Tensor out = attention(q, k, v, mask, 0.35);
        CHECK(out.abs().sum().item<double>() == 0.0);
    }

    SECTION("a sliding window hides keys older than the window") {
        AttentionMask mask{torch::tensor(query_positions), torch::tensor(key_positions), 2, {}, {}};
        const auto got = to_vector(attention(q, k, v, mask, 0.35));
        std::vector<reference::Vector> keys, values;
        for (int64_t j = 0; j < keys_count; ++j) {
            keys.push_back(to_vector(k[0][j]));
            values.push_back(to_vector(v[0][j]));
        }
        std::vector<bool> visible = {false, false, false, false, true, true, false};  // query at 5
        const auto out =
            reference::attend(to_vector(q[0][2] * (0.35 * std::sqrt(8.0))), keys, values, visible);
        for (int64_t d = 0; d < head_dim; ++d)
            CHECK(got[2 * head_dim + d] == Approx(out[d]).margin(1e-5));
    }
}

namespace {

// Dense causal attention in float64 through libtorch's autograd: the reference for the tiled
// kernel's outputs and gradients.
torch::Tensor dense_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, double scale) {
    const int64_t group = q.size(0) / k.size(0), tokens = q.size(1);
    const torch::Tensor keys = k.repeat_interleave(group, 0),
                        values = v.repeat_interleave(group, 0);
    const torch::Tensor later = torch::ones({tokens, tokens}, torch::kBool).triu(1);
    const torch::Tensor scores =
        torch::matmul(q, keys.transpose(1, 2)).mul(scale).masked_fill(later, -INFINITY);
    return torch::matmul(torch::softmax(scores, -1), values);
}

// Causal attention of bf16 copies of q, k, v by the tiled kernel or by the general path (an
// `allow` of all true sends attention() there), and the gradients of (out * upstream).sum():
// out, dq, dk, dv in float64, after checking that they kept bf16.
std::vector<torch::Tensor> bf16_attention_and_gradients(const torch::Tensor& q0,
                                                        const torch::Tensor& k0,
                                                        const torch::Tensor& v0,
                                                        const torch::Tensor& upstream, double scale,
                                                        bool tiled) {
    const int64_t tokens = q0.size(1);
    const torch::Tensor positions = torch::arange(tokens);
    const AttentionMask general_mask{
        positions, positions, 0, torch::ones({tokens, tokens}, torch::kBool), {}};
    torch::Tensor q = q0.to(torch::kBFloat16).requires_grad_(),
                  k = k0.to(torch::kBFloat16).requires_grad_(),
                  v = v0.to(torch::kBFloat16).requires_grad_();
    const torch::Tensor out =
        tiled ? causal_self_attention(q, k, v, scale) : attention(q, k, v, general_mask, scale);
    CHECK(out.scalar_type() == torch::kBFloat16);
    (out.to(torch::kFloat64) * upstream.to(torch::kFloat64)).sum().backward();
    CHECK(k.grad().scalar_type() == torch::kBFloat16);
    return {out.detach().to(torch::kFloat64), q.grad().to(torch::kFloat64),
            k.grad().to(torch::kFloat64), v.grad().to(torch::kFloat64)};
}

}  // namespace

TEST_CASE("tiled causal self-attention and its gradients match float64 autograd",
          "[ops][attention]") {
    // The demo model's head shapes (8 query heads over 2 kv heads of 32) at 1,100 tokens: tiles
    // of 59 queries (2^18 score elements), 18 whole and a partial one, per kv head.
    const int64_t query_heads = 8, kv_heads = 2, head_dim = 32, tokens = 1100;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    const torch::Tensor q0 = random_tensor({query_heads, tokens, head_dim}, 20);
    const torch::Tensor k0 = random_tensor({kv_heads, tokens, head_dim}, 21);
    const torch::Tensor v0 = random_tensor({kv_heads, tokens, head_dim}, 22);
    const torch::Tensor upstream = random_tensor({query_heads, tokens, head_dim}, 23);

    const auto gradients_of = [&](torch::ScalarType dtype, bool reference) {
        torch::Tensor q = q0.to(dtype).requires_grad_(), k = k0.to(dtype).requires_grad_(),
                      v = v0.to(dtype).requires_grad_();
        const torch::Tensor out = reference ? dense_causal_attention(q, k, v, scale)
                                            : causal_self_attention(q, k, v, scale);
        CHECK(out.scalar_type() == dtype);
        (out.to(torch::kFloat64) * upstream.to(torch::kFloat64)).sum().backward();
        CHECK(q.grad().scalar_type() == dtype);
        CHECK(k.grad().scalar_type() == dtype);
        return std::vector<std::vector<double>>{to_vector(out), to_vector(q.grad()),
                                                to_vector(k.grad()), to_vector(v.grad())};
    };
    const auto expected = gradients_of(torch::kFloat64, true);
    const char* names[] = {"output", "dq", "dk", "dv"};
    SECTION("float32") {
        const auto got = gradients_of(torch::kFloat32, false);
        for (int i = 0; i < 4; ++i) {
            INFO(names[i]);
            CHECK(max_abs_difference(got[i], expected[i]) < 2e-5);
        }
    }
    SECTION("bf16: no further from float64 than the general path's bf16 attention") {
        // The products in bf16, as the general path computes them (its scores are rounded to
        // bf16 too).
        const auto run = [&](bool tiled) {
            std::vector<std::vector<double>> results;
            for (const torch::Tensor& result :
                 bf16_attention_and_gradients(q0, k0, v0, upstream, scale, tiled))
                results.push_back(to_vector(result));
            return results;
        };
        const auto tiled = run(true), general = run(false);
        for (int i = 0; i < 4; ++i) {
            INFO(names[i]);
            const double tiled_error = max_abs_difference(tiled[i], expected[i]);
            const double general_error = max_abs_difference(general[i], expected[i]);
            INFO("tiled " << tiled_error << ", general " << general_error);
            // Within two bf16 steps of the largest value, as the general path is where libtorch's
            // bf16 products are computed with AVX-512 (oneDNN). dK and dV sum one bf16 product
            // per tile where the general path rounds one product over every query: a few more
            // roundings, of partial sums. On a CPU without AVX-512 libtorch's own bf16 products
            // land further away (dK 0.23 from float64 where two steps are 0.03, on an AVX2-only
            // CPU): there the tiled path is to be no further than they are.
            double largest = 0;
            for (double value : expected[i])
                largest = std::max(largest, std::abs(value));
            INFO("largest " << largest);
            CHECK(tiled_error <= std::max(largest / 128, general_error));
        }
    }
    SECTION("the same bits whatever the number of threads") {
        const int threads = at::get_num_threads();
        const auto bits_with = [&](int count) {
            at::set_num_threads(count);
            torch::Tensor q = q0.to(torch::kBFloat16).requires_grad_(),
                          k = k0.to(torch::kBFloat16).requires_grad_(),
                          v = v0.to(torch::kBFloat16).requires_grad_();
            const torch::Tensor out = causal_self_attention(q, k, v, scale);
            (out.to(torch::kFloat32) * upstream).sum().backward();
            return std::vector<torch::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
        };
        const auto one = bits_with(1), three = bits_with(3);
        at::set_num_threads(threads);
        for (int i = 0; i < 4; ++i) {
            INFO(names[i]);
            CHECK(
                torch::equal(one[static_cast<std::size_t>(i)], three[static_cast<std::size_t>(i)]));
        }
    }
    SECTION("attention() takes this path when gradients are wanted, and agrees with itself") {
        // Stretched positions (as training draws them): increasing, so causal by index.
        std::vector<int64_t> stretched(tokens);
        for (int64_t t = 0; t < tokens; ++t)
            stretched[t] = t < 400 ? t : t + 900;
        const torch::Tensor positions = torch::tensor(stretched);
        const AttentionMask mask{positions, positions, 0, {}, {}};
        torch::Tensor q = q0.clone().requires_grad_();
        const torch::Tensor trained = attention(q, k0, v0, mask, scale);
        CHECK(trained.grad_fn() != nullptr);
        CHECK(trained.grad_fn()->name().find("CausalAttention") != std::string::npos);
        torch::NoGradGuard no_grad;
        const torch::Tensor general = attention(q0, k0, v0, mask, scale);
        CHECK(max_abs_difference(to_vector(trained), to_vector(general)) < 2e-5);
        CHECK(max_abs_difference(to_vector(trained), expected[0]) < 2e-5);
    }
}

TEST_CASE("prefill attention by tiles: the last queries of a cache view, against float64",
          "[ops][attention]") {
    // 700 queries after 300 cached keys, in a [Hkv, capacity, D] buffer with room to spare (as
    // a cache's views are): 1,000 keys, tiles of 87 queries for groups of 3.
    const int64_t query_heads = 6, kv_heads = 2, head_dim = 16, cached = 300, tokens = 700;
    const int64_t keys_count = cached + tokens, capacity = 1100;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    const torch::Tensor q = random_tensor({query_heads, tokens, head_dim}, 50);
    const torch::Tensor k_buffer = random_tensor({kv_heads, capacity, head_dim}, 51);
    const torch::Tensor v_buffer = random_tensor({kv_heads, capacity, head_dim}, 52);
    // Increasing positions with a gap, as a packed context has.
    const torch::Tensor positions =
        torch::cat({torch::arange(cached), torch::arange(cached + 40, keys_count + 40)});
    const AttentionMask mask{positions.narrow(0, cached, tokens), positions, 0, {}, {}};
    const auto expected = [&](const torch::Tensor& qq, const torch::Tensor& kk,
                              const torch::Tensor& vv) {
        const int64_t group = query_heads / kv_heads;
        const torch::Tensor keys = kk.to(torch::kFloat64).repeat_interleave(group, 0);
        const torch::Tensor values = vv.to(torch::kFloat64).repeat_interleave(group, 0);
        const torch::Tensor later =
            torch::ones({tokens, keys_count}, torch::kBool).triu(cached + 1);
        const torch::Tensor scores = torch::matmul(qq.to(torch::kFloat64), keys.transpose(1, 2))
                                         .mul(scale)
                                         .masked_fill(later, -INFINITY);
        return to_vector(torch::matmul(torch::softmax(scores, -1), values));
    };
    SECTION("float32, and attention() takes this path") {
        const torch::Tensor k = k_buffer.narrow(1, 0, keys_count);
        const torch::Tensor v = v_buffer.narrow(1, 0, keys_count);
        const auto want = expected(q, k, v);
        CHECK(max_abs_difference(to_vector(causal_attention_prefill(q, k, v, scale)), want) < 2e-5);
        CHECK(max_abs_difference(to_vector(attention(q, k, v, mask, scale)), want) < 2e-5);
    }
    SECTION("bf16: as close to float64 as the general path") {
        const torch::Tensor q16 = q.to(torch::kBFloat16);
        const torch::Tensor k16 = k_buffer.to(torch::kBFloat16).narrow(1, 0, keys_count);
        const torch::Tensor v16 = v_buffer.to(torch::kBFloat16).narrow(1, 0, keys_count);
        const auto want = expected(q16, k16, v16);
        const torch::Tensor got = causal_attention_prefill(q16, k16, v16, scale);
        CHECK(got.scalar_type() == torch::kBFloat16);
        // An `allow` of all true sends attention() down the general path.
        const AttentionMask general_mask{mask.query_positions,
                                         positions,
                                         0,
                                         torch::ones({tokens, keys_count}, torch::kBool),
                                         {}};
        const torch::Tensor general = attention(q16, k16, v16, general_mask, scale);
        // Both round the scores and the probabilities to bf16 before their products: the same
        // error, give or take the exponential's last bits and the order of sums.
        const double general_error = max_abs_difference(to_vector(general), want);
        const double tiled_error = max_abs_difference(to_vector(got), want);
        INFO("tiled " << tiled_error << ", general " << general_error);
        // libtorch's bf16 products depend on the CPU: under 0.01 from float64 with AVX-512
        // (oneDNN), 0.018 on an AVX2-only CPU.
        CHECK(general_error < 0.03);
        CHECK(tiled_error <= 1.25 * general_error);
    }
    SECTION("what it refuses") {
        CHECK_THROWS(causal_attention_prefill(q.to(torch::kFloat64), k_buffer.to(torch::kFloat64),
                                              v_buffer.to(torch::kFloat64), scale));
        CHECK_THROWS(causal_attention_prefill(q, k_buffer.narrow(1, 0, 100),
                                              v_buffer.narrow(1, 0, 100), scale));
    }
}

TEST_CASE("the fused softmax rows and their backward match float64, in float32 and bf16",
          "[ops][attention]") {
    const float scale = 0.35f;
    // Widths that end in every lane position of a 16-float vector; scores up to ~15 apart after
    // scaling, as trained models' are.
    for (const int64_t width : {1, 7, 16, 37, 300}) {
        const int64_t visible = std::max<int64_t>(1, width - width / 3);
        const torch::Tensor scores = random_tensor({width}, 30 + width) * 20;
        const torch::Tensor d_probabilities = random_tensor({width}, 40 + width);
        const auto s = to_vector(scores), dp = to_vector(d_probabilities);
        // float64: probabilities, log-sum-exp, and the scores' gradient.
        double best = -INFINITY, total = 0, dot = 0;
        for (int64_t j = 0; j < visible; ++j)
            best = std::max(best, scale * s[j]);
        for (int64_t j = 0; j < visible; ++j)
            total += std::exp(scale * s[j] - best);
        const double lse = best + std::log(total);
        std::vector<double> p(width, 0.0), ds(width, 0.0);
        for (int64_t j = 0; j < visible; ++j)
            dot += (p[j] = std::exp(scale * s[j] - lse)) * dp[j];
        for (int64_t j = 0; j < visible; ++j)
            ds[j] = scale * p[j] * (dp[j] - dot);
        INFO("width " << width << ", visible " << visible);

        const auto check_float32 = [&](auto forward, auto backward) {
            std::vector<float> in(s.begin(), s.end()), d_in(dp.begin(), dp.end());
            std::vector<float> out(width, -1.0f), d_out(width, -1.0f), p_out(width, -1.0f);
            const float got_lse = forward(in.data(), out.data(), visible, width, scale);
            CHECK(got_lse == Approx(lse).epsilon(1e-6));
            backward(in.data(), d_in.data(), static_cast<float>(lse), p_out.data(), d_out.data(),
                     visible, width, scale);
            for (int64_t j = 0; j < width; ++j) {
                CHECK(out[j] == Approx(p[j]).margin(1e-6));
                CHECK(p_out[j] == Approx(p[j]).margin(1e-6));
                CHECK(d_out[j] == Approx(ds[j]).margin(1e-6));
            }
        };
        SECTION("the dispatched kernel, float32") {
            check_float32([](auto... a) { return softmax_row(a...); },
                          [](const float* a, const float* b, float c, float* d, float* e, int64_t f,
                             int64_t g, float h) { softmax_backward_row(a, b, c, d, e, f, g, h); });
        }
        SECTION("the portable loop") {
            check_float32([](auto... a) { return softmax_row_portable(a...); },
                          [](auto... a) { softmax_backward_row_portable(a...); });
        }
        SECTION("bf16 in and out: the float32 results rounded once") {
            const torch::Tensor s16 = scores.to(torch::kBFloat16).contiguous();
            const torch::Tensor dp16 = d_probabilities.to(torch::kBFloat16).contiguous();
            std::vector<float> s_rounded(width), dp_rounded(width);
            for (int64_t j = 0; j < width; ++j) {
                s_rounded[j] = s16[j].item<float>();
                dp_rounded[j] = dp16[j].item<float>();
            }
            std::vector<float> expected_p(width), expected_p2(width), expected_ds(width);
            const float expected_lse =
                softmax_row_portable(s_rounded.data(), expected_p.data(), visible, width, scale);
            softmax_backward_row_portable(s_rounded.data(), dp_rounded.data(), expected_lse,
                                          expected_p2.data(), expected_ds.data(), visible, width,
                                          scale);
            const auto* bits = static_cast<const uint16_t*>(s16.data_ptr());
            const auto* d_bits = static_cast<const uint16_t*>(dp16.data_ptr());
            std::vector<uint16_t> out(width, 0xFFFF), p_out(width, 0xFFFF), d_out(width, 0xFFFF);
            const float got_lse = softmax_row(bits, out.data(), visible, width, scale);
            CHECK(got_lse == Approx(expected_lse).epsilon(1e-6));
            softmax_backward_row(bits, d_bits, expected_lse, p_out.data(), d_out.data(), visible,
                                 width, scale);
            const auto as_float = [](const std::vector<uint16_t>& v) {
                return to_vector(torch::from_blob(const_cast<uint16_t*>(v.data()),
                                                  {static_cast<int64_t>(v.size())},
                                                  torch::kBFloat16));
            };
            const auto rounded = [](const std::vector<float>& v) {
                return to_vector(torch::tensor(v).to(torch::kBFloat16));
            };
            // The float32 values may differ in their last bits (a fused multiply-add, another
            // order of sums), which can move a rounding to the neighbouring bf16 value: one
            // bf16 step at most, beyond float32 differences where dp - d cancels.
            const auto within_a_step = [](const std::vector<double>& got,
                                          const std::vector<double>& want) {
                double largest = 0;
                for (double value : want)
                    largest = std::max(largest, std::abs(value));
                for (std::size_t j = 0; j < got.size(); ++j)
                    if (std::abs(got[j] - want[j]) >
                        std::abs(want[j]) / 128 + largest * 1e-5 + 1e-6)
                        return false;
                return true;
            };
            CHECK(within_a_step(as_float(out), rounded(expected_p)));
            CHECK(within_a_step(as_float(p_out), rounded(expected_p2)));
            CHECK(within_a_step(as_float(d_out), rounded(expected_ds)));
            for (int64_t j = visible; j < width; ++j)
                CHECK((out[j] == 0 && p_out[j] == 0 && d_out[j] == 0));
        }
    }
}

TEST_CASE("the gemv kernels match the float64 reference for f32 and bf16 weights", "[ops][gemv]") {
    // Odd sizes exercise the 4-row blocks, the remainder rows and the scalar tail columns.
    for (auto [rows, columns] :
         {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {37, 100}, {64, 2048}}) {
        const torch::Tensor weight = random_tensor({rows, columns}, 20);
        const torch::Tensor x = random_tensor({1, columns}, 21);
        for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
            const torch::Tensor stored = weight.to(dtype);
            const auto w = to_vector(stored);  // the exact stored values, widened
            reference::Matrix matrix(rows, reference::Vector(columns));
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t c = 0; c < columns; ++c)
                    matrix[r][c] = w[r * columns + c];
            const auto input = to_vector(x.to(dtype));
            torch::NoGradGuard no_grad;
            const auto got = to_vector(kv::linear(x.to(dtype), stored));
            const auto expected = reference::multiply(matrix, input);
            // f32 accumulation over up to 2048 terms; bf16 output rounding dominates for bf16.
            const double tolerance =
                dtype == torch::kFloat32 ? 1e-4 : 0.02 * std::sqrt(double(columns));
            CHECK(max_abs_difference(got, expected) < tolerance);
        }
    }
}

TEST_CASE("a few tokens through bf16 weights: each token's bits are one-token decoding's",
          "[ops][gemv]") {
    if (!kv::gemm_few_bf16_fits(2, 32)) {
        WARN(
            "neither AVX-512 nor AVX2 here: the few-tokens kernel is not used (linear takes "
            "libtorch's)");
        return;
    }
    // Rows by 4 and left over, blocks of rows (2048 columns: 32 rows a block with AVX512-BF16,
    // 16 widened), tokens by 4 and left over, the most tokens the kernel takes; a width with a
    // vector tail where the kernels take it (widening, not the dot-product instruction).
    for (auto [tokens, rows, columns] : {std::tuple<int64_t, int64_t, int64_t>{2, 5, 32},
                                         {9, 37, 256},
                                         {4, 640, 256},
                                         {22, 256, 640},
                                         {kv::max_few_tokens, 70, 2048},
                                         {3, 9, 44}}) {
        CAPTURE(tokens, rows, columns);
        if (!kv::gemm_few_bf16_fits(tokens, columns)) continue;
        const torch::Tensor weight = random_tensor({rows, columns}, 30).to(torch::kBFloat16);
        const torch::Tensor x = random_tensor({tokens, columns}, 31).to(torch::kBFloat16);
        torch::NoGradGuard no_grad;
        const torch::Tensor got =
            kv::linear(x, weight, {}, /*after_context=*/true).to(torch::kFloat32);
        // Not after a context (a document's tokens), the rows take libtorch's matmul, whatever
        // their number: a document has the same bits alone as in a batch. (Where bf16 matmuls
        // are widened, its float32 one: the test below.)
        if (!kv::widen_bf16_matmuls())
            CHECK(torch::equal(kv::linear(x, weight), torch::matmul(x, weight.t())));
        for (int64_t t = 0; t < tokens; ++t)
            CHECK(
                torch::equal(got[t], kv::linear(x.narrow(0, t, 1), weight)[0].to(torch::kFloat32)));
        // And against float64 over the stored values.
        const auto w = to_vector(weight), input = to_vector(x), out = to_vector(got);
        double worst = 0;
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t n = 0; n < rows; ++n) {
                double sum = 0;
                for (int64_t k = 0; k < columns; ++k)
                    sum += w[n * columns + k] * input[t * columns + k];
                worst = std::max(worst, std::abs(out[t * rows + n] - sum) / (1 + std::abs(sum)));
            }
        CHECK(worst < 1e-2);  // the output's rounding to bf16
    }
    // Outside what it takes, it refuses rather than computing something else: more tokens, and
    // with the dot-product instruction widths not a multiple of 32 (the kernels that widen the
    // weights take any width).
    CHECK_FALSE(kv::gemm_few_bf16_fits(kv::max_few_tokens + 1, 32));
    std::vector<uint16_t> weights(48);
    std::vector<float> in(96), out(4);
    CHECK_THROWS_AS(
        kv::gemm_few_bf16(weights.data(), in.data(), out.data(), kv::max_few_tokens + 1, 2, 48),
        std::invalid_argument);
    if (std::string(kv::gemv_isa()) == "avx512-bf16") {
        CHECK_FALSE(kv::gemm_few_bf16_fits(2, 48));
        CHECK_THROWS_AS(kv::gemm_few_bf16(weights.data(), in.data(), out.data(), 2, 2, 48),
                        std::invalid_argument);
    }
}

TEST_CASE("many tokens through bf16 weights, widened where libtorch's bf16 matmul is slow",
          "[ops][gemv]") {
    // A document's tokens: 3,000 rows of 1,400 columns are 3 blocks of 16 MiB widened (1,198
    // rows each) and a partial one; a few tokens and many, bf16 and float32 inputs.
    const torch::Tensor weight = (random_tensor({3000, 1400}, 40) * 0.05).to(torch::kBFloat16);
    for (int64_t tokens : {2, 70, 300}) {
        for (torch::ScalarType dtype : {torch::kBFloat16, torch::kFloat32}) {
            CAPTURE(tokens, dtype == torch::kBFloat16);
            const torch::Tensor x = random_tensor({tokens, 1400}, 41).to(dtype);
            torch::NoGradGuard no_grad;
            const torch::Tensor got = kv::linear(x, weight);
            CHECK(got.scalar_type() == dtype);
            const torch::Tensor want =
                torch::matmul(x.to(torch::kFloat64), weight.to(torch::kFloat64).t());
            // float32 sums of 1,400 products; bf16 outputs rounded once (2^-9 of the value).
            const double relative = dtype == torch::kBFloat16 ? 1.0 / 256 : 1e-5;
            const torch::Tensor error =
                (got.to(torch::kFloat64) - want).abs() - relative * want.abs();
            CHECK(error.max().item<double>() < 1e-4);
        }
    }
}

TEST_CASE("the kernel for many short rows matches the float64 reference", "[ops][gemv]") {
    // An index scoring candidates: 16 rows at a time, their sums folded together; counts that
    // are not multiples of 16 end in the plain kernel, widths not multiples of 16 go there whole.
    for (auto [rows, columns] :
         {std::pair<int64_t, int64_t>{1, 64}, {16, 64}, {37, 64}, {200, 128}, {33, 16}, {20, 24}}) {
        CAPTURE(rows, columns);
        const torch::Tensor weight = random_tensor({rows, columns}, 22);
        const torch::Tensor x = random_tensor({columns}, 23);
        std::vector<float> y(static_cast<std::size_t>(rows));
        dot_many_rows_f32(weight.data_ptr<float>(), x.data_ptr<float>(), y.data(), rows, columns);
        const auto w = to_vector(weight), input = to_vector(x);
        for (int64_t r = 0; r < rows; ++r) {
            double expected = 0;
            for (int64_t c = 0; c < columns; ++c)
                expected += w[static_cast<std::size_t>(r * columns + c)] *
                            input[static_cast<std::size_t>(c)];
            CHECK(std::abs(y[static_cast<std::size_t>(r)] - expected) < 1e-4);
        }
        // bf16 rows give the bits of float32 rows holding the same values.
        const torch::Tensor narrow = weight.to(torch::kBFloat16).contiguous();
        const torch::Tensor widened = narrow.to(torch::kFloat32).contiguous();
        std::vector<float> from_bf16(static_cast<std::size_t>(rows)),
            from_f32(static_cast<std::size_t>(rows));
        dot_many_rows_bf16(reinterpret_cast<const uint16_t*>(narrow.data_ptr()),
                           x.data_ptr<float>(), from_bf16.data(), rows, columns);
        dot_many_rows_f32(widened.data_ptr<float>(), x.data_ptr<float>(), from_f32.data(), rows,
                          columns);
        CHECK(from_bf16 == from_f32);
        // Without AVX-512 each row's sum is the plain kernel's, bit for bit (AVX-512's folding
        // adds in another order).
        if (std::string(kv::gemv_isa()) == "avx2") {
            std::vector<float> plain(static_cast<std::size_t>(rows));
            dot_rows_f32(weight.data_ptr<float>(), x.data_ptr<float>(), plain.data(), rows,
                         columns);
            CHECK(std::memcmp(plain.data(), y.data(), plain.size() * sizeof(float)) == 0);
        }
    }
}

TEST_CASE("a few queries after a long cache match the float64 reference", "[ops][attention]") {
    // The question after a cached context: 2-64 queries over >= 1,024 keys go query by query
    // through the decoding kernel, each over the keys its position lets it see (here the
    // queries' own keys come last, and positions have gaps, as in a packed compressed context).
    const int64_t query_heads = 4, kv_heads = 2, head_dim = 16, cached = 1200;
    for (int64_t queries : {2, 7, 64}) {
        for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
            const int64_t keys_count = cached + queries;
            const torch::Tensor buffer_k =
                random_tensor({kv_heads, keys_count + 10, head_dim}, 40).to(dtype);
            const torch::Tensor buffer_v =
                random_tensor({kv_heads, keys_count + 10, head_dim}, 41).to(dtype);
            const torch::Tensor k = buffer_k.narrow(1, 0, keys_count),
                                v = buffer_v.narrow(1, 0, keys_count);
            const torch::Tensor q = random_tensor({query_heads, queries, head_dim}, 42).to(dtype);
            // Cached tokens at 0, 2, 4, ... (gaps), then the queries' own positions.
            const torch::Tensor key_positions =
                torch::cat({torch::arange(0, 2 * cached, 2, torch::kInt64),
                            torch::arange(2 * cached, 2 * cached + queries, torch::kInt64)});
            const torch::Tensor query_positions = key_positions.narrow(0, cached, queries);
            AttentionMask mask{query_positions, key_positions, 0, {}, {}};
            torch::NoGradGuard no_grad;
            const auto got = to_vector(attention(q, k, v, mask, 1.0 / std::sqrt(double(head_dim))));
            std::vector<double> expected;
            for (int64_t h = 0; h < query_heads; ++h)
                for (int64_t t = 0; t < queries; ++t) {
                    std::vector<reference::Vector> keys, values;
                    std::vector<bool> visible;
                    for (int64_t j = 0; j < keys_count; ++j) {
                        keys.push_back(to_vector(k[h / 2][j]));
                        values.push_back(to_vector(v[h / 2][j]));
                        visible.push_back(j <= cached + t);
                    }
                    const auto out = reference::attend(to_vector(q[h][t]), keys, values, visible);
                    expected.insert(expected.end(), out.begin(), out.end());
                }
            CHECK(max_abs_difference(got, expected) < (dtype == torch::kFloat32 ? 1e-5 : 2e-2));
            // The same bits as one-token decoding of each query over the keys it sees.
            std::vector<double> by_query;
            for (int64_t t = 0; t < queries; ++t) {
                const int64_t seen = cached + t + 1;
                AttentionMask one{
                    query_positions.narrow(0, t, 1), key_positions.narrow(0, 0, seen), 0, {}, {}};
                const auto out = to_vector(attention(q.narrow(1, t, 1), k.narrow(1, 0, seen),
                                                     v.narrow(1, 0, seen), one,
                                                     1.0 / std::sqrt(double(head_dim))));
                by_query.insert(by_query.end(), out.begin(), out.end());
            }
            std::vector<double> got_by_query;  // [H, T, D] as [T, H, D]
            for (int64_t t = 0; t < queries; ++t)
                for (int64_t h = 0; h < query_heads; ++h)
                    for (int64_t d = 0; d < head_dim; ++d)
                        got_by_query.push_back(
                            got[static_cast<std::size_t>((h * queries + t) * head_dim + d)]);
            CHECK(got_by_query == by_query);
        }
    }
}

namespace {

// Every `stride`-th float from `from` to `to` (bit patterns, both of one sign), through
// exp_shifted_in_place in runs of odd lengths; returns how many differ from std::exp's bits.
int64_t exp_mismatches(float from, float to, uint32_t stride) {
    uint32_t first = 0, last = 0;
    std::memcpy(&first, &from, 4);
    std::memcpy(&last, &to, 4);
    if (first > last) std::swap(first, last);
    std::vector<float> inputs, outputs;
    int64_t mismatches = 0;
    auto flush = [&] {
        outputs = inputs;
        exp_shifted_in_place(outputs.data(), static_cast<int64_t>(outputs.size()), 0.0f);
        for (std::size_t i = 0; i < inputs.size(); ++i) {
            const float want = std::exp(inputs[i]);
            if (std::memcmp(&want, &outputs[i], 4) != 0) ++mismatches;
        }
        inputs.clear();
    };
    for (uint64_t bits = first; bits <= last; bits += stride) {
        const auto pattern = static_cast<uint32_t>(bits);
        float value = 0;
        std::memcpy(&value, &pattern, 4);
        inputs.push_back(value);
        if (inputs.size() == 4093) flush();
    }
    flush();
    return mismatches;
}

}  // namespace

TEST_CASE("exp_shifted_in_place gives expf's bits", "[ops][exp]") {
    // Softmax's exponentials go 16 lanes at a time in expf's own arithmetic: sampled over the
    // whole range softmax meets (every 61st float from -104 to 89, every float in [-1, 1] near
    // 0's ends), the special paths, and the shift applied in float first.
    CHECK(exp_mismatches(-104.0f, -0.0f, 61) == 0);
    CHECK(exp_mismatches(0.0f, 89.0f, 61) == 0);
    CHECK(exp_mismatches(-0x1p-10f, -0.0f, 1) == 0);
    CHECK(exp_mismatches(-1.0f, -0.99f, 1) == 0);
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> special = {-inf,   inf,     std::nanf(""), -88.0f,   88.0f,   88.72f,
                                  88.73f, -87.99f, -103.9f,       -103.98f, -150.0f, 100.0f,
                                  -0.0f,  0.0f,    1e-30f,        -1e-30f,  3.4e38f, -3.4e38f};
    std::vector<float> got = special;
    exp_shifted_in_place(got.data(), static_cast<int64_t>(got.size()), 0.0f);
    for (std::size_t i = 0; i < special.size(); ++i) {
        CAPTURE(special[i]);
        const float want = std::exp(special[i]);
        if (std::isnan(want))
            CHECK(std::isnan(got[i]));
        else
            CHECK(std::memcmp(&want, &got[i], 4) == 0);
    }
    // x - shift in float, then expf: softmax's subtraction of the row's maximum.
    std::vector<float> scores = {3.5f, -2.25f, 10.0f, 7.125f, -inf, 0.1f, 9.99f};
    std::vector<float> shifted = scores;
    exp_shifted_in_place(shifted.data(), static_cast<int64_t>(shifted.size()), 10.0f);
    for (std::size_t i = 0; i < scores.size(); ++i) {
        const float want = std::exp(scores[i] - 10.0f);
        CHECK(std::memcmp(&want, &shifted[i], 4) == 0);
    }
}

TEST_CASE("exp_shifted_in_place gives expf's bits for every float from -104 to 89", "[slow]") {
    CHECK(exp_mismatches(-104.0f, -0.0f, 1) == 0);
    CHECK(exp_mismatches(0.0f, 89.0f, 1) == 0);
}

TEST_CASE("one-token decoding: a kv head's query heads together give the bits of one by one",
          "[ops][attention]") {
    // Grouped-query decoding reads each kv head's keys once for its query heads (from 1,024
    // keys); each query head's output must be what the kernel's own arithmetic gives it alone.
    const int64_t kv_heads = 2, head_dim = 64;
    for (int64_t group : {1, 4}) {
        for (int64_t keys : {300, 1024, 5000}) {
            for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
                CAPTURE(group, keys, dtype == torch::kBFloat16);
                const int64_t query_heads = kv_heads * group;
                const torch::Tensor k =
                    (random_tensor({kv_heads, keys, head_dim}, 60) * 2).to(dtype).contiguous();
                const torch::Tensor v = random_tensor({kv_heads, keys, head_dim}, 61).to(dtype);
                const torch::Tensor q = random_tensor({query_heads, 1, head_dim}, 62).to(dtype);
                const torch::Tensor positions = torch::arange(keys, torch::kInt64);
                AttentionMask mask{positions.narrow(0, keys - 1, 1), positions, 0, {}, {}};
                const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
                torch::NoGradGuard no_grad;
                const torch::Tensor got =
                    attention(q, k, v, mask, scale).to(torch::kFloat32).contiguous();
                const bool bf16 = dtype == torch::kBFloat16;
                const torch::Tensor queries = q.to(torch::kFloat32).contiguous();
                std::vector<float> scores(static_cast<std::size_t>(keys));
                std::vector<float> expected(static_cast<std::size_t>(query_heads * head_dim), 0.0f);
                for (int64_t h = 0; h < query_heads; ++h) {
                    const torch::Tensor kh = k[h / group].contiguous(),
                                        vh = v[h / group].contiguous();
                    dot_rows({kh.data_ptr(), bf16}, queries.data_ptr<float>() + h * head_dim,
                             scores.data(), keys, head_dim);
                    softmax_scaled_in_place(scores.data(), keys, scale);
                    accumulate_rows({vh.data_ptr(), bf16}, scores.data(),
                                    expected.data() + h * head_dim, keys, head_dim);
                }
                // The output is rounded to the queries' dtype, as the model's activations are.
                const torch::Tensor want =
                    torch::from_blob(expected.data(), {query_heads, 1, head_dim})
                        .to(dtype)
                        .to(torch::kFloat32);
                CHECK(torch::equal(got, want));
            }
        }
    }
}

TEST_CASE("attend_rows: query rows over prefixes of one kv head, against float64 and row by row",
          "[ops][attention][gemv]") {
    // A short question's rows over a long context: each row over its own prefix of the keys
    // (empty, inside the first block, on block boundaries, all of them), rows in register groups
    // (of 4 for the scores, over the keys the 4 share) and left over, widths with and without a
    // register kernel or vector tail; the last case holds more scores than one pass keeps (16 MiB),
    // so the rows go in several passes.
    struct Case {
        int64_t columns, keys;
        std::vector<int64_t> visible;
    };
    const std::vector<Case> cases = {
        {64, 1030, {0, 1, 255, 256, 257, 600, 1030, 1029, 1028}},
        {128, 700, {700, 699, 698, 512, 3}},
        {16,
         300,
         {300, 299, 298, 297, 296, 295, 294, 293, 292, 291, 290, 289, 288, 287, 286, 285, 284}},
        {24, 513, {513, 100, 0, 512}},
        // Rows by 4 over the keys they share, each row's own rest after them.
        {32, 2000, {2000, 1999, 1998, 1997, 1996, 1995, 1994, 1993, 1990, 1000, 7, 2000}},
        {16, 70000, std::vector<int64_t>(70, 70000)}};
    for (const Case& c : cases) {
        const int64_t count = static_cast<int64_t>(c.visible.size());
        CAPTURE(c.columns, c.keys, count);
        const torch::Tensor queries = random_tensor({count, c.columns}, 50);
        for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
            CAPTURE(dtype == torch::kBFloat16);
            // Keys with a large spread, so that the softmax is peaked as real attention is.
            const torch::Tensor k = (random_tensor({c.keys, c.columns}, 51) * 2).to(dtype);
            const torch::Tensor v = random_tensor({c.keys, c.columns}, 52).to(dtype);
            // bf16 queries as a bf16 model's are: exact in bf16.
            const torch::Tensor q = queries.to(dtype).to(torch::kFloat32).contiguous();
            const bool bf16 = dtype == torch::kBFloat16;
            const float scale = 1.0f / std::sqrt(static_cast<float>(c.columns));
            std::vector<float> got(static_cast<std::size_t>(count * c.columns), -1.0f);
            attend_rows({k.data_ptr(), bf16}, {v.data_ptr(), bf16}, q.data_ptr<float>(), count,
                        c.visible.data(), c.columns, scale, got.data());

            // Row by row, as one-token decoding computes each: the same bits.
            std::vector<float> by_row(got.size(), 0.0f), scores(static_cast<std::size_t>(c.keys));
            for (int64_t r = 0; r < count; ++r) {
                const int64_t n = c.visible[static_cast<std::size_t>(r)];
                if (n == 0) continue;
                dot_rows({k.data_ptr(), bf16}, q.data_ptr<float>() + r * c.columns, scores.data(),
                         n, c.columns);
                softmax_scaled_in_place(scores.data(), n, scale);
                accumulate_rows({v.data_ptr(), bf16}, scores.data(), by_row.data() + r * c.columns,
                                n, c.columns);
            }
            CHECK(got == by_row);

            // Against float64 over the stored (widened) values.
            const auto keys = to_vector(k), values = to_vector(v), query = to_vector(q);
            double worst = 0;
            for (int64_t r = 0; r < count; ++r) {
                const int64_t n = c.visible[static_cast<std::size_t>(r)];
                std::vector<double> logits(static_cast<std::size_t>(n));
                double best = -std::numeric_limits<double>::infinity();
                for (int64_t j = 0; j < n; ++j) {
                    double dot = 0;
                    for (int64_t d = 0; d < c.columns; ++d)
                        dot += keys[static_cast<std::size_t>(j * c.columns + d)] *
                               query[static_cast<std::size_t>(r * c.columns + d)];
                    logits[static_cast<std::size_t>(j)] = dot * scale;
                    best = std::max(best, dot * scale);
                }
                double total = 0;
                for (double& logit : logits)
                    total += (logit = std::exp(logit - best));
                for (int64_t d = 0; d < c.columns; ++d) {
                    double want = 0;
                    for (int64_t j = 0; j < n; ++j)
                        want += logits[static_cast<std::size_t>(j)] / total *
                                values[static_cast<std::size_t>(j * c.columns + d)];
                    worst = std::max(
                        worst, std::abs(want - got[static_cast<std::size_t>(r * c.columns + d)]));
                }
            }
            // float32 scores and sums over up to 70,000 terms (bf16 queries round exactly).
            CHECK(worst < 1e-4);
        }
    }
}

TEST_CASE("one-token attention over a cache view matches the float64 reference",
          "[ops][attention]") {
    // The decoding step reads [Hkv, S, D] views of a larger cache buffer, in f32 or bf16.
    const int64_t query_heads = 8, kv_heads = 2, head_dim = 24, capacity = 40;
    for (int64_t keys_count : {1, 5, 33}) {
        for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
            const torch::Tensor buffer_k =
                random_tensor({kv_heads, capacity, head_dim}, 30).to(dtype);
            const torch::Tensor buffer_v =
                random_tensor({kv_heads, capacity, head_dim}, 31).to(dtype);
            const torch::Tensor k = buffer_k.narrow(1, 0, keys_count),
                                v = buffer_v.narrow(1, 0, keys_count);
            const torch::Tensor q = random_tensor({query_heads, 1, head_dim}, 32).to(dtype);
            AttentionMask mask{torch::full({1}, keys_count - 1, torch::kInt64),
                               torch::arange(keys_count, torch::kInt64),
                               0,
                               {},
                               {}};
            torch::NoGradGuard no_grad;
            const auto got = to_vector(attention(q, k, v, mask, 1.0 / std::sqrt(double(head_dim))));
            std::vector<double> expected;
            for (int64_t h = 0; h < query_heads; ++h) {
                std::vector<reference::Vector> keys, values;
                for (int64_t j = 0; j < keys_count; ++j) {
                    keys.push_back(to_vector(k[h / 4][j]));
                    values.push_back(to_vector(v[h / 4][j]));
                }
                const auto out = reference::attend(to_vector(q[h][0]), keys, values,
                                                   std::vector<bool>(keys_count, true));
                expected.insert(expected.end(), out.begin(), out.end());
            }
            CHECK(max_abs_difference(got, expected) < (dtype == torch::kFloat32 ? 1e-5 : 2e-2));
        }
    }
}

TEST_CASE("tiled bf16 attention agrees with the general path under peaked attention",
          "[ops][attention]") {
    // Trained heads attend sharply (a previous-token head puts nearly all its mass on one key),
    // where bf16 scores are far from float64 (dq ~9% at 6x the random scale): both paths round
    // the same products, so they must agree with each other much more closely than with float64.
    const int64_t query_heads = 8, kv_heads = 2, head_dim = 32, tokens = 256;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    const torch::Tensor upstream = random_tensor({query_heads, tokens, head_dim}, 23);
    for (double sharpness : {1.0, 3.0, 6.0}) {
        const torch::Tensor q0 = random_tensor({query_heads, tokens, head_dim}, 20) * sharpness;
        const torch::Tensor k0 = random_tensor({kv_heads, tokens, head_dim}, 21) * sharpness;
        const torch::Tensor v0 = random_tensor({kv_heads, tokens, head_dim}, 22);
        const auto tiled = bf16_attention_and_gradients(q0, k0, v0, upstream, scale, true);
        const auto general = bf16_attention_and_gradients(q0, k0, v0, upstream, scale, false);
        const char* names[] = {"output", "dq", "dk", "dv"};
        for (std::size_t i = 0; i < 4; ++i) {
            INFO("sharpness " << sharpness << ", " << names[i]);
            const double difference =
                (tiled[i] - general[i]).norm().item<double>() / general[i].norm().item<double>();
            CHECK(difference < 2e-3);
        }
    }
}
