// Cache files an attacker made: HDF5 metadata changed and its checksums recomputed
// (tests/fuzz/hdf5_checksums.hpp), which HDF5 1.10 would follow out of bounds. The reader's
// checking driver refuses each with a message (hdf5_read_driver.cpp) instead of crashing.
#include "../../../fuzz/hdf5_checksums.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<uint8_t> read_bytes(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every error reading the file gives, one per line, read as the fuzz target reads it: opening
// it, then each packet (as kvinspect check goes on past a bad one), then the adapter.
std::string errors(const std::filesystem::path& path) {
    std::string messages;
    try {
        const kv::CacheReader reader(path);
        for (const kv::PacketInfo& info : reader.packets()) {
            try {
                reader.has_index(info.id);
                reader.read(info.id);
            } catch (const kv::Error& error) {
                messages += error.what() + std::string("\n");
            }
        }
        if (reader.has_adapter()) reader.read_adapter();
    } catch (const kv::Error& error) {
        messages += error.what() + std::string("\n");
    }
    return messages;
}

// errors() of `bytes` as a file, their HDF5 checksums recomputed first (an attacker's edit).
std::string errors_after_repair(std::vector<uint8_t> bytes) {
    kv::fuzz::repair_hdf5_checksums(bytes.data(), bytes.size());
    const kv::test::TempDir dir;
    const auto path = dir / "crafted.kvc";
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
    return errors(path);
}

}  // namespace

TEST_CASE("the checksum repair leaves sound files as they are and restores every checksum",
          "[hostile]") {
    int files = 0;
    for (const auto& entry : std::filesystem::directory_iterator(
             std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache/good")) {
        const std::vector<uint8_t> original = read_bytes(entry.path());
        std::vector<uint8_t> bytes = original;
        std::vector<uint64_t> written;
        kv::fuzz::repair_hdf5_checksums(bytes.data(), bytes.size(), &written);
        INFO(entry.path().filename().string());
        CHECK(bytes == original);
        // Every checksum it knows of, overwritten and recomputed.
        for (uint64_t at : written)
            for (int i = 0; i < 4; ++i)
                bytes[at + static_cast<uint64_t>(i)] ^= 0x5a;
        if (!written.empty()) CHECK(bytes != original);
        kv::fuzz::repair_hdf5_checksums(bytes.data(), bytes.size());
        CHECK(bytes == original);
        ++files;
    }
    CHECK(files >= 15);
}

TEST_CASE("crafted HDF5 metadata is refused with a message, never followed", "[hostile]") {
    const std::filesystem::path folder =
        std::filesystem::path(KV_TEST_DATA_DIR) / "../fuzz/regressions/cache_file";
    const std::pair<const char*, const char*> cases[] = {
        {"hdf5-attribute-info-undefined-address-accumulator", "an address outside the file"},
        {"hdf5-btree-record-size", "a B-tree whose records do not fit its nodes"},
        {"hdf5-btree-root-records", "more records than fit"},
        {"hdf5-btree-shared-attribute", "a shared attribute"},
        {"hdf5-btree-wrong-type", "a B-tree of type 2 where an index of attribute names belongs"},
        {"hdf5-packet-attribute-heap-index", "a string points to a missing or wrong global heap"},
        {"hdf5-chunk-element-size", "element size differs from its datatype's"},
        {"hdf5-vlen-string-huge-characters", "a variable-length type of 4278190081-byte elements"},
        // Its root group's version-1 header counts 12 messages and holds 35, which had left its
        // attributes unchecked (the reader refused the string attribute later, when it read it).
        {"hdf5-attribute-vlen-huge-characters",
         "corrupt object header (a version-1 header of 35 messages that counts 12)"},
        // The same miscount; an attribute's values were read past their end (H5A__read).
        {"hdf5-v1-header-message-count",
         "cannot open the HDF5 file: corrupt object header (a version-1 header of 35 messages "
         "that counts 12)"},
        // A dataset of 4 dimensions whose maximum ones were smaller: its fixed array of chunks
        // was sized by those and indexed by the others (H5FA_get).
        {"hdf5-dataspace-maximum-below-current",
         "cannot open dataset 'keys': corrupt object header (a dataspace whose maximum dimensions "
         "are smaller than its dimensions)"},
        // A link message 2 bytes past the end of a group's third continuation chunk: HDF5
        // refuses the header, but after decoding an attribute before it past its values.
        {"hdf5-message-larger-than-chunk",
         "cannot open group '/packets/00000001': corrupt object header (a message larger than its "
         "chunk)"},
        // A chunked layout of no dimensions at all, not even the element size (SIGFPE in
        // H5D__chunk_set_info).
        {"hdf5-chunked-layout-rank-zero",
         "cannot open dataset 'positions': corrupt object header (a chunked layout of 0 "
         "dimensions)"},
        {"hdf5-fixed-array-fewer-entries", "a chunk index whose size is not the dataset's"},
        // A version-4 chunked layout of 16 bytes, its fixed array's address taken from the bytes
        // after it: an array of 3 chunks for a dataset of 4, read past in H5FA_get.
        {"hdf5-chunked-layout-index-address-short",
         "packet '100%': cannot open dataset 'keys': corrupt object header (a chunked layout that "
         "does not fit its message)"},
        {"hdf5-object-header-larger-than-file", "corrupt object header (larger than the file)"},
        {"hdf5-fill-value-longer-than-message",
         "corrupt object header (a fill value message too short)"},
        {"hdf5-dense-attribute-message-overflow", "an attribute message larger than its space"},
        // 16,711,682 layers in /model, keys of 2: 9.6 GB were set aside before the shape was
        // compared with the dataset's.
        {"packet-tensor-shape-allocated-before-checked",
         "'keys' has shape [2, 2, 18, 4], expected [16711682, 2, 18, 4]"},
        {"hdf5-continuation-message-short",
         "cannot open group '/packets/00000001': corrupt object header (a continuation message "
         "too short)"},
        {"hdf5-attribute-dataspace-short",
         "cannot read attribute 'format': corrupt object header (an attribute whose dataspace does "
         "not fit its message)"},
        {"hdf5-dense-attribute-heap-id-length",
         "cannot open group '/model': corrupt object header (an attribute message larger than its "
         "space)"},
        {"hdf5-fractal-heap-width-zero",
         "a fractal heap whose doubling table is impossible (width 0, first block 1024"},
        {"hdf5-number-bits-outside-bytes",
         "corrupt object header (an attribute of a floating-point number whose exponent or "
         "mantissa lies outside its bits)"},
        {"hdf5-attribute-name-without-end",
         "corrupt object header (an attribute whose name has no end)"},
        // The same in an attribute read without a file to check heap ids against (21 GB); the
        // group's header also ends a message past its chunk, which is what refuses it now.
        {"hdf5-vlen-huge-characters-unguarded-read",
         "cannot open group '/packets/00000000': corrupt object header (a message larger than its "
         "chunk)"},
        // A header's prefix cut short by the end of the file (SEGV in H5_checksum_lookup3); a
        // group's continuation of fewer bytes than "OCHK" and a checksum is refused before (the
        // cut-short check has its own case below).
        {"hdf5-object-header-cut-short",
         "cannot open group 'quantized': corrupt object header (a continuation chunk too short "
         "for its signature and checksum)"},
        {"hdf5-empty-object-comment", "corrupt object header (an object comment that has no end)"},
        {"hdf5-chunk-unfiltered-short",
         "cannot read 'positions': a chunk stored unfiltered in 38 bytes where the dataset's "
         "chunks hold 144"},
        {"hdf5-packet-attribute-string-unchecked",
         "an attribute string: a string points outside the global heap"},
        {"hdf5-layout-version-2-compact-empty",
         "a dataset layout of version 2, older than the format"},
        {"hdf5-vlen-type-size-short",
         "attribute 'format': corrupt object header (an attribute of a variable-length type of 14 "
         "bytes (HDF5 stores 16))"},
        // Its pipeline (shuffle, zstd, a filter 0 where Fletcher32 was) gave HDF5 a chunk a byte
        // short, read past; the filter is refused before anything is read.
        {"hdf5-chunk-pipeline-output-short",
         "cannot read 'positions': a dataset compressed with HDF5 filter 0, which kvtools does "
         "not read"},
    };
    for (const auto& [name, expected] : cases) {
        const std::string message = errors(folder / name);
        INFO(name << ": " << message);
        CHECK(message.find(expected) != std::string::npos);
    }
}

TEST_CASE("a number type whose bits lie outside its bytes is refused", "[hostile]") {
    // good/0001_minimal.kvc's 8-byte signed integer attributes (class 0, version 1, signed, 8
    // bytes, bit offset 0, precision 64), their precision made 72, checksums recomputed.
    std::vector<uint8_t> bytes =
        read_bytes(std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache/good/0001_minimal.kvc");
    const std::vector<uint8_t> integer = {0x10, 0x08, 0x00, 0x00, 0x08, 0x00,
                                          0x00, 0x00, 0x00, 0x00, 0x40, 0x00};
    int changed = 0;
    for (auto at = bytes.begin();
         (at = std::search(at, bytes.end(), integer.begin(), integer.end())) != bytes.end();
         ++at, ++changed)
        at[10] = 0x48;
    REQUIRE(changed > 0);
    CHECK_THAT(errors_after_repair(bytes),
               Catch::Contains("a number of 8 bytes whose 72 bits start at bit 0"));
}

TEST_CASE("a filter name without its terminating zero is refused", "[hostile]") {
    // broken/0039's LZF filter (version 2 pipeline: id 32000, name length 4, "lzf\0"), its zero
    // made an 'x', checksums recomputed: HDF5 would size the name with strlen.
    std::vector<uint8_t> bytes = read_bytes(std::filesystem::path(KV_TEST_DATA_DIR) /
                                            "kvcache/broken/0039_filter_not_in_format.kvc");
    const std::vector<uint8_t> name = {'l', 'z', 'f', 0};
    const auto at = std::search(bytes.begin(), bytes.end(), name.begin(), name.end());
    REQUIRE(at != bytes.end());
    at[3] = 'x';
    CHECK_THAT(errors_after_repair(bytes), Catch::Contains("a filter whose name has no end"));
}

TEST_CASE("a dataspace whose rank needs more bytes than its message has is refused", "[hostile]") {
    // good/0001_minimal.kvc's keys and values: dataspace version 2, rank 4, maximum dimensions
    // given, simple (68 bytes), their rank made 5 (84 bytes), checksums recomputed: HDF5 would
    // read the last dimensions from the bytes after the message.
    std::vector<uint8_t> bytes =
        read_bytes(std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache/good/0001_minimal.kvc");
    const std::vector<uint8_t> dataspace = {0x02, 0x04, 0x01, 0x01};
    int changed = 0;
    for (auto at = bytes.begin();
         (at = std::search(at, bytes.end(), dataspace.begin(), dataspace.end())) != bytes.end();
         ++at, ++changed)
        at[1] = 0x05;
    REQUIRE(changed == 2);
    CHECK_THAT(errors_after_repair(bytes),
               Catch::Contains("a dataspace whose dimensions do not fit its message"));
}

TEST_CASE("a continuation that cannot be followed is refused", "[hostile]") {
    // good/0001_minimal.kvc's root group: a version-2 header whose continuation message (at byte
    // 56: type 0x10, 16 bytes, flags; address, length) leads to the chunk at 481, whose own
    // continuation (at 507) leads to 662. Each edited, checksums recomputed.
    const std::vector<uint8_t> minimal =
        read_bytes(std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache/good/0001_minimal.kvc");
    // The message at `message` with its address (field 0) or length (field 1) made `value`.
    auto edited = [&](std::size_t message, int field, uint64_t value) {
        std::vector<uint8_t> bytes = minimal;
        REQUIRE(bytes[message] == 0x10);
        const std::size_t at = message + 4 + 8 * static_cast<std::size_t>(field);
        for (int i = 0; i < 8; ++i)
            bytes[at + static_cast<std::size_t>(i)] = static_cast<uint8_t>(value >> (8 * i));
        return errors_after_repair(bytes);
    };
    REQUIRE(minimal.size() > 700);
    REQUIRE(std::equal(minimal.begin() + 481, minimal.begin() + 485, "OCHK"));
    // A chunk that continues into itself: HDF5 1.10 read the header without the messages after
    // the loop (the file's 'complete' mark among them).
    CHECK_THAT(edited(507, 0, 481),
               Catch::Contains("corrupt object header (a continuation to a chunk already listed)"));
    // 6 bytes cannot hold "OCHK" and a checksum.
    CHECK_THAT(edited(56, 1, 6),
               Catch::Contains("corrupt object header (a continuation chunk too short for its "
                               "signature and checksum)"));
    CHECK_THAT(edited(56, 0, UINT64_MAX - 3),
               Catch::Contains("corrupt object header (a continuation past the largest address)"));
}

TEST_CASE("a version-1 header's continuation that cannot be followed is refused", "[hostile]") {
    // good/0007_gzip_big_endian_earliest.kvc (HDF5's earliest format, h5py's default): the root
    // group's version-1 header (at 96, messages from 112) continues at 112 (type 0x10, 16 bytes;
    // address, length) to the chunk at 800, whose first message continues to 39984. Version 1
    // has no signature and no checksum: a continuation in a chunk another led to cannot be a
    // look-alike's bytes, one in the first chunk can (its address and loops are left to HDF5;
    // a length over 16 MiB past the file is refused in either).
    const std::vector<uint8_t> earliest = read_bytes(
        std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache/good/0007_gzip_big_endian_earliest.kvc");
    REQUIRE(earliest.size() > 900);
    // The little-endian field of `bytes` wide at `at` made `value`.
    auto edited = [&](std::size_t message, std::size_t at, int bytes, uint64_t value) {
        std::vector<uint8_t> file = earliest;
        REQUIRE(file[message] == 0x10);
        REQUIRE(file[message + 1] == 0x00);
        for (int i = 0; i < bytes; ++i)
            file[at + static_cast<std::size_t>(i)] = static_cast<uint8_t>(value >> (8 * i));
        return errors_after_repair(file);
    };
    CHECK(errors_after_repair(earliest).empty());
    // Into the chunk it lies in.
    CHECK_THAT(edited(800, 808, 8, 800),
               Catch::Contains("corrupt object header (a continuation to a chunk already listed)"));
    CHECK_THAT(edited(800, 808, 8, UINT64_MAX - 3),
               Catch::Contains("corrupt object header (a continuation past the largest address)"));
    // A message of 8 bytes, which HDF5 would decode as 16.
    CHECK_THAT(edited(800, 802, 2, 8),
               Catch::Contains("corrupt object header (a continuation message too short)"));
    // 1 GiB of a file of 49 KB, which HDF5 would allocate before reading, from either chunk.
    CHECK_THAT(edited(800, 816, 8, uint64_t{1} << 30),
               Catch::Contains("corrupt object header (larger than the file)"));
    CHECK_THAT(edited(112, 128, 8, uint64_t{1} << 30),
               Catch::Contains("corrupt object header (larger than the file)"));
    // The first chunk continuing into itself is left to HDF5, which refuses it.
    CHECK_THAT(edited(112, 120, 8, 112), Catch::Contains("cannot open the HDF5 file"));
}

TEST_CASE("an object header cut short by the end of the file is refused", "[hostile]") {
    // good/0001_minimal.kvc's root group links 'model' to its header ("OHDR"); the link moved to
    // the file's last 10 bytes, made "OHDR", version 2, flags 0x20 (times stored: a 26-byte
    // prefix before the chunk's size), checksums recomputed. HDF5 reads a header's prefix no
    // further than the end of the file and decodes it from whatever that read gave it.
    std::vector<uint8_t> bytes =
        read_bytes(std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache/good/0001_minimal.kvc");
    auto address_at = [&](std::size_t at) {
        uint64_t value = 0;
        for (int i = 7; i >= 0; --i)
            value = value << 8 | bytes[at + static_cast<std::size_t>(i)];
        return value;
    };
    const std::string name = "model";
    std::size_t link = 0;
    for (auto at = bytes.begin();
         (at = std::search(at, bytes.end(), name.begin(), name.end())) != bytes.end(); ++at) {
        const auto after = static_cast<std::size_t>(at - bytes.begin()) + name.size();
        if (after + 8 > bytes.size()) break;
        const uint64_t target = address_at(after);
        if (target + 4 <= bytes.size() &&
            std::equal(bytes.begin() + static_cast<long>(target),
                       bytes.begin() + static_cast<long>(target) + 4, "OHDR"))
            link = after;
    }
    REQUIRE(link != 0);
    const uint64_t last = bytes.size() - 10;
    for (int i = 0; i < 8; ++i)
        bytes[link + static_cast<std::size_t>(i)] = static_cast<uint8_t>(last >> (8 * i));
    const uint8_t prefix[] = {'O', 'H', 'D', 'R', 2, 0x20};
    std::copy(std::begin(prefix), std::end(prefix), bytes.begin() + static_cast<long>(last));
    CHECK_THAT(errors_after_repair(bytes),
               Catch::Contains("cannot open group '/model': corrupt object header (cut short by "
                               "the end of the file)"));
}
