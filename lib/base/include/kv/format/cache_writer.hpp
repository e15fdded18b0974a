// Writing a kvtools cache file (formats/kvcache.md): packet by packet, atomically (the file
// appears under its name complete or not at all), "-" for standard output through an HDF5 file
// image. Tensors cross this module as raw little-endian bytes with an explicit dtype and shape.
#pragma once

#include "kv/packet.hpp"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>

namespace kv {

struct CacheWriteOptions {
    int zstd_level = 3;          ///< 0: no compression
    bool shuffle = true;         ///< byte shuffle before zstd (helps float data)
    /// Tokens per chunk of keys and values, the smallest unit read from disk; 0 (since format
    /// 1.7): as many as fill 1 MiB of one (layer, kv-head) plane, at least 256.
    int64_t chunk_tokens = 0;
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

}  // namespace kv
