// Read-only memory mapping of a whole file, shared by everything that views into it.
//
// Model weights are viewed in place (tensors wrap the mapping with a deleter that holds this
// object), so a model loads without copying when its stored dtype is the compute dtype.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>

namespace kv {

class MappedFile {
  public:
    /// Maps the file read-only. Throws IoError naming the path and the system's reason.
    static std::shared_ptr<const MappedFile> open(const std::filesystem::path& path);

    ~MappedFile();
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const std::byte* data() const { return data_; }
    std::size_t size() const { return size_; }
    const std::filesystem::path& path() const { return path_; }

  private:
    MappedFile() = default;
    const std::byte* data_ = nullptr;
    std::size_t size_ = 0;
    std::filesystem::path path_;
};

/// Reads a whole (small) file into a string; throws IoError naming the path.
std::string read_file_text(const std::filesystem::path& path);

/// Reads standard input to its end (closed or unreadable: IoError with the system's reason).
std::string read_standard_input();

/// Writes bytes to path atomically: a temporary file in the same directory, fsync, then rename.
/// Nothing is ever left under `path` half written; throws IoError.
void write_file_atomic(const std::filesystem::path& path, const void* data, std::size_t size);

}  // namespace kv
