#include "kv/format/packet_source.hpp"

#include "kv/error.hpp"
#include "kv/memory.hpp"

namespace kv {

namespace {

std::shared_ptr<const CacheReader> open_store(const std::filesystem::path& file, int threads) {
    auto reader = std::make_shared<CacheReader>(file);
    reader->set_threads(threads);
    return reader;
}

}  // namespace

std::shared_ptr<const CacheReader> DirectPacketSource::store(const std::filesystem::path& file) {
    std::shared_ptr<const CacheReader>& reader = opened_[file];
    if (!reader) reader = open_store(file, read_threads_);
    return reader;
}

SourcedPacket DirectPacketSource::packet(const std::shared_ptr<const CacheReader>& store,
                                         const std::string& id) {
    SourcedPacket sourced;
    sourced.packet = std::make_shared<Packet>(store->read(id));
    sourced.bytes_read =
        static_cast<int64_t>(sourced.packet->keys.size() + sourced.packet->values.size());
    return sourced;
}

int64_t packet_memory(const Packet& packet) {
    std::size_t bytes =
        sizeof(Packet) + packet.id.size() + packet.text_sha256.size() +
        packet.adapter_fingerprint.size() + packet.keys.size() + packet.values.size() +
        packet.token_ids.size() * sizeof(int32_t) + packet.positions.size() * sizeof(int64_t) +
        (packet.head_lengths.size() + packet.head_positions.size()) * sizeof(int64_t);
    const PacketIndex& index = packet.index;
    bytes += index.projection.size() * sizeof(float) +
             index.segments.size() * sizeof(IndexSegment) + index.layers.size() * sizeof(int64_t);
    for (const DciLayout& layout : index.layouts)
        bytes += sizeof(DciLayout) + layout.levels.size() * sizeof(int8_t) +
                 (layout.parents.size() + layout.page_sizes.size() + layout.page_tokens.size()) *
                     sizeof(int32_t);
    return static_cast<int64_t>(bytes);
}

PacketCache::PacketCache(int64_t capacity, int read_threads)
    : capacity_(capacity), read_threads_(read_threads) {
    if (capacity < 0)
        throw UsageError("the memory for loaded packets must be >= 0, not " +
                         std::to_string(capacity));
}

PacketCache::Stats PacketCache::stats() const {
    const std::lock_guard lock(mutex_);
    return stats_;
}

std::shared_ptr<const CacheReader> PacketCache::store(const std::filesystem::path& file) {
    const std::lock_guard lock(mutex_);
    auto& reader = stores_[file.string()];
    if (!reader) {
        reader = open_store(file, read_threads_);
        ++stats_.stores;
    }
    return reader;
}

bool PacketCache::keeps(const CacheReader& store, const PacketInfo& info) const {
    const std::lock_guard lock(mutex_);
    if (entries_.count(Key{&store, info.id})) return true;
    // packet() keeps no packet whose memory (packet_memory) exceeds the capacity; this much of
    // it is known before reading: the packet itself, its id, keys and values and a position per
    // stored token.
    const int64_t at_least = static_cast<int64_t>(sizeof(Packet) + info.id.size()) +
                             packet_tensor_bytes(store.model(), info.stored_length) +
                             info.stored_length * static_cast<int64_t>(sizeof(int64_t));
    return at_least <= capacity_;
}

SourcedPacket PacketCache::packet(const std::shared_ptr<const CacheReader>& store,
                                  const std::string& id) {
    SourcedPacket sourced;
    const Key key{store.get(), id};
    // The kept packet of `key`, now the most recent, into `sourced`; false where none is kept.
    auto take_kept = [&] {
        const auto found = entries_.find(key);
        if (found == entries_.end()) return false;
        recent_.splice(recent_.begin(), recent_, found->second);
        sourced.packet = found->second->packet;
        sourced.kept = true;
        return true;
    };
    std::unique_lock lock(mutex_);
    if (take_kept()) {
        ++stats_.hits;
        sourced.from_memory = true;
        return sourced;
    }
    // Read without the lock: other threads find what is kept meanwhile.
    lock.unlock();
    advise_heap_huge_pages();  // kept packets: hundreds of small buffers, each faulted in anew
    sourced.packet = std::make_shared<Packet>(store->read(id));
    Packet& packet = *sourced.packet;
    // The codes of a quantised packet serve only to write it back unchanged.
    packet.stored_quantized.reset();
    sourced.bytes_read = static_cast<int64_t>(packet.keys.size() + packet.values.size());
    lock.lock();
    ++stats_.misses;
    stats_.bytes_read += sourced.bytes_read;
    // Another thread read it too, meanwhile: both reads count, the one kept serves.
    if (take_kept()) return sourced;
    const int64_t bytes = packet_memory(packet);
    if (bytes > capacity_) return sourced;  // handed out, not kept
    while (stats_.kept_bytes + bytes > capacity_) {
        const Entry& oldest = recent_.back();
        stats_.kept_bytes -= oldest.bytes;
        --stats_.kept_packets;
        ++stats_.evictions;
        entries_.erase(oldest.key);
        recent_.pop_back();
    }
    recent_.push_front({key, sourced.packet, bytes});
    entries_.emplace(key, recent_.begin());
    stats_.kept_bytes += bytes;
    ++stats_.kept_packets;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.kept_bytes);
    sourced.kept = true;
    return sourced;
}

}  // namespace kv
