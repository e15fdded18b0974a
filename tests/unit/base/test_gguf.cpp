// The GGUF reader: every metadata type in versions 2 and 3, alignment and the data offset, the
// decoder's config from the metadata, and hostile files, each a typed error with a message.
#include "kv/error.hpp"
#include "kv/gguf.hpp"

#include "gguf_writer.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <numbers>

using namespace kv;
using kv::test::GgufBytes;
using kv::test::GgufWriter;

namespace {

GgufFile parse(const std::string& bytes) {
    return GgufFile::parse(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size(),
                           "test.gguf");
}

// The metadata of a small llama-architecture model, as llama.cpp's converter writes it.
GgufWriter llama_metadata(const std::string& architecture = "llama", uint32_t heads = 4,
                          uint32_t rope_dims = 16) {
    GgufWriter writer;
    const std::string p = architecture + ".";
    writer.string("general.architecture", architecture)
        .u32(p + "context_length", 2048)
        .u32(p + "embedding_length", 64)
        .u32(p + "block_count", 2)
        .u32(p + "feed_forward_length", 160)
        .u32(p + "attention.head_count", heads)
        .u32(p + "attention.head_count_kv", 2)
        .f32(p + "attention.layer_norm_rms_epsilon", 1e-5f)
        .f32(p + "rope.freq_base", 500000.0f)
        .u32(p + "rope.dimension_count", rope_dims)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2);
    return writer;
}

std::string zeros(std::size_t bytes) {
    return std::string(bytes, '\0');
}

void check_error_mentions(const std::string& bytes, const std::string& fragment) {
    try {
        parse(bytes);
        FAIL("no error for a file that should mention " << fragment);
    } catch (const kv::Error& error) {
        INFO(error.what());
        CHECK(std::string(error.what()).find(fragment) != std::string::npos);
        CHECK(std::string(error.what()).find("'test.gguf'") != std::string::npos);
    }
}

}  // namespace

TEST_CASE("GGUF metadata of every type reads back, in versions 2 and 3", "[gguf]") {
    for (uint32_t version : {2u, 3u}) {
        DYNAMIC_SECTION("version " << version) {
            GgufWriter writer(version);
            writer.u32("a.u32", 4000000000u)
                .i32("a.i32", -7)
                .u64("a.u64", uint64_t{1} << 40)
                .f32("a.f32", 1e-5f)
                .f64("a.f64", 0.25)
                .boolean("a.bool", true)
                .string("a.string", "h\xC3\xA9llo")
                .strings("a.strings", {"x", "", "yz"})
                .f32s("a.f32s", {1.5f, -2.0f})
                .i32s("a.i32s", {3, -4, 5});
            const GgufFile file = parse(writer.bytes());
            CHECK(file.version() == version);
            CHECK(file.integer("a.u32") == 4000000000);
            CHECK(file.integer("a.i32") == -7);
            CHECK(file.integer("a.u64") == (int64_t{1} << 40));
            // A float32 keeps the decimal it was written from, as config.json holds it.
            CHECK(file.number("a.f32") == 1e-5);
            CHECK(file.number("a.f64") == 0.25);
            CHECK(file.number("a.i32") == -7.0);
            CHECK(file.boolean("a.bool") == true);
            CHECK(file.string("a.string") == "h\xC3\xA9llo");
            REQUIRE(file.strings("a.strings"));
            CHECK(*file.strings("a.strings") == std::vector<std::string>{"x", "", "yz"});
            CHECK(*file.numbers("a.f32s") == std::vector<double>{1.5, -2.0});
            CHECK(*file.integers("a.i32s") == std::vector<int64_t>{3, -4, 5});
            CHECK_FALSE(file.integer("absent"));
            CHECK(file.strings("absent") == nullptr);
            CHECK_THROWS_WITH(file.integer("a.string"),
                              "'test.gguf': metadata 'a.string' is string, not an integer");
            CHECK_THROWS_AS(file.strings("a.i32s"), FormatError);
            CHECK_THROWS_AS(file.boolean("a.u32"), FormatError);
            CHECK(file.tensors().empty());
        }
    }
}

TEST_CASE("GGUF tensors lie at aligned offsets after the metadata", "[gguf]") {
    for (uint32_t alignment : {1u, 32u, 64u}) {
        DYNAMIC_SECTION("alignment " << alignment) {
            GgufWriter writer;
            if (alignment != 32) writer.alignment(alignment);
            writer.string("general.name", "x");
            writer.tensor("a", {2, 3}, ggml_type::f32, test::float_bytes({1, 2, 3, 4, 5, 6}));
            writer.tensor("b", {5}, ggml_type::f16, zeros(10));
            writer.tensor("c", {1, 64}, ggml_type::q8_0, zeros(68));
            const std::string bytes = writer.bytes();
            const GgufFile file = parse(bytes);
            CHECK(file.alignment() == alignment);
            CHECK(file.data_offset() % alignment == 0);
            REQUIRE(file.tensors().size() == 3);
            const GgufTensorInfo& a = *file.find_tensor("a");
            CHECK(a.dims == std::vector<int64_t>{3, 2});
            CHECK(a.shape() == std::vector<int64_t>{2, 3});
            CHECK(a.size == 24);
            CHECK(a.offset == 0);
            float values[6];
            std::memcpy(values, file.tensor_data(a), sizeof values);
            CHECK(values[5] == 6.0f);
            CHECK(file.find_tensor("b")->size == 10);
            CHECK(file.find_tensor("c")->size == 68);
            CHECK(file.find_tensor("c")->offset % alignment == 0);
            CHECK(ggml_type_name(file.find_tensor("c")->type) == "Q8_0");
            CHECK(file.find_tensor("d") == nullptr);
        }
    }
}

TEST_CASE("Q8_0 blocks dequantise as scale times int8", "[gguf]") {
    std::string block;
    const uint16_t half = 0x3800;  // 0.5 in IEEE half precision
    block.append(reinterpret_cast<const char*>(&half), 2);
    for (int i = 0; i < 32; ++i)
        block.push_back(static_cast<char>(i - 16));
    std::vector<float> out(32);
    dequantize_q8_0(reinterpret_cast<const std::byte*>(block.data()), 32, out.data());
    for (int i = 0; i < 32; ++i)
        CHECK(out[static_cast<std::size_t>(i)] == 0.5f * static_cast<float>(i - 16));
}

TEST_CASE("a truncated GGUF file is an error at every length, never a crash", "[gguf]") {
    GgufWriter writer = llama_metadata();
    writer.strings("tokenizer.ggml.tokens", {"a", "b", "c"});
    writer.tensor("token_embd.weight", {3, 64}, ggml_type::f32, zeros(3 * 64 * 4));
    const std::string bytes = writer.bytes();
    REQUIRE_NOTHROW(parse(bytes));
    for (std::size_t length = 0; length < bytes.size(); ++length) {
        INFO("first " << length << " bytes");
        CHECK_THROWS_AS(parse(bytes.substr(0, length)), kv::Error);
    }
}

TEST_CASE("hostile GGUF headers are refused with a message that says why", "[gguf]") {
    auto header = [](uint32_t version, uint64_t tensors, uint64_t metadata) {
        GgufBytes out;
        out.bytes = "GGUF";
        out.u32(version).u64(tensors).u64(metadata);
        return out;
    };
    check_error_mentions("GGML\x03\0\0\0", "is not a GGUF file");
    check_error_mentions("", "is not a GGUF file");
    check_error_mentions(header(1, 0, 0).bytes, "version 1 is not supported");
    check_error_mentions(header(0x03000000, 0, 0).bytes, "big-endian");
    check_error_mentions(header(7, 0, 0).bytes, "version 7 is not supported");
    check_error_mentions(header(3, uint64_t{1} << 62, 0).bytes, "tensor count");
    check_error_mentions(header(3, 0, ~uint64_t{0}).bytes, "metadata count");

    GgufBytes long_key = header(3, 0, 1);
    long_key.u64(uint64_t{1} << 60);
    long_key.bytes += std::string(16, '\0');
    check_error_mentions(long_key.bytes, "claims 1152921504606846976 bytes");

    GgufBytes huge_array = header(3, 0, 1);
    huge_array.string("k").u32(9).u32(8).u64(uint64_t{1} << 61);
    check_error_mentions(huge_array.bytes, "metadata 'k''s element count");

    GgufBytes unknown_value = header(3, 0, 1);
    unknown_value.string("k").u32(13).u32(0);
    check_error_mentions(unknown_value.bytes, "unknown value type 13");

    GgufBytes deep = header(3, 0, 1);
    deep.string("k");
    for (int i = 0; i < 5; ++i)
        deep.u32(9).u32(9).u64(1);
    deep.bytes += std::string(64, '\0');
    check_error_mentions(deep.bytes, "nests arrays");

    GgufWriter twice;
    twice.u32("k", 1).u32("k", 2);
    check_error_mentions(twice.bytes(), "metadata key 'k' appears twice");

    GgufWriter bad_alignment;
    bad_alignment.u32("general.alignment", 24);
    check_error_mentions(bad_alignment.bytes(), "not a power of two");
    GgufWriter zero_alignment;
    zero_alignment.u32("general.alignment", 0);
    check_error_mentions(zero_alignment.bytes(), "not a power of two");
    GgufWriter string_alignment;
    string_alignment.string("general.alignment", "32");
    check_error_mentions(string_alignment.bytes(), "'general.alignment' is a string");
}

TEST_CASE("hostile GGUF tensor infos are refused with a message that says why", "[gguf]") {
    // One tensor info written by hand after an empty metadata section.
    auto file_with = [](const std::string& name, std::vector<uint64_t> dims, uint32_t type,
                        uint64_t offset, std::size_t data_bytes) {
        GgufBytes out;
        out.bytes = "GGUF";
        out.u32(3).u64(1).u64(0);
        out.string(name).u32(static_cast<uint32_t>(dims.size()));
        for (uint64_t extent : dims)
            out.u64(extent);
        out.u32(type).u64(offset);
        out.bytes.resize((out.bytes.size() + 31) / 32 * 32, '\0');
        out.bytes += std::string(data_bytes, '\0');
        return out.bytes;
    };
    REQUIRE_NOTHROW(parse(file_with("t", {4, 2}, ggml_type::f32, 0, 32)));
    check_error_mentions(file_with("t", {4, 2}, ggml_type::f32, 0, 31), "extends past the end");
    check_error_mentions(file_with("t", {4, 2}, ggml_type::f32, 64, 64), "extends past the end");
    check_error_mentions(file_with("t", {4, 2}, ggml_type::f32, ~uint64_t{0} - 31, 32),
                         "extends past the end");
    check_error_mentions(file_with("t", {4, 2}, ggml_type::f32, 8, 64), "not a multiple of");
    check_error_mentions(file_with("t", {4, 2}, 200, 0, 64), "unknown ggml type 200");
    check_error_mentions(file_with("t", {4, 2}, 4, 0, 64), "unknown ggml type 4");
    check_error_mentions(file_with("t", {1, 1, 1, 1, 1}, ggml_type::f32, 0, 64), "5 dimensions");
    check_error_mentions(
        file_with("t", {uint64_t{1} << 40, uint64_t{1} << 40}, ggml_type::f32, 0, 64),
        "more elements than kvtools can count");
    check_error_mentions(file_with("t", {uint64_t{1} << 62}, ggml_type::f32, 0, 64),
                         "is too large");
    check_error_mentions(file_with("t", {uint64_t{1} << 63}, ggml_type::f32, 0, 64),
                         "more elements than kvtools can count");
    check_error_mentions(file_with("t", {33}, ggml_type::q8_0, 0, 64),
                         "not a multiple of its block of 32");
    CHECK_THROWS_AS(parse(file_with("t", {4}, 200, 0, 64)), UnsupportedError);

    GgufWriter overlapping;
    overlapping.tensor("a", {8}, ggml_type::f32, zeros(32))
        .tensor("b", {8}, ggml_type::f32, zeros(32));
    std::string bytes = overlapping.bytes();
    // b's offset (32) rewritten to 0: both tensors claim the same bytes.
    const std::size_t b_offset = bytes.find(std::string("\x01\0\0\0\0\0\0\0b", 9));
    REQUIRE(b_offset != std::string::npos);
    const std::size_t offset_field = b_offset + 9 + 4 + 8 + 4;
    REQUIRE(bytes[offset_field] == 32);
    bytes[offset_field] = 0;
    check_error_mentions(bytes, "tensors 'a' and 'b' overlap");

    GgufWriter duplicate;
    duplicate.tensor("a", {8}, ggml_type::f32, zeros(32))
        .tensor("a", {8}, ggml_type::f32, zeros(32));
    check_error_mentions(duplicate.bytes(), "tensor 'a' appears twice");
}

TEST_CASE("a llama-architecture GGUF file gives the decoder's config", "[gguf]") {
    GgufWriter writer = llama_metadata();
    writer.tensor("token_embd.weight", {300, 64}, ggml_type::bf16, zeros(300 * 64 * 2));
    const ModelConfig config = gguf_model_config(parse(writer.bytes()));
    CHECK(config.architecture == "LlamaForCausalLM");
    CHECK(config.vocab_size == 300);
    CHECK(config.hidden_size == 64);
    CHECK(config.intermediate_size == 160);
    CHECK(config.num_layers == 2);
    CHECK(config.num_heads == 4);
    CHECK(config.num_kv_heads == 2);
    CHECK(config.head_dim == 16);
    CHECK(config.max_position_embeddings == 2048);
    CHECK(config.rms_norm_eps == 1e-5);
    CHECK(config.rope_theta == 500000.0);
    CHECK(config.rope_layout == RopeLayout::half_split);
    CHECK(config.rope_scaling.type == RopeScalingType::none);
    CHECK(config.tie_word_embeddings);
    CHECK_FALSE(config.attention_bias);
    CHECK_FALSE(config.qk_norm);
    CHECK(config.bos_token_id == 1);
    CHECK(config.eos_token_id == 2);
    CHECK(config.weights_dtype == "bf16");
}

TEST_CASE("qwen2 and qwen3 GGUF files give their flags, and Llama 3 RoPE factors are recognised",
          "[gguf]") {
    for (const std::string architecture : {"qwen2", "qwen3"}) {
        GgufWriter writer = llama_metadata(architecture, 4, 32);
        writer.u32(architecture + ".attention.key_length", 32);
        writer.tensor("token_embd.weight", {300, 64}, ggml_type::q8_0, zeros(300 * 2 * 34));
        writer.tensor("output.weight", {300, 64}, ggml_type::f16, zeros(300 * 64 * 2));
        const ModelConfig config = gguf_model_config(parse(writer.bytes()));
        CHECK(config.architecture ==
              (architecture == "qwen2" ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM"));
        CHECK(config.attention_bias == (architecture == "qwen2"));
        CHECK(config.qk_norm == (architecture == "qwen3"));
        CHECK(config.head_dim == 32);
        CHECK_FALSE(config.tie_word_embeddings);
        CHECK(config.weights_dtype == "f32");  // Q8_0 is dequantised to float32
    }

    // Llama 3.1's factors as convert_hf_to_gguf.py computes them (factor 8, low 1, high 4,
    // 8192 original positions) for head_dim 16 and theta 500000.
    std::vector<float> factors;
    for (int i = 0; i < 8; ++i) {
        const double frequency = 1.0 / std::pow(500000.0, 2.0 * i / 16.0);
        const double wavelength = 2 * std::numbers::pi / frequency;
        double factor;
        if (wavelength < 8192.0 / 4.0)
            factor = 1.0;
        else if (wavelength > 8192.0)
            factor = 8.0;
        else {
            const double smooth = (8192.0 / wavelength - 1.0) / 3.0;
            factor = 1.0 / ((1 - smooth) / 8.0 + smooth);
        }
        factors.push_back(static_cast<float>(factor));
    }
    GgufWriter llama3 = llama_metadata();
    llama3.tensor("token_embd.weight", {300, 64}, ggml_type::f32, zeros(300 * 64 * 4));
    llama3.tensor("rope_freqs.weight", {8}, ggml_type::f32, test::float_bytes(factors));
    const ModelConfig config = gguf_model_config(parse(llama3.bytes()));
    CHECK(config.rope_scaling.type == RopeScalingType::llama3);
    CHECK(config.rope_scaling.factor == Approx(8.0));
    CHECK(config.rope_scaling.original_max_position_embeddings == 8192);

    factors[3] *= 1.5f;
    GgufWriter other = llama_metadata();
    other.tensor("token_embd.weight", {300, 64}, ggml_type::f32, zeros(300 * 64 * 4));
    other.tensor("rope_freqs.weight", {8}, ggml_type::f32, test::float_bytes(factors));
    CHECK_THROWS_AS(gguf_model_config(parse(other.bytes())), UnsupportedError);
}

TEST_CASE("GGUF configs kvtools cannot run are refused by name", "[gguf]") {
    auto config_error = [](GgufWriter writer) -> std::string {
        writer.tensor("token_embd.weight", {300, 64}, ggml_type::f32, zeros(300 * 64 * 4));
        try {
            gguf_model_config(parse(writer.bytes()));
        } catch (const kv::Error& error) {
            return error.what();
        }
        return "no error";
    };
    CHECK(config_error(llama_metadata("gemma")) ==
          "'test.gguf': GGUF architecture 'gemma' is not supported (supported: llama, which "
          "includes Mistral, qwen2, qwen3)");
    CHECK(config_error(llama_metadata().u32("llama.expert_count", 8)) ==
          "'test.gguf': mixtures of experts ('llama.expert_count' 8) are not supported");
    CHECK(config_error(llama_metadata("llama", 4, 8)) ==
          "'test.gguf': partial RoPE ('llama.rope.dimension_count' 8 of 16 dimensions per head) "
          "is not supported");
    CHECK(config_error(llama_metadata().string("llama.rope.scaling.type", "yarn")) ==
          "'test.gguf': rope scaling 'yarn' is not supported (supported: linear, and Llama 3's "
          "rope_freqs.weight)");
    GgufWriter no_layers;
    no_layers.string("general.architecture", "llama");
    CHECK(config_error(no_layers) == "'test.gguf': missing metadata 'llama.embedding_length'");
    CHECK(config_error(llama_metadata("llama", 0)) ==
          "'test.gguf': 'llama.attention.head_count' must be positive");
}
