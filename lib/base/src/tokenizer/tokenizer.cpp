#include "kv/tokenizer.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "../utf8.hpp"
#include "kv/error.hpp"
#include "kv/gguf.hpp"
#include "kv/sha256.hpp"
#include "loaders.hpp"

namespace kv {

namespace fs = std::filesystem;
using namespace tokenizer_detail;

// ---- Tokenizer ------------------------------------------------------------------------------

bool Tokenizer::is_end_of_generation(int32_t id) const {
    return std::find(end_of_generation_ids_.begin(), end_of_generation_ids_.end(), id) !=
           end_of_generation_ids_.end();
}

void Tokenizer::add_end_of_generation(int32_t id) {
    if (id >= 0 && !is_end_of_generation(id)) end_of_generation_ids_.push_back(id);
}

void Tokenizer::check_id(int32_t id) const {
    if (id < 0 || id >= vocab_size()) {
        throw FormatError("token id " + std::to_string(id) + " is outside the vocabulary of " +
                          std::to_string(vocab_size()));
    }
}

void Tokenizer::set_fingerprint(std::string_view file_bytes) {
    std::vector<int32_t> end_ids = end_of_generation_ids_;
    std::sort(end_ids.begin(), end_ids.end());
    std::string settings = "kvtools tokenizer v1\nkind=" + kind_ +
                           "\nfile=" + sha256_hex(file_bytes) + "\nbos=" + std::to_string(bos_id_) +
                           "\neos=" + std::to_string(eos_id_) +
                           "\nadd_bos=" + (add_bos_ ? "1" : "0") + "\nend=";
    for (int32_t id : end_ids)
        settings += std::to_string(id) + ",";
    // The special tokens around a text, only where they are more than a BOS, so that the
    // fingerprints of the tokenizers kvtools read before it knew of them stay as they were.
    const bool plain_prefix =
        special_prefix_.empty() || special_prefix_ == std::vector<int32_t>{bos_id_};
    if (!plain_prefix || !special_suffix_.empty()) {
        settings += "\nprefix=";
        for (int32_t id : special_prefix_)
            settings += std::to_string(id) + ",";
        settings += "\nsuffix=";
        for (int32_t id : special_suffix_)
            settings += std::to_string(id) + ",";
    }
    fingerprint_ = sha256_hex(settings);
}

std::vector<int32_t> Tokenizer::encode_with_special_tokens(std::string_view text) const {
    std::vector<int32_t> ids = special_prefix_;
    std::vector<int32_t> body = encode(text);
    ids.insert(ids.end(), body.begin(), body.end());
    ids.insert(ids.end(), special_suffix_.begin(), special_suffix_.end());
    return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
    std::string text;
    bool before_first_piece = true;  // specials decode to nothing, so they do not count
    for (size_t i = 0; i < ids.size(); ++i) {
        std::string bytes = token_bytes(ids[i]);
        bool at_start = before_first_piece || (strips_space_after_every_bos_ && bos_id_ >= 0 &&
                                               i > 0 && ids[i - 1] == bos_id_);
        size_t skip = strips_leading_space_ && at_start && !bytes.empty() && bytes[0] == ' ';
        text.append(bytes, skip);
        if (!bytes.empty()) before_first_piece = false;
    }
    return text;
}

// ---- TextStreamer ---------------------------------------------------------------------------

std::string TextStreamer::push(int32_t id) {
    std::string bytes = tokenizer_.token_bytes(id);
    bool after_bos = tokenizer_.bos_id() >= 0 && previous_id_ == tokenizer_.bos_id();
    previous_id_ = id;
    size_t skip =
        tokenizer_.strips_leading_space() && after_bos && !bytes.empty() && bytes[0] == ' ';
    pending_.append(bytes, skip);

    std::string text;
    auto* begin = reinterpret_cast<const unsigned char*>(pending_.data());
    auto* end = begin + pending_.size();
    auto* p = begin;
    while (p < end) {
        size_t length = utf8::valid_length(p, end);
        if (length > 0) {
            text.append(reinterpret_cast<const char*>(p), length);
            p += length;
        } else if (utf8::is_incomplete_sequence(p, end)) {
            break;  // the next token may bring the rest of this character
        } else {
            text += utf8::replacement_character;
            ++p;
        }
    }
    pending_.erase(0, static_cast<size_t>(p - begin));
    return text;
}

std::string TextStreamer::finish() {
    std::string text = pending_.empty() ? "" : std::string(utf8::replacement_character);
    pending_.clear();
    previous_id_ = -1;
    return text;
}

// ---- loading --------------------------------------------------------------------------------

namespace tokenizer_detail {

std::string read_file(const fs::path& path) {
    auto fail = [&](int error) {
        throw IoError("cannot read " + kv::quoted(path.string()) + ": " + std::strerror(error));
    };
    std::FILE* file = std::fopen(path.c_str(), "rb");
    if (!file) fail(errno);
    std::string bytes;
    char buffer[1 << 16];
    size_t count;
    while ((count = std::fread(buffer, 1, sizeof buffer, file)) > 0)
        bytes.append(buffer, count);
    int error = std::ferror(file) ? errno : 0;
    std::fclose(file);
    if (error != 0) fail(error);
    return bytes;
}

json::Value read_json_file(const fs::path& path) {
    std::string text = read_file(path);
    try {
        return json::parse(text);
    } catch (const FormatError& error) {
        throw FormatError(kv::quoted(path.string()) + ": " + error.what());
    }
}

ModelConfigs ModelConfigs::read_from(const fs::path& directory) {
    auto read_if_present = [&](const char* name) -> std::optional<json::Value> {
        fs::path path = directory / name;
        std::error_code error;
        if (!fs::is_regular_file(path, error)) return std::nullopt;
        json::Value value = read_json_file(path);
        if (!value.is_object()) {
            throw FormatError(kv::quoted(path.string()) + ": expected an object, got " +
                              std::string(json::type_name(value.type())));
        }
        return value;
    };
    ModelConfigs configs;
    configs.tokenizer_config = read_if_present("tokenizer_config.json");
    configs.model_config = read_if_present("config.json");
    configs.generation_config = read_if_present("generation_config.json");
    return configs;
}

std::string special_token_content(const json::Value* entry) {
    if (!entry) return "";
    if (entry->is_string()) return entry->as_string();
    if (entry->is_object()) {
        const json::Value* content = entry->find("content");
        if (content && content->is_string()) return content->as_string();
    }
    return "";
}

std::vector<int32_t> config_token_ids(const json::Value* entry) {
    std::vector<int32_t> ids;
    auto add = [&](const json::Value& value) {
        if (value.is_integer() && value.as_int() >= 0 && value.as_int() <= INT32_MAX) {
            ids.push_back(static_cast<int32_t>(value.as_int()));
        }
    };
    if (!entry) return ids;
    if (entry->is_array()) {
        for (const auto& value : entry->as_array())
            add(value);
    } else {
        add(*entry);
    }
    return ids;
}

}  // namespace tokenizer_detail

std::unique_ptr<Tokenizer> load_tokenizer(const fs::path& path) {
    std::error_code error;
    if (fs::is_directory(path, error)) {
        ModelConfigs configs = ModelConfigs::read_from(path);
        if (fs::exists(path / "tokenizer.json", error)) {
            fs::path file = path / "tokenizer.json";
            return load_hf_tokenizer_json(file, read_file(file), configs);
        }
        if (fs::exists(path / "tokenizer.model", error)) {
            fs::path file = path / "tokenizer.model";
            return load_sentencepiece(file, read_file(file), configs);
        }
        throw IoError("no tokenizer.json or tokenizer.model in " + kv::quoted(path.string()));
    }

    // A GGUF model file carries its tokenizer in its metadata; it is mapped, not read whole.
    if (is_gguf_file(path)) return load_gguf_tokenizer(path);
    std::string bytes = read_file(path);
    std::string name = path.filename().string();
    std::string extension = path.extension().string();
    // Only files with the standard names are known to sit beside their own model's configs.
    auto configs_beside = [&](const char* standard_name) {
        return name == standard_name
                   ? ModelConfigs::read_from(path.parent_path().empty() ? fs::path(".")
                                                                        : path.parent_path())
                   : ModelConfigs{};
    };
    size_t first = bytes.find_first_not_of(" \t\r\n");
    bool looks_like_json = first != std::string::npos && bytes[first] == '{';
    if (extension == ".json" || (extension != ".bin" && extension != ".model" && looks_like_json)) {
        return load_hf_tokenizer_json(path, std::move(bytes), configs_beside("tokenizer.json"));
    }
    if (extension == ".model") {
        return load_sentencepiece(path, std::move(bytes), configs_beside("tokenizer.model"));
    }
    if (extension == ".bin") return load_llama2c(path, std::move(bytes));
    // No telling extension: a sentencepiece model is a protobuf whose first field is a piece
    // (tag byte 0x0A); everything else is tried as llama2.c.
    if (!bytes.empty() && bytes[0] == '\x0A' && bytes.size() > 4 && bytes[1] != '\0') {
        return load_sentencepiece(path, std::move(bytes), ModelConfigs{});
    }
    return load_llama2c(path, std::move(bytes));
}

}  // namespace kv
