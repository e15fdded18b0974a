// Large buffers backed by transparent huge pages. On a machine whose kernel gives huge pages
// only on request (transparent_hugepage = madvise, Debian's default), every first touch of a
// fresh 4 KiB page of a large buffer is a page fault; reading a 1 GiB cache or copying a
// model's weights spent most of its time in them (perf: half of a 32k-token time to first
// token). Advising 2 MiB pages makes that 512 times fewer faults.
#pragma once

#include <cstddef>
#include <filesystem>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace kv {

/// Buffers at least this large are worth advising.
inline constexpr std::size_t huge_page_worthy_bytes = std::size_t{4} << 20;

/// Asks the kernel for huge pages over the 2 MiB-aligned part of [data, data + bytes), before
/// it is touched. A hint: does nothing for small ranges or where the kernel declines.
void advise_huge_pages(void* data, std::size_t bytes);

/// Faults in the pages of [data, data + bytes) as a write to each would, keeping what they hold:
/// one MADV_POPULATE_WRITE (Linux 5.14 on) over the whole pages around the range, else a byte of
/// each page read and written back. Fresh memory is zeroed by the kernel at its first touch: a
/// buffer about to be filled by a copy or a read is faulted in first by every thread, a part
/// each, so that neither the zeroing nor its stalls fall on one thread.
void populate_for_writing(void* data, std::size_t bytes);
/// populate_for_writing's way where the kernel lacks MADV_POPULATE_WRITE: the first byte in the
/// range of every page read and written back.
void touch_pages_for_writing(void* data, std::size_t bytes);

/// For a process that keeps allocating buffers too small to advise one by one and keeps them
/// (kvserve-once --requests' packets, a few hundred KiB each, kept in memory): asks for huge
/// pages over the part of the main heap grown since the last call, and has it grow and stay in
/// steps of 64 MiB (allocations below 32 MiB come from it), so that most such buffers land in
/// advised memory; on a thread other than the first, the heap of that thread's own arena as well.
/// Faulting them in 4 KiB at a time was a tenth of a --requests question. Call it between
/// batches of allocations, on the thread that makes them; does nothing off glibc.
void advise_heap_huge_pages();

/// Unmaps from the process the pages of [data, data + bytes), rounded outward to whole pages,
/// which must lie in a shared mapping of a file (a FileArena region): the data stays in the file
/// and the OS page cache, and the next read brings it back.
void drop_mapped_file_pages(const void* data, std::size_t bytes);

/// Regions of an unnamed temporary file, each mapped shared into memory: storage that lives on
/// disk and in the OS page cache, of which the process holds only the pages it touched since
/// they were last dropped (drop_mapped_file_pages). The offloading tier of the KV cache and of
/// IceCache's index keys. Nothing is left on disk however the process ends.
class FileArena {
  public:
    /// Throws IoError when no file can be made in `folder` (empty: $TMPDIR, else /tmp).
    explicit FileArena(const std::filesystem::path& folder);
    ~FileArena();
    FileArena(const FileArena&) = delete;
    FileArena& operator=(const FileArena&) = delete;

    struct Region {
        std::span<std::byte> bytes;  ///< mapped: writing here writes the file
        std::size_t offset = 0;      ///< where it starts in the file
    };
    /// A new region of `bytes` zero bytes, page-aligned, valid while the arena lives. Safe to
    /// call from several threads. Throws IoError when the file cannot grow (disk full).
    Region allocate(std::size_t bytes);
    /// Copies `bytes` of the file from `offset` to `out` with pread: a read that brings no page
    /// into the process (reading through the mapping maps the page, and with it up to 15
    /// neighbours the kernel faults in around it). Sees what was written through the mapping.
    void read(std::size_t offset, std::size_t bytes, void* out) const;
    /// Bytes of the file so far.
    std::size_t size() const;

  private:
    std::filesystem::path folder_;
    int fd_ = -1;
    std::size_t size_ = 0;
    std::vector<std::span<std::byte>> mappings_;
    mutable std::mutex mutex_;
};

/// This machine's physical memory in bytes (the most any allocation could get).
std::size_t physical_memory_bytes();
/// "12.0 GiB", "512 MiB", "96 B".
std::string human_size(double bytes);
/// Throws Error before an allocation of `bytes` that cannot fit this machine's memory:
/// "WHAT would need 12.0 GiB, more than this machine's 7.6 GiB of memory". `bytes` of -1 (or
/// anything past SIZE_MAX) stands for a size that overflowed when computed.
void require_memory(double bytes, const std::string& what);
/// The same for a file of `bytes` in `folder` (empty: $TMPDIR, else /tmp), against the space
/// free there.
void require_disk_space(double bytes, const std::filesystem::path& folder, const std::string& what);

/// vector.resize(count) for a vector about to receive a large read: the storage is reserved
/// and advised before resize touches it.
template <class T>
void resize_for_bulk_read(std::vector<T>& vector, std::size_t count) {
    if (count > vector.capacity() && count * sizeof(T) >= huge_page_worthy_bytes) {
        std::vector<T> fresh;
        fresh.reserve(count);
        advise_huge_pages(fresh.data(), count * sizeof(T));
        fresh.assign(vector.begin(), vector.end());
        vector.swap(fresh);
    }
    vector.resize(count);
}

}  // namespace kv
