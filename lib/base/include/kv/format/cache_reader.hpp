// Reading a kvtools cache file (formats/kvcache.md). Reads are lazy: opening a store reads its
// attributes and the shape of its directory (the packet index); packets() reads the directory
// whole, and a packet named by id is found by one lookup of its link in /packet_ids (since 1.6,
// section 6.1: opening a store and reading a few packets by id take the same time whatever its
// size; a file without /packet_ids has its directory read on opening, as before).
// A packet's tensors are read only when asked for. "-" reads standard input (into memory, as an
// HDF5 file image). Every value is checked before it is used, and errors name the file and the
// packet.
#pragma once

#include "kv/packet.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kv {

/// How a file stores keys and values (formats/kvcache.md, section 7).
struct TensorLayout {
    std::string name;  ///< the root attribute tensor_layout (since 1.7; "" before)
    /// Of the first packet with unquantised keys: "chunked", "contiguous" or "compact" (""
    /// when there is none), the tokens per [1, 1, T, D] chunk (0 for another shape or none),
    /// and the filters in pipeline order ("shuffle", "zstd", "fletcher32", "deflate", ...).
    std::string storage;
    int64_t chunk_tokens = 0;
    std::vector<std::string> filters;
    int zstd_level = 0;  ///< the zstd filter's level as recorded (0 without zstd)
};

/// Where CacheReader::read_into puts a packet's keys (or values): the rows of plane (layer,
/// kv-head), contiguous, from `layers[layer] + head * head_stride` bytes on. A decoder's cache
/// whose heads hold room for more tokens than the packet has them further apart than the
/// packet's own [L, H, T, D] layout does.
struct PlaneTargets {
    std::vector<std::byte*> layers;
    std::size_t head_stride = 0;  ///< bytes
    /// When set, called for each piece of rows [first, first + rows) of plane (layer, head)
    /// once its bytes are in place, while they are still in the processor's cache (a key
    /// rotation costs a pass over memory of its own after the read): from the reading threads,
    /// several at once on pieces that never overlap, with the file's lock held (it must not read
    /// the file). Every row is reported once, unless a read starts over (a chunk not as it should
    /// be is read again through HDF5): then every row is written again and reported again.
    std::function<void(std::size_t layer, std::size_t head, std::size_t first, std::size_t rows)>
        landed;
    std::byte* plane(std::size_t layer, std::size_t head) const {
        return layers[layer] + head * head_stride;
    }
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
    /// In file order (the order packets were added): the directory, read whole and checked on
    /// the first call.
    const std::vector<PacketInfo>& packets() const;
    /// One entry, found through /packet_ids unless the directory was read whole; throws
    /// FormatError naming the id (and a few that the file holds) when there is none. A reader
    /// asked for many entries (more than 64 and a 32nd of the store's packets, as kvserve-once
    /// --requests asks over a job) reads the directory whole once and answers the rest from it:
    /// each lookup costs a constant on average, and a few never read the whole directory.
    const PacketInfo& packet_info(const std::string& id) const;
    bool has_packet(const std::string& id) const;
    /// Throws FormatError unless /packet_ids (when the file has it) holds a link for every
    /// packet, to its group, and no other (kvinspect check; reads the directory whole).
    void check_packet_ids() const;

    /// Threads that read, check and decompress a packet's keys and values (0, the default: one
    /// per core this process may run on).
    void set_threads(int threads);

    /// Reads one packet with its tensors, verifying checksums and shapes.
    Packet read(const std::string& id) const;
    /// read() whose keys and values go straight into `keys` and `values` (a decoder's cache
    /// tensors: [num_layers, num_kv_heads, stored_length, head_dim] in the file's dtype, each
    /// exactly that many bytes, else UsageError) instead of the packet, which comes back
    /// without them. Nothing else is allocated for them (a quantised packet is dequantised
    /// first, then copied); on an error their contents are unspecified.
    Packet read_into(const std::string& id, std::span<std::byte> keys,
                     std::span<std::byte> values) const;
    /// read_into() whose keys and values go to the planes `keys` and `values` name (one layer
    /// pointer per layer of the file, each head's T rows room enough: the caller's word, which
    /// nothing here can check) rather than to contiguous tensors: straight into a decoder's
    /// cache, beyond the rows it holds, with no copy of the packet in between. Without
    /// `with_layouts`, the index's per-token layouts stay in the file, as
    /// read_without_tensors_or_layouts leaves them (read_index_layout reads them later).
    Packet read_into(const std::string& id, const PlaneTargets& keys, const PlaneTargets& values,
                     bool with_layouts = true) const;
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
    /// How keys and values are stored (section 7).
    TensorLayout tensor_layout() const;
    /// Whether the file holds an adapter (section 6.7).
    bool has_adapter() const;
    /// Reads the adapter, checking its shapes and that the vectors match its fingerprint;
    /// throws FormatError when the file holds none or it is damaged.
    Adapter read_adapter() const;

  private:
    bool packet_has(const std::string& id, const char* child) const;  ///< a group or dataset
    /// Reads and checks the whole directory (once).
    void read_directory() const;
    /// The entry of `id` and its number, {nullptr, 0} when there is none.
    std::pair<const PacketInfo*, std::size_t> find(const std::string& id) const;
    /// find(), throwing FormatError naming the id when there is none.
    std::pair<const PacketInfo*, std::size_t> entry(const std::string& id) const;
    Packet read_packet(const std::string& id, bool with_tensors, const PlaneReceiver* receive,
                       bool with_layouts = true,
                       const std::pair<PlaneTargets, PlaneTargets>* into = nullptr) const;

    struct State;
    std::unique_ptr<State> state_;
};

}  // namespace kv
