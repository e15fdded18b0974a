// Shared by the fuzz targets: the library reads files, so each input is written to a scratch
// file first; kv::Error is the expected outcome of bad input, anything else escapes and is a bug.
#pragma once

#include "kv/error.hpp"

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace kv::fuzz {

/// A folder of this process's own, removed when the process exits normally.
struct ScratchFolder {
    std::filesystem::path path;
    ScratchFolder() {
        const char* base = std::getenv("TMPDIR");
        path = std::filesystem::path(base && *base ? base : "/tmp") /
               ("kv-fuzz-" + std::to_string(::getpid()));
        std::filesystem::create_directories(path);
    }
    ~ScratchFolder() {
        std::error_code ignored;
        std::filesystem::remove_all(path, ignored);
    }
};

/// A file named `name` in the process's scratch folder, rewritten for every input.
inline std::filesystem::path scratch_file(const std::string& name, const uint8_t* data,
                                          std::size_t size) {
    static const ScratchFolder folder;
    const std::filesystem::path path = folder.path / name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    return path;
}

/// Runs `body`; the typed errors bad input must produce are swallowed, everything else is not.
template <typename Body>
void expect_clean_outcome(Body&& body) {
    try {
        body();
    } catch (const kv::Error&) {
    }
}

}  // namespace kv::fuzz
