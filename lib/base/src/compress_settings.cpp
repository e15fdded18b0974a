// The torch-free half of kv/compress.hpp: method names and settings, shared by the tools.
#include "kv/compress.hpp"

#include "kv/error.hpp"

#include <array>
#include <cmath>
#include <cstdio>
#include <utility>

namespace kv {
namespace {

constexpr std::array<std::pair<CompressionMethod, const char*>, 9> method_names = {{
    {CompressionMethod::random, "random"},
    {CompressionMethod::knorm, "knorm"},
    {CompressionMethod::streaming, "streaming"},
    {CompressionMethod::snapkv, "snapkv"},
    {CompressionMethod::tova, "tova"},
    {CompressionMethod::observed, "observed"},
    {CompressionMethod::expected, "expected"},
    {CompressionMethod::leverage, "leverage"},
    {CompressionMethod::cur, "cur"},
}};

std::string format_number(double value) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", value);
    return text;
}

}  // namespace

CompressionMethod parse_compression_method(const std::string& name) {
    for (const auto& [method, text] : method_names)
        if (name == text) return method;
    throw UsageError("unknown compression method " + kv::quoted(name) + " (expected one of " +
                     compression_method_names() + ")");
}

const char* compression_method_name(CompressionMethod method) {
    for (const auto& [candidate, text] : method_names)
        if (candidate == method) return text;
    return "?";
}

std::string compression_method_names() {
    std::string names;
    for (const auto& [method, text] : method_names)
        names += (names.empty() ? "" : ", ") + std::string(text);
    return names;
}

bool compression_needs_queries(CompressionMethod method) {
    return method == CompressionMethod::snapkv || method == CompressionMethod::tova ||
           method == CompressionMethod::observed || method == CompressionMethod::expected;
}

int64_t CompressionSettings::kept(int64_t tokens) const {
    const int64_t keep =
        keep_tokens >= 0
            ? keep_tokens
            : static_cast<int64_t>(std::floor(static_cast<double>(tokens) * (1 - ratio)));
    return std::max<int64_t>(1, std::min(tokens, keep));
}

void validate_compression_settings(const CompressionSettings& settings) {
    const bool has_ratio = settings.ratio >= 0, has_count = settings.keep_tokens >= 0;
    if (has_ratio == has_count)
        throw UsageError("give exactly one of --ratio (the fraction pruned) and --keep-tokens");
    if (has_ratio && !(settings.ratio < 1))
        throw UsageError("--ratio is the fraction of tokens pruned, in [0, 1); got " +
                         format_number(settings.ratio));
    if (has_count && settings.keep_tokens < 1) throw UsageError("--keep-tokens must be at least 1");
    for (const auto& [value, name] :
         {std::pair<int64_t, const char*>{settings.window_size, "window size"},
          {settings.kernel_size, "kernel size"},
          {settings.future_positions, "future positions"},
          {settings.sketch_dimension, "sketch dimension"},
          {settings.local_window, "local window"}})
        if (value < 1) throw UsageError(std::string("the ") + name + " must be positive");
    if (settings.sinks < 0) throw UsageError("the sink count must not be negative");
    if (settings.kernel_size % 2 == 0)
        throw UsageError("the pooling kernel size must be odd (it is centred on each token)");
}

}  // namespace kv
