// The DCI index against brute force on keys of real shape: build time, query time, dot products
// and recall of the top pages, at one size per run. bench/bench-icecache drives it.
//
//   kv_bench_dci_index --keys N [--head-dim 128] [--queries 50] [--pages 12] [--seed 1]
//
// Keys are drawn with the structure real ones have: a few hundred directions (the "meanings"
// of tokens) that neighbouring tokens tend to share, a handful of channels much larger than the
// rest, and norms that vary; each key is then rotated by RoPE at its position, as stored keys
// are. Queries come from the same directions at the last position. Prints one JSON object.
#include "kv/index/dci.hpp"
#include "kv/model/gemv.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

void rotate(float* x, int64_t dim, int64_t position) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const double angle =
            static_cast<double>(position) *
            std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
        const double c = std::cos(angle), s = std::sin(angle);
        const double a = x[i], b = x[i + half];
        x[i] = static_cast<float>(a * c - b * s);
        x[i + half] = static_cast<float>(b * c + a * s);
    }
}

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    int64_t keys_count = 16384, dim = 128, queries = 50, pages = 12;
    uint64_t seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string name = argv[i];
        const long long value = std::atoll(argv[i + 1]);
        if (name == "--keys")
            keys_count = value;
        else if (name == "--head-dim")
            dim = value;
        else if (name == "--queries")
            queries = value;
        else if (name == "--pages")
            pages = value;
        else if (name == "--seed")
            seed = static_cast<uint64_t>(value);
        else {
            std::fprintf(stderr, "kv_bench_dci_index: unknown option %s\n", name.c_str());
            return 2;
        }
    }
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t meanings = 512;
    std::vector<float> channel_scale(static_cast<std::size_t>(dim), 1.0f);
    for (int c = 0; c < 4; ++c)
        channel_scale[static_cast<std::size_t>(rng() % static_cast<uint64_t>(dim))] = 6.0f;
    std::vector<float> centres(static_cast<std::size_t>(meanings * dim));
    for (int64_t m = 0; m < meanings; ++m)
        for (int64_t d = 0; d < dim; ++d)
            centres[static_cast<std::size_t>(m * dim + d)] =
                normal(rng) * channel_scale[static_cast<std::size_t>(d)];
    std::uniform_int_distribution<int64_t> pick(0, meanings - 1);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    std::vector<float> keys(static_cast<std::size_t>(keys_count * dim));
    int64_t meaning = 0;
    for (int64_t t = 0; t < keys_count; ++t) {
        if (unit(rng) < 0.3f) meaning = pick(rng);
        const float scale = 0.5f + unit(rng);
        float* key = keys.data() + t * dim;
        for (int64_t d = 0; d < dim; ++d)
            key[d] =
                scale * centres[static_cast<std::size_t>(meaning * dim + d)] + 0.8f * normal(rng);
        rotate(key, dim, t);
    }

    const auto build_start = Clock::now();
    kv::DciIndex index(dim, kv::dci_projection(dim, seed));
    index.build(keys.data(), keys_count, 1);
    const double build_seconds = seconds_since(build_start);
    // The same index as decoding restores a stored one: in place, each point's children one run
    // of keys in memory.
    kv::DciIndex restored(dim, kv::dci_projection(dim, seed));
    restored.restore_in_place(
        [&](std::span<const int32_t> tokens, float* out) {
            for (std::size_t i = 0; i < tokens.size(); ++i)
                std::copy_n(keys.data() + tokens[i] * dim, dim,
                            out + static_cast<int64_t>(i) * dim);
        },
        keys_count, index.layout(), "the built index", {});

    std::vector<double> recall, token_recall, query_times, restored_times, brute_times;
    int64_t restored_differs = 0;
    std::vector<int64_t> dots;
    std::vector<float> scores(static_cast<std::size_t>(keys_count));
    for (int64_t q = 0; q < queries; ++q) {
        std::vector<float> query(static_cast<std::size_t>(dim));
        const int64_t m = pick(rng);
        for (int64_t d = 0; d < dim; ++d)
            query[static_cast<std::size_t>(d)] =
                centres[static_cast<std::size_t>(m * dim + d)] + 0.8f * normal(rng);
        rotate(query.data(), dim, keys_count);

        auto started = Clock::now();
        kv::dot_rows_f32(keys.data(), query.data(), scores.data(), keys_count, dim);
        brute_times.push_back(seconds_since(started));
        // Exact: pages ranked by their best token; tokens ranked by score.
        std::vector<float> page_best(static_cast<std::size_t>(index.page_capacity()), -INFINITY);
        for (int64_t t = 0; t < keys_count; ++t) {
            float& best = page_best[static_cast<std::size_t>(index.token_page(t))];
            best = std::max(best, scores[static_cast<std::size_t>(t)]);
        }
        std::vector<int32_t> order(page_best.size());
        for (std::size_t p = 0; p < order.size(); ++p)
            order[p] = static_cast<int32_t>(p);
        std::partial_sort(order.begin(), order.begin() + pages, order.end(),
                          [&](int32_t a, int32_t b) {
                              return page_best[static_cast<std::size_t>(a)] >
                                     page_best[static_cast<std::size_t>(b)];
                          });
        std::vector<int64_t> top_tokens(static_cast<std::size_t>(keys_count));
        for (int64_t t = 0; t < keys_count; ++t)
            top_tokens[static_cast<std::size_t>(t)] = t;
        std::partial_sort(top_tokens.begin(), top_tokens.begin() + 16, top_tokens.end(),
                          [&](int64_t a, int64_t b) {
                              return scores[static_cast<std::size_t>(a)] >
                                     scores[static_cast<std::size_t>(b)];
                          });

        started = Clock::now();
        kv::DciQueryOptions options;
        options.pages = pages;
        const kv::DciQueryResult result = index.query(query.data(), options);
        query_times.push_back(seconds_since(started));
        dots.push_back(result.dot_products);
        started = Clock::now();
        const kv::DciQueryResult again = restored.query(query.data(), options);
        restored_times.push_back(seconds_since(started));
        restored_differs += again.pages != result.pages;
        const std::set<int32_t> found(result.pages.begin(), result.pages.end());
        int64_t hits = 0, token_hits = 0;
        for (int64_t i = 0; i < pages; ++i)
            hits += static_cast<int64_t>(found.count(order[static_cast<std::size_t>(i)]));
        for (int64_t i = 0; i < 16; ++i)
            token_hits += static_cast<int64_t>(
                found.count(index.token_page(top_tokens[static_cast<std::size_t>(i)])));
        recall.push_back(static_cast<double>(hits) / static_cast<double>(pages));
        token_recall.push_back(static_cast<double>(token_hits) / 16.0);
    }
    std::string level_sizes = "[";
    for (int level = 0; level < index.levels(); ++level)
        level_sizes += (level ? ", " : "") + std::to_string(index.level_points(level).size());
    level_sizes += "]";
    double mean_recall = 0, mean_token_recall = 0, mean_dots = 0;
    for (std::size_t i = 0; i < recall.size(); ++i) {
        mean_recall += recall[i] / static_cast<double>(recall.size());
        mean_token_recall += token_recall[i] / static_cast<double>(recall.size());
        mean_dots += static_cast<double>(dots[i]) / static_cast<double>(dots.size());
    }
    std::printf(
        "{\"keys\": %lld, \"head_dim\": %lld, \"levels\": %d, \"pages\": %lld, "
        "\"build_seconds\": %.4f, \"build_ms_per_1k_tokens\": %.4f, "
        "\"query_ms\": %.4f, \"restored_query_ms\": %.4f, \"restored_differs\": %lld, "
        "\"level_sizes\": %s, \"brute_force_ms\": %.4f, \"dot_products\": %.1f, "
        "\"dot_product_share\": %.5f, \"page_recall\": %.4f, \"top16_token_recall\": %.4f, "
        "\"queries\": %lld, \"pages_wanted\": %lld, \"isa\": \"%s\"}\n",
        static_cast<long long>(keys_count), static_cast<long long>(dim), index.levels(),
        static_cast<long long>(index.live_pages()), build_seconds,
        1000.0 * build_seconds / (static_cast<double>(keys_count) / 1000.0),
        1000.0 * median(query_times), 1000.0 * median(restored_times),
        static_cast<long long>(restored_differs), level_sizes.c_str(), 1000.0 * median(brute_times),
        mean_dots, mean_dots / static_cast<double>(keys_count), mean_recall, mean_token_recall,
        static_cast<long long>(queries), static_cast<long long>(pages), kv::gemv_isa());
    return 0;
}
