// Sparse decoding: which cached rows each kv head attends to at a decoding step, under a budget
// of resident rows (kv/sparse/options.hpp), by IceCache (pages retrieved through the DCI index)
// or a baseline (StreamingLLM, Quest, H2O, an exact top-k oracle), each a SparsePolicy
// (kv/sparse/policy.hpp). Attention over the chosen rows is an exact softmax.
#pragma once

#include "kv/model/config.hpp"
#include "kv/model/row_chooser.hpp"
#include "kv/packet.hpp"
#include "kv/sparse/options.hpp"
#include "kv/sparse/policy.hpp"

#include <torch/types.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kv {

class KvCache;
class Rope;

struct SparseStats {
    std::vector<double> recall_sum;     ///< per layer: attention mass on the chosen rows
    std::vector<int64_t> recall_count;  ///< per layer: (step, query head) pairs measured
    int64_t selections = 0;             ///< (step, sparse layer, kv head) choices made
    int64_t selected_tokens = 0;        ///< their rows, summed
    /// Per layer: the (step, kv head) choices it made, their rows summed, and the most rows one
    /// kv head attended to at one step (never more than the budget).
    std::vector<int64_t> layer_selections, layer_rows_sum, layer_rows_max;
    int64_t index_dot_products = 0;  ///< q.k computed by IceCache's index queries
    int64_t indexed_tokens = 0;      ///< rows inserted or built into indexes while decoding
    double index_seconds = 0;        ///< building and growing indexes
    double select_seconds = 0;       ///< choosing rows (queries included)
    /// One-token steps (counted in the first layer) and the time their attention took, in the
    /// layers that attended to every row and in those that attended to the rows chosen.
    int64_t steps = 0;
    double dense_attention_seconds = 0, sparse_attention_seconds = 0;
    int64_t offloaded_index_bytes = 0;  ///< the file the indexes of an offloaded cache keep keys in
};

class SparseAttention final : public RowChooser {
  public:
    /// `options.method` other than "full" (UsageError for an unknown one); "full" with
    /// measure_recall chooses nothing and measures nothing either. A page size of 0 takes the
    /// packets' indexes' (add_stored_index), else 16.
    SparseAttention(const ModelConfig& config, const Rope& rope, SparseOptions options);
    ~SparseAttention() override;
    SparseAttention(const SparseAttention&) = delete;
    SparseAttention& operator=(const SparseAttention&) = delete;

    /// Cache rows [first_row, first_row + stored) came from a packet with this index, its keys
    /// rotated by `position_offset` more positions when appended. IceCache uses it as is.
    void add_stored_index(int64_t first_row, int64_t position_offset, PacketIndex index);

    /// RowChooser: the rows each kv head attends to at this one-token step of layer `layer`,
    /// false when it attends to all of them (dense layer, method full, or everything fits the
    /// budget). Keys are read through the cache (KvCache::read_keys), from whichever tier
    /// holds them: a cache on disk is read with pread, a chunk of rows at a time, so that a step
    /// holds no layer of keys.
    bool select(int64_t layer, const torch::Tensor& queries, const KvCache& cache,
                std::vector<std::vector<int64_t>>& rows) override;
    void attended(int64_t layer, bool chose, double seconds) override;

    /// Builds or restores the indexes of every sparse layer for the rows the cache holds now
    /// (IceCache; others need nothing), so that this one-time work happens before decoding
    /// instead of inside its first step. select() does the same lazily when not called. The
    /// stored indexes of an offloaded cache keep their keys and per-token numbers in a file of
    /// the cache's tier (KvCache::new_spill_file): memory holds of an index its pages and the
    /// points that own them, nothing per token.
    void prepare(const KvCache& cache);
    /// prepare() for one layer whose keys are final, while later layers are still being
    /// computed (a document prefilled layer by layer). Calls for different layers must not
    /// overlap each other or a decoding step.
    void prepare_layer(int64_t layer, const KvCache& cache);

    const SparseOptions& options() const { return options_; }
    const SparseStats& stats() const { return stats_; }

  private:
    /// Whether layer `layer` over `rows` cached rows chooses (else attends to all).
    bool chooses(int64_t layer, int64_t rows) const {
        return options_.method != "full" && layer >= options_.dense_layers &&
               rows > options_.budget;
    }
    /// Whether a sparse layer makes its own choice (else it reuses the layer before's).
    bool owns_choice(int64_t layer);
    /// The method's policy, made on first use with the page size known by then (16 unless given
    /// or set by a packet's index).
    SparsePolicy& policy();
    void make_policy();
    /// Rows a kv head may retrieve at a step of `rows` rows: the budget less what stays resident.
    int64_t retrievable_rows(const Residency& resident, int64_t rows) const;
    /// The share of each query head's full softmax that `rows` hold, added to the stats.
    void measure_recall(int64_t layer, const torch::Tensor& queries, const KvCache& cache,
                        const std::vector<std::vector<int64_t>>& rows);

    ModelConfig config_;
    const Rope& rope_;
    SparseOptions options_;
    BudgetSplit split_;
    std::unique_ptr<SparsePolicy> policy_;
    std::vector<std::vector<std::vector<int64_t>>> last_rows_;  // per layer, for reuse
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

}  // namespace kv
