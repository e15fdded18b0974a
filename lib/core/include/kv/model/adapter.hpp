// KV Packet's adapters on the model: creating them, checking that a file's adapter belongs to the
// model, and wrapping a document's embeddings as [header][document][trailer].
//
// The soft tokens live in input-embedding space: they replace no token, they are rows inserted
// after the embedding lookup, and the frozen model computes their keys and values in every layer
// as for any token. Training keeps them as float32 leaf tensors; the model sees them in its
// compute dtype (the cast is inside the autograd graph, so gradients reach them).
#pragma once

#include "kv/model/model.hpp"
#include "kv/packet.hpp"

#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <span>

namespace kv {

/// The header and trailer as tensors [tokens, hidden] (float32).
struct AdapterTensors {
    torch::Tensor header;
    torch::Tensor trailer;
};

/// A new adapter whose vectors are drawn from N(mean, std) of the model's input embedding
/// matrix (every entry pooled), as the KV Packet authors initialise theirs; seeded.
Adapter initialize_adapter(const Model& model, int64_t header_tokens, int64_t trailer_tokens,
                           uint64_t seed);

/// Reads the adapter stored in `path` and checks that it was made for this model (the model
/// and tokenizer fingerprints, shapes and width): MismatchError naming both otherwise,
/// FormatError when the file holds no adapter or a damaged one.
Adapter load_adapter(const std::filesystem::path& path, const Model& model,
                     const CacheModelInfo& model_info);

/// Row-major float32 values [rows, width] as a tensor on `device`, and back (from any dtype or
/// device): how adapters and their optimizer state cross between files and tensors.
torch::Tensor float_rows(const std::vector<float>& values, int64_t width, torch::Device device);
std::vector<float> float_values(const torch::Tensor& tensor);

/// The adapter's vectors as tensors on `device`.
AdapterTensors adapter_tensors(const Adapter& adapter, torch::Device device);
/// Copies tensors (from training) back into the adapter's vectors.
void store_adapter_tensors(const AdapterTensors& tensors, Adapter& adapter);

/// Input embeddings [header + tokens + trailer, hidden] of a document wrapped by the adapter
/// (no adapter: the tokens' embeddings alone), in the model's compute dtype.
torch::Tensor wrap_document(const Model& model, const AdapterTensors* adapter,
                            std::span<const int32_t> tokens);

/// What a question sees when `documents` are served as packets: the `preamble` tokens (BOS) at
/// positions from 0, then each document wrapped by the adapter (or not) and computed on its own
/// from position 0, its keys rotated to where it lands, one after another: the context kvbake
/// and kvpack assemble, built from differentiable operations (gradients reach the adapter).
struct PacketContext {
    Model::LayerKeysValues keys_values;  ///< per layer [Hkv, S, D], keys after RoPE
    torch::Tensor positions;             ///< [S]
    int64_t next_position = 0;           ///< where the question starts
};
PacketContext packet_context(const Model& model, const AdapterTensors* adapter,
                             std::span<const int32_t> preamble,
                             const std::vector<std::vector<int32_t>>& documents);

}  // namespace kv
