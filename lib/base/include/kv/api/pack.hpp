// Packing: packets concatenated in order into one context cache, each packet's keys rotated by
// its offset in the context (kvpack). Needs no model: the RoPE settings come from the files, and
// rotation is all that changes (values are copied as they are).
#pragma once

#include "kv/format/cache_store.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/json.hpp"

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kv {

struct PackOptions {
    std::vector<CacheSelection> inputs;      ///< in context order; at most one file may be "-"
    std::optional<CacheSelection> preamble;  ///< packed first (e.g. a baked chat-template start)
    std::filesystem::path output = "-";
    std::string id = "context";  ///< the packed packet's id
    Provenance provenance;
    CacheWriteOptions write;
};

struct PackPart {
    std::string file;  ///< as given
    std::string id;
    int64_t offset = 0;  ///< first logical position of the part in the context
    int64_t logical_length = 0;
    int64_t stored_length = 0;
};

struct PackReport {
    std::vector<PackPart> parts;
    int64_t logical_length = 0;
    int64_t stored_length = 0;
    int64_t bytes_read = 0;  ///< keys and values
    bool indexed = false;    ///< the context carries its parts' IceCache indexes
    /// Why the parts' indexes were not carried, when some had one ("" otherwise).
    std::string index_dropped;
    double seconds = 0;
};

/// Concatenates `packets` (all from caches compatible with `model`) into one packet named `id`:
/// token ids and values in order, positions shifted by the running logical offset, keys rotated
/// by it. Packets keep their position gaps (compressed packets), so logical length adds up.
/// Packets baked with different adapters, or with and without one, are refused (MismatchError,
/// check_same_adapter). When every packet has an
/// IceCache index built alike, the context carries them as segments (no index is rebuilt).
Packet pack_packets(const std::vector<Packet>& packets, const CacheModelInfo& model,
                    const std::string& id);

/// Reads the selections, packs them and writes the context cache atomically. Throws
/// MismatchError naming both files when inputs come from different models, tokenizers or dtypes;
/// nothing is written then.
PackReport pack_caches(const PackOptions& options);

/// kvpack --json: packets, logical_length, stored_length, bytes_read, indexed, seconds, and the
/// parts (file, id, offset, logical_length, stored_length).
json::Value to_json(const PackReport& report);
/// kvpack's summary line: "2 packets, 15 tokens (15 stored) in 0.012 s".
std::string summary(const PackReport& report);
/// "note: packet 'b' has no index: the context carries no IceCache index" when the parts'
/// indexes were dropped, "" otherwise: a warning, which -q does not silence.
std::string warning(const PackReport& report);

/// Throws MismatchError naming the packet unless it was baked with the adapter the context's
/// earlier packets were (`context_adapter`, "" for none): wrapped and plain packets never mix.
void check_same_adapter(const std::string& context_adapter, const Packet& packet);

}  // namespace kv
