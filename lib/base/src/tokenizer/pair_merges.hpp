// Byte-pair merging as the BPE tokenizers do it (internal to the library): over and over, the
// adjacent pair that merges best (the leftmost on a tie) becomes one symbol, until no pair
// merges. A heap of candidate pairs over a linked list gives the same choices in O(n log n)
// where rescanning the sequence after every merge is O(n^2) per word.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <queue>
#include <vector>

namespace kv::tokenizer_detail {

/// A merge of two adjacent symbols: its priority (higher merges first) and the merged symbol.
template <typename Priority>
struct PairMerge {
    Priority priority;
    int32_t merged;
};

/// Merges `symbols` in place. `find(left, right)` gives the merge of two adjacent symbols, or
/// nothing where they do not merge; it must give the same answer for the same two symbols.
template <typename Priority, typename Find>
void merge_pairs(std::vector<int32_t>& symbols, Find&& find) {
    const std::size_t n = symbols.size();
    if (n < 2) return;
    std::vector<int32_t> next(n), previous(n);
    for (std::size_t i = 0; i < n; ++i) {
        next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
        previous[i] = static_cast<int32_t>(i) - 1;
    }
    struct Candidate {
        Priority priority;
        int32_t left;  // positions in the original sequence: ties go to the leftmost
        int32_t right;
        int32_t left_symbol;  // what the two were when the pair was found
        int32_t right_symbol;
        int32_t merged;
    };
    auto worse = [](const Candidate& a, const Candidate& b) {
        return a.priority != b.priority ? a.priority < b.priority : a.left > b.left;
    };
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(worse);
    auto consider = [&](int32_t left, int32_t right) {
        if (left < 0 || right < 0) return;
        const std::optional<PairMerge<Priority>> merge = find(symbols[left], symbols[right]);
        if (merge)
            heap.push({merge->priority, left, right, symbols[left], symbols[right], merge->merged});
    };
    for (std::size_t i = 0; i + 1 < n; ++i)
        consider(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));
    std::vector<bool> removed(n, false);
    while (!heap.empty()) {
        const Candidate best = heap.top();
        heap.pop();
        // A stale entry: one side has merged or gone since, so the pair is no longer this one.
        if (removed[best.left] || removed[best.right] || next[best.left] != best.right ||
            symbols[best.left] != best.left_symbol || symbols[best.right] != best.right_symbol)
            continue;
        symbols[best.left] = best.merged;
        removed[best.right] = true;
        next[best.left] = next[best.right];
        if (next[best.right] >= 0) previous[next[best.right]] = best.left;
        consider(previous[best.left], best.left);
        consider(best.left, next[best.left]);
    }
    std::size_t kept = 0;
    for (std::size_t i = 0; i < n; ++i)
        if (!removed[i]) symbols[kept++] = symbols[i];
    symbols.resize(kept);
}

}  // namespace kv::tokenizer_detail
