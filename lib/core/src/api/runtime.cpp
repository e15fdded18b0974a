#include "runtime.hpp"

#include "kv/error.hpp"
#include "kv/gguf.hpp"
#include "kv/json.hpp"
#include "kv/model/packets.hpp"
#include "kv/rope.hpp"

namespace kv {
namespace {

std::filesystem::path tokenizer_path_for(const RuntimeOptions& options) {
    if (options.tokenizer) return *options.tokenizer;
    // A folder holds its tokenizer's files, a GGUF file its tokenizer's metadata.
    if (std::filesystem::is_directory(options.model) || is_gguf_file(options.model))
        return options.model;
    const std::filesystem::path beside = options.model.parent_path() / "tokenizer.bin";
    if (std::filesystem::exists(beside)) return beside;
    throw UsageError(
        "model " + kv::quoted(options.model.string()) +
        " is a llama2.c checkpoint: name its tokenizer with --tokenizer (e.g. tok512.bin)");
}

}  // namespace

Runtime load_runtime(const RuntimeOptions& options) {
    Runtime runtime;
    runtime.model = Model::load({options.model, options.dtype, options.device, options.use_mmap});
    runtime.tokenizer = load_tokenizer(tokenizer_path_for(options));
    const ModelConfig& config = runtime.model->config();
    if (runtime.tokenizer->vocab_size() > config.vocab_size)
        throw MismatchError("tokenizer has " + std::to_string(runtime.tokenizer->vocab_size()) +
                            " tokens but model " + kv::quoted(options.model.string()) + " only " +
                            std::to_string(config.vocab_size));
    CacheModelInfo& info = runtime.cache_info;
    info.model_fingerprint = runtime.model->fingerprint();
    info.model_name = options.model.string();
    info.architecture = config.architecture;
    info.num_layers = config.num_layers;
    info.num_kv_heads = config.num_kv_heads;
    info.head_dim = config.head_dim;
    info.rope_layout = config.rope_layout == RopeLayout::interleaved ? "interleaved" : "half_split";
    info.rope_theta = config.rope_theta;
    info.rope_scaling = rope_scaling_to_json(config.rope_scaling);
    info.tokenizer_fingerprint = runtime.tokenizer->fingerprint();
    info.dtype = cache_dtype(runtime.model->dtype());
    return runtime;
}

}  // namespace kv
