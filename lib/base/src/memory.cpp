#include "kv/memory.hpp"

#include "kv/error.hpp"

#include <fcntl.h>
#include <malloc.h>
#include <sys/mman.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include <unistd.h>

namespace kv {
namespace {

[[maybe_unused]] constexpr std::uintptr_t huge_page = std::uintptr_t{2} << 20;  // transparent, x86-64

}  // namespace

std::size_t physical_memory_bytes() {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return SIZE_MAX;
    return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
}

void require_disk_space(double bytes, const std::filesystem::path& folder,
                        const std::string& what) {
    std::filesystem::path where = folder;
    if (where.empty()) {
        const char* temporary = std::getenv("TMPDIR");
        where = temporary && *temporary ? temporary : "/tmp";
    }
    struct statvfs info {};
    if (::statvfs(where.c_str(), &info) != 0) return;  // the file's creation will say why
    const double free = static_cast<double>(info.f_bavail) * static_cast<double>(info.f_frsize);
    if (bytes >= 0 && bytes <= free) return;
    throw Error(what + " would need " +
                (bytes < 0 || bytes > 1e30 ? std::string("more bytes than can be counted")
                                           : human_size(bytes)) +
                ", more than the " + human_size(free) + " free in " + kv::quoted(where.string()));
}

std::string human_size(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int unit = 0;
    while (bytes >= 1024 && unit < 6) {
        bytes /= 1024;
        ++unit;
    }
    char text[48];
    if (unit == 0)
        std::snprintf(text, sizeof text, "%.0f B", bytes);
    else
        std::snprintf(text, sizeof text, bytes >= 1e6 ? "%.3g %s" : "%.1f %s", bytes, units[unit]);
    return text;
}

void require_memory(double bytes, const std::string& what) {
    const auto memory = static_cast<double>(physical_memory_bytes());
    if (bytes >= 0 && bytes <= memory) return;
    throw Error(what + " would need " +
                (bytes < 0 || bytes > 1e30 ? std::string("more bytes than can be counted")
                                           : human_size(bytes)) +
                ", more than this machine's " + human_size(memory) + " of memory");
}

void advise_huge_pages(void* data, std::size_t bytes) {
#ifdef MADV_HUGEPAGE
    if (data == nullptr || bytes < huge_page_worthy_bytes) return;
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t first = (begin + huge_page - 1) & ~(huge_page - 1);
    const std::uintptr_t last = (begin + bytes) & ~(huge_page - 1);
    if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
    (void)data;
    (void)bytes;
#endif
}

namespace {

// MADV_POPULATE_WRITE, which glibc's headers name from 2.35 on (Debian 12 has 2.36; the value
// is the kernel's).
#ifdef MADV_POPULATE_WRITE
constexpr int populate_write = MADV_POPULATE_WRITE;
#else
constexpr int populate_write = 23;
#endif

}  // namespace

void populate_for_writing(void* data, std::size_t bytes) {
    if (data == nullptr || bytes == 0) return;
    const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t first = begin & ~(page - 1);
    const std::uintptr_t last = (begin + bytes + page - 1) & ~(page - 1);
    if (madvise(reinterpret_cast<void*>(first), last - first, populate_write) == 0) return;
    touch_pages_for_writing(data, bytes);  // a kernel before 5.14
}

void touch_pages_for_writing(void* data, std::size_t bytes) {
    if (data == nullptr || bytes == 0) return;
    const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    auto* bytes_of = static_cast<volatile std::byte*>(data);
    for (std::uintptr_t at = begin; at < begin + bytes; at = (at & ~(page - 1)) + page) {
        volatile std::byte& byte = bytes_of[at - begin];
        byte = byte;
    }
}

namespace {

#if defined(MADV_HUGEPAGE) && defined(__GLIBC__)
// Where the program break's heap begins ([heap] in /proc/self/maps), 0 where that cannot be read.
std::uintptr_t main_heap_start() {
    std::FILE* maps = std::fopen("/proc/self/maps", "r");
    if (maps == nullptr) return 0;
    std::uintptr_t start = 0;
    char line[512];
    while (std::fgets(line, sizeof line, maps))
        if (std::strstr(line, "[heap]")) {
            start = std::strtoull(line, nullptr, 16);
            break;
        }
    std::fclose(maps);
    return start;
}
#endif

}  // namespace

void advise_heap_huge_pages() {
#if defined(MADV_HUGEPAGE) && defined(__GLIBC__)
    static std::mutex mutex;
    static std::uintptr_t advised_end = 0;
    static std::uintptr_t heap_start = 0;  // the main heap: [heap_start, sbrk(0)); 0: unknown
    const std::lock_guard lock(mutex);
    if (advised_end == 0) {
        // Fixed thresholds (setting any of them ends glibc's own adjusting of the mmap
        // threshold): 32 MiB is where that adjusting stops anyway; the heap's top is extended by
        // 64 MiB at a time and kept, so the advice below covers memory before it is touched.
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TOP_PAD, 64 << 20);
        mallopt(M_TRIM_THRESHOLD, 256 << 20);
        advised_end =
            (reinterpret_cast<std::uintptr_t>(sbrk(0)) + huge_page - 1) & ~(huge_page - 1);
        heap_start = main_heap_start();
    }
    const auto current_break = reinterpret_cast<std::uintptr_t>(sbrk(0));
    const std::uintptr_t end = current_break & ~(huge_page - 1);
    if (end > advised_end) {
        (void)madvise(reinterpret_cast<void*>(advised_end), end - advised_end, MADV_HUGEPAGE);
        advised_end = end;
    }
    // A thread other than the first allocates from an arena of its own, whose heaps glibc maps
    // as regions of 64 MiB aligned to their size (HEAP_MAX_SIZE): the heap where a block of a
    // packet buffer's size lands now is advised whole, once (kvserve-once --requests reads the
    // next requests' packets on such a thread: faulted in 4 KiB at a time, the reads took twice
    // as long there).
    constexpr std::uintptr_t thread_heap = std::uintptr_t{64} << 20;
    if (heap_start == 0 || gettid() == getpid()) return;  // the first thread: the main heap's
    void* probe = std::malloc(std::size_t{256} << 10);
    const auto address = reinterpret_cast<std::uintptr_t>(probe);
    std::free(probe);
    if (probe == nullptr || (address >= heap_start && address < current_break)) return;
    thread_local std::vector<std::uintptr_t> advised_heaps;
    const std::uintptr_t heap = address & ~(thread_heap - 1);
    if (std::find(advised_heaps.begin(), advised_heaps.end(), heap) != advised_heaps.end()) return;
    (void)madvise(reinterpret_cast<void*>(heap), thread_heap, MADV_HUGEPAGE);
    advised_heaps.push_back(heap);
#endif
}

void drop_mapped_file_pages(const void* data, std::size_t bytes) {
    if (data == nullptr || bytes == 0) return;
    const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t first = begin & ~(page - 1);
    const std::uintptr_t last = (begin + bytes + page - 1) & ~(page - 1);
    (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

FileArena::FileArena(const std::filesystem::path& folder) : folder_(folder) {
    if (folder_.empty()) {
        const char* tmpdir = std::getenv("TMPDIR");
        folder_ = tmpdir && *tmpdir ? tmpdir : "/tmp";
    }
    // Unnamed, so that nothing is left behind however the process ends.
    fd_ = open(folder_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0) {  // a file system without O_TMPFILE: a named file, unlinked at once
        std::string pattern = (folder_ / ".kvtools-offload-XXXXXX").string();
        fd_ = mkostemp(pattern.data(), O_CLOEXEC);
        if (fd_ >= 0) unlink(pattern.c_str());
    }
    if (fd_ < 0)
        throw IoError("cannot create a temporary file in " + kv::quoted(folder_.string()) +
                      " to offload to: " + std::strerror(errno));
}

FileArena::~FileArena() {
    for (const std::span<std::byte>& mapping : mappings_)
        munmap(mapping.data(), mapping.size());
    if (fd_ >= 0) close(fd_);
}

FileArena::Region FileArena::allocate(std::size_t bytes) {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t rounded = std::max<std::size_t>(page, (bytes + page - 1) / page * page);
    const std::lock_guard lock(mutex_);
    const std::size_t offset = size_;
    const std::string where = kv::quoted(folder_.string());
    if (ftruncate(fd_, static_cast<off_t>(offset + rounded)) != 0)
        throw IoError("cannot grow the offload file in " + where + " to " +
                      std::to_string(offset + rounded) + " bytes: " + std::strerror(errno));
    void* data =
        mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(offset));
    if (data == MAP_FAILED)
        throw IoError("cannot map the offload file in " + where + ": " + std::strerror(errno));
    // Read no further than asked: rows are wanted here and there.
    (void)madvise(data, rounded, MADV_RANDOM);
    size_ = offset + rounded;
    mappings_.emplace_back(static_cast<std::byte*>(data), rounded);
    return {{static_cast<std::byte*>(data), bytes}, offset};
}

void FileArena::read(std::size_t offset, std::size_t bytes, void* out) const {
    auto* target = static_cast<std::byte*>(out);
    while (bytes > 0) {
        const ssize_t got = pread(fd_, target, bytes, static_cast<off_t>(offset));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
            throw IoError("cannot read the offload file in " + kv::quoted(folder_.string()) + ": " +
                          (got < 0 ? std::strerror(errno) : "unexpected end of file"));
        target += got;
        offset += static_cast<std::size_t>(got);
        bytes -= static_cast<std::size_t>(got);
    }
}

std::size_t FileArena::size() const {
    const std::lock_guard lock(mutex_);
    return size_;
}

}  // namespace kv
