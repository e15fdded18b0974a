// The DCI index against brute force: structure invariants, exact parents, exhaustive queries
// equal to the true top pages, recall of the default query, insertion with page splits.
#include "kv/error.hpp"
#include "kv/float_convert.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/index/dci.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>

using namespace kv;

namespace {

constexpr int64_t dim = 16;

// Keys with the structure of real ones: clusters, neighbouring tokens often in the same one,
// norms that vary.
std::vector<float> clustered_keys(int64_t count, int clusters, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> centres(static_cast<std::size_t>(clusters * dim));
    for (float& value : centres)
        value = 3.0f * normal(rng);
    std::vector<float> keys(static_cast<std::size_t>(count * dim));
    std::uniform_int_distribution<int> pick(0, clusters - 1);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    int cluster = 0;
    for (int64_t t = 0; t < count; ++t) {
        if (unit(rng) < 0.2f) cluster = pick(rng);
        for (int64_t d = 0; d < dim; ++d)
            keys[static_cast<std::size_t>(t * dim + d)] =
                centres[static_cast<std::size_t>(cluster * dim + d)] + 0.7f * normal(rng);
    }
    return keys;
}

std::vector<float> random_direction(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> u(dim + 1);
    for (float& value : u)
        value = normal(rng);
    return u;
}

double dot64(const float* a, const float* b) {
    double sum = 0;
    for (int64_t d = 0; d < dim; ++d)
        sum += static_cast<double>(a[d]) * b[d];
    return sum;
}

// Every token in exactly one live page of its parent; pages hold 1..page_size tokens; a
// parent's pages in projection order; parents one level up; top-level points under the root.
void check_structure(const DciIndex& index, int64_t page_size) {
    const int top = index.levels() - 1;
    std::vector<int> seen(static_cast<std::size_t>(index.size()), 0);
    int64_t live = 0;
    for (int32_t page = 0; page < index.page_capacity(); ++page) {
        if (index.page_parent(page) == -2) continue;
        ++live;
        const auto tokens = index.page_tokens(page);
        REQUIRE(!tokens.empty());
        REQUIRE(static_cast<int64_t>(tokens.size()) <= page_size);
        for (int32_t token : tokens) {
            ++seen[static_cast<std::size_t>(token)];
            REQUIRE(index.token_page(token) == page);
            REQUIRE(index.parent(token) == index.page_parent(page));
        }
    }
    CHECK(live == index.live_pages());
    for (int64_t token = 0; token < index.size(); ++token) {
        REQUIRE(seen[static_cast<std::size_t>(token)] == 1);
        const int32_t parent = index.parent(token);
        if (index.level(token) == top)
            REQUIRE(parent == -1);
        else
            REQUIRE(index.level(parent) == index.level(token) + 1);
    }
    std::set<int32_t> owners = {-1};
    for (int level = 1; level < index.levels(); ++level)
        for (int32_t point : index.level_points(level))
            owners.insert(point);
    for (int32_t owner : owners) {
        float previous = -std::numeric_limits<float>::infinity();
        for (int32_t page : index.child_pages(owner)) {
            REQUIRE(index.page_parent(page) == owner);
            for (int32_t token : index.page_tokens(page)) {
                REQUIRE(index.projection_of(token) >= previous);
                previous = index.projection_of(token);
            }
        }
    }
}

// The exact answer: pages ranked by the best q.k among their tokens.
std::vector<int32_t> true_top_pages(const DciIndex& index, const float* query, int64_t k) {
    std::map<int32_t, double> best;
    for (int64_t token = 0; token < index.size(); ++token) {
        const double score = dot64(query, index.key(token));
        auto [it, fresh] = best.emplace(index.token_page(token), score);
        if (!fresh) it->second = std::max(it->second, score);
    }
    std::vector<std::pair<double, int32_t>> ranked;
    for (const auto& [page, score] : best)
        ranked.emplace_back(-score, page);
    std::sort(ranked.begin(), ranked.end());
    std::vector<int32_t> pages;
    for (std::size_t i = 0; i < ranked.size() && static_cast<int64_t>(i) < k; ++i)
        pages.push_back(ranked[i].second);
    return pages;
}

double recall(const std::vector<int32_t>& got, const std::vector<int32_t>& truth) {
    const std::set<int32_t> found(got.begin(), got.end());
    int64_t hits = 0;
    for (int32_t page : truth)
        hits += found.count(page);
    return truth.empty() ? 1.0 : static_cast<double>(hits) / static_cast<double>(truth.size());
}

}  // namespace

TEST_CASE("the lifted distance is half the squared distance of the lifted keys", "[dci]") {
    const std::vector<float> keys = clustered_keys(300, 5, 1);
    DciIndex index(dim, random_direction(2));
    index.build(keys.data(), 300);
    const double m = index.max_squared_norm();
    for (auto [a, b] : {std::pair{0, 1}, {5, 200}, {17, 17}, {299, 3}}) {
        const float* x = index.key(a);
        const float* y = index.key(b);
        const double tail_x = std::sqrt(m - dot64(x, x)), tail_y = std::sqrt(m - dot64(y, y));
        double squared = (tail_x - tail_y) * (tail_x - tail_y);
        for (int64_t d = 0; d < dim; ++d)
            squared += (static_cast<double>(x[d]) - y[d]) * (static_cast<double>(x[d]) - y[d]);
        CHECK(index.lifted_distance(a, b) == Approx(squared / 2).margin(1e-3));
    }
}

TEST_CASE("promotion counts levels as M-DCI does", "[dci]") {
    // The authors' level sizes (M-DCI construct_new_tree with p0 = 0.01, p1 = 0.2, counted by
    // its own C code): 10,000 tokens give 9,875 / 99 / 20 / 5 / 1, 36,000 give 35,553 / 356 /
    // 72 / 15 / 4. The rule does not look at the keys.
    for (const auto& [count, sizes] :
         {std::pair<int64_t, std::vector<int64_t>>{10000, {9875, 99, 20, 5, 1}},
          {36000, {35553, 356, 72, 15, 4}}}) {
        CAPTURE(count);
        const std::vector<float> keys = clustered_keys(count, 20, 3);
        DciIndex index(dim, random_direction(4));
        index.build(keys.data(), count);
        std::vector<int64_t> got;
        for (int level = 0; level < index.levels(); ++level)
            got.push_back(static_cast<int64_t>(index.level_points(level).size()));
        CHECK(got == sizes);
        // Systematic in token order: the 100th token sends the next one up, one level per token.
        CHECK(index.level(99) == 0);
        CHECK(index.level(100) == 1);
        CHECK(index.level(101) == 0);
    }
    // Tokens added one by one continue the same rule: 10,000 built from 4,000 and 6,000
    // inserted have the levels of 10,000 built at once.
    const std::vector<float> keys = clustered_keys(10000, 20, 3);
    DciIndex grown(dim, random_direction(4));
    grown.build(keys.data(), 4000);
    grown.insert(keys.data() + 4000 * dim, 6000);
    std::vector<int64_t> sizes;
    for (int level = 0; level < grown.levels(); ++level)
        sizes.push_back(static_cast<int64_t>(grown.level_points(level).size()));
    CHECK(sizes == std::vector<int64_t>{9875, 99, 20, 5, 1});
}

TEST_CASE("a built index is a valid tree with exact parents", "[dci]") {
    // Up to 3,000 tokens every parent is the true nearest (float64); beyond, the finest level
    // takes the anchor shortcut (next test).
    for (int64_t count : {1, 40, 1000, 3000}) {
        CAPTURE(count);
        const std::vector<float> keys = clustered_keys(count, 12, 5);
        DciIndex index(dim, random_direction(6));
        index.build(keys.data(), count, 2);
        check_structure(index, 16);
        for (int64_t token = 0; token < count; ++token) {
            const int32_t parent = index.parent(token);
            if (parent < 0) continue;
            double best = std::numeric_limits<double>::infinity();
            for (int32_t other : index.level_points(index.level(token) + 1))
                best = std::min(best, index.lifted_distance(token, other));
            REQUIRE(index.lifted_distance(token, parent) == Approx(best).margin(1e-4));
        }
    }
}

TEST_CASE("the anchor shortcut gives valid, mostly exact parents", "[dci]") {
    // More than 3,000 tokens: the finest level's anchors (every 120th token and the last) get
    // exact parents, the others their neighbouring anchors' parents when near enough.
    const int64_t count = 20000;
    const std::vector<float> keys = clustered_keys(count, 40, 7);
    DciIndex index(dim, random_direction(8));
    index.build(keys.data(), count, 2);
    check_structure(index, 16);
    int64_t exact = 0, total = 0;
    for (std::size_t i = 0; i < index.level_points(0).size(); ++i) {
        const int32_t token = index.level_points(0)[i];
        double best = std::numeric_limits<double>::infinity();
        for (int32_t other : index.level_points(1))
            best = std::min(best, index.lifted_distance(token, other));
        const bool is_exact = index.lifted_distance(token, index.parent(token)) <= best + 1e-4;
        if (i % 120 == 0 || i + 1 == index.level_points(0).size()) REQUIRE(is_exact);
        exact += is_exact;
        ++total;
    }
    CHECK(exact < total);  // the shortcut was taken
    CHECK(static_cast<double>(exact) / static_cast<double>(total) > 0.6);
}

TEST_CASE("an exhaustive query returns the exact top pages", "[dci]") {
    const int64_t count = 3000;
    const std::vector<float> keys = clustered_keys(count, 16, 9);
    DciIndex index(dim, random_direction(10));
    index.build(keys.data(), count);
    const std::vector<float> queries = clustered_keys(20, 16, 11);
    DciQueryOptions options;
    options.pages = 12;
    options.field_of_view = count;
    options.retrieve_share = 1.0;
    for (int q = 0; q < 20; ++q) {
        const float* query = queries.data() + q * dim;
        const DciQueryResult result = index.query(query, options);
        CHECK(result.dot_products == count);
        CHECK(result.pages == true_top_pages(index, query, 12));
        for (std::size_t i = 1; i < result.page_scores.size(); ++i)
            CHECK(result.page_scores[i - 1] >= result.page_scores[i]);
    }
}

TEST_CASE("the default query finds most top pages with a fraction of the dot products", "[dci]") {
    const int64_t count = 40000;
    const std::vector<float> keys = clustered_keys(count, 64, 12);
    DciIndex index(dim, random_direction(13));
    index.build(keys.data(), count, 2);
    const std::vector<float> queries = clustered_keys(40, 64, 14);
    double total_recall = 0;
    int64_t dots = 0;
    for (int q = 0; q < 40; ++q) {
        const float* query = queries.data() + q * dim;
        const DciQueryResult result = index.query(query, {});
        total_recall += recall(result.pages, true_top_pages(index, query, 12));
        dots += result.dot_products;
    }
    INFO("recall " << total_recall / 40 << ", dot products per query " << dots / 40);
    CHECK(total_recall / 40 > 0.75);
    CHECK(dots / 40 < count / 4);
}

TEST_CASE("inserted tokens keep the index valid, split pages and mark them dirty", "[dci]") {
    const int64_t count = 4000, first = 600;
    std::vector<float> keys = clustered_keys(count, 12, 15);
    DciIndex index(dim, random_direction(16));
    index.build(keys.data(), first);
    const int64_t pages_before = index.live_pages();
    const int levels_before = index.levels();
    index.take_dirty_pages();
    index.insert(keys.data() + first * dim, 50);
    CHECK(!index.take_dirty_pages().empty());
    index.insert(keys.data() + (first + 50) * dim, count - first - 50);
    REQUIRE(index.size() == count);
    check_structure(index, 16);
    CHECK(index.live_pages() > pages_before);
    CHECK(index.levels() > levels_before);  // new top levels opened on the way

    // Still exact when searched exhaustively.
    const std::vector<float> queries = clustered_keys(10, 12, 17);
    DciQueryOptions options;
    options.field_of_view = count;
    options.retrieve_share = 1.0;
    for (int q = 0; q < 10; ++q)
        CHECK(index.query(queries.data() + q * dim, options).pages ==
              true_top_pages(index, queries.data() + q * dim, 12));

    SECTION("a key beyond the norm bound lays the index out again") {
        std::vector<float> big(keys.begin(), keys.begin() + dim);
        for (float& value : big)
            value *= 10;
        index.insert(big.data(), 1);
        check_structure(index, 16);
        CHECK(index.max_squared_norm() >= dot64(big.data(), big.data()));
        CHECK(static_cast<int64_t>(index.take_dirty_pages().size()) >= index.live_pages());
    }
}

TEST_CASE("pages stay at least half full as tokens join and are re-parented", "[dci]") {
    // As M-DCI's B+-tree leaves: a page that re-parenting leaves below half full borrows from
    // a neighbour or merges with one; only a parent's single page may hold fewer. Grown one
    // token at a time from 16, as a decoding index is, where without merging a third of the
    // pages ended below 8 tokens.
    const int64_t count = 4016;
    const std::vector<float> keys = clustered_keys(count, 12, 31);
    DciIndex index(dim, random_direction(32));
    index.build(keys.data(), 16);
    for (int64_t token = 16; token < count; ++token)
        index.insert(keys.data() + token * dim, 1);
    check_structure(index, 16);
    int64_t pages = 0;
    for (int32_t page = 0; page < index.page_capacity(); ++page) {
        if (index.page_parent(page) == -2) continue;
        ++pages;
        if (index.child_pages(index.page_parent(page)).size() > 1)
            CHECK(index.page_tokens(page).size() >= 8);
    }
    CHECK(pages > count / 16);
}

TEST_CASE("queries walked together get what each gets alone", "[dci]") {
    // The query heads of one kv head share the walk (query_group): the same pages, scores and
    // dot products as one query() each, over an index built and over one restored in place.
    const int64_t count = 8000;
    const std::vector<float> keys = clustered_keys(count, 24, 41);
    DciIndex built(dim, random_direction(42));
    built.build(keys.data(), count);
    DciIndex restored(dim, random_direction(42));
    restored.restore_in_place(
        [&](std::span<const int32_t> tokens, float* out) {
            for (std::size_t i = 0; i < tokens.size(); ++i)
                std::copy_n(keys.data() + tokens[i] * dim, dim,
                            out + static_cast<int64_t>(i) * dim);
        },
        count, built.layout(), "'a.kvc'", {});
    // Four queries, two near each other (they share points) and two apart.
    std::vector<float> queries = clustered_keys(4, 24, 43);
    std::copy_n(queries.data(), dim, queries.data() + dim);
    queries[dim] += 0.3f;
    const std::vector<const float*> group = {queries.data(), queries.data() + dim,
                                             queries.data() + 2 * dim, queries.data() + 3 * dim};
    // bf16 keys stored as bf16: exact, so the same answers as their float32 values stored so.
    std::vector<float> rounded(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i)
        rounded[i] = bf16_to_float(float_to_bf16(keys[i]));
    auto read_rounded = [&](std::span<const int32_t> tokens, float* out) {
        for (std::size_t i = 0; i < tokens.size(); ++i)
            std::copy_n(rounded.data() + tokens[i] * dim, dim, out + static_cast<int64_t>(i) * dim);
    };
    DciIndex wide(dim, random_direction(42)), narrow(dim, random_direction(42));
    wide.restore_in_place(read_rounded, count, built.layout(), "'a.kvc'", {});
    narrow.restore_in_place(read_rounded, count, built.layout(), "'a.kvc'", {nullptr, {}, true});
    for (const float* query : group) {
        const DciQueryResult a = wide.query(query, {}), b = narrow.query(query, {});
        CHECK(a.pages == b.pages);
        CHECK(a.page_scores == b.page_scores);
        CHECK(a.dot_products == b.dot_products);
    }
    for (const DciIndex* index : {&built, &restored})
        for (const int64_t view : {0, 60}) {
            DciQueryOptions options;
            options.field_of_view = view;
            const std::vector<DciQueryResult> together = index->query_group(group, options);
            REQUIRE(together.size() == 4);
            for (std::size_t g = 0; g < 4; ++g) {
                const DciQueryResult alone = index->query(group[g], options);
                CHECK(together[g].pages == alone.pages);
                CHECK(together[g].page_scores == alone.page_scores);
                CHECK(together[g].dot_products == alone.dot_products);
            }
        }
}

TEST_CASE("the children nearest in projection are the run a merge outward picks", "[dci]") {
    // The reference: M-DCI's walk, one value at a time from target's place, the nearer first
    // and the right one at equal distances. Values and targets on a coarse grid, so that ties
    // are common, and Gaussian ones; runs wanted from 1 to more than there are.
    auto merged = [](const std::vector<float>& values, float target, std::size_t wanted) {
        const std::size_t count = values.size();
        if (wanted >= count) return std::pair<std::size_t, std::size_t>(0, count);
        std::size_t right = static_cast<std::size_t>(
            std::lower_bound(values.begin(), values.end(), target) - values.begin());
        std::size_t left = right;
        while (right - left < wanted) {
            const bool take_left =
                right >= count || (left > 0 && target - values[left - 1] < values[right] - target);
            take_left ? --left : ++right;
        }
        return std::pair(left, right);
    };
    std::mt19937_64 rng(61);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int round = 0; round < 20000; ++round) {
        const std::size_t count = 1 + rng() % 150;
        const bool grid = round % 2 == 0;
        std::vector<float> values(count);
        for (float& value : values)
            value = grid ? static_cast<float>(static_cast<int>(rng() % 20) - 10) : normal(rng);
        std::sort(values.begin(), values.end());
        const float target = grid ? 0.5f * static_cast<float>(static_cast<int>(rng() % 48) - 24)
                                  : 1.3f * normal(rng);
        const std::size_t wanted = 1 + rng() % (count + 2);
        CAPTURE(round, count, target, wanted);
        REQUIRE(nearest_in_projection(values, target, wanted) == merged(values, target, wanted));
    }
}

TEST_CASE("a query wanting more pages than exist widens instead of failing", "[dci]") {
    const std::vector<float> keys = clustered_keys(2000, 8, 18);
    DciIndex index(dim, random_direction(19));
    index.build(keys.data(), 2000);
    DciQueryOptions options;
    options.pages = 100000;
    const DciQueryResult result = index.query(keys.data(), options);
    CHECK(static_cast<int64_t>(result.pages.size()) <= index.live_pages());
    CHECK(result.pages.size() > 100);
}

TEST_CASE("bad index parameters are usage errors", "[dci]") {
    CHECK_THROWS_WITH(DciIndex(dim, std::vector<float>(3, 1.0f)),
                      Catch::Contains("the projection needs head_dim + 1 = 17 values"));
    DciOptions options;
    options.promotion_first = 0;
    CHECK_THROWS_WITH(
        DciIndex(dim, random_direction(1), options),
        Catch::Contains("first promotion ratio (p0, --promotion-first) must lie in (0, 1), not 0"));
    options = {};
    options.promotion_rest = 1;
    CHECK_THROWS_WITH(validate_dci_options(options),
                      Catch::Contains("(p1, --promotion-rest) must lie in (0, 1)"));
    options = {};
    options.page_size = 5000;
    CHECK_THROWS_WITH(validate_dci_options(options),
                      Catch::Contains("page size must lie in [2, 4096], not 5000"));
    options = {};
    options.norm_headroom = 0.5;
    CHECK_THROWS_WITH(validate_dci_options(options), Catch::Contains("at least 1, not 0.5"));
    options = {};
    options.anchor_interval = 0;
    CHECK_THROWS_AS(validate_dci_options(options), kv::UsageError);
    CHECK_NOTHROW(validate_dci_options(DciOptions{}));
}

TEST_CASE("a stored layout restores the same index, and a bad one is refused", "[dci]") {
    const int64_t count = 3000;
    const std::vector<float> keys = clustered_keys(count, 12, 20);
    DciIndex index(dim, random_direction(21));
    index.build(keys.data(), count - 200);
    index.insert(keys.data() + (count - 200) * dim, 200);  // splits leave pages out of id order
    const DciLayout layout = index.layout();

    DciIndex restored(dim, random_direction(21));
    restored.restore(keys.data(), count, layout, "'a.kvc'");
    check_structure(restored, 16);
    CHECK(restored.levels() == index.levels());
    CHECK(restored.live_pages() == index.live_pages());
    // Parents, and projections bit for bit: restore computes the keys' norms and projections a
    // chunk at a time, as the built index did key by key.
    for (int64_t token = 0; token < count; ++token) {
        REQUIRE(restored.parent(token) == index.parent(token));
        REQUIRE(restored.projection_of(token) == index.projection_of(token));
    }
    const std::vector<float> queries = clustered_keys(10, 12, 22);
    for (int q = 0; q < 10; ++q) {
        const float* query = queries.data() + q * dim;
        const DciQueryResult a = index.query(query, {}), b = restored.query(query, {});
        CHECK(a.page_scores == b.page_scores);
        CHECK(a.dot_products == b.dot_products);
    }
    // It goes on growing as the original would.
    restored.insert(keys.data(), 300);
    check_structure(restored, 16);

    DciLayout bad = layout;
    SECTION("a token in two pages") {
        bad.page_tokens[1] = bad.page_tokens[0];
        CHECK_THROWS_WITH(restored.restore(keys.data(), count, bad, "'a.kvc'"),
                          Catch::Contains("'a.kvc': invalid index"));
    }
    SECTION("a parent on the wrong level") {
        for (int64_t token = 0; token < count; ++token)
            if (bad.levels[static_cast<std::size_t>(token)] == 0) {
                bad.parents[static_cast<std::size_t>(token)] = static_cast<int32_t>(token);
                break;
            }
        CHECK_THROWS_WITH(restored.restore(keys.data(), count, bad, "'a.kvc'"),
                          Catch::Contains("has no parent one level up"));
    }
    SECTION("a norm bound below the keys") {
        bad.max_squared_norm = 1e-3;
        CHECK_THROWS_AS(restored.restore(keys.data(), count, bad, "'a.kvc'"), kv::FormatError);
    }
}

TEST_CASE("an index written by h5py as the specification says restores", "[dci]") {
    const kv::CacheReader reader(std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache" / "good" /
                                 "0011_indexed.kvc");
    const kv::Packet packet = reader.read("indexed");
    REQUIRE(!packet.index.empty());
    CHECK(reader.read("other").index.empty());  // an unknown method is ignored
    const kv::CacheModelInfo& model = reader.model();
    const int64_t tokens = packet.stored_length(), head_dim = model.head_dim;
    for (int64_t layer = 0; layer < model.num_layers; ++layer)
        for (int64_t head = 0; head < model.num_kv_heads; ++head) {
            std::vector<float> keys(static_cast<std::size_t>(tokens * head_dim));
            std::memcpy(
                keys.data(),
                packet.keys.data() + ((layer * model.num_kv_heads + head) * tokens * head_dim) * 4,
                keys.size() * 4);
            DciIndex index(head_dim, packet.index.projection);
            index.restore(keys.data(), tokens,
                          packet.index.layout(layer, head, model.num_kv_heads, 0), "'0011'");
            CHECK(index.live_pages() == 2);
            check_structure(index, 16);
        }
}

TEST_CASE("an index restored in place keeps its keys in the storage given, children together",
          "[dci]") {
    const int64_t count = 3000;
    const std::vector<float> keys = clustered_keys(count, 12, 30);
    DciIndex built(dim, random_direction(31));
    built.build(keys.data(), count - 300);
    built.insert(keys.data() + (count - 300) * dim, 300);  // pages out of id order
    const DciLayout layout = built.layout();
    // Chunks, as an offloaded cache gives them.
    auto reader = [&](std::span<const int32_t> tokens, float* out) {
        REQUIRE(tokens.size() <= 4096);
        for (std::size_t i = 0; i < tokens.size(); ++i)
            std::copy_n(keys.data() + tokens[i] * dim, dim, out + static_cast<int64_t>(i) * dim);
    };
    DciIndex copy(dim, random_direction(31)), in_place(dim, random_direction(31));
    copy.restore(keys.data(), count, layout, "'a.kvc'");
    // The keys a row per slot, then each slot's projection, then its token's bits.
    const int64_t stride = dim + 2;
    std::vector<float> storage(static_cast<std::size_t>(count * stride), std::nanf(""));
    int64_t reads = 0, key_rows_read = 0;  // the queries' reads of the storage
    KeyStorage on_disk;
    on_disk.floats = storage.data();
    on_disk.read = [&](int64_t offset, int64_t floats, float* out) {
        ++reads;
        if (offset < count * dim) key_rows_read += floats / dim;
        REQUIRE(offset + floats <= count * stride);
        std::copy_n(storage.data() + offset, floats, out);
    };
    in_place.restore_in_place(reader, count, layout, "'a.kvc'", on_disk);
    CHECK(reads == 0);
    CHECK(in_place.in_place());
    CHECK_FALSE(copy.in_place());
    CHECK(in_place.size() == count);
    CHECK(in_place.levels() == copy.levels());
    CHECK(in_place.live_pages() == copy.live_pages());
    CHECK(in_place.page_capacity() == copy.page_capacity());
    // Every token has one slot, holding its key and projection.
    std::vector<int64_t> row_of(static_cast<std::size_t>(count), -1);
    for (int64_t row = 0; row < count; ++row) {
        const float* key = storage.data() + row * dim;
        int32_t token = -1;
        std::memcpy(&token, storage.data() + count * (dim + 1) + row, sizeof token);
        REQUIRE(token >= 0);
        REQUIRE(token < count);
        REQUIRE(row_of[static_cast<std::size_t>(token)] == -1);
        row_of[static_cast<std::size_t>(token)] = row;
        REQUIRE(std::equal(key, key + dim, keys.data() + token * dim));
        REQUIRE(storage[static_cast<std::size_t>(count * dim + row)] == copy.projection_of(token));
    }
    // The same pages per point, with the same tokens; each point's children side by side.
    for (int32_t owner = -1; owner < static_cast<int32_t>(count); ++owner) {
        if (owner >= 0 && copy.level(owner) == 0) continue;
        const auto pages = in_place.child_pages(owner);
        REQUIRE(
            std::vector<int32_t>(pages.begin(), pages.end()) ==
            std::vector<int32_t>(copy.child_pages(owner).begin(), copy.child_pages(owner).end()));
        std::vector<int64_t> rows;
        for (int32_t page : pages) {
            const std::vector<int32_t> tokens = in_place.tokens_of_page(page);
            REQUIRE(tokens == copy.tokens_of_page(page));
            for (int32_t token : tokens)
                rows.push_back(row_of[static_cast<std::size_t>(token)]);
        }
        for (std::size_t i = 1; i < rows.size(); ++i)
            REQUIRE(rows[i] == rows[i - 1] + 1);
    }
    reads = key_rows_read = 0;
    // Queries score the same keys: the same pages, scores and work, each point's chosen
    // children read in one run, from the storage, through `read`, or from memory the index
    // owns.
    DciIndex direct(dim, random_direction(31)), owned(dim, random_direction(31));
    std::vector<float> direct_storage(storage.size());
    direct.restore_in_place(reader, count, layout, "'a.kvc'", {direct_storage.data(), {}});
    CHECK(direct_storage == storage);
    owned.restore_in_place(reader, count, layout, "'a.kvc'", {});
    CHECK(owned.in_place());
    const std::vector<float> queries = clustered_keys(12, 12, 32);
    int64_t dot_products = 0;
    for (int q = 0; q < 12; ++q) {
        const float* query = queries.data() + q * dim;
        const DciQueryResult a = copy.query(query, {}), b = in_place.query(query, {});
        CHECK(a.pages == b.pages);
        CHECK(a.page_scores == b.page_scores);
        CHECK(a.dot_products == b.dot_products);
        for (const DciIndex* other : {&direct, &owned}) {
            const DciQueryResult c = other->query(query, {});
            CHECK(c.pages == a.pages);
            CHECK(c.page_scores == a.page_scores);
        }
        dot_products += b.dot_products;
    }
    // The keys read are those scored, each expanded point's in one run (with its children's
    // projections and tokens: three reads a point).
    CHECK(key_rows_read == dot_products);
    CHECK(reads * 10 < key_rows_read);  // runs of many keys, not a read per key
    CHECK_THROWS_WITH(in_place.insert(keys.data(), 1), Catch::Contains("restored in place"));
    DciLayout bad = layout;
    bad.page_tokens[1] = bad.page_tokens[0];
    CHECK_THROWS_WITH(in_place.restore_in_place(reader, count, bad, "'a.kvc'", on_disk),
                      Catch::Contains("'a.kvc': invalid index"));
    KeyStorage unreadable;
    unreadable.read = on_disk.read;  // reads back storage it was not given
    CHECK_THROWS_AS(in_place.restore_in_place(reader, count, layout, "'a.kvc'", unreadable),
                    UsageError);
}
