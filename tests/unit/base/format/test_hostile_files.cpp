// Cache files an attacker made: HDF5 metadata changed and its checksums recomputed
// (tests/fuzz/hdf5_checksums.hpp), which HDF5 1.10 would follow out of bounds. The reader's
// checking driver refuses each with a message (hdf5_read_driver.cpp) instead of crashing.
#include "../../../fuzz/hdf5_checksums.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"

#include <catch2/catch.hpp>

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

// Every error reading the file gives, one per line: opening it, then each packet (as kvinspect
// check goes on past a bad one), then the adapter.
std::string errors(const std::filesystem::path& path) {
    std::string messages;
    try {
        const kv::CacheReader reader(path);
        for (const kv::PacketInfo& info : reader.packets()) {
            try {
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

}  // namespace

TEST_CASE("the checksum repair leaves sound files as they are and restores every checksum") {
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

TEST_CASE("crafted HDF5 metadata is refused with a message, never followed") {
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
        {"hdf5-attribute-vlen-huge-characters",
         "attribute 'format_version' of '/': a variable-length type of 4278190081-byte elements"},
        {"hdf5-fixed-array-fewer-entries", "a chunk index whose size is not the dataset's"},
        {"hdf5-object-header-larger-than-file", "corrupt object header (larger than the file)"},
        {"hdf5-fill-value-longer-than-message",
         "corrupt object header (a fill value message too short)"},
        {"hdf5-dense-attribute-message-overflow", "an attribute message larger than its space"},
        {"hdf5-fractal-heap-width-zero",
         "a fractal heap whose doubling table is impossible (width 0, first block 1024"},
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
        INFO(name);
        const std::string message = errors(folder / name);
        CHECK(message.find(expected) != std::string::npos);
    }
}
