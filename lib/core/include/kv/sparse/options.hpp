// Sparse decoding's settings and the methods there are, without libtorch: what the tools parse
// and pass on (kv/sparse/sparse_attention.hpp does the work).
//
// The budget B counts the cache rows one kv head attends to at a decoding step, the union over
// its query heads included: a sink (the first rows), a window (the most recent ones, the token
// being decoded among them) and what the method retrieves. With pages of 16: sink = window = 16
// rows when B <= 64, else 32, and (B - sink - window) / 16 retrieved pages; so B = 256 is
// IceCache's 2 sink + 2 window + 12 pages and B = 64 is 1 + 1 + 2 pages (the authors' code
// cannot express 64: its page budget keeps 2 sink and 2 window pages). The first
// `dense_layers` layers attend to everything.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kv {

struct SparseOptions {
    std::string method = "full";  ///< a name of sparse_methods(); "full" attends to everything
    int64_t budget = 256;         ///< rows each kv head attends to (see above)
    /// IceCache's and Quest's pages; 0: those of the packets' indexes (kvindex --page-size),
    /// else 16.
    int64_t page_size = 0;
    int64_t dense_layers = 2;     ///< the first layers attend to every row
    int64_t reuse_layers = 1;     ///< a choice serves this many consecutive layers (IceCache(r): 3)
    int64_t field_of_view = 0;    ///< IceCache query; 0: max(tokens / 1000, 30)
    double retrieve_share = 0.8;  ///< IceCache: share of an expanded point's children scored
    bool measure_recall = false;  ///< compute the full softmax too, to report attention recall
};

/// The resident split a budget gives (see the header comment).
struct BudgetSplit {
    int64_t sink = 0, window = 0, retrieved = 0;  ///< rows
};
BudgetSplit split_budget(int64_t budget, int64_t page_size);

/// A decoding attention method, as the command line offers it.
struct SparseMethodInfo {
    std::string name;  ///< as --attention takes it
    std::string help;  ///< one line for --help and the man page
};
/// Every method, "full" first: the registry (lib/core/src/sparse/registry.cpp).
const std::vector<SparseMethodInfo>& sparse_methods();
/// Throws UsageError naming the methods there are unless `name` is one.
void check_sparse_method(const std::string& name);

}  // namespace kv
