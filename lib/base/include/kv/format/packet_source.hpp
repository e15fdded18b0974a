// Where decoding gets the stores and packets of its context: opened and read when asked (one
// question, kvserve-once), or kept between questions within a memory bound (kvserve-once
// --requests: each store opened once, each packet read once while it stays in memory).
#pragma once

#include "kv/format/cache_reader.hpp"

#include <cstdint>
#include <filesystem>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace kv {

/// A packet handed out by a PacketSource, with its tensors.
struct SourcedPacket {
    std::shared_ptr<Packet> packet;
    /// The source keeps it for later questions: the caller must not change it. Otherwise it is
    /// the caller's alone (its index may be moved out, say).
    bool kept = false;
    bool from_memory = false;  ///< taken from memory, not read from the store
    int64_t bytes_read = 0;    ///< keys and values read from the file for it (0 from memory)
};

class PacketSource {
  public:
    virtual ~PacketSource() = default;
    /// The store at `file` ("-": standard input), open.
    virtual std::shared_ptr<const CacheReader> store(const std::filesystem::path& file) = 0;
    /// Packet `id` of `store` (one this source gave), with its tensors; throws as
    /// CacheReader::read does (FormatError naming the id when the store has no such packet).
    virtual SourcedPacket packet(const std::shared_ptr<const CacheReader>& store,
                                 const std::string& id) = 0;
    /// Whether it holds packet `info` of `store` (one this source gave) or would keep it for
    /// later: where not, a caller may read the packet's keys and values straight to where they
    /// are used (CacheReader::read_into) instead of through packet().
    virtual bool keeps(const CacheReader& store, const PacketInfo& info) const = 0;
};

/// Opens each store once (kept open while the source lives: one question, which may ask for a
/// store twice, "-" among them) and reads every packet anew, keeping none. Its stores read keys
/// and values on `read_threads` threads (0: one per core; CacheReader::set_threads).
class DirectPacketSource final : public PacketSource {
  public:
    explicit DirectPacketSource(int read_threads = 0) : read_threads_(read_threads) {}
    std::shared_ptr<const CacheReader> store(const std::filesystem::path& file) override;
    SourcedPacket packet(const std::shared_ptr<const CacheReader>& store,
                         const std::string& id) override;
    bool keeps(const CacheReader&, const PacketInfo&) const override { return false; }

  private:
    int read_threads_;
    std::map<std::filesystem::path, std::shared_ptr<const CacheReader>> opened_;
};

/// The memory a loaded packet takes: its tensors, token ids, positions, per-head positions and
/// IceCache index (the quantised codes it was read from are dropped when it is kept).
int64_t packet_memory(const Packet& packet);

/// Keeps every store open (one reader per path, as named) and the packets it read in memory,
/// up to `capacity` bytes (packet_memory): when a new packet does not fit, the least recently
/// used ones go first, and a packet larger than the capacity is handed out without being kept.
/// A packet asked for again while kept is not read again. Stores read on `read_threads` threads
/// as DirectPacketSource's do. Thread-safe: one thread may read the packets of the next
/// questions while another answers this one (a call waits while another reads).
class PacketCache final : public PacketSource {
  public:
    explicit PacketCache(int64_t capacity, int read_threads = 0);
    std::shared_ptr<const CacheReader> store(const std::filesystem::path& file) override;
    SourcedPacket packet(const std::shared_ptr<const CacheReader>& store,
                         const std::string& id) override;
    /// True for a packet kept now, or one that may fit the capacity (packet() keeps it unless
    /// its memory turns out larger).
    bool keeps(const CacheReader& store, const PacketInfo& info) const override;

    struct Stats {
        int64_t stores = 0;        ///< opened
        int64_t hits = 0;          ///< packets taken from memory
        int64_t misses = 0;        ///< packets read from their store
        int64_t evictions = 0;     ///< packets dropped to make room
        int64_t kept_packets = 0;  ///< in memory now
        int64_t kept_bytes = 0;    ///< their packet_memory, now
        int64_t peak_bytes = 0;    ///< the most kept at once
        int64_t bytes_read = 0;    ///< keys and values read from stores
    };
    Stats stats() const;
    int64_t capacity() const { return capacity_; }

  private:
    using Key = std::pair<const CacheReader*, std::string>;
    struct Entry {
        Key key;
        std::shared_ptr<Packet> packet;
        int64_t bytes = 0;
    };
    int64_t capacity_;
    int read_threads_;
    mutable std::mutex mutex_;  // over everything below
    Stats stats_;
    std::map<std::string, std::shared_ptr<const CacheReader>> stores_;
    std::list<Entry> recent_;  ///< most recently used first
    std::map<Key, std::list<Entry>::iterator> entries_;
};

}  // namespace kv
