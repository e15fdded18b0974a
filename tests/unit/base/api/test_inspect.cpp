#include "cache_fixtures.hpp"
#include "kv/api/inspect.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/safetensors.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>

namespace {

using kv::test::make_packet;
using kv::test::test_model;
using kv::test::write_store;

void set_float(kv::Packet& packet, bool keys, std::size_t index, float value) {
    std::memcpy((keys ? packet.keys : packet.values).data() + 4 * index, &value, 4);
}

}  // namespace

TEST_CASE("show describes a store from its index", "[inspect]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model(kv::CacheDtype::bf16);
    std::vector<kv::Packet> packets = {make_packet(model, "a", 5, 1),
                                       make_packet(model, "b\tc", 2, 2)};
    packets[1].logical_length = 9;
    packets[1].adapter_fingerprint = std::string(64, 'd');
    write_store(dir / "a.kvc", model, packets);
    const kv::CacheReader reader(dir / "a.kvc");

    const std::string text = kv::describe_cache_text(reader);
    CHECK(text.find("format:      kvtools-kvcache 1.7\n") != std::string::npos);
    // 5 and 2 tokens of head_dim 8: chunks of 1 MiB hold each plane whole.
    CHECK(text.find("layout:      chunks-1mib: keys and values in chunks of 5 tokens, shuffle + "
                    "zstd + fletcher32\n") != std::string::npos);
    CHECK(text.find("'models/tiny' LlamaForCausalLM, fingerprint " + std::string(64, 'a')) !=
          std::string::npos);
    CHECK(text.find("dtype:       bf16\n") != std::string::npos);
    CHECK(text.find("packets:     2, 7 tokens stored of 14") != std::string::npos);
    CHECK(text.find("b\\x09c") != std::string::npos);  // control characters escaped
    CHECK(text.find("dddddddddddd (0+0)") != std::string::npos);

    const kv::json::Value json = kv::describe_cache_json(reader);
    CHECK(json.at("format_version").as_string() == "1.7");
    CHECK(json.at("layout").at("name").as_string() == "chunks-1mib");
    CHECK(json.at("layout").at("chunk_tokens").as_int() == 5);
    CHECK(json.at("layout").at("filters").as_array().size() == 3);
    CHECK(json.at("dtype").as_string() == "bf16");
    CHECK(json.at("model").at("num_layers").as_int() == 3);
    CHECK(json.at("model").at("rope_scaling").as_string() == model.rope_scaling);
    CHECK(json.at("provenance").at("tool").as_string() == "kv_unit_tests");
    CHECK(json.at("stored_tokens").as_int() == 7);
    CHECK(json.at("tensor_bytes").as_int() == 2 * 3 * 2 * 7 * 8 * 2);
    REQUIRE(json.at("packets").size() == 2);
    CHECK(json.at("packets")[1].at("id").as_string() == "b\tc");
    CHECK(json.at("packets")[1].at("logical_length").as_int() == 9);
}

TEST_CASE("check reports values that are not finite, one line per tensor", "[inspect]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    std::vector<kv::Packet> packets = {make_packet(model, "ok", 4, 1),
                                       make_packet(model, "bad", 4, 2)};
    // [3 layers, 2 heads, 4 tokens, 8 dims]: index of layer 1, head 1, token 2, dimension 5.
    const std::size_t at = ((1 * 2 + 1) * 4 + 2) * 8 + 5;
    set_float(packets[1], true, at, std::numeric_limits<float>::quiet_NaN());
    set_float(packets[1], true, at + 1, std::numeric_limits<float>::infinity());
    set_float(packets[1], false, 0, -std::numeric_limits<float>::infinity());
    write_store(dir / "a.kvc", model, packets);
    CHECK(kv::check_cache_file(dir / "a.kvc").empty() == false);
    const std::vector<std::string> problems = kv::check_cache_file(dir / "a.kvc");
    REQUIRE(problems.size() == 2);
    const std::string name = "'" + (dir / "a.kvc").string() + "'";
    CHECK(problems[0] == name +
                             ": packet 'bad': keys hold 2 values that are not finite (first: NaN "
                             "at layer 1, kv-head 1, token 2, dimension 5)");
    CHECK(problems[1] == name +
                             ": packet 'bad': values hold 1 value that is not finite (first: "
                             "infinity at layer 0, kv-head 0, token 0, dimension 0)");

    write_store(dir / "b.kvc", model, {packets[0]});
    CHECK(kv::check_cache_file(dir / "b.kvc").empty());
    const std::vector<std::string> missing = kv::check_cache_file(dir / "none.kvc");
    REQUIRE(missing.size() == 1);
    CHECK(missing[0].find("No such file") != std::string::npos);

    // The report behind check -v: the file, its packets and its problems.
    const kv::CheckReport bad = kv::check_cache(dir / "a.kvc");
    CHECK(bad.packets == 2);
    CHECK(bad.problems == problems);
    CHECK(kv::summary(bad) == name + ": 2 problems, 2 packets");
    const std::string sound = "'" + (dir / "b.kvc").string() + "'";
    CHECK(kv::summary(kv::check_cache(dir / "b.kvc")) == sound + ": sound, 1 packet");
    const kv::CheckReport none = kv::check_cache(dir / "none.kvc");
    CHECK(none.packets == 0);
    CHECK(kv::summary(none) == "'" + (dir / "none.kvc").string() + "': 1 problem, 0 packets");
}

TEST_CASE("diff compares packets layer by layer", "[inspect]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = test_model();
    const std::vector<kv::Packet> packets = {make_packet(model, "a", 4, 1),
                                             make_packet(model, "b", 3, 2)};
    write_store(dir / "1.kvc", model, packets);
    write_store(dir / "2.kvc", model, packets);

    kv::DiffReport same = kv::diff_cache_files(dir / "1.kvc", dir / "2.kvc", {});
    CHECK(same.same);
    REQUIRE(same.packets.size() == 2);
    CHECK(same.packets[0].layers.size() == 3);
    CHECK(same.packets[1].layers[2].values_max == 0);
    CHECK(kv::format_diff_report(same, 0).find("2 packets compared, 0 different: same\n") !=
          std::string::npos);

    std::vector<kv::Packet> changed = packets;
    float value;
    std::memcpy(&value, changed[1].values.data() + 4 * 100, 4);  // layer 100 / 48 = 2
    set_float(changed[1], false, 100, value + 0.5f);
    write_store(dir / "3.kvc", model, changed);
    const kv::DiffReport different = kv::diff_cache_files(dir / "1.kvc", dir / "3.kvc", {});
    CHECK(!different.same);
    CHECK(different.packets[0].same);
    CHECK(!different.packets[1].same);
    CHECK(different.packets[1].layers[1].values_max == 0);
    CHECK(std::fabs(different.packets[1].layers[2].values_max - 0.5) < 1e-6);
    CHECK(std::fabs(different.packets[1].layers[2].values_mean - 0.5 / 48) < 1e-6);
    CHECK(different.packets[1].layers[2].keys_max == 0);

    kv::DiffOptions tolerant;
    tolerant.tolerance = 0.6;
    CHECK(kv::diff_cache_files(dir / "1.kvc", dir / "3.kvc", tolerant).same);
    kv::DiffOptions only_a;
    only_a.packet = "a";
    const kv::DiffReport one = kv::diff_cache_files(dir / "1.kvc", dir / "3.kvc", only_a);
    CHECK(one.same);
    CHECK(one.packets.size() == 1);
    only_a.packet = "zzz";
    CHECK_THROWS_AS(kv::diff_cache_files(dir / "1.kvc", dir / "3.kvc", only_a), kv::UsageError);

    std::vector<kv::Packet> retokenized = packets;
    retokenized[0].token_ids[2] += 1;
    retokenized.pop_back();
    write_store(dir / "4.kvc", model, retokenized);
    const kv::DiffReport sets = kv::diff_cache_files(dir / "1.kvc", dir / "4.kvc", {});
    CHECK(!sets.same);
    REQUIRE(sets.notes.size() == 1);
    CHECK(sets.notes[0] == "packet 'b' is only in '" + (dir / "1.kvc").string() + "'");
    REQUIRE(sets.packets[0].mismatches.size() == 1);
    CHECK(sets.packets[0].mismatches[0].rfind("token ids differ (first at 2:", 0) == 0);

    // Another dtype is a remark, not a difference: the values are compared.
    const kv::CacheModelInfo bf16 = test_model(kv::CacheDtype::bf16);
    write_store(dir / "5.kvc", bf16, {make_packet(bf16, "a", 4, 1)});
    const kv::DiffReport dtypes = kv::diff_cache_files(dir / "5.kvc", dir / "5.kvc", {});
    CHECK(dtypes.same);
    only_a.packet = "a";
    const kv::DiffReport mixed = kv::diff_cache_files(dir / "1.kvc", dir / "5.kvc", only_a);
    CHECK(mixed.remarks.size() == 1);
    CHECK_THROWS_AS(kv::diff_cache_files(dir / "1.kvc", dir / "none.kvc", {}), kv::IoError);
}

TEST_CASE("export writes every packet into one safetensors file", "[inspect]") {
    kv::test::TempDir dir;
    const auto dtype = GENERATE(kv::CacheDtype::f32, kv::CacheDtype::bf16, kv::CacheDtype::f16);
    const kv::CacheModelInfo model = test_model(dtype);
    const std::vector<kv::Packet> packets = {make_packet(model, "doc.1", 5, 1),
                                             make_packet(model, "doc-2", 2, 2)};
    write_store(dir / "a.kvc", model, packets);
    const kv::ExportReport report = kv::export_safetensors(dir / "a.kvc", dir / "a.safetensors");
    CHECK(report.packets == 2);
    CHECK(report.tensors == 8);
    CHECK(report.bytes == static_cast<int64_t>(std::filesystem::file_size(dir / "a.safetensors")));
    CHECK(kv::summary(report) == "exported 2 packets as 8 tensors to '" +
                                     (dir / "a.safetensors").string() + "' (" +
                                     std::to_string(report.bytes) + " bytes)");

    const kv::SafetensorsFile file = kv::SafetensorsFile::open(dir / "a.safetensors");
    CHECK(file.entries().size() == 8);
    const char* expected_dtype = dtype == kv::CacheDtype::f32    ? "F32"
                                 : dtype == kv::CacheDtype::bf16 ? "BF16"
                                                                 : "F16";
    for (const kv::Packet& packet : packets) {
        const kv::SafetensorsEntry* keys = file.find(packet.id + ".keys");
        REQUIRE(keys);
        CHECK(keys->dtype == expected_dtype);
        CHECK(keys->shape == std::vector<int64_t>{3, 2, packet.stored_length(), 8});
        CHECK(std::memcmp(file.data(*keys), packet.keys.data(), packet.keys.size()) == 0);
        const kv::SafetensorsEntry* values = file.find(packet.id + ".values");
        REQUIRE(values);
        CHECK(std::memcmp(file.data(*values), packet.values.data(), packet.values.size()) == 0);
        const kv::SafetensorsEntry* tokens = file.find(packet.id + ".token_ids");
        REQUIRE(tokens);
        CHECK(tokens->dtype == "I32");
        CHECK(std::memcmp(file.data(*tokens), packet.token_ids.data(),
                          4 * packet.token_ids.size()) == 0);
        const kv::SafetensorsEntry* positions = file.find(packet.id + ".positions");
        REQUIRE(positions);
        CHECK(positions->dtype == "I64");
    }
    const kv::json::Value meta_packets = kv::json::parse(file.metadata().at("packets"));
    CHECK(meta_packets[1].at("id").as_string() == "doc-2");
    CHECK(kv::json::parse(file.metadata().at("model")).at("head_dim").as_int() == 8);
    CHECK(file.metadata().at("dtype") == kv::cache_dtype_name(dtype));

    // A failed export leaves nothing behind.
    CHECK_THROWS(kv::export_safetensors(dir / "none.kvc", dir / "b.safetensors"));
    CHECK(!std::filesystem::exists(dir / "b.safetensors"));
}
