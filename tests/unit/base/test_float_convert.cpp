#include "kv/float_convert.hpp"

#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

// libtorch's conversions are the reference: a key converted here must round as the runtime does.

TEST_CASE("f16 to float matches libtorch for every half value", "[float_convert]") {
    std::vector<uint16_t> all(65536);
    for (uint32_t i = 0; i < all.size(); ++i)
        all[i] = static_cast<uint16_t>(i);
    const torch::Tensor expected =
        torch::from_blob(all.data(), {65536}, torch::kHalf).to(torch::kFloat32).contiguous();
    const float* reference = expected.data_ptr<float>();
    for (uint32_t i = 0; i < all.size(); ++i) {
        const float got = kv::f16_to_float(all[i]);
        if (std::isnan(reference[i]))
            REQUIRE(std::isnan(got));
        else
            REQUIRE(got == reference[i]);
    }
}

TEST_CASE("float to f16 rounds as libtorch does", "[float_convert]") {
    std::vector<float> values = {0.0f,      -0.0f,  1.0f,     65504.0f, 65519.99f,     65520.0f,
                                 1e9f,      -1e9f,  5.96e-8f, 2.98e-8f, 2.9802322e-8f, 6.1e-5f,
                                 6.104e-5f, 1e-40f, INFINITY, -INFINITY};
    std::mt19937 random(7);
    std::uniform_int_distribution<uint32_t> any_bits;
    for (int i = 0; i < 200000; ++i) {
        uint32_t bits = any_bits(random);
        if ((bits & 0x7f800000u) == 0x7f800000u) continue;  // NaN payloads differ by design
        // Most random floats are far outside half's range: fold half of them into it.
        if (i % 2) bits = (bits & 0x807fffffu) | ((100u + bits % 45u) << 23);
        float value;
        std::memcpy(&value, &bits, 4);
        values.push_back(value);
    }
    // Exact ties between neighbouring halves, normal and subnormal.
    for (uint32_t half = 0; half < 0x7bff; half += 37)
        values.push_back(0.5f * (kv::f16_to_float(static_cast<uint16_t>(half)) +
                                 kv::f16_to_float(static_cast<uint16_t>(half + 1))));
    const torch::Tensor expected =
        torch::tensor(values).to(torch::kHalf).view(torch::kInt16).contiguous();
    const int16_t* reference = expected.data_ptr<int16_t>();
    for (std::size_t i = 0; i < values.size(); ++i) {
        INFO("value " << values[i]);
        REQUIRE(kv::float_to_f16(values[i]) == static_cast<uint16_t>(reference[i]));
    }
    REQUIRE(std::isnan(kv::f16_to_float(kv::float_to_f16(NAN))));
}
