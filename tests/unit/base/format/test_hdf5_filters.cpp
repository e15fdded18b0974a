// The filters kvtools registers in place of HDF5's (lib/base/src/format/hdf5_filters.hpp): byte
// for byte HDF5's own shuffle, Fletcher32 and deflate, both ways, and reads that hold each chunk
// to its size, including a chunk whose filter mask skips the stage that checks it, or every stage.
#include "../../../../lib/base/src/format/hdf5_file.hpp"
#include "../../../../lib/base/src/format/hdf5_filters.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

// HDF5's own filter classes and its filter table (exported by libhdf5, declared in its private
// headers): the reference, and what a read uses.
extern "C" const H5Z_class2_t H5Z_SHUFFLE[1];
extern "C" const H5Z_class2_t H5Z_FLETCHER32[1];
extern "C" const H5Z_class2_t H5Z_DEFLATE[1];
extern "C" H5Z_class2_t* H5Z_find(H5Z_filter_t id);

namespace {

std::vector<unsigned char> random_bytes(std::size_t count, uint32_t seed) {
    std::mt19937 random(seed);
    std::vector<unsigned char> bytes(count);
    for (unsigned char& byte : bytes)
        byte = static_cast<unsigned char>(random() % 7);  // compressible
    return bytes;
}

// One pass of a filter over a copy of `input` in an HDF5 buffer; empty with ok false on failure.
struct Pass {
    bool ok = false;
    std::vector<unsigned char> output;
};
Pass run(const H5Z_class2_t& filter, unsigned flags, std::vector<unsigned> values,
         const std::vector<unsigned char>& input) {
    std::size_t size = std::max<std::size_t>(input.size(), 1);
    void* buffer = H5allocate_memory(size, false);
    if (!input.empty()) std::memcpy(buffer, input.data(), input.size());
    const std::size_t result =
        filter.filter(flags, values.size(), values.data(), input.size(), &size, &buffer);
    Pass pass;
    pass.ok = result != 0 || input.empty();
    if (pass.ok)
        pass.output.assign(static_cast<unsigned char*>(buffer),
                           static_cast<unsigned char*>(buffer) + result);
    H5free_memory(buffer);
    return pass;
}

// A 1-D int64 dataset of `count` values in chunks of 3, with `filters` set on it.
hid_t make_dataset(hid_t file, const char* name, hsize_t count, void (*filters)(hid_t)) {
    const hid_t properties = H5Pcreate(H5P_DATASET_CREATE);
    const hsize_t chunk = 3;
    H5Pset_chunk(properties, 1, &chunk);
    filters(properties);
    const hid_t space = H5Screate_simple(1, &count, nullptr);
    const hid_t dataset =
        H5Dcreate2(file, name, H5T_STD_I64LE, space, H5P_DEFAULT, properties, H5P_DEFAULT);
    H5Sclose(space);
    H5Pclose(properties);
    return dataset;
}

}  // namespace

TEST_CASE("kvtools' shuffle, Fletcher32 and deflate are HDF5's, byte for byte", "[hdf5_filters]") {
    const auto lock = kv::format::lock_hdf5();
    for (const std::size_t bytes : {0, 1, 5, 24, 23, 1000, 4099}) {
        const std::vector<unsigned char> data = random_bytes(bytes, static_cast<uint32_t>(bytes));
        INFO(bytes << " bytes");
        for (const unsigned element : {1u, 2u, 3u, 4u, 8u}) {
            INFO("shuffle of " << element << "-byte elements");
            const H5Z_class2_t& ours = *H5Z_find(H5Z_FILTER_SHUFFLE);
            REQUIRE(ours.filter != H5Z_SHUFFLE->filter);
            const Pass shuffled = run(ours, 0, {element}, data);
            CHECK(shuffled.output == run(*H5Z_SHUFFLE, 0, {element}, data).output);
            CHECK(run(ours, H5Z_FLAG_REVERSE, {element}, shuffled.output).output == data);
        }
        const H5Z_class2_t& fletcher32 = *H5Z_find(H5Z_FILTER_FLETCHER32);
        REQUIRE(fletcher32.filter != H5Z_FLETCHER32->filter);
        const Pass summed = run(fletcher32, 0, {}, data);
        CHECK(summed.output == run(*H5Z_FLETCHER32, 0, {}, data).output);
        CHECK(run(fletcher32, H5Z_FLAG_REVERSE, {}, summed.output).output == data);
        std::vector<unsigned char> damaged = summed.output;
        damaged[damaged.size() / 2] ^= 1;
        CHECK_FALSE(run(fletcher32, H5Z_FLAG_REVERSE, {}, damaged).ok);
        CHECK(kv::format::take_filter_problem() == "data error detected by Fletcher32 checksum");
        const H5Z_class2_t& deflate = *H5Z_find(H5Z_FILTER_DEFLATE);
        REQUIRE(deflate.filter != H5Z_DEFLATE->filter);
        if (bytes > 0) {  // HDF5 fails deflating nothing; so does this
            const Pass compressed = run(deflate, 0, {6}, data);
            REQUIRE(compressed.ok);
            CHECK(compressed.output == run(*H5Z_DEFLATE, 0, {6}, data).output);
            const Pass reference = run(*H5Z_DEFLATE, H5Z_FLAG_REVERSE, {6}, compressed.output);
            CHECK(reference.output == data);
            CHECK(run(deflate, H5Z_FLAG_REVERSE, {6}, compressed.output).output == data);
        }
    }
    // Too short to hold a checksum: HDF5's own would read before the buffer.
    CHECK_FALSE(run(*H5Z_find(H5Z_FILTER_FLETCHER32), H5Z_FLAG_REVERSE, {}, {1, 2, 3}).ok);
    CHECK_FALSE(run(*H5Z_find(H5Z_FILTER_DEFLATE), H5Z_FLAG_REVERSE, {6}, {1, 2, 3}).ok);
    CHECK(kv::format::take_filter_problem() == "a deflate chunk that does not decompress");
}

TEST_CASE("a read holds every chunk to its size, whatever its filter mask", "[hdf5_filters]") {
    const kv::test::TempDir dir;
    const auto path = dir / "chunks.h5";
    const auto lock = kv::format::lock_hdf5();
    const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(file >= 0);
    const auto shuffle_and_sum = [](hid_t properties) {
        H5Pset_shuffle(properties);
        H5Pset_fletcher32(properties);
    };
    // 3 int64 values: 24 bytes a chunk. Stored as 23 + a valid checksum.
    std::vector<unsigned char> short_chunk = random_bytes(23, 1);
    const Pass summed = run(*H5Z_FLETCHER32, 0, {}, short_chunk);
    const hsize_t origin = 0;
    const hid_t plain = make_dataset(file, "short", 3, shuffle_and_sum);
    REQUIRE(H5Dwrite_chunk(plain, H5P_DEFAULT, 0, &origin, summed.output.size(),
                           summed.output.data()) >= 0);
    // The same chunk marked as not shuffled (mask bit 0): its last stage is Fletcher32's. (A
    // dataset of one chunk keeps no mask: two chunks.)
    const hid_t skipped = make_dataset(file, "skipped", 6, shuffle_and_sum);
    for (const hsize_t at : {hsize_t{0}, hsize_t{3}})
        REQUIRE(H5Dwrite_chunk(skipped, H5P_DEFAULT, 1, &at, summed.output.size(),
                               summed.output.data()) >= 0);
    int64_t values[6] = {};
    CHECK(kv::format::read_dataset(plain, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values) <
          0);
    CHECK(kv::format::take_filter_problem() ==
          "a chunk that decodes to 23 bytes where the dataset's chunks hold 24");
    H5Eclear2(H5E_DEFAULT);
    // Padded with zeros, neither read past (a sanitizer build would see it) nor filled with
    // whatever followed in the buffer (the checksum).
    REQUIRE(kv::format::read_dataset(skipped, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                     values) >= 0);
    unsigned char expected[48] = {};
    std::memcpy(expected, short_chunk.data(), 23);
    std::memcpy(expected + 24, short_chunk.data(), 23);
    CHECK(std::memcmp(values, expected, sizeof expected) == 0);
    // Every filter skipped: no stage runs to hold it, so the read refuses it beforehand.
    const hid_t unfiltered = make_dataset(file, "unfiltered", 6, shuffle_and_sum);
    for (const hsize_t at : {hsize_t{0}, hsize_t{3}})
        REQUIRE(H5Dwrite_chunk(unfiltered, H5P_DEFAULT, 3, &at, short_chunk.size(),
                               short_chunk.data()) >= 0);
    CHECK(kv::format::read_dataset(unfiltered, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                   values) < 0);
    CHECK(kv::format::take_filter_problem() ==
          "a chunk stored unfiltered in 23 bytes where the dataset's chunks hold 24");
    H5Eclear2(H5E_DEFAULT);
    // A sound chunk reads as written.
    const hid_t sound = make_dataset(file, "sound", 3, shuffle_and_sum);
    const int64_t written[3] = {-1, 1 << 20, 7};
    std::memset(values, 0, sizeof values);
    REQUIRE(H5Dwrite(sound, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, written) >= 0);
    REQUIRE(kv::format::read_dataset(sound, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                     values) >= 0);
    CHECK(std::memcmp(values, written, sizeof written) == 0);
    for (const hid_t dataset : {plain, skipped, unfiltered, sound})
        H5Dclose(dataset);
    H5Fclose(file);
}
