// Writes one long synthetic packet for a model, for timing decode against context length
// without prefilling it (bench/bench-decode-context drives it):
//
//   kv_bench_context_cache --like SMALL.kvc --tokens N -o OUT.kvc [--seed 1]
//
// SMALL.kvc is any store kvbake wrote for the model: its model description (fingerprints,
// shapes, RoPE) is copied, so the tools accept OUT.kvc for that model. Keys have the structure
// real ones have (a few hundred shared directions that runs of neighbouring tokens share, a
// handful of large channels, varying norms), drawn per (layer, kv-head) and rotated by the
// model's RoPE at their position; values are N(0, 1). Stored uncompressed.
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/rope.hpp"

#include "kv/float_convert.hpp"

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    std::string like, output;
    int64_t tokens = 0;
    uint64_t seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string name = argv[i], value = argv[i + 1];
        if (name == "--like")
            like = value;
        else if (name == "--tokens")
            tokens = std::atoll(value.c_str());
        else if (name == "-o")
            output = value;
        else if (name == "--seed")
            seed = std::strtoull(value.c_str(), nullptr, 10);
        else {
            std::fprintf(stderr, "kv_bench_context_cache: unknown option %s\n", name.c_str());
            return 2;
        }
    }
    if (like.empty() || output.empty() || tokens <= 0) {
        std::fprintf(stderr, "usage: kv_bench_context_cache --like SMALL.kvc --tokens N -o OUT\n");
        return 2;
    }
    try {
        const kv::CacheReader reader(like);
        const kv::CacheModelInfo& model = reader.model();
        const kv::Packet sample = reader.read(reader.packets().front().id);
        const kv::RopeSettings rope = kv::rope_settings(model);
        const int64_t dim = model.head_dim, heads = model.num_layers * model.num_kv_heads;
        const std::size_t element = kv::cache_dtype_size(model.dtype);

        kv::Packet packet;
        packet.id = "context";
        packet.text_sha256 = std::string(64, '0');
        packet.logical_length = tokens;
        for (int64_t t = 0; t < tokens; ++t) {
            packet.token_ids.push_back(
                sample.token_ids[static_cast<std::size_t>(t) % sample.token_ids.size()]);
            packet.positions.push_back(t);
        }
        const std::size_t per_head = static_cast<std::size_t>(tokens * dim);
        packet.keys.resize(per_head * static_cast<std::size_t>(heads) * element);
        packet.values.resize(packet.keys.size());

        std::mt19937_64 rng(seed);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::uniform_real_distribution<float> unit(0.0f, 1.0f);
        const int64_t meanings = 512;
        std::vector<float> centres(static_cast<std::size_t>(meanings * dim)), key(dim);
        for (int64_t head = 0; head < heads; ++head) {
            std::vector<float> channel_scale(static_cast<std::size_t>(dim), 1.0f);
            for (int c = 0; c < 4; ++c)
                channel_scale[rng() % static_cast<uint64_t>(dim)] = 6.0f;
            for (std::size_t i = 0; i < centres.size(); ++i)
                centres[i] = normal(rng) * channel_scale[i % static_cast<std::size_t>(dim)];
            std::byte* keys =
                packet.keys.data() + static_cast<std::size_t>(head) * per_head * element;
            std::byte* values =
                packet.values.data() + static_cast<std::size_t>(head) * per_head * element;
            int64_t meaning = 0;
            for (int64_t t = 0; t < tokens; ++t) {
                if (unit(rng) < 0.3f) meaning = static_cast<int64_t>(rng() % meanings);
                const float scale = 0.5f + unit(rng);
                for (int64_t d = 0; d < dim; ++d) {
                    const std::size_t at = static_cast<std::size_t>(t * dim + d);
                    kv::store_float(keys, model.dtype, at,
                                    scale * centres[static_cast<std::size_t>(meaning * dim + d)] +
                                        0.8f * normal(rng));
                    kv::store_float(values, model.dtype, at, normal(rng));
                }
                kv::rotate_keys(keys + static_cast<std::size_t>(t * dim) * element, model.dtype, 1,
                                rope, t);
            }
        }
        kv::Provenance provenance{"kv_bench_context_cache", KV_VERSION, "kv_bench_context_cache",
                                  ""};
        kv::CacheWriteOptions options;
        options.zstd_level = 0;
        kv::CacheWriter writer(output, model, provenance, options);
        writer.add(packet);
        writer.finish();
    } catch (const std::exception& error) {
        std::fprintf(stderr, "kv_bench_context_cache: %s\n", error.what());
        return 1;
    }
    return 0;
}
