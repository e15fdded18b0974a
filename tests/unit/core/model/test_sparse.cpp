// Sparse decoding: the budget split, attention over chosen rows against the float64 reference,
// each method's choice against brute force, and IceCache over a packed (rotated) index.
#include "kv/error.hpp"
#include "kv/index/dci.hpp"
#include "kv/model/kv_cache.hpp"
#include "kv/model/model.hpp"
#include "kv/model/ops.hpp"
#include "kv/model/row_attention.hpp"
#include "kv/sparse/sparse_attention.hpp"
#include "random_model.hpp"
#include "test_support.hpp"

#include <ATen/Parallel.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
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

// Sorted rows: sink, window and `extra`.
std::vector<int64_t> with_resident(std::set<int64_t> extra, int64_t total,
                                   const BudgetSplit& split) {
    for (int64_t r = 0; r < split.sink; ++r)
        extra.insert(r);
    for (int64_t r = total - split.window; r < total; ++r)
        extra.insert(r);
    return {extra.begin(), extra.end()};
}

// IceCache's rule for grouped queries, written plainly: the query heads' rankings (best first)
// interleaved rank by rank, the first `count` distinct entries kept.
std::vector<int64_t> first_distinct(const std::vector<std::vector<int64_t>>& rankings,
                                    int64_t count) {
    std::vector<int64_t> kept;
    for (std::size_t rank = 0;; ++rank) {
        bool more = false;
        for (const auto& ranking : rankings) {
            if (rank >= ranking.size()) continue;
            more = true;
            if (static_cast<int64_t>(kept.size()) < count &&
                std::find(kept.begin(), kept.end(), ranking[rank]) == kept.end())
                kept.push_back(ranking[rank]);
        }
        if (!more) return kept;
    }
}

// A cache holding `keys` [Hkv, S, D] (values zero) in one layer, as a decoding step reads it.
KvCache cache_holding(const torch::Tensor& keys) {
    KvCache cache(1, kv_heads, dim, keys.scalar_type(), torch::kCPU, keys.size(1));
    cache.append({keys}, {torch::zeros_like(keys)}, torch::arange(keys.size(1), torch::kInt64));
    return cache;
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
    CHECK_THROWS_AS(check_sparse_method("dense"), UsageError);
    CHECK_NOTHROW(check_sparse_method("icecache"));
    CHECK(sparse_methods().front().name == "full");
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
        options.method = "full";
        CHECK_FALSE(
            SparseAttention(config, rope, options).select(0, queries, cache_holding(keys), rows));
        options.method = "icecache";
        options.budget = total;
        CHECK_FALSE(
            SparseAttention(config, rope, options).select(0, queries, cache_holding(keys), rows));
    }
    SECTION("streaming keeps the sink and the most recent tokens") {
        options.method = "streaming";
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, cache_holding(keys), rows));
        check_shape_of_choice(rows, total, split);
        for (const auto& chosen : rows) {
            CHECK(chosen.size() == 64);
            CHECK(chosen[16] == total - 48);
        }
    }
    SECTION("the top-k oracle takes its query heads' best rows, interleaved, to the budget") {
        options.method = "topk";
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, cache_holding(keys), rows));
        check_shape_of_choice(rows, total, split);
        for (int64_t head = 0; head < kv_heads; ++head) {
            std::vector<std::vector<int64_t>> rankings;
            for (int64_t h = head * 2; h < head * 2 + 2; ++h) {
                std::vector<std::pair<double, int64_t>> scored;
                for (int64_t r = split.sink; r < total - split.window; ++r)
                    scored.emplace_back(-(queries[h][0] * keys[head][r]).sum().item<double>(), r);
                std::sort(scored.begin(), scored.end());
                rankings.emplace_back();
                for (int64_t i = 0; i < split.retrieved; ++i)
                    rankings.back().push_back(scored[static_cast<std::size_t>(i)].second);
            }
            const std::vector<int64_t> best = first_distinct(rankings, split.retrieved);
            CHECK(static_cast<int64_t>(best.size()) == split.retrieved);
            CHECK(rows[static_cast<std::size_t>(head)] ==
                  with_resident({best.begin(), best.end()}, total, split));
        }
    }
    SECTION("quest and h2o stay within their budgets") {
        for (const char* method : {"quest", "h2o"}) {
            options.method = method;
            SparseAttention sparse(config, rope, options);
            REQUIRE(sparse.select(0, queries, cache_holding(keys), rows));
            for (const auto& chosen : rows)
                CHECK(static_cast<int64_t>(chosen.size()) <= 64);
        }
    }
    SECTION("icecache, searching exhaustively, finds each query head's best token") {
        options.method = "icecache";
        options.field_of_view = total;
        options.retrieve_share = 1.0;
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, cache_holding(keys), rows));
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
        REQUIRE(sparse.select(0, queries, cache_holding(longer), rows));
        check_shape_of_choice(rows, total + 1, split);
        // Every row between the sink (always resident, never indexed) and the window.
        CHECK(sparse.stats().indexed_tokens == (total - split.sink - split.window + 1) * kv_heads);
    }
}

namespace {

// The float64 scores q.k of every query head [Hq, S] against its kv head's keys [Hkv, S, D].
torch::Tensor reference_scores(const torch::Tensor& queries, const torch::Tensor& keys) {
    const torch::Tensor q = queries.reshape({query_heads, dim}).to(torch::kFloat64);
    const torch::Tensor k = keys.to(torch::kFloat64).repeat_interleave(query_heads / kv_heads, 0);
    return (q.unsqueeze(1) * k).sum(2);
}

}  // namespace

TEST_CASE("topk quest h2o and attention recall match float64 references over many key chunks",
          "[sparse]") {
    // 9,000 rows: the methods read keys 4,096 rows at a time, so every choice crosses chunks.
    const ModelConfig config = sparse_config(1);
    const Rope rope(config);
    const int64_t total = 9000, budget = 128;
    const torch::Tensor keys = clustered_keys(total + 1, 21);
    const torch::Tensor first_keys = keys.narrow(1, 0, total);
    torch::manual_seed(22);
    const torch::Tensor queries = torch::randn({query_heads, 1, dim});
    const torch::Tensor scores = reference_scores(queries, first_keys);
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    SparseOptions options;
    options.budget = budget;
    options.dense_layers = 0;
    options.measure_recall = true;
    const BudgetSplit split = split_budget(budget, 16);
    const int64_t window_start = total - split.window;
    std::vector<std::vector<int64_t>> rows;

    SECTION("topk: the query heads' best rows interleaved, and the recall of what it chose") {
        options.method = "topk";
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, cache_holding(first_keys), rows));
        double recall = 0;
        for (int64_t head = 0; head < kv_heads; ++head) {
            std::vector<std::vector<int64_t>> rankings;
            for (int64_t member = 0; member < 2; ++member) {
                const torch::Tensor middle =
                    scores[head * 2 + member].narrow(0, split.sink, window_start - split.sink);
                const torch::Tensor top = std::get<1>(middle.topk(split.retrieved)) + split.sink;
                rankings.emplace_back();
                for (int64_t i = 0; i < split.retrieved; ++i)
                    rankings.back().push_back(top[i].item<int64_t>());
            }
            const std::vector<int64_t> best = first_distinct(rankings, split.retrieved);
            const std::vector<int64_t> expected =
                with_resident({best.begin(), best.end()}, total, split);
            CHECK(rows[static_cast<std::size_t>(head)] == expected);
            const torch::Tensor index = torch::tensor(expected, torch::kInt64);
            for (int64_t member = 0; member < 2; ++member)
                recall += torch::softmax(scores[head * 2 + member] * scale, 0)
                              .index_select(0, index)
                              .sum()
                              .item<double>();
        }
        REQUIRE(sparse.stats().recall_count[0] == query_heads);
        CHECK(sparse.stats().recall_sum[0] == Approx(recall).epsilon(1e-5));
    }
    SECTION("quest: the pages of the highest per-channel bounds, interleaved, to the budget") {
        options.method = "quest";
        SparseAttention sparse(config, rope, options);
        REQUIRE(sparse.select(0, queries, cache_holding(first_keys), rows));
        const torch::Tensor k = first_keys.to(torch::kFloat64);
        const torch::Tensor q = queries.reshape({query_heads, dim}).to(torch::kFloat64);
        const int64_t pages = (window_start + 15) / 16, first_page = split.sink / 16;
        for (int64_t head = 0; head < kv_heads; ++head) {
            std::vector<std::vector<int64_t>> rankings;
            for (int64_t member = 0; member < 2; ++member) {
                std::vector<std::pair<double, int64_t>> bounds;
                for (int64_t p = first_page; p < pages; ++p) {
                    const int64_t end = std::min(window_start, (p + 1) * 16);
                    const torch::Tensor page = k[head].narrow(0, p * 16, end - p * 16);
                    const torch::Tensor query = q[head * 2 + member];
                    const double bound = torch::maximum(query * std::get<0>(page.min(0)),
                                                        query * std::get<0>(page.max(0)))
                                             .sum()
                                             .item<double>();
                    bounds.emplace_back(-bound, p);
                }
                std::sort(bounds.begin(), bounds.end());
                rankings.emplace_back();
                for (int64_t i = 0; i < split.retrieved / 16; ++i)
                    rankings.back().push_back(bounds[static_cast<std::size_t>(i)].second);
            }
            std::set<int64_t> chosen;
            for (int64_t page : first_distinct(rankings, split.retrieved / 16))
                for (int64_t r = page * 16; r < std::min(window_start, (page + 1) * 16); ++r)
                    chosen.insert(r);
            CHECK(rows[static_cast<std::size_t>(head)] == with_resident(chosen, total, split));
        }
    }
    SECTION("h2o: the recent half and the old rows with the most attention, over two steps") {
        options.method = "h2o";
        SparseAttention sparse(config, rope, options);
        std::vector<std::vector<int64_t>> kept(kv_heads);
        std::vector<std::map<int64_t, double>> attention(kv_heads);
        for (const int64_t rows_now : {total, total + 1}) {
            const torch::Tensor now = keys.narrow(1, 0, rows_now);
            REQUIRE(sparse.select(0, queries, cache_holding(now), rows));
            const torch::Tensor step_scores = reference_scores(queries, now);
            for (int64_t head = 0; head < kv_heads; ++head) {
                auto& mine = kept[static_cast<std::size_t>(head)];
                auto& mass = attention[static_cast<std::size_t>(head)];
                for (int64_t r = mine.empty() ? 0 : mine.back() + 1; r < rows_now; ++r)
                    mine.push_back(r);
                const torch::Tensor index = torch::tensor(mine, torch::kInt64);
                for (int64_t member = 0; member < 2; ++member) {
                    const torch::Tensor p = torch::softmax(
                        step_scores[head * 2 + member].index_select(0, index) * scale, 0);
                    for (std::size_t i = 0; i < mine.size(); ++i)
                        mass[mine[i]] += p[static_cast<int64_t>(i)].item<double>();
                }
                std::vector<int64_t> old, next;
                for (int64_t r : mine)
                    (r >= rows_now - budget / 2 ? next : old).push_back(r);
                std::sort(old.begin(), old.end(),
                          [&](int64_t a, int64_t b) { return mass[a] > mass[b]; });
                old.resize(static_cast<std::size_t>(budget - static_cast<int64_t>(next.size())));
                next.insert(next.end(), old.begin(), old.end());
                std::sort(next.begin(), next.end());
                mine = next;
                CHECK(rows[static_cast<std::size_t>(head)] == mine);
            }
        }
    }
}

TEST_CASE("every method chooses from a cache on disk as from one in memory", "[sparse][offload]") {
    // The keys of a cache on disk are read with pread a chunk at a time; the choices, and the
    // measured recall, must be those made from the same keys in memory, step after step.
    torch::NoGradGuard no_grad;
    const ModelConfig config = sparse_config(2);
    const Rope rope(config);
    test::TempDir dir;
    const int64_t total = 5000, steps = 3;
    const torch::Tensor positions = torch::arange(total, torch::kInt64);
    KvCache memory(2, kv_heads, dim, torch::kBFloat16, torch::kCPU);
    KvCache disk = KvCache::on_disk(2, kv_heads, dim, torch::kBFloat16, total + steps, dir.path());
    std::vector<torch::Tensor> keys, values;
    for (int64_t layer = 0; layer < 2; ++layer) {
        keys.push_back(
            clustered_keys(total, 30 + static_cast<uint64_t>(layer)).to(torch::kBFloat16));
        values.push_back(torch::randn({kv_heads, total, dim}).to(torch::kBFloat16));
    }
    memory.append(keys, values, positions);
    disk.append(keys, values, positions);
    disk.release_pages();
    SparseOptions options;
    options.budget = 64;
    options.dense_layers = 0;
    options.measure_recall = true;
    std::vector<std::unique_ptr<SparseAttention>> from_memory, from_disk;
    for (const char* method : {"streaming", "topk", "quest", "h2o", "icecache"}) {
        options.method = method;
        from_memory.push_back(std::make_unique<SparseAttention>(config, rope, options));
        from_disk.push_back(std::make_unique<SparseAttention>(config, rope, options));
        from_memory.back()->prepare(memory);
        from_disk.back()->prepare(disk);
    }
    torch::manual_seed(31);
    for (int64_t step = 0; step < steps; ++step) {
        // A new token, then each layer's choice, as a decoding step makes them.
        std::vector<torch::Tensor> new_keys, new_values;
        for (int64_t layer = 0; layer < 2; ++layer) {
            new_keys.push_back(torch::randn({kv_heads, 1, dim}).to(torch::kBFloat16));
            new_values.push_back(torch::randn({kv_heads, 1, dim}).to(torch::kBFloat16));
        }
        const torch::Tensor position = torch::tensor(std::vector<int64_t>{total + step});
        memory.append(new_keys, new_values, position);
        disk.append(new_keys, new_values, position);
        for (int64_t layer = 0; layer < 2; ++layer) {
            const torch::Tensor queries = torch::randn({query_heads, 1, dim});
            for (std::size_t m = 0; m < from_memory.size(); ++m) {
                CAPTURE(step, layer, from_memory[m]->options().method);
                std::vector<std::vector<int64_t>> in_memory, on_disk;
                REQUIRE(from_memory[m]->select(layer, queries, memory, in_memory));
                REQUIRE(from_disk[m]->select(layer, queries, disk, on_disk));
                CHECK(in_memory == on_disk);
                if (from_memory[m]->options().method != "h2o")  // h2o keeps no sink
                    check_shape_of_choice(on_disk, total + step + 1, split_budget(64, 16));
            }
            disk.release_pages(layer);
        }
    }
    for (std::size_t m = 0; m < from_memory.size(); ++m) {
        CAPTURE(from_memory[m]->options().method);
        CHECK(from_disk[m]->stats().recall_sum == from_memory[m]->stats().recall_sum);
        CHECK(from_disk[m]->stats().recall_count == from_memory[m]->stats().recall_count);
    }
}

TEST_CASE("the kv heads' choices do not depend on how many threads make them", "[sparse]") {
    // IceCache and Quest choose each kv head's rows on its own thread: one thread and several
    // must choose the same rows and count the same index dot products.
    torch::NoGradGuard no_grad;
    const ModelConfig config = sparse_config(1);
    const Rope rope(config);
    const int64_t total = 3000;
    KvCache cache(1, kv_heads, dim, torch::kFloat32, torch::kCPU);
    cache.append({clustered_keys(total, 41)}, {torch::randn({kv_heads, total, dim})},
                 torch::arange(total, torch::kInt64));
    const int threads = at::get_num_threads();
    for (const char* method : {"icecache", "quest"}) {
        CAPTURE(method);
        SparseOptions options;
        options.method = method;
        options.budget = 64;
        options.dense_layers = 0;
        SparseAttention serial(config, rope, options), parallel(config, rope, options);
        at::set_num_threads(1);
        serial.prepare(cache);
        at::set_num_threads(std::max(2, threads));
        parallel.prepare(cache);
        torch::manual_seed(43);
        for (int step = 0; step < 4; ++step) {
            const torch::Tensor queries = torch::randn({query_heads, 1, dim});
            std::vector<std::vector<int64_t>> one, many;
            at::set_num_threads(1);
            REQUIRE(serial.select(0, queries, cache, one));
            at::set_num_threads(std::max(2, threads));
            REQUIRE(parallel.select(0, queries, cache, many));
            CHECK(one == many);
        }
        CHECK(serial.stats().index_dot_products == parallel.stats().index_dot_products);
        if (std::string(method) == "icecache") CHECK(serial.stats().index_dot_products > 0);
    }
    at::set_num_threads(threads);
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
    options.method = "icecache";
    options.budget = 64;
    options.dense_layers = 0;
    options.field_of_view = total;
    options.retrieve_share = 1.0;
    SparseAttention sparse(config, rope, options);
    sparse.add_stored_index(0, 0, index);
    std::vector<std::vector<int64_t>> rows;
    REQUIRE(sparse.select(0, queries, cache_holding(rotated), rows));
    CHECK(sparse.stats().indexed_tokens == 0);  // nothing rebuilt: the stored index served
    for (int64_t h = 0; h < query_heads; ++h) {
        const int64_t head = h / 2;
        const torch::Tensor scores =
            (queries[h][0].unsqueeze(0) * rotated[head].narrow(0, 0, total - 16)).sum(1);
        const auto& chosen = rows[static_cast<std::size_t>(head)];
        CHECK(std::binary_search(chosen.begin(), chosen.end(), scores.argmax().item<int64_t>()));
    }
}

TEST_CASE("a stored index's page size and layers are decoding's", "[sparse]") {
    // kvindex --page-size 32 --dense-layers 1: pages of 32 in the budget split, and the layer
    // without a stored index (layer 0, decoded sparsely here) built from the keys.
    torch::NoGradGuard no_grad;
    const ModelConfig config = sparse_config(2);
    const Rope rope(config);
    const int64_t total = 1500;
    KvCache cache(2, kv_heads, dim, torch::kFloat32, torch::kCPU, total);
    const torch::Tensor layer0 = clustered_keys(total, 61), layer1 = clustered_keys(total, 62);
    cache.append({layer0, layer1},
                 {torch::randn({kv_heads, total, dim}), torch::randn({kv_heads, total, dim})},
                 torch::arange(total, torch::kInt64));
    PacketIndex index;
    index.page_size = 32;
    index.projection = dci_projection(dim, 1);
    index.segments = {{0, total, 0}};
    index.layers = {1};
    DciOptions dci;
    dci.page_size = 32;
    for (int64_t head = 0; head < kv_heads; ++head) {
        DciIndex built(dim, index.projection, dci);
        const torch::Tensor k = layer1[head].contiguous();
        built.build(k.data_ptr<float>(), total);
        index.layouts.push_back(built.layout());
    }
    SparseOptions options;
    options.method = "icecache";
    options.budget = 256;
    options.dense_layers = 0;
    SparseAttention sparse(config, rope, options);
    sparse.add_stored_index(0, 0, index);
    CHECK(sparse.options().page_size == 32);
    sparse.prepare(cache);
    CHECK(sparse.stats().indexed_tokens == total * kv_heads);  // layer 0 only, built
    torch::manual_seed(63);
    for (int64_t layer = 0; layer < 2; ++layer) {
        std::vector<std::vector<int64_t>> rows;
        REQUIRE(sparse.select(layer, torch::randn({query_heads, 1, dim}), cache, rows));
        // 256 with pages of 32: a sink and a window of 64 each, 4 pages of at most 32.
        check_shape_of_choice(rows, total, split_budget(256, 32));
        for (const auto& chosen : rows)
            CHECK(static_cast<int64_t>(chosen.size()) <= 256);
    }
    PacketIndex other = index;
    other.page_size = 16;
    CHECK_THROWS_AS(sparse.add_stored_index(total, total, other), MismatchError);
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
    options.method = "icecache";
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
    // Every row between the 16-token sink and the 16-token window, in 3 sparse layers, for
    // each kv head.
    CHECK(by_worker.stats().indexed_tokens == (700 - 16 - 16) * 3 * kv_heads);
    CHECK(after.stats().indexed_tokens == by_worker.stats().indexed_tokens);

    torch::manual_seed(12);
    for (int64_t layer = 1; layer < 4; ++layer) {
        const torch::Tensor queries = torch::randn({query_heads, 1, dim});
        std::vector<std::vector<int64_t>> chosen_by_worker, chosen_after;
        REQUIRE(by_worker.select(layer, queries, cache, chosen_by_worker));
        REQUIRE(after.select(layer, queries, cache, chosen_after));
        CHECK(chosen_by_worker == chosen_after);
        check_shape_of_choice(chosen_by_worker, 700, split_budget(64, 16));
    }
}

TEST_CASE("no kv head attends to more rows than the budget, its query heads grouped or not",
          "[sparse]") {
    // The budget counts what a kv head attends to, the union over the query heads that share
    // it included: every method, every step, every layer, with and without a choice reused by
    // the next layer, for 4 query heads per kv head (GQA) and for 1 (MHA).
    torch::NoGradGuard no_grad;
    const int64_t total = 2000, steps = 3, layers = 2;
    for (const int64_t group : {4, 1}) {
        ModelConfig config = sparse_config(layers);
        config.num_heads = kv_heads * group;
        const Rope rope(config);
        KvCache cache(layers, kv_heads, dim, torch::kFloat32, torch::kCPU, total + steps);
        cache.append({clustered_keys(total, 51), clustered_keys(total, 52)},
                     {torch::randn({kv_heads, total, dim}), torch::randn({kv_heads, total, dim})},
                     torch::arange(total, torch::kInt64));
        std::vector<std::unique_ptr<SparseAttention>> methods;
        for (const SparseMethodInfo& method : sparse_methods()) {
            if (method.name == "full") continue;
            for (const int64_t budget : {64, 128})
                for (const int64_t reuse : {1, 2}) {
                    SparseOptions options;
                    options.method = method.name;
                    options.budget = budget;
                    options.dense_layers = 0;
                    options.reuse_layers = reuse;
                    methods.push_back(std::make_unique<SparseAttention>(config, rope, options));
                }
        }
        REQUIRE(methods.size() == 20);
        torch::manual_seed(53);
        for (int64_t step = 0; step < steps; ++step) {
            cache.append({torch::randn({kv_heads, 1, dim}), torch::randn({kv_heads, 1, dim})},
                         {torch::randn({kv_heads, 1, dim}), torch::randn({kv_heads, 1, dim})},
                         torch::tensor(std::vector<int64_t>{total + step}));
            for (int64_t layer = 0; layer < layers; ++layer) {
                const torch::Tensor queries = torch::randn({kv_heads * group, 1, dim});
                for (const auto& sparse : methods) {
                    const SparseOptions& options = sparse->options();
                    CAPTURE(group, step, layer, options.method, options.budget,
                            options.reuse_layers);
                    std::vector<std::vector<int64_t>> rows;
                    REQUIRE(sparse->select(layer, queries, cache, rows));
                    for (const auto& chosen : rows) {
                        REQUIRE(std::is_sorted(chosen.begin(), chosen.end()));
                        REQUIRE(std::adjacent_find(chosen.begin(), chosen.end()) == chosen.end());
                        CHECK(static_cast<int64_t>(chosen.size()) <= options.budget);
                    }
                }
            }
        }
        for (const auto& sparse : methods) {
            CAPTURE(group, sparse->options().method, sparse->options().budget);
            for (int64_t layer = 0; layer < layers; ++layer) {
                const auto slot = static_cast<std::size_t>(layer);
                CHECK(sparse->stats().layer_selections[slot] == steps * kv_heads);
                CHECK(sparse->stats().layer_rows_max[slot] <= sparse->options().budget);
            }
        }
    }
}
