// UTF-8 helpers shared by the JSON module and the tokenizers (internal to the library).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kv::utf8 {

/// Length of the well-formed UTF-8 sequence at p (RFC 3629: no overlong forms, no surrogates,
/// nothing above U+10FFFF), or 0 when the bytes there are not one.
inline size_t valid_length(const unsigned char* p, const unsigned char* end) {
    auto continuation = [&](size_t offset, unsigned char low = 0x80, unsigned char high = 0xBF) {
        return p + offset < end && p[offset] >= low && p[offset] <= high;
    };
    unsigned char c = p[0];
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return continuation(1) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        unsigned char low = c == 0xE0 ? 0xA0 : 0x80;
        unsigned char high = c == 0xED ? 0x9F : 0xBF;
        return continuation(1, low, high) && continuation(2) ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        unsigned char low = c == 0xF0 ? 0x90 : 0x80;
        unsigned char high = c == 0xF4 ? 0x8F : 0xBF;
        return continuation(1, low, high) && continuation(2) && continuation(3) ? 4 : 0;
    }
    return 0;
}

inline size_t valid_length(std::string_view text, size_t at) {
    auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
    return valid_length(bytes + at, bytes + text.size());
}

/// Whether the bytes from p to end are the start of a well-formed sequence that lacks its last
/// bytes (so more input could complete it).
inline bool is_incomplete_sequence(const unsigned char* p, const unsigned char* end) {
    size_t available = static_cast<size_t>(end - p);
    if (available == 0 || p[0] < 0xC2 || p[0] > 0xF4) return false;
    size_t needed = p[0] < 0xE0 ? 2 : p[0] < 0xF0 ? 3 : 4;
    if (available >= needed) return false;
    for (size_t i = 1; i < available; ++i) {
        unsigned char low = 0x80, high = 0xBF;
        if (i == 1 && p[0] == 0xE0) low = 0xA0;
        if (i == 1 && p[0] == 0xED) high = 0x9F;
        if (i == 1 && p[0] == 0xF0) low = 0x90;
        if (i == 1 && p[0] == 0xF4) high = 0x8F;
        if (p[i] < low || p[i] > high) return false;
    }
    return true;
}

/// The code point of a well-formed sequence of the given length at p.
inline uint32_t decode(const unsigned char* p, size_t length) {
    switch (length) {
        case 1:
            return p[0];
        case 2:
            return (uint32_t{p[0]} & 0x1F) << 6 | (p[1] & 0x3F);
        case 3:
            return (uint32_t{p[0]} & 0x0F) << 12 | (uint32_t{p[1]} & 0x3F) << 6 | (p[2] & 0x3F);
        default:
            return (uint32_t{p[0]} & 0x07) << 18 | (uint32_t{p[1]} & 0x3F) << 12 |
                   (uint32_t{p[2]} & 0x3F) << 6 | (p[3] & 0x3F);
    }
}

inline void append(std::string& out, uint32_t code_point) {
    if (code_point < 0x80) {
        out += static_cast<char>(code_point);
    } else if (code_point < 0x800) {
        out += static_cast<char>(0xC0 | (code_point >> 6));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    } else if (code_point < 0x10000) {
        out += static_cast<char>(0xE0 | (code_point >> 12));
        out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (code_point >> 18));
        out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    }
}

inline constexpr std::string_view replacement_character = "\xEF\xBF\xBD";

}  // namespace kv::utf8
