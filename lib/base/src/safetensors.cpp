#include "kv/safetensors.hpp"

#include "kv/error.hpp"
#include "kv/json.hpp"

#include <cstring>
#include <limits>

namespace kv {
namespace {

constexpr std::uint64_t max_header_bytes = 100u << 20;  // the format's own limit is 100 MB

std::uint64_t read_le64(const std::byte* bytes) {
    std::uint64_t value = 0;
    for (int i = 7; i >= 0; --i)
        value = (value << 8) | static_cast<std::uint8_t>(bytes[i]);
    return value;
}

}  // namespace

std::size_t safetensors_element_size(const std::string& dtype) {
    if (dtype == "F32" || dtype == "I32") return 4;
    if (dtype == "F16" || dtype == "BF16") return 2;
    if (dtype == "I64" || dtype == "F64") return 8;
    if (dtype == "U8" || dtype == "I8" || dtype == "BOOL") return 1;
    throw UnsupportedError("safetensors dtype '" + dtype + "' is not supported");
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
    SafetensorsFile result;
    result.file_ = MappedFile::open(path);
    const std::string source = quoted(path.string());
    const std::size_t file_size = result.file_->size();
    if (file_size < 8)
        throw FormatError(source +
                          " is not a safetensors file: shorter than its 8-byte header length");
    const std::uint64_t header_size = read_le64(result.file_->data());
    if (header_size > max_header_bytes || header_size > file_size - 8)
        throw FormatError(source + ": safetensors header length " + std::to_string(header_size) +
                          " exceeds the file (" + std::to_string(file_size) +
                          " bytes): truncated or not safetensors");
    const std::size_t data_start = 8 + header_size;
    const std::size_t data_size = file_size - data_start;

    json::Value header;
    try {
        header = json::parse(
            std::string_view(reinterpret_cast<const char*>(result.file_->data() + 8), header_size));
    } catch (const FormatError& error) {
        throw FormatError(source + ": bad safetensors header: " + error.what());
    }
    if (!header.is_object())
        throw FormatError(source + ": safetensors header is not a JSON object");

    for (const auto& [name, node] : header.as_object()) {
        if (name == "__metadata__") {
            if (!node.is_object()) throw FormatError(source + ": '__metadata__' is not an object");
            for (const auto& [key, value] : node.as_object())
                if (value.is_string()) result.metadata_[key] = value.as_string();
            continue;
        }
        auto bad = [&, &tensor = name](const std::string& why) {
            return FormatError(source + ": tensor '" + tensor + "': " + why);
        };
        if (!node.is_object()) throw bad("entry is not an object");
        const json::Value* dtype = node.find("dtype");
        const json::Value* shape = node.find("shape");
        const json::Value* offsets = node.find("data_offsets");
        if (!dtype || !dtype->is_string() || !shape || !shape->is_array() || !offsets ||
            !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_integer() ||
            !(*offsets)[1].is_integer())
            throw bad("needs 'dtype', 'shape' and two 'data_offsets'");
        SafetensorsEntry entry;
        entry.name = name;
        entry.dtype = dtype->as_string();
        std::size_t element_size = 0;
        try {
            element_size = safetensors_element_size(entry.dtype);
        } catch (const UnsupportedError&) {
            throw UnsupportedError(source + ": tensor '" + name + "' has unsupported dtype '" +
                                   entry.dtype + "'");
        }
        std::uint64_t elements = 1;
        for (const json::Value& dim : shape->as_array()) {
            if (!dim.is_integer() || dim.as_int() < 0)
                throw bad("shape has a negative or non-integer dimension");
            const auto extent = static_cast<std::uint64_t>(dim.as_int());
            if (extent != 0 && elements > std::numeric_limits<std::uint64_t>::max() / 16 / extent)
                throw bad("shape is too large");
            elements *= extent;
            entry.shape.push_back(dim.as_int());
        }
        const int64_t begin = (*offsets)[0].as_int();
        const int64_t end = (*offsets)[1].as_int();
        if (begin < 0 || end < begin || static_cast<std::uint64_t>(end) > data_size)
            throw bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                      ") fall outside the " + std::to_string(data_size) +
                      " data bytes (truncated file?)");
        if (static_cast<std::uint64_t>(end - begin) != elements * element_size)
            throw bad("data_offsets span " + std::to_string(end - begin) +
                      " bytes but the shape needs " + std::to_string(elements * element_size));
        entry.offset = data_start + static_cast<std::size_t>(begin);
        entry.size = static_cast<std::size_t>(end - begin);
        result.entries_.push_back(std::move(entry));
    }
    return result;
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
    for (const SafetensorsEntry& entry : entries_)
        if (entry.name == name) return &entry;
    return nullptr;
}

void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorsTensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
    json::Value header = json::Value::object();
    if (!metadata.empty()) {
        json::Value meta = json::Value::object();
        for (const auto& [key, value] : metadata)
            meta.set(key, value);
        header.set("__metadata__", std::move(meta));
    }
    std::size_t offset = 0;
    for (const SafetensorsTensorView& tensor : tensors) {
        std::size_t elements = 1;
        json::Value shape = json::Value::array();
        for (int64_t dim : tensor.shape) {
            elements *= static_cast<std::size_t>(dim);
            shape.push_back(dim);
        }
        if (elements * safetensors_element_size(tensor.dtype) != tensor.size)
            throw Error("write_safetensors: tensor '" + tensor.name +
                        "' size does not match its shape");
        json::Value entry = json::Value::object();
        entry.set("dtype", tensor.dtype);
        entry.set("shape", std::move(shape));
        json::Value offsets = json::Value::array();
        offsets.push_back(static_cast<int64_t>(offset));
        offsets.push_back(static_cast<int64_t>(offset + tensor.size));
        entry.set("data_offsets", std::move(offsets));
        header.set(tensor.name, std::move(entry));
        offset += tensor.size;
    }
    std::string header_text = json::dump(header);
    header_text.append((8 - header_text.size() % 8) % 8, ' ');  // keeps tensor data 8-byte aligned
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i)
        bytes[i] = static_cast<char>((header_text.size() >> (8 * i)) & 0xff);
    bytes += header_text;
    bytes.reserve(bytes.size() + offset);
    for (const SafetensorsTensorView& tensor : tensors)
        bytes.append(static_cast<const char*>(tensor.data), tensor.size);
    write_file_atomic(path, bytes.data(), bytes.size());
}

}  // namespace kv
