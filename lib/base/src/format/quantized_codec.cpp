#include "quantized_codec.hpp"

#include "kv/format/quantize.hpp"

#include <algorithm>
#include <memory>
#include <utility>

namespace kv::format {

void write_quantized(const FileWriter& out, hid_t packet_group, const Packet& packet,
                     const Quantization& quantization, const CacheModelInfo& m,
                     const CacheWriteOptions& options, hid_t key_type) {
    const int64_t planes = m.num_layers * m.num_kv_heads, slots = packet.stored_length();
    Handle group = out.create_group(packet_group, "quantized");
    out.write_integer(group.get(), "bits", quantization.bits);
    out.write_integer(group.get(), "group_size", quantization.group_size);
    out.write_integer(group.get(), "residual_tokens", quantization.residual_tokens);
    const auto layers = static_cast<hsize_t>(m.num_layers),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    // The codes read from a file, when nothing changed since: quantising their dequantised
    // values again would move them by rounding at every rewrite (kvindex, merge, append).
    // Checked here, on the rare rewrite, rather than by hashing every load.
    const QuantizedPayload* stored = packet.stored_quantized.get();
    auto unchanged = [&](const QuantizedTensor& tensor, const std::vector<std::byte>& bytes) {
        return dequantize_tensor(tensor, m.dtype, planes, slots, m.head_dim, quantization) == bytes;
    };
    const bool reuse = stored && stored->quantization == quantization &&
                       unchanged(stored->keys, packet.keys) &&
                       unchanged(stored->values, packet.values);
    for (const bool keys : {true, false}) {
        const QuantizedTensor tensor =
            reuse ? (keys ? stored->keys : stored->values)
                  : quantize_tensor((keys ? packet.keys : packet.values).data(), m.dtype, planes,
                                    slots, m.head_dim, quantization);
        const std::string prefix = keys ? "key_" : "value_";
        const auto quantized = static_cast<hsize_t>(tensor.quantized_slots);
        const auto residual = static_cast<hsize_t>(slots - tensor.quantized_slots);
        const auto code_bytes = static_cast<hsize_t>(m.head_dim * quantization.bits / 8);
        const auto groups = static_cast<hsize_t>(m.head_dim / quantization.group_size);
        const auto row_bytes_of_residual =
            static_cast<hsize_t>(m.head_dim) * cache_dtype_size(m.dtype);
        out.write_dataset(
            group.get(), prefix + "codes", H5T_STD_U8LE, H5T_NATIVE_UINT8,
            {layers, heads, quantized, code_bytes},
            {1, 1,
             std::max<hsize_t>(1, std::min(quantized, tensor_chunk_tokens(options, code_bytes))),
             code_bytes},
            options, false, tensor.codes.data());
        for (const auto& [name, values] :
             {std::pair<const char*, const std::vector<float>*>{"scales", &tensor.scales},
              {"offsets", &tensor.offsets}})
            out.write_dataset(group.get(), prefix + name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                              {layers, heads, quantized, groups},
                              {1, 1,
                               std::max<hsize_t>(1, std::min(quantized, tensor_chunk_tokens(
                                                                            options, 4 * groups))),
                               groups},
                              options, true, values->data());
        out.write_dataset(
            group.get(), prefix + "residual", key_type, key_type,
            {layers, heads, residual, static_cast<hsize_t>(m.head_dim)},
            {1, 1,
             std::max<hsize_t>(
                 1, std::min(residual, tensor_chunk_tokens(options, row_bytes_of_residual))),
             static_cast<hsize_t>(m.head_dim)},
            options, true, tensor.residual.data(), m.dtype == CacheDtype::bf16 ? "bf16" : nullptr);
    }
}

Quantization read_quantization(const FileReader& in, hid_t group) {
    Quantization quantization;
    quantization.bits = static_cast<int>(in.integer_attribute(group, "bits", "quantized"));
    quantization.group_size = in.integer_attribute(group, "group_size", "quantized");
    quantization.residual_tokens = in.integer_attribute(group, "residual_tokens", "quantized");
    return quantization;
}

void read_quantized(const FileReader& in, hid_t packet_group, const CacheModelInfo& m,
                    int64_t stored, const TensorReader& read_tensor, Packet& packet) {
    Handle quantized = in.open_group(packet_group, "quantized", "quantized");
    const hid_t q = quantized.get();
    Quantization& quantization = packet.quantization;
    quantization = read_quantization(in, q);
    try {
        check_quantization(quantization, m.head_dim, "quantized");
    } catch (const FormatError& error) {
        in.fail(error.what());
    }
    const int64_t planes = m.num_layers * m.num_kv_heads;
    const auto residual = static_cast<hsize_t>(std::min(stored, quantization.residual_tokens));
    const auto quantized_slots = static_cast<hsize_t>(stored) - residual;
    const auto layers = static_cast<hsize_t>(m.num_layers),
               heads = static_cast<hsize_t>(m.num_kv_heads);
    const auto code_bytes = static_cast<hsize_t>(m.head_dim * quantization.bits / 8);
    const auto groups = static_cast<hsize_t>(m.head_dim / quantization.group_size);
    auto payload = std::make_shared<QuantizedPayload>();
    payload->quantization = quantization;
    for (const bool keys : {true, false}) {
        const std::string prefix = keys ? "key_" : "value_";
        QuantizedTensor& tensor = keys ? payload->keys : payload->values;
        tensor.quantized_slots = static_cast<int64_t>(quantized_slots);
        tensor.codes = in.numeric_dataset<uint8_t>(q, prefix + "codes", prefix + "codes",
                                                   {layers, heads, quantized_slots, code_bytes},
                                                   H5T_NATIVE_UINT8);
        for (auto [name, target] :
             {std::pair<const char*, std::vector<float>*>{"scales", &tensor.scales},
              {"offsets", &tensor.offsets}})
            *target = in.numeric_dataset<float>(q, prefix + name, prefix + name,
                                                {layers, heads, quantized_slots, groups},
                                                H5T_NATIVE_FLOAT);
        read_tensor(q, prefix + "residual", residual, tensor.residual);
        (keys ? packet.keys : packet.values) =
            dequantize_tensor(tensor, m.dtype, planes, stored, m.head_dim, quantization);
    }
    packet.stored_quantized = std::move(payload);
}

}  // namespace kv::format
