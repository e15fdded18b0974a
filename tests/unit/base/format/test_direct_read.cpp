// Keys and values read without HDF5's filter pipeline (lib/base/src/format/direct_read.hpp):
// Fletcher32 as HDF5 computes it, the unshuffle, and whole tensors read the same as HDF5 reads
// them, with a damaged chunk still a clean error.
#include "../../../../lib/base/src/format/direct_read.hpp"
#include "../../../../lib/base/src/format/hdf5_file.hpp"
#include "cache_fixtures.hpp"
#include "kv/error.hpp"
#include "test_support.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>

// HDF5's own checksum (exported by libhdf5, declared in its private headers).
extern "C" uint32_t H5_checksum_fletcher32(const void* data, size_t length);

namespace {

std::vector<std::byte> random_bytes(std::size_t count, uint32_t seed) {
    std::mt19937 random(seed);
    std::vector<std::byte> bytes(count);
    for (std::byte& byte : bytes)
        byte = static_cast<std::byte>(random());
    return bytes;
}

// A keys or values dataset of a file, read by read_tensor_directly (`direct` says whether it
// did) and by H5Dread.
struct BothReads {
    bool direct = false;
    std::vector<std::byte> directly, by_hdf5;
};

BothReads read_both(const std::filesystem::path& path, const std::string& dataset_path,
                    std::size_t element_size, hid_t memory_type, int threads = 2) {
    const auto lock = kv::format::lock_hdf5();
    kv::RawSource raw;
    raw.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(raw.fd >= 0);
    raw.size = std::filesystem::file_size(path);
    const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    REQUIRE(file >= 0);
    const hid_t dataset = H5Dopen2(file, dataset_path.c_str(), H5P_DEFAULT);
    REQUIRE(dataset >= 0);
    const hid_t space = H5Dget_space(dataset);
    hsize_t dims[4] = {};
    REQUIRE(H5Sget_simple_extent_dims(space, dims, nullptr) == 4);
    H5Sclose(space);
    BothReads reads;
    reads.directly.resize(dims[0] * dims[1] * dims[2] * dims[3] * element_size);
    reads.by_hdf5.resize(reads.directly.size());
    kv::PlaneTargets planes;
    planes.head_stride = dims[2] * dims[3] * element_size;
    for (hsize_t layer = 0; layer < dims[0]; ++layer)
        planes.layers.push_back(reads.directly.data() + layer * dims[1] * planes.head_stride);
    // A thread for every byte: the test's tensors are small, and every thread must take part.
    reads.direct = kv::format::read_tensor_directly(dataset, raw, element_size, dims, planes,
                                                    threads, /*bytes_per_thread=*/1);
    REQUIRE(H5Dread(dataset, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, reads.by_hdf5.data()) >=
            0);
    H5Dclose(dataset);
    H5Fclose(file);
    ::close(raw.fd);
    return reads;
}

// Where the first stored chunk of a dataset lies: {offset, size}.
std::pair<uint64_t, uint64_t> first_chunk(const std::filesystem::path& path,
                                          const std::string& dataset_path) {
    const auto lock = kv::format::lock_hdf5();
    const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const hid_t dataset = H5Dopen2(file, dataset_path.c_str(), H5P_DEFAULT);
    const hsize_t origin[4] = {0, 0, 0, 0};
    unsigned mask = 0;
    haddr_t address = 0;
    hsize_t size = 0;
    REQUIRE(H5Dget_chunk_info_by_coord(dataset, origin, &mask, &address, &size) >= 0);
    H5Dclose(dataset);
    H5Fclose(file);
    return {address, size};
}

void flip_byte(const std::filesystem::path& path, uint64_t at) {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(at));
    char byte = 0;
    file.read(&byte, 1);
    file.seekp(static_cast<std::streamoff>(at));
    byte = static_cast<char>(byte ^ 0xff);
    file.write(&byte, 1);
}

}  // namespace

TEST_CASE("a read starts a thread per 512 KiB of output, within the threads it may use",
          "[direct_read]") {
    using kv::format::read_bytes_per_thread;
    using kv::format::threads_for;
    CHECK(read_bytes_per_thread == std::size_t{512} << 10);
    // A demo-model packet's keys (260 tokens x 1 KiB: 260 KiB) stay on the calling thread.
    CHECK(threads_for(260 << 10, 2, read_bytes_per_thread) == 1);
    CHECK(threads_for(0, 2, read_bytes_per_thread) == 1);
    CHECK(threads_for((std::size_t{1} << 20) - 1, 8, read_bytes_per_thread) == 1);
    CHECK(threads_for(std::size_t{1} << 20, 8, read_bytes_per_thread) == 2);
    // A 1B model's 32k-token keys (512 MiB) use every thread allowed, and never fewer than one.
    CHECK(threads_for(std::size_t{512} << 20, 2, read_bytes_per_thread) == 2);
    CHECK(threads_for(std::size_t{512} << 20, 0, read_bytes_per_thread) == 1);
    CHECK(threads_for(std::size_t{512} << 20, 3, 0) == 3);
}

TEST_CASE("Fletcher32 is HDF5's, whole or in pieces", "[direct_read]") {
    for (std::size_t length :
         {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{15}, std::size_t{16},
          std::size_t{17}, std::size_t{63}, std::size_t{64}, std::size_t{65}, std::size_t{719},
          std::size_t{720}, std::size_t{721}, std::size_t{1441}, std::size_t{4096},
          std::size_t{65537}, std::size_t{1} << 20}) {
        const std::vector<std::byte> bytes = random_bytes(length, static_cast<uint32_t>(length));
        const uint32_t expected = H5_checksum_fletcher32(bytes.data(), bytes.size());
        CHECK(kv::format::fletcher32(bytes.data(), bytes.size()) == expected);
        kv::format::Fletcher32 pieces;
        std::size_t at = 0;
        for (std::size_t piece = 720; at + piece < length; at += piece, piece += 720)
            pieces.update(bytes.data() + at, piece);
        pieces.update(bytes.data() + at, length - at);
        CHECK(pieces.value() == expected);
        // As stored after a chunk: little-endian, or byte-swapped within each half (HDF5
        // before 1.6.3).
        const unsigned char stored[4] = {
            static_cast<unsigned char>(expected), static_cast<unsigned char>(expected >> 8),
            static_cast<unsigned char>(expected >> 16), static_cast<unsigned char>(expected >> 24)};
        const unsigned char swapped[4] = {stored[1], stored[0], stored[3], stored[2]};
        unsigned char wrong[4] = {stored[0], stored[1], stored[2], stored[3]};
        wrong[0] ^= 1u;
        CHECK(kv::format::fletcher32_matches(stored, expected));
        CHECK(kv::format::fletcher32_matches(swapped, expected));
        CHECK(!kv::format::fletcher32_matches(wrong, expected));
    }
    // All ones: the sums' largest values, where the folds matter most.
    const std::vector<std::byte> ones(4099, std::byte{0xff});
    CHECK(kv::format::fletcher32(ones.data(), ones.size()) ==
          H5_checksum_fletcher32(ones.data(), ones.size()));
}

TEST_CASE("unshuffle undoes HDF5's byte shuffle, also for the first values only", "[direct_read]") {
    for (std::size_t size : {std::size_t{1}, std::size_t{2}, std::size_t{4}, std::size_t{3}}) {
        const std::size_t total = 100;
        const std::vector<std::byte> plain = random_bytes(total * size, 7);
        std::vector<std::byte> shuffled(plain.size());
        for (std::size_t i = 0; i < total; ++i)
            for (std::size_t b = 0; b < size; ++b)
                shuffled[b * total + i] = plain[i * size + b];
        for (std::size_t elements : {total, std::size_t{37}, std::size_t{0}}) {
            std::vector<std::byte> out(elements * size);
            kv::format::unshuffle(shuffled.data(), total, size, elements, out.data());
            CHECK(out == std::vector<std::byte>(
                             plain.begin(), plain.begin() + static_cast<long>(elements * size)));
        }
    }
}

TEST_CASE("keys and values are read directly as HDF5 reads them, in every layout kvtools writes",
          "[direct_read]") {
    kv::test::TempDir dir;
    for (const kv::CacheDtype dtype : {kv::CacheDtype::f32, kv::CacheDtype::bf16}) {
        const kv::CacheModelInfo model = kv::test::test_model(dtype);
        // 300 tokens: in chunks of 128, the last holds 44 rows of 128 (HDF5 stores it whole).
        const std::vector<kv::Packet> packets = {kv::test::make_packet(model, "long", 300, 1),
                                                 kv::test::make_packet(model, "short", 5, 2)};
        for (const int level : {3, 0})
            for (const int64_t chunk_tokens : {int64_t{0}, int64_t{128}})
                for (const int threads : {1, 3}) {
                    CAPTURE(cache_dtype_name(dtype), level, chunk_tokens, threads);
                    kv::CacheWriteOptions options;
                    options.zstd_level = level;
                    options.chunk_tokens = chunk_tokens;
                    const auto path = dir.path() / "store.kvc";
                    std::filesystem::remove(path);
                    kv::test::write_store(path, model, packets, options);
                    const hid_t memory_type =
                        dtype == kv::CacheDtype::f32 ? H5T_NATIVE_FLOAT : H5T_NATIVE_UINT16;
                    for (const char* name : {"keys", "values"}) {
                        const BothReads reads =
                            read_both(path, std::string("/packets/00000000/") + name,
                                      cache_dtype_size(dtype), memory_type, threads);
                        CHECK(reads.direct);
                        CHECK(reads.directly == reads.by_hdf5);
                    }
                    kv::CacheReader reader(path);
                    reader.set_threads(threads);
                    for (const kv::Packet& written : packets) {
                        const kv::Packet read = reader.read(written.id);
                        CHECK(read.keys == written.keys);
                        CHECK(read.values == written.values);
                        std::vector<std::byte> keys(written.keys.size()),
                            values(written.values.size());
                        const kv::Packet rest = reader.read_into(written.id, keys, values);
                        CHECK(keys == written.keys);
                        CHECK(values == written.values);
                        CHECK(rest.keys.empty());
                        CHECK(rest.positions == written.positions);
                    }
                    const kv::TensorLayout layout = reader.tensor_layout();
                    CHECK(layout.name == (chunk_tokens == 0 ? "chunks-1mib" : "chunks-128"));
                    CHECK(layout.storage == "chunked");
                    CHECK(layout.chunk_tokens == (chunk_tokens == 0 ? 300 : 128));
                    CHECK(layout.filters ==
                          (level > 0 ? std::vector<std::string>{"shuffle", "zstd", "fletcher32"}
                                     : std::vector<std::string>{"fletcher32"}));
                    CHECK(reader.format_version() == "1.7");
                }
    }
}

TEST_CASE("read_into planes further apart than the packet's: each plane's rows in its place",
          "[direct_read]") {
    // A decoder's cache: every head has room for more tokens than the packet brings, and the
    // packet goes after rows it already holds. Files read directly (contiguous, zstd,
    // uncompressed, chunks of both shapes) and through HDF5 (gzip, big-endian: a hyperslab per
    // layer), quantised (dequantised, then copied), each against read(); each piece reported as it
    // lands.
    const std::filesystem::path good = std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache" / "good";
    for (const char* name :
         {"0001_minimal.kvc", "0002_f32_zstd.kvc", "0003_bf16.kvc", "0004_f16.kvc",
          "0007_gzip_big_endian_earliest.kvc", "0010_many_packets.kvc", "0013_quantized.kvc",
          "0017_chunks_1mib.kvc", "0018_chunks_1mib_uncompressed.kvc"}) {
        CAPTURE(name);
        const kv::CacheReader reader(good / name);
        const kv::CacheModelInfo& m = reader.model();
        const std::size_t row = static_cast<std::size_t>(m.head_dim) * cache_dtype_size(m.dtype);
        for (const kv::PacketInfo& info : reader.packets()) {
            CAPTURE(info.id);
            const kv::Packet whole = reader.read(info.id);
            const auto tokens = static_cast<std::size_t>(info.stored_length);
            const std::size_t before = 5, room = tokens + 7;  // rows held, rows per head
            const auto layers = static_cast<std::size_t>(m.num_layers);
            const auto heads = static_cast<std::size_t>(m.num_kv_heads);
            std::vector<std::byte> keys(layers * heads * room * row, std::byte{0xab});
            std::vector<std::byte> values = keys;
            kv::PlaneTargets key_planes, value_planes;
            key_planes.head_stride = value_planes.head_stride = room * row;
            for (std::size_t layer = 0; layer < layers; ++layer) {
                key_planes.layers.push_back(keys.data() + (layer * heads * room + before) * row);
                value_planes.layers.push_back(values.data() +
                                              (layer * heads * room + before) * row);
            }
            // Every row reported landed once, holding its bytes by then.
            std::mutex mutex;
            std::vector<int> reported(2 * layers * heads * tokens);
            std::size_t wrong_when_reported = 0;
            for (const bool is_keys : {true, false}) {
                kv::PlaneTargets& planes = is_keys ? key_planes : value_planes;
                const std::vector<std::byte>& expected = is_keys ? whole.keys : whole.values;
                planes.landed = [&, is_keys](std::size_t layer, std::size_t head, std::size_t first,
                                             std::size_t rows) {
                    const std::lock_guard lock(mutex);
                    const std::size_t plane = layer * heads + head;
                    for (std::size_t r = first; r < first + rows && r < tokens; ++r)
                        ++reported[(is_keys ? 0 : layers * heads * tokens) + plane * tokens + r];
                    if (first + rows > tokens ||
                        std::memcmp(planes.plane(layer, head) + first * row,
                                    expected.data() + (plane * tokens + first) * row,
                                    rows * row) != 0)
                        ++wrong_when_reported;
                };
            }
            const kv::Packet rest = reader.read_into(info.id, key_planes, value_planes);
            CHECK(wrong_when_reported == 0);
            CHECK(std::count(reported.begin(), reported.end(), 1) ==
                  static_cast<std::ptrdiff_t>(reported.size()));
            CHECK(rest.keys.empty());
            CHECK(rest.positions == whole.positions);
            CHECK(rest.token_ids == whole.token_ids);
            std::size_t misplaced = 0;
            for (std::size_t plane = 0; plane < layers * heads; ++plane)
                for (std::size_t r = 0; r < room; ++r)
                    for (std::size_t b = 0; b < row; ++b) {
                        const std::size_t at = (plane * room + r) * row + b;
                        const bool inside = r >= before && r < before + tokens;
                        const std::size_t from = (plane * tokens + r - before) * row + b;
                        if (keys[at] != (inside ? whole.keys[from] : std::byte{0xab}) ||
                            values[at] != (inside ? whole.values[from] : std::byte{0xab}))
                            ++misplaced;
                    }
            CHECK(misplaced == 0);
        }
    }
}

TEST_CASE("read_into refuses tensors of the wrong size", "[direct_read]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = kv::test::test_model();
    const auto path = dir.path() / "store.kvc";
    kv::test::write_store(path, model, {kv::test::make_packet(model, "doc", 10, 1)});
    const kv::CacheReader reader(path);
    std::vector<std::byte> keys(3 * 2 * 10 * 8 * 4), values(keys.size() - 4);
    CHECK_THROWS_AS(reader.read_into("doc", keys, values), kv::UsageError);
}

TEST_CASE("the corpus files that HDF5 would read chunk by chunk are read directly the same",
          "[direct_read]") {
    const std::filesystem::path good = std::filesystem::path(KV_TEST_DATA_DIR) / "kvcache" / "good";
    for (const char* name : {"0002_f32_zstd.kvc", "0010_many_packets.kvc", "0017_chunks_1mib.kvc",
                             "0018_chunks_1mib_uncompressed.kvc"}) {
        CAPTURE(name);
        const BothReads reads =
            read_both(good / name, "/packets/00000000/keys", 4, H5T_NATIVE_FLOAT);
        CHECK(reads.direct);
        CHECK(reads.directly == reads.by_hdf5);
    }
    // Big-endian keys (0007) are not the memory's bytes; the reader leaves them to HDF5.
    const kv::CacheReader reader(good / "0007_gzip_big_endian_earliest.kvc");
    CHECK(reader.tensor_layout().filters == std::vector<std::string>{"deflate", "fletcher32"});
}

TEST_CASE("a flipped byte in a chunk read directly is still a clean checksum error",
          "[direct_read]") {
    kv::test::TempDir dir;
    const kv::CacheModelInfo model = kv::test::test_model(kv::CacheDtype::bf16);
    const kv::Packet packet = kv::test::make_packet(model, "doc", 300, 3);
    for (const int level : {3, 0}) {
        CAPTURE(level);
        kv::CacheWriteOptions options;
        options.zstd_level = level;
        const auto path = dir.path() / "store.kvc";
        std::filesystem::remove(path);
        kv::test::write_store(path, model, {packet}, options);
        const auto [offset, size] = first_chunk(path, "/packets/00000000/values");
        flip_byte(path, offset + size / 2);
        const kv::CacheReader reader(path);
        CHECK_THROWS_WITH(reader.read("doc"),
                          Catch::Contains("packet 'doc': cannot read 'values': data error "
                                          "detected by Fletcher32 checksum"));
        std::vector<std::byte> keys(packet.keys.size()), values(packet.values.size());
        CHECK_THROWS_AS(reader.read_into("doc", keys, values), kv::FormatError);
    }
}
