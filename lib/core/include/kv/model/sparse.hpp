// Sparse decoding: which cached tokens each kv head attends to at a decoding step, under a
// budget of resident tokens, by IceCache (pages retrieved through the DCI index) or a baseline
// (StreamingLLM, Quest, H2O, an exact top-k oracle). Attention over the chosen tokens is an
// exact softmax.
//
// The budget B counts the tokens one query head attends to: a sink (the first tokens), a window
// (the most recent ones, including the token being decoded) and what the method retrieves. With
// pages of 16: sink = window = 16 tokens when B <= 64, else 32, and (B - sink - window) / 16
// retrieved pages; so B = 256 is IceCache's 2 sink + 2 window + 12 pages and B = 64 is
// 1 + 1 + 2 pages (the authors' code cannot express 64: ../shared/research/icecache.md, 3.1).
// Query heads sharing a kv head take the union of their choices, as IceCache does; the first
// `dense_layers` layers attend to everything.
#pragma once

#include "kv/model/config.hpp"
#include "kv/model/kv_cache.hpp"
#include "kv/model/ops.hpp"
#include "kv/packet.hpp"

#include <torch/types.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kv {

enum class SparseMethod { full, streaming, quest, h2o, topk, icecache };

/// "full", "streaming", "quest", "h2o", "topk" or "icecache"; UsageError otherwise.
SparseMethod parse_sparse_method(const std::string& name);
const char* sparse_method_name(SparseMethod method);

struct SparseOptions {
    SparseMethod method = SparseMethod::full;
    int64_t budget = 256;       ///< resident tokens per query head (see above)
    int64_t page_size = 16;     ///< IceCache and Quest pages
    int64_t dense_layers = 2;   ///< the first layers attend to every token
    int64_t reuse_layers = 1;   ///< a choice serves this many consecutive layers (IceCache(r): 3)
    int64_t field_of_view = 0;  ///< IceCache query; 0: max(tokens / 1000, 30)
    double retrieve_share = 0.8;
    bool measure_recall = false;  ///< compute the full softmax too, to report attention recall
    /// Where the stored indexes of a cache offloaded to disk keep their keys (a temporary file;
    /// empty: $TMPDIR, else /tmp). See prepare().
    std::filesystem::path offload_dir;
};

/// The resident split a budget gives (see the header comment).
struct BudgetSplit {
    int64_t sink = 0, window = 0, retrieved = 0;  ///< tokens
};
BudgetSplit split_budget(int64_t budget, int64_t page_size);

struct SparseStats {
    std::vector<double> recall_sum;     ///< per layer: attention mass on the chosen tokens
    std::vector<int64_t> recall_count;  ///< per layer: (step, query head) pairs measured
    int64_t selections = 0;             ///< (step, sparse layer, kv head) choices made
    int64_t selected_tokens = 0;        ///< their tokens, summed
    int64_t index_dot_products = 0;     ///< q.k computed by IceCache's index queries
    int64_t indexed_tokens = 0;         ///< tokens inserted or built into indexes while decoding
    double index_seconds = 0;           ///< building and growing indexes
    double select_seconds = 0;          ///< choosing tokens (queries included)
    int64_t offloaded_index_bytes = 0;  ///< the file the indexes of an offloaded cache keep keys in
};

class SparseAttention {
  public:
    SparseAttention(const ModelConfig& config, const Rope& rope, SparseOptions options);
    ~SparseAttention();
    SparseAttention(const SparseAttention&) = delete;
    SparseAttention& operator=(const SparseAttention&) = delete;

    /// Cache rows [first_row, first_row + stored) came from a packet with this index, its keys
    /// rotated by `position_offset` more positions when appended. IceCache uses it as is.
    void add_stored_index(int64_t first_row, int64_t position_offset, PacketIndex index);

    /// The rows each kv head attends to at this one-token step of layer `layer`: false when it
    /// attends to all of them (dense layer, method full, or everything fits the budget).
    /// `queries` [Hq, 1, D] after RoPE; `keys` [Hkv, S, D] including the new token.
    bool select(int64_t layer, const torch::Tensor& queries, const torch::Tensor& keys,
                std::vector<std::vector<int64_t>>& rows);

    /// Builds or restores the indexes of every sparse layer for the rows the cache holds now
    /// (IceCache; others need nothing), so that this one-time work happens before decoding
    /// instead of inside its first step. select() does the same lazily when not called.
    /// Given a cache offloaded to disk, every method's select() reads that cache's keys from its
    /// file with pread, a chunk of rows at a time, so that a step holds no layer of keys (quest's
    /// page summaries, h2o's kept rows and the recall measurement's normaliser included).
    /// For a cache offloaded to disk (KvCache::on_disk) the stored indexes keep their keys and
    /// per-token numbers in a file too (DciIndex::restore_in_place), restoring reads the cache
    /// with pread, and queries read the file the same way: memory holds of an index its pages
    /// and the points that own them, nothing per token. Decoded tokens still join live indexes
    /// in memory.
    void prepare(const KvCache& cache);
    /// prepare() for one layer whose keys [Hkv, S, D] are final, while later layers are still
    /// being computed (a document prefilled layer by layer). Calls for different layers must not
    /// overlap each other or a decoding step.
    void prepare_layer(int64_t layer, const torch::Tensor& keys);

    const SparseOptions& options() const { return options_; }
    const SparseStats& stats() const { return stats_; }

  private:
    /// Adds to `jobs` the index work for the rows of `layer` that left the window.
    void index_rows(int64_t layer, const torch::Tensor& keys,
                    std::vector<std::function<void()>>& jobs);
    void run_index_jobs(std::vector<std::function<void()>>& jobs);
    /// Whether layer `layer` over `tokens` cached tokens chooses rows (else attends to all).
    bool chooses(int64_t layer, int64_t tokens) const {
        return options_.method != SparseMethod::full && layer >= options_.dense_layers &&
               tokens > options_.budget;
    }

    struct State;
    std::unique_ptr<State> state_;
    SparseOptions options_;
    SparseStats stats_;
};

/// Builds IceCache's indexes of the layers a layer-by-layer prefill (Model::prefill_by_layer)
/// has finished, on one worker thread, in layer order, while the prefill computes the next
/// layers: the overlap IceCache gets when the layers run on an accelerator and the host is
/// free. Each layer's keys must be final when layer_done() is called.
class IndexWorker {
  public:
    IndexWorker(SparseAttention& sparse, const KvCache& cache);
    /// Joins the worker (a failure not collected by finish() is dropped).
    ~IndexWorker();
    IndexWorker(const IndexWorker&) = delete;
    IndexWorker& operator=(const IndexWorker&) = delete;

    void layer_done(int64_t layer);
    /// Waits for every queued layer; rethrows the first failure.
    void finish();

  private:
    void work();

    SparseAttention& sparse_;
    const KvCache& cache_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<int64_t> layers_;
    bool closed_ = false;
    std::exception_ptr failure_;
    std::thread worker_;  // last: started once everything above exists
};

/// Exact attention of one token's queries [Hq, 1, D] over the chosen rows of each kv head of
/// keys/values [Hkv, S, D]; returns [Hq, 1, D] in the queries' dtype.
torch::Tensor attention_over_rows(const torch::Tensor& queries, const torch::Tensor& keys,
                                  const torch::Tensor& values,
                                  const std::vector<std::vector<int64_t>>& rows, double scale);

/// attention_over_rows() over the cache's layer `layer`, the chosen rows of every kv head
/// gathered into one staging buffer first (KvCache::gather: from an offloaded cache's file
/// without mapping a page) and moved to the queries' device in one transfer. The same result.
torch::Tensor attention_over_staged_rows(const torch::Tensor& queries, const KvCache& cache,
                                         int64_t layer,
                                         const std::vector<std::vector<int64_t>>& rows,
                                         double scale);

/// Exact attention of one token's queries [Hq, 1, D] over every row of the cache's layer
/// `layer` (the decoding token sees them all: no mask), its keys then its values read `chunk`
/// rows at a time with KvCache::gather, so that an offloaded cache's dense layers hold one chunk
/// of rows in memory, not the layer (and a score per row and query head of one kv head). For
/// bf16 and float32 caches the same bits as attention() over the rows in memory, whatever the
/// chunk: the same kernels in the same order.
torch::Tensor attention_streamed(const torch::Tensor& queries, const KvCache& cache, int64_t layer,
                                 double scale, int64_t chunk = 4096);

}  // namespace kv
