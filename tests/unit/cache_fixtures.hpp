// Cache files for tests: a small model description, seeded packets, a store written from them.
#pragma once

#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_writer.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kv::test {

inline kv::CacheModelInfo test_model(kv::CacheDtype dtype = kv::CacheDtype::f32) {
    kv::CacheModelInfo model;
    model.model_fingerprint = std::string(64, 'a');
    model.model_name = "models/tiny";
    model.architecture = "LlamaForCausalLM";
    model.num_layers = 3;
    model.num_kv_heads = 2;
    model.head_dim = 8;
    model.rope_layout = "half_split";
    model.rope_theta = 10000;
    model.rope_scaling = R"({"rope_type":"llama3","factor":8.0})";
    model.tokenizer_fingerprint = std::string(64, 'b');
    model.dtype = dtype;
    return model;
}

inline kv::Provenance test_provenance() {
    return {"kv_unit_tests", "0.1.0", "kv_unit_tests --case 'cache file'", ""};
}

// A packet of `length` tokens with seeded values, every byte pattern of the dtype but NaN.
inline kv::Packet make_packet(const kv::CacheModelInfo& model, const std::string& id,
                              int64_t length, uint32_t seed) {
    kv::Packet packet;
    packet.id = id;
    packet.text_sha256 = std::string(64, 'c');
    packet.logical_length = length;
    for (int64_t i = 0; i < length; ++i) {
        packet.token_ids.push_back(static_cast<int32_t>((seed * 31 + i * 7) % 512));
        packet.positions.push_back(i);
    }
    const std::size_t elements =
        static_cast<std::size_t>(model.num_layers * model.num_kv_heads * length * model.head_dim);
    std::mt19937 random(seed);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    for (auto* tensor : {&packet.keys, &packet.values}) {
        tensor->resize(elements * kv::cache_dtype_size(model.dtype));
        for (std::size_t i = 0; i < elements; ++i) {
            const float value = normal(random);
            if (model.dtype == kv::CacheDtype::f32) {
                std::memcpy(tensor->data() + 4 * i, &value, 4);
            } else {
                // Any 16-bit pattern that is not NaN or infinite is a valid bf16 or f16 value.
                uint16_t bits = static_cast<uint16_t>(random());
                if (model.dtype == kv::CacheDtype::bf16 && (bits & 0x7f80) == 0x7f80)
                    bits ^= 0x4000;
                if (model.dtype == kv::CacheDtype::f16 && (bits & 0x7c00) == 0x7c00) bits ^= 0x4000;
                std::memcpy(tensor->data() + 2 * i, &bits, 2);
            }
        }
    }
    return packet;
}

inline void write_store(const std::filesystem::path& path, const kv::CacheModelInfo& model,
                        const std::vector<kv::Packet>& packets,
                        kv::CacheWriteOptions options = {}) {
    kv::CacheWriter writer(path, model, test_provenance(), options);
    for (const kv::Packet& packet : packets)
        writer.add(packet);
    writer.finish();
}

/// The keys and values read_planes() hands out, laid end to end in the order received:
/// [layers, kv_heads, S, head_dim] each, as Packet holds them.
inline std::pair<std::vector<std::byte>, std::vector<std::byte>> read_all_planes(
    const CacheReader& reader, const std::string& id) {
    std::pair<std::vector<std::byte>, std::vector<std::byte>> planes;
    int64_t expected = 0;  // (layer, head) in order, keys first
    const int64_t per_tensor = reader.model().num_layers * reader.model().num_kv_heads;
    const auto row_bytes =
        static_cast<std::size_t>(reader.model().head_dim) * cache_dtype_size(reader.model().dtype);
    const int64_t tokens = reader.packet_info(id).stored_length;
    int64_t next_token = 0;  // pieces come in token order within a plane
    reader.read_planes(id, [&](int64_t layer, int64_t head, bool keys, int64_t first,
                               std::span<const std::byte> rows) {
        REQUIRE(layer * reader.model().num_kv_heads + head + (keys ? 0 : per_tensor) == expected);
        REQUIRE(first == next_token);
        next_token += static_cast<int64_t>(rows.size() / row_bytes);
        if (next_token == tokens) next_token = 0, ++expected;
        auto& target = keys ? planes.first : planes.second;
        target.insert(target.end(), rows.begin(), rows.end());
    });
    REQUIRE(expected == (tokens > 0 ? 2 * per_tensor : 0));
    return planes;
}

}  // namespace kv::test
