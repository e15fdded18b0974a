// The checksum HDF5 keeps over its metadata (superblocks, object headers, B-trees, heaps), for
// the writer that repairs one HDF5 leaves stale and the fuzz targets that repair what they mutate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kv {

/// Bob Jenkins' lookup3 hashlittle(): H5_checksum_lookup3 with initial value `initial`.
inline uint32_t hdf5_lookup3(const uint8_t* data, std::size_t length, uint32_t initial = 0) {
    auto rotate = [](uint32_t x, int k) { return (x << k) | (x >> (32 - k)); };
    auto word = [](const uint8_t* p) {
        return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
    };
    uint32_t a, b, c;
    a = b = c = 0xdeadbeef + static_cast<uint32_t>(length) + initial;
    while (length > 12) {
        a += word(data);
        b += word(data + 4);
        c += word(data + 8);
        a -= c, a ^= rotate(c, 4), c += b;
        b -= a, b ^= rotate(a, 6), a += c;
        c -= b, c ^= rotate(b, 8), b += a;
        a -= c, a ^= rotate(c, 16), c += b;
        b -= a, b ^= rotate(a, 19), a += c;
        c -= b, c ^= rotate(b, 4), b += a;
        length -= 12;
        data += 12;
    }
    if (length == 0) return c;
    uint8_t tail[12] = {};
    std::memcpy(tail, data, length);
    a += word(tail);
    b += word(tail + 4);
    c += word(tail + 8);
    c ^= b, c -= rotate(b, 14);
    a ^= c, a -= rotate(c, 11);
    b ^= a, b -= rotate(a, 25);
    c ^= b, c -= rotate(b, 16);
    a ^= c, a -= rotate(c, 4);
    b ^= a, b -= rotate(a, 14);
    c ^= b, c -= rotate(b, 24);
    return c;
}

}  // namespace kv
