// Quantised storage against a float64 reference: every value within half a step of its group,
// 4-bit codes packed two per byte, the residual
// window exact, and the file round trip equal to dequantising in memory.
#include "cache_fixtures.hpp"
#include "kv/float_convert.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/format/quantize.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>

using namespace kv;

namespace {

std::vector<std::byte> random_f32(std::size_t count, uint64_t seed, double scale = 1.0) {
    std::mt19937_64 generator(seed);
    std::normal_distribution<double> normal(0.0, scale);
    std::vector<std::byte> bytes(count * 4);
    for (std::size_t i = 0; i < count; ++i) {
        const float x = static_cast<float>(normal(generator));
        std::memcpy(bytes.data() + 4 * i, &x, 4);
    }
    return bytes;
}

float value_of(const std::vector<std::byte>& bytes, std::size_t i) {
    float x;
    std::memcpy(&x, bytes.data() + 4 * i, 4);
    return x;
}

}  // namespace

TEST_CASE("quantised values stay within half a step of the original", "[quantize]") {
    const int64_t planes = 3, slots = 20, dim = 16;
    for (const int bits : {8, 4}) {
        DYNAMIC_SECTION(bits << " bits") {
            Quantization q;
            q.bits = bits;
            q.group_size = 8;
            q.residual_tokens = 5;
            const auto data = random_f32(static_cast<std::size_t>(planes * slots * dim), 1, 3.0);
            const QuantizedTensor tensor =
                quantize_tensor(data.data(), CacheDtype::f32, planes, slots, dim, q);
            CHECK(tensor.quantized_slots == 15);
            CHECK(tensor.codes.size() == static_cast<std::size_t>(planes * 15 * dim * bits / 8));
            const auto back = dequantize_tensor(tensor, CacheDtype::f32, planes, slots, dim, q);
            const double levels = (1 << bits) - 1;
            for (int64_t plane = 0; plane < planes; ++plane)
                for (int64_t slot = 0; slot < slots; ++slot)
                    for (int64_t g = 0; g < dim / 8; ++g) {
                        double low = 1e300, high = -1e300;
                        const std::size_t row =
                            static_cast<std::size_t>((plane * slots + slot) * dim);
                        for (int64_t i = g * 8; i < g * 8 + 8; ++i) {
                            low = std::min<double>(low, value_of(data, row + i));
                            high = std::max<double>(high, value_of(data, row + i));
                        }
                        // Half a step (and float32 rounding); the residual window is exact.
                        const double step = (high - low) / levels;
                        const double bound =
                            slot < 15 ? step / 2 + (std::abs(low) + std::abs(high)) * 1e-6 : 0.0;
                        for (int64_t i = g * 8; i < g * 8 + 8; ++i) {
                            INFO("plane " << plane << " slot " << slot << " dim " << i);
                            CHECK(std::abs(static_cast<double>(value_of(back, row + i)) -
                                           static_cast<double>(value_of(data, row + i))) <= bound);
                        }
                    }
        }
    }
}

TEST_CASE("4-bit codes pack the even value in the low nibble", "[quantize]") {
    Quantization q;
    q.bits = 4;
    q.group_size = 4;
    std::vector<std::byte> data(4 * 4);
    const float values[4] = {0.0f, 15.0f, 5.0f, 10.0f};  // offset 0, scale 1: codes 0 15 5 10
    std::memcpy(data.data(), values, sizeof values);
    const QuantizedTensor tensor = quantize_tensor(data.data(), CacheDtype::f32, 1, 1, 4, q);
    REQUIRE(tensor.codes.size() == 2);
    CHECK(tensor.codes[0] == 0xF0);
    CHECK(tensor.codes[1] == 0xA5);
    const auto back = dequantize_tensor(tensor, CacheDtype::f32, 1, 1, 4, q);
    for (int i = 0; i < 4; ++i)
        CHECK(value_of(back, static_cast<std::size_t>(i)) == values[i]);
}

TEST_CASE("a constant group and an empty residual are exact", "[quantize]") {
    Quantization q;
    q.bits = 8;
    q.group_size = 4;
    std::vector<std::byte> data(4 * 4);
    const float values[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    std::memcpy(data.data(), values, sizeof values);
    const auto back = dequantize_tensor(quantize_tensor(data.data(), CacheDtype::f32, 1, 1, 4, q),
                                        CacheDtype::f32, 1, 1, 4, q);
    CHECK(back == data);
}

TEST_CASE("quantised packets round-trip through the file, dequantised on read", "[quantize]") {
    test::TempDir dir;
    for (const CacheDtype dtype : {CacheDtype::f32, CacheDtype::bf16}) {
        const CacheModelInfo model = test::test_model(dtype);
        // Normal values (make_packet's bf16 ones are arbitrary bit patterns, up to 1e38).
        Packet packet = test::make_packet(test::test_model(), "q", 40, 5);
        if (dtype == CacheDtype::bf16)
            for (auto* tensor : {&packet.keys, &packet.values}) {
                std::vector<std::byte> half(tensor->size() / 2);
                for (std::size_t i = 0; i < half.size() / 2; ++i)
                    store_float(half.data(), CacheDtype::bf16, i,
                                load_float(tensor->data(), CacheDtype::f32, i));
                *tensor = half;
            }
        packet.quantization.bits = 4;
        packet.quantization.group_size = 4;
        packet.quantization.residual_tokens = 8;
        const auto path = dir.path() / (std::string(cache_dtype_name(dtype)) + ".kvc");
        {
            CacheWriter writer(path, model, test::test_provenance());
            writer.add(packet);
            writer.add(test::make_packet(model, "plain", 7, 6));
            writer.finish();
        }
        const CacheReader reader(path);
        CHECK(reader.format_version() == "1.7");  // 1.3 for quantised packets; tensor_layout
        CHECK(reader.quantization("q") == packet.quantization);
        CHECK_FALSE(reader.quantization("plain").enabled());
        const Packet back = reader.read("q");
        const int64_t planes = model.num_layers * model.num_kv_heads;
        const auto expected =
            dequantize_tensor(quantize_tensor(packet.keys.data(), dtype, planes, 40, model.head_dim,
                                              packet.quantization),
                              dtype, planes, 40, model.head_dim, packet.quantization);
        CHECK(back.keys == expected);
        CHECK(back.quantization == packet.quantization);
        // Plane by plane: dequantised the same.
        const auto [keys, values] = test::read_all_planes(reader, "q");
        CHECK(keys == back.keys);
        CHECK(values == back.values);
        // Written again (kvindex, merge), the dequantised values quantise to themselves.
        const auto path2 = dir.path() / (std::string(cache_dtype_name(dtype)) + "-again.kvc");
        {
            CacheWriter writer(path2, model, test::test_provenance());
            writer.add(back);
            writer.finish();
        }
        CHECK(CacheReader(path2).read("q").keys == back.keys);
    }
}
