#include "kv/sampler.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

namespace {

// The sampler as first written (a sort of (weight, token) pairs): the radix order must pick
// the same tokens from the same draws.
class ReferenceSampler {
  public:
    ReferenceSampler(double temperature, double top_p, uint64_t seed)
        : temperature_(temperature), top_p_(top_p), state_(seed) {}

    int32_t sample(const std::vector<float>& logits) {
        const float max_logit = logits[static_cast<std::size_t>(kv::argmax(logits))];
        std::vector<std::pair<float, int32_t>> candidates;
        double total = 0.0;
        for (std::size_t i = 0; i < logits.size(); ++i) {
            const double weight = std::exp((logits[i] - max_logit) / temperature_);
            candidates.emplace_back(static_cast<float>(weight), static_cast<int32_t>(i));
            total += weight;
        }
        std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        double kept = 0.0;
        std::size_t nucleus = 0;
        while (nucleus < candidates.size()) {
            kept += candidates[nucleus].first;
            ++nucleus;
            if (kept >= top_p_ * total) break;
        }
        double target = next_uniform() * kept;
        for (std::size_t i = 0; i < nucleus; ++i) {
            target -= candidates[i].first;
            if (target < 0) return candidates[i].second;
        }
        return candidates[nucleus - 1].second;
    }

  private:
    double next_uniform() {
        uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        return static_cast<double>(z >> 11) * 0x1.0p-53;
    }
    double temperature_, top_p_;
    uint64_t state_;
};

}  // namespace

TEST_CASE("Sampler: the tokens of a sort of (weight, token) pairs, from the same draws",
          "[sampler]") {
    // Vocabularies around the radix's byte boundaries and of real size; logits flat and
    // peaked, with ties (rounded to a coarse grid: equal weights go by token) and tokens
    // masked to -inf (weight 0). The real sizes (the reference sorts 128k pairs a draw) at
    // fewer settings.
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t vocab :
         {std::size_t{1}, std::size_t{2}, std::size_t{255}, std::size_t{256}, std::size_t{257},
          std::size_t{1000}, std::size_t{70000}, std::size_t{128256}}) {
        const bool large = vocab > 1000;
        const std::vector<float> spreads =
            large ? std::vector<float>{0.1f, 30.0f} : std::vector<float>{0.1f, 3.0f, 30.0f};
        const std::vector<double> temperatures =
            large ? std::vector<double>{0.8} : std::vector<double>{0.5, 0.8, 1.5};
        const std::vector<double> top_ps =
            large ? std::vector<double>{0.95, 1.0} : std::vector<double>{0.3, 0.95, 1.0};
        const int draws = large ? 4 : 12;
        for (float spread : spreads) {
            for (bool ties : {false, true}) {
                std::vector<float> logits(vocab);
                for (float& logit : logits) {
                    logit = spread * normal(rng);
                    if (ties) logit = std::round(logit * 2.0f) / 2.0f;
                }
                if (ties && vocab > 2) logits[vocab / 2] = -std::numeric_limits<float>::infinity();
                for (double temperature : temperatures) {
                    for (double top_p : top_ps) {
                        CAPTURE(vocab, spread, ties, temperature, top_p);
                        const uint64_t seed = rng();
                        kv::Sampler sampler({temperature, top_p, seed});
                        ReferenceSampler reference(temperature, top_p, seed);
                        std::vector<int32_t> got, want;
                        for (int draw = 0; draw < draws; ++draw) {
                            got.push_back(sampler.sample(logits));
                            want.push_back(reference.sample(logits));
                        }
                        CHECK(got == want);
                    }
                }
            }
        }
    }
}

TEST_CASE("Sampler: greedy at temperature 0, the first index on ties", "[sampler]") {
    kv::Sampler sampler({0.0, 0.95, 1});
    const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
    CHECK(sampler.sample(logits) == 1);
}

TEST_CASE("Sampler: a nucleus of one token when it holds top_p alone", "[sampler]") {
    // Token 3's weight is 1 and every other's below e^-40: at top_p 0.5 only token 3 remains.
    std::vector<float> logits(1000, -40.0f);
    logits[3] = 0.0f;
    kv::Sampler sampler({1.0, 0.5, 11});
    for (int draw = 0; draw < 50; ++draw)
        CHECK(sampler.sample(logits) == 3);
}
