#include "cache_fixtures.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/index/dci.hpp"
#include "test_support.hpp"

#include <hdf5.h>
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <chrono>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

namespace {

using kv::test::make_packet;
using kv::test::test_model;
using kv::test::test_provenance;
using kv::test::write_store;

void check_same_packet(const kv::Packet& a, const kv::Packet& b) {
    CHECK(a.id == b.id);
    CHECK(a.text_sha256 == b.text_sha256);
    CHECK(a.token_ids == b.token_ids);
    CHECK(a.positions == b.positions);
    CHECK(a.logical_length == b.logical_length);
    CHECK(a.adapter_fingerprint == b.adapter_fingerprint);
    CHECK(a.header_tokens == b.header_tokens);
    CHECK(a.trailer_tokens == b.trailer_tokens);
    CHECK(a.keys == b.keys);
    CHECK(a.values == b.values);
}

std::string error_of(const std::function<void()>& action) {
    try {
        action();
    } catch (const std::exception& error) {
        return error.what();
    }
    return "";
}

std::vector<std::string> directory_entries(const std::filesystem::path& directory) {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(directory))
        names.push_back(entry.path().filename().string());
    return names;
}

}  // namespace

TEST_CASE("cache dtypes have names and sizes", "[cache_file]") {
    CHECK(std::string(kv::cache_dtype_name(kv::CacheDtype::bf16)) == "bf16");
    CHECK(kv::parse_cache_dtype("f16") == kv::CacheDtype::f16);
    CHECK(kv::cache_dtype_size(kv::CacheDtype::f32) == 4);
    CHECK(kv::cache_dtype_size(kv::CacheDtype::bf16) == 2);
    CHECK_THROWS_AS(kv::parse_cache_dtype("f64"), kv::FormatError);
}

TEST_CASE("cache files round-trip every dtype with several packets", "[cache_file]") {
    const auto dtype = GENERATE(kv::CacheDtype::f32, kv::CacheDtype::bf16, kv::CacheDtype::f16);
    const auto zstd_level = GENERATE(0, 3);
    CAPTURE(kv::cache_dtype_name(dtype), zstd_level);
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model(dtype);
    std::vector<kv::Packet> packets = {
        make_packet(model, "doc-1", 5, 1), make_packet(model, "naïve/ünïcode id", 300, 2),
        make_packet(model, "empty", 0, 3), make_packet(model, "one", 1, 4)};
    packets[1].adapter_fingerprint = std::string(64, 'd');
    packets[1].header_tokens = 8;
    packets[1].trailer_tokens = 8;
    packets[1].token_ids[0] = -1;    // an adapter soft token
    packets[3].logical_length = 10;  // compressed: 1 of 10 tokens kept
    packets[3].positions[0] = 9;
    kv::CacheWriteOptions options;
    options.zstd_level = zstd_level;
    options.chunk_tokens = 64;
    write_store(dir / "a.kvc", model, packets, options);

    const kv::CacheReader reader(dir / "a.kvc");
    CHECK(reader.format_version() == "1.7");  // tensor_layout (section 7), in every file
    CHECK(reader.source() == "'" + (dir / "a.kvc").string() + "'");
    const kv::CacheModelInfo& got = reader.model();
    CHECK(got.model_fingerprint == model.model_fingerprint);
    CHECK(got.model_name == model.model_name);
    CHECK(got.architecture == model.architecture);
    CHECK(got.num_layers == 3);
    CHECK(got.num_kv_heads == 2);
    CHECK(got.head_dim == 8);
    CHECK(got.rope_layout == "half_split");
    CHECK(got.rope_theta == 10000);
    CHECK(got.rope_scaling == model.rope_scaling);
    CHECK(got.tokenizer_fingerprint == model.tokenizer_fingerprint);
    CHECK(got.dtype == dtype);
    CHECK(reader.provenance().tool == "kv_unit_tests");
    CHECK(reader.provenance().command_line == test_provenance().command_line);
    CHECK(reader.provenance().created.empty());
    REQUIRE(reader.packets().size() == packets.size());
    for (std::size_t i = 0; i < packets.size(); ++i) {
        const kv::PacketInfo& info = reader.packets()[i];
        CHECK(info.id == packets[i].id);
        CHECK(info.stored_length == packets[i].stored_length());
        CHECK(info.logical_length == packets[i].logical_length);
        check_same_packet(reader.read(info.id), packets[i]);
        // Plane by plane, and without tensors, the same packet.
        const auto [keys, values] = kv::test::read_all_planes(reader, info.id);
        CHECK(keys == packets[i].keys);
        CHECK(values == packets[i].values);
        kv::Packet bare = reader.read_without_tensors(info.id);
        CHECK(bare.keys.empty());
        CHECK(bare.values.empty());
        bare.keys = keys;
        bare.values = values;
        check_same_packet(bare, packets[i]);
    }
    CHECK(reader.packet_info("one").logical_length == 10);
    CHECK_THROWS_AS(reader.packet_info("absent"), kv::Error);
    CHECK_THROWS_WITH(reader.read("absent"), Catch::Contains("no packet 'absent'"));
}

TEST_CASE("index layouts left in the file are read one at a time as read() reads them",
          "[cache_file]") {
    // kvserve-once --offload disk restores one (layer, kv-head, segment) index at a time and
    // reads only its layout then. Two segments, as kvpack leaves them.
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    kv::Packet packet = make_packet(model, "indexed", 300, 3);
    kv::PacketIndex& index = packet.index;
    index.projection = kv::dci_projection(model.head_dim, 1);
    index.segments = {{0, 120, 0}, {120, 180, 120}};
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    for (int64_t plane = 0; plane < model.num_layers * model.num_kv_heads; ++plane)
        for (const kv::IndexSegment& segment : index.segments) {
            std::vector<float> keys(static_cast<std::size_t>(segment.count * model.head_dim));
            for (float& x : keys)
                x = normal(rng);
            kv::DciIndex built(model.head_dim, index.projection);
            built.build(keys.data(), segment.count);
            index.layouts.push_back(built.layout());
        }
    write_store(dir / "a.kvc", model, {packet});
    const kv::CacheReader reader(dir / "a.kvc");
    const kv::Packet whole = reader.read("indexed");
    const kv::Packet bare = reader.read_without_tensors_or_layouts("indexed");
    CHECK(bare.keys.empty());
    CHECK(bare.index.layouts.empty());
    CHECK(bare.index.projection == whole.index.projection);
    REQUIRE(bare.index.segments.size() == 2);
    CHECK(bare.index.segments[1].delta == 120);
    CHECK(bare.positions == whole.positions);
    // Read into a cache's planes (kvserve-once's in-place read), without its layouts.
    std::vector<std::byte> keys(whole.keys.size()), values(whole.values.size());
    const std::size_t plane_bytes =
        whole.keys.size() / static_cast<std::size_t>(model.num_layers * model.num_kv_heads);
    kv::PlaneTargets key_planes, value_planes;
    key_planes.head_stride = value_planes.head_stride = plane_bytes;
    for (int64_t layer = 0; layer < model.num_layers; ++layer) {
        const std::size_t at = static_cast<std::size_t>(layer * model.num_kv_heads) * plane_bytes;
        key_planes.layers.push_back(keys.data() + at);
        value_planes.layers.push_back(values.data() + at);
    }
    const kv::Packet into = reader.read_into("indexed", key_planes, value_planes, false);
    CHECK(into.index.layouts.empty());
    CHECK(into.index.segments.size() == 2);
    CHECK(into.index.projection == whole.index.projection);
    CHECK(keys == whole.keys);
    CHECK(values == whole.values);
    CHECK(reader.read_into("indexed", key_planes, value_planes).index.layouts.size() ==
          whole.index.layouts.size());
    for (int64_t layer = 0; layer < model.num_layers; ++layer)
        for (int64_t head = 0; head < model.num_kv_heads; ++head)
            for (int64_t segment = 0; segment < 2; ++segment) {
                const kv::DciLayout read =
                    reader.read_index_layout("indexed", layer, head, segment);
                const kv::DciLayout& expected =
                    whole.index.layout(layer, head, model.num_kv_heads, segment);
                CHECK(read.max_squared_norm == expected.max_squared_norm);
                CHECK(read.levels == expected.levels);
                CHECK(read.parents == expected.parents);
                CHECK(read.page_sizes == expected.page_sizes);
                CHECK(read.page_tokens == expected.page_tokens);
                CHECK_FALSE(read.levels.empty());
            }
    CHECK_THROWS_WITH(reader.read_index_layout("indexed", 0, 0, 2),
                      Catch::Contains("no index layout for plane 0, segment 2 (the index has 2 "
                                      "segments)"));
    CHECK_THROWS_AS(reader.read_index_layout("indexed", 0, 0, 2), kv::UsageError);
    CHECK_THROWS_AS(reader.read_index_layout("indexed", 3, 0, 0), kv::UsageError);
    CHECK_THROWS_WITH(reader.read_index_layout("absent", 0, 0, 0),
                      Catch::Contains("no packet 'absent'"));
}

TEST_CASE("an index over some layers is written with its feature, and read back", "[cache_file]") {
    // kvindex --dense-layers / --reuse-layers: the index covers layers 1 and 2 of 3 only.
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    kv::Packet packet = make_packet(model, "some", 200, 4);
    kv::PacketIndex& index = packet.index;
    index.projection = kv::dci_projection(model.head_dim, 1);
    index.segments = {{0, 200, 0}};
    index.layers = {1, 2};
    std::mt19937 rng(6);
    std::normal_distribution<float> normal;
    for (int64_t plane = 0; plane < 2 * model.num_kv_heads; ++plane) {
        std::vector<float> keys(static_cast<std::size_t>(200 * model.head_dim));
        for (float& x : keys)
            x = normal(rng);
        kv::DciIndex built(model.head_dim, index.projection);
        built.build(keys.data(), 200);
        index.layouts.push_back(built.layout());
    }
    write_store(dir / "a.kvc", model, {packet});
    const kv::CacheReader reader(dir / "a.kvc");
    CHECK(reader.format_version() == "1.7");  // 1.5 for the feature, 1.7 for tensor_layout
    const kv::Packet read = reader.read("some");
    CHECK(read.index.layers == std::vector<int64_t>{1, 2});
    CHECK_FALSE(read.index.covers(0));
    REQUIRE(read.index.layouts.size() == 4);
    CHECK(read.index.layout(2, 1, model.num_kv_heads, 0).levels ==
          index.layout(2, 1, model.num_kv_heads, 0).levels);
    CHECK(reader.read_index_layout("some", 1, 0, 0).page_tokens ==
          index.layout(1, 0, model.num_kv_heads, 0).page_tokens);
    CHECK_THROWS_WITH(reader.read_index_layout("some", 0, 0, 0),
                      Catch::Contains("has no index of layer 0 (it covers layers 1, 2)"));

    SECTION("layouts that do not match the listed layers are refused before writing") {
        index.layers = {2, 1};
        CHECK_THROWS_WITH(write_store(dir / "b.kvc", model, {packet}),
                          Catch::Contains("its layers do not increase"));
        index.layers = {1};
        CHECK_THROWS_WITH(write_store(dir / "b.kvc", model, {packet}),
                          Catch::Contains("one layout per covered layer"));
    }
}

TEST_CASE("a long packet is read plane by plane in pieces, the same bytes", "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model(kv::CacheDtype::bf16);
    const kv::Packet packet = make_packet(model, "long", 16384 * 2 + 300, 7);
    write_store(dir / "a.kvc", model, {packet});
    const kv::CacheReader reader(dir / "a.kvc");
    int64_t pieces = 0;
    reader.read_planes("long",
                       [&](int64_t, int64_t, bool, int64_t first, std::span<const std::byte> rows) {
                           ++pieces;
                           CHECK(first % 16384 == 0);
                           CHECK(rows.size() <= std::size_t{16384} * 8 * 2);
                       });
    CHECK(pieces == 3 * 2 * 2 * 3);  // layers, heads, keys and values, three pieces each
    const auto [keys, values] = kv::test::read_all_planes(reader, "long");
    CHECK(keys == packet.keys);
    CHECK(values == packet.values);
}

TEST_CASE("a cache file with no packets is valid", "[cache_file]") {
    kv::test::TempDir dir;
    write_store(dir / "empty.kvc", test_model(), {});
    const kv::CacheReader reader(dir / "empty.kvc");
    CHECK(reader.packets().empty());
}

TEST_CASE("identical input writes identical bytes", "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model(kv::CacheDtype::bf16);
    const std::vector<kv::Packet> packets = {make_packet(model, "a", 40, 1),
                                             make_packet(model, "b", 7, 2)};
    write_store(dir / "1.kvc", model, packets);
    // HDF5 stamps objects to the second unless told not to: cross a second boundary.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    write_store(dir / "2.kvc", model, packets);
    CHECK(kv::test::read_text(dir / "1.kvc") == kv::test::read_text(dir / "2.kvc"));
}

TEST_CASE("the writer refuses bad packets", "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    kv::CacheWriter writer(dir / "a.kvc", model, test_provenance());
    writer.add(make_packet(model, "x", 4, 1));
    CHECK_THROWS_AS(writer.add(make_packet(model, "x", 4, 2)), kv::UsageError);
    CHECK_THROWS_WITH(writer.add(make_packet(model, "x", 4, 2)),
                      Catch::Contains("duplicate packet id 'x'"));
    CHECK_THROWS_AS(writer.add(make_packet(model, "", 4, 2)), kv::UsageError);

    kv::Packet short_keys = make_packet(model, "short", 4, 3);
    short_keys.keys.pop_back();
    CHECK_THROWS_AS(writer.add(short_keys), kv::FormatError);
    kv::Packet positions = make_packet(model, "positions", 4, 3);
    positions.positions.pop_back();
    CHECK_THROWS_AS(writer.add(positions), kv::FormatError);
    kv::Packet logical = make_packet(model, "logical", 4, 3);
    logical.logical_length = 3;
    CHECK_THROWS_WITH(writer.add(logical),
                      Catch::Contains("logical_length 3 is less than stored_length 4"));
    kv::Packet outside = make_packet(model, "outside", 4, 3);
    outside.positions[2] = 4;
    CHECK_THROWS_AS(writer.add(outside), kv::FormatError);

    // Refused packets leave the writer usable.
    writer.add(make_packet(model, "y", 2, 4));
    writer.finish();
    const kv::CacheReader reader(dir / "a.kvc");
    REQUIRE(reader.packets().size() == 2);
    CHECK(reader.packets()[1].id == "y");
}

TEST_CASE("a writer destroyed without finish leaves nothing", "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    {
        kv::CacheWriter writer(dir / "a.kvc", model, test_provenance());
        writer.add(make_packet(model, "x", 4, 1));
        // The temporary file exists beside the output while writing, never under its name.
        const auto names = directory_entries(dir.path());
        REQUIRE(names.size() == 1);
        CHECK(names[0].rfind(".a.kvc.tmp-", 0) == 0);
    }
    CHECK(directory_entries(dir.path()).empty());

    // An existing file is untouched until finish() replaces it.
    write_store(dir / "a.kvc", model, {make_packet(model, "old", 2, 1)});
    {
        kv::CacheWriter writer(dir / "a.kvc", model, test_provenance());
        writer.add(make_packet(model, "new", 2, 1));
    }
    const kv::CacheReader reader(dir / "a.kvc");
    REQUIRE(reader.packets().size() == 1);
    CHECK(reader.packets()[0].id == "old");
}

TEST_CASE("a writer killed mid-write leaves no file under the output name", "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        try {
            kv::CacheWriter writer(dir / "a.kvc", model, test_provenance());
            for (int i = 0;; ++i)
                writer.add(make_packet(model, std::to_string(i), 64, i));
        } catch (...) {
        }
        _exit(1);  // never back into the test runner
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFSIGNALED(status));
    CHECK(!std::filesystem::exists(dir / "a.kvc"));
}

TEST_CASE("opening a store reads no tensor", "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    {
        kv::CacheWriter writer(dir / "a.kvc", model, test_provenance());
        for (int i = 0; i < 1000; ++i)
            writer.add(make_packet(model, "doc-" + std::to_string(i), 3, i));
        writer.finish();
    }
    // The index lists them all; tests/cli/kvinspect/lazy-reads.sh shows that no tensor chunk is
    // read for it, by corrupting every chunk but one packet's.
    const kv::CacheReader reader(dir / "a.kvc");
    REQUIRE(reader.packets().size() == 1000);
    CHECK(reader.packets()[999].id == "doc-999");
    CHECK(reader.packet_info("doc-500").stored_length == 3);
    check_same_packet(reader.read("doc-500"), make_packet(model, "doc-500", 3, 500));
}

TEST_CASE("readers refuse what is not a sound cache file", "[cache_file]") {
    kv::test::TempDir dir;
    CHECK_THROWS_AS(kv::CacheReader(dir / "absent.kvc"), kv::IoError);
    CHECK_THROWS_WITH(kv::CacheReader(dir / "absent.kvc"),
                      Catch::Contains("cannot open '") && Catch::Contains("No such file"));
    kv::test::write_file(dir / "text.kvc", "hello, world\n");
    CHECK_THROWS_AS(kv::CacheReader(dir / "text.kvc"), kv::FormatError);
    CHECK_THROWS_WITH(kv::CacheReader(dir / "text.kvc"), Catch::Contains("not an HDF5 file"));
    CHECK_THROWS_AS(kv::CacheReader(dir.path()), kv::IoError);

    const kv::CacheModelInfo model = test_model();
    write_store(dir / "a.kvc", model, {make_packet(model, "x", 300, 1)});
    const std::string bytes = kv::test::read_text(dir / "a.kvc");
    for (std::size_t keep : {std::size_t{100}, bytes.size() / 2, bytes.size() - 1}) {
        CAPTURE(keep);
        kv::test::write_file(dir / "cut.kvc", bytes.substr(0, keep));
        std::string message;
        try {
            const kv::CacheReader reader(dir / "cut.kvc");
            for (const kv::PacketInfo& info : reader.packets())
                reader.read(info.id);
        } catch (const kv::FormatError& error) {
            message = error.what();
        }
        CHECK(message.find("cut.kvc'") != std::string::npos);
        CHECK(message.find('\n') == std::string::npos);
    }
}

TEST_CASE("check_compatible names both fingerprints", "[cache_file]") {
    const kv::CacheModelInfo expected = test_model();
    kv::CacheModelInfo found = test_model();
    CHECK_NOTHROW(kv::check_compatible(expected, found, "'a.kvc'"));
    found.model_name = "other/name";  // names are for messages only
    CHECK_NOTHROW(kv::check_compatible(expected, found, "'a.kvc'"));

    found.model_fingerprint = "1234567890abcdef" + std::string(48, '0');
    const std::string message = error_of([&] { kv::check_compatible(expected, found, "'a.kvc'"); });
    CHECK(message ==
          "cache 'a.kvc' was baked with model 'other/name' (fingerprint 1234567890ab), not "
          "'models/tiny' (fingerprint aaaaaaaaaaaa)");
    CHECK_THROWS_AS(kv::check_compatible(expected, found, "a.kvc"), kv::MismatchError);

    found = test_model();
    found.tokenizer_fingerprint = std::string(64, 'e');
    CHECK(error_of([&] { kv::check_compatible(expected, found, "a.kvc"); }) ==
          "cache 'a.kvc' was baked with another tokenizer (fingerprint eeeeeeeeeeee) than the one "
          "in use (fingerprint bbbbbbbbbbbb)");
    found = test_model(kv::CacheDtype::bf16);
    CHECK(error_of([&] { kv::check_compatible(expected, found, "'a.kvc'"); }) ==
          "cache 'a.kvc' has dtype bf16, expected f32");
    found = test_model();
    found.num_layers = 4;
    CHECK(error_of([&] { kv::check_compatible(expected, found, "'a.kvc'"); }) ==
          "cache 'a.kvc' has num_layers 4, expected 3");
}

TEST_CASE("merge concatenates stores and refuses mismatches", "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model(kv::CacheDtype::bf16);
    const std::vector<kv::Packet> first = {make_packet(model, "a", 5, 1),
                                           make_packet(model, "b", 9, 2)};
    const std::vector<kv::Packet> second = {make_packet(model, "c", 3, 3)};
    write_store(dir / "1.kvc", model, first);
    write_store(dir / "2.kvc", model, second);
    const kv::MergeReport report =
        kv::merge_cache_files({dir / "2.kvc", dir / "1.kvc"}, dir / "all.kvc",
                              {"kvinspect", "0.1.0", "kvinspect merge 2.kvc 1.kvc -o all.kvc", ""});
    CHECK(report.files == 2);
    CHECK(report.packets == 3);
    CHECK(report.tokens == 5 + 9 + 3);
    CHECK(report.stored_tokens == 5 + 9 + 3);
    CHECK(report.bytes == static_cast<int64_t>(first[0].keys.size() + first[0].values.size() +
                                               first[1].keys.size() + first[1].values.size() +
                                               second[0].keys.size() + second[0].values.size()));
    const kv::CacheReader merged(dir / "all.kvc");
    REQUIRE(merged.packets().size() == 3);
    CHECK(merged.packets()[0].id == "c");
    CHECK(merged.packets()[1].id == "a");
    CHECK(merged.packets()[2].id == "b");
    CHECK(merged.provenance().tool == "kvinspect");
    CHECK(merged.model().dtype == kv::CacheDtype::bf16);
    check_same_packet(merged.read("b"), first[1]);
    check_same_packet(merged.read("c"), second[0]);

    const std::string duplicate = error_of([&] {
        kv::merge_cache_files({dir / "1.kvc", dir / "all.kvc"}, dir / "x.kvc", {});
    });
    CHECK(duplicate.find("packet id 'a' is in both '" + (dir / "1.kvc").string() + "' and '" +
                         (dir / "all.kvc").string() + "'") != std::string::npos);
    CHECK_THROWS_AS(kv::merge_cache_files({dir / "1.kvc", dir / "all.kvc"}, dir / "x.kvc", {}),
                    kv::MismatchError);

    kv::CacheModelInfo other = model;
    other.model_fingerprint = std::string(64, 'f');
    write_store(dir / "other.kvc", other, {make_packet(other, "z", 2, 1)});
    const std::string mismatch = error_of([&] {
        kv::merge_cache_files({dir / "1.kvc", dir / "other.kvc"}, dir / "x.kvc", {});
    });
    CHECK(mismatch.find((dir / "1.kvc").string()) != std::string::npos);
    CHECK(mismatch.find((dir / "other.kvc").string()) != std::string::npos);
    CHECK(mismatch.find("fingerprint ffffffffffff") != std::string::npos);
    CHECK(!std::filesystem::exists(dir / "x.kvc"));

    // Merging into one of the inputs replaces it at the end.
    kv::merge_cache_files({dir / "1.kvc", dir / "2.kvc"}, dir / "1.kvc", {});
    CHECK(kv::CacheReader(dir / "1.kvc").packets().size() == 3);
    CHECK_THROWS_AS(kv::merge_cache_files({}, dir / "x.kvc", {}), kv::UsageError);
    CHECK_THROWS_AS(kv::merge_cache_files({"-", "-"}, dir / "x.kvc", {}), kv::UsageError);
}

TEST_CASE("the conformance corpus reads as tests/data/kvcache/expected.tsv says", "[cache_file]") {
    const std::filesystem::path corpus = std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache";
    std::istringstream list(kv::test::read_text(corpus / "expected.tsv"));
    int files = 0;
    for (std::string line; std::getline(list, line);) {
        if (line.empty() || line[0] == '#') continue;
        const std::string file = line.substr(0, line.find('\t'));
        const bool sound = line.find("\t0\t") != std::string::npos;
        // A file whose values are not finite is sound for the reader: only check objects.
        const bool readable = sound || line.find("not finite") != std::string::npos;
        CAPTURE(file);
        std::string message;
        try {
            const kv::CacheReader reader(corpus / file);
            for (const kv::PacketInfo& info : reader.packets()) {
                const kv::Packet packet = reader.read(info.id);
                CHECK(packet.stored_length() == info.stored_length);
            }
            reader.check_packet_ids();  // as kvinspect check does
            if (reader.has_adapter()) reader.read_adapter();
        } catch (const kv::FormatError& error) {
            message = error.what();
        }
        if (readable) {
            CHECK(message.empty());
        } else {
            CHECK(message.find(file) != std::string::npos);
            CHECK(message.find('\n') == std::string::npos);
        }
        ++files;
    }
    CHECK(files >= 30);
}

TEST_CASE("the corpus files hold what their generator wrote", "[cache_file]") {
    const std::filesystem::path corpus = std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache";
    const kv::CacheReader reader(corpus / "good/0006_compressed_and_adapter.kvc");
    CHECK(reader.model().architecture == "LlamaForCausalLM");
    CHECK(reader.model().num_layers == 2);
    CHECK(reader.provenance().tool == "make_kvcache_corpus.py");
    const kv::Packet pruned = reader.read("pruned");
    CHECK(pruned.logical_length == 10);
    CHECK(pruned.positions == std::vector<int64_t>{0, 4, 9});
    const kv::Packet wrapped = reader.read("wrapped");
    CHECK(wrapped.token_ids == std::vector<int32_t>{-1, -1, 17, 18, -1, -1});
    CHECK(wrapped.header_tokens == 2);
    CHECK(wrapped.trailer_tokens == 2);
    CHECK(wrapped.adapter_fingerprint.size() == 64);

    const kv::CacheReader loose(corpus / "good/0008_loose_types_optional_absent.kvc");
    CHECK(loose.model().rope_theta == 10000);
    CHECK(loose.model().model_name.empty());
    CHECK(loose.model().rope_scaling.empty());
    const kv::CacheReader many(corpus / "good/0010_many_packets.kvc");
    CHECK(many.packets().size() == 12);
    CHECK(many.packet_info("with/slash").stored_length > 0);
    CHECK(many.read("日本語").id == "日本語");

    // Quantised packets (formats/kvcache.md 6.6), written by h5py with known codes: element e of
    // the codes has code e % 2^bits, scale 0.25 (keys) / 0.5 (values), offset -1; residual slots
    // hold 100 + their index. Layers 2, kv-heads 2, head_dim 4.
    const kv::CacheReader quantized(corpus / "good/0013_quantized.kvc");
    CHECK(quantized.format_version() == "1.3");
    auto value_at = [](const kv::Packet& packet, bool keys, std::size_t i) {
        float value;
        std::memcpy(&value, (keys ? packet.keys : packet.values).data() + 4 * i, 4);
        return value;
    };
    for (const auto& [id, bits, slots, residual] :
         {std::tuple<const char*, int, int64_t, int64_t>{"q8", 8, 3, 0}, {"q4", 4, 5, 2}}) {
        const kv::Packet packet = quantized.read(id);
        CHECK(packet.quantization.bits == bits);
        CHECK(packet.quantization.residual_tokens == residual);
        const int64_t kept = slots - residual;
        for (const bool keys : {true, false})
            for (int64_t plane = 0; plane < 4; ++plane)
                for (int64_t slot = 0; slot < slots; ++slot)
                    for (int64_t d = 0; d < 4; ++d) {
                        const auto at = static_cast<std::size_t>((plane * slots + slot) * 4 + d);
                        const float expected =
                            slot < kept ? static_cast<float>(((plane * kept + slot) * 4 + d) %
                                                             (1 << bits)) *
                                                  (keys ? 0.25f : 0.5f) -
                                              1.0f
                                        : static_cast<float>(
                                              100 + (plane * residual + slot - kept) * 4 + d);
                        INFO(id << (keys ? " keys" : " values") << " plane " << plane << " slot "
                                << slot << " dim " << d);
                        CHECK(value_at(packet, keys, at) == expected);
                    }
    }
    CHECK_FALSE(quantized.read("plain").quantization.enabled());
}

TEST_CASE("a packet is found by its link in /packet_ids, without reading the directory",
          "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    const std::vector<std::string> ids = {"doc-1", "with/slash",    "100%",   "%2F", ".",
                                          "..",    "naïve ünïcode", "日本語", " "};
    std::vector<kv::Packet> packets;
    for (std::size_t i = 0; i < ids.size(); ++i)
        packets.push_back(make_packet(model, ids[i], 2 + static_cast<int>(i), static_cast<int>(i)));
    packets[3].header_tokens = 1;  // an entry whose fields are not all the defaults
    packets[3].adapter_fingerprint = std::string(64, 'c');
    write_store(dir / "a.kvc", model, packets);
    {
        const kv::CacheReader reader(dir / "a.kvc");
        CHECK(reader.format_version() == "1.7");
        for (const kv::Packet& packet : packets) {
            CAPTURE(packet.id);
            const kv::PacketInfo& info = reader.packet_info(packet.id);
            CHECK(info.id == packet.id);
            CHECK(info.stored_length == packet.stored_length());
            CHECK(info.logical_length == packet.logical_length);
            CHECK(info.text_sha256 == packet.text_sha256);
            CHECK(info.header_tokens == packet.header_tokens);
            CHECK(info.adapter_fingerprint == packet.adapter_fingerprint);
            check_same_packet(reader.read(packet.id), packet);
        }
        CHECK_FALSE(reader.has_packet("absent"));
        CHECK_FALSE(reader.has_packet("with%2Fslash"));  // the link's name is not an id
        CHECK_THROWS_WITH(reader.packet_info("absent"),
                          Catch::Contains("no packet 'absent'") &&
                              Catch::Contains("(it holds 9: 'doc-1', 'with/slash', '100%', "
                                              "'%2F', '.', ...)"));
        CHECK_NOTHROW(reader.check_packet_ids());
        CHECK(reader.packets().size() == ids.size());  // the directory, read whole after all
        CHECK(reader.packet_info("..").stored_length == 7);
    }
    // The directory is not read for a lookup: a store whose index holds a bad entry elsewhere
    // is still served by id (the spec lets a lookup leave it unread), and refused whole.
    const std::filesystem::path corpus = std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache";
    const kv::CacheReader linked(corpus / "good/0016_packet_ids.kvc");
    CHECK(linked.read("with/slash").stored_length() == 2);
    CHECK(linked.read("100%").stored_length() == 3);
    CHECK(linked.read(".").stored_length() == 1);
    CHECK(linked.packet_info("doc-04").stored_length == 5);
    for (const auto& [file, id, message] :
         {std::tuple<const char*, const char*, const char*>{
              "broken/0031_packet_ids_hard_link.kvc", "doc-2",
              "packet 'doc-2': its link '/packet_ids/doc-2' is not a soft link"},
          {"broken/0032_packet_ids_wrong_group.kvc", "doc-1",
           "packet 'doc-1': its link '/packet_ids/doc-1' leads to '/packets/00000001', whose id "
           "is 'doc-2'"}}) {
        CAPTURE(file);
        const kv::CacheReader reader(corpus / file);
        CHECK_THROWS_WITH(reader.read(id), Catch::Contains(message));
    }
    // A link missing: the packet is not found by id; check names it.
    const kv::CacheReader missing(corpus / "broken/0033_packet_ids_missing_link.kvc");
    CHECK_FALSE(missing.has_packet("doc-2"));
    CHECK_THROWS_WITH(missing.check_packet_ids(),
                      Catch::Contains("packet 'doc-2' has no link in '/packet_ids'"));
    // Files before 1.6 have no /packet_ids: their directory is read on opening, as before.
    const kv::CacheReader older(corpus / "good/0010_many_packets.kvc");
    CHECK(older.packet_info("with/slash").stored_length > 0);
    CHECK_NOTHROW(older.check_packet_ids());
}

TEST_CASE("many lookups read the directory once, and a bad one leaves them to the links",
          "[cache_file]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    std::vector<kv::Packet> packets;
    for (int i = 0; i < 100; ++i)
        packets.push_back(
            make_packet(model, "doc-" + std::to_string(i), 1 + i % 5, static_cast<uint32_t>(i)));
    write_store(dir / "a.kvc", model, packets);
    std::filesystem::copy_file(dir / "a.kvc", dir / "b.kvc");
    // b's directory holds a bad entry (a stored length above the logical one) for the last
    // packet only; its group and link are right.
    {
        const hid_t file = H5Fopen((dir / "b.kvc").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        REQUIRE(file >= 0);
        const hid_t lengths = H5Dopen2(file, "/packet_index/stored_length", H5P_DEFAULT);
        REQUIRE(lengths >= 0);
        std::vector<int64_t> values(packets.size());
        REQUIRE(H5Dread(lengths, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >=
                0);
        values.back() = 1000;
        REQUIRE(H5Dwrite(lengths, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >=
                0);
        H5Dclose(lengths);
        H5Fclose(file);
    }
    // Past 64 lookups through the links, a reads its directory whole and answers from it; b
    // cannot, and goes on through the links, each entry checked as it is found.
    const kv::CacheReader a(dir / "a.kvc"), b(dir / "b.kvc");
    for (std::size_t i = 0; i < packets.size(); ++i) {
        const kv::Packet& packet = packets[i];
        CAPTURE(packet.id);
        for (const kv::CacheReader* reader : {&a, &b}) {
            const kv::PacketInfo& info = reader->packet_info(packet.id);
            CHECK(info.id == packet.id);
            CHECK(info.stored_length == packet.stored_length());
            CHECK(info.logical_length == packet.logical_length);
            if (i % 10 == 9) check_same_packet(reader->read(packet.id), packet);
        }
    }
    CHECK_FALSE(a.has_packet("absent"));
    CHECK_FALSE(b.has_packet("absent"));
    CHECK(a.packets().size() == packets.size());
    CHECK_THROWS_AS(b.packets(), kv::FormatError);
}

TEST_CASE("a cache file lock excludes a second locker and follows replacement", "[cache_file]") {
    kv::test::TempDir dir;
    const auto path = dir / "store.kvc";
    {
        kv::CacheFileLock nothing(path);
        CHECK_FALSE(nothing.locked());  // no file: nothing to lock
    }
    write_store(path, test_model(), {make_packet(test_model(), "a", 3, 1)});
    {
        kv::CacheFileLock first(path);
        REQUIRE(first.locked());
        // flock locks belong to the open file, so a second open in this process conflicts too.
        REQUIRE_THROWS_WITH(kv::CacheFileLock(path),
                            Catch::Contains("is locked: another process is writing it"));
        // The holder replaces the file by rename, as a writer does; its lock stays on the old one.
        write_store(path, test_model(), {make_packet(test_model(), "b", 3, 2)});
        kv::CacheFileLock after_replacement(path);
        CHECK(after_replacement.locked());
    }
    kv::CacheFileLock again(path);
    CHECK(again.locked());
}

TEST_CASE("no_replace refuses a file that appeared meanwhile", "[cache_file]") {
    kv::test::TempDir dir;
    const auto path = dir / "store.kvc";
    kv::CacheWriteOptions options;
    options.no_replace = true;
    kv::CacheWriter writer(path, test_model(), test_provenance(), options);
    writer.add(make_packet(test_model(), "mine", 3, 1));
    write_store(path, test_model(), {make_packet(test_model(), "theirs", 3, 2)});
    REQUIRE_THROWS_WITH(writer.finish(), Catch::Contains("another process created it meanwhile"));
    const kv::CacheReader reader(path);
    REQUIRE(reader.packets().size() == 1);
    CHECK(reader.packets()[0].id == "theirs");
    CHECK(std::distance(std::filesystem::directory_iterator(dir.path()), {}) == 1);
}
