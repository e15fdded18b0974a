#include "kv/model/model.hpp"
#include "kv/model/row_attention.hpp"
#include "kv/model/row_chooser.hpp"
#include "kv/model/weight_arena.hpp"

#include "kv/error.hpp"
#include "kv/gguf.hpp"
#include "kv/sha256.hpp"

#include <torch/cuda.h>

#include <chrono>
#include <cmath>

namespace kv {
namespace {

std::string shape_text(at::IntArrayRef shape) {
    std::string text = "[";
    for (std::size_t i = 0; i < shape.size(); ++i)
        text += (i ? ", " : "") + std::to_string(shape[i]);
    return text + "]";
}

// Takes a named weight out of the map, checks its shape, and places it on the device in the
// compute dtype (a no-op, hence no copy, when it is already there).
class WeightPlacer {
  public:
    WeightPlacer(WeightMap& weights, const std::string& source, torch::ScalarType dtype,
                 torch::Device device, bool copy)
        : weights_(weights), source_(source), dtype_(dtype), device_(device), copy_(copy) {}

    torch::Tensor take(const std::string& name, std::vector<int64_t> shape) {
        auto found = weights_.find(name);
        if (found == weights_.end()) throw FormatError(source_ + ": missing tensor '" + name + "'");
        torch::Tensor tensor = found->second;
        weights_.erase(found);
        if (tensor.sizes() != at::IntArrayRef(shape))
            throw FormatError(source_ + ": tensor '" + name + "' has shape " +
                              shape_text(tensor.sizes()) + ", the config needs " +
                              shape_text(shape));
        torch::Tensor placed = tensor.to(device_, dtype_);
        // A no-op conversion still views the mapped file; copy when asked to.
        if (copy_ && placed.data_ptr() == tensor.data_ptr()) placed = placed.clone();
        return placed;
    }

    torch::Tensor take_if_present(const std::string& name, std::vector<int64_t> shape) {
        return weights_.count(name) ? take(name, std::move(shape)) : torch::Tensor();
    }

  private:
    WeightMap& weights_;
    const std::string& source_;
    torch::ScalarType dtype_;
    torch::Device device_;
    bool copy_;
};

}  // namespace

torch::Device resolve_device(const std::string& name) {
    if (name == "auto")
        return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0)
                                           : torch::Device(torch::kCPU);
    if (name == "cpu") return torch::kCPU;
    if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
        if (!torch::cuda::is_available())
            throw UnsupportedError(
                "device '" + name +
                "' is not available: this build of libtorch or this machine has no CUDA");
        int index = 0;
        if (name.size() > 5) {
            try {
                std::size_t used = 0;
                index = std::stoi(name.substr(5), &used);
                if (used != name.size() - 5 || index < 0) throw std::invalid_argument(name);
            } catch (const std::exception&) {
                throw UsageError("invalid device '" + name + "' (expected cpu, cuda or cuda:N)");
            }
        }
        if (index >= static_cast<int>(torch::cuda::device_count()))
            throw UnsupportedError("device '" + name + "' is not available: " +
                                   std::to_string(torch::cuda::device_count()) + " CUDA device(s)");
        return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
    }
    throw UsageError("invalid device '" + name + "' (expected auto, cpu, cuda or cuda:N)");
}

torch::ScalarType resolve_dtype(const std::string& name, const std::string& stored,
                                torch::Device device) {
    std::string chosen = name == "auto" ? stored : name;
    if (chosen == "f32") return torch::kFloat32;
    if (chosen == "bf16") return torch::kBFloat16;
    if (chosen == "f16") {
        if (device.is_cpu()) {
            // libtorch's CPU kernels lack half-precision matrix products; f16 weights are
            // computed in f32 there unless the user insists.
            if (name == "auto") return torch::kFloat32;
            throw UnsupportedError(
                "dtype 'f16' needs a CUDA device; on CPU use --dtype bf16 or f32");
        }
        return torch::kFloat16;
    }
    throw UsageError("invalid dtype '" + name + "' (expected f32, bf16 or f16)");
}

std::string dtype_name(torch::ScalarType dtype) {
    switch (dtype) {
        case torch::kFloat32:
            return "f32";
        case torch::kBFloat16:
            return "bf16";
        case torch::kFloat16:
            return "f16";
        default:
            return std::string(c10::toString(dtype));
    }
}

std::string fingerprint_weights(const LoadedWeights& loaded) {
    const ModelConfig& c = loaded.config;
    Sha256 hash;
    // Everything that changes what the model computes from a token; the RoPE layout is part of it,
    // so the same weights as llama2.c (interleaved) and permuted for HF differ, as they must.
    const std::string description =
        "kvtools-model-fingerprint-v1\n" + c.architecture + "\nvocab " +
        std::to_string(c.vocab_size) + "\nhidden " + std::to_string(c.hidden_size) +
        "\nintermediate " + std::to_string(c.intermediate_size) + "\nlayers " +
        std::to_string(c.num_layers) + "\nheads " + std::to_string(c.num_heads) + "\nkv_heads " +
        std::to_string(c.num_kv_heads) + "\nhead_dim " + std::to_string(c.head_dim) + "\nrope " +
        (c.rope_layout == RopeLayout::interleaved ? "interleaved" : "half_split") + " theta " +
        std::to_string(c.rope_theta) + " scaling " +
        std::to_string(static_cast<int>(c.rope_scaling.type)) + " " +
        std::to_string(c.rope_scaling.factor) + " " +
        std::to_string(c.rope_scaling.low_freq_factor) + " " +
        std::to_string(c.rope_scaling.high_freq_factor) + " " +
        std::to_string(c.rope_scaling.original_max_position_embeddings) + "\nbias " +
        std::to_string(c.attention_bias) + " qk_norm " + std::to_string(c.qk_norm) + " tied " +
        std::to_string(c.tie_word_embeddings) + " window " + std::to_string(c.sliding_window) +
        " eps " + std::to_string(c.rms_norm_eps) + "\n";
    hash.update(description);
    constexpr std::size_t sample_bytes = 64 * 1024;
    for (const auto& [name, tensor] : loaded.weights) {  // std::map: sorted, so order-independent
        std::string line = name + " " + std::string(c10::toString(tensor.scalar_type())) + " " +
                           shape_text(tensor.sizes()) + "\n";
        hash.update(line);
        const torch::Tensor contiguous = tensor.contiguous();
        hash.update(contiguous.data_ptr(),
                    std::min<std::size_t>(contiguous.nbytes(), sample_bytes));
    }
    return hash.hex();
}

LoadedWeights load_weights(const std::filesystem::path& path) {
    std::error_code error;
    const auto status = std::filesystem::status(path, error);
    if (error || !std::filesystem::exists(status))
        throw IoError("cannot open model " + quoted(path.string()) + ": No such file or directory");
    if (std::filesystem::is_directory(status)) return load_hf_folder(path);
    if (is_gguf_file(path)) return load_gguf_model(path);
    return load_llama2c_checkpoint(path);
}

std::shared_ptr<Model> Model::load(const ModelLoadOptions& options) {
    LoadedWeights loaded = load_weights(options.path);
    const torch::Device device = resolve_device(options.device);
    const torch::ScalarType dtype =
        resolve_dtype(options.dtype, loaded.config.weights_dtype, device);
    return from_weights(std::move(loaded), dtype, device, !options.use_mmap);
}

std::shared_ptr<Model> Model::from_weights(LoadedWeights loaded, torch::ScalarType dtype,
                                           torch::Device device, bool copy_weights) {
    const ModelConfig& c = loaded.config;
    validate_config(c, loaded.source);
    std::shared_ptr<Model> model(new Model(c));
    model->fingerprint_ = fingerprint_weights(loaded);
    model->dtype_ = dtype;
    model->device_ = device;
    model->source_ = loaded.source;
    model->chat_template_ = loaded.chat_template;
    // Weights copied out of their files go into one huge-page arena, on every thread; what is
    // left to place is converted to `dtype`, into fresh memory anyway.
    if (copy_weights && device.is_cpu()) {
        copy_weights_to_arena(loaded.weights, dtype);
        copy_weights = false;
    }
    WeightPlacer place(loaded.weights, loaded.source, dtype, device, copy_weights);

    const int64_t hidden = c.hidden_size, q_dim = c.num_heads * c.head_dim, kv_dim = c.kv_dim();
    model->embed_tokens_ = place.take("model.embed_tokens.weight", {c.vocab_size, hidden});
    model->final_norm_ = place.take("model.norm.weight", {hidden});
    model->lm_head_ = c.tie_word_embeddings ? model->embed_tokens_
                                            : place.take("lm_head.weight", {c.vocab_size, hidden});
    for (int64_t i = 0; i < c.num_layers; ++i) {
        const std::string prefix = "model.layers." + std::to_string(i) + ".";
        Layer layer;
        layer.attention_norm = place.take(prefix + "input_layernorm.weight", {hidden});
        layer.q_proj = place.take(prefix + "self_attn.q_proj.weight", {q_dim, hidden});
        layer.k_proj = place.take(prefix + "self_attn.k_proj.weight", {kv_dim, hidden});
        layer.v_proj = place.take(prefix + "self_attn.v_proj.weight", {kv_dim, hidden});
        layer.o_proj = place.take(prefix + "self_attn.o_proj.weight", {hidden, q_dim});
        if (c.attention_bias) {
            layer.q_bias = place.take(prefix + "self_attn.q_proj.bias", {q_dim});
            layer.k_bias = place.take(prefix + "self_attn.k_proj.bias", {kv_dim});
            layer.v_bias = place.take(prefix + "self_attn.v_proj.bias", {kv_dim});
        }
        if (c.qk_norm) {
            layer.q_norm = place.take(prefix + "self_attn.q_norm.weight", {c.head_dim});
            layer.k_norm = place.take(prefix + "self_attn.k_norm.weight", {c.head_dim});
        }
        layer.mlp_norm = place.take(prefix + "post_attention_layernorm.weight", {hidden});
        layer.gate_proj =
            place.take(prefix + "mlp.gate_proj.weight", {c.intermediate_size, hidden});
        layer.up_proj = place.take(prefix + "mlp.up_proj.weight", {c.intermediate_size, hidden});
        layer.down_proj =
            place.take(prefix + "mlp.down_proj.weight", {hidden, c.intermediate_size});
        model->layers_.push_back(std::move(layer));
    }
    return model;
}

KvCache Model::new_cache(int64_t capacity) const {
    return KvCache(config_.num_layers, config_.num_kv_heads, config_.head_dim, dtype_, device_,
                   capacity);
}

torch::Tensor Model::embed(std::span<const int32_t> tokens) const {
    for (int32_t token : tokens)
        if (token < 0 || token >= config_.vocab_size)
            throw Error("token id " + std::to_string(token) + " is outside the vocabulary of " +
                        std::to_string(config_.vocab_size));
    const torch::Tensor ids = torch::from_blob(const_cast<int32_t*>(tokens.data()),
                                               {static_cast<int64_t>(tokens.size())}, torch::kInt32)
                                  .to(device_, torch::kInt64);
    return embed_tokens_.index_select(0, ids);
}

Model::Projected Model::project(const Layer& layer, const torch::Tensor& x,
                                const torch::Tensor& positions, bool after_context) const {
    const int64_t tokens = x.size(0), head_dim = config_.head_dim;
    const torch::Tensor normed = rms_norm(x, layer.attention_norm, config_.rms_norm_eps);
    // [T, H*D] -> [H, T, D]
    auto heads = [&](const torch::Tensor& projected, int64_t count) {
        return projected.view({tokens, count, head_dim}).transpose(0, 1);
    };
    torch::Tensor q =
        heads(kv::linear(normed, layer.q_proj, layer.q_bias, after_context), config_.num_heads);
    torch::Tensor k =
        heads(kv::linear(normed, layer.k_proj, layer.k_bias, after_context), config_.num_kv_heads);
    torch::Tensor v =
        heads(kv::linear(normed, layer.v_proj, layer.v_bias, after_context), config_.num_kv_heads);
    if (config_.qk_norm) {
        q = rms_norm(q, layer.q_norm, config_.rms_norm_eps);
        k = rms_norm(k, layer.k_norm, config_.rms_norm_eps);
    }
    return {rope_.apply(q, positions), rope_.apply(k, positions), v};
}

torch::Tensor Model::attend(const Layer& layer, const torch::Tensor& queries,
                            const torch::Tensor& keys, const torch::Tensor& values,
                            const AttentionMask& mask) const {
    const int64_t tokens = queries.size(1);
    const torch::Tensor attended = attention(
        queries, keys, values, mask, 1.0 / std::sqrt(static_cast<double>(config_.head_dim)));
    return kv::linear(
        attended.transpose(0, 1).reshape({tokens, config_.num_heads * config_.head_dim}),
        layer.o_proj);
}

torch::Tensor Model::mlp_block(const Layer& layer, const torch::Tensor& x,
                               bool after_context) const {
    const torch::Tensor normed = rms_norm(x, layer.mlp_norm, config_.rms_norm_eps);
    return kv::linear(swiglu(kv::linear(normed, layer.gate_proj, {}, after_context),
                             kv::linear(normed, layer.up_proj, {}, after_context)),
                      layer.down_proj, {}, after_context);
}

torch::Tensor Model::check_embeddings(const torch::Tensor& embeddings) const {
    if (embeddings.dim() != 2 || embeddings.size(1) != config_.hidden_size)
        throw Error("forward: embeddings must be [tokens, " + std::to_string(config_.hidden_size) +
                    "]");
    return embeddings.to(device_, dtype_);
}

torch::Tensor Model::forward(const torch::Tensor& embeddings, const torch::Tensor& positions,
                             KvCache& cache, const torch::Tensor& allow, RowChooser* chooser,
                             QueryObserver* observer) const {
    torch::Tensor x = check_embeddings(embeddings);
    const torch::Tensor positions_here = positions.to(device_, torch::kInt64);
    // Tokens after a cached context (a question, the last block of a long prefill) may take the
    // few-token kernel; a document's first block never does (kv::linear says why).
    const bool after_context = cache.length() > 0;
    cache.begin_append(positions_here);
    try {
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            const Layer& layer = layers_[i];
            const int64_t index = static_cast<int64_t>(i);
            const Projected projected = project(layer, x, positions_here, after_context);
            cache.write(index, projected.keys, projected.values);
            if (observer)
                observer->observe(index, projected.queries, positions_here, cache.keys(index),
                                  cache.positions());
            AttentionMask mask{positions_here, cache.positions(), config_.sliding_window, allow,
                               cache.key_valid(index)};
            // One decoding token: attending to the rows a sparse method chose, or, in a dense
            // layer of a cache on disk, to every row read in chunks, never resident as a whole.
            const double scale = 1.0 / std::sqrt(static_cast<double>(config_.head_dim));
            const bool decoding = x.size(0) == 1 && !allow.defined();
            std::vector<std::vector<int64_t>> rows;
            const bool chose =
                chooser && decoding && chooser->select(index, projected.queries, cache, rows);
            const auto attention_start = std::chrono::steady_clock::now();
            torch::Tensor attended;
            if (chose)
                attended =
                    cache.offloaded()
                        ? attention_over_staged_rows(projected.queries, cache, index, rows, scale)
                        : attention_over_rows(projected.queries, cache.keys(index),
                                              cache.values(index), rows, scale);
            else if (cache.offloaded() && decoding && config_.sliding_window == 0 &&
                     !cache.has_padding())
                attended = attention_streamed(projected.queries, cache, index, scale);
            else
                attended = attention(projected.queries, cache.keys(index), cache.values(index),
                                     mask, scale)
                               .transpose(0, 1);
            if (chooser && decoding)
                chooser->attended(index, chose,
                                  std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                                attention_start)
                                      .count());
            x = x + kv::linear(attended.reshape({x.size(0), config_.num_heads * config_.head_dim}),
                               layer.o_proj, {}, after_context);
            x = x + mlp_block(layer, x, after_context);
            // What this layer read of an offloaded cache leaves the process again.
            cache.release_pages(index);
        }
        cache.commit();
        return rms_norm(x, final_norm_, config_.rms_norm_eps);
    } catch (...) {
        cache.rollback();
        throw;
    }
}

torch::Tensor Model::forward_sequence(const torch::Tensor& embeddings,
                                      const torch::Tensor& positions, const torch::Tensor& allow,
                                      LayerKeysValues* keys_values, const LayerKeysValues* past,
                                      const torch::Tensor& past_positions) const {
    torch::Tensor x = check_embeddings(embeddings);
    const torch::Tensor positions_here = positions.to(device_, torch::kInt64);
    if (positions_here.dim() != 1 || positions_here.size(0) != x.size(0))
        throw Error("forward_sequence: positions must be [tokens]");
    torch::Tensor key_positions = positions_here;
    if (past) {
        if (past->size() != layers_.size())
            throw Error("forward_sequence: past holds " + std::to_string(past->size()) +
                        " layers, the model has " + std::to_string(layers_.size()));
        const torch::Tensor before = past_positions.to(device_, torch::kInt64);
        if (before.dim() != 1 || before.size(0) != past->front().first.size(1))
            throw Error("forward_sequence: past positions must be [past tokens]");
        key_positions = torch::cat({before, positions_here});
    }
    const AttentionMask mask{positions_here, key_positions, config_.sliding_window, allow, {}};
    if (keys_values) keys_values->clear();
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        const Layer& layer = layers_[i];
        const Projected projected = project(layer, x, positions_here);
        if (keys_values) keys_values->emplace_back(projected.keys, projected.values);
        torch::Tensor keys = projected.keys, values = projected.values;
        if (past) {
            keys = torch::cat({(*past)[i].first.to(keys.scalar_type()), keys}, 1);
            values = torch::cat({(*past)[i].second.to(values.scalar_type()), values}, 1);
        }
        x = x + attend(layer, projected.queries, keys, values, mask);
        x = x + mlp_block(layer, x);
    }
    return rms_norm(x, final_norm_, config_.rms_norm_eps);
}

namespace {
constexpr int64_t recompute_chunk = 512;
}  // namespace

std::vector<int64_t> Model::recompute(KvCache& cache, const torch::Tensor& slots,
                                      std::span<const int32_t> tokens, double keep_fraction,
                                      int64_t select_at_layer) const {
    torch::NoGradGuard no_grad;
    if (slots.dim() != 1 || slots.size(0) != static_cast<int64_t>(tokens.size()))
        throw Error("recompute: one token id per slot");
    if (!(keep_fraction > 0 && keep_fraction <= 1))
        throw UsageError("the recompute ratio must be in (0, 1]");
    std::vector<int64_t> counts;
    if (tokens.empty()) return std::vector<int64_t>(layers_.size(), 0);
    torch::Tensor chosen = slots.to(device_, torch::kInt64);
    torch::Tensor x = embed(tokens);
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        const Layer& layer = layers_[i];
        const int64_t index = static_cast<int64_t>(i);
        const torch::Tensor positions = cache.positions().index_select(0, chosen);
        const Projected projected = project(layer, x, positions);
        torch::Tensor keys = cache.keys(index), values = cache.values(index);
        const torch::Tensor new_keys = projected.keys.to(keys.scalar_type());
        const torch::Tensor new_values = projected.values.to(values.scalar_type());
        torch::Tensor keep;
        if (keep_fraction < 1 && index == select_at_layer) {
            // CacheBlend: the tokens whose keys and values moved most once they saw the context.
            const torch::Tensor deviation =
                (new_keys.to(torch::kFloat32) - keys.index_select(1, chosen).to(torch::kFloat32))
                    .pow(2)
                    .sum(std::vector<int64_t>{0, 2}) +
                (new_values.to(torch::kFloat32) -
                 values.index_select(1, chosen).to(torch::kFloat32))
                    .pow(2)
                    .sum(std::vector<int64_t>{0, 2});
            const int64_t kept = std::max<int64_t>(
                1, static_cast<int64_t>(
                       std::ceil(keep_fraction * static_cast<double>(chosen.size(0)))));
            keep = std::get<0>(std::get<1>(deviation.topk(kept)).sort());
        }
        // Views of the cache's buffers: the recomputed entries replace the baked ones.
        keys.index_copy_(1, chosen, new_keys);
        values.index_copy_(1, chosen, new_values);
        // Queries in chunks, as prefill() does, so that the scores stay [heads, 512, S]; a
        // chunk reads only the slots up to its last one when positions grow with the slots
        // (a packed context), which the causal rule would mask anyway.
        const torch::Tensor key_positions = cache.positions();
        const bool ordered =
            key_positions.size(0) < 2 || (key_positions.narrow(0, 1, key_positions.size(0) - 1) >
                                          key_positions.narrow(0, 0, key_positions.size(0) - 1))
                                             .all()
                                             .item<bool>();
        const torch::Tensor valid = cache.key_valid(index);
        const torch::Tensor chosen_host = chosen.to(torch::kCPU);
        std::vector<torch::Tensor> attended;
        for (int64_t begin = 0; begin < chosen.size(0); begin += recompute_chunk) {
            const int64_t count = std::min(recompute_chunk, chosen.size(0) - begin);
            const int64_t seen =
                ordered ? chosen_host[begin + count - 1].item<int64_t>() + 1 : keys.size(1);
            const AttentionMask mask{positions.narrow(0, begin, count),
                                     key_positions.narrow(0, 0, seen),
                                     config_.sliding_window,
                                     {},
                                     valid.defined() ? valid.narrow(1, 0, seen) : valid};
            attended.push_back(attend(layer, projected.queries.narrow(1, begin, count),
                                      keys.narrow(1, 0, seen), values.narrow(1, 0, seen), mask));
        }
        x = x + torch::cat(attended);
        x = x + mlp_block(layer, x);
        counts.push_back(chosen.size(0));
        if (keep.defined()) {
            chosen = chosen.index_select(0, keep);
            x = x.index_select(0, keep);
        }
    }
    return counts;
}

torch::Tensor Model::logits(const torch::Tensor& hidden) const {
    const torch::Tensor logits = kv::linear(hidden, lm_head_);
    return logits.scalar_type() == torch::kFloat64 ? logits : logits.to(torch::kFloat32);
}

torch::Tensor Model::prefill_by_layer(std::span<const int32_t> tokens, KvCache& cache,
                                      int64_t chunk,
                                      const std::function<void(int64_t layer)>& layer_done) const {
    if (tokens.empty()) throw Error("prefill: no tokens");
    if (chunk <= 0) throw UsageError("prefill chunk must be positive");
    torch::NoGradGuard no_grad;
    const int64_t count = static_cast<int64_t>(tokens.size());
    const int64_t first_position = cache.next_position();
    const torch::Tensor positions =
        torch::arange(first_position, first_position + count,
                      torch::TensorOptions().dtype(torch::kInt64).device(device_));
    torch::Tensor x = embed(tokens);
    cache.reserve(cache.length() + count);
    const int64_t before = cache.length();
    cache.begin_append(positions);
    try {
        const torch::Tensor key_positions = cache.positions();
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            const Layer& layer = layers_[i];
            const int64_t index = static_cast<int64_t>(i);
            // Keys and values of the whole layer first, so that every query chunk finds the
            // keys it may see; the queries are kept (the size of the hidden states).
            std::vector<torch::Tensor> queries;
            for (int64_t begin = 0; begin < count; begin += chunk) {
                const int64_t rows = std::min(chunk, count - begin);
                const Projected projected =
                    project(layer, x.narrow(0, begin, rows), positions.narrow(0, begin, rows));
                cache.write_part(index, begin, projected.keys, projected.values);
                queries.push_back(projected.queries);
            }
            const torch::Tensor keys = cache.keys(index), values = cache.values(index);
            const torch::Tensor valid = cache.key_valid(index);
            torch::Tensor next = torch::empty_like(x);
            for (int64_t begin = 0, part = 0; begin < count; begin += chunk, ++part) {
                const int64_t rows = std::min(chunk, count - begin);
                const int64_t seen = before + begin + rows;
                const AttentionMask mask{positions.narrow(0, begin, rows),
                                         key_positions.narrow(0, 0, seen),
                                         config_.sliding_window,
                                         {},
                                         valid.defined() ? valid.narrow(1, 0, seen) : valid};
                const torch::Tensor h =
                    x.narrow(0, begin, rows) +
                    attend(layer, queries[static_cast<std::size_t>(part)], keys.narrow(1, 0, seen),
                           values.narrow(1, 0, seen), mask);
                next.narrow(0, begin, rows).copy_(h + mlp_block(layer, h));
            }
            x = next;
            if (layer_done) layer_done(index);
        }
        cache.commit();
    } catch (...) {
        cache.rollback();
        throw;
    }
    return logits(rms_norm(x.narrow(0, count - 1, 1), final_norm_, config_.rms_norm_eps))
        .select(0, 0)
        .to(torch::kCPU);
}

torch::Tensor Model::prefill(std::span<const int32_t> tokens, KvCache& cache, int64_t chunk,
                             RowChooser* chooser, QueryObserver* observer) const {
    if (tokens.empty()) throw Error("prefill: no tokens");
    if (chunk <= 0) throw UsageError("prefill chunk must be positive");
    torch::NoGradGuard no_grad;
    torch::Tensor last_hidden;
    for (std::size_t begin = 0; begin < tokens.size(); begin += static_cast<std::size_t>(chunk)) {
        const std::size_t count = std::min(tokens.size() - begin, static_cast<std::size_t>(chunk));
        const int64_t first_position = cache.next_position();
        const torch::Tensor positions =
            torch::arange(first_position, first_position + static_cast<int64_t>(count),
                          torch::TensorOptions().dtype(torch::kInt64));
        const torch::Tensor hidden =
            forward(embed(tokens.subspan(begin, count)), positions, cache, {}, chooser, observer);
        last_hidden = hidden.narrow(0, hidden.size(0) - 1, 1);
    }
    return logits(last_hidden).select(0, 0).to(torch::kCPU);
}

}  // namespace kv
