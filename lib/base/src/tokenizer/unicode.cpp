// NFC as Unicode Standard Annex #15 describes it, over the tables in unicode_tables.cpp.

#include <algorithm>
#include <vector>

#include "../utf8.hpp"
#include "unicode.hpp"

namespace kv::unicode {

namespace {

// Hangul syllables decompose and compose by arithmetic (Unicode chapter 3.12).
constexpr uint32_t hangul_s_base = 0xAC00, hangul_l_base = 0x1100, hangul_v_base = 0x1161,
                   hangul_t_base = 0x11A7;
constexpr uint32_t hangul_l_count = 19, hangul_v_count = 21, hangul_t_count = 28;
constexpr uint32_t hangul_n_count = hangul_v_count * hangul_t_count;
constexpr uint32_t hangul_s_count = hangul_l_count * hangul_n_count;

// Bytes that are not UTF-8 ride along as values above any code point; they never combine.
constexpr uint32_t raw_byte_flag = 0x8000'0000;

uint32_t combining_class(uint32_t code_point) {
    const auto* begin = tables::combining_classes;
    const auto* end = begin + tables::combining_class_count;
    auto it = std::upper_bound(begin, end, code_point,
                               [](uint32_t cp, const auto& range) { return cp < range.first; });
    if (it == begin) return 0;
    --it;
    return code_point <= it->last ? it->combining_class : 0;
}

void decompose(uint32_t code_point, std::vector<uint32_t>& out) {
    if (code_point >= hangul_s_base && code_point < hangul_s_base + hangul_s_count) {
        uint32_t index = code_point - hangul_s_base;
        out.push_back(hangul_l_base + index / hangul_n_count);
        out.push_back(hangul_v_base + (index % hangul_n_count) / hangul_t_count);
        if (index % hangul_t_count != 0) out.push_back(hangul_t_base + index % hangul_t_count);
        return;
    }
    const auto* begin = tables::decompositions;
    const auto* end = begin + tables::decomposition_count;
    auto it = std::lower_bound(begin, end, code_point, [](const auto& entry, uint32_t cp) {
        return entry.code_point < cp;
    });
    if (it == end || it->code_point != code_point) {
        out.push_back(code_point);
        return;
    }
    const uint32_t* parts = tables::decomposed_code_points + it->offset;
    out.insert(out.end(), parts, parts + it->length);
}

// The primary composite of a pair, or 0.
uint32_t compose(uint32_t first, uint32_t second) {
    if (first >= hangul_l_base && first < hangul_l_base + hangul_l_count &&
        second >= hangul_v_base && second < hangul_v_base + hangul_v_count) {
        return hangul_s_base +
               ((first - hangul_l_base) * hangul_v_count + (second - hangul_v_base)) *
                   hangul_t_count;
    }
    if (first >= hangul_s_base && first < hangul_s_base + hangul_s_count &&
        (first - hangul_s_base) % hangul_t_count == 0 && second > hangul_t_base &&
        second < hangul_t_base + hangul_t_count) {
        return first + (second - hangul_t_base);
    }
    const auto* begin = tables::compositions;
    const auto* end = begin + tables::composition_count;
    auto it = std::lower_bound(begin, end, std::pair{first, second},
                               [](const auto& entry, const std::pair<uint32_t, uint32_t>& key) {
                                   return std::pair{entry.first, entry.second} < key;
                               });
    return it != end && it->first == first && it->second == second ? it->composite : 0;
}

}  // namespace

std::string nfc(std::string_view text) {
    // Below U+0300 nothing decomposes or combines, which covers ASCII and most Latin text.
    if (std::all_of(text.begin(), text.end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0xCC; })) {
        return std::string(text);
    }
    std::vector<uint32_t> decomposed;
    decomposed.reserve(text.size());
    auto* p = reinterpret_cast<const unsigned char*>(text.data());
    auto* end = p + text.size();
    while (p < end) {
        size_t length = utf8::valid_length(p, end);
        if (length == 0) {
            decomposed.push_back(raw_byte_flag | *p++);
            continue;
        }
        decompose(utf8::decode(p, length), decomposed);
        p += length;
    }

    // Canonical order: marks between two starters sorted by class, stably.
    std::vector<uint32_t> classes(decomposed.size());
    for (size_t i = 0; i < decomposed.size(); ++i) {
        classes[i] = decomposed[i] & raw_byte_flag ? 0 : combining_class(decomposed[i]);
    }
    for (size_t i = 1; i < decomposed.size(); ++i) {
        for (size_t j = i; j > 0 && classes[j] != 0 && classes[j - 1] > classes[j]; --j) {
            std::swap(classes[j], classes[j - 1]);
            std::swap(decomposed[j], decomposed[j - 1]);
        }
    }

    std::vector<uint32_t> composed;
    composed.reserve(decomposed.size());
    std::vector<uint32_t> composed_classes;
    size_t starter = SIZE_MAX;
    uint32_t last_class = 0;
    for (size_t i = 0; i < decomposed.size(); ++i) {
        uint32_t code_point = decomposed[i];
        uint32_t current_class = classes[i];
        // A mark composes with the last starter unless a mark of the same or a higher class
        // (or a starter) stands between them.
        bool reachable =
            starter != SIZE_MAX && !(code_point & raw_byte_flag) &&
            !(composed[starter] & raw_byte_flag) &&
            (last_class < current_class || (last_class == 0 && starter + 1 == composed.size()));
        if (reachable) {
            if (uint32_t composite = compose(composed[starter], code_point)) {
                composed[starter] = composite;
                continue;
            }
        }
        if (current_class == 0) starter = composed.size();
        last_class = current_class;
        composed.push_back(code_point);
    }

    std::string out;
    out.reserve(text.size());
    for (uint32_t code_point : composed) {
        if (code_point & raw_byte_flag) {
            out += static_cast<char>(code_point & 0xFF);
        } else {
            utf8::append(out, code_point);
        }
    }
    return out;
}

}  // namespace kv::unicode
