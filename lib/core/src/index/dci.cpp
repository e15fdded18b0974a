#include "kv/index/dci.hpp"

#include "kv/error.hpp"
#include "kv/float_convert.hpp"
#include "kv/memory.hpp"
#include "kv/model/gemv.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>

namespace kv {

namespace {

double dot(const float* a, const float* b, int64_t n) {
    float sum = 0;
    for (int64_t i = 0; i < n; ++i)
        sum += a[i] * b[i];
    return sum;
}

// out[r] = dot(row(r), other(r), n) for r < count, each the same float sum in the same order, 8
// rows' chains of dependent additions interleaved: one chain at a time, each addition waiting
// for the one before, the keys' squared norms were a third of restoring an index and their
// lifted distances a third of building one.
template <typename Row, typename Other>
void dots_in_order(int64_t count, int64_t n, Row&& row, Other&& other, float* out) {
    constexpr int together = 8;
    int64_t r = 0;
    for (; r + together <= count; r += together) {
        float sums[together] = {};
        const float* a[together];
        const float* b[together];
        for (int g = 0; g < together; ++g) {
            a[g] = row(r + g);
            b[g] = other(r + g);
        }
        for (int64_t i = 0; i < n; ++i)
#pragma GCC unroll 8
            for (int g = 0; g < together; ++g)
                sums[g] += a[g][i] * b[g][i];
        std::copy_n(sums, together, out + r);
    }
    for (; r < count; ++r)
        out[r] = static_cast<float>(dot(row(r), other(r), n));
}

constexpr int32_t free_page = -2;

// Asks for [data, data + bytes) to be brought into the cache, a line at a time. On x86 as an
// instruction the compiler keeps: g++ 12 deleted a loop of __builtin_prefetch alone as a loop
// without effects.
void prefetch_range(const void* data, int64_t bytes) {
    const auto* bytes_at = static_cast<const char*>(data);
    for (int64_t offset = 0; offset < bytes; offset += 64) {
#if defined(__x86_64__) || defined(__i386__)
        asm volatile("prefetcht0 %0" : : "m"(bytes_at[offset]));
#else
        __builtin_prefetch(bytes_at + offset);
#endif
    }
}

}  // namespace

std::pair<std::size_t, std::size_t> nearest_in_projection(std::span<const float> projections,
                                                          float target, std::size_t wanted) {
    const std::size_t count = projections.size();
    if (wanted >= count) return {0, count};
    // The run starts within `wanted` of target's place. Moving it one to the right trades its
    // first value for the one after its end, which the merge does unless the first is strictly
    // nearer; that holds from some start on (the values are sorted), found by bisection. (A
    // merge outward one value at a time, as M-DCI walks, cost a mispredicted branch per value:
    // a quarter of expanding a point at 131k tokens.)
    const auto split = static_cast<std::size_t>(
        std::lower_bound(projections.begin(), projections.end(), target) - projections.begin());
    std::size_t low = split > wanted ? split - wanted : 0, high = std::min(split, count - wanted);
    while (low < high) {
        const std::size_t middle = low + (high - low) / 2;
        if (target - projections[middle] < projections[middle + wanted] - target)
            high = middle;
        else
            low = middle + 1;
    }
    return {low, low + wanted};
}

std::vector<float> dci_projection(int64_t head_dim, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> draws(static_cast<std::size_t>(head_dim + 1));
    double norm = 0;
    for (double& value : draws) {
        value = normal(rng);
        norm += value * value;
    }
    std::vector<float> direction;
    for (double value : draws)
        direction.push_back(static_cast<float>(value / std::sqrt(norm)));
    return direction;
}

void validate_dci_options(const DciOptions& options) {
    if (options.page_size < 2 || options.page_size > 4096)
        throw UsageError("page size must lie in [2, 4096], not " +
                         std::to_string(options.page_size));
    auto shortest = [](double value) {
        char text[32];
        std::snprintf(text, sizeof text, "%g", value);
        return std::string(text);
    };
    auto ratio = [&](const char* name, double value) {
        if (!(value > 0 && value < 1))
            throw UsageError(std::string(name) + " must lie in (0, 1), not " + shortest(value));
    };
    // Named as kvindex's options too: their range checks (closed ranges) let 0 through.
    ratio("the first promotion ratio (p0, --promotion-first)", options.promotion_first);
    ratio("the promotion ratio of higher levels (p1, --promotion-rest)", options.promotion_rest);
    if (!(options.norm_headroom >= 1))
        throw UsageError("norm headroom must be at least 1, not " +
                         shortest(options.norm_headroom));
    if (options.anchor_interval < 1)
        throw UsageError("anchor interval must be at least 1, not " +
                         std::to_string(options.anchor_interval));
    if (options.exact_parent_limit < 0)
        throw UsageError("exact parent limit must not be negative, not " +
                         std::to_string(options.exact_parent_limit));
}

DciIndex::DciIndex(int64_t head_dim, std::vector<float> projection, DciOptions options)
    : head_dim_(head_dim), direction_(std::move(projection)), options_(options) {
    if (head_dim_ <= 0) throw UsageError("dci: head_dim must be positive");
    if (static_cast<int64_t>(direction_.size()) != head_dim_ + 1)
        throw UsageError(
            "dci: the projection needs head_dim + 1 = " + std::to_string(head_dim_ + 1) +
            " values, not " + std::to_string(direction_.size()));
    double norm = 0;
    for (float value : direction_)
        norm += static_cast<double>(value) * value;
    if (!(norm > 0) || !std::isfinite(norm)) throw UsageError("dci: the projection is zero");
    for (float& value : direction_)
        value = static_cast<float>(value / std::sqrt(norm));
    validate_dci_options(options_);
    reset();
}

void DciIndex::reset() {
    keys_.clear();
    key_storage_ = {};
    std::vector<float>().swap(owned_storage_);
    in_place_ = false;
    token_count_ = 0;
    owner_slots_.clear();
    owner_of_point_.clear();
    page_first_slot_.clear();
    page_size_.clear();
    owner_page_ids_.clear();
    owner_page_sizes_.clear();
    squared_norm_.clear();
    projection_value_.clear();
    level_.clear();
    parent_.clear();
    parent_distance_.clear();
    token_page_.clear();
    level_points_.assign(1, {});
    level_count_.clear();
    next_target_ = 0;
    owner_.clear();
    owned_pages_.assign(1, {});  // the root's
    owned_pages_below_.assign(1, 0);
    pages_.clear();
    free_pages_.clear();
    dirty_.clear();
    packed_keys_.clear();
    packed_norms_.clear();
    max_squared_norm_ = 0;
}

std::vector<int32_t>& DciIndex::pages_of(int32_t parent) {
    if (parent < 0) return owned_pages_.front();
    int32_t& owner = owner_[static_cast<std::size_t>(parent)];
    if (owner < 0) {  // a point's first page: it joins the owners
        owner = static_cast<int32_t>(owned_pages_.size());
        owned_pages_.emplace_back();
        owned_pages_below_.push_back(0);
    }
    return owned_pages_[static_cast<std::size_t>(owner)];
}
const std::vector<int32_t>& DciIndex::pages_of(int32_t parent) const {
    static const std::vector<int32_t> none;
    const int32_t owner = owner_index(parent);
    return owner < 0 ? none : owned_pages_[static_cast<std::size_t>(owner)];
}

int64_t DciIndex::pages_below(int32_t point) const {
    const int32_t owner = owner_index(point);
    return owner < 0 ? 0 : owned_pages_below_[static_cast<std::size_t>(owner)];
}

int32_t DciIndex::owner_index(int32_t point) const {
    if (point < 0) return 0;
    if (!in_place()) return owner_[static_cast<std::size_t>(point)];
    return owner_of_point_.find(point);
}

// Deterministic promotion, M-DCI's rule (construct_new_tree with random = false, which its
// one-point inserts continue): each token goes to the level the previous decision named; the
// token that brings the top level to ceil(1/p) points sends the next one to open a new level,
// and a token of a lower level sends the next one up a level once its level holds at least 1/p
// times the points of the level above. Counts are exact per level and the arithmetic is
// M-DCI's float arithmetic, so that the level sizes are the authors' (systematic sampling in
// token order: about p of each level rises to the next).
int DciIndex::next_level() {
    const int levels = static_cast<int>(level_count_.size());
    const int target = next_target_;
    const float p =
        static_cast<float>(target > 0 ? options_.promotion_rest : options_.promotion_first);
    if (target == levels) {
        level_count_.push_back(0);
        next_target_ = 0;
    } else if (target == levels - 1) {
        const auto promoted = static_cast<int64_t>(std::ceil(1.0f / p));
        next_target_ =
            level_count_[static_cast<std::size_t>(target)] + 1 == promoted ? target + 1 : 0;
    } else {
        next_target_ =
            static_cast<float>(level_count_[static_cast<std::size_t>(target)] + 1) >=
                    static_cast<float>(level_count_[static_cast<std::size_t>(target) + 1]) / p
                ? target + 1
                : 0;
    }
    ++level_count_[static_cast<std::size_t>(target)];
    return target;
}

void DciIndex::add_token(const float* key) {
    keys_.insert(keys_.end(), key, key + head_dim_);
    const double squared = dot(key, key, head_dim_);
    squared_norm_.push_back(static_cast<float>(squared));
    const int level = next_level();
    if (level > 127) throw Error("dci: too many levels");
    const auto token = static_cast<int32_t>(level_.size());
    level_.push_back(static_cast<int8_t>(level));
    parent_.push_back(-1);
    parent_distance_.push_back(0);
    token_page_.push_back(-1);
    projection_value_.push_back(0);
    while (static_cast<int>(level_points_.size()) <= level)
        level_points_.emplace_back();
    level_points_[level].push_back(token);
    // Points own a slot in the per-point tables; the root's stays last.
    owner_.push_back(-1);
}

float DciIndex::project(const float* key, double squared_norm) const {
    return projection(dot(direction_.data(), key, head_dim_), squared_norm);
}

float DciIndex::projection(double along, double squared_norm) const {
    const double tail = std::sqrt(std::max(0.0, max_squared_norm_ - squared_norm));
    return static_cast<float>(along + tail * direction_[static_cast<std::size_t>(head_dim_)]);
}

double DciIndex::lifted_distance_to(const float* key, double squared_norm, int64_t other) const {
    return lifted_from_dot(dot(key, this->key(other), head_dim_), squared_norm,
                           squared_norm_[other]);
}

double DciIndex::lifted_from_dot(double dot, double squared_norm, double other_squared_norm) const {
    const double tails = std::sqrt(std::max(0.0, max_squared_norm_ - squared_norm) *
                                   std::max(0.0, max_squared_norm_ - other_squared_norm));
    return max_squared_norm_ - dot - tails;
}

double DciIndex::lifted_distance(int64_t a, int64_t b) const {
    return lifted_distance_to(key(a), squared_norm_[a], b);
}

void DciIndex::lifted_distances(int64_t token, std::span<const int32_t> others,
                                std::vector<double>& out) const {
    thread_local std::vector<float> dots;
    const auto count = static_cast<int64_t>(others.size());
    dots.resize(others.size());
    const float* from = key(token);
    dots_in_order(
        count, head_dim_, [&](int64_t) { return from; },
        [&](int64_t i) { return key(others[static_cast<std::size_t>(i)]); }, dots.data());
    const double squared_norm = squared_norm_[static_cast<std::size_t>(token)];
    out.resize(others.size());
    for (std::size_t i = 0; i < others.size(); ++i)
        out[i] = lifted_from_dot(dots[i], squared_norm, squared_norm_[others[i]]);
}

void DciIndex::pack_level(int level) {
    if (static_cast<int>(packed_keys_.size()) <= level) {
        packed_keys_.resize(static_cast<std::size_t>(level) + 1);
        packed_norms_.resize(static_cast<std::size_t>(level) + 1);
    }
    std::vector<float>& packed = packed_keys_[static_cast<std::size_t>(level)];
    std::vector<float>& norms = packed_norms_[static_cast<std::size_t>(level)];
    const std::vector<int32_t>& points = level_points_[static_cast<std::size_t>(level)];
    for (std::size_t i = norms.size(); i < points.size(); ++i) {
        packed.insert(packed.end(), key(points[i]), key(points[i]) + head_dim_);
        norms.push_back(squared_norm_[static_cast<std::size_t>(points[i])]);
    }
}

// Brute force over a level packed row by row: one row kernel for the dot products.
int32_t DciIndex::nearest_exact(int64_t token, int level) const {
    const std::vector<int32_t>& points = level_points_[static_cast<std::size_t>(level)];
    const std::vector<float>& packed = packed_keys_[static_cast<std::size_t>(level)];
    const std::vector<float>& norms = packed_norms_[static_cast<std::size_t>(level)];
    const std::size_t count = norms.size();  // packed by pack_level before any search
    std::vector<float> dots(count);
    dot_rows_f32(packed.data(), key(token), dots.data(), static_cast<int64_t>(count), head_dim_);
    const double tail = std::sqrt(
        std::max(0.0, max_squared_norm_ - squared_norm_[static_cast<std::size_t>(token)]));
    int32_t best = -1;
    double best_distance = std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < count; ++i) {
        const double distance = max_squared_norm_ - dots[i] -
                                tail * std::sqrt(std::max(0.0, max_squared_norm_ - norms[i]));
        if (distance < best_distance) best_distance = distance, best = points[i];
    }
    return best;
}

// The approximate parent search for a large level: a beam of the construction field of view
// carried down from the top level through each kept point's children.
int32_t DciIndex::nearest_descending(int64_t token, int level) const {
    const int top = levels() - 1;
    const auto beam_width =
        static_cast<std::size_t>(std::max<int64_t>(1, options_.construction_field_of_view));
    std::vector<std::pair<double, int32_t>> beam;
    std::vector<int32_t> points = level_points_[top];
    std::vector<double> distances;
    lifted_distances(token, points, distances);
    for (std::size_t i = 0; i < points.size(); ++i)
        beam.emplace_back(distances[i], points[i]);
    for (int current = top; current > level + 1; --current) {
        std::sort(beam.begin(), beam.end());
        if (beam.size() > beam_width) beam.resize(beam_width);
        points.clear();
        for (const auto& [distance, point] : beam)
            for (int32_t page : pages_of(point))
                for (int32_t child : pages_[page].tokens)
                    if (level_[child] == current - 1) points.push_back(child);
        if (points.empty()) break;  // unreachable with a consistent tree
        lifted_distances(token, points, distances);
        beam.clear();
        for (std::size_t i = 0; i < points.size(); ++i)
            beam.emplace_back(distances[i], points[i]);
    }
    return std::min_element(beam.begin(), beam.end())->second;
}

void DciIndex::assign_parents(int level, int threads) {
    const std::vector<int32_t>& points = level_points_[level];
    const int top = levels() - 1;
    if (level == top) {
        for (int32_t point : points)
            parent_[point] = -1, parent_distance_[point] = 0;
        return;
    }
    // The nearest point one level up: exactly while that level is small (M-DCI's brute force
    // below its threshold of 3,000), else by a beam descent.
    const bool exact =
        static_cast<int64_t>(level_points_[level + 1].size()) <= options_.exact_parent_limit;
    pack_level(level + 1);
    auto assign = [&](std::size_t begin, std::size_t end, const std::vector<int32_t>& which) {
        for (std::size_t i = begin; i < end; ++i) {
            const int32_t point = which[i];
            parent_[point] =
                exact ? nearest_exact(point, level + 1) : nearest_descending(point, level);
            parent_distance_[point] = static_cast<float>(lifted_distance(point, parent_[point]));
        }
    };
    auto in_parallel = [&](const std::vector<int32_t>& which, auto&& work) {
        const std::size_t count = which.size();
        const std::size_t workers =
            std::min<std::size_t>(static_cast<std::size_t>(std::max(1, threads)), count / 64 + 1);
        if (workers <= 1) return work(0, count, which);
        std::vector<std::thread> pool;
        for (std::size_t w = 0; w < workers; ++w)
            pool.emplace_back(
                [&, w] { work(count * w / workers, count * (w + 1) / workers, which); });
        for (std::thread& thread : pool)
            thread.join();
    };
    // The anchor shortcut (M-DCI, construct_new_tree), for the finest level of an index of more
    // than `exact_parent_limit` tokens: neighbouring tokens tend to share a cluster, so every
    // n-th token (and the last) is an anchor with its own parent, and the others take the
    // nearest of their neighbouring anchors' parents when it lies within `anchor_threshold` of
    // that parent's reach (its farthest child so far, which each accepted token extends).
    if (level != 0 || static_cast<int64_t>(points.size()) <= options_.exact_parent_limit)
        return in_parallel(points, assign);
    const auto interval = static_cast<std::size_t>(std::max<int64_t>(1, options_.anchor_interval));
    std::vector<int32_t> anchors;
    std::vector<std::size_t> anchor_at;  // index in points of each anchor
    for (std::size_t i = 0; i < points.size(); i += interval)
        anchors.push_back(points[i]), anchor_at.push_back(i);
    if (anchor_at.back() != points.size() - 1)
        anchors.push_back(points.back()), anchor_at.push_back(points.size() - 1);
    in_parallel(anchors, assign);
    std::vector<double> reach(level_.size(), 0.0);
    for (int32_t anchor : anchors)
        reach[parent_[anchor]] = std::max<double>(reach[parent_[anchor]], parent_distance_[anchor]);

    // One pass in token order: M-DCI runs it on many threads, each acceptance widening a reach
    // the others read, so that its parents depend on the schedule; in order they do not.
    const auto neighbours =
        static_cast<std::size_t>(std::max<int64_t>(1, options_.anchor_neighbours));
    std::vector<int32_t> candidates, rejected;
    std::vector<double> candidate_distances;
    for (std::size_t i = 0; i < points.size(); ++i) {
        const int32_t point = points[i];
        const std::size_t slot = static_cast<std::size_t>(
            std::upper_bound(anchor_at.begin(), anchor_at.end(), i) - anchor_at.begin());
        if (slot > 0 && anchor_at[slot - 1] == i) continue;  // an anchor itself
        candidates.clear();
        const std::size_t first = slot > neighbours ? slot - neighbours : 0;
        const std::size_t last = std::min(anchors.size(), slot + neighbours);
        for (std::size_t a = first; a < last; ++a)
            candidates.push_back(parent_[anchors[a]]);
        std::sort(candidates.begin(), candidates.end());
        candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
        int32_t best = -1;
        double best_distance = std::numeric_limits<double>::infinity();
        lifted_distances(point, candidates, candidate_distances);
        for (std::size_t c = 0; c < candidates.size(); ++c)
            if (candidate_distances[c] < best_distance)
                best_distance = candidate_distances[c], best = candidates[c];
        if (best < 0 || reach[best] * options_.anchor_threshold < best_distance) {
            rejected.push_back(point);
            continue;
        }
        parent_[point] = best;
        parent_distance_[point] = static_cast<float>(best_distance);
        reach[best] = std::max(reach[best], best_distance);
    }
    // The tokens no neighbouring anchor's parent took search as the anchors did.
    in_parallel(rejected, assign);
}

int32_t DciIndex::new_page(int32_t parent) {
    int32_t page;
    if (!free_pages_.empty()) {
        page = free_pages_.back();
        free_pages_.pop_back();
    } else {
        page = static_cast<int32_t>(pages_.size());
        pages_.emplace_back();
        dirty_.push_back(0);
    }
    pages_[page].parent = parent;
    pages_[page].tokens.clear();
    dirty_[page] = 1;
    return page;
}

// Bulk layout: the children in projection order, cut into ceil(n / size) pages as evenly as
// possible (M-DCI's bulk load).
void DciIndex::lay_out_pages(int32_t parent, std::vector<int32_t> children) {
    std::sort(children.begin(), children.end(), [&](int32_t a, int32_t b) {
        return projection_value_[a] != projection_value_[b]
                   ? projection_value_[a] < projection_value_[b]
                   : a < b;
    });
    const auto size = static_cast<std::size_t>(options_.page_size);
    std::size_t remaining_pages = (children.size() + size - 1) / size;
    std::size_t next = 0;
    while (next < children.size()) {
        const std::size_t take = (children.size() - next) / remaining_pages--;
        const int32_t page = new_page(parent);
        pages_of(parent).push_back(page);
        for (std::size_t i = next; i < next + take; ++i) {
            pages_[page].tokens.push_back(children[i]);
            token_page_[children[i]] = page;
        }
        next += take;
    }
}

void DciIndex::count_pages_below() {
    std::fill(owned_pages_below_.begin(), owned_pages_below_.end(), 0);
    auto below = [&](int32_t point) -> int64_t& {
        return owned_pages_below_[point < 0 ? 0 : static_cast<std::size_t>(owner_[point])];
    };
    if (levels() == 1) {
        below(-1) = static_cast<int64_t>(pages_of(-1).size());
        return;
    }
    for (int32_t point : level_points_[1])
        if (owner_[point] >= 0) below(point) = static_cast<int64_t>(pages_of(point).size());
    // A point with pages below it has children, hence pages of its own and a parent that has.
    for (int level = 1; level < levels(); ++level)
        for (int32_t point : level_points_[level])
            if (owner_[point] >= 0) below(parent_[point]) += below(point);
}

void DciIndex::build(const float* keys, int64_t count, int threads) {
    if (count < 0) throw UsageError("dci: negative key count");
    reset();
    keys_.reserve(static_cast<std::size_t>(count * head_dim_));
    advise_huge_pages(keys_.data(), keys_.capacity() * sizeof(float));
    for (int64_t token = 0; token < count; ++token)
        add_token(keys + token * head_dim_);
    double largest = 0;
    for (float squared : squared_norm_)
        largest = std::max<double>(largest, squared);
    max_squared_norm_ = largest > 0 ? largest * options_.norm_headroom : 1.0;
    for (int64_t token = 0; token < count; ++token)
        projection_value_[token] = project(key(token), squared_norm_[token]);
    // Top down, so that a level's pages exist when the level below searches through them.
    for (int level = levels() - 1; level >= 0; --level) {
        assign_parents(level, threads);
        std::vector<std::vector<int32_t>> children(level_.size() + 1);
        for (int32_t point : level_points_[level])
            children[parent_[point] < 0 ? level_.size() : static_cast<std::size_t>(parent_[point])]
                .push_back(point);
        for (std::size_t owner = 0; owner < children.size(); ++owner)
            if (!children[owner].empty())
                lay_out_pages(owner == level_.size() ? -1 : static_cast<int32_t>(owner),
                              std::move(children[owner]));
    }
    count_pages_below();
}

void DciIndex::place(int64_t token, int32_t parent) {
    parent_[token] = parent;
    parent_distance_[token] =
        parent < 0 ? 0.0f : static_cast<float>(lifted_distance(token, parent));
    std::vector<int32_t>& owned = pages_of(parent);
    if (owned.empty()) owned.push_back(new_page(parent));
    const float value = projection_value_[token];
    // The first page whose last token is not below the new one, else the last page.
    std::size_t slot = 0;
    while (slot + 1 < owned.size() && projection_value_[pages_[owned[slot]].tokens.back()] < value)
        ++slot;
    const int32_t page = owned[slot];
    std::vector<int32_t>& tokens = pages_[page].tokens;
    const auto at = std::upper_bound(tokens.begin(), tokens.end(), value,
                                     [&](float v, int32_t t) { return v < projection_value_[t]; });
    tokens.insert(at, static_cast<int32_t>(token));
    token_page_[token] = page;
    dirty_[page] = 1;
    if (static_cast<int64_t>(tokens.size()) > options_.page_size) {
        // Split in halves; the upper half moves to a new page right after this one.
        const int32_t upper = new_page(parent);
        std::vector<int32_t>& full = pages_[page].tokens;  // new_page may have grown pages_
        const std::size_t half = full.size() / 2;
        pages_[upper].tokens.assign(full.begin() + static_cast<std::ptrdiff_t>(half), full.end());
        full.resize(half);
        for (int32_t moved : pages_[upper].tokens)
            token_page_[moved] = upper;
        std::vector<int32_t>& list = pages_of(parent);
        list.insert(list.begin() + static_cast<std::ptrdiff_t>(slot) + 1, upper);
    }
}

void DciIndex::free_page_slot(int32_t page) {
    std::vector<int32_t>& list = pages_of(pages_[page].parent);
    list.erase(std::find(list.begin(), list.end(), page));
    pages_[page].parent = free_page;
    pages_[page].tokens.clear();
    free_pages_.push_back(page);
}

void DciIndex::shift_tokens(int32_t from, int32_t to, std::size_t count) {
    std::vector<int32_t>& source = pages_[from].tokens;
    std::vector<int32_t>& target = pages_[to].tokens;
    const std::vector<int32_t>& list = pages_of(pages_[from].parent);
    const bool forward =
        std::find(list.begin(), list.end(), from) < std::find(list.begin(), list.end(), to);
    // Pages follow projection order: the source's last tokens lead the next page, its first
    // tokens end the page before.
    const auto moved_begin =
        forward ? source.end() - static_cast<std::ptrdiff_t>(count) : source.begin();
    const std::vector<int32_t> moved(moved_begin, moved_begin + static_cast<std::ptrdiff_t>(count));
    source.erase(moved_begin, moved_begin + static_cast<std::ptrdiff_t>(count));
    target.insert(forward ? target.begin() : target.end(), moved.begin(), moved.end());
    for (int32_t token : moved)
        token_page_[token] = to;
    dirty_[from] = dirty_[to] = 1;
}

// As a leaf of M-DCI's B+-tree: a page left with fewer than half its slots borrows from a
// neighbour that has more than half (the fuller one), or merges with a neighbour, so that a
// retrieved page holds the tokens the budget counts on. A parent's only page may hold fewer.
void DciIndex::remove(int64_t token) {
    const int32_t page = token_page_[token];
    std::vector<int32_t>& tokens = pages_[page].tokens;
    tokens.erase(std::find(tokens.begin(), tokens.end(), static_cast<int32_t>(token)));
    token_page_[token] = -1;
    dirty_[page] = 1;
    const std::vector<int32_t>& list = pages_of(pages_[page].parent);
    const auto minimum = static_cast<std::size_t>(options_.page_size / 2);
    if (pages_[page].tokens.size() >= minimum) return;
    if (list.size() == 1) {
        if (pages_[page].tokens.empty()) free_page_slot(page);
        return;
    }
    const auto slot =
        static_cast<std::size_t>(std::find(list.begin(), list.end(), page) - list.begin());
    const int32_t left = slot > 0 ? list[slot - 1] : -1;
    const int32_t right = slot + 1 < list.size() ? list[slot + 1] : -1;
    auto size_of = [&](int32_t other) { return pages_[other].tokens.size(); };
    auto few = [&](int32_t other) { return other < 0 || size_of(other) <= minimum; };
    if (few(left) && few(right)) {
        // Merged into the page before, else the page after into this one.
        const int32_t kept = left >= 0 ? left : page, gone = left >= 0 ? page : right;
        shift_tokens(gone, kept, size_of(gone));
        free_page_slot(gone);
        return;
    }
    // Borrowed from the neighbour with tokens to spare (the fuller when both have), half the
    // difference.
    const int32_t donor = few(left)                         ? right
                          : few(right)                      ? left
                          : size_of(left) <= size_of(right) ? right
                                                            : left;
    shift_tokens(donor, page, (size_of(donor) - size_of(page)) / 2);
}

void DciIndex::reproject_and_rebuild() {
    // A key beyond the norm bound changes every lifted coordinate: lay everything out again.
    const std::vector<float> keys = keys_;
    const int64_t count = size();
    const std::size_t old_pages = pages_.size();
    build(keys.data(), count, 1);
    if (dirty_.size() < old_pages) dirty_.resize(old_pages, 0);
    std::fill(dirty_.begin(), dirty_.end(), 1);
}

void DciIndex::insert(const float* keys, int64_t count) {
    if (in_place())
        throw Error("dci: an index restored in place takes no new tokens (it keeps no keys)");
    for (int64_t i = 0; i < count; ++i) {
        const float* key = keys + i * head_dim_;
        const int previous_levels = levels();
        add_token(key);
        const auto token = static_cast<int32_t>(size() - 1);
        if (squared_norm_[token] > max_squared_norm_) {
            reproject_and_rebuild();
            continue;
        }
        projection_value_[token] = project(key, squared_norm_[token]);
        const int level = level_[token];
        const int top = levels() - 1;
        if (top > 0 && levels() > previous_levels) {
            // A new top level: the former top points (the root's children) move under it.
            std::vector<int32_t> former(level_points_[top - 1].begin(),
                                        level_points_[top - 1].end());
            former.erase(std::remove(former.begin(), former.end(), token), former.end());
            for (int32_t point : former)
                remove(point);
            for (int32_t point : former)
                place(point, token);
            place(token, -1);
        } else if (level == top) {
            place(token, -1);
        } else {
            const bool exact = static_cast<int64_t>(level_points_[level + 1].size()) <=
                               options_.exact_parent_limit;
            pack_level(level + 1);
            place(token,
                  exact ? nearest_exact(token, level + 1) : nearest_descending(token, level));
        }
        if (level >= 1 && !(top > 0 && levels() > previous_levels)) {
            // A new parent adopts the points one level down that are closer to it.
            for (int32_t point : level_points_[level - 1]) {
                if (point == token) continue;
                if (lifted_distance(point, token) < parent_distance_[point]) {
                    remove(point);
                    place(point, token);
                }
            }
        }
        count_pages_below();
    }
}

DciLayout DciIndex::layout() const {
    DciLayout out;
    out.max_squared_norm = max_squared_norm_;
    out.levels = level_;
    out.parents = parent_;
    for (const Page& page : pages_) {
        if (page.parent == free_page) continue;
        out.page_sizes.push_back(static_cast<int32_t>(page.tokens.size()));
        out.page_tokens.insert(out.page_tokens.end(), page.tokens.begin(), page.tokens.end());
    }
    return out;
}

void DciIndex::restore(const float* keys, int64_t count, const DciLayout& layout,
                       const std::string& source) {
    restore_from(
        [&](std::span<const int32_t> tokens, float* out) {
            for (std::size_t i = 0; i < tokens.size(); ++i)
                std::copy_n(keys + static_cast<int64_t>(tokens[i]) * head_dim_, head_dim_,
                            out + static_cast<int64_t>(i) * head_dim_);
        },
        count, layout, source, true);
}

void DciIndex::restore_in_place(const KeyReader& read, int64_t count, const DciLayout& layout,
                                const std::string& source, KeyStorage storage,
                                const Bf16KeyReader& read_bf16) {
    if (!storage.floats && storage.read)
        throw UsageError("dci: restore_in_place reads back storage it was not given");
    restore_from(read, count, layout, source, false);
    // Slots: the root's children, then each point's, page after page in projection order; the
    // pages keep their ids, as a slot range each.
    const auto n = static_cast<std::size_t>(count);
    std::vector<int32_t> token_at(n);
    owner_slots_.assign(owned_pages_.size(), {});
    page_first_slot_.assign(pages_.size(), -1);
    page_size_.assign(pages_.size(), 0);
    owner_page_ids_.clear();
    owner_page_sizes_.clear();
    int32_t next = 0;
    auto lay_out = [&](std::size_t owner) {
        OwnerSlots& slots = owner_slots_[owner];
        slots.first_slot = next;
        slots.pages_begin = static_cast<int32_t>(owner_page_ids_.size());
        slots.pages = static_cast<int32_t>(owned_pages_[owner].size());
        for (int32_t page : owned_pages_[owner]) {
            const std::vector<int32_t>& tokens = pages_[static_cast<std::size_t>(page)].tokens;
            page_first_slot_[static_cast<std::size_t>(page)] = next;
            page_size_[static_cast<std::size_t>(page)] = static_cast<int32_t>(tokens.size());
            owner_page_ids_.push_back(page);
            owner_page_sizes_.push_back(static_cast<int32_t>(tokens.size()));
            for (int32_t token : tokens)
                token_at[static_cast<std::size_t>(next++)] = token;
        }
        slots.children = next - slots.first_slot;
    };
    lay_out(0);
    std::vector<std::pair<int32_t, int32_t>> owners;
    for (std::size_t point = 0; point < n; ++point)
        if (owner_[point] >= 0) {
            owners.emplace_back(static_cast<int32_t>(point), owner_[point]);
            lay_out(static_cast<std::size_t>(owner_[point]));
        }
    owner_of_point_.assign(owners);
    if (storage.bf16_keys && head_dim_ % 2 != 0)
        throw UsageError("dci: bf16 keys need an even head_dim");
    if (!storage.floats) {
        // Huge pages where it is large (a 32k-token head's is ~4.3 MiB): zeroed 4 KiB page by page,
        // the storage was half of restoring a 1B shape's 128 indexes (perf: the page faults).
        owned_storage_.clear();
        resize_for_bulk_read(owned_storage_, static_cast<std::size_t>(dci_storage_floats(
                                                 count, head_dim_, storage.bf16_keys)));
        storage.floats = owned_storage_.data();
    }
    key_storage_.bf16_keys = storage.bf16_keys;
    token_count_ = count;
    // The keys slot by slot, then the projections, then the token ids; written front to back.
    float* keys_out = storage.floats;
    float* projections_out = keys_out + projections_at();
    float* tokens_out = keys_out + tokens_at();
    constexpr int64_t chunk = 4096;
    std::vector<float> wide;
    for (int64_t first = 0; first < count; first += chunk) {
        const int64_t rows = std::min(chunk, count - first);
        const std::span<const int32_t> tokens(token_at.data() + first,
                                              static_cast<std::size_t>(rows));
        if (storage.bf16_keys && read_bf16) {
            read_bf16(tokens, reinterpret_cast<uint16_t*>(keys_out + key_floats_of(first)));
        } else if (storage.bf16_keys) {
            wide.resize(static_cast<std::size_t>(rows * head_dim_));
            read(tokens, wide.data());
            auto* narrow = reinterpret_cast<uint16_t*>(keys_out + key_floats_of(first));
            for (std::size_t i = 0; i < wide.size(); ++i)
                narrow[i] = float_to_bf16(wide[i]);
        } else {
            read(tokens, keys_out + key_floats_of(first));
        }
        for (int64_t i = 0; i < rows; ++i) {
            projections_out[first + i] = projection_value_[static_cast<std::size_t>(tokens[i])];
            std::memcpy(tokens_out + first + i, &tokens[static_cast<std::size_t>(i)],
                        sizeof(float));
        }
    }
    key_storage_ = std::move(storage);
    in_place_ = true;
    // Only the pages, the owners and the levels' count stay in memory: per token, nothing.
    const std::size_t level_count = level_points_.size();
    std::vector<std::vector<int32_t>>(level_count).swap(level_points_);
    std::vector<float>().swap(squared_norm_);
    std::vector<float>().swap(projection_value_);
    std::vector<int8_t>().swap(level_);
    std::vector<int32_t>().swap(parent_);
    std::vector<int32_t>().swap(token_page_);
    std::vector<int32_t>().swap(owner_);
    std::vector<Page>().swap(pages_);
    std::vector<int32_t>().swap(free_pages_);
    std::vector<uint8_t>().swap(dirty_);
}

void DciIndex::copy_key(int32_t token, float* out) const {
    std::copy_n(key(token), head_dim_, out);
}

std::vector<int32_t> DciIndex::tokens_of_page(int32_t page) const {
    if (!in_place()) return pages_[static_cast<std::size_t>(page)].tokens;
    const int32_t first = page_first_slot_[static_cast<std::size_t>(page)];
    const int32_t size = page_size_[static_cast<std::size_t>(page)];
    std::vector<float> buffer;
    const float* bits = storage_floats(tokens_at() + first, size, buffer);
    std::vector<int32_t> tokens(static_cast<std::size_t>(size));
    std::memcpy(tokens.data(), bits, static_cast<std::size_t>(size) * sizeof(float));
    return tokens;
}

int64_t dci_storage_floats(int64_t count, int64_t head_dim, bool bf16_keys) {
    return count * (bf16_keys ? head_dim / 2 : head_dim) + 2 * count;
}

int64_t DciIndex::key_floats_of(int64_t slots) const {
    return slots * (key_storage_.bf16_keys ? head_dim_ / 2 : head_dim_);
}

const float* DciIndex::storage_floats(int64_t offset, int64_t count,
                                      std::vector<float>& buffer) const {
    if (!key_storage_.read) return key_storage_.floats + offset;
    buffer.resize(static_cast<std::size_t>(count));
    key_storage_.read(offset, count, buffer.data());
    return buffer.data();
}

void DciIndex::restore_from(const KeyReader& read, int64_t count, const DciLayout& layout,
                            const std::string& source, bool keep_keys) {
    auto fail = [&](const std::string& what) {
        throw FormatError(source + ": invalid index: " + what);
    };
    const auto n = static_cast<std::size_t>(count);
    if (layout.levels.size() != n || layout.parents.size() != n || layout.page_tokens.size() != n)
        fail("it describes " + std::to_string(layout.levels.size()) + " tokens, the keys " +
             std::to_string(count));
    if (!(layout.max_squared_norm > 0) || !std::isfinite(layout.max_squared_norm))
        fail("max_squared_norm must be positive");
    reset();
    const auto dim = static_cast<std::size_t>(head_dim_);
    if (keep_keys) {
        keys_.reserve(n * dim);
        advise_huge_pages(keys_.data(), keys_.capacity() * sizeof(float));
    }
    int top = 0;
    for (int8_t level : layout.levels) {
        if (level < 0) fail("negative level");
        top = std::max<int>(top, level);
    }
    level_points_.assign(static_cast<std::size_t>(top) + 1, {});
    // The promotion rule's next target depends on the number of tokens alone: replayed. Its
    // counts are the layout's (an index built by an older rule keeps its own levels).
    for (int64_t token = 0; token < count; ++token)
        next_level();
    level_count_.assign(static_cast<std::size_t>(top) + 1, 0);
    next_target_ = std::min(next_target_, top + 1);
    // The keys are read once, in chunks: the norm bound is the layout's, so projections need
    // no second pass.
    max_squared_norm_ = layout.max_squared_norm;
    projection_value_.resize(n);
    constexpr int64_t chunk = 4096;
    std::vector<float> buffer, norms, along;
    std::vector<int32_t> tokens;
    for (int64_t first = 0; first < count; first += chunk) {
        const int64_t rows = std::min(chunk, count - first);
        buffer.resize(static_cast<std::size_t>(rows) * dim);
        tokens.resize(static_cast<std::size_t>(rows));
        std::iota(tokens.begin(), tokens.end(), static_cast<int32_t>(first));
        read(tokens, buffer.data());
        // What add_token and project compute, key by key, for the chunk at once.
        norms.resize(static_cast<std::size_t>(rows));
        along.resize(static_cast<std::size_t>(rows));
        auto key_at = [&](int64_t row) { return buffer.data() + row * head_dim_; };
        dots_in_order(rows, head_dim_, key_at, key_at, norms.data());
        dots_in_order(
            rows, head_dim_, key_at, [&](int64_t) { return direction_.data(); }, along.data());
        for (int64_t i = 0; i < rows; ++i) {
            const std::size_t token = static_cast<std::size_t>(first + i);
            const float* key = key_at(i);
            if (keep_keys) keys_.insert(keys_.end(), key, key + head_dim_);
            squared_norm_.push_back(norms[static_cast<std::size_t>(i)]);
            projection_value_[token] =
                projection(along[static_cast<std::size_t>(i)], squared_norm_.back());
            const int level = layout.levels[token];
            level_.push_back(static_cast<int8_t>(level));
            level_points_[static_cast<std::size_t>(level)].push_back(static_cast<int32_t>(token));
            ++level_count_[static_cast<std::size_t>(level)];
        }
    }
    for (int level = 0; level < top; ++level)
        if (level_points_[static_cast<std::size_t>(level) + 1].empty()) fail("an empty level");
    for (float squared : squared_norm_)
        if (squared > max_squared_norm_) fail("a key is longer than max_squared_norm allows");
    parent_ = layout.parents;
    token_page_.assign(n, -1);
    owner_.assign(n, -1);
    // Distances to parents serve insertion only, which an index without its keys refuses.
    if (keep_keys) parent_distance_.assign(n, 0);
    for (std::size_t token = 0; token < n; ++token) {
        const int32_t parent = parent_[token];
        if (level_[token] == top) {
            if (parent != -1) fail("a top-level token has a parent");
        } else if (parent < 0 || static_cast<std::size_t>(parent) >= n ||
                   level_[static_cast<std::size_t>(parent)] != level_[token] + 1) {
            fail("token " + std::to_string(token) + " has no parent one level up");
        } else if (keep_keys) {
            parent_distance_[token] =
                static_cast<float>(lifted_distance(static_cast<int64_t>(token), parent));
        }
    }
    std::size_t next = 0;
    for (int32_t size : layout.page_sizes) {
        if (size <= 0 || size > options_.page_size || next + static_cast<std::size_t>(size) > n)
            fail("a page of " + std::to_string(size) + " tokens");
        const int32_t first = layout.page_tokens[next];
        if (first < 0 || static_cast<std::size_t>(first) >= n) fail("a token out of range");
        const int32_t parent = parent_[static_cast<std::size_t>(first)];
        const int32_t page = new_page(parent);
        dirty_[static_cast<std::size_t>(page)] = 0;
        for (int32_t i = 0; i < size; ++i, ++next) {
            const int32_t token = layout.page_tokens[next];
            if (token < 0 || static_cast<std::size_t>(token) >= n) fail("a token out of range");
            if (token_page_[static_cast<std::size_t>(token)] >= 0)
                fail("token " + std::to_string(token) + " is in two pages");
            if (parent_[static_cast<std::size_t>(token)] != parent)
                fail("a page mixes the children of two parents");
            pages_[static_cast<std::size_t>(page)].tokens.push_back(token);
            token_page_[static_cast<std::size_t>(token)] = page;
        }
        // Keys rotated back after kvpack, or stored in another dtype, may reorder near-equal
        // projections by a rounding: order each page again rather than refuse it.
        std::vector<int32_t>& members = pages_[static_cast<std::size_t>(page)].tokens;
        std::stable_sort(members.begin(), members.end(), [&](int32_t a, int32_t b) {
            return projection_value_[static_cast<std::size_t>(a)] <
                   projection_value_[static_cast<std::size_t>(b)];
        });
        pages_of(parent).push_back(page);
    }
    if (next != n) fail("the pages do not hold every token");
    // A parent's pages in projection order.
    for (std::vector<int32_t>& owned : owned_pages_)
        std::sort(owned.begin(), owned.end(), [&](int32_t a, int32_t b) {
            return projection_value_[static_cast<std::size_t>(
                       pages_[static_cast<std::size_t>(a)].tokens.front())] <
                   projection_value_[static_cast<std::size_t>(
                       pages_[static_cast<std::size_t>(b)].tokens.front())];
        });
    count_pages_below();
}

int64_t DciIndex::live_pages() const {
    if (in_place())
        return std::count_if(page_first_slot_.begin(), page_first_slot_.end(),
                             [](int32_t first) { return first >= 0; });
    return static_cast<int64_t>(pages_.size() - free_pages_.size());
}

std::vector<int32_t> DciIndex::take_dirty_pages() {
    std::vector<int32_t> pages;
    for (std::size_t page = 0; page < dirty_.size(); ++page)
        if (dirty_[page]) pages.push_back(static_cast<int32_t>(page)), dirty_[page] = 0;
    return pages;
}

DciQueryResult DciIndex::query(const float* query, const DciQueryOptions& options) const {
    return std::move(query_group({&query, 1}, options).front());
}

std::vector<DciQueryResult> DciIndex::query_group(std::span<const float* const> queries,
                                                  const DciQueryOptions& options) const {
    std::vector<DciQueryResult> results(queries.size());
    if (size() == 0 || options.pages <= 0) return results;
    const int64_t field_of_view =
        options.field_of_view > 0 ? options.field_of_view : std::max<int64_t>(size() / 1000, 30);
    const double share = std::clamp(options.retrieve_share, 0.0, 1.0);
    using Scored = std::pair<float, int32_t>;  // q.k, token

    // Each query's own walk: where it lies in projection, its candidates, and the best score it
    // saw in each page (scratch kept per thread across calls, only the pages touched reset).
    struct Walk {
        const float* query = nullptr;
        float projection = 0;
        std::vector<Scored> current, next;
        std::vector<int32_t> touched;
        std::vector<float>* page_best = nullptr;
    };
    thread_local std::vector<std::vector<float>> page_bests;
    if (page_bests.size() < queries.size()) page_bests.resize(queries.size());
    const auto pages_here = static_cast<std::size_t>(page_capacity());
    // The walks and the buffers below are kept per thread too: a step of a 1B model at 131k
    // tokens makes 112 queries, each of which allocated them afresh.
    thread_local std::vector<Walk> walk_pool;
    if (walk_pool.size() < queries.size()) walk_pool.resize(queries.size());
    const std::span<Walk> walks(walk_pool.data(), queries.size());
    for (std::size_t g = 0; g < queries.size(); ++g) {
        Walk& walk = walks[g];
        walk.current.clear();
        walk.next.clear();
        walk.touched.clear();
        walk.query = queries[g];
        const double query_norm = std::sqrt(dot(walk.query, walk.query, head_dim_));
        // The query lifted onto the keys' sphere, [sqrt(M) q/|q|, 0]: then |T(k) - T(q)|² =
        // 2M - 2 sqrt(M) q.k/|q| ranks keys exactly as q.k does, and nearness in projection
        // means something. (M-DCI projects q/|q|, of norm 1 against keys of norm sqrt(M): with
        // real key norms that picks children almost at random, which its 80% share hides.)
        walk.projection =
            query_norm > 0
                ? static_cast<float>(std::sqrt(max_squared_norm_) *
                                     dot(direction_.data(), walk.query, head_dim_) / query_norm)
                : 0.0f;
        walk.page_best = &page_bests[g];
        if (walk.page_best->size() < pages_here)
            walk.page_best->resize(pages_here, -std::numeric_limits<float>::infinity());
    }

    // A point's children in projection order, as the queries see them: their projections and
    // tokens, where their keys are, and their pages as runs of children (ids and sizes). An
    // index restored in place keeps them as one run of slots, read where they lie in memory (or
    // copied from its file).
    thread_local std::vector<int32_t> token_list, page_id_list, page_size_list;
    thread_local std::vector<float> projection_list, projection_buffer, token_buffer, key_buffer,
        rows, scores;
    const float* projections = nullptr;
    const int32_t* tokens = nullptr;
    const int32_t* page_ids = nullptr;
    const int32_t* page_sizes = nullptr;
    int64_t children = 0, first_slot = 0;
    // `row`: owner_index(owner), -1 when it owns no page.
    auto load_children = [&](int32_t owner, int32_t row) {
        children = 0;
        if (!in_place()) {
            token_list.clear();
            projection_list.clear();
            page_id_list.clear();
            page_size_list.clear();
            for (int32_t page : pages_of(owner)) {
                page_id_list.push_back(page);
                page_size_list.push_back(static_cast<int32_t>(pages_[page].tokens.size()));
                for (int32_t token : pages_[page].tokens) {
                    token_list.push_back(token);
                    projection_list.push_back(projection_value_[token]);
                }
            }
            children = static_cast<int64_t>(token_list.size());
            tokens = token_list.data();
            projections = projection_list.data();
            page_ids = page_id_list.data();
            page_sizes = page_size_list.data();
            return;
        }
        if (row < 0) return;
        const OwnerSlots& slots = owner_slots_[static_cast<std::size_t>(row)];
        children = slots.children;
        if (children == 0) return;
        first_slot = slots.first_slot;
        page_ids = owner_page_ids_.data() + slots.pages_begin;
        page_sizes = owner_page_sizes_.data() + slots.pages_begin;
        projections = storage_floats(projections_at() + first_slot, children, projection_buffer);
        tokens = reinterpret_cast<const int32_t*>(
            storage_floats(tokens_at() + first_slot, children, token_buffer));
    };
    // Asks for the children of the owner at `row` to be brought into the cache while another's
    // are scored: each owner's run of slots lies elsewhere in memory, and a query waited for
    // every run it started (its keys were most of a query's time at 131k tokens).
    const int64_t row_bytes =
        in_place() && key_storage_.bf16_keys ? head_dim_ * 2 : head_dim_ * int64_t{4};
    auto prefetch_children = [&](int32_t row) {
        if (!in_place() || key_storage_.read || row < 0) return;
        const OwnerSlots& slots = owner_slots_[static_cast<std::size_t>(row)];
        const float* base = key_storage_.floats;
        prefetch_range(base + key_floats_of(slots.first_slot), slots.children * row_bytes);
        prefetch_range(base + projections_at() + slots.first_slot, slots.children * 4);
        prefetch_range(base + tokens_at() + slots.first_slot, slots.children * 4);
        prefetch_range(owner_page_ids_.data() + slots.pages_begin, slots.pages * 4);
        prefetch_range(owner_page_sizes_.data() + slots.pages_begin, slots.pages * 4);
    };

    // The `wanted` children nearest in projection to `target`: a run [left, right) of them.
    auto nearest_run = [&](float target, std::size_t wanted) {
        return nearest_in_projection({projections, static_cast<std::size_t>(children)}, target,
                                     wanted);
    };

    // Scores the children of `owner` nearest each of `members`' queries in projection (all of
    // them, or `share`); a member's candidates for the level below, when `collect`, go to its
    // `next`. The keys of the children any member scores are read once for all of them.
    thread_local std::vector<std::pair<std::size_t, std::size_t>> runs;
    auto expand = [&](int32_t owner, int32_t row, double take_share,
                      const std::vector<std::size_t>& members, bool collect) {
        load_children(owner, row);
        if (children == 0) return;
        const auto count = static_cast<std::size_t>(children);
        const auto wanted = static_cast<std::size_t>(
            std::max(1.0, std::ceil(take_share * static_cast<double>(count))));
        runs.clear();
        std::size_t first = count, last = 0;
        for (std::size_t g : members) {
            runs.push_back(nearest_run(walks[g].projection, wanted));
            first = std::min(first, runs.back().first);
            last = std::max(last, runs.back().second);
        }
        // In place, the slots' keys as they lie (float32 or bf16); else the children's keys
        // gathered.
        const float* keys = nullptr;
        const bool bf16 = in_place() && key_storage_.bf16_keys;
        const int64_t row_floats = bf16 ? head_dim_ / 2 : head_dim_;
        if (in_place()) {
            keys = storage_floats(key_floats_of(first_slot + static_cast<int64_t>(first)),
                                  static_cast<int64_t>(last - first) * row_floats, key_buffer);
        } else {
            rows.resize((last - first) * static_cast<std::size_t>(head_dim_));
            for (std::size_t i = first; i < last; ++i)
                copy_key(tokens[i],
                         rows.data() + (i - first) * static_cast<std::size_t>(head_dim_));
            keys = rows.data();
        }
        for (std::size_t m = 0; m < members.size(); ++m) {
            Walk& walk = walks[members[m]];
            const auto [left, right] = runs[m];
            const std::size_t run = right - left;
            scores.resize(run);
            const float* run_keys = keys + (left - first) * static_cast<std::size_t>(row_floats);
            if (bf16)
                dot_many_rows_bf16(reinterpret_cast<const uint16_t*>(run_keys), walk.query,
                                   scores.data(), static_cast<int64_t>(run), head_dim_);
            else
                dot_many_rows_f32(run_keys, walk.query, scores.data(), static_cast<int64_t>(run),
                                  head_dim_);
            results[members[m]].dot_products += static_cast<int64_t>(run);
            // Each page's best score among the run's children in it.
            std::vector<float>& page_best = *walk.page_best;
            std::size_t p = 0, page_start = 0;
            while (page_start + static_cast<std::size_t>(page_sizes[p]) <= left)
                page_start += static_cast<std::size_t>(page_sizes[p++]);
            for (std::size_t i = left; i < right; ++p) {
                const std::size_t page_end = page_start + static_cast<std::size_t>(page_sizes[p]);
                page_start = page_end;
                if (page_end <= i) continue;
                const int32_t page = page_ids[p];
                float best = page_best[page];
                if (best == -std::numeric_limits<float>::infinity()) walk.touched.push_back(page);
                for (const std::size_t end = std::min(page_end, right); i < end; ++i)
                    best = std::max(best, scores[i - left]);
                page_best[page] = best;
            }
            if (collect)
                for (std::size_t i = 0; i < run; ++i)
                    walk.next.emplace_back(scores[i], tokens[left + i]);
        }
    };

    std::vector<std::size_t> everyone(queries.size());
    std::iota(everyone.begin(), everyone.end(), std::size_t{0});
    expand(-1, 0, levels() > 1 ? 1.0 : share, everyone, levels() > 1);
    for (Walk& walk : walks)
        std::swap(walk.current, walk.next);
    // The points each query keeps at a level, as (point, query) pairs; sorted, each point's run
    // names the queries that keep it. (The order points are expanded in changes nothing: every
    // choice below is a sort by score with the token or page breaking ties.)
    thread_local std::vector<std::pair<int32_t, uint32_t>> kept;
    thread_local std::vector<std::size_t> keepers;
    thread_local std::vector<std::pair<std::size_t, int32_t>> expanding;
    for (int level = levels() - 1; level > 0; --level) {
        kept.clear();
        for (std::size_t g = 0; g < walks.size(); ++g) {
            std::vector<Scored>& current = walks[g].current;
            // Keep the best points whose subtrees cover the pages wanted, never fewer than the
            // field of view; where coverage needs more, the view widens (M-DCI aborts there),
            // the next best first. The field of view is kept whole, so it is only selected
            // (what it covers is a sum); beyond it the points are ordered a view's worth at a
            // time as coverage asks (each (score, token) is distinct: the same points as a sort
            // of them all; at 131k tokens the partial sort's heap alone was 7% of the queries).
            const auto at = [&](std::size_t i) {
                return current.begin() + static_cast<std::ptrdiff_t>(i);
            };
            const std::size_t view =
                std::min(current.size(), static_cast<std::size_t>(field_of_view));
            if (view < current.size())
                std::nth_element(at(0), at(view), at(current.size()), std::greater<>());
            std::size_t keep = 0, ordered = view;
            int64_t covered = 0;
            while (keep < current.size() &&
                   (covered < options.pages || static_cast<int64_t>(keep) < field_of_view)) {
                if (keep == ordered) {
                    // view >= 1 here: the field of view is at least 1, and current holds one.
                    const std::size_t next = std::min(current.size(), ordered + view);
                    if (next < current.size())
                        std::nth_element(at(ordered), at(next), at(current.size()),
                                         std::greater<>());
                    std::sort(at(ordered), at(next), std::greater<>());
                    ordered = next;
                }
                const int32_t point = current[keep++].second;
                covered += pages_below(point);
                kept.emplace_back(point, static_cast<uint32_t>(g));
            }
            walks[g].next.clear();
        }
        // Upper points have about 1/p1 children each: all are scored, since a point missed
        // there loses its whole subtree. The share applies where the children are many. The
        // finest level's tokens only count for their pages.
        std::sort(kept.begin(), kept.end());
        // The points kept, each with where its run of `kept` starts and its owner row; the
        // children of a few points ahead are asked for while each point is expanded (an upper
        // point's few children take less time to score than to arrive).
        expanding.clear();
        for (std::size_t i = 0; i < kept.size(); ++i)
            if (i == 0 || kept[i].first != kept[i - 1].first)
                expanding.push_back({i, owner_index(kept[i].first)});
        constexpr std::size_t ahead = 4;
        for (std::size_t e = 0; e < std::min(ahead, expanding.size()); ++e)
            prefetch_children(expanding[e].second);
        for (std::size_t e = 0; e < expanding.size(); ++e) {
            if (e + ahead < expanding.size()) prefetch_children(expanding[e + ahead].second);
            const std::size_t first = expanding[e].first;
            const std::size_t last =
                e + 1 < expanding.size() ? expanding[e + 1].first : kept.size();
            keepers.clear();
            for (std::size_t i = first; i < last; ++i)
                keepers.push_back(kept[i].second);
            expand(kept[first].first, expanding[e].second, level == 1 ? share : 1.0, keepers,
                   level > 1);
        }
        for (Walk& walk : walks)
            std::swap(walk.current, walk.next);
    }

    for (std::size_t g = 0; g < walks.size(); ++g) {
        Walk& walk = walks[g];
        std::vector<float>& page_best = *walk.page_best;
        const auto ranked = std::min(walk.touched.size(), static_cast<std::size_t>(options.pages));
        std::partial_sort(
            walk.touched.begin(), walk.touched.begin() + static_cast<std::ptrdiff_t>(ranked),
            walk.touched.end(), [&](int32_t a, int32_t b) {
                return page_best[a] != page_best[b] ? page_best[a] > page_best[b] : a < b;
            });
        for (std::size_t i = 0; i < ranked; ++i) {
            results[g].pages.push_back(walk.touched[i]);
            results[g].page_scores.push_back(page_best[walk.touched[i]]);
        }
        for (int32_t page : walk.touched)
            page_best[page] = -std::numeric_limits<float>::infinity();
    }
    return results;
}

}  // namespace kv
