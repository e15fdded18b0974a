// What every library test may need: a private temporary directory, small file helpers, and where
// the real model files are (../shared/models, or $KV_MODELS_DIR).
#pragma once

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

// Byte buffers print as their size: Catch2 would otherwise stream them element by element, and
// the libtorch precompiled header brings glog's vector printer, which cannot print std::byte.
namespace Catch {
template <>
struct StringMaker<std::vector<std::byte>> {
    static std::string convert(const std::vector<std::byte>& bytes) {
        return "<" + std::to_string(bytes.size()) + " bytes>";
    }
};
}  // namespace Catch

namespace kv::test {

/// A fresh directory under the system's temporary directory, removed with everything in it, so
/// that test cases never collide, even under ctest -j.
class TempDir {
  public:
    TempDir() {
        std::string pattern =
            (std::filesystem::temp_directory_path() / "kvtools-test-XXXXXX").string();
        if (!mkdtemp(pattern.data())) throw std::runtime_error("cannot create a temp directory");
        path_ = pattern;
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    ~TempDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path_, ignored);
    }
    const std::filesystem::path& path() const { return path_; }
    std::filesystem::path operator/(std::string_view name) const { return path_ / name; }

  private:
    std::filesystem::path path_;
};

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write " + path.string());
}

inline std::string read_text(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

inline std::filesystem::path shared_models_dir() {
    if (const char* dir = std::getenv("KV_MODELS_DIR")) return dir;
    return KV_SHARED_MODELS_DIR;
}

/// The path of a shared model file, or an empty path (with a Catch2 warning) when it is absent,
/// so that the calling test can skip.
inline std::filesystem::path shared_model_file(const std::string& relative) {
    const std::filesystem::path path = shared_models_dir() / relative;
    if (!std::filesystem::exists(path)) {
        WARN("skipped: model file " << path << " is absent");
        return {};
    }
    return path;
}

}  // namespace kv::test
