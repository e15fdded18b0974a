#include "kv/sampler.hpp"

#include "kv/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

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

int32_t Sampler::sample(std::span<const float> logits) {
    if (options_.temperature == 0.0) return argmax(logits);
    const float max_logit = logits[static_cast<std::size_t>(argmax(logits))];
    candidates_.clear();
    double total = 0.0;
    for (std::size_t i = 0; i < logits.size(); ++i) {
        const double weight = std::exp((logits[i] - max_logit) / options_.temperature);
        candidates_.emplace_back(static_cast<float>(weight), static_cast<int32_t>(i));
        total += weight;
    }
    std::sort(candidates_.begin(), candidates_.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    // The nucleus: the fewest most likely tokens whose mass reaches top_p.
    double kept = 0.0;
    std::size_t nucleus = 0;
    while (nucleus < candidates_.size()) {
        kept += candidates_[nucleus].first;
        ++nucleus;
        if (kept >= options_.top_p * total) break;
    }
    double target = next_uniform() * kept;
    for (std::size_t i = 0; i < nucleus; ++i) {
        target -= candidates_[i].first;
        if (target < 0) return candidates_[i].second;
    }
    return candidates_[nucleus - 1].second;
}

}  // namespace kv
