// Section 6.6 of formats/kvcache.md: keys and values stored quantised (group `quantized`: codes,
// scales and offsets, and the residual window in the file's dtype), written and read. The
// arithmetic is kv/format/quantize.hpp's.
#pragma once

#include "hdf5_file.hpp"
#include "kv/packet.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kv::format {

/// Writes `packet`'s keys and values quantised as `quantization` says, or the codes they were
/// read from when they still dequantise to the same bytes.
void write_quantized(const FileWriter& out, hid_t packet_group, const Packet& packet,
                     const Quantization& quantization, const CacheModelInfo& model,
                     const CacheWriteOptions& options, hid_t key_type);

/// The attributes of a packet's `quantized` group, unchecked.
Quantization read_quantization(const FileReader& in, hid_t group);

/// Reads a whole tensor in the file's dtype (keys, values, a residual) of `tokens` tokens per
/// (layer, kv-head) into `target`, checking its shape and type.
using TensorReader = std::function<void(hid_t parent, const std::string& name, hsize_t tokens,
                                        std::vector<std::byte>& target)>;
/// Reads the packet's quantised keys and values (it has `stored` tokens) and dequantises them
/// into packet.keys and packet.values, keeping the codes in packet.stored_quantized.
void read_quantized(const FileReader& in, hid_t packet_group, const CacheModelInfo& model,
                    int64_t stored, const TensorReader& read_tensor, Packet& packet);

}  // namespace kv::format
