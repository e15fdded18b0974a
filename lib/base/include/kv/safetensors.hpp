// The safetensors format: an 8-byte little-endian header length, a JSON header mapping tensor
// names to {dtype, shape, data_offsets}, then the raw little-endian tensor bytes.
//
// Reading maps the file and hands out views (no copy); writing is atomic. Supported dtypes are
// F32, F16, BF16, I32, I64 and U8 (the ones kvtools reads or writes); others are reported by name.
#pragma once

#include "kv/mapped_file.hpp"

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kv {

struct SafetensorsEntry {
    std::string name;
    std::string dtype;  ///< as written in the file: "F32", "BF16", ...
    std::vector<int64_t> shape;
    std::size_t offset = 0;  ///< byte offset of the data from the start of the file
    std::size_t size = 0;    ///< bytes
};

class SafetensorsFile {
  public:
    /// Maps and validates the file: header bounds, JSON, dtypes, offsets inside the data and
    /// consistent with shape x element size. Throws FormatError naming the file and the tensor.
    static SafetensorsFile open(const std::filesystem::path& path);

    const std::vector<SafetensorsEntry>& entries() const { return entries_; }
    const SafetensorsEntry* find(const std::string& name) const;
    const std::byte* data(const SafetensorsEntry& entry) const {
        return file_->data() + entry.offset;
    }
    const std::shared_ptr<const MappedFile>& mapping() const { return file_; }
    const std::map<std::string, std::string>& metadata() const { return metadata_; }

  private:
    std::shared_ptr<const MappedFile> file_;
    std::vector<SafetensorsEntry> entries_;
    std::map<std::string, std::string> metadata_;
};

/// Bytes per element of a safetensors dtype name; throws UnsupportedError for other names.
std::size_t safetensors_element_size(const std::string& dtype);

struct SafetensorsTensorView {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    const void* data = nullptr;
    std::size_t size = 0;  ///< bytes; must equal product(shape) x element size
};

/// Writes tensors (in the order given) and string metadata to path, atomically.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorsTensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace kv
