#include "kv/runtime.hpp"

#include "kv/error.hpp"
#include "kv/memory.hpp"

#include <c10/core/CPUAllocator.h>

#include <torch/types.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <malloc.h>

#include <thread>

namespace kv {

namespace {

// PyTorch 2.3 made Allocator::allocate non-const and added the pure virtual copy_data
// (c10/core/Allocator.h); before, allocate was const and there was no copy_data to define.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define KV_TORCH_ALLOCATOR_2_3 1
#else
#define KV_TORCH_ALLOCATOR_2_3 0
#endif

// libtorch's CPU allocator, with large tensors advised to use huge pages (kv/memory.hpp) before
// anything touches them; the memory and its deleter stay the default allocator's.
class HugePageAllocator final : public at::Allocator {
  public:
    explicit HugePageAllocator(at::Allocator* base) : base_(base) {}
    at::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }
#if KV_TORCH_ALLOCATOR_2_3
    at::DataPtr allocate(std::size_t bytes) override {
        return advised(base_->allocate(bytes), bytes);
    }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
        base_->copy_data(dest, src, count);
    }
#else
    at::DataPtr allocate(std::size_t bytes) const override {
        return advised(base_->allocate(bytes), bytes);
    }
#endif

  private:
    static at::DataPtr advised(at::DataPtr data, std::size_t bytes) {
        if (bytes >= huge_page_worthy_bytes) advise_huge_pages(data.get(), bytes);
        return data;
    }
    at::Allocator* base_;
};

}  // namespace

int set_compute_threads(int threads) {
    // Keep freed tensors in the heap for the next layer instead of unmapping them: attention
    // scores of a prefill chunk are megabytes, and fresh mappings fault on every first touch
    // (perf: page faults were half of a 1k-token prefill's time before this).
    static const bool tuned = [] {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
        // Priority 1 outranks the default allocator's registration (0).
        static HugePageAllocator allocator(c10::GetDefaultCPUAllocator());
        c10::SetCPUAllocator(&allocator, 1);
        return true;
    }();
    (void)tuned;
    if (threads < 0) throw UsageError("threads must be >= 0, got " + std::to_string(threads));
    if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    torch::set_num_threads(threads);
    return threads;
}

}  // namespace kv
