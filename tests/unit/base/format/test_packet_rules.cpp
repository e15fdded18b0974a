// What the consumers of a packet rely on beyond its shapes (packet_rules.hpp): positions that
// increase, index layouts DciIndex can restore, segments moved forward only. The writer refuses
// a packet that breaks one, naming it, so that no tool writes what kvpack and kvserve-once would
// refuse or misuse later; the reader applies the same rules to every packet it reads.
#include "cache_fixtures.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/index/dci.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <random>

using kv::test::make_packet;
using kv::test::test_model;
using kv::test::test_provenance;

namespace {

// A packet of `length` tokens with a sound index of one segment per plane.
kv::Packet indexed_packet(const kv::CacheModelInfo& model, int64_t length) {
    kv::Packet packet = make_packet(model, "doc", length, 3);
    kv::PacketIndex& index = packet.index;
    index.projection = kv::dci_projection(model.head_dim, 1);
    index.segments = {{0, length, 0}};
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    for (int64_t plane = 0; plane < model.num_layers * model.num_kv_heads; ++plane) {
        std::vector<float> keys(static_cast<std::size_t>(length * model.head_dim));
        for (float& x : keys)
            x = normal(rng);
        kv::DciIndex built(model.head_dim, index.projection);
        built.build(keys.data(), length);
        index.layouts.push_back(built.layout());
    }
    return packet;
}

std::string refusal(const kv::CacheModelInfo& model, const kv::Packet& packet) {
    kv::test::TempDir dir;
    kv::CacheWriter writer(dir / "a.kvc", model, test_provenance());
    try {
        writer.add(packet);
    } catch (const kv::FormatError& error) {
        return error.what();
    }
    return "";
}

}  // namespace

TEST_CASE("the writer refuses positions that do not increase, naming the packet",
          "[cache_file][packet_rules]") {
    const kv::CacheModelInfo model = test_model();
    kv::Packet packet = make_packet(model, "doc", 6, 1);
    CHECK(refusal(model, packet).empty());
    packet.positions[4] = packet.positions[3];  // one position twice
    const std::string message = refusal(model, packet);
    CHECK_THAT(message, Catch::Contains("'doc'") && Catch::Contains("positions do not increase"));
}

TEST_CASE("the writer refuses an index that decoding could not restore, naming the packet",
          "[cache_file][packet_rules]") {
    const kv::CacheModelInfo model = test_model();
    const kv::Packet sound = indexed_packet(model, 200);
    REQUIRE(refusal(model, sound).empty());
    {
        // Written and read back, the sound index passes the reader's checks too.
        kv::test::TempDir dir;
        kv::test::write_store(dir / "a.kvc", model, {sound});
        CHECK(kv::CacheReader(dir / "a.kvc").read("doc").index.layouts.size() ==
              sound.index.layouts.size());
    }

    kv::Packet twice = sound;
    std::vector<int32_t>& tokens = twice.index.layouts[1].page_tokens;
    REQUIRE(tokens.size() >= 2);
    tokens[1] = tokens[0];  // a token in two pages, another in none
    CHECK_THAT(refusal(model, twice),
               Catch::Contains("'doc'") && Catch::Contains("invalid index"));

    kv::Packet norm = sound;
    norm.index.layouts[0].max_squared_norm = -1;
    CHECK_THAT(refusal(model, norm), Catch::Contains("max_squared_norm is not a positive number"));

    kv::Packet moved_back = sound;
    moved_back.index.segments[0].delta = -1;  // keys moved before their first position
    CHECK_THAT(refusal(model, moved_back),
               Catch::Contains("'doc'") && Catch::Contains("segment 0 was moved by"));
}
