// llama2.c checkpoints: a header, then every float32 tensor in a fixed order.
//
// Legacy (v0): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len); a
// negative vocab_size means the classifier is not shared with the embedding. Tensors follow the
// header, grouped by kind across layers, then two unused RoPE tables, then the classifier if any.
// v1: magic "ak42" (0x616b3432), int32 version 1, the same 7 int32, a shared-classifier byte,
// zero padding to 256 bytes; tensor order puts the norms first. RoPE pairs are interleaved.
#include "kv/error.hpp"
#include "kv/mapped_file.hpp"
#include "kv/model/model.hpp"

#include <cstring>

namespace kv {
namespace {

constexpr std::uint32_t versioned_magic = 0x616b3432;
constexpr int64_t max_reasonable_dim = int64_t{1} << 20;

int32_t read_i32(const std::byte* at) {
    int32_t value;
    std::memcpy(&value, at, sizeof value);
    return value;
}

}  // namespace

LoadedWeights load_llama2c_checkpoint(const std::filesystem::path& path) {
    auto file = MappedFile::open(path);
    const std::string source = quoted(path.string());
    const std::byte* bytes = file->data();
    const std::size_t size = file->size();
    if (size < 28)
        throw FormatError(source + " is not a llama2.c checkpoint: only " + std::to_string(size) +
                          " bytes");

    std::uint32_t magic;
    std::memcpy(&magic, bytes, sizeof magic);
    const bool versioned = magic == versioned_magic;
    int version = 0;
    std::size_t header_size = 28;
    const std::byte* params = bytes;
    bool shared_classifier = true;
    if (versioned) {
        if (size < 256) throw FormatError(source + ": llama2.c v1 header is truncated");
        version = read_i32(bytes + 4);
        if (version != 1)
            throw UnsupportedError(source + ": llama2.c checkpoint version " +
                                   std::to_string(version) +
                                   " is not supported (supported: legacy v0 and v1)");
        params = bytes + 8;
        shared_classifier = static_cast<std::uint8_t>(bytes[36]) != 0;
        header_size = 256;
    }

    ModelConfig config;
    config.architecture = "llama2.c";
    config.hidden_size = read_i32(params);
    config.intermediate_size = read_i32(params + 4);
    config.num_layers = read_i32(params + 8);
    config.num_heads = read_i32(params + 12);
    config.num_kv_heads = read_i32(params + 16);
    int64_t vocab = read_i32(params + 20);
    config.max_position_embeddings = read_i32(params + 24);
    if (!versioned) {
        shared_classifier = vocab > 0;
        vocab = vocab < 0 ? -vocab : vocab;
    }
    config.vocab_size = vocab;
    config.rope_layout = RopeLayout::interleaved;
    config.rope_theta = 10000.0;
    config.rms_norm_eps = 1e-5;
    config.tie_word_embeddings = shared_classifier;
    config.weights_dtype = "f32";
    config.bos_token_id = 1;
    config.eos_token_id = 2;

    for (int64_t value :
         {config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
          config.num_kv_heads, config.vocab_size, config.max_position_embeddings})
        if (value <= 0 || value > max_reasonable_dim)
            throw FormatError(source + " is not a llama2.c checkpoint: implausible header value " +
                              std::to_string(value));
    if (config.hidden_size % config.num_heads != 0)
        throw FormatError(source + ": dim " + std::to_string(config.hidden_size) +
                          " is not a multiple of n_heads " + std::to_string(config.num_heads));
    config.head_dim = config.hidden_size / config.num_heads;
    validate_config(config, source);

    const int64_t dim = config.hidden_size, hidden = config.intermediate_size,
                  layers = config.num_layers;
    const int64_t kv_dim = config.kv_dim();
    const int64_t rope_table = config.max_position_embeddings * config.head_dim / 2;

    // Offsets (in floats) of each kind's block, in file order.
    struct Block {
        const char* name;
        std::vector<int64_t> shape;  // per layer, or whole for the singletons
        bool per_layer;
    };
    std::vector<Block> order;
    const Block attention_norm{"input_layernorm.weight", {dim}, true};
    const Block mlp_norm{"post_attention_layernorm.weight", {dim}, true};
    const Block final_norm{"model.norm.weight", {dim}, false};
    const Block embedding{"model.embed_tokens.weight", {config.vocab_size, dim}, false};
    const Block wq{"self_attn.q_proj.weight", {dim, dim}, true};
    const Block wk{"self_attn.k_proj.weight", {kv_dim, dim}, true};
    const Block wv{"self_attn.v_proj.weight", {kv_dim, dim}, true};
    const Block wo{"self_attn.o_proj.weight", {dim, dim}, true};
    const Block w1{"mlp.gate_proj.weight", {hidden, dim}, true};
    const Block w2{"mlp.down_proj.weight", {dim, hidden}, true};
    const Block w3{"mlp.up_proj.weight", {hidden, dim}, true};
    const Block rope_real{"", {rope_table}, false};
    const Block rope_imaginary{"", {rope_table}, false};
    const Block classifier{"lm_head.weight", {config.vocab_size, dim}, false};
    if (versioned)
        order = {attention_norm, mlp_norm, final_norm, embedding, wq, wk, wv, wo, w1, w2, w3};
    else
        order = {embedding, attention_norm, wq, wk, wv, wo, mlp_norm, w1, w2, w3, final_norm,
                 rope_real, rope_imaginary};
    if (!shared_classifier) order.push_back(classifier);

    std::size_t expected = header_size;
    for (const Block& block : order) {
        int64_t count = 1;
        for (int64_t extent : block.shape)
            count *= extent;
        expected +=
            static_cast<std::size_t>(count * (block.per_layer ? layers : 1)) * sizeof(float);
    }
    if (size != expected)
        throw FormatError(source + ": llama2.c checkpoint is " + std::to_string(size) +
                          " bytes but its header (dim " + std::to_string(dim) + ", " +
                          std::to_string(layers) + " layers, vocab " +
                          std::to_string(config.vocab_size) + ") needs " +
                          std::to_string(expected) + ": truncated or corrupt");

    LoadedWeights result;
    result.config = config;
    result.source = source;
    std::size_t offset = header_size;
    auto view = [&](std::size_t at, const std::vector<int64_t>& shape) {
        // The deleter keeps the mapping alive for as long as any tensor views it.
        return torch::from_blob(
            const_cast<std::byte*>(bytes + at), shape, [file](void*) {},
            torch::TensorOptions().dtype(torch::kFloat32));
    };
    for (const Block& block : order) {
        int64_t count = 1;
        for (int64_t extent : block.shape)
            count *= extent;
        const std::size_t block_bytes = static_cast<std::size_t>(count) * sizeof(float);
        if (block.per_layer) {
            for (int64_t layer = 0; layer < layers; ++layer) {
                result.weights["model.layers." + std::to_string(layer) + "." + block.name] =
                    view(offset, block.shape);
                offset += block_bytes;
            }
        } else {
            if (block.name[0] != '\0') result.weights[block.name] = view(offset, block.shape);
            offset += block_bytes;
        }
    }
    return result;
}

}  // namespace kv
