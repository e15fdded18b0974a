// What the tools that run the model share: loading a model with its tokenizer, and describing
// them the way cache files record them.
#pragma once

#include "kv/model/model.hpp"
#include "kv/packet.hpp"
#include "kv/runtime.hpp"
#include "kv/tokenizer.hpp"

#include <filesystem>
#include <memory>
#include <optional>

namespace kv {

struct Runtime {
    std::shared_ptr<Model> model;
    std::unique_ptr<Tokenizer> tokenizer;
    CacheModelInfo cache_info;  ///< with dtype = the model's compute dtype
};

/// Loads the model, then its tokenizer (--tokenizer, the model folder's own, or tokenizer.bin
/// beside a llama2.c checkpoint), and checks that they fit each other.
Runtime load_runtime(const RuntimeOptions& options);

}  // namespace kv
