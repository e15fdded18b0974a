#include "kv/sampler.hpp"

#include "kv/error.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <random>
#include <utility>

namespace kv {

int32_t argmax(std::span<const float> values) {
    if (values.empty()) throw Error("argmax of an empty vector");
    std::size_t best = 0;
    for (std::size_t i = 1; i < values.size(); ++i)
        if (values[i] > values[best]) best = i;
    return static_cast<int32_t>(best);
}

Sampler::Sampler(const SamplerOptions& options)
    : options_(options),
      seed_(options.seed ? *options.seed : std::random_device{}()),
      state_(seed_) {
    if (!(options.temperature >= 0) || !std::isfinite(options.temperature))
        throw UsageError("temperature must be a finite number >= 0");
    // Named as kvserve-once's option: its range check (closed ranges) lets 0 through.
    if (!(options.top_p > 0 && options.top_p <= 1)) {
        char value[32];
        std::snprintf(value, sizeof value, "%g", options.top_p);
        throw UsageError(std::string("top-p (--top-p) must be in (0, 1], not ") + value);
    }
}

double Sampler::next_uniform() {
    // splitmix64: tiny, fast, and the same sequence on every platform for a given seed.
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
}

namespace {

// Keys in ascending order, a byte at a time from the lowest (LSD radix), passing over the
// bytes every key shares (a vocabulary's indexes leave the top ones empty).
void sort_keys(std::vector<uint64_t>& keys, std::vector<uint64_t>& scratch) {
    std::array<std::array<uint32_t, 256>, 8> counts{};
    for (uint64_t key : keys)
        for (int digit = 0; digit < 8; ++digit)
            ++counts[static_cast<std::size_t>(digit)][(key >> (8 * digit)) & 0xff];
    scratch.resize(keys.size());
    for (int digit = 0; digit < 8; ++digit) {
        std::array<uint32_t, 256>& next = counts[static_cast<std::size_t>(digit)];
        if (keys.empty() || next[(keys.front() >> (8 * digit)) & 0xff] == keys.size()) continue;
        uint32_t offset = 0;
        for (uint32_t& slot : next)
            offset += std::exchange(slot, offset);
        for (uint64_t key : keys)
            scratch[next[(key >> (8 * digit)) & 0xff]++] = key;
        keys.swap(scratch);
    }
}

// A weight's key: its bits inverted above the token's index. Weights are >= 0 (exponentials),
// whose bits order as their values, so ascending keys are descending weights, ties by token.
uint64_t candidate_key(float weight, std::size_t token) {
    return uint64_t{~std::bit_cast<uint32_t>(weight)} << 32 | static_cast<uint32_t>(token);
}
float weight_of(uint64_t key) {
    return std::bit_cast<float>(~static_cast<uint32_t>(key >> 32));
}
int32_t token_of(uint64_t key) {
    return static_cast<int32_t>(static_cast<uint32_t>(key));
}

}  // namespace

int32_t Sampler::sample(std::span<const float> logits) {
    if (options_.temperature == 0.0) return argmax(logits);
    const float max_logit = logits[static_cast<std::size_t>(argmax(logits))];
    candidates_.clear();
    double total = 0.0;
    for (std::size_t i = 0; i < logits.size(); ++i) {
        const double weight = std::exp((logits[i] - max_logit) / options_.temperature);
        candidates_.push_back(candidate_key(static_cast<float>(weight), i));
        total += weight;
    }
    sort_keys(candidates_, scratch_);
    // The nucleus: the fewest most likely tokens whose mass reaches top_p.
    double kept = 0.0;
    std::size_t nucleus = 0;
    while (nucleus < candidates_.size()) {
        kept += weight_of(candidates_[nucleus]);
        ++nucleus;
        if (kept >= options_.top_p * total) break;
    }
    double target = next_uniform() * kept;
    for (std::size_t i = 0; i < nucleus; ++i) {
        target -= weight_of(candidates_[i]);
        if (target < 0) return token_of(candidates_[i]);
    }
    return token_of(candidates_[nucleus - 1]);
}

}  // namespace kv
