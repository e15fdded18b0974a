#include "kv/memory.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

TEST_CASE("a bulk-read resize keeps the contents and the new size", "[memory]") {
    for (std::size_t count : {std::size_t{0}, std::size_t{10}, std::size_t{3} << 20}) {
        std::vector<uint16_t> values(5);
        std::iota(values.begin(), values.end(), 1);
        kv::resize_for_bulk_read(values, count);
        REQUIRE(values.size() == count);
        for (std::size_t i = 0; i < std::min<std::size_t>(count, 5); ++i)
            CHECK(values[i] == i + 1);
        for (std::size_t i = 5; i < count; i += 4099)
            CHECK(values[i] == 0);
    }
    // Shrinking keeps the front, as resize does.
    std::vector<float> floats(100, 2.0f);
    kv::resize_for_bulk_read(floats, 7);
    CHECK(floats == std::vector<float>(7, 2.0f));
}

TEST_CASE("huge pages are only a hint", "[memory]") {
    // Null, small, unaligned and large ranges are all accepted; the memory stays usable.
    kv::advise_huge_pages(nullptr, std::size_t{8} << 20);
    std::vector<char> small(100, 'a');
    kv::advise_huge_pages(small.data(), small.size());
    std::vector<char> large((std::size_t{9} << 20) + 123);
    kv::advise_huge_pages(large.data() + 1, large.size() - 1);
    large.back() = 'z';
    CHECK(small.front() == 'a');
    CHECK(large.back() == 'z');
    std::ifstream setting("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string modes;
    std::getline(setting, modes);
    if (modes.empty()) WARN("transparent huge pages are not available here: the hint does nothing");
}

TEST_CASE("the heap grown between two calls is advised for huge pages", "[memory]") {
    std::ifstream setting("/sys/kernel/mm/transparent_hugepage/enabled");
    if (!setting) {
        WARN("transparent huge pages are not available here: nothing to check");
        return;
    }
    kv::advise_heap_huge_pages();
    const void* before = sbrk(0);
    // 96 MiB in blocks of 300 KiB, each touched: the heap grows past the part advised before.
    std::vector<std::vector<char>> blocks;
    for (int i = 0; i < 320; ++i)
        blocks.emplace_back(300 << 10, 'x');
    if (sbrk(0) == before) {
        // AddressSanitizer's allocator (scripts/test-sanitizers) keeps no main heap.
        WARN("the allocator here does not grow the main heap: nothing to advise");
        return;
    }
    kv::advise_heap_huge_pages();
    // The last 2 MiB-aligned byte of the heap lies in a region whose flags say "hg".
    const auto end = reinterpret_cast<std::uintptr_t>(sbrk(0)) & ~((std::uintptr_t{2} << 20) - 1);
    std::ifstream maps("/proc/self/smaps");
    bool inside = false, advised = false, found = false;
    for (std::string line; std::getline(maps, line);) {
        std::uintptr_t first = 0, last = 0;
        // A region's first line is "first-last perms ..." (no field name parses as two numbers).
        if (std::sscanf(line.c_str(), "%lx-%lx ", &first, &last) == 2) {
            inside = first <= end - 1 && end - 1 < last;
            found = found || inside;
        } else if (inside && line.rfind("VmFlags:", 0) == 0) {
            advised = line.find(" hg") != std::string::npos;
            inside = false;
        }
    }
    REQUIRE(found);
    CHECK(advised);
    CHECK(blocks.back().back() == 'x');
}

TEST_CASE("populating pages for writing faults them in and keeps what they hold", "[memory]") {
    // MADV_POPULATE_WRITE, and the byte-per-page way of kernels before 5.14.
    for (auto* populate : {&kv::populate_for_writing, &kv::touch_pages_for_writing}) {
        const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
        const std::size_t pages = 8;
        void* mapped =
            mmap(nullptr, pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        REQUIRE(mapped != MAP_FAILED);
        auto* bytes = static_cast<unsigned char*>(mapped);
        // Marks in pages 1 and 6 (faulted in by them); the range starts and ends inside a page.
        bytes[page + 5] = 17;
        bytes[6 * page + 9] = 23;
        populate(bytes + page + 3, 5 * page + 100);
        std::vector<unsigned char> resident(pages);
        REQUIRE(mincore(mapped, pages * page, resident.data()) == 0);
        CHECK((resident[0] & 1) == 0);  // before the range's page
        for (std::size_t i = 1; i <= 6; ++i) {
            INFO("page " << i);
            CHECK((resident[i] & 1) == 1);
        }
        CHECK((resident[7] & 1) == 0);  // after it
        CHECK(bytes[page + 5] == 17);
        CHECK(bytes[6 * page + 9] == 23);
        CHECK(bytes[3 * page] == 0);
        munmap(mapped, pages * page);
    }
}

TEST_CASE("sizes that cannot fit fail before allocating, saying how much", "[memory]") {
    CHECK(kv::human_size(96) == "96 B");
    CHECK(kv::human_size(512.0 * 1024 * 1024) == "512.0 MiB");
    CHECK_NOTHROW(kv::require_memory(4096, "a buffer"));
    const double memory = static_cast<double>(kv::physical_memory_bytes());
    CHECK_THROWS_WITH(kv::require_memory(4 * memory, "a KV cache of 9 tokens"),
                      Catch::StartsWith("a KV cache of 9 tokens would need ") &&
                          Catch::Contains("more than this machine's"));
    // A size that overflowed when computed (-1) is refused, not taken for a small one.
    CHECK_THROWS_WITH(kv::require_memory(-1, "x"),
                      Catch::Contains("more bytes than can be counted"));
    CHECK_NOTHROW(kv::require_disk_space(1, "", "a file"));
    CHECK_THROWS_WITH(
        kv::require_disk_space(1e40, "", "a file"),
        Catch::Contains("more bytes than can be counted") && Catch::Contains(" free in "));
}
