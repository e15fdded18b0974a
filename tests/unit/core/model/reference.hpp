// A float64 reference of the decoder, written from the architecture descriptions (Llama,
// Qwen2, Qwen3, llama2.c) with plain loops and no libtorch, to check the runtime against.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <numbers>
#include <string>
#include <vector>

namespace kv::reference {

using Vector = std::vector<double>;
using Matrix = std::vector<Vector>;  // row-major: matrix[out][in]

inline Vector rms_norm(const Vector& x, const Vector& weight, double eps) {
    double sum = 0;
    for (double v : x)
        sum += v * v;
    const double scale = 1.0 / std::sqrt(sum / static_cast<double>(x.size()) + eps);
    Vector y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i)
        y[i] = x[i] * scale * weight[i];
    return y;
}

inline Vector multiply(const Matrix& w, const Vector& x) {
    Vector y(w.size(), 0.0);
    for (std::size_t o = 0; o < w.size(); ++o)
        for (std::size_t i = 0; i < x.size(); ++i)
            y[o] += w[o][i] * x[i];
    return y;
}

inline double silu(double x) {
    return x / (1.0 + std::exp(-x));
}

/// Inverse frequency of pair i, with Llama 3.1's scaling when factor > 0 (the formula from
/// Meta's reference `apply_scaling`).
struct RopeSpec {
    double theta = 10000;
    int head_dim = 0;
    bool interleaved = false;
    double llama3_factor = 0;  // 0: no scaling
    double low_freq_factor = 1, high_freq_factor = 4, original_context = 8192;
};

inline double inverse_frequency(const RopeSpec& spec, int i) {
    const double base = 1.0 / std::pow(spec.theta, 2.0 * i / spec.head_dim);
    if (spec.llama3_factor <= 0) return base;
    const double wavelength = 2 * std::numbers::pi / base;
    const double low_wavelength = spec.original_context / spec.low_freq_factor;
    const double high_wavelength = spec.original_context / spec.high_freq_factor;
    if (wavelength < high_wavelength) return base;
    if (wavelength > low_wavelength) return base / spec.llama3_factor;
    const double smooth = (spec.original_context / wavelength - spec.low_freq_factor) /
                          (spec.high_freq_factor - spec.low_freq_factor);
    return (1 - smooth) * base / spec.llama3_factor + smooth * base;
}

/// Rotates one head vector to `position`: pairs (2i, 2i+1) when interleaved, (i, i+D/2) else.
inline Vector rope(const RopeSpec& spec, const Vector& x, double position) {
    Vector y = x;
    const int half = spec.head_dim / 2;
    for (int i = 0; i < half; ++i) {
        const double angle = position * inverse_frequency(spec, i);
        const std::size_t a = spec.interleaved ? 2 * i : i;
        const std::size_t b = spec.interleaved ? 2 * i + 1 : i + half;
        y[a] = x[a] * std::cos(angle) - x[b] * std::sin(angle);
        y[b] = x[a] * std::sin(angle) + x[b] * std::cos(angle);
    }
    return y;
}

/// Softmax attention of one query over keys/values that it may see.
inline Vector attend(const Vector& q, const std::vector<Vector>& keys,
                     const std::vector<Vector>& values, const std::vector<bool>& visible) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size()));
    std::vector<double> scores(keys.size(), -INFINITY);
    double best = -INFINITY;
    for (std::size_t j = 0; j < keys.size(); ++j) {
        if (!visible[j]) continue;
        double dot = 0;
        for (std::size_t d = 0; d < q.size(); ++d)
            dot += q[d] * keys[j][d];
        scores[j] = dot * scale;
        best = std::max(best, scores[j]);
    }
    Vector out(q.size(), 0.0);
    if (best == -INFINITY) return out;
    double total = 0;
    for (double& s : scores)
        total += (s = s == -INFINITY ? 0.0 : std::exp(s - best));
    for (std::size_t j = 0; j < keys.size(); ++j)
        for (std::size_t d = 0; d < q.size(); ++d)
            out[d] += scores[j] / total * values[j][d];
    return out;
}

struct Layer {
    Vector attention_norm, mlp_norm, q_bias, k_bias, v_bias, q_norm, k_norm;
    Matrix wq, wk, wv, wo, gate, up, down;
};

struct Model {
    int heads = 0, kv_heads = 0, head_dim = 0;
    double eps = 1e-5;
    RopeSpec rope;
    Matrix embedding, lm_head;
    Vector final_norm;
    std::vector<Layer> layers;

    /// Logits of every token of `tokens` at positions 0..T-1, causal; `document` (optional) gives
    /// each token a block id: tokens attend only within their block.
    std::vector<Vector> forward(const std::vector<int>& tokens,
                                const std::vector<int>& document = {},
                                const std::vector<double>& positions_in = {}) const {
        const std::size_t count = tokens.size();
        std::vector<double> positions = positions_in;
        if (positions.empty())
            for (std::size_t t = 0; t < count; ++t)
                positions.push_back(static_cast<double>(t));
        std::vector<Vector> x;
        for (int token : tokens)
            x.push_back(embedding[static_cast<std::size_t>(token)]);
        for (const Layer& layer : layers) {
            // keys[h][t], values[h][t]
            std::vector<std::vector<Vector>> keys(kv_heads), values(kv_heads);
            std::vector<std::vector<Vector>> queries(count);
            for (std::size_t t = 0; t < count; ++t) {
                const Vector normed = rms_norm(x[t], layer.attention_norm, eps);
                Vector q = multiply(layer.wq, normed), k = multiply(layer.wk, normed),
                       v = multiply(layer.wv, normed);
                for (std::size_t i = 0; i < layer.q_bias.size(); ++i)
                    q[i] += layer.q_bias[i];
                for (std::size_t i = 0; i < layer.k_bias.size(); ++i)
                    k[i] += layer.k_bias[i];
                for (std::size_t i = 0; i < layer.v_bias.size(); ++i)
                    v[i] += layer.v_bias[i];
                auto head = [&](const Vector& all, int h) {
                    return Vector(all.begin() + h * head_dim, all.begin() + (h + 1) * head_dim);
                };
                for (int h = 0; h < heads; ++h) {
                    Vector qh = head(q, h);
                    if (!layer.q_norm.empty()) qh = rms_norm(qh, layer.q_norm, eps);
                    queries[t].push_back(rope_of(qh, positions[t]));
                }
                for (int h = 0; h < kv_heads; ++h) {
                    Vector kh = head(k, h);
                    if (!layer.k_norm.empty()) kh = rms_norm(kh, layer.k_norm, eps);
                    keys[h].push_back(rope_of(kh, positions[t]));
                    values[h].push_back(head(v, h));
                }
            }
            for (std::size_t t = 0; t < count; ++t) {
                std::vector<bool> visible(count);
                for (std::size_t j = 0; j < count; ++j)
                    visible[j] = positions[j] <= positions[t] &&
                                 (document.empty() || document[j] == document[t]);
                Vector concatenated;
                for (int h = 0; h < heads; ++h) {
                    const int group = heads / kv_heads;
                    const Vector out =
                        attend(queries[t][h], keys[h / group], values[h / group], visible);
                    concatenated.insert(concatenated.end(), out.begin(), out.end());
                }
                const Vector projected = multiply(layer.wo, concatenated);
                for (std::size_t i = 0; i < projected.size(); ++i)
                    x[t][i] += projected[i];
                const Vector normed = rms_norm(x[t], layer.mlp_norm, eps);
                const Vector gate = multiply(layer.gate, normed), up = multiply(layer.up, normed);
                Vector hidden(gate.size());
                for (std::size_t i = 0; i < gate.size(); ++i)
                    hidden[i] = silu(gate[i]) * up[i];
                const Vector down = multiply(layer.down, hidden);
                for (std::size_t i = 0; i < down.size(); ++i)
                    x[t][i] += down[i];
            }
        }
        std::vector<Vector> logits;
        for (std::size_t t = 0; t < count; ++t)
            logits.push_back(multiply(lm_head, rms_norm(x[t], final_norm, eps)));
        return logits;
    }

  private:
    Vector rope_of(const Vector& x, double position) const {
        return kv::reference::rope(rope, x, position);
    }
};

}  // namespace kv::reference
