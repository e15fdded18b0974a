// Hugging Face model folders: config.json plus model.safetensors, or the shards named by
// model.safetensors.index.json. Tensors view the memory-mapped shards.
#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/model/model.hpp"
#include "kv/safetensors.hpp"

#include <set>

namespace kv {
namespace {

torch::ScalarType torch_dtype_of(const std::string& dtype, const std::string& source,
                                 const std::string& name) {
    if (dtype == "F32") return torch::kFloat32;
    if (dtype == "BF16") return torch::kBFloat16;
    if (dtype == "F16") return torch::kFloat16;
    throw UnsupportedError(source + ": tensor '" + name + "' has dtype " + dtype +
                           " (supported model weights: F32, BF16, F16)");
}

std::vector<std::filesystem::path> shard_paths(const std::filesystem::path& folder) {
    const std::filesystem::path single = folder / "model.safetensors";
    const std::filesystem::path index = folder / "model.safetensors.index.json";
    if (std::filesystem::exists(index)) {
        const std::string source = quoted(index.string());
        json::Value parsed;
        try {
            parsed = json::parse(read_file_text(index));
        } catch (const FormatError& error) {
            throw FormatError(source + ": " + error.what());
        }
        const json::Value* map = parsed.find("weight_map");
        if (!map || !map->is_object()) throw FormatError(source + ": missing 'weight_map'");
        std::set<std::string> files;
        for (const auto& [name, file] : map->as_object()) {
            if (!file.is_string())
                throw FormatError(source + ": weight_map entry '" + name + "' is not a file name");
            const std::string& shard = file.as_string();
            if (shard.find('/') != std::string::npos || shard == ".." || shard.empty())
                throw FormatError(source + ": shard name '" + shard +
                                  "' must be a plain file name");
            files.insert(shard);
        }
        std::vector<std::filesystem::path> paths;
        for (const std::string& shard : files)
            paths.push_back(folder / shard);
        return paths;
    }
    if (std::filesystem::exists(single)) return {single};
    throw IoError("cannot open model " + quoted(folder.string()) +
                  ": no model.safetensors or model.safetensors.index.json in it");
}

}  // namespace

LoadedWeights load_hf_folder(const std::filesystem::path& folder) {
    const std::filesystem::path config_path = folder / "config.json";
    const std::string config_source = quoted(config_path.string());
    if (!std::filesystem::exists(config_path))
        throw IoError("cannot open model " + quoted(folder.string()) + ": no config.json in it");
    json::Value config_json;
    try {
        config_json = json::parse(read_file_text(config_path));
    } catch (const FormatError& error) {
        throw FormatError(config_source + ": " + error.what());
    }

    LoadedWeights result;
    result.config = parse_hf_config(config_json, config_source);
    result.source = quoted(folder.string());

    std::string stored_dtype;
    for (const std::filesystem::path& shard_path : shard_paths(folder)) {
        const SafetensorsFile shard = SafetensorsFile::open(shard_path);
        const std::string source = quoted(shard_path.string());
        for (const SafetensorsEntry& entry : shard.entries()) {
            const torch::ScalarType dtype = torch_dtype_of(entry.dtype, source, entry.name);
            if (result.weights.count(entry.name))
                throw FormatError(source + ": tensor '" + entry.name +
                                  "' appears in more than one shard");
            auto mapping = shard.mapping();
            result.weights[entry.name] = torch::from_blob(
                const_cast<std::byte*>(shard.data(entry)), entry.shape, [mapping](void*) {},
                torch::TensorOptions().dtype(dtype));
            if (entry.name == "model.embed_tokens.weight")
                stored_dtype = dtype == torch::kBFloat16  ? "bf16"
                               : dtype == torch::kFloat16 ? "f16"
                                                          : "f32";
        }
    }
    // What the weights are stored as decides the default compute dtype, whatever config.json says.
    if (!stored_dtype.empty()) result.config.weights_dtype = stored_dtype;
    return result;
}

}  // namespace kv
