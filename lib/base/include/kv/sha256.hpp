// SHA-256 (FIPS 180-4) for fingerprints: tokenizer files, model metadata, cache checksums.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace kv {

/// Incremental SHA-256: update() any number of times, then digest() or hex() once.
class Sha256 {
  public:
    Sha256();
    void update(std::string_view bytes);
    void update(const void* data, size_t size);
    /// The 32-byte digest; finishes the hash, so later update() calls start nothing new.
    std::array<uint8_t, 32> digest();
    /// The digest as 64 lowercase hex digits.
    std::string hex();

  private:
    void compress(const uint8_t* block);

    std::array<uint32_t, 8> state_;
    std::array<uint8_t, 64> buffer_{};
    size_t buffered_ = 0;
    uint64_t total_bytes_ = 0;
    bool finished_ = false;
};

/// Hex SHA-256 of bytes.
std::string sha256_hex(std::string_view bytes);

}  // namespace kv
