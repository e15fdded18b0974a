// Times reading packets from a cache file: every packet, or one named packet, as JSON on stdout.
//   kv_bench_cache_load FILE [ID]
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"

#include <chrono>
#include <cstdio>

int main(int argc, char** argv) {
    if (argc < 2 || argc > 3) {
        std::fprintf(stderr, "usage: kv_bench_cache_load FILE [ID]\n");
        return 2;
    }
    try {
        const auto start = std::chrono::steady_clock::now();
        const kv::CacheReader reader(argv[1]);
        const double open_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::size_t bytes = 0, packets = 0;
        auto read = [&](const std::string& id) {
            const kv::Packet packet = reader.read(id);
            bytes += packet.keys.size() + packet.values.size();
            ++packets;
        };
        if (argc == 3)
            read(argv[2]);
        else
            for (const kv::PacketInfo& info : reader.packets())
                read(info.id);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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
