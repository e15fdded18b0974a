// The names and numbers of the cache file format (formats/kvcache.md) that its reader and
// writer share: the format's identity, its versions and features, and the layout of groups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>

namespace kv::format {

inline constexpr const char* format_name = "kvtools-kvcache";
inline constexpr int format_major = 1;
// Writers write the lowest version that describes the file: 1.0, 1.1 once a packet has an index
// (6.5), 1.2 once one keeps different tokens per head (6.3), 1.3 once one is quantised (6.6),
// 1.4 when the file holds an adapter (6.7), 1.5 once an index covers only some layers (6.5),
// 1.6 with /packet_ids (6.1), 1.7 with tensor_layout (section 7); kvtools writes both in every
// file.
inline constexpr int format_minor = 7;
inline constexpr int index_minor = 1;
inline constexpr int ragged_minor = 2;
inline constexpr const char* ragged_feature = "ragged-heads";
inline constexpr int quantized_minor = 3;
inline constexpr const char* quantized_feature = "quantized-kv";
inline constexpr int adapter_minor = 4;
inline constexpr int index_layers_minor = 5;
inline constexpr const char* index_layers_feature = "index-layers";
inline constexpr int packet_ids_minor = 6;
inline constexpr int tensor_layout_minor = 7;
inline constexpr int64_t max_1d_chunk = 65536;
/// Features this reader implements.
inline const std::set<std::string> known_features = {ragged_feature, quantized_feature,
                                                     index_layers_feature};

/// The name of the ordinal-th packet's group under /packets: "00000012".
inline std::string packet_group_name(std::size_t ordinal) {
    char name[32];
    std::snprintf(name, sizeof name, "%08zu", ordinal);
    return name;
}

/// The name of a packet's link under /packet_ids (section 6.1): the id with '%' and '/' written
/// as %25 and %2F, and the id "." as %2E.
inline std::string packet_link_name(const std::string& id) {
    if (id == ".") return "%2E";
    std::string name;
    name.reserve(id.size());
    for (const char c : id) {
        if (c == '%' || c == '/') {
            char escaped[4];
            std::snprintf(escaped, sizeof escaped, "%%%02X", static_cast<unsigned char>(c));
            name += escaped;
        } else {
            name += c;
        }
    }
    return name;
}

}  // namespace kv::format
