// What a cache holds, as values: packets (one document's keys and values with their token ids,
// positions, IceCache index and per-head kept tokens), KV Packet's adapters, and the model and
// tokenizer fingerprints that say what a cache can be combined with. The domain types every layer
// shares, with no file format, HDF5 or libtorch behind them: kv/format/ reads and writes them
// (formats/kvcache.md), kv/model/ computes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kv {

// ---------------------------------------------------------------------------------------------
// IceCache's index of a packet as a cache file stores it (formats/kvcache.md, section 6.5),
// without the index code: what kvindex writes, kvpack carries and kvserve-once restores.

/// One index of one (layer, kv-head) over one segment: the tree and pages, without the keys
/// (projections and distances are recomputed from them).
struct DciLayout {
    double max_squared_norm = 0;
    std::vector<int8_t> levels;        ///< per token
    std::vector<int32_t> parents;      ///< per token, segment-relative, -1 under the root
    std::vector<int32_t> page_sizes;   ///< per page, pages in storage order
    std::vector<int32_t> page_tokens;  ///< the pages' tokens, page after page, projection order
};

/// Consecutive stored tokens indexed on their own; `delta` positions were added to their keys
/// after indexing (kvpack), so a query meets the index rotated back by delta.
struct IndexSegment {
    int64_t first = 0;
    int64_t count = 0;
    int64_t delta = 0;
};

/// A packet's index: empty (no segments) when it has none.
struct PacketIndex {
    int64_t page_size = 16;
    double promotion_first = 0.01;
    double promotion_rest = 0.2;
    std::vector<float> projection;  ///< [head_dim + 1], unit length
    std::vector<IndexSegment> segments;
    /// The layers it covers, increasing; empty: every layer (formats/kvcache.md 6.5, `layers`).
    std::vector<int64_t> layers;
    /// [covered layer][kv-head][segment], flattened: (row * kv_heads + head) * segments +
    /// segment, row the layer's place among the covered ones. Empty when the layouts were left
    /// in the file (read_layout reads them one at a time).
    std::vector<DciLayout> layouts;
    /// Reads the layout of (layer, kv-head, segment) from the file the index came from
    /// (CacheReader::read_index_layout); set instead of `layouts` where a packet's index is
    /// restored one plane at a time, so memory never holds every plane's layout at once.
    std::function<DciLayout(int64_t layer, int64_t head, int64_t segment)> read_layout;

    bool empty() const { return segments.empty(); }
    /// Whether layer `layer` has a layout.
    bool covers(int64_t layer) const { return row_of(layer) >= 0; }
    /// The layer's place among the covered layers, -1 when not covered.
    int64_t row_of(int64_t layer) const {
        if (layers.empty()) return layer;
        for (std::size_t row = 0; row < layers.size(); ++row)
            if (layers[row] == layer) return static_cast<int64_t>(row);
        return -1;
    }
    /// The layout of a covered layer, moved out of `layouts` (each is restored once) or read by
    /// read_layout.
    DciLayout take_layout(int64_t layer, int64_t head, int64_t kv_heads, int64_t segment) {
        if (layouts.empty() && read_layout) return read_layout(layer, head, segment);
        return std::exchange(layout(layer, head, kv_heads, segment), DciLayout{});
    }
    const DciLayout& layout(int64_t layer, int64_t head, int64_t kv_heads, int64_t segment) const {
        return layouts[slot(layer, head, kv_heads, segment)];
    }
    DciLayout& layout(int64_t layer, int64_t head, int64_t kv_heads, int64_t segment) {
        return layouts[slot(layer, head, kv_heads, segment)];
    }

  private:
    std::size_t slot(int64_t layer, int64_t head, int64_t kv_heads, int64_t segment) const {
        return static_cast<std::size_t>(
            (row_of(layer) * kv_heads + head) * static_cast<int64_t>(segments.size()) + segment);
    }
};

// ---------------------------------------------------------------------------------------------
// Quantised storage of keys and values (section 6.6; the codec is kv/format/quantize.hpp).

struct Quantization {
    int bits = 0;                 ///< 0: stored in the file's dtype; 8 or 4
    int64_t group_size = 32;      ///< head_dim values per scale and offset; divides head_dim
    int64_t residual_tokens = 0;  ///< last slots of each head kept in the file's dtype
    bool enabled() const { return bits != 0; }
    bool operator==(const Quantization&) const = default;
};

/// One tensor [planes, slots, dim] as stored quantised: the first `slots - residual` slots of
/// each plane as codes, scales and offsets, the rest as they were.
struct QuantizedTensor {
    int64_t quantized_slots = 0;      ///< per plane
    std::vector<uint8_t> codes;       ///< [planes, quantized_slots, dim * bits / 8]
    std::vector<float> scales;        ///< [planes, quantized_slots, dim / group]
    std::vector<float> offsets;       ///< likewise: value = code * scale + offset
    std::vector<std::byte> residual;  ///< [planes, slots - quantized_slots, dim] in the dtype
};

/// A packet's quantised tensors as read from a file: a writer given keys and values they still
/// dequantise to writes these codes back instead of quantising the dequantised values again
/// (which would move them by rounding at every rewrite).
struct QuantizedPayload {
    Quantization quantization;
    QuantizedTensor keys, values;
};

// ---------------------------------------------------------------------------------------------

/// Storage dtype of keys and values.
enum class CacheDtype { f32, bf16, f16 };
const char* cache_dtype_name(CacheDtype dtype);
/// "f32", "bf16" or "f16"; throws FormatError otherwise.
CacheDtype parse_cache_dtype(const std::string& name);
std::size_t cache_dtype_size(CacheDtype dtype);

/// What a cache was baked with. Two caches can be combined, and a cache can be decoded by a
/// model, only when these agree (check_compatible says which field differs, naming both).
struct CacheModelInfo {
    std::string model_fingerprint;  ///< hex SHA-256 over the model's config and weight metadata
    std::string model_name;         ///< for messages: the model path or name as given
    std::string architecture;
    int64_t num_layers = 0;
    int64_t num_kv_heads = 0;
    int64_t head_dim = 0;
    std::string rope_layout;  ///< "half_split" or "interleaved"
    double rope_theta = 0;
    std::string rope_scaling;           ///< compact JSON of the scaling, "" when none
    std::string tokenizer_fingerprint;  ///< hex SHA-256 (Tokenizer::fingerprint)
    CacheDtype dtype = CacheDtype::f32;
};

/// Throws MismatchError "cache 'a.kvc' was baked with model X (fingerprint ab12..), not Y (cd34..)"
/// when `found` cannot be used where `expected` is required. `what` names the file, quoted as
/// CacheReader::source() gives it (an unquoted name is quoted). Compares the model fingerprint,
/// the tokenizer fingerprint, then architecture, shapes, RoPE settings and dtype; the model name
/// only appears in the message.
void check_compatible(const CacheModelInfo& expected, const CacheModelInfo& found,
                      const std::string& what);

/// The bytes of a packet's keys and values together, `stored_length` rows in `model`'s dtype.
int64_t packet_tensor_bytes(const CacheModelInfo& model, int64_t stored_length);

struct Provenance {
    std::string tool;          ///< "kvbake"
    std::string version;       ///< kvtools version
    std::string command_line;  ///< as typed, arguments joined by spaces (quoted where needed)
    std::string created;       ///< ISO 8601 UTC; empty to omit (reproducible output)
};

/// One document's cache.
struct Packet {
    std::string id;                  ///< any UTF-8 string (the JSONL id, or the file name)
    std::string text_sha256;         ///< of the document text as given
    std::vector<int32_t> token_ids;  ///< [stored_length]; -1 for adapter soft tokens
    std::vector<int64_t>
        positions;               ///< [stored_length], RoPE position of each key, < logical_length
    int64_t logical_length = 0;  ///< tokens the packet spans (>= stored_length when compressed)
    std::string adapter_fingerprint;  ///< "" when baked without adapters
    int64_t header_tokens = 0;        ///< adapter soft tokens before the document
    int64_t trailer_tokens = 0;       ///< and after
    /// [num_layers, num_kv_heads, stored_length, head_dim] in the file's dtype, keys after RoPE.
    std::vector<std::byte> keys;
    std::vector<std::byte> values;
    /// IceCache's index of the keys (kvindex), empty when the packet has none.
    PacketIndex index;
    /// Per-(layer, kv-head) kept tokens of a compressed packet (formats/kvcache.md 6.3), both
    /// empty when every head stores the tokens of `positions`. head_lengths [num_layers *
    /// num_kv_heads]: slots in use, the first ones; head_positions [num_layers * num_kv_heads *
    /// stored_length]: the position of each used slot (unused ones 0). `positions` then holds,
    /// per slot, the largest position any head stores there, and `token_ids` that token.
    std::vector<int64_t> head_lengths;
    std::vector<int64_t> head_positions;
    /// How keys and values are stored (section 6.6): read back dequantised into `keys` and
    /// `values`, and quantised again when written (unless CacheWriteOptions says otherwise).
    Quantization quantization;
    /// The codes it was read from, written back as they are while keys and values are unchanged.
    std::shared_ptr<const QuantizedPayload> stored_quantized;

    int64_t stored_length() const { return static_cast<int64_t>(token_ids.size()); }
    bool ragged() const { return !head_lengths.empty(); }
    /// Some head uses fewer slots than stored_length (its last slots are padding).
    bool padded() const;
};

/// Summary of a packet without its tensors.
struct PacketInfo {
    std::string id;
    std::string text_sha256;
    int64_t logical_length = 0;
    int64_t stored_length = 0;
    std::string adapter_fingerprint;
    int64_t header_tokens = 0;
    int64_t trailer_tokens = 0;
};

/// KV Packet's adapter (formats/kvcache.md 6.7): header and trailer soft tokens, vectors in the
/// model's input-embedding space that kvbake --adapter wraps every document in and kvtrain
/// learns. It lives in a cache file of its own (no packets), beside the model's fingerprint.
struct Adapter {
    int64_t hidden_size = 0;
    std::vector<float> header;   ///< [header_tokens, hidden_size], row-major
    std::vector<float> trailer;  ///< [trailer_tokens, hidden_size]
    double init_mean = 0;        ///< the normal distribution it was initialised from
    double init_std = 0;
    std::string training;  ///< compact JSON: how kvtrain trained it so far ("" when untrained)
    /// AdamW's state, kept in checkpoints so that training resumes exactly; empty otherwise.
    int64_t optimizer_step = 0;
    std::vector<float> header_moment, header_second_moment;
    std::vector<float> trailer_moment, trailer_second_moment;

    int64_t header_tokens() const;
    int64_t trailer_tokens() const;
    bool has_optimizer_state() const { return !header_moment.empty(); }
    /// Hex SHA-256 of the token counts, the width and the vectors' float32 bytes: what packets
    /// record as adapter_fingerprint (training state and notes do not change it).
    std::string fingerprint() const;
};

}  // namespace kv
