// One sparse decoding method, as SparseAttention (kv/sparse/sparse_attention.hpp) drives it: the
// shape of kvpress's ScorerPress, where the shared machinery is written once and each method
// overrides only what is its own. The engine decides when a layer chooses at all (dense layers,
// contexts within the budget), keeps the sink and the window resident, merges the query heads
// of a kv head and holds the union to the budget, lets one choice serve several layers, and
// measures recall; a policy says which rows stay resident and ranks what it would retrieve.
//
// Adding a method: a file under lib/core/src/sparse/ with a SparsePolicy, a line in its
// registry (registry.cpp), a test, and a line in kvserve-once(1).
#pragma once

#include "kv/model/config.hpp"
#include "kv/packet.hpp"
#include "kv/sparse/options.hpp"

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace kv {

class KvCache;
class Rope;
struct SparseStats;

/// The rows a kv head keeps resident at a step whatever it retrieves: the first `sink` rows
/// and the rows from `window_start` on (the token being decoded is the last).
struct Residency {
    int64_t sink = 0;
    int64_t window_start = 0;
};

/// One layer's decoding step, as the engine hands it to a policy.
struct SparseStep {
    int64_t layer = 0;
    const torch::Tensor& queries;  ///< [Hq, D] float32 on the CPU, after RoPE
    const KvCache& cache;          ///< the layer's keys, read through KvCache::read_keys
    int64_t rows = 0;              ///< rows of the layer, the decoding token's included
    int64_t group = 1;             ///< query heads per kv head
    Residency resident;
    /// Units (pages or rows) a kv head may retrieve: (budget - sink - window) / unit_rows().
    int64_t retrievable = 0;
    /// Per kv head: the exact q.k its ranking computed in an index (summed into the stats after
    /// the step, so that heads ranked at once count apart).
    std::vector<int64_t>& dot_products;
};

/// What one query head would retrieve, best first: each unit (a page, or one row) with the
/// rows it brings. `id` tells units apart across the group (the same page seen by two query
/// heads is one unit).
struct RankedUnit {
    int64_t id = 0;
    std::vector<int64_t> rows;
};
using Ranking = std::vector<RankedUnit>;

/// What a policy is built from.
struct PolicySetup {
    const ModelConfig& config;
    const Rope& rope;
    const SparseOptions& options;
    BudgetSplit split;
};

class SparsePolicy {
  public:
    virtual ~SparsePolicy() = default;

    /// Rows resident at a step of `rows` rows: by default the split's sink and window.
    virtual Residency residency(const BudgetSplit& split, int64_t budget, int64_t rows) const;
    /// Rows one unit of a ranking holds at most: the page size for page-based methods, 1 for
    /// row-based ones.
    virtual int64_t unit_rows() const = 0;
    /// Fills ranking[m] for each query head m of kv head `head` (the group's members in order),
    /// best first; rows inside the sink and the window need not be left out. May be called for
    /// several heads at once when parallel_heads(); a head's state is its own.
    virtual void rank(const SparseStep& step, int64_t head, std::vector<Ranking>& rankings) = 0;
    /// Whether rank() may run for several kv heads at once (on the compute threads).
    virtual bool parallel_heads() const { return false; }
    /// Whether a layer's choice may serve the next layers (--reuse-layers).
    virtual bool reusable() const { return true; }

    /// Work before a sparse layer's step ranks anything (IceCache indexes the rows that left
    /// the window since the last step).
    virtual void begin_step(const SparseStep& /*step*/, SparseStats& /*stats*/) {}
    /// Cache rows [first_row, first_row + stored) came from a packet with this index, its keys
    /// rotated by `position_offset` more positions when appended.
    virtual void add_stored_index(int64_t /*first_row*/, int64_t /*position_offset*/,
                                  PacketIndex /*index*/) {}
    /// One-time work over the rows `cache` holds in `layers` (IceCache builds or restores its
    /// indexes), so that it happens before decoding, not inside its first step.
    virtual void prepare(const KvCache& /*cache*/, const std::vector<int64_t>& /*layers*/,
                         SparseStats& /*stats*/) {}
};

/// The policy of a registered method other than "full"; UsageError for an unknown name.
std::unique_ptr<SparsePolicy> make_sparse_policy(const std::string& method,
                                                 const PolicySetup& setup);

}  // namespace kv
