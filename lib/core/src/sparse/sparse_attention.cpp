#include "kv/sparse/sparse_attention.hpp"

#include "common.hpp"
#include "kv/error.hpp"
#include "kv/model/kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

namespace kv {

BudgetSplit split_budget(int64_t budget, int64_t page_size) {
    BudgetSplit split;
    split.sink = split.window = budget <= 4 * page_size ? page_size : 2 * page_size;
    split.retrieved = std::max<int64_t>(0, budget - split.sink - split.window);
    return split;
}

Residency SparsePolicy::residency(const BudgetSplit& split, int64_t, int64_t rows) const {
    return {split.sink, rows - split.window};
}

using sparse::Clock;
using sparse::since;

namespace {

// IceCache's rule for grouped queries (its _DCI_query): the query heads' rankings interleaved
// rank by rank (h0 r0, h1 r0, ..., h0 r1, ...) and the first `units` distinct units kept, so
// that a kv head retrieves what one query head would, however many share it. Their rows go to
// `chosen`.
void merge_rankings(const std::vector<Ranking>& rankings, int64_t units, int64_t unit_rows,
                    std::vector<int64_t>& chosen) {
    std::vector<int64_t> taken;
    for (std::size_t rank = 0; static_cast<int64_t>(taken.size()) < units; ++rank) {
        bool more = false;
        for (const Ranking& ranking : rankings) {
            if (rank >= ranking.size()) continue;
            more = true;
            const RankedUnit& unit = ranking[rank];
            if (std::find(taken.begin(), taken.end(), unit.id) != taken.end()) continue;
            // The budget arithmetic rests on it: a unit holds at most unit_rows rows.
            if (static_cast<int64_t>(unit.rows.size()) > unit_rows)
                throw Error("sparse attention: a ranked unit holds " +
                            std::to_string(unit.rows.size()) + " rows, more than " +
                            std::to_string(unit_rows));
            taken.push_back(unit.id);
            chosen.insert(chosen.end(), unit.rows.begin(), unit.rows.end());
            if (static_cast<int64_t>(taken.size()) == units) break;
        }
        if (!more) break;
    }
}

}  // namespace

int64_t SparseAttention::retrievable_rows(const Residency& resident, int64_t rows) const {
    const int64_t sink = std::min(resident.sink, rows);
    const int64_t window = rows - std::max<int64_t>(resident.window_start, sink);
    return std::max<int64_t>(0, options_.budget - sink - window);
}

SparseAttention::SparseAttention(const ModelConfig& config, const Rope& rope, SparseOptions options)
    : config_(config), rope_(rope), options_(std::move(options)) {
    check_sparse_method(options_.method);
    if (options_.dense_layers < 0) throw UsageError("--dense-layers must be >= 0");
    if (options_.reuse_layers < 1) throw UsageError("--reuse-layers must be >= 1");
    if (options_.page_size < 0) throw UsageError("the page size must not be negative");
    last_rows_.resize(static_cast<std::size_t>(config.num_layers));
    stats_.recall_sum.assign(static_cast<std::size_t>(config.num_layers), 0.0);
    stats_.recall_count.assign(static_cast<std::size_t>(config.num_layers), 0);
    stats_.layer_selections.assign(static_cast<std::size_t>(config.num_layers), 0);
    stats_.layer_rows_sum.assign(static_cast<std::size_t>(config.num_layers), 0);
    stats_.layer_rows_max.assign(static_cast<std::size_t>(config.num_layers), 0);
    if (options_.method == "full") return;
    // Without a page size given, the packets' indexes say it (add_stored_index), else 16.
    if (options_.page_size > 0) make_policy();
}

SparseAttention::~SparseAttention() = default;

SparsePolicy& SparseAttention::policy() {
    if (!policy_) {
        if (options_.page_size == 0) options_.page_size = 16;
        make_policy();
    }
    return *policy_;
}

void SparseAttention::make_policy() {
    if (options_.budget < 4 * options_.page_size)
        throw UsageError("--budget must be at least " + std::to_string(4 * options_.page_size) +
                         " tokens (sink, window and two pages of " +
                         std::to_string(options_.page_size) + "), not " +
                         std::to_string(options_.budget));
    split_ = split_budget(options_.budget, options_.page_size);
    policy_ = make_sparse_policy(options_.method, {config_, rope_, options_, split_});
}

void SparseAttention::add_stored_index(int64_t first_row, int64_t position_offset,
                                       PacketIndex index) {
    if (options_.method == "full") return;
    if (!policy_ && options_.page_size == 0 && !index.empty()) options_.page_size = index.page_size;
    if (!index.empty() && index.page_size != options_.page_size && options_.method == "icecache")
        throw MismatchError("a packet's index has pages of " + std::to_string(index.page_size) +
                            " tokens, decoding uses pages of " +
                            std::to_string(options_.page_size) +
                            ": index the packets of one context alike (kvindex --page-size)");
    policy().add_stored_index(first_row, position_offset, std::move(index));
}

bool SparseAttention::owns_choice(int64_t layer) {
    return !(policy().reusable() && options_.reuse_layers > 1 &&
             (layer - options_.dense_layers) % options_.reuse_layers != 0);
}

void SparseAttention::prepare(const KvCache& cache) {
    std::vector<int64_t> layers;
    // Layers that reuse an earlier layer's choice need nothing of their own.
    for (int64_t layer = options_.dense_layers; layer < cache.num_layers(); ++layer)
        if (chooses(layer, cache.keys(layer).size(1)) && owns_choice(layer))
            layers.push_back(layer);
    if (!layers.empty()) policy().prepare(cache, layers, stats_);
}

void SparseAttention::prepare_layer(int64_t layer, const KvCache& cache) {
    if (chooses(layer, cache.keys(layer).size(1)) && owns_choice(layer))
        policy().prepare(cache, {layer}, stats_);
}

bool SparseAttention::select(int64_t layer, const torch::Tensor& queries, const KvCache& cache,
                             std::vector<std::vector<int64_t>>& rows) {
    const int64_t total = cache.keys(layer).size(1);
    if (!chooses(layer, total)) return false;
    SparsePolicy& policy = this->policy();
    const auto started = Clock::now();
    const int64_t kv_heads = cache.kv_heads(), query_heads = queries.size(0);
    const int64_t group = query_heads / kv_heads, dim = cache.head_dim();
    const auto layer_slot = static_cast<std::size_t>(layer);
    const torch::Tensor q =
        queries.reshape({query_heads, dim}).to(torch::kCPU, torch::kFloat32).contiguous();
    const Residency resident = policy.residency(split_, options_.budget, total);

    // The sink and the window join every choice.
    auto add_resident = [&](std::vector<int64_t>& chosen) {
        for (int64_t r = 0; r < std::min(resident.sink, total); ++r)
            chosen.push_back(r);
        for (int64_t r = std::max<int64_t>(0, resident.window_start); r < total; ++r)
            chosen.push_back(r);
        std::sort(chosen.begin(), chosen.end());
        chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
    };

    const bool reuse = !owns_choice(layer) && !last_rows_[layer_slot - 1].empty();
    rows.assign(static_cast<std::size_t>(kv_heads), {});
    if (reuse) {
        rows = last_rows_[layer_slot - 1];
        // The newest token joined after the earlier layer chose: it is in the window.
        for (auto& chosen : rows)
            add_resident(chosen);
    } else {
        std::vector<int64_t> dot_products(static_cast<std::size_t>(kv_heads), 0);
        const SparseStep step{layer,
                              q,
                              cache,
                              total,
                              group,
                              resident,
                              retrievable_rows(resident, total) / policy.unit_rows(),
                              dot_products};
        policy.begin_step(step, stats_);
        auto choose = [&](int64_t head) {
            std::vector<Ranking> rankings(static_cast<std::size_t>(group));
            policy.rank(step, head, rankings);
            auto& chosen = rows[static_cast<std::size_t>(head)];
            merge_rankings(rankings, step.retrievable, policy.unit_rows(), chosen);
            add_resident(chosen);
        };
        if (policy.parallel_heads())
            sparse::for_each_head(kv_heads, choose);
        else
            for (int64_t head = 0; head < kv_heads; ++head)
                choose(head);
        for (int64_t count : dot_products)
            stats_.index_dot_products += count;
    }
    last_rows_[layer_slot] = rows;
    stats_.select_seconds += since(started);
    stats_.selections += kv_heads;
    stats_.layer_selections[layer_slot] += kv_heads;
    for (const auto& chosen : rows) {
        const auto count = static_cast<int64_t>(chosen.size());
        stats_.selected_tokens += count;
        stats_.layer_rows_sum[layer_slot] += count;
        stats_.layer_rows_max[layer_slot] = std::max(stats_.layer_rows_max[layer_slot], count);
    }
    if (options_.measure_recall) measure_recall(layer, q, cache, rows);
    return true;
}

void SparseAttention::attended(int64_t layer, bool chose, double seconds) {
    if (layer == 0) ++stats_.steps;
    (chose ? stats_.sparse_attention_seconds : stats_.dense_attention_seconds) += seconds;
}

void SparseAttention::measure_recall(int64_t layer, const torch::Tensor& q, const KvCache& cache,
                                     const std::vector<std::vector<int64_t>>& rows) {
    // The share of the full softmax the chosen rows hold: the normaliser over every row, read a
    // chunk at a time, against the chosen rows' own terms.
    const int64_t kv_heads = cache.kv_heads(), group = q.size(0) / kv_heads;
    const int64_t total = cache.keys(layer).size(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(cache.head_dim()));
    const auto layer_slot = static_cast<std::size_t>(layer);
    for (int64_t head = 0; head < kv_heads; ++head) {
        const torch::Tensor group_queries = q.narrow(0, head * group, group);
        sparse::LogSumExp normaliser(group);
        sparse::scan_keys(cache, layer, head, 0, total, sparse::key_chunk_rows,
                          [&](int64_t, const torch::Tensor& chunk) {
                              normaliser.add(torch::matmul(group_queries, chunk.t()) * scale);
                          });
        const torch::Tensor chosen_logits =
            torch::matmul(
                group_queries,
                cache.gather_keys(layer, head, rows[static_cast<std::size_t>(head)]).t()) *
            scale;
        const torch::Tensor mass =
            torch::exp(chosen_logits.to(torch::kFloat64) - normaliser.value().unsqueeze(1))
                .sum(1)
                .contiguous();
        for (int64_t member = 0; member < group; ++member)
            stats_.recall_sum[layer_slot] += mass.data_ptr<double>()[member];
        stats_.recall_count[layer_slot] += group;
    }
}

IndexWorker::IndexWorker(SparseAttention& sparse, const KvCache& cache)
    : sparse_(sparse), cache_(cache), worker_([this] { work(); }) {}

IndexWorker::~IndexWorker() {
    try {
        finish();
    } catch (...) {  // the caller is already unwinding from another error
    }
}

void IndexWorker::layer_done(int64_t layer) {
    {
        const std::lock_guard lock(mutex_);
        layers_.push_back(layer);
    }
    wake_.notify_one();
}

void IndexWorker::finish() {
    {
        const std::lock_guard lock(mutex_);
        closed_ = true;
    }
    wake_.notify_one();
    if (worker_.joinable()) worker_.join();
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void IndexWorker::work() {
    for (;;) {
        int64_t layer = 0;
        {
            std::unique_lock lock(mutex_);
            wake_.wait(lock, [this] { return closed_ || !layers_.empty(); });
            if (layers_.empty()) return;
            layer = layers_.front();
            layers_.pop_front();
        }
        if (failure_) continue;  // drain the queue; the first failure is reported
        try {
            torch::NoGradGuard no_grad;
            sparse_.prepare_layer(layer, cache_);
        } catch (...) {
            failure_ = std::current_exception();
        }
    }
}

}  // namespace kv
