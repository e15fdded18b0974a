#include "packet_rules.hpp"

#include <cmath>
#include <cstdio>

namespace kv::format {

std::string number_text(double value) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", value);
    return text;
}

std::string positions_problem(const std::vector<int64_t>& positions) {
    for (std::size_t i = 1; i < positions.size(); ++i)
        if (positions[i] <= positions[i - 1])
            return "positions do not increase (" + std::to_string(positions[i - 1]) + " then " +
                   std::to_string(positions[i]) + " at tokens " + std::to_string(i - 1) + " and " +
                   std::to_string(i) + ")";
    return "";
}

std::string index_layout_problem(const DciLayout& layout, int64_t count, int64_t page_size) {
    const auto n = static_cast<std::size_t>(count);
    if (layout.levels.size() != n || layout.parents.size() != n || layout.page_tokens.size() != n)
        return "a layout does not match its segment's length";
    if (!(layout.max_squared_norm > 0) || !std::isfinite(layout.max_squared_norm))
        return "max_squared_norm is not a positive number";
    int top = 0;
    for (std::size_t token = 0; token < n; ++token) {
        if (layout.levels[token] < 0)
            return "token " + std::to_string(token) + " has a negative level";
        top = std::max<int>(top, layout.levels[token]);
    }
    std::vector<int64_t> per_level(static_cast<std::size_t>(top) + 1, 0);
    for (int8_t level : layout.levels)
        ++per_level[static_cast<std::size_t>(level)];
    for (int level = 1; level <= top; ++level)
        if (per_level[static_cast<std::size_t>(level)] == 0)
            return "level " + std::to_string(level) + " is empty, below level " +
                   std::to_string(top);
    for (std::size_t token = 0; token < n; ++token) {
        const int32_t parent = layout.parents[token];
        const int level = layout.levels[token];
        if (level == top) {
            if (parent != -1) return "token " + std::to_string(token) + " at the top has a parent";
        } else if (parent < 0 || static_cast<std::size_t>(parent) >= n ||
                   layout.levels[static_cast<std::size_t>(parent)] != level + 1) {
            return "token " + std::to_string(token) + " has no parent one level up";
        }
    }
    std::vector<char> paged(n, 0);
    std::size_t next = 0;
    for (std::size_t page = 0; page < layout.page_sizes.size(); ++page) {
        const int32_t size = layout.page_sizes[page];
        if (size <= 0 || size > page_size || next + static_cast<std::size_t>(size) > n)
            return "page " + std::to_string(page) + " holds " + std::to_string(size) +
                   " tokens (pages hold 1 to " + std::to_string(page_size) +
                   " of the segment's " + std::to_string(count) + ")";
        int32_t parent = 0;
        for (int32_t i = 0; i < size; ++i, ++next) {
            const int32_t token = layout.page_tokens[next];
            if (token < 0 || static_cast<std::size_t>(token) >= n)
                return "page " + std::to_string(page) + " holds token " + std::to_string(token) +
                       ", outside the segment";
            if (paged[static_cast<std::size_t>(token)])
                return "token " + std::to_string(token) + " is in two pages";
            paged[static_cast<std::size_t>(token)] = 1;
            const int32_t its_parent = layout.parents[static_cast<std::size_t>(token)];
            if (i == 0) parent = its_parent;
            if (its_parent != parent)
                return "page " + std::to_string(page) + " mixes the children of two parents";
        }
    }
    if (next != n) return "the pages do not hold every token";
    return "";
}

std::string index_segments_problem(const PacketIndex& index, const std::vector<int64_t>& positions) {
    for (std::size_t s = 0; s < index.segments.size(); ++s) {
        const IndexSegment& segment = index.segments[s];
        const auto first = static_cast<std::size_t>(segment.first);
        const int64_t limit = first < positions.size() ? positions[first] : 0;
        if (segment.delta < 0 || segment.delta > limit)
            return "segment " + std::to_string(s) + " was moved by " +
                   std::to_string(segment.delta) + " positions, outside [0, " +
                   std::to_string(limit) + "] (the position of its first token)";
    }
    return "";
}

}  // namespace kv::format
