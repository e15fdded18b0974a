// Picking the next token from logits: greedy at temperature 0, else temperature and nucleus
// (top-p) sampling from a seeded generator, so that a run is reproducible from its seed.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace kv {

struct SamplerOptions {
    double temperature = 0.8;  ///< 0: greedy (argmax, first index on ties)
    double top_p = 0.95;       ///< keep the smallest set of tokens whose probability reaches top_p
    std::optional<uint64_t> seed;  ///< none: drawn from the system (Sampler::seed() tells)
};

class Sampler {
  public:
    explicit Sampler(const SamplerOptions& options);
    int32_t sample(std::span<const float> logits);
    /// The seed in use: the options' or the one drawn.
    uint64_t seed() const { return seed_; }

  private:
    double next_uniform();  // [0, 1)

    SamplerOptions options_;
    uint64_t seed_;
    uint64_t state_;
    // Each token as one key, the bits of its weight inverted above its index: ascending keys
    // are the tokens from the most likely down, ties by index (a sort of the vocabulary's
    // (weight, token) pairs was ~16 ms of a 1B model's token, 128k pairs).
    std::vector<uint64_t> candidates_, scratch_;
};

/// Index of the largest value, the first one on ties (as llama2.c's argmax).
int32_t argmax(std::span<const float> values);

}  // namespace kv
