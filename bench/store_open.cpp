// Times what serving a few packets of a large store costs: opening it, finding each packet by
// id, and reading it (tensors included), as JSON on stdout.
//   kv_bench_store_open [--whole-directory] FILE ID...
// --whole-directory reads the packet index whole first (packets()), as a reader that does not
// use /packet_ids (formats/kvcache.md 6.1) must, to compare the two ways in one build.
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
    int first = 1;
    const bool whole = argc > 1 && std::strcmp(argv[1], "--whole-directory") == 0;
    if (whole) ++first;
    if (argc - first < 2) {
        std::fprintf(stderr, "usage: kv_bench_store_open [--whole-directory] FILE ID...\n");
        return 2;
    }
    try {
        const auto start = Clock::now();
        const kv::CacheReader reader(argv[first]);
        if (whole) reader.packets();
        const double open_seconds = since(start);
        double find_seconds = 0, read_seconds = 0;
        std::size_t bytes = 0;
        for (int i = first + 1; i < argc; ++i) {
            auto at = Clock::now();
            const kv::PacketInfo& info = reader.packet_info(argv[i]);
            find_seconds += since(at);
            at = Clock::now();
            const kv::Packet packet = reader.read(info.id);
            read_seconds += since(at);
            bytes += packet.keys.size() + packet.values.size();
        }
        std::printf(
            "{\"packets\": %d, \"bytes\": %zu, \"open_seconds\": %.6f, \"find_seconds\": %.6f, "
            "\"read_seconds\": %.6f, \"seconds\": %.6f}\n",
            argc - first - 1, bytes, open_seconds, find_seconds, read_seconds, since(start));
        return 0;
    } catch (const std::exception& error) {
        std::fprintf(stderr, "kv_bench_store_open: error: %s\n", error.what());
        return 1;
    }
}
