// Times reading packets from a cache file: every packet, or one named packet, as JSON on stdout.
//   kv_bench_cache_load FILE [ID] [--threads N] [--into 1 --repeats R]
// and writes a file of one packet of random keys and values of a model's shape to read:
//   kv_bench_cache_load --write FILE --layers L --kv-heads H --head-dim D --tokens S
//       [--dtype bf16] [--zstd-level 3] [--chunk-tokens T (0: the format's default)]
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_writer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

namespace {

// Keys and values of a layer's shape: normal-looking values (the sum of four uniform ones) with
// a scale per channel, as real keys have, so that they compress as real ones do.
void fill(std::vector<std::byte>& out, kv::CacheDtype dtype, int64_t count, int64_t head_dim,
          uint64_t seed) {
    out.resize(static_cast<std::size_t>(count) * kv::cache_dtype_size(dtype));
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    auto next = [&] {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        return static_cast<float>(state >> 40) / static_cast<float>(1 << 24);
    };
    for (int64_t i = 0; i < count; ++i) {
        const float scale = 0.25f + static_cast<float>((i % head_dim) % 7);
        const float value = (next() + next() + next() + next() - 2.0f) * scale;
        uint32_t bits = 0;
        std::memcpy(&bits, &value, 4);
        if (dtype == kv::CacheDtype::f32) {
            std::memcpy(out.data() + 4 * i, &bits, 4);
        } else {  // bf16 (f16 is not offered)
            const auto high = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
            std::memcpy(out.data() + 2 * i, &high, 2);
        }
    }
}

int write(std::map<std::string, std::string> options, const std::string& path) {
    auto number = [&](const char* name, int64_t fallback) {
        const auto found = options.find(name);
        return found == options.end() ? fallback : std::stoll(found->second);
    };
    kv::CacheModelInfo model;
    model.model_fingerprint = std::string(64, '0');
    model.architecture = "LlamaForCausalLM";
    model.num_layers = number("--layers", 16);
    model.num_kv_heads = number("--kv-heads", 8);
    model.head_dim = number("--head-dim", 64);
    model.rope_layout = "half_split";
    model.rope_theta = 500000;
    model.tokenizer_fingerprint = std::string(64, '0');
    model.dtype = kv::parse_cache_dtype(options.count("--dtype") ? options["--dtype"] : "bf16");
    const int64_t tokens = number("--tokens", 32768);
    kv::CacheWriteOptions write_options;
    write_options.zstd_level = static_cast<int>(number("--zstd-level", 3));
    write_options.chunk_tokens = number("--chunk-tokens", 0);
    kv::CacheWriter writer(path, model, {"kv_bench_cache_load", "1", "kv_bench_cache_load", ""},
                           write_options);
    kv::Packet packet;
    packet.id = "context";
    packet.text_sha256 = std::string(64, '0');
    packet.logical_length = tokens;
    for (int64_t i = 0; i < tokens; ++i) {
        packet.token_ids.push_back(static_cast<int32_t>(i % 32000));
        packet.positions.push_back(i);
    }
    const int64_t count = model.num_layers * model.num_kv_heads * tokens * model.head_dim;
    fill(packet.keys, model.dtype, count, model.head_dim, 1);
    fill(packet.values, model.dtype, count, model.head_dim, 2);
    writer.add(packet);
    writer.finish();
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> positional;
    std::map<std::string, std::string> options;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg.rfind("--", 0) == 0 && i + 1 < argc)
            options[arg] = argv[++i];
        else
            positional.push_back(arg);
    }
    if (positional.empty() == !options.count("--write") || positional.size() > 2) {
        std::fprintf(stderr,
                     "usage: kv_bench_cache_load FILE [ID] [--threads N]\n"
                     "       kv_bench_cache_load --write FILE --layers L --kv-heads H "
                     "--head-dim D --tokens S [--dtype bf16|f32] [--zstd-level N] "
                     "[--chunk-tokens T]\n");
        return 2;
    }
    try {
        if (options.count("--write")) return write(options, options["--write"]);
        const auto start = std::chrono::steady_clock::now();
        kv::CacheReader reader(positional[0]);
        if (options.count("--threads")) reader.set_threads(std::stoi(options["--threads"]));
        const double open_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::size_t bytes = 0, packets = 0;
        // --into: straight into tensors already in memory, as a decoder's cache is (the first
        // touch of fresh memory, which costs more than the read on some virtual machines, is
        // left out), read --repeats times; each time's seconds are listed.
        const bool into = options.count("--into") && options["--into"] == "1";
        std::vector<double> times;
        std::vector<std::byte> keys, values;
        auto read = [&](const std::string& id) {
            if (!into) {
                const kv::Packet packet = reader.read(id);
                bytes += packet.keys.size() + packet.values.size();
                ++packets;
                return;
            }
            const kv::PacketInfo& info = reader.packet_info(id);
            const kv::CacheModelInfo& m = reader.model();
            keys.resize(static_cast<std::size_t>(m.num_layers * m.num_kv_heads *
                                                 info.stored_length * m.head_dim) *
                        kv::cache_dtype_size(m.dtype));
            values.resize(keys.size());
            for (int repeat = 0; repeat < std::stoi(options["--repeats"]); ++repeat) {
                const auto begin = std::chrono::steady_clock::now();
                reader.read_into(id, keys, values);
                times.push_back(
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - begin)
                        .count());
            }
            bytes += keys.size() + values.size();
            ++packets;
        };
        if (!options.count("--repeats")) options["--repeats"] = "1";
        if (positional.size() == 2)
            read(positional[1]);
        else
            for (const kv::PacketInfo& info : reader.packets())
                read(info.id);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (into) {
            std::string list;
            for (double time : times)
                list += (list.empty() ? "" : ", ") + std::to_string(time);
            std::vector<double> sorted = times;
            std::sort(sorted.begin(), sorted.end());
            const double median = sorted.empty() ? 0 : sorted[sorted.size() / 2];
            std::printf(
                "{\"packets\": %zu, \"bytes\": %zu, \"into\": true, \"seconds\": [%s], "
                "\"median_seconds\": %.6f, \"gb_per_second\": %.4f}\n",
                packets, bytes, list.c_str(), median, bytes / median / 1e9);
            return 0;
        }
        std::printf(
            "{\"packets\": %zu, \"bytes\": %zu, \"open_seconds\": %.6f, \"seconds\": %.6f, "
            "\"gb_per_second\": %.4f}\n",
            packets, bytes, open_seconds, seconds, bytes / seconds / 1e9);
        return 0;
    } catch (const std::exception& error) {
        std::fprintf(stderr, "kv_bench_cache_load: error: %s\n", error.what());
        return 1;
    }
}
