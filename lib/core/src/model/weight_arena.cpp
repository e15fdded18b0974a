#include "kv/model/weight_arena.hpp"

#include "kv/error.hpp"
#include "kv/memory.hpp"

#include <ATen/Parallel.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace kv {
namespace {

// Anonymous memory of its own mapping (not the heap: freed whole when the model goes, and
// 2 MiB-aligned so that all of it can be huge pages).
class Arena {
  public:
    explicit Arena(std::size_t bytes) : bytes_(bytes) {
        void* data =
            ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (data == MAP_FAILED)
            throw Error("cannot allocate " + std::to_string(bytes) +
                        " bytes for the model's weights: " + std::strerror(errno));
        data_ = static_cast<std::byte*>(data);
        advise_huge_pages(data_, bytes_);
    }
    ~Arena() { ::munmap(data_, bytes_); }
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    std::byte* data() const { return data_; }

  private:
    std::byte* data_ = nullptr;
    std::size_t bytes_;
};

// Pieces of the copy handed to threads: large enough that scheduling costs nothing, small
// enough that the two threads of a 2-core machine finish together.
constexpr std::size_t piece_bytes = std::size_t{4} << 20;
constexpr std::size_t alignment = 64;

}  // namespace

void copy_weights_to_arena(WeightMap& weights, torch::ScalarType dtype) {
    struct Copy {
        torch::Tensor* tensor;
        std::size_t offset;
    };
    std::vector<Copy> copies;
    std::size_t total = 0;
    for (auto& [name, tensor] : weights) {
        if (!tensor.device().is_cpu() || tensor.scalar_type() != dtype || tensor.numel() == 0)
            continue;
        copies.push_back({&tensor, total});
        total += (tensor.nbytes() + alignment - 1) / alignment * alignment;
    }
    if (copies.empty()) return;
    const auto arena = std::make_shared<Arena>(total);
    std::vector<torch::Tensor> copied;
    // Contiguous tensors (every weight of a safetensors file) are copied in pieces on every
    // thread, which also spreads the page faults of both sides; any other is copied by libtorch.
    struct Piece {
        std::byte* to;
        const std::byte* from;
        std::size_t bytes;
    };
    std::vector<Piece> pieces;
    for (const Copy& copy : copies) {
        const torch::Tensor& source = *copy.tensor;
        std::byte* to = arena->data() + copy.offset;
        copied.push_back(torch::from_blob(
            to, source.sizes(), [arena](void*) {}, source.options()));
        if (!source.is_contiguous()) {
            copied.back().copy_(source);
            continue;
        }
        const auto* from = static_cast<const std::byte*>(source.data_ptr());
        for (std::size_t done = 0; done < source.nbytes(); done += piece_bytes)
            pieces.push_back(
                {to + done, from + done, std::min(piece_bytes, source.nbytes() - done)});
    }
    // The arena's pages first, on every thread (populate_for_writing): a 2.5 GB model's 4 KiB
    // faults one by one were most of its load, and huge pages faulted in by the copy each
    // stalled it while the kernel zeroed (or first compacted) 2 MiB.
    const int64_t arena_pieces = static_cast<int64_t>((total + piece_bytes - 1) / piece_bytes);
    at::parallel_for(0, arena_pieces, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const std::size_t offset = static_cast<std::size_t>(i) * piece_bytes;
            populate_for_writing(arena->data() + offset, std::min(piece_bytes, total - offset));
        }
    });
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const Piece& piece = pieces[static_cast<std::size_t>(i)];
            std::memcpy(piece.to, piece.from, piece.bytes);
        }
    });
    for (std::size_t i = 0; i < copies.size(); ++i)
        *copies[i].tensor = std::move(copied[i]);
}

}  // namespace kv
