// Copying a model's weights out of their mapped files at load (the default; --mmap reads them in
// place): one private arena advised to use transparent huge pages, filled by every compute
// thread at once.
//
// Cloning tensor by tensor spent the load of a 2.5 GB model (the Llama 3.2 1B shape, 2 cores) in
// page faults: those of the fresh copies and those of the mapped file (bench/bench-ttft, the
// "load" column; docs/performance.md).
#pragma once

#include "kv/model/model.hpp"

namespace kv {

/// Replaces every tensor of `weights` in host memory that is already of `dtype` by a contiguous
/// copy of it in one arena, which the copies keep alive; tensors of other dtypes or devices are
/// left for the caller to convert (into fresh memory). Throws Error when the memory cannot be had.
void copy_weights_to_arena(WeightMap& weights, torch::ScalarType dtype);

}  // namespace kv
