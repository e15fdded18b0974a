// Section 6.3 of formats/kvcache.md: per-(layer, kv-head) kept tokens of a compressed packet
// (`head_lengths`, `head_positions`), checked, written and read.
#pragma once

#include "hdf5_file.hpp"
#include "kv/packet.hpp"

#include <cstdint>
#include <string>

namespace kv::format {

/// What is wrong with a packet's per-head kept tokens, "" when nothing is: the sizes, each
/// head's used slots at increasing positions inside the packet, and no slot position above the
/// packet's `positions` entry for it (which readers without per-head masks rely on).
std::string ragged_problem(const Packet& packet, int64_t layers, int64_t heads);

void write_head_positions(const FileWriter& out, hid_t packet_group, const Packet& packet,
                          const CacheModelInfo& model, const CacheWriteOptions& options);
/// Whether the packet's group holds per-head kept tokens.
bool has_head_positions(hid_t packet_group);
/// Reads them into packet.head_lengths and packet.head_positions (its token ids and positions
/// read already) and checks them.
void read_head_positions(const FileReader& in, hid_t packet_group, const CacheModelInfo& model,
                         Packet& packet);

}  // namespace kv::format
