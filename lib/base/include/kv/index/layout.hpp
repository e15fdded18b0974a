// The IceCache index as a cache file stores it (formats/kvcache.md, section 6.5), without
// libtorch or the index code: what kvindex writes, kvpack carries and kvserve-once restores.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace kv {

/// One index of one (layer, kv-head) over one segment: the tree and pages, without the keys
/// (projections and distances are recomputed from them).
struct DciLayout {
    double max_squared_norm = 0;
    std::vector<int8_t> levels;        ///< per token
    std::vector<int32_t> parents;      ///< per token, segment-relative, -1 under the root
    std::vector<int32_t> page_sizes;   ///< per page, pages in storage order
    std::vector<int32_t> page_tokens;  ///< the pages' tokens, page after page, projection order
};

/// Consecutive stored tokens indexed on their own; `delta` positions were added to their keys
/// after indexing (kvpack), so a query meets the index rotated back by delta.
struct IndexSegment {
    int64_t first = 0;
    int64_t count = 0;
    int64_t delta = 0;
};

/// A packet's index: empty (no segments) when it has none.
struct PacketIndex {
    int64_t page_size = 16;
    double promotion_first = 0.01;
    double promotion_rest = 0.2;
    std::vector<float> projection;  ///< [head_dim + 1], unit length
    std::vector<IndexSegment> segments;
    /// [layer][kv-head][segment], flattened: (layer * kv_heads + head) * segments + segment.
    /// Empty when the layouts were left in the file (read_layout reads them one at a time).
    std::vector<DciLayout> layouts;
    /// Reads the layout of (layer, kv-head, segment) from the file the index came from
    /// (CacheReader::read_index_layout); set instead of `layouts` where a packet's index is
    /// restored one plane at a time, so memory never holds every plane's layout at once.
    std::function<DciLayout(int64_t layer, int64_t head, int64_t segment)> read_layout;

    bool empty() const { return segments.empty(); }
    /// The layout, moved out of `layouts` (each is restored once) or read by read_layout.
    DciLayout take_layout(int64_t layer, int64_t head, int64_t kv_heads, int64_t segment) {
        if (layouts.empty() && read_layout) return read_layout(layer, head, segment);
        return std::exchange(layout(layer, head, kv_heads, segment), DciLayout{});
    }
    const DciLayout& layout(int64_t layer, int64_t head, int64_t kv_heads, int64_t segment) const {
        return layouts[static_cast<std::size_t>(
            (layer * kv_heads + head) * static_cast<int64_t>(segments.size()) + segment)];
    }
    DciLayout& layout(int64_t layer, int64_t head, int64_t kv_heads, int64_t segment) {
        return layouts[static_cast<std::size_t>(
            (layer * kv_heads + head) * static_cast<int64_t>(segments.size()) + segment)];
    }
};

}  // namespace kv
