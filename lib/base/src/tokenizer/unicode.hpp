// Unicode normalization for tokenizer.json normalizers (internal to the library).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kv::unicode {

/// Normalization Form C (canonical decomposition, then composition) of UTF-8 text. Bytes that
/// are not UTF-8 pass through unchanged and interrupt composition.
std::string nfc(std::string_view text);

namespace tables {

struct Decomposition {
    uint32_t code_point;
    uint32_t offset;  // into decomposed_code_points
    uint32_t length;
};
struct Composition {
    uint32_t first, second, composite;
};
struct CombiningClassRange {
    uint32_t first, last;
    uint32_t combining_class;
};

// Sorted by code point (compositions by first, then second); see unicode_tables.cpp.
extern const Decomposition decompositions[];
extern const size_t decomposition_count;
extern const uint32_t decomposed_code_points[];
extern const Composition compositions[];
extern const size_t composition_count;
extern const CombiningClassRange combining_classes[];
extern const size_t combining_class_count;

}  // namespace tables

}  // namespace kv::unicode
