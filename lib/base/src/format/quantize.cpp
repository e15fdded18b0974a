#include "kv/format/quantize.hpp"

#include "kv/error.hpp"
#include "kv/float_convert.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kv {

Quantization parse_quantization(const std::string& name) {
    Quantization quantization;
    if (name == "none") return quantization;
    if (name == "int8") {
        quantization.bits = 8;
        return quantization;
    }
    if (name == "int4") {
        quantization.bits = 4;
        quantization.residual_tokens = 128;
        return quantization;
    }
    throw UsageError("unknown quantization " + kv::quoted(name) + " (expected int8, int4 or none)");
}

std::string quantization_name(const Quantization& quantization) {
    if (!quantization.enabled()) return "none";
    std::string name = "int" + std::to_string(quantization.bits);
    if (quantization.residual_tokens > 0)
        name += "+" + std::to_string(quantization.residual_tokens);
    return name;
}

void check_quantization(const Quantization& quantization, int64_t head_dim,
                        const std::string& what) {
    if (quantization.bits != 4 && quantization.bits != 8)
        throw FormatError(what + ": quantization bits " + std::to_string(quantization.bits) +
                          " (expected 8 or 4)");
    if (quantization.group_size < 1 || head_dim % quantization.group_size != 0)
        throw FormatError(what + ": quantization group size " +
                          std::to_string(quantization.group_size) + " does not divide head_dim " +
                          std::to_string(head_dim));
    if (quantization.residual_tokens < 0) throw FormatError(what + ": negative residual_tokens");
}

QuantizedTensor quantize_tensor(const std::byte* data, CacheDtype dtype, int64_t planes,
                                int64_t slots, int64_t dim, const Quantization& quantization) {
    QuantizedTensor out;
    const int64_t residual = std::min(slots, quantization.residual_tokens);
    const int64_t quantized = slots - residual;
    const int64_t group = quantization.group_size, groups = dim / group;
    const int levels = (1 << quantization.bits) - 1;
    const int64_t code_bytes = dim * quantization.bits / 8;
    const std::size_t element = cache_dtype_size(dtype);
    out.quantized_slots = quantized;
    out.codes.assign(static_cast<std::size_t>(planes * quantized * code_bytes), 0);
    out.scales.resize(static_cast<std::size_t>(planes * quantized * groups));
    out.offsets.resize(out.scales.size());
    out.residual.resize(static_cast<std::size_t>(planes * residual * dim) * element);
    for (int64_t plane = 0; plane < planes; ++plane) {
        for (int64_t slot = 0; slot < quantized; ++slot) {
            const std::size_t row = static_cast<std::size_t>((plane * slots + slot) * dim);
            const std::size_t out_row = static_cast<std::size_t>(plane * quantized + slot);
            for (int64_t g = 0; g < groups; ++g) {
                float low = INFINITY, high = -INFINITY;
                for (int64_t i = g * group; i < (g + 1) * group; ++i) {
                    const float x = load_float(data, dtype, row + static_cast<std::size_t>(i));
                    low = std::min(low, x);
                    high = std::max(high, x);
                }
                const float offset = low;
                const double span = static_cast<double>(high) - static_cast<double>(low);
                const auto scale = static_cast<float>(span / levels);
                if (!std::isfinite(scale) || !std::isfinite(offset))
                    throw FormatError(
                        "cannot quantise values that are not finite or span more "
                        "than float32 scales (" +
                        std::to_string(low) + " to " + std::to_string(high) + ")");
                out.scales[out_row * static_cast<std::size_t>(groups) +
                           static_cast<std::size_t>(g)] = scale;
                out.offsets[out_row * static_cast<std::size_t>(groups) +
                            static_cast<std::size_t>(g)] = offset;
                for (int64_t i = g * group; i < (g + 1) * group; ++i) {
                    const float x = load_float(data, dtype, row + static_cast<std::size_t>(i));
                    const long code = scale > 0 ? std::lround((x - offset) / scale) : 0;
                    const auto clamped = static_cast<uint8_t>(std::clamp<long>(code, 0, levels));
                    uint8_t* codes =
                        out.codes.data() + out_row * static_cast<std::size_t>(code_bytes);
                    if (quantization.bits == 8)
                        codes[i] = clamped;
                    else  // two per byte, the even value in the low nibble
                        codes[i / 2] |= static_cast<uint8_t>(i % 2 ? clamped << 4 : clamped);
                }
            }
        }
        const std::size_t row_bytes = static_cast<std::size_t>(dim) * element;
        for (int64_t slot = 0; slot < residual; ++slot)
            std::copy_n(
                data + static_cast<std::size_t>(plane * slots + quantized + slot) * row_bytes,
                row_bytes,
                out.residual.data() +
                    static_cast<std::size_t>(plane * residual + slot) * row_bytes);
    }
    return out;
}

std::vector<std::byte> dequantize_tensor(const QuantizedTensor& tensor, CacheDtype dtype,
                                         int64_t planes, int64_t slots, int64_t dim,
                                         const Quantization& quantization) {
    const int64_t quantized = tensor.quantized_slots, residual = slots - quantized;
    const int64_t group = quantization.group_size, groups = dim / group;
    const int64_t code_bytes = dim * quantization.bits / 8;
    const std::size_t element = cache_dtype_size(dtype);
    std::vector<std::byte> out(static_cast<std::size_t>(planes * slots * dim) * element);
    // Loading is the hot path (every read of a quantised file): codes unpacked a row at a time
    // into floats, then stored with the dtype's conversion chosen once, not per value.
    std::vector<float> values(static_cast<std::size_t>(dim));
    auto store_row = [&](std::size_t row) {
        std::byte* target = out.data() + row * element;
        switch (dtype) {
            case CacheDtype::f32:
                std::memcpy(target, values.data(), values.size() * 4);
                break;
            case CacheDtype::bf16:
                for (std::size_t i = 0; i < values.size(); ++i) {
                    const uint16_t bits = float_to_bf16(values[i]);
                    std::memcpy(target + 2 * i, &bits, 2);
                }
                break;
            case CacheDtype::f16:
                for (std::size_t i = 0; i < values.size(); ++i) {
                    const uint16_t bits = float_to_f16(values[i]);
                    std::memcpy(target + 2 * i, &bits, 2);
                }
                break;
        }
    };
    for (int64_t plane = 0; plane < planes; ++plane) {
        for (int64_t slot = 0; slot < quantized; ++slot) {
            const std::size_t in_row = static_cast<std::size_t>(plane * quantized + slot);
            const uint8_t* codes =
                tensor.codes.data() + in_row * static_cast<std::size_t>(code_bytes);
            if (quantization.bits == 8) {
                for (int64_t i = 0; i < dim; ++i)
                    values[static_cast<std::size_t>(i)] = codes[i];
            } else {
                for (int64_t i = 0; i < dim; i += 2) {
                    values[static_cast<std::size_t>(i)] = static_cast<float>(codes[i / 2] & 15);
                    values[static_cast<std::size_t>(i + 1)] = static_cast<float>(codes[i / 2] >> 4);
                }
            }
            const float* scales = tensor.scales.data() + in_row * static_cast<std::size_t>(groups);
            const float* offsets =
                tensor.offsets.data() + in_row * static_cast<std::size_t>(groups);
            for (int64_t g = 0; g < groups; ++g)
                for (int64_t i = g * group; i < (g + 1) * group; ++i)
                    values[static_cast<std::size_t>(i)] =
                        values[static_cast<std::size_t>(i)] * scales[g] + offsets[g];
            store_row(static_cast<std::size_t>((plane * slots + slot) * dim));
        }
        const std::size_t row_bytes = static_cast<std::size_t>(dim) * element;
        for (int64_t slot = 0; slot < residual; ++slot)
            std::copy_n(tensor.residual.data() +
                            static_cast<std::size_t>(plane * residual + slot) * row_bytes,
                        row_bytes,
                        out.data() +
                            static_cast<std::size_t>(plane * slots + quantized + slot) * row_bytes);
    }
    return out;
}

}  // namespace kv
