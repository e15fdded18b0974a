// Attention of one decoding token over some rows of a layer, or over all of them read a chunk at
// a time: the kernels Model::forward uses when a RowChooser (sparse decoding) picked the rows, or
// when the cache lives on disk and no layer of it may be resident at once.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace kv {

class KvCache;

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
