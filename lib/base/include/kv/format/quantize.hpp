// Quantised storage of keys and values (formats/kvcache.md 6.6): per token, each group of
// `group_size` consecutive head_dim values shares a scale and an offset (asymmetric min-max,
// float32), codes of 8 or 4 bits; the last `residual_tokens` slots of every (layer, head)
// stay in the file's dtype (KIVI's full-precision recent window). Readers dequantise on load, so
// everything after the reader sees ordinary keys and values. Torch-free.
#pragma once

#include "kv/packet.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kv {

/// "int8", "int4" or "none" with the defaults: group 32, residual 0 for int8 and 128 for int4.
Quantization parse_quantization(const std::string& name);
/// "int8", "int4+128" (with its residual window) or "none".
std::string quantization_name(const Quantization& quantization);
/// FormatError unless bits is 4 or 8, the group divides head_dim and the residual is not
/// negative (`what` names the packet).
void check_quantization(const Quantization& quantization, int64_t head_dim,
                        const std::string& what);

/// Throws FormatError when a group spans more than float32 can scale (values near 1e38).
QuantizedTensor quantize_tensor(const std::byte* data, CacheDtype dtype, int64_t planes,
                                int64_t slots, int64_t dim, const Quantization& quantization);
/// The tensor back in `dtype`, [planes, slots, dim]: code * scale + offset.
std::vector<std::byte> dequantize_tensor(const QuantizedTensor& tensor, CacheDtype dtype,
                                         int64_t planes, int64_t slots, int64_t dim,
                                         const Quantization& quantization);

}  // namespace kv
