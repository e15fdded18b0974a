// Section 6.7 of formats/kvcache.md: KV Packet's adapter (group `/adapter`), written and read.
#pragma once

#include "hdf5_file.hpp"
#include "kv/packet.hpp"

#include <string>

namespace kv::format {

/// Why `adapter` cannot be stored, or "".
std::string adapter_problem(const Adapter& adapter);
void write_adapter(const FileWriter& out, hid_t root, const Adapter& adapter,
                   const CacheWriteOptions& options);
/// The adapter under `root`, its shapes checked and its vectors matched to its fingerprint.
Adapter read_adapter(const FileReader& in, hid_t root);

}  // namespace kv::format
