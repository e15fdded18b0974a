// Recomputes the checksums of an HDF5 file after its bytes were changed, as an attacker who edits
// a file (rather than a disk that flips its bits) would: the lookup3 checksums of the metadata
// HDF5 1.10 writes with checksums (superblock v2/v3, object headers and their continuation
// chunks, fixed-array headers, data blocks and pages, fractal heap headers and root direct
// blocks, v2 B-tree headers and root leaves, free-space headers and section lists) and the
// Fletcher32 checksum at the end of every filtered chunk a fixed array lists. Each structure is
// read as HDF5 would read it from the changed bytes (its sizes and addresses as they now are), so
// that HDF5 finds the checksums right and goes on to trust what they cover. Files with other than
// 8-byte addresses and lengths are left alone. Used by the cache_file fuzz target's mutator and
// tested on the conformance corpus (repairing an unchanged file changes nothing).
#pragma once

#include "../../lib/base/src/format/hdf5_checksum.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

namespace kv::fuzz {

using kv::hdf5_lookup3;

/// H5_checksum_fletcher32: 16-bit big-endian words, sums started at 0.
inline uint32_t hdf5_fletcher32(const uint8_t* data, std::size_t length) {
    std::size_t words = length / 2;
    uint32_t sum1 = 0, sum2 = 0;
    while (words) {
        std::size_t run = words > 360 ? 360 : words;
        words -= run;
        do {
            sum1 += static_cast<uint32_t>(data[0]) << 8 | data[1];
            data += 2;
            sum2 += sum1;
        } while (--run);
        sum1 = (sum1 & 0xffff) + (sum1 >> 16);
        sum2 = (sum2 & 0xffff) + (sum2 >> 16);
    }
    if (length % 2) {
        sum1 += static_cast<uint32_t>(*data) << 8;
        sum2 += sum1;
        sum1 = (sum1 & 0xffff) + (sum1 >> 16);
        sum2 = (sum2 & 0xffff) + (sum2 >> 16);
    }
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
    return sum2 << 16 | sum1;
}

namespace detail {

struct Image {
    uint8_t* data;
    std::size_t size;
    uint64_t base;  ///< where the superblock is (after a user block): addresses count from there
    std::vector<uint64_t>* written;  ///< where checksums were stored, when asked

    bool fits(uint64_t at, uint64_t length) const {
        return at <= size && length <= size - at;
    }
    uint64_t load(uint64_t at, int bytes) const {
        uint64_t value = 0;
        for (int i = bytes - 1; i >= 0; --i)
            value = value << 8 | data[at + static_cast<uint64_t>(i)];
        return value;
    }
    void store32(uint64_t at, uint32_t value) {
        if (written) written->push_back(at);
        for (int i = 0; i < 4; ++i)
            data[at + static_cast<uint64_t>(i)] = static_cast<uint8_t>(value >> (8 * i));
    }
    bool has(uint64_t at, const char* signature) const {
        return fits(at, 4) && std::memcmp(data + at, signature, 4) == 0;
    }
    /// An address in the file as an offset in the image, or size when it is outside.
    uint64_t offset(uint64_t address) const {
        return address > size || base > size - address ? size : base + address;
    }
    /// Stores the lookup3 checksum of [at, at + length) after it.
    void seal(uint64_t at, uint64_t length) {
        if (fits(at, length) && fits(at + length, 4))
            store32(at + length, hdf5_lookup3(data + at, static_cast<std::size_t>(length)));
    }
};

// Object header messages of a version-2 header chunk [from, to): repairs the continuation
// chunks they point to ("OCHK", checksum at the end of the length the message gives).
inline void repair_continuations(Image& image, uint64_t from, uint64_t to, bool creation_order,
                                 std::set<uint64_t>& seen, int depth) {
    const uint64_t header = creation_order ? 6 : 4;
    for (uint64_t at = from; at + header <= to;) {
        const uint64_t type = image.data[at];
        const uint64_t size = image.load(at + 1, 2);
        const uint64_t data = at + header;
        if (size > to - data) return;
        if (type == 0x10 && size >= 16 && depth < 64) {
            const uint64_t chunk = image.offset(image.load(data, 8));
            const uint64_t length = image.load(data + 8, 8);
            if (length >= 8 && image.fits(chunk, length) && image.has(chunk, "OCHK") &&
                seen.insert(chunk).second) {
                repair_continuations(image, chunk + 4, chunk + length - 4, creation_order, seen,
                                     depth + 1);
                image.seal(chunk, length - 4);
            }
        }
        at = data + size;
    }
}

inline void repair_object_header(Image& image, uint64_t at, std::set<uint64_t>& seen) {
    if (!image.fits(at, 7) || image.data[at + 4] != 2) return;
    const unsigned flags = image.data[at + 5];
    uint64_t p = at + 6 + ((flags & 0x20) ? 16 : 0) + ((flags & 0x10) ? 4 : 0);
    const int size_bytes = 1 << (flags & 3);
    if (!image.fits(p, static_cast<uint64_t>(size_bytes))) return;
    const uint64_t chunk = image.load(p, size_bytes);
    p += static_cast<uint64_t>(size_bytes);
    if (!image.fits(p, chunk)) return;
    repair_continuations(image, p, p + chunk, (flags & 0x04) != 0, seen, 0);
    image.seal(at, p + chunk - at);
}

// A fixed array's header and data block (pages included), then the Fletcher32 of the filtered
// chunks it lists.
inline void repair_fixed_array(Image& image, uint64_t at) {
    constexpr uint64_t header_size = 4 + 1 + 1 + 1 + 1 + 8 + 8;
    if (!image.fits(at, header_size + 4)) return;
    const unsigned client = image.data[at + 5];
    const uint64_t entry = image.data[at + 6];
    const unsigned page_bits = image.data[at + 7];
    const uint64_t entries = image.load(at + 8, 8);
    const uint64_t block = image.offset(image.load(at + 16, 8));
    image.seal(at, header_size);
    if (entry == 0 || page_bits >= 32 || entries > image.size || !image.has(block, "FADB")) return;
    const uint64_t per_page = uint64_t{1} << page_bits;
    const uint64_t pages = entries > per_page ? (entries + per_page - 1) / per_page : 0;
    const uint64_t prefix = 4 + 1 + 1 + 8 + (pages + 7) / 8;
    const uint64_t elements = block + prefix + (pages ? 4 : 0);
    if (pages == 0) {
        if (!image.fits(block, prefix + entries * entry + 4)) return;
        image.seal(block, prefix + entries * entry);
    } else {
        image.seal(block, prefix);
        uint64_t page = elements;
        for (uint64_t left = entries; left > 0;) {
            const uint64_t count = left < per_page ? left : per_page;
            if (!image.fits(page, count * entry + 4)) return;
            image.seal(page, count * entry);
            page += count * entry + 4;
            left -= count;
        }
    }
    // Filtered chunk entries: address (8), size (entry - 12 bytes), filter mask (4).
    if (client != 1 || entry <= 12 || entry > 20) return;
    for (uint64_t i = 0; i < entries; ++i) {
        uint64_t place = elements + i * entry;
        if (pages) place += (i / per_page) * 4;  // each earlier page's checksum
        if (!image.fits(place, entry)) return;
        const uint64_t chunk = image.offset(image.load(place, 8));
        const uint64_t length = image.load(place + 8, static_cast<int>(entry - 12));
        if (length > 4 && image.fits(chunk, length))
            image.store32(chunk + length - 4,
                          hdf5_fletcher32(image.data + chunk, static_cast<std::size_t>(length - 4)));
    }
}

// A fractal heap's header and, when the root is a direct block with checksums, that block.
inline void repair_fractal_heap(Image& image, uint64_t at) {
    constexpr uint64_t fixed = 142;  // with 8-byte addresses and lengths, before any filter
    if (!image.fits(at, fixed + 4)) return;
    const uint64_t filter_length = image.load(at + 7, 2);
    const unsigned flags = image.data[at + 9];
    const uint64_t start_block = image.load(at + 112, 8);
    const uint64_t max_heap_bits = image.load(at + 128, 2);
    const uint64_t root = image.offset(image.load(at + 132, 8));
    const uint64_t root_rows = image.load(at + 140, 2);
    const uint64_t length = fixed + (filter_length ? 12 + filter_length : 0);
    if (!image.fits(at, length + 4)) return;
    image.seal(at, length);
    if (!(flags & 2) || root_rows != 0 || filter_length != 0 || !image.has(root, "FHDB")) return;
    const uint64_t checksum = root + 4 + 1 + 8 + (max_heap_bits + 7) / 8;
    if (checksum + 4 > root + start_block || !image.fits(root, start_block)) return;
    image.store32(checksum, 0);
    image.store32(checksum,
                  hdf5_lookup3(image.data + root, static_cast<std::size_t>(start_block)));
}

// A v2 B-tree's header and, when the root is a leaf, that leaf.
inline void repair_btree(Image& image, uint64_t at) {
    constexpr uint64_t header_size = 34;
    if (!image.fits(at, header_size + 4)) return;
    const uint64_t node_size = image.load(at + 6, 4);
    const uint64_t record_size = image.load(at + 10, 2);
    const uint64_t depth = image.load(at + 12, 2);
    const uint64_t root = image.offset(image.load(at + 16, 8));
    const uint64_t records = image.load(at + 24, 2);
    image.seal(at, header_size);
    if (depth != 0 || !image.has(root, "BTLF")) return;
    const uint64_t length = 6 + records * record_size;
    if (length + 4 <= node_size && image.fits(root, length + 4)) image.seal(root, length);
}

// A free-space manager's header and its serialized section list.
inline void repair_free_space(Image& image, uint64_t at) {
    constexpr uint64_t header_size = 78;
    if (!image.fits(at, header_size + 4)) return;
    const uint64_t sections = image.offset(image.load(at + 54, 8));
    const uint64_t used = image.load(at + 62, 8);
    image.seal(at, header_size);
    if (used > 4 && image.has(sections, "FSSE") && image.fits(sections, used))
        image.seal(sections, used - 4);
}

}  // namespace detail

/// Recomputes every checksum this header knows of (above) in place; `written` (optional) gets the
/// offset of each checksum stored.
inline void repair_hdf5_checksums(uint8_t* data, std::size_t size,
                                  std::vector<uint64_t>* written = nullptr) {
    static const uint8_t signature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
    uint64_t base = 0;
    while (base + 8 <= size && std::memcmp(data + base, signature, 8) != 0)
        base = base ? base * 2 : 512;
    if (base + 12 > size) return;
    detail::Image image{data, size, base, written};
    const unsigned version = data[base + 8];
    if (version != 2 && version != 3) return;  // earlier superblocks carry no checksums
    if (data[base + 9] != 8 || data[base + 10] != 8) return;
    image.seal(base, 12 + 4 * 8);
    std::set<uint64_t> continuations;
    for (uint64_t at = base; at + 4 <= size; ++at) {
        if (data[at] == 'O' && image.has(at, "OHDR"))
            detail::repair_object_header(image, at, continuations);
        else if (data[at] == 'F' && image.has(at, "FAHD"))
            detail::repair_fixed_array(image, at);
        else if (data[at] == 'F' && image.has(at, "FRHP"))
            detail::repair_fractal_heap(image, at);
        else if (data[at] == 'B' && image.has(at, "BTHD"))
            detail::repair_btree(image, at);
        else if (data[at] == 'F' && image.has(at, "FSHD"))
            detail::repair_free_space(image, at);
    }
}

}  // namespace kv::fuzz
