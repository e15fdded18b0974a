// What every tool that runs a model is told about it, and the process-wide compute settings.
// Torch-free: the tools' mains include it.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace kv {

/// A model to load, its tokenizer, and where and how it computes.
struct RuntimeOptions {
    std::filesystem::path model;  ///< a Hugging Face folder or a llama2.c checkpoint
    /// Default: the model folder's own, or tokenizer.bin beside a llama2.c checkpoint.
    std::optional<std::filesystem::path> tokenizer;
    std::string dtype = "auto";   ///< compute (and storage) dtype: f32, bf16, f16, auto
    std::string device = "auto";  ///< cpu, cuda[:N], auto
    bool use_mmap = false;        ///< map the weights instead of copying them
    int threads = 0;              ///< CPU threads; 0: one per core (set_compute_threads)
};

/// Sets libtorch's intra-op thread count; 0 means one per core. Returns the count in effect.
int set_compute_threads(int threads);

}  // namespace kv
