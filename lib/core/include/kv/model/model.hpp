// The Llama-family decoder on libtorch: loading (Hugging Face folders, GGUF files, llama2.c
// checkpoints), the forward pass over a KvCache, and the logits.
//
// One implementation serves every supported architecture; ModelConfig's flags select q/k/v
// biases, Qwen3's per-head q/k norm, the RoPE layout and scaling, tied embeddings and GQA.
// Weights are kept in the compute dtype on the compute device; when the file already stores
// that dtype on CPU the tensors view the memory-mapped file directly (no copy).
#pragma once

#include "kv/model/config.hpp"
#include "kv/model/kv_cache.hpp"
#include "kv/model/ops.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kv {

class RowChooser;

/// Sees each layer's queries during a forward pass: kvpress-style compression scores tokens by the
/// attention the prefill's queries give them.
class QueryObserver {
  public:
    virtual ~QueryObserver() = default;
    /// queries [Hq, T, D] after RoPE at `positions` [T]; `keys` [Hkv, S, D] every key of the
    /// layer they may see (the cache's, theirs included) at `key_positions` [S].
    virtual void observe(int64_t layer, const torch::Tensor& queries,
                         const torch::Tensor& positions, const torch::Tensor& keys,
                         const torch::Tensor& key_positions) = 0;
};

struct ModelLoadOptions {
    std::filesystem::path path;  ///< a Hugging Face folder, a GGUF file or a llama2.c checkpoint
    std::string dtype =
        "auto";  ///< "auto" (the model's own; f32 for llama2.c), "f32", "bf16", "f16"
    std::string device = "auto";  ///< "auto" (cuda when available), "cpu", "cuda", "cuda:N"
    /// Use weights in place from the mapped file when their dtype is the compute dtype (instant
    /// load, shared page cache). The default copies them into private memory once: loading takes
    /// longer, but bf16 decoding of a 1B model ran 2x faster that way (bench/bench-runtime).
    bool use_mmap = false;
};

/// Weights by Hugging Face name ("model.layers.0.self_attn.q_proj.weight"), in the stored dtype.
using WeightMap = std::map<std::string, torch::Tensor>;

/// A model as read from disk, before it is placed on a device in a compute dtype.
struct LoadedWeights {
    ModelConfig config;
    WeightMap weights;
    std::string source;  ///< what to name in messages
    /// A GGUF file's tokenizer.chat_template (Jinja), "" where the file has none; a Hugging Face
    /// folder's is in its tokenizer_config.json.
    std::string chat_template;
};

/// Reads a llama2.c checkpoint (legacy v0 header or the versioned v1 header).
LoadedWeights load_llama2c_checkpoint(const std::filesystem::path& path);
/// Reads a Hugging Face folder: config.json and model.safetensors, or the shards listed in
/// model.safetensors.index.json.
LoadedWeights load_hf_folder(const std::filesystem::path& folder);
/// Reads a GGUF file (llama, qwen2, qwen3; F32, F16, BF16 and Q8_0 tensors, Q8_0 dequantised to
/// float32); its weights are renamed and reordered as the Hugging Face folder it was converted
/// from holds them (kv/gguf.hpp).
LoadedWeights load_gguf_model(const std::filesystem::path& path);
/// Dispatches on the path: a folder is Hugging Face, a file starting with GGUF's magic is GGUF,
/// any other file is llama2.c.
LoadedWeights load_weights(const std::filesystem::path& path);
/// The fingerprint of weights as stored (see Model::fingerprint).
std::string fingerprint_weights(const LoadedWeights& loaded);

/// Resolves "auto"/"cpu"/"cuda[:N]"; throws UnsupportedError when CUDA is asked for but absent.
torch::Device resolve_device(const std::string& name);
/// Resolves "auto"/"f32"/"bf16"/"f16" for a model whose weights are stored as `stored`.
torch::ScalarType resolve_dtype(const std::string& name, const std::string& stored,
                                torch::Device device);
/// "f32", "bf16" or "f16".
std::string dtype_name(torch::ScalarType dtype);

class Model {
  public:
    static std::shared_ptr<Model> load(const ModelLoadOptions& options);
    static std::shared_ptr<Model> from_weights(LoadedWeights loaded, torch::ScalarType dtype,
                                               torch::Device device, bool copy_weights = false);

    const ModelConfig& config() const { return config_; }
    torch::ScalarType dtype() const { return dtype_; }
    torch::Device device() const { return device_; }
    const Rope& rope() const { return rope_; }
    const std::string& source() const { return source_; }
    /// The chat template the model file carries (a GGUF file's tokenizer.chat_template), or "".
    const std::string& chat_template() const { return chat_template_; }
    /// Hex SHA-256 over the config, every weight's name, dtype and shape, and the first 64 KiB of
    /// each weight's stored bytes: cheap to compute, and different for a fine-tune of the same
    /// base. Caches record it so that a cache baked with another model is refused.
    const std::string& fingerprint() const { return fingerprint_; }

    /// An empty cache shaped for this model.
    KvCache new_cache(int64_t capacity = 256) const;

    /// Token ids [T] to input embeddings [T, hidden].
    torch::Tensor embed(std::span<const int32_t> tokens) const;

    /// Runs embeddings [T, hidden] at positions [T] through every layer, appending the tokens'
    /// keys and values to `cache`; returns the final-normed hidden states [T, hidden].
    /// `allow` [T, S] (optional, S = cache length + T) further restricts attention.
    /// With `chooser` (sparse decoding), a one-token step lets it choose the rows each kv head
    /// attends to.
    /// With `observer`, every layer's queries are shown to it (compression scores).
    torch::Tensor forward(const torch::Tensor& embeddings, const torch::Tensor& positions,
                          KvCache& cache, const torch::Tensor& allow = {},
                          RowChooser* chooser = nullptr, QueryObserver* observer = nullptr) const;

    /// Per layer, keys (after RoPE) and values [Hkv, S, D] of tokens before a sequence.
    using LayerKeysValues = std::vector<std::pair<torch::Tensor, torch::Tensor>>;

    /// The same computation as forward() over one whole sequence, built only from
    /// differentiable libtorch operations: gradients reach the embeddings (kvtrain's adapters),
    /// `past` and any weight that requires them (the demo model's trainer). `allow` [T, S + T]
    /// (optional) further restricts attention, e.g. block-diagonal for packets. `past` (optional)
    /// holds tokens before the sequence at `past_positions` [S], which every token may see (the
    /// causal rule by position still applies). When `keys_values` is given it receives each
    /// layer's post-RoPE keys and values [Hkv, T, D] of the sequence itself.
    torch::Tensor forward_sequence(const torch::Tensor& embeddings, const torch::Tensor& positions,
                                   const torch::Tensor& allow = {},
                                   LayerKeysValues* keys_values = nullptr,
                                   const LayerKeysValues* past = nullptr,
                                   const torch::Tensor& past_positions = {}) const;

    /// Selective recomputation of a cache assembled from separately baked packets (the
    /// baselines KV Packet is measured against). The stored tokens at `slots` [N] (int64,
    /// increasing), whose vocabulary ids are `tokens`, are recomputed layer by layer with every
    /// stored token of that layer in view (causal by position), their keys and values written
    /// over the stored ones. With `keep_fraction` 1 every slot is recomputed in every layer
    /// (EPIC: the slots are each document's first tokens; all of them: full recompute). Below 1
    /// (CacheBlend), after layer `select_at_layer` the slots are ranked by the squared
    /// deviation of their recomputed keys and values from the stored ones and only the top
    /// ceil(keep_fraction * N) are carried into the later layers. Returns the tokens recomputed
    /// per layer.
    std::vector<int64_t> recompute(KvCache& cache, const torch::Tensor& slots,
                                   std::span<const int32_t> tokens, double keep_fraction = 1.0,
                                   int64_t select_at_layer = 1) const;

    /// The input embedding matrix [vocab, hidden] in the compute dtype.
    const torch::Tensor& input_embeddings() const { return embed_tokens_; }

    /// hidden [T, hidden] to logits [T, vocab] in float32.
    torch::Tensor logits(const torch::Tensor& hidden) const;

    /// Feeds tokens after what the cache holds (positions continue from cache.next_position()), in
    /// chunks of at most `chunk` tokens to bound memory; returns the last token's logits [vocab]
    /// (float32, CPU).
    torch::Tensor prefill(std::span<const int32_t> tokens, KvCache& cache, int64_t chunk = 512,
                          RowChooser* chooser = nullptr, QueryObserver* observer = nullptr) const;

    /// prefill() computed layer by layer instead of chunk by chunk: every token goes through
    /// layer i (in chunks of `chunk` rows, each query chunk reading the keys up to its own)
    /// before any reaches layer i + 1, and `layer_done(i)` runs as soon as layer i's keys and
    /// values are in the cache (pending until the end), so that work on them (an index) can
    /// overlap the later layers. Needs a cache whose positions grow with its slots. Returns the
    /// last token's logits [vocab] (float32, CPU).
    torch::Tensor prefill_by_layer(std::span<const int32_t> tokens, KvCache& cache,
                                   int64_t chunk = 512,
                                   const std::function<void(int64_t layer)>& layer_done = {}) const;

  private:
    struct Layer {
        torch::Tensor attention_norm, q_proj, k_proj, v_proj, o_proj;
        torch::Tensor q_bias, k_bias, v_bias, q_norm, k_norm;
        torch::Tensor mlp_norm, gate_proj, up_proj, down_proj;
    };
    Model(const ModelConfig& config) : config_(config), rope_(config) {}
    struct Projected {
        torch::Tensor queries, keys, values;  // [H, T, D], keys after RoPE
    };
    /// `after_context`: x follows tokens already in a cache (kv::linear says what it changes).
    Projected project(const Layer& layer, const torch::Tensor& x, const torch::Tensor& positions,
                      bool after_context = false) const;
    torch::Tensor attend(const Layer& layer, const torch::Tensor& queries,
                         const torch::Tensor& keys, const torch::Tensor& values,
                         const AttentionMask& mask) const;
    torch::Tensor mlp_block(const Layer& layer, const torch::Tensor& x,
                            bool after_context = false) const;
    torch::Tensor check_embeddings(const torch::Tensor& embeddings) const;

    ModelConfig config_;
    Rope rope_;
    torch::ScalarType dtype_ = torch::kFloat32;
    torch::Device device_ = torch::kCPU;
    std::string source_;
    std::string fingerprint_;
    std::string chat_template_;
    torch::Tensor embed_tokens_, final_norm_, lm_head_;
    std::vector<Layer> layers_;
};

}  // namespace kv
