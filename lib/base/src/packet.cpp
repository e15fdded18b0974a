#include "kv/packet.hpp"

#include "kv/error.hpp"
#include "kv/sha256.hpp"

#include <cstdio>

namespace kv {
namespace {

std::string short_fingerprint(const std::string& fingerprint, const std::string& other) {
    const std::size_t length = fingerprint.compare(0, 12, other, 0, 12) == 0 ? 64 : 12;
    return fingerprint.substr(0, length);
}

std::string describe_model(const CacheModelInfo& model, const std::string& other_fingerprint) {
    std::string text = model.model_name.empty() ? "" : kv::quoted(model.model_name) + " ";
    return text + "(fingerprint " + short_fingerprint(model.model_fingerprint, other_fingerprint) +
           ")";
}

}  // namespace

const char* cache_dtype_name(CacheDtype dtype) {
    switch (dtype) {
        case CacheDtype::f32:
            return "f32";
        case CacheDtype::bf16:
            return "bf16";
        case CacheDtype::f16:
            return "f16";
    }
    return "unknown";
}

CacheDtype parse_cache_dtype(const std::string& name) {
    if (name == "f32") return CacheDtype::f32;
    if (name == "bf16") return CacheDtype::bf16;
    if (name == "f16") return CacheDtype::f16;
    throw FormatError("unknown cache dtype " + kv::quoted(name) + " (expected f32, bf16 or f16)");
}

std::size_t cache_dtype_size(CacheDtype dtype) {
    return dtype == CacheDtype::f32 ? 4 : 2;
}

int64_t packet_tensor_bytes(const CacheModelInfo& model, int64_t stored_length) {
    return 2 * model.num_layers * model.num_kv_heads * stored_length * model.head_dim *
           static_cast<int64_t>(cache_dtype_size(model.dtype));
}

void check_compatible(const CacheModelInfo& expected, const CacheModelInfo& found,
                      const std::string& what) {
    // `what` usually comes from CacheReader::source(): already quoted, or "standard input".
    const bool formatted = (!what.empty() && what.front() == '\'') || what == "standard input";
    const std::string subject = "cache " + (formatted ? what : kv::quoted(what));
    if (found.model_fingerprint != expected.model_fingerprint)
        throw MismatchError(subject + " was baked with model " +
                            describe_model(found, expected.model_fingerprint) + ", not " +
                            describe_model(expected, found.model_fingerprint));
    if (found.tokenizer_fingerprint != expected.tokenizer_fingerprint)
        throw MismatchError(
            subject + " was baked with another tokenizer (fingerprint " +
            short_fingerprint(found.tokenizer_fingerprint, expected.tokenizer_fingerprint) +
            ") than the one in use (fingerprint " +
            short_fingerprint(expected.tokenizer_fingerprint, found.tokenizer_fingerprint) + ")");
    auto differ = [&](const std::string& field, const std::string& got, const std::string& want) {
        if (got != want)
            throw MismatchError(subject + " has " + field + " " + got + ", expected " + want);
    };
    differ("architecture", kv::quoted(found.architecture), kv::quoted(expected.architecture));
    differ("num_layers", std::to_string(found.num_layers), std::to_string(expected.num_layers));
    differ("num_kv_heads", std::to_string(found.num_kv_heads),
           std::to_string(expected.num_kv_heads));
    differ("head_dim", std::to_string(found.head_dim), std::to_string(expected.head_dim));
    differ("rope_layout", kv::quoted(found.rope_layout), kv::quoted(expected.rope_layout));
    auto exact = [](double value) {
        char text[32];
        std::snprintf(text, sizeof text, "%.17g", value);
        return std::string(text);
    };
    differ("rope_theta", exact(found.rope_theta), exact(expected.rope_theta));
    differ("rope_scaling", kv::quoted(found.rope_scaling), kv::quoted(expected.rope_scaling));
    differ("dtype", cache_dtype_name(found.dtype), cache_dtype_name(expected.dtype));
}

int64_t Adapter::header_tokens() const {
    return hidden_size > 0 ? static_cast<int64_t>(header.size()) / hidden_size : 0;
}

int64_t Adapter::trailer_tokens() const {
    return hidden_size > 0 ? static_cast<int64_t>(trailer.size()) / hidden_size : 0;
}

std::string Adapter::fingerprint() const {
    Sha256 hash;
    hash.update("kvtools-adapter-v1\n" + std::to_string(header_tokens()) + " " +
                std::to_string(trailer_tokens()) + " " + std::to_string(hidden_size) + "\n");
    hash.update(header.data(), header.size() * sizeof(float));
    hash.update(trailer.data(), trailer.size() * sizeof(float));
    return hash.hex();
}

bool Packet::padded() const {
    const int64_t slots = stored_length();
    for (int64_t used : head_lengths)
        if (used != slots) return true;
    return false;
}

}  // namespace kv
