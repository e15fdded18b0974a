// The kvpress scoring rules against float64 references written as plain loops, and the pruning
// they drive: per-head choices, kept adapters, per-head storage through the file, decoding with
// padding, and packing per-head packets.
#include "kv/api/pack.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/model/compress.hpp"
#include "kv/model/packets.hpp"
#include "kv/rope.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

using namespace kv;

namespace {

constexpr int64_t kv_heads = 2, group = 2, query_heads = 4, tokens = 12, dim = 4;
using Grid = std::vector<std::vector<double>>;  // [head][token]

struct Inputs {
    std::vector<double> keys, values, queries;  // [H, T, D] row-major, queries [Hq, T, D]
    double key(int64_t h, int64_t t, int64_t d) const { return keys[(h * tokens + t) * dim + d]; }
    double value(int64_t h, int64_t t, int64_t d) const {
        return values[(h * tokens + t) * dim + d];
    }
    double query(int64_t h, int64_t t, int64_t d) const {
        return queries[(h * tokens + t) * dim + d];
    }
};

Inputs random_inputs(uint64_t seed, double key_scale = 1.0) {
    std::mt19937_64 generator(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    Inputs in;
    for (int64_t i = 0; i < kv_heads * tokens * dim; ++i)
        in.keys.push_back(key_scale * normal(generator));
    for (int64_t i = 0; i < kv_heads * tokens * dim; ++i)
        in.values.push_back(normal(generator));
    for (int64_t i = 0; i < query_heads * tokens * dim; ++i)
        in.queries.push_back(normal(generator));
    return in;
}

torch::Tensor tensor(const std::vector<double>& values, int64_t heads) {
    return torch::tensor(values, torch::kFloat64).view({heads, tokens, dim}).to(torch::kFloat32);
}

Rope test_rope() {
    return Rope(RopeLayout::half_split, rope_inverse_frequencies(dim, 10000.0, {}));
}

// R(p) x for the half-split layout, in float64.
std::vector<double> rotate(const std::vector<double>& x, double position) {
    const std::vector<float> frequencies = rope_inverse_frequencies(dim, 10000.0, {});
    std::vector<double> out(x.size());
    for (int64_t i = 0; i < dim / 2; ++i) {
        const double angle =
            position * static_cast<double>(frequencies[static_cast<std::size_t>(i)]);
        out[i] = x[i] * std::cos(angle) - x[i + dim / 2] * std::sin(angle);
        out[i + dim / 2] = x[i + dim / 2] * std::cos(angle) + x[i] * std::sin(angle);
    }
    return out;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
    return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
}

std::vector<double> row(const std::vector<double>& data, int64_t head, int64_t token) {
    const auto begin = data.begin() + (head * tokens + token) * dim;
    return {begin, begin + dim};
}

// Softmax over visible keys of query (qh, qt) (causal by position = index).
std::vector<double> attention_row(const Inputs& in, int64_t qh, int64_t qt) {
    std::vector<double> weights(tokens, 0.0);
    double best = -1e300, total = 0;
    for (int64_t j = 0; j <= qt; ++j) {
        weights[j] =
            dot(row(in.queries, qh, qt), row(in.keys, qh / group, j)) / std::sqrt(double(dim));
        best = std::max(best, weights[j]);
    }
    for (int64_t j = 0; j <= qt; ++j)
        total += (weights[j] = std::exp(weights[j] - best));
    for (int64_t j = 0; j <= qt; ++j)
        weights[j] /= total;
    return weights;
}

LayerEvidence evidence_for(const Inputs& in) {
    LayerEvidence evidence;
    evidence.keys = tensor(in.keys, kv_heads);
    evidence.values = tensor(in.values, kv_heads);
    evidence.positions = torch::arange(tokens, torch::kInt64);
    return evidence;
}

// The prefill as the model shows it to the recorder: two chunks, each with the keys so far.
LayerEvidence recorded_evidence(const CompressionSettings& settings, const Inputs& in) {
    const Rope rope = test_rope();
    QueryRecorder recorder(settings, rope, 1);
    const torch::Tensor queries = tensor(in.queries, query_heads);
    const torch::Tensor keys = tensor(in.keys, kv_heads);
    for (const auto& [begin, count] : {std::pair<int64_t, int64_t>{0, 5}, {5, tokens - 5}})
        recorder.observe(
            0, queries.narrow(1, begin, count), torch::arange(begin, begin + count, torch::kInt64),
            keys.narrow(1, 0, begin + count), torch::arange(begin + count, torch::kInt64));
    LayerEvidence evidence = evidence_for(in);
    recorder.fill(0, evidence);
    return evidence;
}

void check_scores(const torch::Tensor& got, const Grid& expected, double tolerance) {
    REQUIRE(got.size(0) == static_cast<int64_t>(expected.size()));
    const torch::Tensor scores = got.to(torch::kFloat64).contiguous();
    for (std::size_t h = 0; h < expected.size(); ++h) {
        REQUIRE(scores.size(1) == static_cast<int64_t>(expected[h].size()));
        for (std::size_t t = 0; t < expected[h].size(); ++t) {
            INFO("head " << h << ", token " << t);
            CHECK(scores[h][t].item<double>() ==
                  Approx(expected[h][t]).margin(tolerance).epsilon(tolerance));
        }
    }
}

Grid pad_top(Grid scores, int64_t before, int64_t after) {
    double top = -1e300;
    for (const auto& head : scores)
        for (double s : head)
            top = std::max(top, s);
    for (auto& head : scores) {
        head.insert(head.begin(), static_cast<std::size_t>(before), top + 1);
        head.insert(head.end(), static_cast<std::size_t>(after), top + 1);
    }
    return scores;
}

CompressionSettings settings_for(CompressionMethod method) {
    CompressionSettings settings;
    settings.method = method;
    settings.ratio = 0.5;
    return settings;
}

}  // namespace

TEST_CASE("knorm keeps the keys of smallest norm", "[compress]") {
    const Inputs in = random_inputs(1);
    Grid expected(kv_heads);
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t t = 0; t < tokens; ++t)
            expected[h].push_back(-std::sqrt(dot(row(in.keys, h, t), row(in.keys, h, t))));
    check_scores(
        score_tokens(settings_for(CompressionMethod::knorm), test_rope(), evidence_for(in), 0),
        expected, 1e-6);
}

TEST_CASE("cur scores by window-normalised key and value norms", "[compress]") {
    const Inputs in = random_inputs(2);
    CompressionSettings settings = settings_for(CompressionMethod::cur);
    settings.local_window = 5;  // windows 0-4, 5-9, 10-11 (padded)
    Grid expected(kv_heads);
    for (int64_t h = 0; h < kv_heads; ++h) {
        std::vector<double> k2(tokens), v2(tokens);
        for (int64_t t = 0; t < tokens; ++t) {
            k2[t] = dot(row(in.keys, h, t), row(in.keys, h, t));
            v2[t] = dot(row(in.values, h, t), row(in.values, h, t));
        }
        auto normalise = [&](std::vector<double>& x) {
            for (int64_t start = 0; start < tokens; start += 5) {
                double total = 0;
                for (int64_t t = start; t < std::min(tokens, start + 5); ++t)
                    total += x[t];
                for (int64_t t = start; t < std::min(tokens, start + 5); ++t)
                    x[t] /= total;
            }
        };
        normalise(k2);
        normalise(v2);
        double total = 0;
        for (int64_t t = 0; t < tokens; ++t)
            total += k2[t] * v2[t];
        for (int64_t t = 0; t < tokens; ++t)
            expected[h].push_back(t < 4 ? 1.0 : k2[t] * v2[t] / total);
    }
    check_scores(score_tokens(settings, test_rope(), evidence_for(in), 0), expected, 1e-6);
}

TEST_CASE("streaming keeps the sinks and the most recent tokens", "[compress]") {
    const Inputs in = random_inputs(3);
    CompressionSettings settings = settings_for(CompressionMethod::streaming);
    settings.ratio = -1;
    settings.keep_tokens = 7;
    Packet packet;
    packet.id = "p";
    packet.logical_length = tokens;
    CacheModelInfo model;
    model.num_layers = 1;
    model.num_kv_heads = kv_heads;
    model.head_dim = dim;
    model.dtype = CacheDtype::f32;
    for (int64_t t = 0; t < tokens; ++t) {
        packet.token_ids.push_back(static_cast<int32_t>(100 + t));
        packet.positions.push_back(t);
    }
    const torch::Tensor keys = tensor(in.keys, kv_heads).contiguous();
    const torch::Tensor values = tensor(in.values, kv_heads).contiguous();
    packet.keys.assign(static_cast<const std::byte*>(keys.data_ptr()),
                       static_cast<const std::byte*>(keys.data_ptr()) + keys.nbytes());
    packet.values.assign(static_cast<const std::byte*>(values.data_ptr()),
                         static_cast<const std::byte*>(values.data_ptr()) + values.nbytes());
    const Packet out = compress_packet(packet, model, test_rope(), settings, nullptr);
    CHECK_FALSE(out.ragged());  // every head chose alike: no per-head storage
    CHECK(out.positions == std::vector<int64_t>{0, 1, 2, 3, 9, 10, 11});
    CHECK(out.token_ids == std::vector<int32_t>{100, 101, 102, 103, 109, 110, 111});
    CHECK(out.logical_length == tokens);
}

TEST_CASE("random scores are seeded and uniform between 0 and 1", "[compress]") {
    const Inputs in = random_inputs(4);
    CompressionSettings settings = settings_for(CompressionMethod::random);
    const Rope rope = test_rope();
    const torch::Tensor a = score_tokens(settings, rope, evidence_for(in), 0);
    CHECK(torch::equal(a, score_tokens(settings, rope, evidence_for(in), 0)));
    CHECK_FALSE(torch::equal(a, score_tokens(settings, rope, evidence_for(in), 1)));
    settings.seed = 7;
    CHECK_FALSE(torch::equal(a, score_tokens(settings, rope, evidence_for(in), 0)));
    CHECK(a.min().item<double>() >= 0);
    CHECK(a.max().item<double>() < 1);
}

TEST_CASE("snapkv pools the last window's attention", "[compress]") {
    const Inputs in = random_inputs(5);
    CompressionSettings settings = settings_for(CompressionMethod::snapkv);
    settings.window_size = 4;
    settings.kernel_size = 3;
    const int64_t window = 4, scored = tokens - window;
    Grid per_query_head(query_heads, std::vector<double>(scored, 0.0));
    for (int64_t qh = 0; qh < query_heads; ++qh)
        for (int64_t qt = tokens - window; qt < tokens; ++qt) {
            const std::vector<double> weights = attention_row(in, qh, qt);
            for (int64_t j = 0; j < scored; ++j)
                per_query_head[qh][j] += weights[j] / window;
        }
    Grid expected(kv_heads, std::vector<double>(scored, 0.0));
    for (int64_t qh = 0; qh < query_heads; ++qh)
        for (int64_t j = 0; j < scored; ++j) {
            double pooled = 0;  // average pooling, kernel 3, zero padding, divided by 3
            for (int64_t o = -1; o <= 1; ++o)
                if (j + o >= 0 && j + o < scored) pooled += per_query_head[qh][j + o];
            expected[qh / group][j] += pooled / 3 / group;
        }
    check_scores(score_tokens(settings, test_rope(), recorded_evidence(settings, in), 0),
                 pad_top(expected, 0, window), 1e-5);
}

TEST_CASE("tova scores by the last query, averaged over every head", "[compress]") {
    const Inputs in = random_inputs(6);
    const CompressionSettings settings = settings_for(CompressionMethod::tova);
    std::vector<double> mean(tokens - 1, 0.0);
    for (int64_t qh = 0; qh < query_heads; ++qh) {
        const std::vector<double> weights = attention_row(in, qh, tokens - 1);
        for (int64_t j = 0; j < tokens - 1; ++j)
            mean[j] += weights[j] / query_heads;
    }
    check_scores(score_tokens(settings, test_rope(), recorded_evidence(settings, in), 0),
                 pad_top(Grid(kv_heads, mean), 0, 1), 1e-5);
}

TEST_CASE("observed averages the attention each key received", "[compress]") {
    const Inputs in = random_inputs(7);
    const CompressionSettings settings = settings_for(CompressionMethod::observed);
    Grid expected(kv_heads, std::vector<double>(tokens, 0.0));
    for (int64_t qh = 0; qh < query_heads; ++qh)
        for (int64_t qt = 0; qt < tokens; ++qt) {
            const std::vector<double> weights = attention_row(in, qh, qt);
            for (int64_t j = 0; j <= qt; ++j)
                expected[qh / group][j] += weights[j] / double(tokens - j) / group;
        }
    check_scores(score_tokens(settings, test_rope(), recorded_evidence(settings, in), 0), expected,
                 1e-5);
}

TEST_CASE("expected attention uses the rotated query moments", "[compress]") {
    const Inputs in = random_inputs(8);
    CompressionSettings settings = settings_for(CompressionMethod::expected);
    settings.sinks = 2;
    settings.future_positions = 6;
    // The recorder sees queries after RoPE; their moments are taken before it.
    std::vector<double> post_rope;
    for (int64_t qh = 0; qh < query_heads; ++qh)
        for (int64_t t = 0; t < tokens; ++t)
            for (double x : rotate(row(in.queries, qh, t), double(t)))
                post_rope.push_back(x);
    Inputs rotated_in = in;
    rotated_in.queries = post_rope;
    // R = mean over p in [12, 18) of R(p), as a matrix (column i = R e_i).
    std::vector<std::vector<double>> mean_rotation(dim, std::vector<double>(dim, 0.0));
    for (int64_t p = tokens; p < tokens + 6; ++p)
        for (int64_t i = 0; i < dim; ++i) {
            std::vector<double> basis(dim, 0.0);
            basis[i] = 1;
            const std::vector<double> image = rotate(basis, double(p));
            for (int64_t r = 0; r < dim; ++r)
                mean_rotation[r][i] += image[r] / 6;
        }
    Grid expected(kv_heads, std::vector<double>(tokens - 2, 0.0));
    for (int64_t qh = 0; qh < query_heads; ++qh) {
        std::vector<double> mu(dim, 0.0);
        std::vector<std::vector<double>> sigma(dim, std::vector<double>(dim, 0.0));
        const double n = tokens - 2;
        for (int64_t t = 2; t < tokens; ++t)
            for (int64_t d = 0; d < dim; ++d)
                mu[d] += in.query(qh, t, d) / n;
        for (int64_t t = 2; t < tokens; ++t)
            for (int64_t a = 0; a < dim; ++a)
                for (int64_t b = 0; b < dim; ++b)
                    sigma[a][b] += (in.query(qh, t, a) - mu[a]) * (in.query(qh, t, b) - mu[b]) / n;
        std::vector<double> mu_r(dim, 0.0);
        std::vector<std::vector<double>> sigma_r(dim, std::vector<double>(dim, 0.0));
        for (int64_t a = 0; a < dim; ++a)
            for (int64_t b = 0; b < dim; ++b)
                mu_r[a] += mean_rotation[a][b] * mu[b];
        for (int64_t a = 0; a < dim; ++a)
            for (int64_t b = 0; b < dim; ++b)
                for (int64_t c = 0; c < dim; ++c)
                    for (int64_t e = 0; e < dim; ++e)
                        sigma_r[a][b] += mean_rotation[a][c] * sigma[c][e] * mean_rotation[b][e];
        std::vector<double> logits;
        for (int64_t t = 2; t < tokens; ++t) {
            const std::vector<double> k = row(in.keys, qh / group, t);
            double quadratic = 0;
            for (int64_t a = 0; a < dim; ++a)
                for (int64_t b = 0; b < dim; ++b)
                    quadratic += k[a] * sigma_r[a][b] * k[b];
            logits.push_back(dot(k, mu_r) / std::sqrt(double(dim)) + quadratic / dim / 2);
        }
        const double best = *std::max_element(logits.begin(), logits.end());
        double total = 0;
        for (double& l : logits)
            total += (l = std::exp(l - best));
        for (int64_t t = 2; t < tokens; ++t)
            expected[qh / group][t - 2] += logits[t - 2] / total / group;
    }
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t t = 2; t < tokens; ++t)
            expected[h][t - 2] *= std::sqrt(dot(row(in.values, h, t), row(in.values, h, t)));
    check_scores(score_tokens(settings, test_rope(), recorded_evidence(settings, rotated_in), 0),
                 pad_top(expected, 2, 0), 1e-5);
}

TEST_CASE("leverage scores are the hat-matrix diagonal of the centred pre-RoPE keys",
          "[compress]") {
    // With a sketch wider than the keys, X = K Phi spans K's columns and the sketched leverage
    // is the exact one (up to kvpress's 1e-2 jitter, made negligible by large keys).
    const Inputs in = random_inputs(9, 30.0);
    CompressionSettings settings = settings_for(CompressionMethod::leverage);
    settings.sketch_dimension = 8;
    std::vector<double> all;
    for (int64_t h = 0; h < kv_heads; ++h) {
        // Keys stored after RoPE at position t: rotating back gives in.keys, so store rotated.
        std::vector<double> mean(dim, 0.0);
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t d = 0; d < dim; ++d)
                mean[d] += in.key(h, t, d) / tokens;
        std::vector<std::vector<double>> x(tokens, std::vector<double>(dim));
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t d = 0; d < dim; ++d)
                x[t][d] = in.key(h, t, d) - mean[d];
        // Gram matrix and its inverse by Gauss-Jordan.
        std::vector<std::vector<double>> gram(dim, std::vector<double>(2 * dim, 0.0));
        for (int64_t a = 0; a < dim; ++a) {
            for (int64_t b = 0; b < dim; ++b)
                for (int64_t t = 0; t < tokens; ++t)
                    gram[a][b] += x[t][a] * x[t][b];
            gram[a][dim + a] = 1;
        }
        for (int64_t c = 0; c < dim; ++c) {
            const double pivot = gram[c][c];
            for (double& v : gram[c])
                v /= pivot;
            for (int64_t r = 0; r < dim; ++r)
                if (r != c) {
                    const double f = gram[r][c];
                    for (int64_t k = 0; k < 2 * dim; ++k)
                        gram[r][k] -= f * gram[c][k];
                }
        }
        for (int64_t t = 0; t < tokens; ++t) {
            double h_tt = 0;
            for (int64_t a = 0; a < dim; ++a)
                for (int64_t b = 0; b < dim; ++b)
                    h_tt += x[t][a] * gram[a][dim + b] * x[t][b];
            all.push_back(h_tt);
        }
    }
    const double mean = std::accumulate(all.begin(), all.end(), 0.0) / double(all.size());
    double variance = 0;
    for (double v : all)
        variance += (v - mean) * (v - mean) / double(all.size() - 1);
    Grid expected(kv_heads);
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t t = 0; t < tokens; ++t)
            expected[h].push_back((all[h * tokens + t] - mean) / std::sqrt(variance));
    std::vector<double> stored;
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t t = 0; t < tokens; ++t)
            for (double v : rotate(row(in.keys, h, t), double(t)))
                stored.push_back(v);
    LayerEvidence evidence = evidence_for(in);
    evidence.keys = tensor(stored, kv_heads);
    check_scores(score_tokens(settings, test_rope(), evidence, 0), expected, 2e-3);
}

namespace {

CacheModelInfo small_model_info() {
    CacheModelInfo model;
    model.model_fingerprint = std::string(64, 'a');
    model.architecture = "LlamaForCausalLM";
    model.num_layers = 2;
    model.num_kv_heads = kv_heads;
    model.head_dim = dim;
    model.rope_layout = "half_split";
    model.rope_theta = 10000;
    model.tokenizer_fingerprint = std::string(64, 'b');
    model.dtype = CacheDtype::f32;
    return model;
}

// A packet of `tokens` tokens whose keys have norm (token + 1) * (plane + 1) in plane 0 and the
// reverse order elsewhere, so that knorm keeps different tokens per head.
Packet norm_ordered_packet(const std::string& id, int64_t header = 0, int64_t trailer = 0) {
    Packet packet;
    packet.id = id;
    packet.text_sha256 = std::string(64, 'c');
    packet.logical_length = tokens;
    packet.header_tokens = header;
    packet.trailer_tokens = trailer;
    for (int64_t t = 0; t < tokens; ++t) {
        const bool adapter = t < header || t >= tokens - trailer;
        packet.token_ids.push_back(adapter ? -1 : static_cast<int32_t>(t + 1));
        packet.positions.push_back(t);
    }
    std::vector<float> keys, values;
    for (int64_t plane = 0; plane < 2 * kv_heads; ++plane)
        for (int64_t t = 0; t < tokens; ++t) {
            const double norm = plane == 0 ? t + 1 : tokens - t;
            const double scale =
                (header + trailer > 0 && (t < header || t >= tokens - trailer)) ? 100 : 1;
            for (int64_t d = 0; d < dim; ++d) {
                keys.push_back(static_cast<float>(norm * scale / 2));  // |k| = norm * scale
                values.push_back(static_cast<float>(plane * 1000 + t));
            }
        }
    auto bytes = [](const std::vector<float>& x) {
        const auto* p = reinterpret_cast<const std::byte*>(x.data());
        return std::vector<std::byte>(p, p + x.size() * sizeof(float));
    };
    packet.keys = bytes(keys);
    packet.values = bytes(values);
    return packet;
}

float value_at(const Packet& packet, int64_t plane, int64_t slot) {
    float v;
    std::memcpy(&v, packet.values.data() + (plane * packet.stored_length() + slot) * dim * 4, 4);
    return v;
}

}  // namespace

TEST_CASE("each head keeps its own tokens, stored per head and read back", "[compress]") {
    const CacheModelInfo model = small_model_info();
    CompressionSettings settings = settings_for(CompressionMethod::knorm);
    settings.ratio = 0.5;
    const Packet out =
        compress_packet(norm_ordered_packet("p"), model, test_rope(), settings, nullptr);
    REQUIRE(out.ragged());
    CHECK_FALSE(out.padded());
    CHECK(out.stored_length() == 6);
    CHECK(out.logical_length == tokens);
    // Plane 0 keeps the six smallest norms (tokens 0-5); the others the six last tokens.
    for (int64_t plane = 0; plane < 4; ++plane)
        for (int64_t slot = 0; slot < 6; ++slot) {
            const int64_t token = plane == 0 ? slot : 6 + slot;
            CHECK(out.head_positions[static_cast<std::size_t>(plane * 6 + slot)] == token);
            CHECK(value_at(out, plane, slot) == static_cast<float>(plane * 1000 + token));
        }
    // Each slot at the largest position a head keeps there, with that token.
    CHECK(out.positions == std::vector<int64_t>{6, 7, 8, 9, 10, 11});
    CHECK(out.token_ids == std::vector<int32_t>{7, 8, 9, 10, 11, 12});

    test::TempDir dir;
    const auto path = dir.path() / "ragged.kvc";
    {
        CacheWriter writer(path, model, {"test", "0", "test", ""});
        writer.add(out);
        writer.add(norm_ordered_packet("plain"));
        writer.finish();
    }
    const CacheReader reader(path);
    CHECK(reader.format_version() == "1.7");  // 1.2 for per-head tokens; tensor_layout
    const Packet back = reader.read("p");
    CHECK(back.head_lengths == out.head_lengths);
    CHECK(back.head_positions == out.head_positions);
    CHECK(back.keys == out.keys);
    CHECK_FALSE(reader.read("plain").ragged());
}

TEST_CASE("with --keep-adapters header and trailer tokens are never pruned", "[compress]") {
    const CacheModelInfo model = small_model_info();
    CompressionSettings settings = settings_for(CompressionMethod::knorm);
    settings.keep_tokens = 5;
    settings.ratio = -1;
    const Packet wrapped = norm_ordered_packet("w", 2, 1);  // adapters have huge norms
    const Packet pruned = compress_packet(wrapped, model, test_rope(), settings, nullptr);
    settings.keep_adapters = true;
    const Packet kept = compress_packet(wrapped, model, test_rope(), settings, nullptr);
    for (int64_t plane = 0; plane < 4; ++plane) {
        auto has = [&](const Packet& p, int64_t position) {
            const auto begin = p.head_positions.begin() + plane * 5;
            return std::find(begin, begin + 5, position) != begin + 5;
        };
        CHECK(has(kept, 0));
        CHECK(has(kept, 1));
        CHECK(has(kept, tokens - 1));
        CHECK_FALSE((has(pruned, 0) && has(pruned, 1) && has(pruned, tokens - 1)));
    }
}

TEST_CASE("padding slots of a head are never attended to", "[compress]") {
    // Head 0 uses 3 slots, head 1 all 5: attention must equal attention over the used ones.
    torch::manual_seed(3);
    const torch::Tensor k = torch::randn({2, 5, dim}, torch::kFloat32);
    const torch::Tensor v = torch::randn({2, 5, dim}, torch::kFloat32);
    const torch::Tensor q = torch::randn({4, 1, dim}, torch::kFloat32);
    torch::Tensor valid = torch::ones({2, 5}, torch::kBool);
    valid[0].narrow(0, 3, 2).fill_(false);
    const AttentionMask mask{
        torch::full({1}, 9, torch::kInt64), torch::arange(5, torch::kInt64), 0, {}, valid};
    const torch::Tensor got = attention(q, k, v, mask, 0.5);
    for (int64_t qh = 0; qh < 4; ++qh) {
        const int64_t h = qh / 2, used = h == 0 ? 3 : 5;
        const torch::Tensor scores =
            torch::softmax(torch::matmul(k[h].narrow(0, 0, used).to(torch::kFloat64),
                                         q[qh][0].to(torch::kFloat64)) *
                               0.5,
                           0);
        const torch::Tensor expected =
            torch::matmul(scores, v[h].narrow(0, 0, used).to(torch::kFloat64));
        CHECK(torch::allclose(got[qh][0].to(torch::kFloat64), expected, 1e-5, 1e-6));
    }

    // The cache tracks padding once a padded packet arrives, and new tokens are real.
    KvCache cache(1, 2, dim, torch::kFloat32, torch::kCPU, 4);
    cache.append({k}, {v}, torch::arange(5, torch::kInt64), {torch::tensor({3, 5}, torch::kInt64)});
    REQUIRE(cache.has_padding());
    CHECK(torch::equal(cache.key_valid(0), valid));
    cache.append({k.narrow(1, 0, 1)}, {v.narrow(1, 0, 1)}, torch::full({1}, 10, torch::kInt64));
    CHECK(cache.key_valid(0).narrow(1, 5, 1).all().item<bool>());

    // Cleared for the next sequence (kvserve-once --requests), it keeps its memory and forgets
    // the padding, the tokens and the positions: unpadded tokens are whole again.
    const int64_t capacity = cache.capacity();
    const void* memory = cache.keys(0).data_ptr();
    cache.clear();
    CHECK(cache.length() == 0);
    CHECK(cache.next_position() == 0);
    CHECK_FALSE(cache.has_padding());
    cache.append({k}, {v}, torch::arange(5, torch::kInt64));
    CHECK_FALSE(cache.has_padding());
    CHECK(cache.capacity() == capacity);
    CHECK(cache.keys(0).data_ptr() == memory);
    CHECK(torch::equal(cache.keys(0), k));
    CHECK(torch::equal(cache.values(0), v));
    CHECK(torch::equal(cache.positions(), torch::arange(5, torch::kInt64)));
    CHECK(cache.next_position() == 5);
}

TEST_CASE("packing per-head packets concatenates each head's tokens", "[compress]") {
    const CacheModelInfo model = small_model_info();
    CompressionSettings settings = settings_for(CompressionMethod::knorm);
    const Packet a =
        compress_packet(norm_ordered_packet("a"), model, test_rope(), settings, nullptr);
    const Packet plain = norm_ordered_packet("b");
    const Packet context = pack_packets({a, plain}, model, "context");
    REQUIRE(context.ragged());
    CHECK(context.logical_length == 2 * tokens);
    CHECK(context.stored_length() == 6 + tokens);
    for (int64_t plane = 0; plane < 4; ++plane) {
        CHECK(context.head_lengths[static_cast<std::size_t>(plane)] == 6 + tokens);
        for (int64_t slot = 0; slot < 6 + tokens; ++slot) {
            const int64_t expected =
                slot < 6 ? a.head_positions[static_cast<std::size_t>(plane * 6 + slot)]
                         : tokens + (slot - 6);
            CHECK(context.head_positions[static_cast<std::size_t>(plane * (6 + tokens) + slot)] ==
                  expected);
        }
    }
    // The same keys as appending the packets one after another to a runtime cache.
    const Rope rope = test_rope();
    KvCache cache(2, kv_heads, dim, torch::kFloat32, torch::kCPU);
    append_packet(rope, cache, a, CacheDtype::f32);
    append_packet(rope, cache, plain, CacheDtype::f32);
    const torch::Tensor packed = packet_tensor(context, true, 2, kv_heads, dim, CacheDtype::f32);
    for (int64_t layer = 0; layer < 2; ++layer)
        CHECK(torch::allclose(packed[layer], cache.keys(layer), 1e-5, 1e-6));
    CHECK(cache.next_position() == 2 * tokens);
}
