// GGUF model files (llama.cpp's): the metadata gives the config (gguf_model_config in kvbase),
// the tensors are renamed to Hugging Face's names and shapes, so that the one decoder computes a
// GGUF file exactly as it computes the folder it was converted from.
//
// F32, F16 and BF16 tensors view the memory-mapped file; Q8_0 tensors are dequantised to
// float32 at load (ggml's rule: scale times int8), every other ggml type is refused by name.
// llama.cpp's converter permutes the rows of q and k (weights and biases) of llama-architecture
// models for its interleaved RoPE (convert_hf_to_gguf.py, LlamaModel.permute); they are put back
// in Hugging Face's order here, so that the half-split RoPE gives the folder's numbers bit for bit.
#include "kv/error.hpp"
#include "kv/gguf.hpp"
#include "kv/model/model.hpp"

#include <charconv>
#include <cstring>

namespace kv {
namespace {

// GGUF's per-layer tensor names and Hugging Face's.
constexpr std::pair<std::string_view, std::string_view> layer_names[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
};

constexpr std::pair<std::string_view, std::string_view> model_names[] = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
};

// The Hugging Face name of a GGUF tensor, or "" for one the decoder has no use for.
std::string hf_name(std::string_view name, int64_t layers) {
    for (const auto& [gguf, hf] : model_names)
        if (name == gguf) return std::string(hf);
    if (!name.starts_with("blk.")) return "";
    name.remove_prefix(4);
    const std::size_t dot = name.find('.');
    if (dot == std::string_view::npos || dot == 0) return "";
    int64_t layer = -1;
    const auto [end, error] = std::from_chars(name.data(), name.data() + dot, layer);
    if (error != std::errc() || end != name.data() + dot || layer < 0 || layer >= layers) return "";
    const std::string_view suffix = name.substr(dot + 1);
    for (const auto& [gguf, hf] : layer_names)
        if (suffix == gguf) return "model.layers." + std::to_string(layer) + "." + std::string(hf);
    return "";
}

// Undoes convert_hf_to_gguf.py's permute(w, n_head): each head's rows [2, D/2] (the halves
// Hugging Face's RoPE rotates together) were written as [D/2, 2] (llama.cpp's pairs).
torch::Tensor unpermute(const torch::Tensor& tensor, int64_t heads, const std::string& source,
                        const std::string& name) {
    std::vector<int64_t> sizes = tensor.sizes().vec();
    if (sizes.empty() || sizes[0] % (2 * heads) != 0)
        throw FormatError(source + ": tensor '" + name + "' has " +
                          std::to_string(sizes.empty() ? 0 : sizes[0]) + " rows, not " +
                          std::to_string(heads) + " heads of an even size");
    std::vector<int64_t> split = {heads, sizes[0] / heads / 2, 2};
    split.insert(split.end(), sizes.begin() + 1, sizes.end());
    return tensor.reshape(split).transpose(1, 2).reshape(sizes).contiguous();
}

}  // namespace

LoadedWeights load_gguf_model(const std::filesystem::path& path) {
    const GgufFile file = GgufFile::open(path);
    const std::string& source = file.source();
    LoadedWeights result;
    result.config = gguf_model_config(file);
    result.source = source;
    result.chat_template = file.string("tokenizer.chat_template").value_or("");
    const ModelConfig& config = result.config;
    const bool permuted = file.string("general.architecture") == "llama";

    // Every tensor is checked before any is read, so that a file is refused before its load.
    std::vector<std::pair<const GgufTensorInfo*, std::string>> used;
    for (const GgufTensorInfo& tensor : file.tensors()) {
        if (tensor.name == "rope_freqs.weight") continue;  // read into the config's RoPE scaling
        std::string name = hf_name(tensor.name, config.num_layers);
        if (name.empty())
            throw UnsupportedError(source + ": tensor '" + tensor.name +
                                   "' is not one of a Llama, Mistral or Qwen decoder's");
        const uint32_t type = tensor.type;
        if (type != ggml_type::f32 && type != ggml_type::f16 && type != ggml_type::bf16 &&
            type != ggml_type::q8_0)
            throw UnsupportedError(source + ": tensor '" + tensor.name + "' has type " +
                                   ggml_type_name(type) +
                                   " (supported: F32, F16, BF16, and Q8_0 dequantised to F32 at "
                                   "load)");
        used.emplace_back(&tensor, std::move(name));
    }

    const std::shared_ptr<const MappedFile>& mapping = file.mapping();
    for (const auto& [tensor, name] : used) {
        const std::vector<int64_t> shape = tensor->shape();
        const std::byte* bytes = file.tensor_data(*tensor);
        torch::Tensor value;
        if (tensor->type == ggml_type::q8_0) {
            value = torch::empty(shape, torch::kFloat32);
            dequantize_q8_0(bytes, static_cast<std::size_t>(tensor->elements()),
                            value.data_ptr<float>());
        } else {
            const torch::ScalarType dtype = tensor->type == ggml_type::f32   ? torch::kFloat32
                                            : tensor->type == ggml_type::f16 ? torch::kFloat16
                                                                             : torch::kBFloat16;
            const auto options = torch::TensorOptions().dtype(dtype);
            // The deleter keeps the mapping alive while a tensor views it. An alignment below
            // the element's size could leave a tensor unaligned: that one is copied.
            value = torch::from_blob(
                const_cast<std::byte*>(bytes), shape, [mapping](void*) {}, options);
            if (reinterpret_cast<std::uintptr_t>(bytes) % value.element_size() != 0) {
                torch::Tensor aligned = torch::empty(shape, options);
                std::memcpy(aligned.data_ptr(), bytes, static_cast<std::size_t>(tensor->size));
                value = aligned;
            }
        }
        if (permuted &&
            (name.ends_with("self_attn.q_proj.weight") || name.ends_with("self_attn.q_proj.bias")))
            value = unpermute(value, config.num_heads, source, tensor->name);
        else if (permuted && (name.ends_with("self_attn.k_proj.weight") ||
                              name.ends_with("self_attn.k_proj.bias")))
            value = unpermute(value, config.num_kv_heads, source, tensor->name);
        result.weights[name] = value;
    }
    return result;
}

}  // namespace kv
