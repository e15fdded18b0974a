#include "kv/model/adapter.hpp"

#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"

#include <cstring>

namespace kv {
std::vector<float> float_values(const torch::Tensor& tensor) {
    const torch::Tensor host = tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    const float* data = host.data_ptr<float>();
    return std::vector<float>(data, data + host.numel());
}

torch::Tensor float_rows(const std::vector<float>& values, int64_t width, torch::Device device) {
    const int64_t count = width > 0 ? static_cast<int64_t>(values.size()) / width : 0;
    return torch::from_blob(const_cast<float*>(values.data()), {count, width}, torch::kFloat32)
        .clone()
        .to(device);
}

Adapter initialize_adapter(const Model& model, int64_t header_tokens, int64_t trailer_tokens,
                           uint64_t seed) {
    if (header_tokens < 0 || trailer_tokens < 0 || header_tokens + trailer_tokens == 0)
        throw UsageError("an adapter needs at least one soft token (header " +
                         std::to_string(header_tokens) + ", trailer " +
                         std::to_string(trailer_tokens) + ")");
    torch::NoGradGuard no_grad;
    const torch::Tensor table = model.input_embeddings().to(torch::kCPU, torch::kFloat64);
    Adapter adapter;
    adapter.hidden_size = model.config().hidden_size;
    adapter.init_mean = table.mean().item<double>();
    adapter.init_std = table.std().item<double>();
    // A private generator: the draw depends on the seed alone, not on what ran before.
    torch::Generator generator = at::detail::createCPUGenerator(seed);
    auto draw = [&](int64_t count) {
        const torch::Tensor values =
            at::normal(adapter.init_mean, adapter.init_std, {count, adapter.hidden_size}, generator,
                       torch::TensorOptions().dtype(torch::kFloat32));
        return float_values(values);
    };
    adapter.header = draw(header_tokens);
    adapter.trailer = draw(trailer_tokens);
    return adapter;
}

Adapter load_adapter(const std::filesystem::path& path, const Model& model,
                     const CacheModelInfo& model_info) {
    const CacheReader reader(path);
    CacheModelInfo found = reader.model();
    found.dtype = model_info.dtype;  // the vectors are float32 whatever the model computes in
    try {
        check_compatible(model_info, found, reader.source());
    } catch (const MismatchError& error) {
        throw MismatchError("adapter " + reader.source() +
                            " does not belong to this model: " + error.what());
    }
    Adapter adapter = reader.read_adapter();
    if (adapter.hidden_size != model.config().hidden_size)
        throw MismatchError("adapter " + reader.source() + " has soft tokens of width " +
                            std::to_string(adapter.hidden_size) + ", the model's embeddings " +
                            std::to_string(model.config().hidden_size));
    return adapter;
}

AdapterTensors adapter_tensors(const Adapter& adapter, torch::Device device) {
    return {float_rows(adapter.header, adapter.hidden_size, device),
            float_rows(adapter.trailer, adapter.hidden_size, device)};
}

void store_adapter_tensors(const AdapterTensors& tensors, Adapter& adapter) {
    adapter.header = float_values(tensors.header);
    adapter.trailer = float_values(tensors.trailer);
}

torch::Tensor wrap_document(const Model& model, const AdapterTensors* adapter,
                            std::span<const int32_t> tokens) {
    torch::Tensor document =
        tokens.empty()
            ? torch::empty({0, model.config().hidden_size},
                           torch::TensorOptions().dtype(model.dtype()).device(model.device()))
            : model.embed(tokens);
    if (!adapter) return document;
    return torch::cat({adapter->header.to(model.device(), model.dtype()), document,
                       adapter->trailer.to(model.device(), model.dtype())});
}

PacketContext packet_context(const Model& model, const AdapterTensors* adapter,
                             std::span<const int32_t> preamble,
                             const std::vector<std::vector<int32_t>>& documents) {
    const std::size_t layers = static_cast<std::size_t>(model.config().num_layers);
    std::vector<std::vector<torch::Tensor>> keys(layers), values(layers);
    std::vector<torch::Tensor> positions;
    int64_t offset = 0;
    auto add_part = [&](const torch::Tensor& embeddings, bool realign) {
        const int64_t length = embeddings.size(0);
        if (length == 0) return;
        Model::LayerKeysValues part;
        model.forward_sequence(embeddings, torch::arange(length, torch::kInt64), {}, &part);
        for (std::size_t layer = 0; layer < layers; ++layer) {
            keys[layer].push_back(realign && offset != 0
                                      ? model.rope().shift(part[layer].first, offset)
                                      : part[layer].first);
            values[layer].push_back(part[layer].second);
        }
        positions.push_back(torch::arange(offset, offset + length, torch::kInt64));
        offset += length;
    };
    if (!preamble.empty()) add_part(model.embed(preamble), false);
    for (const std::vector<int32_t>& document : documents)
        add_part(wrap_document(model, adapter, document), true);
    if (positions.empty()) throw Error("packet_context: no tokens");
    PacketContext context;
    for (std::size_t layer = 0; layer < layers; ++layer)
        context.keys_values.emplace_back(torch::cat(keys[layer], 1), torch::cat(values[layer], 1));
    context.positions = torch::cat(positions).to(model.device());
    context.next_position = offset;
    return context;
}

}  // namespace kv
