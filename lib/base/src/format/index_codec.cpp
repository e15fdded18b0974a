#include "index_codec.hpp"

#include "spec.hpp"

#include <algorithm>

namespace kv::format {

std::string index_layers_problem(const std::vector<int64_t>& layers, int64_t num_layers) {
    for (std::size_t i = 0; i < layers.size(); ++i) {
        if (layers[i] < 0 || layers[i] >= num_layers)
            return "layer " + std::to_string(layers[i]) + " is outside [0, " +
                   std::to_string(num_layers) + ")";
        if (i > 0 && layers[i] <= layers[i - 1]) return "its layers do not increase";
    }
    return "";
}

void check_index(const PacketIndex& index, const CacheModelInfo& m, int64_t stored,
                 const std::string& what) {
    auto fail = [&](const std::string& problem) {
        throw FormatError(what + ": invalid index: " + problem);
    };
    if (static_cast<int64_t>(index.projection.size()) != m.head_dim + 1)
        fail("the projection needs head_dim + 1 values");
    if (index.page_size < 2) fail("page_size below 2");
    int64_t next = 0;
    for (const IndexSegment& segment : index.segments) {
        if (segment.first != next || segment.count <= 0) fail("segments must tile the tokens");
        next += segment.count;
    }
    if (next != stored) fail("segments must tile the tokens");
    const std::string problem = index_layers_problem(index.layers, m.num_layers);
    if (!problem.empty()) fail(problem);
    const int64_t rows =
        index.layers.empty() ? m.num_layers : static_cast<int64_t>(index.layers.size());
    if (static_cast<int64_t>(index.layouts.size()) !=
        rows * m.num_kv_heads * static_cast<int64_t>(index.segments.size()))
        fail("one layout per covered layer, kv-head and segment is needed");
    for (std::size_t i = 0; i < index.layouts.size(); ++i) {
        const DciLayout& layout = index.layouts[i];
        const auto count =
            static_cast<std::size_t>(index.segments[i % index.segments.size()].count);
        int64_t paged = 0;
        for (int32_t size : layout.page_sizes)
            paged += size;
        if (layout.levels.size() != count || layout.parents.size() != count ||
            layout.page_tokens.size() != count || paged != static_cast<int64_t>(count))
            fail("a layout does not match its segment's length");
    }
}

void write_index(const FileWriter& out, hid_t packet_group, const PacketIndex& index,
                 const CacheModelInfo& m, int64_t stored, const CacheWriteOptions& options) {
    Handle group = out.create_group(packet_group, "index");
    const hid_t g = group.get();
    out.write_string(g, "method", "mdci");
    out.write_integer(g, "page_size", index.page_size);
    out.write_double(g, "promotion_first", index.promotion_first);
    out.write_double(g, "promotion_rest", index.promotion_rest);
    // The covered layers' rows only (all of them when `layers` is empty).
    const auto layers = static_cast<hsize_t>(
                   index.layers.empty() ? m.num_layers : static_cast<int64_t>(index.layers.size())),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    const auto segments = static_cast<hsize_t>(index.segments.size());
    const auto tokens = static_cast<hsize_t>(stored);
    if (!index.layers.empty())
        out.write_dataset(g, "layers", H5T_STD_I64LE, H5T_NATIVE_INT64, {layers}, {}, options,
                          false, index.layers.data());
    out.write_dataset(g, "projection", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {index.projection.size()},
                      {}, options, false, index.projection.data());
    std::vector<int64_t> segment_table;
    for (const IndexSegment& segment : index.segments)
        segment_table.insert(segment_table.end(), {segment.first, segment.count, segment.delta});
    out.write_dataset(g, "segments", H5T_STD_I64LE, H5T_NATIVE_INT64, {segments, 3}, {}, options,
                      false, segment_table.data());

    std::vector<double> norms;
    std::vector<int32_t> page_counts;
    std::vector<int8_t> levels;
    std::vector<int32_t> parents, page_tokens;
    std::vector<std::vector<int32_t>> sizes_per_plane(layers * heads);
    std::size_t widest = 1;
    for (std::size_t plane = 0; plane < layers * heads; ++plane) {
        for (std::size_t segment = 0; segment < segments; ++segment) {
            const DciLayout& layout = index.layouts[plane * segments + segment];
            norms.push_back(layout.max_squared_norm);
            page_counts.push_back(static_cast<int32_t>(layout.page_sizes.size()));
            levels.insert(levels.end(), layout.levels.begin(), layout.levels.end());
            parents.insert(parents.end(), layout.parents.begin(), layout.parents.end());
            page_tokens.insert(page_tokens.end(), layout.page_tokens.begin(),
                               layout.page_tokens.end());
            sizes_per_plane[plane].insert(sizes_per_plane[plane].end(), layout.page_sizes.begin(),
                                          layout.page_sizes.end());
        }
        widest = std::max(widest, sizes_per_plane[plane].size());
    }
    std::vector<int32_t> page_sizes(layers * heads * widest, 0);
    for (std::size_t plane = 0; plane < layers * heads; ++plane)
        std::copy(sizes_per_plane[plane].begin(), sizes_per_plane[plane].end(),
                  page_sizes.begin() + static_cast<std::ptrdiff_t>(plane * widest));
    const std::vector<hsize_t> per_token = {layers, heads, tokens};
    const std::vector<hsize_t> token_chunk = {
        1, 1, std::max<hsize_t>(1, std::min<hsize_t>(tokens, max_1d_chunk))};
    out.write_dataset(g, "max_squared_norm", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                      {layers, heads, segments}, {}, options, false, norms.data());
    out.write_dataset(g, "page_counts", H5T_STD_I32LE, H5T_NATIVE_INT32, {layers, heads, segments},
                      {}, options, false, page_counts.data());
    out.write_dataset(g, "levels", H5T_STD_I8LE, H5T_NATIVE_INT8, per_token, token_chunk, options,
                      true, levels.data());
    out.write_dataset(g, "parents", H5T_STD_I32LE, H5T_NATIVE_INT32, per_token, token_chunk,
                      options, true, parents.data());
    out.write_dataset(g, "page_tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, per_token, token_chunk,
                      options, true, page_tokens.data());
    out.write_dataset(g, "page_sizes", H5T_STD_I32LE, H5T_NATIVE_INT32,
                      {layers, heads, static_cast<hsize_t>(widest)},
                      {1, 1, std::min<hsize_t>(widest, max_1d_chunk)}, options, true,
                      page_sizes.data());
}

PacketIndex read_index(const FileReader& in, hid_t packet_group, const CacheModelInfo& m,
                       int64_t stored, LayoutChoice choice) {
    PacketIndex index;
    if (H5Lexists(packet_group, "index", H5P_DEFAULT) <= 0) return index;
    Handle group = in.open_group(packet_group, "index", "index");
    const hid_t g = group.get();
    if (in.string_attribute(g, "method", "index") != "mdci") return index;
    index.page_size = in.integer_attribute(g, "page_size", "index");
    index.promotion_first = in.float_attribute(g, "promotion_first", "index");
    index.promotion_rest = in.float_attribute(g, "promotion_rest", "index");
    if (index.page_size < 2 || index.page_size > (1 << 20))
        in.fail("index: page_size " + std::to_string(index.page_size) + " out of range");
    const auto dim = static_cast<hsize_t>(m.head_dim);
    index.projection =
        in.numeric_dataset<float>(g, "projection", "index/projection", {dim + 1}, H5T_NATIVE_FLOAT);
    std::vector<hsize_t> dims;
    const std::vector<int64_t> table = in.numeric_dataset<int64_t>(g, "segments", "index/segments",
                                                                   {0, 3}, H5T_NATIVE_INT64, &dims);
    const auto segments = dims[0];
    int64_t next = 0;
    for (hsize_t i = 0; i < segments; ++i) {
        const IndexSegment segment{table[i * 3], table[i * 3 + 1], table[i * 3 + 2]};
        if (segment.first != next || segment.count <= 0)
            in.fail("index: segments do not tile the packet's tokens");
        next += segment.count;
        index.segments.push_back(segment);
    }
    if (next != stored) in.fail("index: segments do not tile the packet's tokens");
    if (H5Lexists(g, "layers", H5P_DEFAULT) > 0) {
        index.layers =
            in.numeric_dataset<int64_t>(g, "layers", "index/layers", {0}, H5T_NATIVE_INT64);
        if (index.layers.empty()) in.fail("index: 'layers' lists no layer");
        const std::string problem = index_layers_problem(index.layers, m.num_layers);
        if (!problem.empty()) in.fail("index: " + problem);
    }
    // Rows of the per-layer datasets: the covered layers.
    const auto layers = static_cast<hsize_t>(
                   index.layers.empty() ? m.num_layers : static_cast<int64_t>(index.layers.size())),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    const auto tokens = static_cast<hsize_t>(stored);
    const auto norms = in.numeric_dataset<double>(g, "max_squared_norm", "index/max_squared_norm",
                                                  {layers, heads, segments}, H5T_NATIVE_DOUBLE);
    const auto page_counts = in.numeric_dataset<int32_t>(
        g, "page_counts", "index/page_counts", {layers, heads, segments}, H5T_NATIVE_INT32);
    // Read one (layer, kv-head) row at a time straight into its layouts: memory never holds
    // the datasets twice (a long packet's index is tens of bytes per token and plane).
    const Handle levels =
        in.numeric_dataset_checked(g, "levels", "index/levels", {layers, heads, tokens});
    const Handle parents =
        in.numeric_dataset_checked(g, "parents", "index/parents", {layers, heads, tokens});
    const Handle page_tokens =
        in.numeric_dataset_checked(g, "page_tokens", "index/page_tokens", {layers, heads, tokens});
    const Handle page_sizes =
        in.numeric_dataset_checked(g, "page_sizes", "index/page_sizes", {layers, heads, 0}, &dims);
    const std::size_t widest = dims[2];
    if (choice.which == LayoutChoice::Which::none) return index;
    // The caller checked the plane; a segment beyond the index's is the caller's mistake too.
    std::size_t wanted_plane = 0;  // for `one`: the plane's row among the covered layers'
    if (choice.which == LayoutChoice::Which::one) {
        const auto layer = static_cast<int64_t>(choice.plane / heads);
        if (choice.plane >= static_cast<std::size_t>(m.num_layers) * heads ||
            choice.segment >= segments)
            throw UsageError(
                in.source() + ": no index layout for plane " + std::to_string(choice.plane) +
                ", segment " + std::to_string(choice.segment) + " (the index has " +
                std::to_string(segments) + " segment" + (segments == 1 ? "" : "s") + ")");
        if (!index.covers(layer)) return index;  // no layout: the layer is not covered
        wanted_plane = static_cast<std::size_t>(index.row_of(layer)) * heads + choice.plane % heads;
    }
    std::vector<int32_t> plane_page_sizes;
    for (std::size_t plane = 0; plane < layers * heads; ++plane) {
        if (choice.which == LayoutChoice::Which::one && plane != wanted_plane) continue;
        const hsize_t layer = plane / heads, head = plane % heads;  // layer: the dataset's row
        in.read_row(page_sizes.get(), "index/page_sizes", H5T_NATIVE_INT32, layer, head, 0, widest,
                    plane_page_sizes);
        std::size_t page = 0;
        for (std::size_t s = 0; s < segments; ++s) {
            const IndexSegment& segment = index.segments[s];
            const auto from = static_cast<hsize_t>(segment.first);
            const auto count = static_cast<hsize_t>(segment.count);
            const int32_t pages = page_counts[plane * segments + s];
            if (pages < 0 || page + static_cast<std::size_t>(pages) > widest)
                in.fail("index: page_counts exceed page_sizes");
            if (choice.which == LayoutChoice::Which::one && s != choice.segment) {
                page += static_cast<std::size_t>(pages);  // an earlier segment's pages
                continue;
            }
            DciLayout layout;
            layout.max_squared_norm = norms[plane * segments + s];
            in.read_row(levels.get(), "index/levels", H5T_NATIVE_INT8, layer, head, from, count,
                        layout.levels);
            in.read_row(parents.get(), "index/parents", H5T_NATIVE_INT32, layer, head, from, count,
                        layout.parents);
            in.read_row(page_tokens.get(), "index/page_tokens", H5T_NATIVE_INT32, layer, head, from,
                        count, layout.page_tokens);
            int64_t held = 0;
            for (int32_t p = 0; p < pages; ++p, ++page) {
                const int32_t size = plane_page_sizes[page];
                if (size <= 0 || size > index.page_size) in.fail("index: a page size out of range");
                held += size;
                layout.page_sizes.push_back(size);
            }
            if (held != segment.count) in.fail("index: pages do not hold the segment's tokens");
            index.layouts.push_back(std::move(layout));
        }
    }
    return index;
}

}  // namespace kv::format
