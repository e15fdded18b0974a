#include "kv/model/sparse.hpp"

#include "kv/error.hpp"
#include "kv/index/dci.hpp"
#include "kv/memory.hpp"
#include "kv/model/gemv.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <utility>

namespace kv {

SparseMethod parse_sparse_method(const std::string& name) {
    for (SparseMethod method : {SparseMethod::full, SparseMethod::streaming, SparseMethod::quest,
                                SparseMethod::h2o, SparseMethod::topk, SparseMethod::icecache})
        if (name == sparse_method_name(method)) return method;
    throw UsageError("unknown attention method " + kv::quoted(name) +
                     " (full, icecache, streaming, quest, h2o or topk)");
}

const char* sparse_method_name(SparseMethod method) {
    switch (method) {
        case SparseMethod::full:
            return "full";
        case SparseMethod::streaming:
            return "streaming";
        case SparseMethod::quest:
            return "quest";
        case SparseMethod::h2o:
            return "h2o";
        case SparseMethod::topk:
            return "topk";
        case SparseMethod::icecache:
            return "icecache";
    }
    return "?";
}

BudgetSplit split_budget(int64_t budget, int64_t page_size) {
    BudgetSplit split;
    split.sink = split.window = budget <= 4 * page_size ? page_size : 2 * page_size;
    split.retrieved = std::max<int64_t>(0, budget - split.sink - split.window);
    return split;
}

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

// Row r of a [S, D] float32 tensor.
const float* row_of(const torch::Tensor& rows, int64_t r) {
    return rows.data_ptr<float>() + r * rows.size(1);
}

// fn(head) for every kv head, the heads spread over the compute threads: a step's choices are
// independent per head (each writes its own rows and plane state). at::parallel_for rethrows
// the first failure (a read of an offloaded cache).
template <typename Fn>
void for_each_head(int64_t kv_heads, Fn&& fn) {
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t head = begin; head < end; ++head)
            fn(head);
    });
}

// The best `count` of `scores` (indices), best first.
std::vector<int64_t> best_indices(const std::vector<float>& scores, int64_t count) {
    std::vector<int64_t> order(scores.size());
    std::iota(order.begin(), order.end(), 0);
    const auto keep =
        std::min<std::size_t>(order.size(), static_cast<std::size_t>(std::max<int64_t>(0, count)));
    std::partial_sort(
        order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
        [&](int64_t a, int64_t b) {
            return scores[static_cast<std::size_t>(a)] != scores[static_cast<std::size_t>(b)]
                       ? scores[static_cast<std::size_t>(a)] > scores[static_cast<std::size_t>(b)]
                       : a < b;
        });
    order.resize(keep);
    return order;
}

// Rows a step reads at a time when it scans a layer's keys (quest's page summaries, topk, h2o's
// first step, the recall measurement): what it holds of them at once.
constexpr int64_t key_chunk_rows = 4096;

// The float32 keys of one kv head of a layer: from the keys tensor in memory, or from an
// offloaded cache's file with pread (KvCache::gather), so that a step over a cache on disk never
// maps the layer's keys or holds more of them than one chunk.
class HeadKeys {
  public:
    HeadKeys(const torch::Tensor& keys, const KvCache* disk, int64_t layer, int64_t head)
        : keys_(keys), disk_(disk), layer_(layer), head_(head) {}

    /// Rows [first, first + count): [count, D].
    torch::Tensor range(int64_t first, int64_t count) const {
        if (!disk_)
            return keys_[head_]
                .narrow(0, first, count)
                .to(torch::kCPU, torch::kFloat32)
                .contiguous();
        const torch::Tensor raw = torch::empty({count, disk_->head_dim()}, disk_->dtype());
        disk_->gather_range(layer_, head_, first, count, raw.data_ptr(), nullptr);
        return raw.to(torch::kFloat32).contiguous();
    }

    /// The rows `rows`: [rows.size(), D].
    torch::Tensor gather(std::span<const int64_t> rows) const {
        const auto count = static_cast<int64_t>(rows.size());
        if (!disk_) {
            const torch::Tensor index =
                torch::from_blob(const_cast<int64_t*>(rows.data()), {count}, torch::kInt64)
                    .to(keys_.device());
            return keys_[head_]
                .index_select(0, index)
                .to(torch::kCPU, torch::kFloat32)
                .contiguous();
        }
        const torch::Tensor raw = torch::empty({count, disk_->head_dim()}, disk_->dtype());
        disk_->gather(layer_, head_, rows, raw.data_ptr(), nullptr);
        return raw.to(torch::kFloat32).contiguous();
    }

    /// Calls visit(first, keys) for rows [from, to) in chunks of at most `chunk` rows, in order.
    template <class Visit>
    void scan(int64_t from, int64_t to, int64_t chunk, Visit&& visit) const {
        for (int64_t first = from; first < to; first += chunk) {
            const int64_t count = std::min(chunk, to - first);
            visit(first, range(first, count));
        }
    }

  private:
    const torch::Tensor& keys_;
    const KvCache* disk_;
    int64_t layer_, head_;
};

// log(sum(exp(logits))) per query row, over logits [rows, n] added a chunk at a time (float64).
class LogSumExp {
  public:
    explicit LogSumExp(int64_t rows)
        : top_(torch::full({rows}, -std::numeric_limits<double>::infinity(), torch::kFloat64)),
          sum_(torch::zeros({rows}, torch::kFloat64)) {}

    void add(const torch::Tensor& logits) {
        const torch::Tensor wide = logits.to(torch::kFloat64);
        const torch::Tensor top = torch::maximum(top_, std::get<0>(wide.max(1)));
        sum_ = sum_ * torch::exp(top_ - top) + torch::exp(wide - top.unsqueeze(1)).sum(1);
        top_ = top;
    }
    /// [rows]: the log of each row's normaliser.
    torch::Tensor value() const { return top_ + torch::log(sum_); }

  private:
    torch::Tensor top_, sum_;
};

}  // namespace

// One index segment: rows [first_row, first_row + size) of the cache, indexed per (layer, head)
// with keys rotated back by `delta` positions.
struct Segment {
    int64_t first_row = 0;
    int64_t delta = 0;
    PacketIndex* stored = nullptr;  // restored lazily from this, per layer
    int64_t stored_segment = 0;
    int64_t stored_count = 0;
    std::vector<std::unique_ptr<DciIndex>> indexes;  // per layer * kv_heads + head
    std::vector<int64_t> live_rows;  // live segments: rows indexed so far, per layer
};

struct SparseAttention::State {
    ModelConfig config;
    const Rope& rope;
    BudgetSplit split;
    std::vector<float> projection;
    std::vector<std::unique_ptr<PacketIndex>> stored_indexes;
    std::vector<Segment> segments;                             // by first row
    std::vector<int64_t> covered;                              // per layer: rows indexed so far
    std::vector<std::vector<std::vector<int64_t>>> last_rows;  // per layer, for reuse
    // Quest: per plane, per-channel minimum and maximum of each token-order page.
    std::vector<std::vector<float>> page_min, page_max;
    // H2O: per plane, the kept rows and every row's accumulated attention.
    std::vector<std::vector<int64_t>> kept;
    std::vector<std::vector<double>> accumulated;
    std::vector<int64_t> seen;  // per plane: rows added to `kept` so far
    // The keys of the stored indexes of an offloaded cache, in a file (prepare()).
    std::unique_ptr<FileArena> index_arena;
    // The cache on disk prepare() was given: select() reads its keys with pread.
    const KvCache* offloaded_cache = nullptr;

    State(const ModelConfig& c, const Rope& r) : config(c), rope(r) {}
};

SparseAttention::SparseAttention(const ModelConfig& config, const Rope& rope, SparseOptions options)
    : state_(std::make_unique<State>(config, rope)), options_(options) {
    if (options_.budget < 4 * options_.page_size && options_.method != SparseMethod::full)
        throw UsageError("--budget must be at least " + std::to_string(4 * options_.page_size) +
                         " tokens (sink, window and two pages of " +
                         std::to_string(options_.page_size) + "), not " +
                         std::to_string(options_.budget));
    if (options_.dense_layers < 0) throw UsageError("--dense-layers must be >= 0");
    if (options_.reuse_layers < 1) throw UsageError("--reuse-layers must be >= 1");
    State& s = *state_;
    s.split = split_budget(options_.budget, options_.page_size);
    const auto planes = static_cast<std::size_t>(config.num_layers * config.num_kv_heads);
    s.covered.assign(static_cast<std::size_t>(config.num_layers), 0);
    s.last_rows.resize(static_cast<std::size_t>(config.num_layers));
    s.page_min.resize(planes);
    s.page_max.resize(planes);
    s.kept.resize(planes);
    s.accumulated.resize(planes);
    s.seen.assign(planes, 0);
    stats_.recall_sum.assign(static_cast<std::size_t>(config.num_layers), 0.0);
    stats_.recall_count.assign(static_cast<std::size_t>(config.num_layers), 0);
    // Indexes built while decoding use the direction kvindex draws by default.
    s.projection = dci_projection(config.head_dim, 1);
}

SparseAttention::~SparseAttention() = default;

void SparseAttention::add_stored_index(int64_t first_row, int64_t position_offset,
                                       PacketIndex index) {
    if (index.empty() || options_.method != SparseMethod::icecache) return;
    State& s = *state_;
    s.stored_indexes.push_back(std::make_unique<PacketIndex>(std::move(index)));
    PacketIndex* kept = s.stored_indexes.back().get();
    for (std::size_t i = 0; i < kept->segments.size(); ++i) {
        Segment segment;
        segment.first_row = first_row + kept->segments[i].first;
        segment.delta = kept->segments[i].delta + position_offset;
        segment.stored = kept;
        segment.stored_segment = static_cast<int64_t>(i);
        segment.stored_count = kept->segments[i].count;
        segment.indexes.resize(
            static_cast<std::size_t>(s.config.num_layers * s.config.num_kv_heads));
        s.segments.push_back(std::move(segment));
    }
    std::sort(s.segments.begin(), s.segments.end(),
              [](const Segment& a, const Segment& b) { return a.first_row < b.first_row; });
}

namespace {

// The keys of rows [first, first + count) of one head, float32, rotated back by delta.
torch::Tensor index_keys(const torch::Tensor& keys, int64_t head, int64_t first, int64_t count,
                         int64_t delta, const Rope& rope) {
    torch::Tensor rows = keys[head].narrow(0, first, count).to(torch::kCPU, torch::kFloat32);
    if (delta != 0) rows = rope.shift(rows, -delta);
    return rows.contiguous();
}

}  // namespace

void SparseAttention::index_rows(int64_t layer, const torch::Tensor& keys,
                                 std::vector<std::function<void()>>& jobs) {
    State& s = *state_;
    const int64_t total = keys.size(1);
    const int64_t kv_heads = keys.size(0), dim = keys.size(2);
    const int64_t window_start = total - s.split.window;
    const auto layer_slot = static_cast<std::size_t>(layer);
    // Index every row that has left the window: stored segments are restored, the rest
    // (BOS, the prompt, decoded tokens) grows live segments. The segments are decided here, on
    // the calling thread; restoring, building and growing each head's index are the jobs,
    // independent of each other, run on the compute threads (run_index_jobs).
    int64_t& covered = s.covered[layer_slot];
    while (covered < window_start) {
        auto stored = std::find_if(s.segments.begin(), s.segments.end(), [&](const Segment& g) {
            return g.stored && g.first_row <= covered && covered < g.first_row + g.stored_count;
        });
        if (stored != s.segments.end()) {
            for (int64_t head = 0; head < kv_heads; ++head) {
                auto& index = stored->indexes[static_cast<std::size_t>(layer * kv_heads + head)];
                index = std::make_unique<DciIndex>(dim, stored->stored->projection);
                jobs.push_back([&rope = s.rope, index = index.get(), keys, head,
                                first = stored->first_row, count = stored->stored_count,
                                delta = stored->delta, stored_index = stored->stored,
                                segment = stored->stored_segment, layer, kv_heads,
                                arena = s.index_arena.get(), cache = s.offloaded_cache] {
                    // Each layout is restored once: its memory goes when its index exists.
                    const DciLayout layout =
                        stored_index->take_layout(layer, head, kv_heads, segment);
                    const std::string source =
                        "the index of cache rows " + std::to_string(first) + "+";
                    if (!arena) {
                        const torch::Tensor k = index_keys(keys, head, first, count, delta, rope);
                        index->restore(k.data_ptr<float>(), count, layout, source);
                        return;
                    }
                    // A row per token: its key, projection and id (DciIndex::restore_in_place).
                    const auto row_bytes =
                        static_cast<std::size_t>(keys.size(2) + 2) * sizeof(float);
                    const FileArena::Region storage =
                        arena->allocate(static_cast<std::size_t>(count) * row_bytes);
                    KeyStorage keys_on_disk;
                    keys_on_disk.rows = reinterpret_cast<float*>(storage.bytes.data());
                    // Queries read by pread: their keys never become resident.
                    keys_on_disk.read = [arena, offset = storage.offset, row_bytes](
                                            int64_t from, int64_t n, float* out) {
                        arena->read(offset + static_cast<std::size_t>(from) * row_bytes,
                                    static_cast<std::size_t>(n) * row_bytes, out);
                    };
                    index->restore_in_place(
                        [&](std::span<const int32_t> tokens, float* out) {
                            // Read with pread (KvCache::gather): restoring brings no page of
                            // the cache into memory, and the storage is written front to back,
                            // each page once, then dropped.
                            std::vector<int64_t> rows(tokens.size());
                            for (std::size_t i = 0; i < tokens.size(); ++i)
                                rows[i] = first + tokens[i];
                            torch::Tensor raw =
                                torch::empty({static_cast<int64_t>(tokens.size()), keys.size(2)},
                                             keys.options().device(torch::kCPU));
                            cache->gather(layer, head, rows, raw.data_ptr(), nullptr);
                            torch::Tensor k = raw.to(torch::kFloat32);
                            if (delta != 0) k = rope.shift(k, -delta);
                            k = k.contiguous();
                            std::copy_n(k.data_ptr<float>(), k.numel(), out);
                            drop_mapped_file_pages(storage.bytes.data(), storage.bytes.size());
                        },
                        count, layout, source, std::move(keys_on_disk));
                    // Written through the mapping; from now on only read with pread.
                    drop_mapped_file_pages(storage.bytes.data(), storage.bytes.size());
                });
            }
            covered = stored->first_row + stored->stored_count;
            continue;
        }
        // Up to the next stored segment or the window.
        int64_t end = window_start;
        for (const Segment& g : s.segments)
            if (g.stored && g.first_row > covered) end = std::min(end, g.first_row);
        Segment* live = nullptr;
        for (Segment& g : s.segments) {
            const auto& first = g.indexes[static_cast<std::size_t>(layer * kv_heads)];
            if (!g.stored && first && g.first_row + g.live_rows[layer_slot] == covered) live = &g;
        }
        const bool grows = live != nullptr;
        if (!live) {
            // A new live segment; later layers find it by its first row.
            auto found = std::find_if(s.segments.begin(), s.segments.end(), [&](const Segment& g) {
                return !g.stored && g.first_row == covered;
            });
            if (found == s.segments.end()) {
                Segment segment;
                segment.first_row = covered;
                segment.indexes.resize(static_cast<std::size_t>(s.config.num_layers * kv_heads));
                segment.live_rows.assign(static_cast<std::size_t>(s.config.num_layers), 0);
                s.segments.push_back(std::move(segment));
                std::sort(
                    s.segments.begin(), s.segments.end(),
                    [](const Segment& a, const Segment& b) { return a.first_row < b.first_row; });
                found = std::find_if(s.segments.begin(), s.segments.end(), [&](const Segment& g) {
                    return !g.stored && g.first_row == covered;
                });
            }
            live = &*found;
            for (int64_t head = 0; head < kv_heads; ++head)
                live->indexes[static_cast<std::size_t>(layer * kv_heads + head)] =
                    std::make_unique<DciIndex>(dim, s.projection);
        }
        for (int64_t head = 0; head < kv_heads; ++head) {
            DciIndex* index =
                live->indexes[static_cast<std::size_t>(layer * kv_heads + head)].get();
            jobs.push_back(
                [&rope = s.rope, index, keys, head, first = covered, count = end - covered, grows] {
                    const torch::Tensor k = index_keys(keys, head, first, count, 0, rope);
                    if (grows)
                        index->insert(k.data_ptr<float>(), count);
                    else
                        index->build(k.data_ptr<float>(), count);
                });
        }
        live->live_rows[layer_slot] += end - covered;
        stats_.indexed_tokens += (end - covered) * kv_heads;
        covered = end;
    }
}

void SparseAttention::run_index_jobs(std::vector<std::function<void()>>& jobs) {
    if (jobs.empty()) return;
    const auto started = Clock::now();
    // One job per (segment, layer, head); at::parallel_for hands them to the compute threads
    // and rethrows the first failure (a stored index that does not fit its keys).
    at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t job = begin; job < end; ++job)
            jobs[static_cast<std::size_t>(job)]();
    });
    jobs.clear();
    stats_.index_seconds += since(started);
}

void SparseAttention::prepare(const KvCache& cache) {
    // Every method reads the keys of a cache on disk with pread (select()).
    if (cache.offloaded()) state_->offloaded_cache = &cache;
    if (options_.method != SparseMethod::icecache) return;
    if (cache.offloaded() && !state_->index_arena)
        state_->index_arena = std::make_unique<FileArena>(options_.offload_dir);
    std::vector<std::function<void()>> jobs;
    for (int64_t layer = options_.dense_layers; layer < state_->config.num_layers; ++layer) {
        const torch::Tensor keys = cache.keys(layer);
        if (chooses(layer, keys.size(1))) index_rows(layer, keys, jobs);
    }
    run_index_jobs(jobs);
    if (state_->index_arena)
        stats_.offloaded_index_bytes = static_cast<int64_t>(state_->index_arena->size());
}

void SparseAttention::prepare_layer(int64_t layer, const torch::Tensor& keys) {
    if (options_.method != SparseMethod::icecache || !chooses(layer, keys.size(1))) return;
    std::vector<std::function<void()>> jobs;
    index_rows(layer, keys, jobs);
    run_index_jobs(jobs);
}

bool SparseAttention::select(int64_t layer, const torch::Tensor& queries, const torch::Tensor& keys,
                             std::vector<std::vector<int64_t>>& rows) {
    if (!chooses(layer, keys.size(1))) return false;
    State& s = *state_;
    const int64_t total = keys.size(1);
    const auto started = Clock::now();
    const int64_t kv_heads = keys.size(0), query_heads = queries.size(0);
    const int64_t group = query_heads / kv_heads, dim = keys.size(2);
    const int64_t sink = s.split.sink;
    const int64_t window_start = total - s.split.window;
    const auto layer_slot = static_cast<std::size_t>(layer);
    const torch::Tensor q =
        queries.reshape({query_heads, dim}).to(torch::kCPU, torch::kFloat32).contiguous();

    // Keys are read a head and a chunk at a time (HeadKeys), from the file of a cache on disk.
    const KvCache* disk = s.offloaded_cache && s.offloaded_cache->offloaded() &&
                                  s.offloaded_cache->keys(layer).data_ptr() == keys.data_ptr()
                              ? s.offloaded_cache
                              : nullptr;
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));

    auto resident = [&](std::vector<int64_t>& chosen, int64_t window_from) {
        for (int64_t r = 0; r < std::min(sink, total); ++r)
            chosen.push_back(r);
        for (int64_t r = std::max<int64_t>(0, window_from); r < total; ++r)
            chosen.push_back(r);
        std::sort(chosen.begin(), chosen.end());
        chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
    };

    const bool reusable = options_.method == SparseMethod::icecache ||
                          options_.method == SparseMethod::quest ||
                          options_.method == SparseMethod::topk;
    const bool reuse = reusable && options_.reuse_layers > 1 &&
                       (layer - options_.dense_layers) % options_.reuse_layers != 0 &&
                       !s.last_rows[layer_slot - 1].empty();
    rows.assign(static_cast<std::size_t>(kv_heads), {});
    if (reuse) {
        rows = s.last_rows[layer_slot - 1];
        // The newest token joined after the earlier layer chose: it is in the window.
        for (auto& chosen : rows)
            resident(chosen, window_start);
    } else if (options_.method == SparseMethod::streaming) {
        for (auto& chosen : rows)
            resident(chosen, total - (options_.budget - sink));
    } else if (options_.method == SparseMethod::topk) {
        // The best `retrieved` rows per query head, merged chunk by chunk: the global top-k,
        // ties to the earlier row, holding one chunk of scores at a time.
        struct Scored {
            float score;
            int64_t row;
        };
        const auto better = [](const Scored& a, const Scored& b) {
            return a.score != b.score ? a.score > b.score : a.row < b.row;
        };
        const auto keep = static_cast<std::size_t>(s.split.retrieved);
        for (int64_t head = 0; head < kv_heads; ++head) {
            std::vector<std::vector<Scored>> best(static_cast<std::size_t>(group));
            HeadKeys(keys, disk, layer, head)
                .scan(
                    sink, window_start, key_chunk_rows,
                    [&](int64_t first, const torch::Tensor& chunk) {
                        const torch::Tensor scores =
                            torch::matmul(q.narrow(0, head * group, group), chunk.t()).contiguous();
                        for (int64_t member = 0; member < group; ++member) {
                            auto& kept = best[static_cast<std::size_t>(member)];
                            const float* row = scores.data_ptr<float>() + member * chunk.size(0);
                            for (int64_t i = 0; i < chunk.size(0); ++i)
                                kept.push_back({row[i], first + i});
                            const std::size_t n = std::min(keep, kept.size());
                            std::partial_sort(kept.begin(),
                                              kept.begin() + static_cast<std::ptrdiff_t>(n),
                                              kept.end(), better);
                            kept.resize(n);
                        }
                    });
            auto& chosen = rows[static_cast<std::size_t>(head)];
            for (const auto& kept : best)
                for (const Scored& found : kept)
                    chosen.push_back(found.row);
            resident(chosen, window_start);
        }
    } else if (options_.method == SparseMethod::quest) {
        const int64_t page = options_.page_size;
        // Chunks of whole pages, so that each page is summarised from one chunk.
        const int64_t chunk = std::max<int64_t>(1, key_chunk_rows / page) * page;
        for_each_head(kv_heads, [&](int64_t head) {
            const auto plane = static_cast<std::size_t>(layer * kv_heads + head);
            std::vector<float>& mins = s.page_min[plane];
            std::vector<float>& maxs = s.page_max[plane];
            // Summaries of every page up to the window, recomputed for the page still filling.
            const int64_t pages = (window_start + page - 1) / page;
            const int64_t complete = static_cast<int64_t>(mins.size()) / dim;
            const int64_t from = std::max<int64_t>(0, std::min(complete, pages) - 1);
            mins.resize(static_cast<std::size_t>(pages * dim));
            maxs.resize(static_cast<std::size_t>(pages * dim));
            HeadKeys(keys, disk, layer, head)
                .scan(from * page, window_start, chunk,
                      [&](int64_t first, const torch::Tensor& rows_read) {
                          const int64_t last = first + rows_read.size(0);
                          for (int64_t p = first / page; p * page < last; ++p)
                              for (int64_t d = 0; d < dim; ++d) {
                                  float low = std::numeric_limits<float>::infinity(), high = -low;
                                  for (int64_t r = p * page; r < std::min(last, (p + 1) * page);
                                       ++r) {
                                      const float value = row_of(rows_read, r - first)[d];
                                      low = std::min(low, value);
                                      high = std::max(high, value);
                                  }
                                  mins[static_cast<std::size_t>(p * dim + d)] = low;
                                  maxs[static_cast<std::size_t>(p * dim + d)] = high;
                              }
                      });
            auto& chosen = rows[static_cast<std::size_t>(head)];
            const int64_t first_page = sink / page;  // pages before it lie in the sink
            for (int64_t member = 0; member < group; ++member) {
                const float* query = q.data_ptr<float>() + (head * group + member) * dim;
                std::vector<float> bounds;
                for (int64_t p = first_page; p < pages; ++p) {
                    float bound = 0;
                    for (int64_t d = 0; d < dim; ++d)
                        bound += std::max(query[d] * mins[static_cast<std::size_t>(p * dim + d)],
                                          query[d] * maxs[static_cast<std::size_t>(p * dim + d)]);
                    bounds.push_back(bound);
                }
                for (int64_t index : best_indices(bounds, s.split.retrieved / page)) {
                    const int64_t p = first_page + index;
                    for (int64_t r = p * page; r < std::min(window_start, (p + 1) * page); ++r)
                        chosen.push_back(r);
                }
            }
            resident(chosen, window_start);
        });
    } else if (options_.method == SparseMethod::h2o) {
        const int64_t recent = options_.budget / 2;
        for (int64_t head = 0; head < kv_heads; ++head) {
            const auto plane = static_cast<std::size_t>(layer * kv_heads + head);
            // The kept rows, ascending, and the attention each has accumulated (evicted rows
            // never return, so theirs is forgotten).
            std::vector<int64_t>& kept = s.kept[plane];
            std::vector<double>& score = s.accumulated[plane];
            for (int64_t r = s.seen[plane]; r < total; ++r) {
                kept.push_back(r);
                score.push_back(0.0);
            }
            s.seen[plane] = total;
            const HeadKeys source(keys, disk, layer, head);
            const torch::Tensor group_queries = q.narrow(0, head * group, group);
            auto logits_of = [&](std::size_t from) {
                const std::size_t count =
                    std::min(kept.size() - from, static_cast<std::size_t>(key_chunk_rows));
                return torch::matmul(group_queries,
                                     source.gather({kept.data() + from, count}).t()) *
                       scale;
            };
            // This step's attention over the kept rows, summed over the group's query heads: the
            // normaliser first, then the probabilities, a chunk at a time (one chunk, read once,
            // after the first step: the kept rows are the budget).
            LogSumExp normaliser(group);
            torch::Tensor only_chunk;
            for (std::size_t from = 0; from < kept.size();
                 from += static_cast<std::size_t>(key_chunk_rows)) {
                const torch::Tensor logits = logits_of(from);
                normaliser.add(logits);
                if (from == 0 && kept.size() <= static_cast<std::size_t>(key_chunk_rows))
                    only_chunk = logits;
            }
            const torch::Tensor log_total = normaliser.value().unsqueeze(1);
            for (std::size_t from = 0; from < kept.size();
                 from += static_cast<std::size_t>(key_chunk_rows)) {
                const torch::Tensor logits = only_chunk.defined() ? only_chunk : logits_of(from);
                const torch::Tensor summed =
                    torch::exp(logits.to(torch::kFloat64) - log_total).sum(0).contiguous();
                for (int64_t i = 0; i < summed.size(0); ++i)
                    score[from + static_cast<std::size_t>(i)] += summed.data_ptr<double>()[i];
            }
            if (static_cast<int64_t>(kept.size()) > options_.budget) {
                // Every recent row stays; of the older ones, those with the most attention.
                std::vector<std::size_t> old, next;
                for (std::size_t i = 0; i < kept.size(); ++i)
                    (kept[i] >= total - recent ? next : old).push_back(i);
                std::sort(old.begin(), old.end(), [&](std::size_t a, std::size_t b) {
                    return score[a] != score[b] ? score[a] > score[b] : a < b;
                });
                old.resize(std::min(old.size(),
                                    static_cast<std::size_t>(std::max<int64_t>(
                                        0, options_.budget - static_cast<int64_t>(next.size())))));
                next.insert(next.end(), old.begin(), old.end());
                std::sort(next.begin(), next.end());
                std::vector<int64_t> kept_rows;
                std::vector<double> kept_scores;
                for (std::size_t i : next) {
                    kept_rows.push_back(kept[i]);
                    kept_scores.push_back(score[i]);
                }
                kept = std::move(kept_rows);
                score = std::move(kept_scores);
            }
            rows[static_cast<std::size_t>(head)] = kept;
        }
    } else {  // icecache
        std::vector<std::function<void()>> jobs;
        index_rows(layer, keys, jobs);
        run_index_jobs(jobs);

        const int64_t wanted = s.split.retrieved / options_.page_size;
        DciQueryOptions query_options;
        query_options.pages = wanted;
        query_options.field_of_view = options_.field_of_view;
        query_options.retrieve_share = options_.retrieve_share;
        std::vector<torch::Tensor> shifted(s.segments.size());
        for (std::size_t g = 0; g < s.segments.size(); ++g)
            shifted[g] =
                s.segments[g].delta != 0
                    ? s.rope.shift(q.unsqueeze(1), -s.segments[g].delta).squeeze(1).contiguous()
                    : q;
        // The kv heads' queries are independent: one head per task, each counting its own dot
        // products.
        std::vector<int64_t> dot_products(static_cast<std::size_t>(kv_heads), 0);
        for_each_head(kv_heads, [&](int64_t head) {
            auto& chosen = rows[static_cast<std::size_t>(head)];
            for (int64_t member = 0; member < group; ++member) {
                struct Found {
                    float score;
                    std::size_t segment;
                    int32_t page;
                };
                std::vector<Found> found;
                for (std::size_t g = 0; g < s.segments.size(); ++g) {
                    const auto& index =
                        s.segments[g].indexes[static_cast<std::size_t>(layer * kv_heads + head)];
                    if (!index) continue;
                    const float* query =
                        shifted[g].data_ptr<float>() + (head * group + member) * dim;
                    const DciQueryResult result = index->query(query, query_options);
                    dot_products[static_cast<std::size_t>(head)] += result.dot_products;
                    for (std::size_t i = 0; i < result.pages.size(); ++i)
                        found.push_back({result.page_scores[i], g, result.pages[i]});
                }
                std::sort(found.begin(), found.end(),
                          [](const Found& a, const Found& b) { return a.score > b.score; });
                if (static_cast<int64_t>(found.size()) > wanted)
                    found.resize(static_cast<std::size_t>(wanted));
                for (const Found& f : found) {
                    const Segment& segment = s.segments[f.segment];
                    const auto& index =
                        segment.indexes[static_cast<std::size_t>(layer * kv_heads + head)];
                    for (int32_t token : index->tokens_of_page(f.page))
                        chosen.push_back(segment.first_row + token);
                }
            }
            resident(chosen, window_start);
        });
        for (int64_t count : dot_products)
            stats_.index_dot_products += count;
    }
    s.last_rows[layer_slot] = rows;
    stats_.select_seconds += since(started);
    stats_.selections += kv_heads;
    for (const auto& chosen : rows)
        stats_.selected_tokens += static_cast<int64_t>(chosen.size());

    if (options_.measure_recall) {
        // The share of the full softmax the chosen rows hold: the normaliser over every row,
        // read a chunk at a time, against the chosen rows' own terms.
        for (int64_t head = 0; head < kv_heads; ++head) {
            const HeadKeys source(keys, disk, layer, head);
            const torch::Tensor group_queries = q.narrow(0, head * group, group);
            LogSumExp normaliser(group);
            source.scan(0, total, key_chunk_rows, [&](int64_t, const torch::Tensor& chunk) {
                normaliser.add(torch::matmul(group_queries, chunk.t()) * scale);
            });
            const torch::Tensor chosen_logits =
                torch::matmul(group_queries,
                              source.gather(rows[static_cast<std::size_t>(head)]).t()) *
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
    return true;
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
            sparse_.prepare_layer(layer, cache_.keys(layer));
        } catch (...) {
            failure_ = std::current_exception();
        }
    }
}

namespace {

// Exact attention of one kv head's query heads [group, D] over its chosen keys and values.
torch::Tensor attend_head(const torch::Tensor& queries, int64_t head, int64_t group,
                          const torch::Tensor& keys, const torch::Tensor& values, double scale) {
    const int64_t dim = queries.size(2);
    const torch::Tensor q =
        queries.narrow(0, head * group, group).reshape({group, dim}).to(torch::kFloat32);
    const torch::Tensor probabilities =
        torch::softmax(torch::matmul(q, keys.to(torch::kFloat32).t()) * scale, -1);
    return torch::matmul(probabilities, values.to(torch::kFloat32)).unsqueeze(1);
}

}  // namespace

torch::Tensor attention_over_rows(const torch::Tensor& queries, const torch::Tensor& keys,
                                  const torch::Tensor& values,
                                  const std::vector<std::vector<int64_t>>& rows, double scale) {
    const int64_t kv_heads = keys.size(0), group = queries.size(0) / kv_heads;
    std::vector<torch::Tensor> outputs;
    for (int64_t head = 0; head < kv_heads; ++head) {
        const torch::Tensor index =
            torch::tensor(rows[static_cast<std::size_t>(head)], torch::kInt64).to(keys.device());
        outputs.push_back(attend_head(queries, head, group, keys[head].index_select(0, index),
                                      values[head].index_select(0, index), scale));
    }
    return torch::cat(outputs, 0).to(queries.scalar_type());
}

torch::Tensor attention_over_staged_rows(const torch::Tensor& queries, const KvCache& cache,
                                         int64_t layer,
                                         const std::vector<std::vector<int64_t>>& rows,
                                         double scale) {
    const int64_t kv_heads = cache.kv_heads(), group = queries.size(0) / kv_heads;
    const int64_t dim = cache.head_dim();
    int64_t total = 0;
    for (const auto& chosen : rows)
        total += static_cast<int64_t>(chosen.size());
    auto options = torch::TensorOptions().dtype(cache.dtype());
    if (queries.device().is_cuda()) options = options.pinned_memory(true);
    const torch::Tensor staging = torch::empty({2, total, dim}, options);
    const int64_t row_bytes = dim * staging.element_size();
    auto* keys_out = static_cast<std::byte*>(staging[0].data_ptr());
    auto* values_out = static_cast<std::byte*>(staging[1].data_ptr());
    int64_t first = 0;
    for (int64_t head = 0; head < kv_heads; ++head) {
        const auto& chosen = rows[static_cast<std::size_t>(head)];
        cache.gather(layer, head, chosen, keys_out + first * row_bytes,
                     values_out + first * row_bytes);
        first += static_cast<int64_t>(chosen.size());
    }
    const torch::Tensor staged = staging.to(queries.device(), /*non_blocking=*/true);
    std::vector<torch::Tensor> outputs;
    first = 0;
    for (int64_t head = 0; head < kv_heads; ++head) {
        const auto count = static_cast<int64_t>(rows[static_cast<std::size_t>(head)].size());
        outputs.push_back(attend_head(queries, head, group, staged[0].narrow(0, first, count),
                                      staged[1].narrow(0, first, count), scale));
        first += count;
    }
    return torch::cat(outputs, 0).to(queries.scalar_type());
}

torch::Tensor attention_streamed(const torch::Tensor& queries, const KvCache& cache, int64_t layer,
                                 double scale, int64_t chunk) {
    const int64_t kv_heads = cache.kv_heads(), group = queries.size(0) / kv_heads;
    const int64_t dim = cache.head_dim(), total = cache.keys(layer).size(1);
    const torch::ScalarType stored = cache.dtype();
    // The decoding kernels read bf16 and f32 rows as they are; f16 goes through float32.
    const bool direct = stored == torch::kBFloat16 || stored == torch::kFloat32;
    chunk = std::max<int64_t>(1, std::min(chunk, total));
    const torch::Tensor q =
        queries.reshape({queries.size(0), dim}).to(torch::kCPU, torch::kFloat32).contiguous();
    torch::Tensor out = torch::zeros({queries.size(0), dim}, torch::kFloat32);
    // The arithmetic of the decoding kernel over rows in memory (ops.cpp, attention_decode), in
    // its order, so that a cache on disk decodes to the same bits: every key's score first (the
    // keys read a chunk at a time), the softmax over them, then the values a chunk at a time.
    // Memory holds a chunk per thread and 4 bytes per row and query head of the kv head at hand.
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
        const torch::Tensor rows_read = torch::empty({chunk, dim}, stored);
        std::vector<float> scores(static_cast<std::size_t>(group * total));
        auto read = [&](int64_t head, bool keys, int64_t first, int64_t count) {
            cache.gather_range(layer, head, first, count, keys ? rows_read.data_ptr() : nullptr,
                               keys ? nullptr : rows_read.data_ptr());
            return direct ? rows_read
                          : rows_read.narrow(0, 0, count).to(torch::kFloat32).contiguous();
        };
        for (int64_t head = begin; head < end; ++head) {
            for (int64_t first = 0; first < total; first += chunk) {
                const int64_t count = std::min(chunk, total - first);
                const torch::Tensor k = read(head, true, first, count);
                for (int64_t member = 0; member < group; ++member) {
                    const float* query = q.data_ptr<float>() + (head * group + member) * dim;
                    float* row_scores = scores.data() + member * total + first;
                    dot_rows({k.data_ptr(), k.scalar_type() == torch::kBFloat16}, query, row_scores,
                             count, dim);
                }
            }
            for (int64_t member = 0; member < group; ++member)
                softmax_scaled_in_place(scores.data() + member * total, total,
                                        static_cast<float>(scale));
            for (int64_t first = 0; first < total; first += chunk) {
                const int64_t count = std::min(chunk, total - first);
                const torch::Tensor v = read(head, false, first, count);
                for (int64_t member = 0; member < group; ++member) {
                    const float* weights = scores.data() + member * total + first;
                    float* acc = out.data_ptr<float>() + (head * group + member) * dim;
                    accumulate_rows({v.data_ptr(), v.scalar_type() == torch::kBFloat16}, weights,
                                    acc, count, dim);
                }
            }
        }
    });
    return out.unsqueeze(1).to(queries.device(), queries.scalar_type());
}

}  // namespace kv
