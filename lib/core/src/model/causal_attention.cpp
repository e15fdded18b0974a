// Causal self-attention with gradients, by tiles: what training spends most of its time on.
//
// Through the general attention() a 2,048-token training sequence materialised [Hq, T, S] score,
// probability and mask tensors in float32 and bf16 and ran a dozen elementwise passes over them
// forward and backward (dtype copies, masked_fill, softmax and its backward, the zero fill of
// masked gradients): ~90% of a training step (libtorch profiler, demo model, 8 x 2,048 tokens),
// the matrix products ~6%. Here each task takes one kv head and a block of queries with its whole
// query group: the products of the keys the block may see (a prefix: causal by index) run in the
// inputs' dtype (with AVX-512 bf16's are ~3x faster than float32's, and the general path rounded
// its scores to bf16 too; without, through float32: product_in_dtype), the softmax of each row in
// float32 in two fused passes (attention_rows.hpp) while the tile is in cache. Forward keeps only
// the output and each row's log-sum-exp; backward recomputes the probabilities from them
// (FlashAttention's scheme).
#include "kv/model/attention_rows.hpp"
#include "kv/model/gemv.hpp"
#include "kv/model/ops.hpp"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kv {
namespace {

// Score elements per tile: [group * block, keys] stays within a core's L2 in the tile's dtype
// and its float32 row copies (1 MiB of float32 at the most), and short sequences take whole
// heads at once rather than paying libtorch's per-call cost on many small tiles.
constexpr int64_t tile_elements = int64_t{1} << 18;

// `tokens` queries, the last of `keys` positions: query t sees keys 0 .. offset + t.
struct Shapes {
    int64_t query_heads, kv_heads, group, tokens, keys, offset, head_dim, block, blocks;
};

Shapes shapes_of(const torch::Tensor& q, const torch::Tensor& k) {
    Shapes s{};
    s.query_heads = q.size(0);
    s.kv_heads = k.size(0);
    s.group = s.query_heads / s.kv_heads;
    s.tokens = q.size(1);
    s.keys = k.size(1);
    s.offset = s.keys - s.tokens;
    s.head_dim = q.size(2);
    s.block = std::clamp<int64_t>(tile_elements / (s.group * s.keys), 16, s.tokens);
    s.blocks = (s.tokens + s.block - 1) / s.block;
    return s;
}

// Tasks in an order that balances threads: at::parallel_for hands each thread a contiguous
// range, and a block's cost grows with its index, so blocks alternate from both ends.
std::vector<std::pair<int64_t, int64_t>> balanced_tasks(const Shapes& s) {
    std::vector<std::pair<int64_t, int64_t>> tasks;
    for (int64_t head = 0; head < s.kv_heads; ++head)
        for (int64_t low = 0, high = s.blocks - 1; low <= high; ++low, --high) {
            tasks.emplace_back(head, high);
            if (low != high) tasks.emplace_back(head, low);
        }
    return tasks;
}

// OpenBLAS (float32 products) runs its own threads: called from every thread of the region at
// once they contended (a 2,048-token training step 2.5x slower, most of it in the kernel), so
// each call runs on its caller's thread while tiles are computed in parallel.
class SingleThreadedBlas {
  public:
    SingleThreadedBlas() {
        if (set_ && get_) {
            previous_ = get_();
            set_(1);
        }
    }
    ~SingleThreadedBlas() {
        if (set_ && get_) set_(previous_);
    }
    SingleThreadedBlas(const SingleThreadedBlas&) = delete;
    SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

  private:
    // Looked up at run time: libtorch's BLAS may be another one, or none.
    using Set = void (*)(int);
    using Get = int (*)();
    inline static const Set set_ =
        reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    inline static const Get get_ =
        reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
    int previous_ = 1;
};

// Tiles read keys in multiples of this (the last ones masked like later keys): oneDNN compiles
// a kernel per product shape and keeps 1,024, and a prefill layer by layer over 16k tokens in
// 512-token chunks asked for ~2,000 shapes per layer, recompiling most (--document 1.5x slower
// than --prompt-file, perf: oneDNN's JIT and fresh pages).
constexpr int64_t key_granule = 128;

// One tile: the group's queries [begin, begin + count) of one kv head, every key up to the last
// of them (rounded up to key_granule, within the keys there are). Row r of the tile is query begin
// + r % count of group member r / count, and sees the first offset + begin + r % count + 1 keys.
struct Tile {
    int64_t head, begin, count, visible, rows, offset;

    Tile(const Shapes& s, std::pair<int64_t, int64_t> task)
        : head(task.first),
          begin(task.second * s.block),
          count(std::min(s.block, s.tokens - begin)),
          visible(std::min(
              s.keys, (s.offset + begin + count + key_granule - 1) / key_granule * key_granule)),
          rows(s.group * count),
          offset(s.offset) {}
    int64_t row_visible(int64_t row) const { return offset + begin + row % count + 1; }
    // Row r's place in a head's [group, tokens] log-sum-exp.
    int64_t lse_index(int64_t row, int64_t tokens) const {
        return (row / count) * tokens + begin + row % count;
    }
    // [group, T, D] of one head -> this tile's [rows, D].
    torch::Tensor queries_of(const torch::Tensor& grouped_head) const {
        return grouped_head.narrow(1, begin, count).reshape({rows, grouped_head.size(2)});
    }
};

template <typename T>
T* pointer(const torch::Tensor& tensor) {
    return static_cast<T*>(tensor.data_ptr());
}

template <typename T>
void forward_tiles(const torch::Tensor& grouped, const torch::Tensor& keys,
                   const torch::Tensor& values, double scale, const Shapes& s,
                   torch::Tensor& output, torch::Tensor& log_sum_exp) {
    const auto tasks = balanced_tasks(s);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t first, int64_t end) {
        // Grad mode is per thread and on in OpenMP's workers: the tiles' products there would
        // record a graph, and copying them into the output made it a leaf that requires grad
        // (an error from the second copy, depending on which thread ran which tile).
        const torch::NoGradGuard no_grad;
        for (int64_t t = first; t < end; ++t) {
            const Tile tile(s, tasks[static_cast<std::size_t>(t)]);
            const torch::Tensor visible_keys = keys[tile.head].narrow(0, 0, tile.visible);
            // Scores, then probabilities in place: [rows, visible].
            torch::Tensor scores =
                product_in_dtype(tile.queries_of(grouped[tile.head]), visible_keys.t());
            T* row = pointer<T>(scores);
            float* lse = pointer<float>(log_sum_exp[tile.head]);
            for (int64_t r = 0; r < tile.rows; ++r, row += tile.visible)
                lse[tile.lse_index(r, s.tokens)] = softmax_row(
                    row, row, tile.row_visible(r), tile.visible, static_cast<float>(scale));
            output[tile.head]
                .narrow(1, tile.begin, tile.count)
                .copy_(product_in_dtype(scores, values[tile.head].narrow(0, 0, tile.visible))
                           .view({s.group, tile.count, s.head_dim}));
        }
    });
}

// Backward's keys and values gather gradients from every block after them. Each kv head's
// blocks are dealt to a fixed number of accumulators (every one alternating long and short
// blocks), each filled in a fixed order by one task and summed in a fixed order at the end: the
// same bits whatever the number of threads.
constexpr int64_t accumulators_per_head = 4;

template <typename T>
void backward_tiles(const torch::Tensor& grouped, const torch::Tensor& keys,
                    const torch::Tensor& values, const torch::Tensor& log_sum_exp,
                    const torch::Tensor& d_output, double scale, const Shapes& s,
                    torch::Tensor& d_q, torch::Tensor& d_k, torch::Tensor& d_v) {
    const auto tasks = balanced_tasks(s);
    const int64_t per_head = s.blocks;  // balanced_tasks lists each head's blocks together
    at::parallel_for(0, s.kv_heads * accumulators_per_head, 1, [&](int64_t first, int64_t end) {
        const torch::NoGradGuard no_grad;  // as in forward_tiles
        for (int64_t job = first; job < end; ++job) {
            const int64_t head = job / accumulators_per_head;
            const int64_t slot = job % accumulators_per_head;
            torch::Tensor d_k_slot = d_k[slot][head], d_v_slot = d_v[slot][head];
            for (int64_t i = slot; i < per_head; i += accumulators_per_head) {
                const Tile tile(s, tasks[static_cast<std::size_t>(head * per_head + i)]);
                const torch::Tensor visible_keys = keys[head].narrow(0, 0, tile.visible);
                const torch::Tensor visible_values = values[head].narrow(0, 0, tile.visible);
                const torch::Tensor queries = tile.queries_of(grouped[head]);
                const torch::Tensor d_out = tile.queries_of(d_output[head]);
                // Recomputed probabilities and the scores' gradient, in place of the
                // scores and of the probabilities' gradient.
                torch::Tensor probabilities = product_in_dtype(queries, visible_keys.t());
                torch::Tensor d_scores = product_in_dtype(d_out, visible_values.t());
                T* p = pointer<T>(probabilities);
                T* d = pointer<T>(d_scores);
                const float* lse = pointer<float>(log_sum_exp[head]);
                for (int64_t r = 0; r < tile.rows; ++r, p += tile.visible, d += tile.visible)
                    softmax_backward_row(p, d, lse[tile.lse_index(r, s.tokens)], p, d,
                                         tile.row_visible(r), tile.visible,
                                         static_cast<float>(scale));
                d_v_slot.narrow(0, 0, tile.visible)
                    .add_(product_in_dtype(probabilities.t(), d_out));
                d_q[head]
                    .narrow(1, tile.begin, tile.count)
                    .copy_(product_in_dtype(d_scores, visible_keys)
                               .view({s.group, tile.count, s.head_dim}));
                d_k_slot.narrow(0, 0, tile.visible).add_(product_in_dtype(d_scores.t(), queries));
            }
        }
    });
}

// The forward tiles over q [Hq, T, D] (contiguous) and k, v [Hkv, S, D] of q's dtype: the output
// [Hq, T, D] and each row's log-sum-exp [Hkv, group, T].
std::pair<torch::Tensor, torch::Tensor> forward_pass(const torch::Tensor& q, const torch::Tensor& k,
                                                     const torch::Tensor& v, double scale) {
    const Shapes s = shapes_of(q, k);
    const torch::Tensor grouped = q.view({s.kv_heads, s.group, s.tokens, s.head_dim});
    torch::Tensor output = torch::empty_like(grouped);
    torch::Tensor log_sum_exp =
        torch::empty({s.kv_heads, s.group, s.tokens}, q.options().dtype(torch::kFloat32));
    const SingleThreadedBlas blas;
    if (q.scalar_type() == torch::kBFloat16)
        forward_tiles<uint16_t>(grouped, k, v, scale, s, output, log_sum_exp);
    else
        forward_tiles<float>(grouped, k, v, scale, s, output, log_sum_exp);
    return {output.view({s.query_heads, s.tokens, s.head_dim}), log_sum_exp};
}

struct CausalAttention : torch::autograd::Function<CausalAttention> {
    static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v, double scale) {
        const torch::ScalarType dtype = q.scalar_type();
        const torch::Tensor qc = q.contiguous(), kc = k.to(dtype).contiguous(),
                            vc = v.to(dtype).contiguous();
        auto [output, log_sum_exp] = forward_pass(qc, kc, vc, scale);
        context->save_for_backward({qc, kc, vc, log_sum_exp});
        context->saved_data["scale"] = scale;
        context->saved_data["key_dtype"] = static_cast<int64_t>(k.scalar_type());
        context->saved_data["value_dtype"] = static_cast<int64_t>(v.scalar_type());
        return output;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                   torch::autograd::variable_list gradients) {
        const auto saved = context->get_saved_variables();
        const torch::Tensor &qc = saved[0], &kc = saved[1], &vc = saved[2], &log_sum_exp = saved[3];
        const double scale = context->saved_data["scale"].toDouble();
        const Shapes s = shapes_of(qc, kc);
        const torch::ScalarType dtype = qc.scalar_type();
        const torch::Tensor grouped = qc.view({s.kv_heads, s.group, s.tokens, s.head_dim});
        const torch::Tensor d_output =
            gradients[0].to(dtype).contiguous().view({s.kv_heads, s.group, s.tokens, s.head_dim});
        torch::Tensor d_q = torch::empty_like(grouped);
        torch::Tensor d_k = torch::zeros({accumulators_per_head, s.kv_heads, s.tokens, s.head_dim},
                                         qc.options().dtype(torch::kFloat32));
        torch::Tensor d_v = torch::zeros_like(d_k);
        const SingleThreadedBlas blas;
        if (dtype == torch::kBFloat16)
            backward_tiles<uint16_t>(grouped, kc, vc, log_sum_exp, d_output, scale, s, d_q, d_k,
                                     d_v);
        else
            backward_tiles<float>(grouped, kc, vc, log_sum_exp, d_output, scale, s, d_q, d_k, d_v);
        const auto dtype_of = [&](const char* name) {
            return static_cast<torch::ScalarType>(context->saved_data[name].toInt());
        };
        const auto in_order = [](const torch::Tensor& accumulators) {
            torch::Tensor total = accumulators[0].clone();
            for (int64_t slot = 1; slot < accumulators_per_head; ++slot)
                total.add_(accumulators[slot]);
            return total;
        };
        return {d_q.view({s.query_heads, s.tokens, s.head_dim}),
                in_order(d_k).to(dtype_of("key_dtype")), in_order(d_v).to(dtype_of("value_dtype")),
                torch::Tensor()};
    }
};

}  // namespace

bool causal_attention_prefill_takes(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v) {
    const torch::ScalarType dtype = q.scalar_type();
    return (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && k.scalar_type() == dtype &&
           v.scalar_type() == dtype && k.size(1) >= q.size(1) && v.size(1) == k.size(1) &&
           head_rows_contiguous(k) && head_rows_contiguous(v);
}

bool head_rows_contiguous(const torch::Tensor& rows) {
    return rows.stride(2) == 1 && rows.stride(1) == rows.size(2);
}

torch::Tensor causal_attention_prefill(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, double scale) {
    if (!causal_attention_prefill_takes(q, k, v))
        throw std::invalid_argument(
            "causal_attention_prefill: float32 or bf16 of one dtype, at least as many keys as "
            "queries, the rows of each head contiguous");
    torch::NoGradGuard no_grad;
    return forward_pass(q.contiguous(), k, v, scale).first;
}

torch::Tensor causal_self_attention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, double scale) {
    if (q.scalar_type() != torch::kFloat32 && q.scalar_type() != torch::kBFloat16)
        throw std::invalid_argument("causal_self_attention: float32 or bf16 queries");
    return CausalAttention::apply(q, k, v, scale);
}

}  // namespace kv
