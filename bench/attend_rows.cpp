// A question's prefill over a cached context, one kernel alone: attend_rows (the scores, the
// softmax and the weighted sums of a kv head's query rows) over --heads distinct kv heads of
// bf16 keys and values, one after another on one thread, as a layer's share of kv heads goes
// through it on one core. Distinct heads, so that their keys and values come from memory as a
// cache's do (one head's 4 MiB at 32k tokens would otherwise stay in the processor's cache).
//
//   kv_bench_attend_rows [--keys 32768] [--tokens 9] [--group 4] [--head-dim 64] [--heads 16]
//                        [--repeats 7] [--seed 1]
//
// The rows are --group query heads times --tokens question tokens, token t seeing the keys of
// the context and of the tokens before it, as in kvserve-once's prefill of a question. Prints
// one JSON object: the median and the fastest time per kv head, the (row, key) pairs per
// second, and a hash of the outputs' bits (the same for two builds that compute the same).
#include "kv/float_convert.hpp"
#include "kv/model/gemv.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    int64_t keys = 32768, tokens = 9, group = 4, dim = 64, heads = 16, repeats = 7;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i += 2) {
        const std::string name = argv[i];
        if (i + 1 >= argc) {
            std::fprintf(stderr, "kv_bench_attend_rows: %s needs a value\n", name.c_str());
            return 2;
        }
        const long long value = std::atoll(argv[i + 1]);
        if (name == "--keys")
            keys = value;
        else if (name == "--tokens")
            tokens = value;
        else if (name == "--group")
            group = value;
        else if (name == "--head-dim")
            dim = value;
        else if (name == "--heads")
            heads = value;
        else if (name == "--repeats")
            repeats = value;
        else if (name == "--seed")
            seed = static_cast<uint64_t>(value);
        else {
            std::fprintf(stderr, "kv_bench_attend_rows: unknown option %s\n", name.c_str());
            return 2;
        }
    }
    if (keys < 1 || tokens < 1 || group < 1 || dim < 1 || heads < 1 || repeats < 1) {
        std::fprintf(stderr, "kv_bench_attend_rows: every count must be at least 1\n");
        return 2;
    }
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t rows = group * tokens, plane = (keys + tokens) * dim;
    // Keys with a spread (a peaked softmax, as real attention is), values of unit scale.
    std::vector<uint16_t> key_planes(static_cast<std::size_t>(heads * plane)),
        value_planes(key_planes.size());
    for (auto& key : key_planes)
        key = kv::float_to_bf16(2.0f * normal(rng));
    for (auto& value : value_planes)
        value = kv::float_to_bf16(normal(rng));
    // Queries exact in bf16, as a bf16 model's are.
    std::vector<float> queries(static_cast<std::size_t>(heads * rows * dim));
    for (auto& query : queries)
        query = kv::bf16_to_float(kv::float_to_bf16(normal(rng)));
    std::vector<int64_t> visible(static_cast<std::size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
        visible[static_cast<std::size_t>(r)] = keys + 1 + r % tokens;
    std::vector<float> out(static_cast<std::size_t>(heads * rows * dim));
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));

    std::vector<double> per_head;
    for (int64_t repeat = 0; repeat < repeats; ++repeat) {
        const auto started = std::chrono::steady_clock::now();
        for (int64_t head = 0; head < heads; ++head)
            kv::attend_rows({key_planes.data() + head * plane, true},
                            {value_planes.data() + head * plane, true},
                            queries.data() + head * rows * dim, rows, visible.data(), dim, scale,
                            out.data() + head * rows * dim);
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
        per_head.push_back(took.count() / static_cast<double>(heads));
    }
    std::sort(per_head.begin(), per_head.end());
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over the outputs' bits
    for (float x : out) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        hash = (hash ^ bits) * 1099511628211ull;
    }
    double pairs = 0;
    for (int64_t seen : visible)
        pairs += static_cast<double>(seen);
    const double median = per_head[per_head.size() / 2];
    std::printf(
        "{\"keys\": %lld, \"tokens\": %lld, \"group\": %lld, \"head_dim\": %lld, \"heads\": %lld, "
        "\"repeats\": %lld, \"isa\": \"%s\", \"median_ms_per_head\": %.4f, "
        "\"fastest_ms_per_head\": %.4f, \"row_key_pairs_per_second\": %.4g, "
        "\"output_hash\": \"%016llx\"}\n",
        static_cast<long long>(keys), static_cast<long long>(tokens), static_cast<long long>(group),
        static_cast<long long>(dim), static_cast<long long>(heads), static_cast<long long>(repeats),
        kv::gemv_isa(), median * 1e3, per_head.front() * 1e3, pairs / median,
        static_cast<unsigned long long>(hash));
    return 0;
}
