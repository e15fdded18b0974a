#include "kv/model/ops.hpp"

#include "kernel_scratch.hpp"
#include "kv/error.hpp"
#include "kv/model/gemv.hpp"
#include "kv/rope.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numbers>
#include <optional>
#include <random>
#include <type_traits>

namespace kv {

namespace {

// Whether rms_norm's scaling can run as one loop over host memory: f32 or bf16 rows with a
// weight of their dtype, nothing autograd must see.
bool rms_scaling_on_host(const torch::Tensor& x, const torch::Tensor& weight) {
    if (!x.device().is_cpu() || !weight.device().is_cpu() || x.dim() < 1) return false;
    if (x.scalar_type() != torch::kFloat32 && x.scalar_type() != torch::kBFloat16) return false;
    if (weight.scalar_type() != x.scalar_type() || weight.dim() != 1 ||
        weight.size(0) != x.size(-1) || !weight.is_contiguous())
        return false;
    return !at::GradMode::is_enabled() || (!x.requires_grad() && !weight.requires_grad());
}

}  // namespace

namespace {

// libtorch's float sum of a contiguous row (1.13's SumKernel.cpp, vectorized_inner_sum with
// row_sum and multi_row_sum over vectors of `Lanes` floats: four interleaved accumulators of
// vectors, cascaded every 16 vectors of each, added together, then the row's tail after its last
// whole vector one by one, then the vector's lanes in order), of squares[0..width), divided by
// width as mean() divides. Lane-wise float additions in libtorch's order, so its bits.
template <int Lanes>
float mean_of_squares(const float* squares, int64_t width) {
    using Vector = std::array<float, Lanes>;
    auto add = [](Vector& to, const float* from) {
        for (int lane = 0; lane < Lanes; ++lane)
            to[static_cast<std::size_t>(lane)] += from[lane];
    };
    auto add_vector = [](Vector& to, const Vector& from) {
        for (int lane = 0; lane < Lanes; ++lane)
            to[static_cast<std::size_t>(lane)] += from[static_cast<std::size_t>(lane)];
    };
    const int64_t vectors = width / Lanes, groups = vectors / 4;
    constexpr int64_t levels = 4, level_power = 4, level_step = int64_t{1} << level_power;
    Vector acc[levels][4] = {};
    int64_t i = 0;
    for (; i + level_step <= groups;) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int64_t k = 0; k < 4; ++k)
                add(acc[0][k], squares + (i * 4 + k) * Lanes);
        for (int64_t level = 1; level < levels; ++level) {
            for (int64_t k = 0; k < 4; ++k) {
                add_vector(acc[level][k], acc[level - 1][k]);
                acc[level - 1][k] = Vector{};
            }
            if ((i & ((level_step - 1) << (level * level_power))) != 0) break;
        }
    }
    for (; i < groups; ++i)
        for (int64_t k = 0; k < 4; ++k)
            add(acc[0][k], squares + (i * 4 + k) * Lanes);
    for (int64_t level = 1; level < levels; ++level)
        for (int64_t k = 0; k < 4; ++k)
            add_vector(acc[0][k], acc[level][k]);
    Vector sum = acc[0][0];
    for (int64_t v = groups * 4; v < vectors; ++v)
        add(sum, squares + v * Lanes);
    for (int64_t k = 1; k < 4; ++k)
        add_vector(sum, acc[0][k]);
    float total = 0;
    for (int64_t n = vectors * Lanes; n < width; ++n)
        total += squares[n];
    for (int lane = 0; lane < Lanes; ++lane)
        total += sum[static_cast<std::size_t>(lane)];
    return (0.0f + total) / static_cast<float>(width);
}

// The shortest rows libtorch sums with vectors, and the longest it sums on one thread whatever
// the rows around them (a single row of 32,768 floats or more is split between threads).
constexpr int64_t host_mean_min_width = 16, host_mean_max_width = 32767;

// The vector width (16 floats with AVX-512 kernels, 8 with AVX2 or none) for which
// mean_of_squares gives the bits of libtorch's pow(2).mean(-1) on rows of `width`, found once
// per width by comparing with libtorch on random rows; 0 when neither does (another libtorch),
// and rms_norm keeps libtorch's operations.
int host_mean_lanes(int64_t width) {
    static std::mutex mutex;
    static std::map<int64_t, int> known;
    const std::lock_guard lock(mutex);
    if (const auto at = known.find(width); at != known.end()) return at->second;
    std::mt19937 generator(static_cast<uint32_t>(width));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    constexpr int64_t rows = 4;
    torch::Tensor probe = torch::empty({rows, width}, torch::kFloat32);
    float* values = probe.data_ptr<float>();
    for (int64_t n = 0; n < rows * width; ++n)  // magnitudes over several binades
        values[n] = normal(generator) * std::ldexp(1.0f, static_cast<int>(n % 7) * 3 - 9);
    const torch::Tensor expected = probe.pow(2).mean(-1, /*keepdim=*/true).contiguous();
    std::vector<float> squares(static_cast<std::size_t>(width));
    auto matches = [&](auto mean) {
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t n = 0; n < width; ++n)
                squares[static_cast<std::size_t>(n)] =
                    values[r * width + n] * values[r * width + n];
            const float got = mean(squares.data(), width);
            if (std::memcmp(&got, expected.data_ptr<float>() + r, sizeof got) != 0) return false;
        }
        return true;
    };
    const int lanes = matches(mean_of_squares<16>) ? 16 : matches(mean_of_squares<8>) ? 8 : 0;
    known.emplace(width, lanes);
    return lanes;
}

// host_mean_lanes for widths rms_norm may take in one loop, 0 for the others.
int one_loop_lanes(int64_t width) {
    return width >= host_mean_min_width && width <= host_mean_max_width ? host_mean_lanes(width)
                                                                        : 0;
}

struct RmsSquares {};  // kernel_scratch tag

template <typename Element>
void rms_norm_rows(const Element* in, const Element* weight, Element* out, int64_t count,
                   int64_t width, float epsilon, int lanes) {
    float* squares = kernel_scratch<RmsSquares>(width);
    for (int64_t r = 0; r < count; ++r, in += width, out += width) {
        for (int64_t i = 0; i < width; ++i) {
            const float value = static_cast<float>(in[i]);
            squares[i] = value * value;
        }
        const float mean =
            lanes == 16 ? mean_of_squares<16>(squares, width) : mean_of_squares<8>(squares, width);
        const float inverse = 1.0f / std::sqrt(mean + epsilon);
        for (int64_t i = 0; i < width; ++i) {
            if constexpr (std::is_same_v<Element, float>) {
                out[i] = (static_cast<float>(in[i]) * inverse) * weight[i];
            } else {
                out[i] = Element(static_cast<float>(Element(static_cast<float>(in[i]) * inverse)) *
                                 static_cast<float>(weight[i]));
            }
        }
    }
}

}  // namespace

bool rms_norm_in_one_loop(int64_t width) {
    return one_loop_lanes(width) != 0;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    // libtorch's arithmetic, in its order and roundings: x in float32 (float64 kept for gradient
    // checks), the mean of the squares, plus eps, 1 / sqrt, each product rounded to float32,
    // then to x's dtype, then times the weight (in float32, rounded to the dtype). On the host,
    // without autograd, one loop does all of it: the five operations and their tensors, ~1 us
    // each at a decoding step's sizes, nine norms a step, were a sixth of the demo model's step.
    const int64_t width = x.dim() > 0 ? x.size(-1) : 0;
    const int lanes = rms_scaling_on_host(x, weight) ? one_loop_lanes(width) : 0;
    if (lanes != 0) {
        const torch::Tensor rows = x.contiguous();
        torch::Tensor out = torch::empty(x.sizes(), rows.options());
        const int64_t count = rows.numel() / width;
        const auto epsilon = static_cast<float>(eps);
        if (x.scalar_type() == torch::kBFloat16)
            rms_norm_rows(rows.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                          out.data_ptr<at::BFloat16>(), count, width, epsilon, lanes);
        else
            rms_norm_rows(rows.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(),
                          count, width, epsilon, lanes);
        return out;
    }
    const torch::Tensor x32 =
        x.to(x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32);
    const torch::Tensor mean_square = x32.pow(2).mean(-1, /*keepdim=*/true);
    return (x32 * torch::rsqrt(mean_square + eps)).to(x.scalar_type()) * weight;
}

namespace {

struct LinearInput {};  // kernel_scratch tags
struct LinearOutput {};

// Where kv's own kernels may serve x [T, K] W^T: both on the CPU, W 2-D and contiguous, and
// nothing autograd must see (they are not differentiable).
bool own_kernel_may_serve(const torch::Tensor& x, const torch::Tensor& weight) {
    if (x.dim() != 2 || !x.device().is_cpu() || !weight.device().is_cpu()) return false;
    if (!weight.is_contiguous() || weight.dim() != 2) return false;
    return !at::GradMode::is_enabled() || (!x.requires_grad() && !weight.requires_grad());
}

// One-token decoding on CPU goes through kv's own matrix-vector kernels (see gemv.hpp).
bool use_gemv_kernel(const torch::Tensor& x, const torch::Tensor& weight) {
    return own_kernel_may_serve(x, weight) && x.size(0) == 1 &&
           (weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16);
}

// A few tokens (a question after a cached context) through bf16 weights: kv's kernel reads the
// weights once for all the tokens and gives each token the bits one-token decoding gives it. A
// 1B model's 9-token question after 4,096 cached tokens: prefill 0.164 s through oneDNN's bf16
// matmul, 0.118 s through this (bench/results/ttft-few-tokens.json).
bool use_few_tokens_kernel(const torch::Tensor& x, const torch::Tensor& weight) {
    return own_kernel_may_serve(x, weight) && x.size(0) >= 2 &&
           weight.scalar_type() == torch::kBFloat16 &&
           gemm_few_bf16_fits(x.size(0), weight.size(1));
}

// Many tokens through bf16 weights where libtorch's bf16 matmul is slow (widen_bf16_matmuls):
// the weights widened a block of rows at a time (16 MiB of float32), each block through
// libtorch's float32 matmul, the products rounded back to the input's dtype as .to() rounds.
bool use_widened_matmul(const torch::Tensor& x, const torch::Tensor& weight) {
    return own_kernel_may_serve(x, weight) && weight.scalar_type() == torch::kBFloat16 &&
           widen_bf16_matmuls();
}

torch::Tensor widened_matmul(const torch::Tensor& x, const torch::Tensor& weight) {
    const int64_t tokens = x.size(0), rows = weight.size(0), columns = weight.size(1);
    const torch::Tensor input = x.to(torch::kFloat32).contiguous();
    const torch::Tensor output = torch::empty({tokens, rows}, torch::kFloat32);
    const int64_t block = std::clamp<int64_t>((int64_t{16} << 20) / (columns * 4), 1, rows);
    const torch::Tensor wide = torch::empty({block, columns}, torch::kFloat32);
    const auto* bf16 = reinterpret_cast<const uint16_t*>(weight.data_ptr());
    for (int64_t begin = 0; begin < rows; begin += block) {
        const int64_t count = std::min(block, rows - begin);
        float* target = wide.data_ptr<float>();
        at::parallel_for(0, count, 64, [&](int64_t first, int64_t last) {
            widen_bf16(bf16 + (begin + first) * columns, target + first * columns,
                       (last - first) * columns);
        });
        output.narrow(1, begin, count).copy_(torch::mm(input, wide.narrow(0, 0, count).t()));
    }
    return output.to(x.scalar_type());
}

}  // namespace

torch::Tensor product_in_dtype(const torch::Tensor& a, const torch::Tensor& b) {
    const auto multiply = [&](const torch::Tensor& left, const torch::Tensor& right) {
        return a.dim() == 2 ? torch::mm(left, right) : torch::bmm(left, right);
    };
    if (a.scalar_type() == torch::kBFloat16 && a.device().is_cpu() && widen_bf16_matmuls())
        return multiply(a.to(torch::kFloat32), b.to(torch::kFloat32)).to(torch::kBFloat16);
    return multiply(a, b);
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     bool after_context) {
    torch::Tensor y;
    const bool gemv = use_gemv_kernel(x, weight);
    if (gemv || (after_context && use_few_tokens_kernel(x, weight))) {
        const int64_t tokens = x.size(0), rows = weight.size(0), columns = weight.size(1);
        // bf16 tokens are widened and the float products rounded back here, not by libtorch's
        // conversions: two operations (each dispatched, allocated, iterated) per projection,
        // 29 projections per token of a small model, were a fifth of its decoding step. The
        // same bits: widening is exact, and round_to_bf16 rounds as libtorch's conversion does.
        const bool bf16_in = x.scalar_type() == torch::kBFloat16;
        const torch::Tensor input = bf16_in || x.scalar_type() == torch::kFloat32
                                        ? x.contiguous()
                                        : x.to(torch::kFloat32).contiguous();
        const float* in = nullptr;
        if (bf16_in) {
            float* wide = kernel_scratch<LinearInput>(tokens * columns);
            widen_bf16(static_cast<const uint16_t*>(input.data_ptr()), wide, tokens * columns);
            in = wide;
        } else {
            in = input.data_ptr<float>();
        }
        torch::Tensor output;
        float* out = nullptr;
        if (x.scalar_type() == torch::kFloat32) {
            output = torch::empty({tokens, rows}, torch::kFloat32);
            out = output.data_ptr<float>();
        } else {
            out = kernel_scratch<LinearOutput>(tokens * rows);
        }
        const auto* bf16 = reinterpret_cast<const uint16_t*>(weight.data_ptr());
        if (!gemv)
            gemm_few_bf16(bf16, in, out, tokens, rows, columns);
        else if (weight.scalar_type() == torch::kBFloat16)
            gemv_bf16(bf16, in, out, rows, columns);
        else
            gemv_f32(weight.data_ptr<float>(), in, out, rows, columns);
        if (output.defined()) {
            y = output;
        } else if (bf16_in) {
            y = torch::empty({tokens, rows}, torch::kBFloat16);
            round_to_bf16(out, static_cast<uint16_t*>(y.data_ptr()), tokens * rows);
        } else {
            y = torch::from_blob(out, {tokens, rows}, torch::kFloat32).to(x.scalar_type());
        }
    } else if (use_widened_matmul(x, weight)) {
        y = widened_matmul(x, weight);
    } else if (x.dim() == 2 && x.size(0) == 1) {
        y = torch::mv(weight, x.select(0, 0)).unsqueeze(0);
    } else {
        y = torch::matmul(x, weight.t());
    }
    if (bias.defined()) y.add_(bias);
    return y;
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
    return torch::silu(gate).mul_(up);
}

std::vector<float> rope_inverse_frequencies(const ModelConfig& config) {
    return rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling);
}

namespace {

// The dtype rotate_keys turns a host tensor's rows in; none for dtypes it does not know.
std::optional<CacheDtype> rotatable_dtype(const torch::Tensor& x) {
    switch (x.scalar_type()) {
        case torch::kFloat32:
            return CacheDtype::f32;
        case torch::kBFloat16:
            return CacheDtype::bf16;
        case torch::kFloat16:
            return CacheDtype::f16;
        default:
            return std::nullopt;
    }
}

}  // namespace

Rope::Rope(const ModelConfig& config)
    : layout_(config.rope_layout), inverse_frequencies_(rope_inverse_frequencies(config)) {}

namespace {

// The angle table, built on the host with float arithmetic (angle = position * frequency, then
// cosf/sinf), exactly as llama2.c's run.c does, so greedy decoding matches it.
void angle_table(const std::vector<float>& inverse_frequencies, const int64_t* positions,
                 int64_t count, float* cosines, float* sines) {
    const auto half = static_cast<int64_t>(inverse_frequencies.size());
    for (int64_t t = 0; t < count; ++t)
        for (int64_t i = 0; i < half; ++i) {
            const float angle =
                static_cast<float>(positions[t]) * inverse_frequencies[static_cast<std::size_t>(i)];
            cosines[t * half + i] = cosf(angle);
            sines[t * half + i] = sinf(angle);
        }
}

}  // namespace

torch::Tensor Rope::apply(const torch::Tensor& x, const torch::Tensor& positions) const {
    // A decoding step rotates each layer's queries and keys of one token: through libtorch that
    // was some fifteen operations, ~10 us, a sixth of the demo model's step.
    const std::optional<CacheDtype> dtype = rotatable_dtype(x);
    const auto half = static_cast<int64_t>(inverse_frequencies_.size());
    if (!x.device().is_cpu() || !dtype || x.dim() < 2 || x.size(-1) != 2 * half ||
        (at::GradMode::is_enabled() && x.requires_grad()))
        return apply_with_tensors(x, positions);
    const torch::Tensor positions_cpu = positions.to(torch::kCPU, torch::kInt64).contiguous();
    const int64_t count = positions_cpu.numel();
    if (x.size(-2) != count) throw Error("rope: positions do not match the token count");
    std::vector<float> cosines(static_cast<std::size_t>(count * half));
    std::vector<float> sines(cosines.size());
    angle_table(inverse_frequencies_, positions_cpu.data_ptr<int64_t>(), count, cosines.data(),
                sines.data());
    torch::Tensor rotated = x.clone(at::MemoryFormat::Contiguous);
    if (rotated.numel() == 0) return rotated;
    // Token t's rows, one per [T, head_dim] block, are a block apart.
    const std::size_t row_bytes = static_cast<std::size_t>(2 * half) * rotated.element_size();
    const auto blocks = static_cast<std::size_t>(rotated.numel() / (count * 2 * half));
    auto* base = static_cast<std::byte*>(rotated.data_ptr());
    for (int64_t t = 0; t < count; ++t)
        rotate_rows(base + static_cast<std::size_t>(t) * row_bytes, *dtype, blocks,
                    static_cast<std::size_t>(count) * row_bytes, layout_,
                    static_cast<std::size_t>(half), cosines.data() + t * half,
                    sines.data() + t * half);
    return rotated;
}

torch::Tensor Rope::apply_with_tensors(const torch::Tensor& x,
                                       const torch::Tensor& positions) const {
    const int64_t half = static_cast<int64_t>(inverse_frequencies_.size());
    if (x.size(-1) != 2 * half)
        throw Error("rope: head dimension " + std::to_string(x.size(-1)) + " does not match " +
                    std::to_string(2 * half));
    const torch::Tensor positions_cpu = positions.to(torch::kCPU, torch::kInt64).contiguous();
    const int64_t count = positions_cpu.numel();
    if (x.size(-2) != count) throw Error("rope: positions do not match the token count");

    torch::Tensor cos_table = torch::empty({count, half}, torch::kFloat32);
    torch::Tensor sin_table = torch::empty({count, half}, torch::kFloat32);
    angle_table(inverse_frequencies_, positions_cpu.data_ptr<int64_t>(), count,
                cos_table.data_ptr<float>(), sin_table.data_ptr<float>());
    // At least float32 (bf16 rotations drift), float64 kept for gradient checks.
    const torch::ScalarType math =
        x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    cos_table = cos_table.to(x.device(), math);
    sin_table = sin_table.to(x.device(), math);

    const torch::Tensor x32 = x.to(math);
    torch::Tensor rotated;
    if (layout_ == RopeLayout::half_split) {
        const torch::Tensor first = x32.narrow(-1, 0, half);
        const torch::Tensor second = x32.narrow(-1, half, half);
        rotated = torch::cat(
            {first * cos_table - second * sin_table, second * cos_table + first * sin_table}, -1);
    } else {
        const torch::Tensor pairs = x32.unflatten(-1, {half, 2});
        const torch::Tensor real = pairs.select(-1, 0);
        const torch::Tensor imaginary = pairs.select(-1, 1);
        rotated = torch::stack({real * cos_table - imaginary * sin_table,
                                real * sin_table + imaginary * cos_table},
                               -1)
                      .flatten(-2);
    }
    return rotated.to(x.scalar_type());
}

torch::Tensor Rope::shift(const torch::Tensor& x, int64_t delta) const {
    // Every token turns by the same angles, so one row of cosines serves them all: rotate_keys
    // does that in place on a copy, on every thread (through libtorch's per-token tables and
    // float32 temporaries, realigning a 1 GB packet took 6 s), with the same float32 arithmetic
    // and rounding (tests/unit/core/model/test_ops.cpp checks they agree bit for bit). Tensors
    // that need gradients (kvtrain's adapters) or live on a GPU take apply().
    if (!x.device().is_cpu() || !rotatable_dtype(x) ||
        (at::GradMode::is_enabled() && x.requires_grad()) || x.dim() < 1 ||
        x.size(-1) != 2 * static_cast<int64_t>(inverse_frequencies_.size()))
        return apply(x, torch::full({x.size(-2)}, delta, torch::kInt64));
    torch::Tensor rotated = x.contiguous().clone();
    // A contiguous copy's rows, as one block: shift_in_place always takes them.
    shift_in_place(rotated.view({-1, x.size(-1)}), delta);
    return rotated;
}

bool Rope::shift_in_place(const torch::Tensor& x, int64_t delta) const {
    const std::optional<CacheDtype> dtype = rotatable_dtype(x);
    if (!x.device().is_cpu() || !dtype || x.requires_grad() || x.dim() < 2 ||
        x.size(-1) != 2 * static_cast<int64_t>(inverse_frequencies_.size()) || x.stride(-1) != 1 ||
        (x.size(-2) > 1 && x.stride(-2) != x.size(-1)))
        return false;
    if (delta == 0 || x.numel() == 0) return true;
    // The [T, head_dim] blocks, wherever the leading dims put them.
    const torch::Tensor blocks = x.reshape({-1, x.size(-2), x.size(-1)});
    if (blocks.data_ptr() != x.data_ptr()) return false;  // reshape had to copy
    const RopeSettings settings{layout_, x.size(-1), inverse_frequencies_};
    const int64_t rows = x.size(-2), chunk = 4096;
    const int64_t chunks_per_block = (rows + chunk - 1) / chunk;
    const std::size_t row_bytes = static_cast<std::size_t>(x.size(-1)) * x.element_size();
    auto* base = static_cast<std::byte*>(x.data_ptr());
    const auto block_bytes = static_cast<std::ptrdiff_t>(blocks.stride(0) * x.element_size());
    at::parallel_for(0, blocks.size(0) * chunks_per_block, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t block = task / chunks_per_block, first = task % chunks_per_block * chunk;
            rotate_keys(
                base + block * block_bytes +
                    static_cast<std::ptrdiff_t>(first) * static_cast<std::ptrdiff_t>(row_bytes),
                *dtype, static_cast<std::size_t>(std::min(chunk, rows - first)), settings, delta);
        }
    });
    return true;
}

bool decode_kernel_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    if (!q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu()) return false;
    if (k.scalar_type() != v.scalar_type()) return false;
    if (k.scalar_type() != torch::kFloat32 && k.scalar_type() != torch::kBFloat16) return false;
    if (!head_rows_contiguous(k) || !head_rows_contiguous(v)) return false;
    return !at::GradMode::is_enabled() ||
           (!q.requires_grad() && !k.requires_grad() && !v.requires_grad());
}

namespace {

// One query token per head on CPU, every stored key visible: the decoding step. libtorch 1.13's
// bf16 bmm/softmax/transpose paths cost milliseconds per call at these sizes (measured: 1.2 s per
// token on a 1B model), so the scores and the weighted sum read the cache rows directly, in its
// dtype, with the gemv row kernels, one kv head (and its query group) per task.
// Whether the row kernels can read these tensors (decode_kernel_takes) under this mask: no
// mask beyond causality by position.
bool decode_kernel_fits(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionMask& mask) {
    if (mask.sliding_window > 0 || mask.allow.defined() || mask.key_valid.defined()) return false;
    return decode_kernel_takes(q, k, v);
}

bool use_decode_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const AttentionMask& mask) {
    if (q.size(1) != 1 || !decode_kernel_fits(q, k, v, mask)) return false;
    // Every key must be visible: none stored at a later position than the query.
    return mask.key_positions.max().item<int64_t>() <= mask.query_positions.max().item<int64_t>();
}

// A few queries after many keys, the question after a long cached context: libtorch's bf16
// bmm over [Hkv, group*T, S] scores cost 0.8 s per 1B layer at 32k keys (allocating and
// faulting in fresh score and transposed-key buffers), so each query goes through the decoding
// kernel's arithmetic over the keys it may see (attention_decode_rows: all of them at once).
// With key positions non-decreasing along the slots (every cache kvtools assembles; checked
// here), those are a prefix of the slots.
constexpr int64_t max_queries_per_query_decode = 64;

// The shape and layout part of use_per_query_decode, for callers that know the key positions
// increase.
bool per_query_decode_fits(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const AttentionMask& mask) {
    return q.size(1) >= 2 && q.size(1) <= max_queries_per_query_decode && k.size(1) >= 1024 &&
           decode_kernel_fits(q, k, v, mask);
}

bool use_per_query_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const AttentionMask& mask) {
    if (!per_query_decode_fits(q, k, v, mask)) return false;
    const torch::Tensor positions = mask.key_positions;
    return positions.size(0) < 2 || (positions.narrow(0, 1, positions.size(0) - 1) >=
                                     positions.narrow(0, 0, positions.size(0) - 1))
                                        .all()
                                        .item<bool>();
}

// Keys from which a kv head's query heads are decoded together (attention_decode): below, its
// keys and values stay in the core's caches between query heads anyway.
constexpr int64_t attend_together_min_keys = 1024;

torch::Tensor attention_decode(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double scale) {
    const int64_t query_heads = q.size(0), head_dim = q.size(2);
    const int64_t kv_heads = k.size(0), keys = k.size(1);
    const int64_t group = query_heads / kv_heads;
    const torch::Tensor queries = q.to(torch::kFloat32).contiguous();  // [Hq, 1, D]
    torch::Tensor output = torch::zeros({query_heads, 1, head_dim}, torch::kFloat32);
    const bool bf16 = k.scalar_type() == torch::kBFloat16;
    const std::size_t element = bf16 ? 2 : 4;
    const auto* key_base = static_cast<const std::byte*>(k.data_ptr());
    const auto* value_base = static_cast<const std::byte*>(v.data_ptr());
    const float* query_data = queries.data_ptr<float>();
    float* output_data = output.data_ptr<float>();
    // Heads go to threads only when there is enough work to pay for waking them (~10 us a
    // parallel region): stories260K's 4 kv heads of 8 over ~200 keys decoded 25% slower split.
    constexpr int64_t min_parallel_elements = int64_t{1} << 16;
    const int64_t grain =
        query_heads * keys * head_dim < min_parallel_elements ? kv_heads : int64_t{1};
    // A kv head's query heads (grouped-query attention) go through attend_rows together, which
    // reads each block of keys and values once for all of them: query head by query head, a
    // Llama 3 1B layer read its 8 kv heads' 256 MiB four times at 131k tokens (55 ms a layer on
    // 2 cores). Each row's arithmetic is the one below, so the bits are the same.
    const bool together = group > 1 && keys >= attend_together_min_keys;
    const std::vector<int64_t> visible(static_cast<std::size_t>(together ? group : 0), keys);
    at::parallel_for(0, kv_heads, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(static_cast<std::size_t>(together ? 0 : keys));
        for (int64_t head = begin; head < end; ++head) {
            const std::byte* key_rows = key_base + head * k.stride(0) * element;
            const std::byte* value_rows = value_base + head * v.stride(0) * element;
            if (together) {
                attend_rows({key_rows, bf16}, {value_rows, bf16},
                            query_data + head * group * head_dim, group, visible.data(), head_dim,
                            static_cast<float>(scale), output_data + head * group * head_dim);
                continue;
            }
            for (int64_t member = 0; member < group; ++member) {
                const int64_t query_head = head * group + member;
                const float* query = query_data + query_head * head_dim;
                dot_rows({key_rows, bf16}, query, scores.data(), keys, head_dim);
                softmax_scaled_in_place(scores.data(), keys, static_cast<float>(scale));
                accumulate_rows({value_rows, bf16}, scores.data(),
                                output_data + query_head * head_dim, keys, head_dim);
            }
        }
    });
    return output.to(q.scalar_type());
}

// The question's queries together (`seen[t]`: the keys query t may see, a prefix): per kv head,
// its group's rows through attend_rows, which reads each block of keys and values once for all
// of them. Query by query through attention_decode, a 9-token question over 32k keys read each
// kv head's 8 MiB 36 times per layer (4.3 s on 2 cores for a 1B model); the arithmetic of each
// row is attention_decode's, so the bits are the same.
torch::Tensor attention_decode_rows(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const std::vector<int64_t>& seen,
                                    double scale) {
    const int64_t query_heads = q.size(0), tokens = q.size(1), head_dim = q.size(2);
    const int64_t kv_heads = k.size(0), group = query_heads / kv_heads;
    // [Hq, T, D]: the rows of kv head h are those of its query heads, (h * group + m) * T + t.
    const torch::Tensor queries = q.to(torch::kFloat32).contiguous();
    torch::Tensor output = torch::empty({query_heads, tokens, head_dim}, torch::kFloat32);
    std::vector<int64_t> visible(static_cast<std::size_t>(group * tokens));
    for (int64_t row = 0; row < group * tokens; ++row)
        visible[static_cast<std::size_t>(row)] = seen[static_cast<std::size_t>(row % tokens)];
    const bool bf16 = k.scalar_type() == torch::kBFloat16;
    const std::size_t element = bf16 ? 2 : 4;
    const auto* key_base = static_cast<const std::byte*>(k.data_ptr());
    const auto* value_base = static_cast<const std::byte*>(v.data_ptr());
    const float* query_data = queries.data_ptr<float>();
    float* output_data = output.data_ptr<float>();
    const int64_t rows = group * tokens;
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t head = begin; head < end; ++head)
            attend_rows({key_base + head * k.stride(0) * element, bf16},
                        {value_base + head * v.stride(0) * element, bf16},
                        query_data + head * rows * head_dim, rows, visible.data(), head_dim,
                        static_cast<float>(scale), output_data + head * rows * head_dim);
    });
    return output.to(q.scalar_type());
}

}  // namespace

namespace {

// `whole_call`: q holds every query of the call, not one block of a longer prefill (whose
// blocks would otherwise look like a few queries and go query by query, reading all keys once
// per query instead of once per block).
torch::Tensor attention_part(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionMask& mask, double scale, bool whole_call) {
    if (k.size(1) > 0 && use_decode_kernel(q, k, v, mask)) return attention_decode(q, k, v, scale);
    if (whole_call && use_per_query_decode(q, k, v, mask)) {
        const torch::Tensor key_positions = mask.key_positions.to(torch::kCPU).contiguous();
        const torch::Tensor query_positions = mask.query_positions.to(torch::kCPU).contiguous();
        const int64_t* first = key_positions.data_ptr<int64_t>();
        const int64_t* last = first + key_positions.numel();
        std::vector<int64_t> seen(static_cast<std::size_t>(q.size(1)));
        for (int64_t t = 0; t < q.size(1); ++t)
            seen[static_cast<std::size_t>(t)] =
                std::upper_bound(first, last, query_positions.data_ptr<int64_t>()[t]) - first;
        return attention_decode_rows(q, k, v, seen, scale);
    }
    // Long prefills with other masks go by blocks of queries, so that no score tensor
    // exceeds a few MB: above glibc's mmap threshold (32 MB at most) every temporary is a fresh
    // mapping whose pages fault on first touch, which made a 2,048-token training step 15x slower
    // than four 512-token ones.
    constexpr int64_t max_scores = int64_t{4} << 20;
    const int64_t block =
        std::max<int64_t>(1, max_scores / std::max<int64_t>(1, q.size(0) * k.size(1)));
    if (q.size(1) > block) {
        std::vector<torch::Tensor> outputs;
        for (int64_t begin = 0; begin < q.size(1); begin += block) {
            const int64_t count = std::min(block, q.size(1) - begin);
            AttentionMask part = mask;
            part.query_positions = mask.query_positions.narrow(0, begin, count);
            if (mask.allow.defined()) part.allow = mask.allow.narrow(0, begin, count);
            outputs.push_back(attention_part(q.narrow(1, begin, count), k, v, part, scale, false));
        }
        return torch::cat(outputs, 1);
    }
    const int64_t query_heads = q.size(0), tokens = q.size(1), head_dim = q.size(2);
    const int64_t kv_heads = k.size(0), keys = k.size(1);
    if (query_heads % kv_heads != 0)
        throw Error("attention: query heads are not a multiple of kv heads");
    const int64_t group = query_heads / kv_heads;

    // [Hkv, group*T, D] x [Hkv, D, S]: one batched product per kv head serves its whole group.
    const torch::Tensor grouped_q = q.reshape({kv_heads, group * tokens, head_dim});
    const torch::ScalarType score_type =
        q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    torch::Tensor scores =
        product_in_dtype(grouped_q, k.transpose(1, 2)).to(score_type).mul_(scale);
    scores = scores.view({kv_heads, group, tokens, keys});

    const bool needs_causal_mask = tokens > 1 || mask.sliding_window > 0;
    torch::Tensor allowed;
    if (needs_causal_mask) {
        const torch::Tensor query_positions = mask.query_positions.to(q.device()).view({tokens, 1});
        const torch::Tensor key_positions = mask.key_positions.to(q.device()).view({1, keys});
        allowed = key_positions <= query_positions;
        if (mask.sliding_window > 0)
            allowed = allowed & (key_positions > query_positions - mask.sliding_window);
    }
    if (mask.allow.defined())
        allowed =
            allowed.defined() ? allowed & mask.allow.to(q.device()) : mask.allow.to(q.device());
    if (mask.key_valid.defined()) {
        const torch::Tensor valid = mask.key_valid.to(q.device()).view({kv_heads, 1, 1, keys});
        allowed = allowed.defined() ? allowed & valid : valid;
    }
    if (allowed.defined())
        scores.masked_fill_(allowed.logical_not(), -std::numeric_limits<float>::infinity());

    torch::Tensor probabilities = torch::softmax(scores, -1);
    // A row with no visible key is all -inf and softmaxes to NaN; it attends to nothing instead.
    if (allowed.defined()) probabilities = probabilities.masked_fill(allowed.logical_not(), 0.0);
    probabilities = probabilities.view({kv_heads, group * tokens, keys}).to(v.scalar_type());
    return product_in_dtype(probabilities, v).view({query_heads, tokens, head_dim});
}

}  // namespace

namespace {

// Plain causality over increasing positions with the queries at the last keys' positions (query
// t sees keys 0 .. S - T + t), float32 or bf16 in host memory: what the tiled kernels compute.
bool is_causal_tail(const torch::Tensor& q, const torch::Tensor& k, const AttentionMask& mask) {
    // On an accelerator the general path's big batched products are the fast ones.
    if (!q.device().is_cpu() || !k.device().is_cpu()) return false;
    if (q.scalar_type() != torch::kFloat32 && q.scalar_type() != torch::kBFloat16) return false;
    if (mask.sliding_window > 0 || mask.allow.defined() || mask.key_valid.defined()) return false;
    const int64_t tokens = q.size(1), keys = k.size(1);
    if (tokens < 2 || keys < tokens) return false;
    const torch::Tensor key_positions = mask.key_positions;
    if (!mask.query_positions.is_same(key_positions) &&
        !torch::equal(mask.query_positions, key_positions.narrow(0, keys - tokens, tokens)))
        return false;
    return (key_positions.narrow(0, 1, keys - 1) > key_positions.narrow(0, 0, keys - 1))
        .all()
        .item<bool>();
}

}  // namespace

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionMask& mask, double scale) {
    if (at::GradMode::is_enabled() &&
        (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
        // Training: a sequence's queries over the same sequence's keys.
        if (k.size(1) == q.size(1) && v.size(1) == q.size(1) && is_causal_tail(q, k, mask))
            return causal_self_attention(q, k, v, scale);
    } else if (causal_attention_prefill_takes(q, k, v) && is_causal_tail(q, k, mask) &&
               !per_query_decode_fits(q, k, v, mask)) {
        // A prefill; a few queries after a long context keep the decoding kernel's arithmetic
        // (is_causal_tail has checked the key positions increase, as that path needs).
        return causal_attention_prefill(q, k, v, scale);
    }
    return attention_part(q, k, v, mask, scale, true);
}

}  // namespace kv
