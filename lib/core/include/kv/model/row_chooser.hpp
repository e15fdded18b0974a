// What Model::forward asks at a one-token decoding step: which cache rows each kv head attends
// to. Sparse decoding (kv/sparse/sparse_attention.hpp) answers; without a chooser, every row.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace kv {

class KvCache;

class RowChooser {
  public:
    virtual ~RowChooser() = default;
    /// The rows each kv head attends to at this one-token step of layer `layer` (rows[head],
    /// ascending): false when it attends to all of them. `queries` [Hq, 1, D] after RoPE; the
    /// cache holds the layer's keys, the new token's included.
    virtual bool select(int64_t layer, const torch::Tensor& queries, const KvCache& cache,
                        std::vector<std::vector<int64_t>>& rows) = 0;
    /// Told after each such step's attention in layer `layer`: over the rows chosen
    /// (`chose`) or over every row, and how long the attention took (a step's breakdown).
    virtual void attended(int64_t /*layer*/, bool /*chose*/, double /*seconds*/) {}
};

}  // namespace kv
