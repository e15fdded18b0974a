#include "cache_fixtures.hpp"
#include "kv/error.hpp"
#include "kv/format/packet_source.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <thread>

namespace {

using kv::test::make_packet;
using kv::test::test_model;
using kv::test::write_store;

// Packets "doc-0", "doc-1", ... of `tokens` tokens each, written to a store at `path`.
std::vector<kv::Packet> write_docs(const std::filesystem::path& path,
                                   const kv::CacheModelInfo& model, int count, int64_t tokens) {
    std::vector<kv::Packet> packets;
    for (int i = 0; i < count; ++i)
        packets.push_back(make_packet(model, "doc-" + std::to_string(i), tokens, i));
    write_store(path, model, packets);
    return packets;
}

}  // namespace

TEST_CASE("the packet cache keeps stores open and packets loaded, least recently used out",
          "[packet_source]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    const std::vector<kv::Packet> packets = write_docs(dir / "a.kvc", model, 4, 10);
    const int64_t one = kv::packet_memory(packets[0]);
    CHECK(one > static_cast<int64_t>(packets[0].keys.size() + packets[0].values.size()));

    // Room for two packets of this size, not three.
    kv::PacketCache cache(2 * one + one / 2);
    const auto store = cache.store(dir / "a.kvc");
    CHECK(cache.store(dir / "a.kvc") == store);  // opened once
    CHECK(cache.stats().stores == 1);

    kv::SourcedPacket first = cache.packet(store, "doc-0");
    CHECK_FALSE(first.from_memory);
    CHECK(first.kept);
    CHECK(first.bytes_read == static_cast<int64_t>(packets[0].keys.size() * 2));
    CHECK(first.packet->keys == packets[0].keys);
    cache.packet(store, "doc-1");
    kv::SourcedPacket again = cache.packet(store, "doc-0");  // doc-0 is now the most recent
    CHECK(again.from_memory);
    CHECK(again.bytes_read == 0);
    CHECK(again.packet == first.packet);
    CHECK(cache.stats().hits == 1);
    CHECK(cache.stats().misses == 2);

    cache.packet(store, "doc-2");  // evicts doc-1, the least recently used
    CHECK(cache.stats().evictions == 1);
    CHECK(cache.stats().kept_packets == 2);
    CHECK(cache.packet(store, "doc-0").from_memory);
    CHECK_FALSE(cache.packet(store, "doc-1").from_memory);  // read again, evicting doc-2
    CHECK(cache.packet(store, "doc-0").from_memory);
    CHECK_FALSE(cache.packet(store, "doc-2").from_memory);
    CHECK(cache.stats().kept_bytes <= cache.capacity());
    CHECK(cache.stats().peak_bytes == 2 * one);
    // A packet handed out stays whole after its eviction: the caller holds it.
    CHECK(first.packet->keys == packets[0].keys);

    CHECK_THROWS_WITH(cache.packet(store, "absent"), Catch::Contains("no packet 'absent'"));
    CHECK_THROWS_AS(kv::PacketCache(-1), kv::UsageError);
}

TEST_CASE("a packet cache of no memory keeps nothing, nor does a direct source",
          "[packet_source]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    write_store(dir / "a.kvc", model, {make_packet(model, "x", 5, 1)});
    kv::PacketCache none(0);
    const auto store = none.store(dir / "a.kvc");
    for (int i = 0; i < 2; ++i) {
        const kv::SourcedPacket sourced = none.packet(store, "x");
        CHECK_FALSE(sourced.kept);
        CHECK_FALSE(sourced.from_memory);
    }
    CHECK(none.stats().misses == 2);
    CHECK(none.stats().kept_packets == 0);

    kv::DirectPacketSource direct;
    const auto opened = direct.store(dir / "a.kvc");
    CHECK(direct.store(dir / "a.kvc") == opened);  // once while it lives (one question)
    // Whether a caller may read a packet straight to where it goes: never kept here.
    const kv::PacketInfo info = store->packet_info("x");
    CHECK_FALSE(direct.keeps(*opened, info));
    CHECK_FALSE(none.keeps(*store, info));
    // A cache with room keeps it; one no larger than its keys and values does not (the packet
    // takes more: its positions, its id).
    const int64_t tensors = kv::packet_tensor_bytes(model, info.stored_length);
    kv::PacketCache roomy(tensors * 4), tight(tensors);
    CHECK(roomy.keeps(*roomy.store(dir / "a.kvc"), info));
    CHECK_FALSE(tight.keeps(*tight.store(dir / "a.kvc"), info));
    const kv::SourcedPacket sourced = direct.packet(opened, "x");
    CHECK_FALSE(sourced.kept);
    CHECK(sourced.packet->stored_length() == 5);
}

TEST_CASE("two threads share a packet cache: each packet read once, the counts add up",
          "[packet_source]") {
    // kvserve-once --requests reads the next requests' packets on one thread while another
    // looks up the packets and directory entries of the request it serves.
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    const std::vector<kv::Packet> packets = write_docs(dir / "a.kvc", model, 16, 12);
    kv::PacketCache cache(int64_t{1} << 30);
    const auto store = cache.store(dir / "a.kvc");
    std::atomic<int> wrong{0};
    auto ask_all = [&](int first) {
        for (int round = 0; round < 3; ++round)
            for (int k = 0; k < 16; ++k) {
                const int i = (first + k) % 16;
                const std::string id = "doc-" + std::to_string(i);
                if (store->packet_info(id).stored_length != 12) ++wrong;
                const kv::SourcedPacket sourced = cache.packet(store, id);
                if (sourced.packet->keys != packets[static_cast<std::size_t>(i)].keys) ++wrong;
            }
    };
    std::thread other(ask_all, 8);
    ask_all(0);
    other.join();
    CHECK(wrong == 0);
    const kv::PacketCache::Stats stats = cache.stats();
    CHECK(stats.hits + stats.misses == 2 * 3 * 16);
    // Both threads may read a packet that neither had yet; no packet is read more than twice.
    CHECK(stats.misses >= 16);
    CHECK(stats.misses <= 32);
    CHECK(stats.kept_packets == 16);
}
