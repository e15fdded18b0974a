// The kvtools cache file (formats/kvcache.md): an HDF5 file holding baked KV caches ("packets",
// one per document) and, after kvpack, one assembled context, with the model's and tokenizer's
// fingerprints, provenance and checksums.
//
// This module is torch-free: tensors cross it as raw little-endian bytes with an explicit dtype
// and shape. Paths may be "-" for standard input/output (through HDF5 file images). Writes are
// atomic: the file appears under its name complete or not at all. Reads are lazy: opening a
// store reads its directory, and a packet's tensors are read only when asked for.
#pragma once

#include "kv/index/layout.hpp"
#include "kv/quantize.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kv {

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

struct CacheWriteOptions {
    int zstd_level = 3;          ///< 0: no compression
    bool shuffle = true;         ///< byte shuffle before zstd (helps float data)
    int64_t chunk_tokens = 256;  ///< tokens per chunk: the smallest unit read from disk
    bool force = false;          ///< allow writing binary data to a terminal
    /// finish() refuses to replace a file that appeared under the name meanwhile (kvbake
    /// --append creating a store that another process created first).
    bool no_replace = false;
    /// Store every packet this way instead of as each packet says (bits 0: unquantised).
    std::optional<Quantization> quantization;
};

/// Writes a new cache file packet by packet (memory holds one packet at a time).
class CacheWriter {
  public:
    /// Starts writing to `path` ("-": standard output, refused when it is a terminal unless
    /// force). Nothing appears under `path` until finish().
    CacheWriter(const std::filesystem::path& path, const CacheModelInfo& model,
                const Provenance& provenance, const CacheWriteOptions& options = {});
    ~CacheWriter();  ///< without finish(): discards everything, leaves no file
    CacheWriter(const CacheWriter&) = delete;
    CacheWriter& operator=(const CacheWriter&) = delete;

    /// Adds a packet; throws UsageError on a duplicate id, FormatError on inconsistent sizes.
    void add(const Packet& packet);
    /// Stores an adapter in the file (at most one; written by finish()). Throws FormatError when
    /// its shapes are inconsistent or a value is not finite.
    void set_adapter(const Adapter& adapter);
    /// Marks the file complete, flushes, and renames it into place (or writes it to stdout).
    void finish();

  private:
    struct State;
    std::unique_ptr<State> state_;
};

/// Reads a cache file; tensors are read only on request.
class CacheReader {
  public:
    /// Opens `path` ("-": reads all of standard input into memory first). Validates the format
    /// name, the version (an unknown major version or required feature is refused naming both
    /// versions), the required attributes and the completeness mark; throws FormatError.
    explicit CacheReader(const std::filesystem::path& path);
    ~CacheReader();
    CacheReader(const CacheReader&) = delete;
    CacheReader& operator=(const CacheReader&) = delete;

    const std::string& source() const;  ///< quoted name for messages
    const std::string& format_version() const;
    const CacheModelInfo& model() const;
    const Provenance& provenance() const;
    /// In file order (the order packets were added).
    const std::vector<PacketInfo>& packets() const;
    const PacketInfo& packet_info(const std::string& id) const;  ///< throws Error naming the id
    bool has_packet(const std::string& id) const;

    /// Reads one packet with its tensors, verifying checksums and shapes.
    Packet read(const std::string& id) const;
    /// read() without keys and values (both left empty): positions, token ids, the index.
    Packet read_without_tensors(const std::string& id) const;
    /// read_without_tensors() whose index keeps its segments, projection and settings but
    /// leaves the per-token layouts in the file, for read_index_layout (a long packet's layouts
    /// are 9 bytes per token and plane).
    Packet read_without_tensors_or_layouts(const std::string& id) const;
    /// One (layer, kv-head, segment) layout of the packet's index, checked as read() checks it.
    DciLayout read_index_layout(const std::string& id, int64_t layer, int64_t head,
                                int64_t segment) const;
    /// Receives a piece of one (layer, kv-head) plane of keys or values: its tokens [first,
    /// first + rows), [rows, head_dim] in the file's dtype; the bytes are valid during the call
    /// only.
    using PlaneReceiver = std::function<void(int64_t layer, int64_t head, bool keys, int64_t first,
                                             std::span<const std::byte> rows)>;
    /// Hands the packet's keys (every plane in (layer, head) order, each in pieces in token
    /// order), then its values, to `receive`, reading a piece of at most 16,384 tokens at a
    /// time: memory holds one piece however long the packet (a quantised packet is dequantised
    /// whole first, and handed out a plane at a time).
    void read_planes(const std::string& id, const PlaneReceiver& receive) const;
    /// Whether the packet carries an IceCache index (section 6.5), without reading it.
    bool has_index(const std::string& id) const;
    /// Whether the packet keeps different tokens per head (section 6.3), without reading it.
    bool has_head_positions(const std::string& id) const;
    /// How the packet's keys and values are stored (section 6.6), without reading them.
    Quantization quantization(const std::string& id) const;
    /// Whether the file holds an adapter (section 6.7).
    bool has_adapter() const;
    /// Reads the adapter, checking its shapes and that the vectors match its fingerprint;
    /// throws FormatError when the file holds none or it is damaged.
    Adapter read_adapter() const;

  private:
    bool packet_has(const std::string& id, const char* child) const;  ///< a group or dataset
    Packet read_packet(const std::string& id, bool with_tensors, const PlaneReceiver* receive,
                       bool with_layouts = true) const;

    struct State;
    std::unique_ptr<State> state_;
};

/// An exclusive advisory lock (flock) on an existing cache file for as long as it lives, taken
/// without waiting: a second process gets IoError naming the file. Writers replace files by
/// rename, so the lock is taken on the file the name refers to after locking (retrying when it
/// was replaced meanwhile). Nothing is locked when the file does not exist.
class CacheFileLock {
  public:
    explicit CacheFileLock(const std::filesystem::path& path);
    ~CacheFileLock();
    CacheFileLock(const CacheFileLock&) = delete;
    CacheFileLock& operator=(const CacheFileLock&) = delete;
    bool locked() const { return fd_ >= 0; }  ///< false: the file did not exist

  private:
    int fd_ = -1;
};

/// A cache argument as users write it: FILE (every packet, in file order) or FILE:ID (one packet),
/// "-" for standard input. FILE:ID names one packet unless FILE:ID is itself an existing file.
struct CacheSelection {
    std::filesystem::path file;
    std::string id;  ///< empty: every packet
};
CacheSelection parse_cache_selection(const std::string& spec);

/// Merges stores baked separately (shards of one kvbake run, say) into `output`: the packets of
/// every input, inputs in the order given and packets in file order, tensors copied exactly.
/// Throws MismatchError naming both files when two inputs differ in model information
/// (check_compatible) or share a packet id; nothing is written then. At most one input may be
/// "-"; `output` may be one of the inputs (it is replaced atomically at the end).
void merge_cache_files(const std::vector<std::filesystem::path>& inputs,
                       const std::filesystem::path& output, const Provenance& provenance,
                       const CacheWriteOptions& options = {});

}  // namespace kv
