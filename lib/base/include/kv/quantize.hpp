// Quantised storage of keys and values (formats/kvcache.md 6.6): per token, each group of
// `group_size` consecutive head_dim values shares a scale and an offset (asymmetric min-max,
// float32), codes of 8 or 4 bits; the last `residual_tokens` slots of every (layer, head)
// stay in the file's dtype (KIVI's full-precision recent window). Readers dequantise on load, so
// everything after the reader sees ordinary keys and values. Torch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kv {

enum class CacheDtype;

struct Quantization {
    int bits = 0;                 ///< 0: stored in the file's dtype; 8 or 4
    int64_t group_size = 32;      ///< head_dim values per scale and offset; divides head_dim
    int64_t residual_tokens = 0;  ///< last slots of each head kept in the file's dtype
    bool enabled() const { return bits != 0; }
    bool operator==(const Quantization&) const = default;
};

/// "int8", "int4" or "none" with the defaults: group 32, residual 0 for int8 and 128 for int4.
Quantization parse_quantization(const std::string& name);
/// "int8", "int4+128" (with its residual window) or "none".
std::string quantization_name(const Quantization& quantization);
/// FormatError unless bits is 4 or 8, the group divides head_dim and the residual is not
/// negative (`what` names the packet).
void check_quantization(const Quantization& quantization, int64_t head_dim,
                        const std::string& what);

/// One tensor [planes, slots, dim] as stored quantised: the first `slots - residual` slots of
/// each plane as codes, scales and offsets, the rest as they were.
struct QuantizedTensor {
    int64_t quantized_slots = 0;      ///< per plane
    std::vector<uint8_t> codes;       ///< [planes, quantized_slots, dim * bits / 8]
    std::vector<float> scales;        ///< [planes, quantized_slots, dim / group]
    std::vector<float> offsets;       ///< likewise: value = code * scale + offset
    std::vector<std::byte> residual;  ///< [planes, slots - quantized_slots, dim] in the dtype
};

/// A packet's quantised tensors as read from a file: a writer given keys and values they still
/// dequantise to writes these codes back instead of quantising the dequantised values again
/// (which would move them by rounding at every rewrite).
struct QuantizedPayload {
    Quantization quantization;
    QuantizedTensor keys, values;
};

/// Throws FormatError when a group spans more than float32 can scale (values near 1e38).
QuantizedTensor quantize_tensor(const std::byte* data, CacheDtype dtype, int64_t planes,
                                int64_t slots, int64_t dim, const Quantization& quantization);
/// The tensor back in `dtype`, [planes, slots, dim]: code * scale + offset.
std::vector<std::byte> dequantize_tensor(const QuantizedTensor& tensor, CacheDtype dtype,
                                         int64_t planes, int64_t slots, int64_t dim,
                                         const Quantization& quantization);

}  // namespace kv
