// Sparse decoding: the budget split, attention over chosen rows against the float64 reference,
// each method's choice against brute force, and IceCache over a packed (rotated) index.
#include "kv/error.hpp"
#include "kv/index/dci.hpp"
#include "kv/model/model.hpp"
#include "kv/model/ops.hpp"
#include "kv/model/sparse.hpp"
#include "random_model.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <set>

using namespace kv;

namespace {

constexpr int64_t kv_heads = 2, query_heads = 4, dim = 16;

ModelConfig sparse_config(int64_t layers) {
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    config.num_layers = layers;
    config.num_heads = query_heads;
    config.num_kv_heads = kv_heads;
    config.head_dim = dim;
    return config;
}

// Clustered keys [Hkv, S, D]: a query near one cluster has a few clear winners.
torch::Tensor clustered_keys(int64_t tokens, uint64_t seed) {
    torch::manual_seed(seed);
    const torch::Tensor centres = torch::randn({kv_heads, 24, dim}) * 2.0;
    const torch::Tensor which = torch::randint(0, 24, {tokens});
    return centres.index_select(1, which) + 0.5 * torch::randn({kv_heads, tokens, dim});
}

void check_shape_of_choice(const std::vector<std::vector<int64_t>>& rows, int64_t total,
                           const BudgetSplit& split) {
    REQUIRE(static_cast<int64_t>(rows.size()) == kv_heads);
    for (const auto& chosen : rows) {
        REQUIRE(std::is_sorted(chosen.begin(), chosen.end()));
        REQUIRE(std::adjacent_find(chosen.begin(), chosen.end()) == chosen.end());
        REQUIRE(chosen.front() >= 0);
        REQUIRE(chosen.back() < total);
        const std::set<int64_t> set(chosen.begin(), chosen.end());
        for (int64_t r = 0; r < split.sink; ++r)
            REQUIRE(set.count(r));
        for (int64_t r = total - split.window; r < total; ++r)
            REQUIRE(set.count(r));
    }
}

}  // namespace

TEST_CASE("a budget splits into sink, window and retrieved pages", "[sparse]") {
    CHECK(split_budget(64, 16).sink == 16);
    CHECK(split_budget(64, 16).window == 16);
    CHECK(split_budget(64, 16).retrieved == 32);
    CHECK(split_budget(128, 16).sink == 32);
    CHECK(split_budget(128, 16).retrieved == 64);
    CHECK(split_budget(256, 16).retrieved == 192);  // IceCache's 12 pages
    CHECK_THROWS_AS(parse_sparse_method("dense"), UsageError);
    CHECK(parse_sparse_method("icecache") == SparseMethod::icecache);
}

TEST_CASE("attention over chosen rows matches the float64 reference", "[sparse]") {
    torch::manual_seed(3);
    const int64_t tokens = 50;
    const torch::Tensor q = torch::randn({query_heads, 1, dim});
    const torch::Tensor k = torch::randn({kv_heads, tokens, dim});
    const torch::Tensor v = torch::randn({kv_heads, tokens, dim});
    const std::vector<std::vector<int64_t>> rows = {{0, 3, 4, 17, 49}, {1, 2, 30, 31, 40, 41, 49}};
    const double scale = 0.25;
    const torch::Tensor got = attention_over_rows(q, k, v, rows, scale);
    for (int64_t h = 0; h < query_heads; ++h) {
        const int64_t head = h / (query_heads / kv_heads);
        const auto& chosen = rows[static_cast<std::size_t>(head)];
        std::vector<double> weights;
        double total = 0, best = -1e300;
        for (int64_t r : chosen) {
            double score = 0;
            for (int64_t d = 0; d < dim; ++d)
                score += q[h][0][d].item<double>() * k[head][r][d].item<double>();
            weights.push_back(score * scale);
            best = std::max(best, score * scale);
        }
        for (double& w : weights)
            total += (w = std::exp(w - best));
        for (int64_t d = 0; d < dim; ++d) {
            double expected = 0;
            for (std::size_t i = 0; i < chosen.size(); ++i)
                expected += weights[i] / total * v[head][chosen[i]][d].item<double>();
            CHECK(got[h][0][d].item<double>() == Approx(expected).margin(1e-5));
        }
    }
    // All rows: the same as full attention.
    std::vector<std::vector<int64_t>> all(kv_heads);
    for (auto& chosen : all)
        for (int64_t r = 0; r < tokens; ++r)
            chosen.push_back(r);
    const AttentionMask mask{torch::tensor(std::vector<int64_t>{tokens - 1}),
                             torch::arange(tokens, torch::kInt64),
                             0,
                             {},
                             {}};
    CHECK(torch::allclose(attention_over_rows(q, k, v, all, scale), attention(q, k, v, mask, scale),
                          1e-5, 1e-5));
}

TEST_CASE("each method chooses what it promises", "[sparse]") {
    const ModelConfig config = sparse_config(1);
    const Rope rope(config);
    const int64_t total = 600;
    const torch::Tensor keys = clustered_keys(total, 4);
    torch::manual_seed(5);
    const torch::Tensor queries = torch::randn({query_heads, 1, dim});
    SparseOptions options;
    options.budget = 64;
    options.dense_layers = 0;
    const BudgetSplit split = split_budget(64, 16);
    std::vector<std::vector<int64_t>> rows;

    SECTION("full and a budget the context fits attend to everything") {
        options.method = SparseMethod::full;
        CHECK_FALSE(SparseAttention(config, rope, options).select(0, queries, keys, rows));
        options.method = SparseMethod::icecache;
        options.budget = total;
        CHECK_FALSE(SparseAttention(config, rope, options).select(0, queries, keys, rows));
    }
    SECTION("streaming keeps the sink and the most recent tokens") {
        options.method = SparseMethod::streaming;
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, keys, rows));
        check_shape_of_choice(rows, total, split);
        for (const auto& chosen : rows) {
            CHECK(chosen.size() == 64);
            CHECK(chosen[16] == total - 48);
        }
    }
    SECTION("the top-k oracle takes each query head's best tokens exactly") {
        options.method = SparseMethod::topk;
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, keys, rows));
        check_shape_of_choice(rows, total, split);
        for (int64_t h = 0; h < query_heads; ++h) {
            const int64_t head = h / 2;
            std::vector<std::pair<double, int64_t>> scored;
            for (int64_t r = split.sink; r < total - split.window; ++r)
                scored.emplace_back(-(queries[h][0] * keys[head][r]).sum().item<double>(), r);
            std::sort(scored.begin(), scored.end());
            const std::set<int64_t> chosen(rows[static_cast<std::size_t>(head)].begin(),
                                           rows[static_cast<std::size_t>(head)].end());
            for (int64_t i = 0; i < split.retrieved; ++i)
                CHECK(chosen.count(scored[static_cast<std::size_t>(i)].second));
        }
    }
    SECTION("quest and h2o stay within their budgets") {
        for (SparseMethod method : {SparseMethod::quest, SparseMethod::h2o}) {
            options.method = method;
            SparseAttention sparse(config, rope, options);
            REQUIRE(sparse.select(0, queries, keys, rows));
            for (const auto& chosen : rows)
                CHECK(static_cast<int64_t>(chosen.size()) <=
                      (method == SparseMethod::h2o
                           ? 64
                           : split.sink + split.window + 2 * split.retrieved));
        }
    }
    SECTION("icecache, searching exhaustively, finds each query head's best token") {
        options.method = SparseMethod::icecache;
        options.field_of_view = total;
        options.retrieve_share = 1.0;
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, keys, rows));
        check_shape_of_choice(rows, total, split);
        for (int64_t h = 0; h < query_heads; ++h) {
            const int64_t head = h / 2;
            const torch::Tensor scores =
                (queries[h][0].unsqueeze(0) * keys[head].narrow(0, 0, total - split.window)).sum(1);
            const int64_t best = scores.argmax().item<int64_t>();
            const auto& chosen = rows[static_cast<std::size_t>(head)];
            CHECK(std::binary_search(chosen.begin(), chosen.end(), best));
        }
        CHECK(sparse.stats().index_dot_products > 0);
        // A later step inserts the token that left the window, and still works.
        const torch::Tensor longer = torch::cat({keys, clustered_keys(1, 9)}, 1);
        REQUIRE(sparse.select(0, queries, longer, rows));
        check_shape_of_choice(rows, total + 1, split);
        CHECK(sparse.stats().indexed_tokens == (total - split.window + 1) * kv_heads);
    }
}

TEST_CASE("a packed index, its keys rotated, still finds the best tokens", "[sparse]") {
    // kvindex indexed the keys at positions from 0; kvpack then rotated them by delta. The
    // index is used as stored, with queries rotated back.
    const ModelConfig config = sparse_config(1);
    const Rope rope(config);
    const int64_t total = 500, delta = 777;
    const torch::Tensor original = clustered_keys(total, 6);
    PacketIndex index;
    index.projection = dci_projection(dim, 1);
    index.segments = {{0, total, delta}};
    for (int64_t head = 0; head < kv_heads; ++head) {
        DciIndex built(dim, index.projection);
        const torch::Tensor k = original[head].contiguous();
        built.build(k.data_ptr<float>(), total);
        index.layouts.push_back(built.layout());
    }
    const torch::Tensor rotated = rope.shift(original, delta);
    torch::manual_seed(8);
    const torch::Tensor queries = torch::randn({query_heads, 1, dim});
    SparseOptions options;
    options.method = SparseMethod::icecache;
    options.budget = 64;
    options.dense_layers = 0;
    options.field_of_view = total;
    options.retrieve_share = 1.0;
    SparseAttention sparse(config, rope, options);
    sparse.add_stored_index(0, 0, index);
    std::vector<std::vector<int64_t>> rows;
    REQUIRE(sparse.select(0, queries, rotated, rows));
    CHECK(sparse.stats().indexed_tokens == 0);  // nothing rebuilt: the stored index served
    for (int64_t h = 0; h < query_heads; ++h) {
        const int64_t head = h / 2;
        const torch::Tensor scores =
            (queries[h][0].unsqueeze(0) * rotated[head].narrow(0, 0, total - 16)).sum(1);
        const auto& chosen = rows[static_cast<std::size_t>(head)];
        CHECK(std::binary_search(chosen.begin(), chosen.end(), scores.argmax().item<int64_t>()));
    }
}

TEST_CASE("indexes built by the worker during a layer-by-layer prefill choose as prepare()'s",
          "[sparse]") {
    // kvserve-once --document on an accelerator: the worker indexes each layer as the prefill
    // finishes it. Its indexes must be the ones prepare() builds from the finished cache.
    ModelConfig config = sparse_config(4);
    testing::TwinModel twin = testing::make_random_model(config, 11);
    auto model = Model::from_weights(std::move(twin.weights), torch::kFloat32, torch::kCPU);
    torch::NoGradGuard no_grad;
    std::vector<int32_t> ids;
    for (int i = 0; i < 700; ++i)
        ids.push_back(static_cast<int32_t>((i * 37 + i / 5) % config.vocab_size));
    SparseOptions options;
    options.method = SparseMethod::icecache;
    options.budget = 64;
    options.dense_layers = 1;

    KvCache cache = model->new_cache();
    SparseAttention by_worker(config, model->rope(), options);
    std::vector<int64_t> queued;
    {
        IndexWorker worker(by_worker, cache);
        model->prefill_by_layer(ids, cache, 128, [&](int64_t layer) {
            queued.push_back(layer);
            worker.layer_done(layer);
        });
        worker.finish();
    }
    CHECK(queued == std::vector<int64_t>{0, 1, 2, 3});
    SparseAttention after(config, model->rope(), options);
    after.prepare(cache);
    // Every row outside the 16-token window, in 3 sparse layers, for each kv head.
    CHECK(by_worker.stats().indexed_tokens == (700 - 16) * 3 * kv_heads);
    CHECK(after.stats().indexed_tokens == by_worker.stats().indexed_tokens);

    torch::manual_seed(12);
    for (int64_t layer = 1; layer < 4; ++layer) {
        const torch::Tensor queries = torch::randn({query_heads, 1, dim});
        std::vector<std::vector<int64_t>> chosen_by_worker, chosen_after;
        REQUIRE(by_worker.select(layer, queries, cache.keys(layer), chosen_by_worker));
        REQUIRE(after.select(layer, queries, cache.keys(layer), chosen_after));
        CHECK(chosen_by_worker == chosen_after);
        check_shape_of_choice(chosen_by_worker, 700, split_budget(64, 16));
    }
}
