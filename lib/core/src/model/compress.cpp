#include "kv/model/compress.hpp"

#include "kv/error.hpp"
#include "kv/model/packets.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>

namespace kv {
namespace {

constexpr double kept_always = std::numeric_limits<double>::infinity();

// splitmix64: a seeded stream that is the same on every platform (std::normal_distribution is
// not), so that a seed names one compression everywhere.
struct SeededStream {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
    double normal() {                                                           // Box-Muller
        const double u = 1.0 - uniform(), v = uniform();
        return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * M_PI * v);
    }
};

SeededStream stream_for(uint64_t seed, int64_t layer, uint64_t purpose) {
    SeededStream stream{seed * 0x100000001B3ull + purpose};
    stream.state ^= static_cast<uint64_t>(layer) * 0xD6E8FEB86659FD93ull;
    return stream;
}

torch::Tensor as_double(const torch::Tensor& x) {
    return x.to(torch::kCPU, torch::kFloat64).contiguous();
}

// Mean over each kv head's group of query heads: [Hq, ...] -> [Hkv, ...].
torch::Tensor mean_over_group(const torch::Tensor& per_query_head, int64_t kv_heads) {
    std::vector<int64_t> shape = {kv_heads, per_query_head.size(0) / kv_heads};
    for (int64_t d = 1; d < per_query_head.dim(); ++d)
        shape.push_back(per_query_head.size(d));
    return per_query_head.reshape(shape).mean(1);
}

// Softmax attention of `queries` [Hq, W, D] at `query_positions` over `keys` [Hkv, T, D] at
// `key_positions`, causal by position: [Hq, W, T], float64.
torch::Tensor causal_attention(const torch::Tensor& queries, const torch::Tensor& query_positions,
                               const torch::Tensor& keys, const torch::Tensor& key_positions) {
    const int64_t query_heads = queries.size(0), kv_heads = keys.size(0);
    const int64_t group = query_heads / kv_heads;
    const torch::Tensor q = as_double(queries), k = as_double(keys);
    const torch::Tensor expanded = k.repeat_interleave(group, 0);  // [Hq, T, D]
    torch::Tensor scores =
        torch::bmm(q, expanded.transpose(1, 2)) / std::sqrt(static_cast<double>(q.size(2)));
    const torch::Tensor visible = key_positions.to(torch::kCPU).view({1, 1, -1}) <=
                                  query_positions.to(torch::kCPU).view({1, -1, 1});
    scores = scores.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
    return torch::softmax(scores, -1);
}

torch::Tensor pad_with_top(const torch::Tensor& scores, int64_t before, int64_t after) {
    const double top = scores.numel() > 0 ? scores.max().item<double>() + 1 : 1.0;
    return torch::constant_pad_nd(scores, {before, after}, top);
}

torch::Tensor require(const torch::Tensor& tensor, const char* what, CompressionMethod method) {
    if (!tensor.defined())
        throw Error(std::string("compression ") + compression_method_name(method) + " needs " +
                    what + " from the prefill");
    return tensor;
}

torch::Tensor snapkv_scores(const CompressionSettings& settings, const LayerEvidence& evidence,
                            int64_t window) {
    const int64_t kv_heads = evidence.keys.size(0), tokens = evidence.keys.size(1);
    const torch::Tensor queries = require(evidence.last_queries, "queries", settings.method);
    // A packet no longer than the window: the window shrinks so that one token is scored.
    window = std::min({window, tokens - 1, queries.size(1)});
    if (window < 1) return torch::zeros({kv_heads, tokens}, torch::kFloat64);
    const torch::Tensor last = queries.narrow(1, queries.size(1) - window, window);
    const torch::Tensor last_positions =
        evidence.last_positions.narrow(0, evidence.last_positions.size(0) - window, window);
    const torch::Tensor attention =
        causal_attention(last, last_positions, evidence.keys, evidence.positions)
            .narrow(2, 0, tokens - window);  // [Hq, W, T - W]
    torch::Tensor scores = attention.mean(1);
    if (settings.method == CompressionMethod::tova) {
        // One score for every kv head: the mean over all query heads (TOVA).
        scores = scores.mean(0, true).expand({kv_heads, tokens - window}).contiguous();
    } else {
        scores = torch::avg_pool1d(scores.unsqueeze(1), {settings.kernel_size}, {1},
                                   {settings.kernel_size / 2})
                     .squeeze(1);
        scores = mean_over_group(scores, kv_heads);
    }
    return pad_with_top(scores, 0, window);
}

torch::Tensor observed_scores(const CompressionSettings& settings, const LayerEvidence& evidence) {
    const int64_t kv_heads = evidence.keys.size(0), tokens = evidence.keys.size(1);
    const torch::Tensor sums =
        as_double(require(evidence.attention_sums, "attention", settings.method));
    // Key i is seen by the queries at its position and after: tokens - i of them.
    const torch::Tensor seen = torch::arange(tokens, 0, -1, torch::kFloat64);
    return mean_over_group(sums.narrow(1, 0, tokens) / seen, kv_heads);
}

torch::Tensor expected_scores(const CompressionSettings& settings, const Rope& rope,
                              const LayerEvidence& evidence) {
    const int64_t kv_heads = evidence.keys.size(0), tokens = evidence.keys.size(1),
                  dim = evidence.keys.size(2);
    const int64_t sinks = std::min(settings.sinks, tokens - 1);
    const torch::Tensor mean =
        as_double(require(evidence.query_mean, "query statistics", settings.method));
    const torch::Tensor covariance =
        as_double(require(evidence.query_covariance, "query statistics", settings.method));
    const int64_t query_heads = mean.size(0), group = query_heads / kv_heads;

    // The mean rotation over the next positions, R = mean_p R(p), found by rotating the basis:
    // rows of `basis_images` are R e_i, so as row vectors mu R^T = mu @ M with M = rows.
    const int64_t next = evidence.positions.max().item<int64_t>() + 1;
    const torch::Tensor future =
        torch::arange(next, next + settings.future_positions, torch::kInt64);
    const torch::Tensor basis = torch::eye(dim, torch::kFloat32)
                                    .unsqueeze(1)
                                    .expand({dim, settings.future_positions, dim})
                                    .contiguous();
    const torch::Tensor rotated = as_double(rope.apply(basis, future));  // [D, P, D]
    const torch::Tensor images = rotated.mean(1);  // row i: R e_i, i.e. images = R^T
    const torch::Tensor mean_rotated = torch::matmul(mean, images);  // mu R^T
    const torch::Tensor covariance_rotated =
        torch::matmul(images.transpose(0, 1), torch::matmul(covariance, images));  // R S R^T

    const torch::Tensor keys =
        as_double(evidence.keys).narrow(1, sinks, tokens - sinks).repeat_interleave(group, 0);
    torch::Tensor scores = torch::matmul(keys, mean_rotated.unsqueeze(2)).squeeze(2) /
                           std::sqrt(static_cast<double>(dim));
    scores = scores + (torch::matmul(keys, covariance_rotated) * keys).sum(2) / dim / 2;
    scores = mean_over_group(torch::softmax(scores, -1), kv_heads);
    const torch::Tensor values = as_double(evidence.values).narrow(1, sinks, tokens - sinks);
    scores = scores * values.norm(2, -1);  // kvpress: (scores + epsilon 0) * |v|
    return pad_with_top(scores, sinks, 0);
}

torch::Tensor leverage_scores(const CompressionSettings& settings, const Rope& rope,
                              const LayerEvidence& evidence, int64_t layer) {
    const int64_t kv_heads = evidence.keys.size(0), dim = evidence.keys.size(2),
                  sketch = settings.sketch_dimension;
    // Keys before RoPE: the stored ones rotated back by their positions.
    const torch::Tensor pre_rope = as_double(
        rope.apply(evidence.keys.to(torch::kFloat32), -evidence.positions.to(torch::kCPU)));
    SeededStream stream = stream_for(settings.seed, layer, 2);
    torch::Tensor phi = torch::empty({kv_heads, dim, sketch}, torch::kFloat64);
    double* data = phi.data_ptr<double>();
    for (int64_t i = 0; i < phi.numel(); ++i)
        data[i] = stream.normal() / std::sqrt(static_cast<double>(sketch));
    const torch::Tensor centred = pre_rope - pre_rope.mean(1, true);
    const torch::Tensor x = torch::matmul(centred, phi);  // [Hkv, T, k]
    const torch::Tensor xt = x.transpose(1, 2);
    torch::Tensor gram = torch::matmul(xt, x);
    gram = 0.5 * (gram + gram.transpose(1, 2));
    const torch::Tensor identity = torch::eye(sketch, torch::kFloat64);
    // As kvpress: a jitter of 1e-2, grown tenfold while the factorisation fails.
    torch::Tensor factor;
    double jitter = 1e-2;
    for (int attempt = 0;; ++attempt) {
        auto [lower, info] = torch::linalg_cholesky_ex(gram + jitter * identity);
        if (info.eq(0).all().item<bool>()) {
            factor = lower;
            break;
        }
        if (attempt == 4) throw Error("leverage scores: the key sketch is not positive definite");
        jitter *= 10;
    }
    const torch::Tensor solved = torch::cholesky_solve(xt, factor);  // (X^T X)^-1 X^T
    torch::Tensor scores = (x * solved.transpose(1, 2)).sum(2).clamp_min(0);
    const double spread = std::max(scores.std().item<double>(), 1e-6);
    return (scores - scores.mean()) / spread;
}

torch::Tensor cur_scores(const CompressionSettings& settings, const LayerEvidence& evidence) {
    const int64_t kv_heads = evidence.keys.size(0), tokens = evidence.keys.size(1);
    const int64_t window = settings.local_window;
    auto local = [&](const torch::Tensor& squared) {  // [Hkv, T] normalised per window
        const int64_t padded = (tokens + window - 1) / window * window;
        const torch::Tensor blocks =
            torch::constant_pad_nd(squared, {0, padded - tokens}, 0.0).view({kv_heads, -1, window});
        return (blocks / blocks.sum(-1, true).clamp_min(std::numeric_limits<double>::min()))
            .view({kv_heads, padded})
            .narrow(1, 0, tokens);
    };
    const torch::Tensor k2 = local(as_double(evidence.keys).pow(2).sum(-1));
    const torch::Tensor v2 = local(as_double(evidence.values).pow(2).sum(-1));
    torch::Tensor scores = k2 * v2;
    scores = scores / scores.sum(-1, true).clamp_min(std::numeric_limits<double>::min());
    scores.narrow(1, 0, std::min(settings.sinks, tokens)).fill_(1.0);
    return scores;
}

}  // namespace

torch::Tensor score_tokens(const CompressionSettings& settings, const Rope& rope,
                           const LayerEvidence& evidence, int64_t layer) {
    const int64_t kv_heads = evidence.keys.size(0), tokens = evidence.keys.size(1);
    switch (settings.method) {
        case CompressionMethod::random: {
            SeededStream stream = stream_for(settings.seed, layer, 1);
            torch::Tensor scores = torch::empty({kv_heads, tokens}, torch::kFloat64);
            double* data = scores.data_ptr<double>();
            for (int64_t i = 0; i < scores.numel(); ++i)
                data[i] = stream.uniform();
            return scores;
        }
        case CompressionMethod::knorm:
            return -as_double(evidence.keys).norm(2, -1);
        case CompressionMethod::streaming: {
            // The sinks, then the most recent tokens: a score that grows with the position.
            const torch::Tensor positions = as_double(evidence.positions);
            torch::Tensor scores = positions.unsqueeze(0).expand({kv_heads, tokens}).clone();
            return scores.masked_fill(scores < static_cast<double>(settings.sinks), kept_always);
        }
        case CompressionMethod::snapkv:
            return snapkv_scores(settings, evidence, settings.window_size);
        case CompressionMethod::tova:
            return snapkv_scores(settings, evidence, 1);
        case CompressionMethod::observed:
            return observed_scores(settings, evidence);
        case CompressionMethod::expected:
            return expected_scores(settings, rope, evidence);
        case CompressionMethod::leverage:
            return leverage_scores(settings, rope, evidence, layer);
        case CompressionMethod::cur:
            return cur_scores(settings, evidence);
    }
    throw Error("unknown compression method");
}

// ---------------------------------------------------------------------------------------------

QueryRecorder::QueryRecorder(const CompressionSettings& settings, const Rope& rope,
                             int64_t num_layers)
    : settings_(settings), rope_(rope), layers_(static_cast<std::size_t>(num_layers)) {}

void QueryRecorder::observe(int64_t layer, const torch::Tensor& queries,
                            const torch::Tensor& positions, const torch::Tensor& keys,
                            const torch::Tensor& key_positions) {
    torch::NoGradGuard no_grad;
    Layer& state = layers_.at(static_cast<std::size_t>(layer));
    const torch::Tensor q = queries.to(torch::kCPU, torch::kFloat32);
    const torch::Tensor query_positions = positions.to(torch::kCPU, torch::kInt64);
    switch (settings_.method) {
        case CompressionMethod::snapkv:
        case CompressionMethod::tova: {
            const int64_t window =
                settings_.method == CompressionMethod::tova ? 1 : settings_.window_size;
            torch::Tensor all =
                state.last_queries.defined() ? torch::cat({state.last_queries, q}, 1) : q;
            torch::Tensor all_positions = state.last_positions.defined()
                                              ? torch::cat({state.last_positions, query_positions})
                                              : query_positions;
            const int64_t kept = std::min(window, all.size(1));
            state.last_queries = all.narrow(1, all.size(1) - kept, kept).clone();
            state.last_positions =
                all_positions.narrow(0, all_positions.size(0) - kept, kept).clone();
            break;
        }
        case CompressionMethod::observed: {
            const int64_t query_heads = q.size(0), kv_heads = keys.size(0), count = q.size(1);
            const int64_t key_count = keys.size(1), group = query_heads / kv_heads;
            const torch::Tensor k = keys.to(torch::kCPU, torch::kFloat32);
            const torch::Tensor key_positions_cpu = key_positions.to(torch::kCPU, torch::kInt64);
            torch::Tensor sums = torch::zeros({query_heads, key_count}, torch::kFloat32);
            // Blocks of queries, so that no score tensor exceeds ~16 MB.
            const int64_t block =
                std::max<int64_t>(1, (int64_t{4} << 20) / (query_heads * key_count));
            for (int64_t begin = 0; begin < count; begin += block) {
                const int64_t n = std::min(block, count - begin);
                const torch::Tensor part = q.narrow(1, begin, n).reshape({kv_heads, group * n, -1});
                torch::Tensor scores = torch::bmm(part, k.transpose(1, 2))
                                           .mul_(1.0 / std::sqrt(static_cast<double>(q.size(2))))
                                           .view({kv_heads, group, n, key_count});
                const torch::Tensor visible = key_positions_cpu.view({1, key_count}) <=
                                              query_positions.narrow(0, begin, n).view({n, 1});
                scores.masked_fill_(visible.logical_not(), -std::numeric_limits<float>::infinity());
                sums += torch::softmax(scores, -1).sum(2).reshape({query_heads, key_count});
            }
            if (!state.attention_sums.defined()) {
                state.attention_sums = sums;
            } else {
                torch::Tensor grown = torch::zeros({query_heads, key_count}, torch::kFloat32);
                grown.narrow(1, 0, state.attention_sums.size(1)).copy_(state.attention_sums);
                state.attention_sums = grown + sums;
            }
            break;
        }
        case CompressionMethod::expected: {
            // Moments of the queries before RoPE, past the sinks (kvpress).
            const torch::Tensor keep = query_positions >= settings_.sinks;
            if (!keep.any().item<bool>()) break;
            const torch::Tensor pre_rope = rope_.apply(q, -query_positions)
                                               .to(torch::kFloat64)
                                               .index({torch::indexing::Slice(), keep});
            const torch::Tensor sum = pre_rope.sum(1);
            const torch::Tensor products = torch::bmm(pre_rope.transpose(1, 2), pre_rope);
            state.query_sum = state.query_sum.defined() ? state.query_sum + sum : sum;
            state.query_products =
                state.query_products.defined() ? state.query_products + products : products;
            state.query_count += pre_rope.size(1);
            break;
        }
        default:
            break;
    }
}

void QueryRecorder::fill(int64_t layer, LayerEvidence& evidence) const {
    const Layer& state = layers_.at(static_cast<std::size_t>(layer));
    evidence.last_queries = state.last_queries;
    evidence.last_positions = state.last_positions;
    evidence.attention_sums = state.attention_sums;
    if (state.query_count > 0) {
        const double count = static_cast<double>(state.query_count);
        const torch::Tensor mean = state.query_sum / count;
        evidence.query_mean = mean;
        evidence.query_covariance =
            state.query_products / count - mean.unsqueeze(2) * mean.unsqueeze(1);
    }
}

// ---------------------------------------------------------------------------------------------

Packet compress_packet(const Packet& packet, const CacheModelInfo& model, const Rope& rope,
                       const CompressionSettings& settings, const QueryRecorder* recorder) {
    torch::NoGradGuard no_grad;
    if (packet.ragged())
        throw FormatError("packet " + kv::quoted(packet.id) +
                          " is already compressed per head; compress the uncompressed packet");
    if (compression_needs_queries(settings.method) && !recorder)
        throw UsageError(std::string("compression ") + compression_method_name(settings.method) +
                         " needs the prefill's queries (the model)");
    const int64_t tokens = packet.stored_length();
    const int64_t layers = model.num_layers, kv_heads = model.num_kv_heads;
    const std::size_t planes = static_cast<std::size_t>(layers * kv_heads);

    std::vector<bool> protect(static_cast<std::size_t>(tokens), false);
    int64_t protected_count = 0;
    if (settings.keep_adapters)
        for (int64_t i = 0; i < tokens; ++i) {
            const int64_t position = packet.positions[static_cast<std::size_t>(i)];
            if (position < packet.header_tokens ||
                position >= packet.logical_length - packet.trailer_tokens) {
                protect[static_cast<std::size_t>(i)] = true;
                ++protected_count;
            }
        }
    const int64_t keep = std::min(tokens, std::max(settings.kept(tokens), protected_count));
    if (keep >= tokens) return packet;

    const torch::Tensor keys =
        packet_tensor(packet, true, layers, kv_heads, model.head_dim, model.dtype);
    const torch::Tensor values =
        packet_tensor(packet, false, layers, kv_heads, model.head_dim, model.dtype);
    const torch::Tensor positions =
        torch::from_blob(const_cast<int64_t*>(packet.positions.data()), {tokens}, torch::kInt64)
            .clone();

    // Per plane, the kept token indices in increasing order.
    std::vector<std::vector<int64_t>> chosen(planes);
    std::vector<int64_t> order(static_cast<std::size_t>(tokens));
    for (int64_t layer = 0; layer < layers; ++layer) {
        LayerEvidence evidence;
        evidence.keys = keys[layer].to(torch::kFloat32);
        evidence.values = values[layer].to(torch::kFloat32);
        evidence.positions = positions;
        if (recorder) recorder->fill(layer, evidence);
        const torch::Tensor scores = score_tokens(settings, rope, evidence, layer).contiguous();
        if (scores.size(0) != kv_heads || scores.size(1) != tokens)
            throw Error("compression: scores have the wrong shape");
        for (int64_t head = 0; head < kv_heads; ++head) {
            const double* row = scores.data_ptr<double>() + head * tokens;
            auto score = [&](int64_t i) {
                return protect[static_cast<std::size_t>(i)] ? kept_always : row[i];
            };
            std::iota(order.begin(), order.end(), 0);
            // Highest first, ties to the earlier token; NaN scores (degenerate input) last.
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
                const double x = score(a), y = score(b);
                if (std::isnan(x) || std::isnan(y)) return !std::isnan(x) && std::isnan(y);
                return x > y;
            });
            std::vector<int64_t>& kept = chosen[static_cast<std::size_t>(layer * kv_heads + head)];
            kept.assign(order.begin(), order.begin() + keep);
            std::sort(kept.begin(), kept.end());
        }
    }

    Packet out;
    out.id = packet.id;
    out.text_sha256 = packet.text_sha256;
    out.logical_length = packet.logical_length;
    out.adapter_fingerprint = packet.adapter_fingerprint;
    out.header_tokens = packet.header_tokens;
    out.trailer_tokens = packet.trailer_tokens;
    const bool uniform = std::all_of(chosen.begin(), chosen.end(),
                                     [&](const std::vector<int64_t>& c) { return c == chosen[0]; });
    out.positions.assign(static_cast<std::size_t>(keep), 0);
    out.token_ids.assign(static_cast<std::size_t>(keep), -1);
    if (uniform) {
        for (int64_t slot = 0; slot < keep; ++slot) {
            const auto i = static_cast<std::size_t>(chosen[0][static_cast<std::size_t>(slot)]);
            out.positions[static_cast<std::size_t>(slot)] = packet.positions[i];
            out.token_ids[static_cast<std::size_t>(slot)] = packet.token_ids[i];
        }
    } else {
        out.head_lengths.assign(planes, keep);
        out.head_positions.assign(planes * static_cast<std::size_t>(keep), 0);
        std::vector<int64_t> slot_source(static_cast<std::size_t>(keep), -1);
        for (std::size_t plane = 0; plane < planes; ++plane)
            for (int64_t slot = 0; slot < keep; ++slot) {
                const auto i =
                    static_cast<std::size_t>(chosen[plane][static_cast<std::size_t>(slot)]);
                const int64_t position = packet.positions[i];
                out.head_positions[plane * static_cast<std::size_t>(keep) +
                                   static_cast<std::size_t>(slot)] = position;
                if (slot_source[static_cast<std::size_t>(slot)] < 0 ||
                    position > out.positions[static_cast<std::size_t>(slot)]) {
                    out.positions[static_cast<std::size_t>(slot)] = position;
                    out.token_ids[static_cast<std::size_t>(slot)] = packet.token_ids[i];
                    slot_source[static_cast<std::size_t>(slot)] = static_cast<int64_t>(i);
                }
            }
    }
    const std::size_t row_bytes =
        static_cast<std::size_t>(model.head_dim) * cache_dtype_size(model.dtype);
    out.keys.resize(planes * static_cast<std::size_t>(keep) * row_bytes);
    out.values.resize(out.keys.size());
    for (std::size_t plane = 0; plane < planes; ++plane)
        for (int64_t slot = 0; slot < keep; ++slot) {
            const auto i = static_cast<std::size_t>(chosen[plane][static_cast<std::size_t>(slot)]);
            const std::size_t from = (plane * static_cast<std::size_t>(tokens) + i) * row_bytes;
            const std::size_t to =
                (plane * static_cast<std::size_t>(keep) + static_cast<std::size_t>(slot)) *
                row_bytes;
            std::memcpy(out.keys.data() + to, packet.keys.data() + from, row_bytes);
            std::memcpy(out.values.data() + to, packet.values.data() + from, row_bytes);
        }
    return out;
}

}  // namespace kv
