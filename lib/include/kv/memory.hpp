// Large buffers backed by transparent huge pages. On a machine whose kernel gives huge pages
// only on request (transparent_hugepage = madvise, Debian's default), every first touch of a
// fresh 4 KiB page of a large buffer is a page fault; reading a 1 GiB cache or copying a
// model's weights spent most of its time in them (perf: half of a 32k-token time to first
// token). Advising 2 MiB pages makes that 512 times fewer faults.
#pragma once

#include <cstddef>
#include <vector>

namespace kv {

/// Buffers at least this large are worth advising.
inline constexpr std::size_t huge_page_worthy_bytes = std::size_t{4} << 20;

/// Asks the kernel for huge pages over the 2 MiB-aligned part of [data, data + bytes), before
/// it is touched. A hint: does nothing for small ranges or where the kernel declines.
void advise_huge_pages(void* data, std::size_t bytes);

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
