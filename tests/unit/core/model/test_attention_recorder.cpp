// The attention kvinspect plot draws: softmax(q k / sqrt(D)) with grouped-query heads and the
// causal rule by position, averaged over query heads and tokens, against float64 loops.
#include "kv/model/attention_recorder.hpp"

#include <catch2/catch.hpp>

#include <cmath>

using namespace kv;

TEST_CASE("the recorded attention is the mean softmax over heads and prompt tokens", "[plot]") {
    torch::manual_seed(3);
    const int64_t query_heads = 4, kv_heads = 2, tokens = 3, keys_count = 7, dim = 5;
    const torch::Tensor queries = torch::randn({query_heads, tokens, dim});
    const torch::Tensor keys = torch::randn({kv_heads, keys_count, dim});
    // Keys at positions 0..6, the prompt at 4, 5, 6: the first prompt token sees five keys.
    const torch::Tensor key_positions = torch::arange(keys_count, torch::kInt64);
    const torch::Tensor positions = torch::tensor({4, 5, 6}, torch::kInt64);
    AttentionRecorder recorder(2);
    recorder.observe(1, queries, positions, keys, key_positions);
    CHECK(recorder.weights()[0].empty());
    const std::vector<double>& got = recorder.weights()[1];
    REQUIRE(got.size() == static_cast<std::size_t>(keys_count));

    std::vector<double> expected(keys_count, 0.0);
    for (int64_t h = 0; h < query_heads; ++h) {
        const int64_t kv = h / (query_heads / kv_heads);
        for (int64_t t = 0; t < tokens; ++t) {
            std::vector<double> scores;
            double largest = -INFINITY;
            for (int64_t s = 0; s < keys_count; ++s) {
                double dot = 0;
                for (int64_t d = 0; d < dim; ++d)
                    dot += queries[h][t][d].item<double>() * keys[kv][s][d].item<double>();
                const bool visible = s <= positions[t].item<int64_t>();
                scores.push_back(visible ? dot / std::sqrt(static_cast<double>(dim)) : -INFINITY);
                largest = std::max(largest, scores.back());
            }
            double total = 0;
            for (double& score : scores)
                total += (score = std::exp(score - largest));
            for (int64_t s = 0; s < keys_count; ++s)
                expected[s] += scores[s] / total / static_cast<double>(query_heads * tokens);
        }
    }
    double sum = 0;
    for (int64_t s = 0; s < keys_count; ++s) {
        CHECK(got[s] == Approx(expected[s]).margin(1e-6));
        sum += got[s];
    }
    CHECK(sum == Approx(1.0).margin(1e-5));
}
