// Causal self-attention with gradients, by tiles: what training spends most of its time on.
//
// Through the general attention() a 2,048-token training sequence materialised [Hq, T, S] score,
// probability and mask tensors in float32 and bf16 and ran a dozen elementwise passes over them
// forward and backward (dtype copies, masked_fill, softmax and its backward, the zero fill of
// masked gradients): ~90% of a training step (libtorch profiler, demo model, 8 x 2,048 tokens),
// the matrix products ~6%. Here each task takes one kv head and a block of queries with its whole
// query group, computes the scores of the keys the block may see (a prefix: causal by index)
// into a tile that stays in cache, and keeps only the output and each row's log-sum-exp;
// backward recomputes the tile's probabilities from them (FlashAttention's scheme).
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

// Queries per tile: [group * block, keys] float32 scores stay within a core's L2 at the lengths
// training uses (4 x 32 x 2,048 x 4 bytes = 1 MiB).
constexpr int64_t query_block = 32;

struct Shapes {
    int64_t query_heads, kv_heads, group, tokens, head_dim, blocks;
};

Shapes shapes_of(const torch::Tensor& q, const torch::Tensor& k) {
    Shapes s{};
    s.query_heads = q.size(0);
    s.kv_heads = k.size(0);
    s.group = s.query_heads / s.kv_heads;
    s.tokens = q.size(1);
    s.head_dim = q.size(2);
    s.blocks = (s.tokens + query_block - 1) / query_block;
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

// Scores of the group's queries in [begin, begin + count) against keys [0, begin + count), scaled,
// with each query's later keys at -inf: [group * count, begin + count] float32.
torch::Tensor tile_scores(const torch::Tensor& q_head, const torch::Tensor& k_head, int64_t begin,
                          int64_t count, double scale) {
    const int64_t group = q_head.size(0), visible = begin + count;
    const torch::Tensor queries =
        q_head.narrow(1, begin, count).reshape({group * count, q_head.size(2)});
    torch::Tensor scores =
        torch::mm(queries, k_head.narrow(0, 0, visible).t()).to(torch::kFloat32).mul_(scale);
    // Only the tile's last `count` keys can be later than a query of the tile.
    static const torch::Tensor later =
        torch::ones({query_block, query_block}, torch::TensorOptions().dtype(torch::kBool))
            .triu_(1);
    scores.view({group, count, visible})
        .narrow(2, begin, count)
        .masked_fill_(later.narrow(0, 0, count).narrow(1, 0, count),
                      -std::numeric_limits<float>::infinity());
    return scores;
}

struct CausalAttention : torch::autograd::Function<CausalAttention> {
    static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v, double scale) {
        // The products run in the inputs' dtype (bf16's are ~3x faster here than float32's,
        // and the general path rounded its scores to bf16 too), the softmax in float32.
        const torch::ScalarType dtype = q.scalar_type();
        const torch::Tensor qc = q.contiguous(), kc = k.to(dtype).contiguous(),
                            vc = v.to(dtype).contiguous();
        const Shapes s = shapes_of(qc, kc);
        const torch::Tensor grouped = qc.view({s.kv_heads, s.group, s.tokens, s.head_dim});
        torch::Tensor output = torch::empty_like(grouped);
        torch::Tensor log_sum_exp =
            torch::empty({s.kv_heads, s.group, s.tokens}, qc.options().dtype(torch::kFloat32));
        const auto tasks = balanced_tasks(s);
        const SingleThreadedBlas blas;
        at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t first, int64_t end) {
            for (int64_t t = first; t < end; ++t) {
                const auto [head, block] = tasks[static_cast<std::size_t>(t)];
                const int64_t begin = block * query_block;
                const int64_t count = std::min(query_block, s.tokens - begin);
                torch::Tensor scores = tile_scores(grouped[head], kc[head], begin, count, scale);
                const torch::Tensor row_max = std::get<0>(scores.max(1, true));
                scores.sub_(row_max).exp_();
                const torch::Tensor row_sum = scores.sum(1, true);
                scores.div_(row_sum);
                output[head]
                    .narrow(1, begin, count)
                    .copy_(torch::mm(scores.to(dtype), vc[head].narrow(0, 0, begin + count))
                               .view({s.group, count, s.head_dim}));
                log_sum_exp[head]
                    .narrow(1, begin, count)
                    .copy_((row_max + row_sum.log()).view({s.group, count}));
            }
        });
        context->save_for_backward({qc, kc, vc, output, log_sum_exp});
        context->saved_data["scale"] = scale;
        context->saved_data["key_dtype"] = static_cast<int64_t>(k.scalar_type());
        context->saved_data["value_dtype"] = static_cast<int64_t>(v.scalar_type());
        return output.view({s.query_heads, s.tokens, s.head_dim});
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                   torch::autograd::variable_list gradients) {
        const auto saved = context->get_saved_variables();
        const torch::Tensor &qc = saved[0], &kc = saved[1], &vc = saved[2], &output = saved[3],
                            &log_sum_exp = saved[4];
        const double scale = context->saved_data["scale"].toDouble();
        const Shapes s = shapes_of(qc, kc);
        const torch::ScalarType dtype = qc.scalar_type();
        const torch::Tensor grouped = qc.view({s.kv_heads, s.group, s.tokens, s.head_dim});
        const torch::Tensor d_output =
            gradients[0].to(dtype).contiguous().view({s.kv_heads, s.group, s.tokens, s.head_dim});
        // D_i = sum_j dO_ij O_ij: the softmax backward's row term, computed once.
        const torch::Tensor row_dot =
            (d_output.to(torch::kFloat32) * output.view_as(d_output).to(torch::kFloat32)).sum(-1);
        torch::Tensor d_q = torch::empty_like(grouped);
        // Keys and values gather gradients from every block after them: one float32
        // accumulator per thread, summed at the end. Deterministic for a given thread count;
        // another count sums in another order (last bits of the gradients).
        const int64_t threads = at::get_num_threads();
        torch::Tensor d_k = torch::zeros({threads, s.kv_heads, s.tokens, s.head_dim},
                                         qc.options().dtype(torch::kFloat32));
        torch::Tensor d_v = torch::zeros_like(d_k);
        const auto tasks = balanced_tasks(s);
        const SingleThreadedBlas blas;
        at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t first, int64_t end) {
            const int64_t thread = at::get_thread_num();
            for (int64_t t = first; t < end; ++t) {
                const auto [head, block] = tasks[static_cast<std::size_t>(t)];
                const int64_t begin = block * query_block;
                const int64_t count = std::min(query_block, s.tokens - begin);
                const int64_t visible = begin + count;
                const int64_t rows = s.group * count;
                torch::Tensor probabilities =
                    tile_scores(grouped[head], kc[head], begin, count, scale);
                probabilities.sub_(log_sum_exp[head].narrow(1, begin, count).reshape({rows, 1}))
                    .exp_();
                const torch::Tensor d_out =
                    d_output[head].narrow(1, begin, count).reshape({rows, s.head_dim});
                const torch::Tensor keys = kc[head].narrow(0, 0, visible);
                const torch::Tensor values = vc[head].narrow(0, 0, visible);
                d_v[thread][head]
                    .narrow(0, 0, visible)
                    .add_(torch::mm(probabilities.to(dtype).t(), d_out));
                // dS = P * (dP - D), then the scale of the scores.
                torch::Tensor d_scores = torch::mm(d_out, values.t()).to(torch::kFloat32);
                d_scores.sub_((d_scores * probabilities).sum(1, true))
                    .mul_(probabilities)
                    .mul_(scale);
                const torch::Tensor d_scores_c = d_scores.to(dtype);
                d_q[head]
                    .narrow(1, begin, count)
                    .copy_(torch::mm(d_scores_c, keys).view({s.group, count, s.head_dim}));
                const torch::Tensor queries =
                    grouped[head].narrow(1, begin, count).reshape({rows, s.head_dim});
                d_k[thread][head].narrow(0, 0, visible).add_(torch::mm(d_scores_c.t(), queries));
            }
        });
        const auto dtype_of = [&](const char* name) {
            return static_cast<torch::ScalarType>(context->saved_data[name].toInt());
        };
        return {d_q.view({s.query_heads, s.tokens, s.head_dim}),
                d_k.sum(0).to(dtype_of("key_dtype")), d_v.sum(0).to(dtype_of("value_dtype")),
                torch::Tensor()};
    }
};

}  // namespace

torch::Tensor causal_self_attention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, double scale) {
    return CausalAttention::apply(q, k, v, scale);
}

}  // namespace kv
