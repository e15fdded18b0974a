#include "head_positions_codec.hpp"

#include "spec.hpp"

#include <algorithm>

namespace kv::format {

std::string ragged_problem(const Packet& packet, int64_t layers, int64_t heads) {
    const int64_t slots = packet.stored_length();
    const auto planes = static_cast<std::size_t>(layers * heads);
    if (packet.head_lengths.size() != planes)
        return "head_lengths has " + std::to_string(packet.head_lengths.size()) +
               " entries, expected " + std::to_string(planes) + " (layers x kv-heads)";
    if (packet.head_positions.size() != planes * static_cast<std::size_t>(slots))
        return "head_positions has " + std::to_string(packet.head_positions.size()) +
               " entries, expected " + std::to_string(planes * static_cast<std::size_t>(slots)) +
               " (layers x kv-heads x stored_length)";
    for (std::size_t plane = 0; plane < planes; ++plane) {
        const int64_t used = packet.head_lengths[plane];
        const std::string where =
            "layer " + std::to_string(plane / static_cast<std::size_t>(heads)) + ", kv-head " +
            std::to_string(plane % static_cast<std::size_t>(heads));
        if (used < 0 || used > slots)
            return "head_lengths of " + where + " is " + std::to_string(used) +
                   ", outside [0, stored_length " + std::to_string(slots) + "]";
        const int64_t* positions =
            packet.head_positions.data() + plane * static_cast<std::size_t>(slots);
        for (int64_t slot = 0; slot < used; ++slot) {
            const int64_t position = positions[slot];
            if (position < 0 || position >= packet.logical_length)
                return "head position " + std::to_string(position) + " of " + where +
                       " is outside [0, logical_length " + std::to_string(packet.logical_length) +
                       ")";
            if (slot > 0 && position <= positions[slot - 1])
                return "head positions of " + where + " do not increase";
            if (position > packet.positions[static_cast<std::size_t>(slot)])
                return "head position " + std::to_string(position) + " of " + where +
                       " exceeds the slot's position " +
                       std::to_string(packet.positions[static_cast<std::size_t>(slot)]);
        }
    }
    return "";
}

void write_head_positions(const FileWriter& out, hid_t packet_group, const Packet& packet,
                          const CacheModelInfo& m, const CacheWriteOptions& options) {
    const auto layers = static_cast<hsize_t>(m.num_layers),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    const auto length = static_cast<hsize_t>(packet.stored_length());
    out.write_dataset(packet_group, "head_lengths", H5T_STD_I64LE, H5T_NATIVE_INT64,
                      {layers, heads}, {}, options, false, packet.head_lengths.data());
    out.write_dataset(packet_group, "head_positions", H5T_STD_I64LE, H5T_NATIVE_INT64,
                      {layers, heads, length},
                      {1, 1, std::max<hsize_t>(1, std::min<hsize_t>(length, max_1d_chunk))},
                      options, true, packet.head_positions.data());
}

bool has_head_positions(hid_t packet_group) {
    return H5Lexists(packet_group, "head_lengths", H5P_DEFAULT) > 0 ||
           H5Lexists(packet_group, "head_positions", H5P_DEFAULT) > 0;
}

void read_head_positions(const FileReader& in, hid_t packet_group, const CacheModelInfo& m,
                         Packet& packet) {
    const auto layers = static_cast<hsize_t>(m.num_layers),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    const auto length = static_cast<hsize_t>(packet.stored_length());
    packet.head_lengths = in.numeric_dataset<int64_t>(packet_group, "head_lengths", "head_lengths",
                                                      {layers, heads}, H5T_NATIVE_INT64);
    packet.head_positions =
        in.numeric_dataset<int64_t>(packet_group, "head_positions", "head_positions",
                                    {layers, heads, length}, H5T_NATIVE_INT64);
    const std::string problem = ragged_problem(packet, m.num_layers, m.num_kv_heads);
    if (!problem.empty()) in.fail(problem);
}

}  // namespace kv::format
