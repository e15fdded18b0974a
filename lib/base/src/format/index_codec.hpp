// Section 6.5 of formats/kvcache.md: a packet's IceCache index (group `index`), written and read.
#pragma once

#include "hdf5_file.hpp"
#include "kv/packet.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kv::format {

/// What is wrong with an index's covered layers (in range, increasing), "" when nothing is.
std::string index_layers_problem(const std::vector<int64_t>& layers, int64_t num_layers);
/// Throws FormatError (prefixed with `what`) unless the index's sizes match its packet of
/// `stored` tokens: checked before anything is written.
void check_index(const PacketIndex& index, const CacheModelInfo& model, int64_t stored,
                 const std::string& what);
void write_index(const FileWriter& out, hid_t packet_group, const PacketIndex& index,
                 const CacheModelInfo& model, int64_t stored, const CacheWriteOptions& options);

/// Which of an index's per-token layouts read_index reads.
struct LayoutChoice {
    enum class Which { all, none, one } which = Which::all;
    std::size_t plane = 0, segment = 0;  ///< for `one`
};
/// The packet's index, or an empty one when it has none or one of another method.
PacketIndex read_index(const FileReader& in, hid_t packet_group, const CacheModelInfo& model,
                       int64_t stored, LayoutChoice choice = {});

}  // namespace kv::format
