// IceCache (Mao et al., ICLR 2026): each (layer, kv head)'s keys in a multi-level DCI index
// (kv/index/dci.hpp) whose pages hold tokens that are near in meaning; a query walks the index
// down and retrieves the pages with the best keys it meets. Rows that leave the window join the
// index as decoding goes (a live segment); packets indexed by kvindex bring their index along
// (stored segments, restored on first use, their keys rotated back by the offset they were
// packed at).
#include "common.hpp"
#include "kv/float_convert.hpp"
#include "kv/index/dci.hpp"
#include "kv/memory.hpp"
#include "kv/model/ops.hpp"
#include "kv/rope.hpp"
#include "kv/sparse/sparse_attention.hpp"
#include "methods.hpp"

#include <cstring>
#include <functional>
#include <span>
#include <string>

namespace kv::sparse {
namespace {

// The keys of rows [first, first + count) of one head, float32, rotated back by delta.
torch::Tensor index_keys(const KvCache& cache, int64_t layer, int64_t head, int64_t first,
                         int64_t count, int64_t delta, const Rope& rope) {
    torch::Tensor rows = cache.read_keys(layer, head, first, count);
    if (delta != 0) rows = rope.shift(rows, -delta);
    return rows.contiguous();
}

// index_keys for `tokens` of a head's bf16 rows: widened exactly, then rotated back by delta in
// float32 by rotate_keys, as Rope::shift rotates index_keys' floats.
void read_rotated_floats(const uint16_t* rows, int64_t dim, std::span<const int32_t> tokens,
                         const RopeSettings& rope, int64_t delta, float* out) {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
        const uint16_t* row = rows + static_cast<int64_t>(tokens[i]) * dim;
        float* wide = out + static_cast<int64_t>(i) * dim;
        for (int64_t d = 0; d < dim; ++d)
            wide[d] = bf16_to_float(row[d]);
    }
    rotate_keys(reinterpret_cast<std::byte*>(out), CacheDtype::f32, tokens.size(), rope, -delta);
}

// What float_to_bf16 makes of read_rotated_floats' floats: rotate_keys on bf16 rows does the
// same float32 arithmetic and rounds as float_to_bf16 does; unrotated, the rows round-trip
// unchanged but for a signalling NaN, which float_to_bf16 quiets.
void read_rotated_bf16(const uint16_t* rows, int64_t dim, std::span<const int32_t> tokens,
                       const RopeSettings& rope, int64_t delta, uint16_t* out) {
    const auto row_bytes = static_cast<std::size_t>(dim) * sizeof(uint16_t);
    for (std::size_t i = 0; i < tokens.size(); ++i)
        std::memcpy(out + static_cast<int64_t>(i) * dim,
                    rows + static_cast<int64_t>(tokens[i]) * dim, row_bytes);
    const std::size_t values = tokens.size() * static_cast<std::size_t>(dim);
    if (delta != 0) {
        rotate_keys(reinterpret_cast<std::byte*>(out), CacheDtype::bf16, tokens.size(), rope,
                    -delta);
    } else {
        for (std::size_t v = 0; v < values; ++v)
            if ((out[v] & 0x7fffu) > 0x7f80u) out[v] |= 0x40u;
    }
}

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

class IceCache final : public SparsePolicy {
  public:
    explicit IceCache(const PolicySetup& setup)
        : config_(setup.config),
          rope_(setup.rope),
          options_(setup.options),
          split_(setup.split),
          // Indexes built while decoding use the direction kvindex draws by default.
          projection_(dci_projection(setup.config.head_dim, 1)),
          // The sink is always resident: the index starts after it (as the authors' holds the
          // pages between the sink and the window only). Stored segments still cover whole
          // packets.
          covered_(static_cast<std::size_t>(setup.config.num_layers), setup.split.sink) {}

    int64_t unit_rows() const override { return options_.page_size; }
    bool parallel_heads() const override { return true; }

    void add_stored_index(int64_t first_row, int64_t position_offset, PacketIndex index) override {
        if (index.empty()) return;
        stored_indexes_.push_back(std::make_unique<PacketIndex>(std::move(index)));
        PacketIndex* kept = stored_indexes_.back().get();
        for (std::size_t i = 0; i < kept->segments.size(); ++i) {
            Segment segment;
            segment.first_row = first_row + kept->segments[i].first;
            segment.delta = kept->segments[i].delta + position_offset;
            segment.stored = kept;
            segment.stored_segment = static_cast<int64_t>(i);
            segment.stored_count = kept->segments[i].count;
            segment.indexes.resize(
                static_cast<std::size_t>(config_.num_layers * config_.num_kv_heads));
            segments_.push_back(std::move(segment));
        }
        std::sort(segments_.begin(), segments_.end(),
                  [](const Segment& a, const Segment& b) { return a.first_row < b.first_row; });
    }

    void prepare(const KvCache& cache, const std::vector<int64_t>& layers,
                 SparseStats& stats) override {
        std::vector<std::function<void()>> jobs;
        for (int64_t layer : layers)
            index_rows(layer, cache, cache.keys(layer).size(1) - split_.window, jobs, stats);
        run_index_jobs(jobs, stats);
    }

    void begin_step(const SparseStep& step, SparseStats& stats) override {
        std::vector<std::function<void()>> jobs;
        index_rows(step.layer, step.cache, step.resident.window_start, jobs, stats);
        run_index_jobs(jobs, stats);
        // The query rotated back by each segment's offset, once per step for every head.
        shifted_.assign(segments_.size(), {});
        for (std::size_t g = 0; g < segments_.size(); ++g)
            shifted_[g] = segments_[g].delta != 0
                              ? rope_.shift(step.queries.unsqueeze(1), -segments_[g].delta)
                                    .squeeze(1)
                                    .contiguous()
                              : step.queries;
    }

    void rank(const SparseStep& step, int64_t head, std::vector<Ranking>& rankings) override {
        const int64_t kv_heads = step.cache.kv_heads(), dim = step.cache.head_dim();
        const int64_t wanted = step.retrievable;
        DciQueryOptions query_options;
        query_options.pages = wanted;
        query_options.field_of_view = options_.field_of_view;
        query_options.retrieve_share = options_.retrieve_share;
        const auto plane = static_cast<std::size_t>(step.layer * kv_heads + head);
        struct Found {
            float score;
            std::size_t segment;
            int32_t page;
        };
        std::vector<std::vector<Found>> found(static_cast<std::size_t>(step.group));
        std::vector<const float*> queries(static_cast<std::size_t>(step.group));
        for (std::size_t g = 0; g < segments_.size(); ++g) {
            const auto& index = segments_[g].indexes[plane];
            if (!index) continue;
            // The kv head's query heads walk the index together: each expanded point's children
            // are read once for all of them.
            for (int64_t member = 0; member < step.group; ++member)
                queries[static_cast<std::size_t>(member)] =
                    shifted_[g].data_ptr<float>() + (head * step.group + member) * dim;
            const std::vector<DciQueryResult> results = index->query_group(queries, query_options);
            for (int64_t member = 0; member < step.group; ++member) {
                const DciQueryResult& result = results[static_cast<std::size_t>(member)];
                step.dot_products[static_cast<std::size_t>(head)] += result.dot_products;
                for (std::size_t i = 0; i < result.pages.size(); ++i)
                    found[static_cast<std::size_t>(member)].push_back(
                        {result.page_scores[i], g, result.pages[i]});
            }
        }
        for (int64_t member = 0; member < step.group; ++member) {
            std::vector<Found>& mine = found[static_cast<std::size_t>(member)];
            std::sort(mine.begin(), mine.end(),
                      [](const Found& a, const Found& b) { return a.score > b.score; });
            if (static_cast<int64_t>(mine.size()) > wanted)
                mine.resize(static_cast<std::size_t>(wanted));
            Ranking& ranking = rankings[static_cast<std::size_t>(member)];
            for (const Found& f : mine) {
                const Segment& segment = segments_[f.segment];
                // A page is known by its segment and its number there.
                RankedUnit unit{static_cast<int64_t>(f.segment) << 32 | f.page, {}};
                for (int32_t token : segment.indexes[plane]->tokens_of_page(f.page))
                    unit.rows.push_back(segment.first_row + token);
                ranking.push_back(std::move(unit));
            }
        }
    }

  private:
    /// Adds to `jobs` the index work for the rows of `layer` before `window_start` that no
    /// index holds yet: stored segments are restored, the rest (BOS, the prompt, decoded tokens)
    /// grows live segments. The segments are decided here, on the calling thread; restoring,
    /// building and growing each head's index are the jobs, independent of each other, run on
    /// the compute threads (run_index_jobs).
    void index_rows(int64_t layer, const KvCache& cache, int64_t window_start,
                    std::vector<std::function<void()>>& jobs, SparseStats& stats);
    void run_index_jobs(std::vector<std::function<void()>>& jobs, SparseStats& stats);
    /// A job restoring the stored index of `segment` for one head.
    std::function<void()> restore_job(const Segment& segment, DciIndex* index, int64_t layer,
                                      int64_t head, const KvCache& cache);

    ModelConfig config_;
    const Rope& rope_;
    SparseOptions options_;
    BudgetSplit split_;
    std::vector<float> projection_;
    std::vector<std::unique_ptr<PacketIndex>> stored_indexes_;
    std::vector<Segment> segments_;       // by first row
    std::vector<int64_t> covered_;        // per layer: rows indexed so far
    std::vector<torch::Tensor> shifted_;  // per segment: this step's queries in its frame
    // Where restored indexes keep their keys when the cache's tier is a file (the cache's
    // KvCache::new_spill_file(), made on first use; null for a cache in memory).
    std::unique_ptr<FileArena> spill_;
    bool spill_asked_ = false;
};

std::function<void()> IceCache::restore_job(const Segment& segment, DciIndex* index, int64_t layer,
                                            int64_t head, const KvCache& cache) {
    return [&rope = rope_, index, &cache, head, first = segment.first_row,
            count = segment.stored_count, delta = segment.delta, stored_index = segment.stored,
            stored_segment = segment.stored_segment, layer, kv_heads = config_.num_kv_heads,
            arena = spill_.get()] {
        // Each layout is restored once: its memory goes when its index exists.
        const DciLayout layout = stored_index->take_layout(layer, head, kv_heads, stored_segment);
        const std::string source = "the index of cache rows " + std::to_string(first) + "+";
        const int64_t dim = cache.head_dim();
        // Keys that were bf16 stay bf16 in the index: exact, and half the bytes a query reads.
        const bool bf16_keys = cache.dtype() == torch::kBFloat16 && dim % 2 == 0;
        if (!arena && bf16_keys) {
            const torch::Tensor plane = cache.keys(layer)[head];
            // (Rope::shift rotates rows of the whole head_dim only; others take index_keys.)
            if (plane.device().is_cpu() && plane.stride(1) == 1 && plane.stride(0) == dim &&
                2 * static_cast<int64_t>(rope.inverse_frequencies().size()) == dim) {
                // Rows copied from the cache a few thousand at a time, no float32 copy of the
                // head (two of them, 16 MB at 32k tokens, every page new to the process).
                const auto* rows = static_cast<const uint16_t*>(plane.data_ptr()) + first * dim;
                const RopeSettings settings{rope.layout(), dim, rope.inverse_frequencies()};
                index->restore_in_place(
                    [&](std::span<const int32_t> tokens, float* out) {
                        read_rotated_floats(rows, dim, tokens, settings, delta, out);
                    },
                    count, layout, source, {nullptr, {}, true},
                    [&](std::span<const int32_t> tokens, uint16_t* out) {
                        read_rotated_bf16(rows, dim, tokens, settings, delta, out);
                    });
                return;
            }
        }
        if (!arena) {
            // In memory, in the index's own order of slots: a query reads each expanded point's
            // children as one run of keys.
            const torch::Tensor k = index_keys(cache, layer, head, first, count, delta, rope);
            index->restore_in_place(
                [&](std::span<const int32_t> tokens, float* out) {
                    for (std::size_t i = 0; i < tokens.size(); ++i)
                        std::copy_n(k.data_ptr<float>() + tokens[i] * dim, dim,
                                    out + static_cast<int64_t>(i) * dim);
                },
                count, layout, source, {nullptr, {}, bf16_keys});
            return;
        }
        // Per token: its key, projection and id (DciIndex::restore_in_place).
        const FileArena::Region storage = arena->allocate(
            static_cast<std::size_t>(dci_storage_floats(count, dim, bf16_keys)) * sizeof(float));
        KeyStorage keys_in_file;
        keys_in_file.floats = reinterpret_cast<float*>(storage.bytes.data());
        keys_in_file.bf16_keys = bf16_keys;
        // Queries read by pread: their keys never become resident.
        keys_in_file.read = [arena, offset = storage.offset](int64_t from, int64_t n, float* out) {
            arena->read(offset + static_cast<std::size_t>(from) * sizeof(float),
                        static_cast<std::size_t>(n) * sizeof(float), out);
        };
        index->restore_in_place(
            [&](std::span<const int32_t> tokens, float* out) {
                // Read through the cache (pread from its file): restoring brings no page of it
                // into memory, and the storage is written front to back, each page once, then
                // dropped.
                std::vector<int64_t> rows(tokens.size());
                for (std::size_t i = 0; i < tokens.size(); ++i)
                    rows[i] = first + tokens[i];
                torch::Tensor k = cache.gather_keys(layer, head, rows);
                if (delta != 0) k = rope.shift(k, -delta);
                k = k.contiguous();
                std::copy_n(k.data_ptr<float>(), k.numel(), out);
                drop_mapped_file_pages(storage.bytes.data(), storage.bytes.size());
            },
            count, layout, source, std::move(keys_in_file));
        // Written through the mapping; from now on only read with pread.
        drop_mapped_file_pages(storage.bytes.data(), storage.bytes.size());
    };
}

void IceCache::index_rows(int64_t layer, const KvCache& cache, int64_t window_start,
                          std::vector<std::function<void()>>& jobs, SparseStats& stats) {
    const int64_t kv_heads = cache.kv_heads(), dim = cache.head_dim();
    const auto layer_slot = static_cast<std::size_t>(layer);
    if (!spill_asked_) {
        spill_ = cache.new_spill_file();
        spill_asked_ = true;
    }
    int64_t& covered = covered_[layer_slot];
    while (covered < window_start) {
        auto stored = std::find_if(segments_.begin(), segments_.end(), [&](const Segment& g) {
            return g.stored && g.first_row <= covered && covered < g.first_row + g.stored_count;
        });
        if (stored != segments_.end()) {
            const PacketIndex& packet_index = *stored->stored;
            DciOptions dci;
            dci.page_size = packet_index.page_size;
            dci.promotion_first = packet_index.promotion_first;
            dci.promotion_rest = packet_index.promotion_rest;
            // A layer the packet's index does not cover (kvindex --dense-layers and
            // --reuse-layers other than decoding's) is built from the keys instead.
            const bool covered_layer = packet_index.covers(layer);
            for (int64_t head = 0; head < kv_heads; ++head) {
                auto& index = stored->indexes[static_cast<std::size_t>(layer * kv_heads + head)];
                index = std::make_unique<DciIndex>(dim, packet_index.projection, dci);
                if (covered_layer) {
                    jobs.push_back(restore_job(*stored, index.get(), layer, head, cache));
                    continue;
                }
                jobs.push_back([&rope = rope_, &cache, index = index.get(), layer, head,
                                first = stored->first_row, count = stored->stored_count,
                                delta = stored->delta] {
                    const torch::Tensor k =
                        index_keys(cache, layer, head, first, count, delta, rope);
                    index->build(k.data_ptr<float>(), count);
                });
            }
            if (!covered_layer) stats.indexed_tokens += stored->stored_count * kv_heads;
            covered = stored->first_row + stored->stored_count;
            continue;
        }
        // Up to the next stored segment or the window.
        int64_t end = window_start;
        for (const Segment& g : segments_)
            if (g.stored && g.first_row > covered) end = std::min(end, g.first_row);
        Segment* live = nullptr;
        for (Segment& g : segments_) {
            const auto& first = g.indexes[static_cast<std::size_t>(layer * kv_heads)];
            if (!g.stored && first && g.first_row + g.live_rows[layer_slot] == covered) live = &g;
        }
        const bool grows = live != nullptr;
        if (!live) {
            // A new live segment; later layers find it by its first row.
            auto found = std::find_if(segments_.begin(), segments_.end(), [&](const Segment& g) {
                return !g.stored && g.first_row == covered;
            });
            if (found == segments_.end()) {
                Segment segment;
                segment.first_row = covered;
                segment.indexes.resize(static_cast<std::size_t>(config_.num_layers * kv_heads));
                segment.live_rows.assign(static_cast<std::size_t>(config_.num_layers), 0);
                segments_.push_back(std::move(segment));
                std::sort(
                    segments_.begin(), segments_.end(),
                    [](const Segment& a, const Segment& b) { return a.first_row < b.first_row; });
                found = std::find_if(segments_.begin(), segments_.end(), [&](const Segment& g) {
                    return !g.stored && g.first_row == covered;
                });
            }
            live = &*found;
            DciOptions dci;
            dci.page_size = options_.page_size;
            for (int64_t head = 0; head < kv_heads; ++head)
                live->indexes[static_cast<std::size_t>(layer * kv_heads + head)] =
                    std::make_unique<DciIndex>(dim, projection_, dci);
        }
        for (int64_t head = 0; head < kv_heads; ++head) {
            DciIndex* index =
                live->indexes[static_cast<std::size_t>(layer * kv_heads + head)].get();
            jobs.push_back([&rope = rope_, &cache, index, layer, head, first = covered,
                            count = end - covered, grows] {
                const torch::Tensor k = index_keys(cache, layer, head, first, count, 0, rope);
                if (grows)
                    index->insert(k.data_ptr<float>(), count);
                else
                    index->build(k.data_ptr<float>(), count);
            });
        }
        live->live_rows[layer_slot] += end - covered;
        stats.indexed_tokens += (end - covered) * kv_heads;
        covered = end;
    }
}

void IceCache::run_index_jobs(std::vector<std::function<void()>>& jobs, SparseStats& stats) {
    if (jobs.empty()) return;
    const auto started = Clock::now();
    // One job per (segment, layer, head); at::parallel_for hands them to the compute threads
    // and rethrows the first failure (a stored index that does not fit its keys).
    at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t job = begin; job < end; ++job)
            jobs[static_cast<std::size_t>(job)]();
    });
    jobs.clear();
    stats.index_seconds += since(started);
    if (spill_) stats.offloaded_index_bytes = static_cast<int64_t>(spill_->size());
}

}  // namespace

std::unique_ptr<SparsePolicy> make_icecache(const PolicySetup& setup) {
    return std::make_unique<IceCache>(setup);
}

}  // namespace kv::sparse
