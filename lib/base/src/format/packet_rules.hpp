// What the consumers of a packet rely on beyond its shapes (formats/kvcache.md 6.2, 6.5), checked
// by the reader for every packet it reads and by the writer for every packet it writes, so that
// kvinspect check finds what kvpack, kvserve-once and the IceCache index would refuse or misuse,
// and names the packet. Private to lib/base/src/format.
#pragma once

#include "kv/packet.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace kv::format {

/// A number as %g writes it ("nan", "-1", "1e+300"), for messages.
std::string number_text(double value);

/// Positions of a packet without per-head kept tokens strictly increase (keys at one position
/// twice, or out of order, break the causal masks and the rotation of packed contexts). "" or
/// the problem.
std::string positions_problem(const std::vector<int64_t>& positions);

/// An index layout over a segment of `count` tokens, as DciIndex::restore_from needs it: a
/// positive finite norm bound, levels in [0, 127] with no empty level below the top, every
/// token's parent one level up (none at the top), pages of 1 to `page_size` tokens that hold
/// every token once and the children of one parent each. "" or the problem.
std::string index_layout_problem(const DciLayout& layout, int64_t count, int64_t page_size);

/// An index's segments against the packet's positions: each segment's delta (the positions its
/// keys were moved by since indexing) lies in [0, the position of its first token]. "" or the
/// problem.
std::string index_segments_problem(const PacketIndex& index, const std::vector<int64_t>& positions);

}  // namespace kv::format
