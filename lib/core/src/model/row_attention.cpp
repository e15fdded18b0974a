#include "kv/model/row_attention.hpp"

#include "kv/model/gemv.hpp"
#include "kv/model/kv_cache.hpp"
#include "kv/model/ops.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace kv {

namespace {

// Exact attention of one kv head's query heads [group, D] over its chosen keys and values.
torch::Tensor attend_head(const torch::Tensor& queries, int64_t head, int64_t group,
                          const torch::Tensor& keys, const torch::Tensor& values, double scale) {
    const int64_t dim = queries.size(2);
    const torch::Tensor q =
        queries.narrow(0, head * group, group).reshape({group, dim}).to(torch::kFloat32);
    const torch::Tensor probabilities =
        torch::softmax(torch::matmul(q, keys.to(torch::kFloat32).t()) * scale, -1);
    return torch::matmul(probabilities, values.to(torch::kFloat32)).unsqueeze(1);
}

// The kv heads' query heads over their chosen rows with the decoding kernel (attend_rows, the
// arithmetic of attention() for one token): `gather(head, keys_out, values_out)` writes head
// h's chosen rows, rows[h].size() of them, one after another. The result is attention() over
// exactly those rows in that order, bit for bit; through libtorch (a dozen operators per kv head
// on a few hundred rows) the attention over the chosen rows was ~17 ms of a 1B model's step.
template <typename Gather>
torch::Tensor attend_chosen(const torch::Tensor& queries, int64_t kv_heads, int64_t dim,
                            torch::ScalarType stored, const std::vector<std::vector<int64_t>>& rows,
                            double scale, Gather&& gather) {
    const int64_t query_heads = queries.size(0), group = query_heads / kv_heads;
    const torch::Tensor q = queries.reshape({query_heads, dim}).to(torch::kFloat32).contiguous();
    torch::Tensor out = torch::zeros({query_heads, 1, dim}, torch::kFloat32);
    const bool bf16 = stored == torch::kBFloat16;
    const auto row_bytes = static_cast<std::size_t>(dim) * (bf16 ? 2 : 4);
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<std::byte> keys_here, values_here;
        std::vector<int64_t> visible(static_cast<std::size_t>(group));
        for (int64_t head = begin; head < end; ++head) {
            const auto count = static_cast<int64_t>(rows[static_cast<std::size_t>(head)].size());
            keys_here.resize(static_cast<std::size_t>(count) * row_bytes);
            values_here.resize(keys_here.size());
            gather(head, keys_here.data(), values_here.data());
            std::fill(visible.begin(), visible.end(), count);
            attend_rows({keys_here.data(), bf16}, {values_here.data(), bf16},
                        q.data_ptr<float>() + head * group * dim, group, visible.data(), dim,
                        static_cast<float>(scale), out.data_ptr<float>() + head * group * dim);
        }
    });
    return out.to(queries.scalar_type());
}

}  // namespace

torch::Tensor attention_over_rows(const torch::Tensor& queries, const torch::Tensor& keys,
                                  const torch::Tensor& values,
                                  const std::vector<std::vector<int64_t>>& rows, double scale) {
    const int64_t kv_heads = keys.size(0), group = queries.size(0) / kv_heads;
    if (decode_kernel_takes(queries, keys, values)) {
        const int64_t dim = keys.size(2);
        const std::size_t element = keys.element_size();
        const auto row_bytes = static_cast<std::size_t>(dim) * element;
        const auto* key_base = static_cast<const std::byte*>(keys.data_ptr());
        const auto* value_base = static_cast<const std::byte*>(values.data_ptr());
        return attend_chosen(
            queries, kv_heads, dim, keys.scalar_type(), rows, scale,
            [&](int64_t head, std::byte* keys_out, std::byte* values_out) {
                const std::byte* head_keys = key_base + head * keys.stride(0) * element;
                const std::byte* head_values = value_base + head * values.stride(0) * element;
                for (const int64_t row : rows[static_cast<std::size_t>(head)]) {
                    std::memcpy(keys_out, head_keys + row * row_bytes, row_bytes);
                    std::memcpy(values_out, head_values + row * row_bytes, row_bytes);
                    keys_out += row_bytes;
                    values_out += row_bytes;
                }
            });
    }
    std::vector<torch::Tensor> outputs;
    for (int64_t head = 0; head < kv_heads; ++head) {
        const torch::Tensor index =
            torch::tensor(rows[static_cast<std::size_t>(head)], torch::kInt64).to(keys.device());
        outputs.push_back(attend_head(queries, head, group, keys[head].index_select(0, index),
                                      values[head].index_select(0, index), scale));
    }
    return torch::cat(outputs, 0).to(queries.scalar_type());
}

torch::Tensor attention_over_staged_rows(const torch::Tensor& queries, const KvCache& cache,
                                         int64_t layer,
                                         const std::vector<std::vector<int64_t>>& rows,
                                         double scale) {
    const int64_t kv_heads = cache.kv_heads(), group = queries.size(0) / kv_heads;
    const int64_t dim = cache.head_dim();
    if (queries.device().is_cpu() &&
        (cache.dtype() == torch::kBFloat16 || cache.dtype() == torch::kFloat32) &&
        (!at::GradMode::is_enabled() || !queries.requires_grad()))
        return attend_chosen(queries, kv_heads, dim, cache.dtype(), rows, scale,
                             [&](int64_t head, std::byte* keys_out, std::byte* values_out) {
                                 cache.gather(layer, head, rows[static_cast<std::size_t>(head)],
                                              keys_out, values_out);
                             });
    int64_t total = 0;
    for (const auto& chosen : rows)
        total += static_cast<int64_t>(chosen.size());
    auto options = torch::TensorOptions().dtype(cache.dtype());
    if (queries.device().is_cuda()) options = options.pinned_memory(true);
    const torch::Tensor staging = torch::empty({2, total, dim}, options);
    const int64_t row_bytes = dim * staging.element_size();
    auto* keys_out = static_cast<std::byte*>(staging[0].data_ptr());
    auto* values_out = static_cast<std::byte*>(staging[1].data_ptr());
    int64_t first = 0;
    for (int64_t head = 0; head < kv_heads; ++head) {
        const auto& chosen = rows[static_cast<std::size_t>(head)];
        cache.gather(layer, head, chosen, keys_out + first * row_bytes,
                     values_out + first * row_bytes);
        first += static_cast<int64_t>(chosen.size());
    }
    const torch::Tensor staged = staging.to(queries.device(), /*non_blocking=*/true);
    std::vector<torch::Tensor> outputs;
    first = 0;
    for (int64_t head = 0; head < kv_heads; ++head) {
        const auto count = static_cast<int64_t>(rows[static_cast<std::size_t>(head)].size());
        outputs.push_back(attend_head(queries, head, group, staged[0].narrow(0, first, count),
                                      staged[1].narrow(0, first, count), scale));
        first += count;
    }
    return torch::cat(outputs, 0).to(queries.scalar_type());
}

torch::Tensor attention_streamed(const torch::Tensor& queries, const KvCache& cache, int64_t layer,
                                 double scale, int64_t chunk) {
    const int64_t kv_heads = cache.kv_heads(), group = queries.size(0) / kv_heads;
    const int64_t dim = cache.head_dim(), total = cache.keys(layer).size(1);
    const torch::ScalarType stored = cache.dtype();
    // The decoding kernels read bf16 and f32 rows as they are; f16 goes through float32.
    const bool direct = stored == torch::kBFloat16 || stored == torch::kFloat32;
    chunk = std::max<int64_t>(1, std::min(chunk, total));
    const torch::Tensor q =
        queries.reshape({queries.size(0), dim}).to(torch::kCPU, torch::kFloat32).contiguous();
    torch::Tensor out = torch::zeros({queries.size(0), dim}, torch::kFloat32);
    // The arithmetic of the decoding kernel over rows in memory (ops.cpp, attention_decode), in
    // its order, so that a cache on disk decodes to the same bits: every key's score first (the
    // keys read a chunk at a time), the softmax over them, then the values a chunk at a time.
    // Memory holds a chunk per thread and 4 bytes per row and query head of the kv head at hand.
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
        const torch::Tensor rows_read = torch::empty({chunk, dim}, stored);
        std::vector<float> scores(static_cast<std::size_t>(group * total));
        auto read = [&](int64_t head, bool keys, int64_t first, int64_t count) {
            cache.gather_range(layer, head, first, count, keys ? rows_read.data_ptr() : nullptr,
                               keys ? nullptr : rows_read.data_ptr());
            return direct ? rows_read
                          : rows_read.narrow(0, 0, count).to(torch::kFloat32).contiguous();
        };
        for (int64_t head = begin; head < end; ++head) {
            for (int64_t first = 0; first < total; first += chunk) {
                const int64_t count = std::min(chunk, total - first);
                const torch::Tensor k = read(head, true, first, count);
                for (int64_t member = 0; member < group; ++member) {
                    const float* query = q.data_ptr<float>() + (head * group + member) * dim;
                    float* row_scores = scores.data() + member * total + first;
                    dot_rows({k.data_ptr(), k.scalar_type() == torch::kBFloat16}, query, row_scores,
                             count, dim);
                }
            }
            for (int64_t member = 0; member < group; ++member)
                softmax_scaled_in_place(scores.data() + member * total, total,
                                        static_cast<float>(scale));
            for (int64_t first = 0; first < total; first += chunk) {
                const int64_t count = std::min(chunk, total - first);
                const torch::Tensor v = read(head, false, first, count);
                for (int64_t member = 0; member < group; ++member) {
                    const float* weights = scores.data() + member * total + first;
                    float* acc = out.data_ptr<float>() + (head * group + member) * dim;
                    accumulate_rows({v.data_ptr(), v.scalar_type() == torch::kBFloat16}, weights,
                                    acc, count, dim);
                }
            }
        }
    });
    return out.unsqueeze(1).to(queries.device(), queries.scalar_type());
}

}  // namespace kv
