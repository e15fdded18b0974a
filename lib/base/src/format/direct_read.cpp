#include "direct_read.hpp"

#include "hdf5_zstd.hpp"

#include <sched.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include "kv/avx512_lanes.hpp"
#endif

namespace kv::format {
namespace {

constexpr std::size_t block_words = 360;  // HDF5 folds its sums every 360 words
constexpr std::size_t block_bytes = 2 * block_words;
constexpr std::size_t max_direct_chunks = 8192;  // per dataset

// One block of n <= 360 whole words: s = sum of the words, w = sum of (n - j) * word j, both
// exact in 32 bits (w <= 65535 * 360 * 361 / 2 < 2^32).
void block_sums(const std::byte* data, std::size_t n, uint32_t& s, uint32_t& w) {
    const auto* p = reinterpret_cast<const uint8_t*>(data);
    std::size_t j = 0;
    uint32_t sum = 0, weighted = 0;
#if defined(__SSE2__)
    // Eight words at a time: a word is high * 256 + low, both bytes below 256, so _mm_madd_epi16
    // (signed) multiplies them exactly. Within a group the words weigh 8, 7, ..., 1, and every
    // later group adds 8 to the weight of each word before it (the running sum times 8).
    const std::size_t groups = n / 8;
    if (groups > 0) {
        const __m128i ones = _mm_set1_epi16(1);
        const __m128i weights = _mm_setr_epi16(8, 7, 6, 5, 4, 3, 2, 1);
        const __m128i low_mask = _mm_set1_epi16(0xff);
        __m128i vs = _mm_setzero_si128(), vw = _mm_setzero_si128();
        for (std::size_t g = 0; g < groups; ++g) {
            const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g));
            const __m128i high = _mm_and_si128(x, low_mask);  // the first byte: the high one
            const __m128i low = _mm_srli_epi16(x, 8);
            vw = _mm_add_epi32(vw, _mm_slli_epi32(vs, 3));
            vw = _mm_add_epi32(vw, _mm_slli_epi32(_mm_madd_epi16(high, weights), 8));
            vw = _mm_add_epi32(vw, _mm_madd_epi16(low, weights));
            vs = _mm_add_epi32(vs, _mm_slli_epi32(_mm_madd_epi16(high, ones), 8));
            vs = _mm_add_epi32(vs, _mm_madd_epi16(low, ones));
        }
        alignas(16) uint32_t lanes[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(lanes), vs);
        sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
        _mm_store_si128(reinterpret_cast<__m128i*>(lanes), vw);
        weighted = lanes[0] + lanes[1] + lanes[2] + lanes[3];
        j = groups * 8;
    }
#endif
    // The rest: each word weighs one more than the words after it.
    const uint32_t rest = static_cast<uint32_t>(n - j);
    weighted += rest * sum;
    for (uint32_t k = 0; j < n; ++j, ++k) {
        const uint32_t word = (uint32_t{p[2 * j]} << 8) | p[2 * j + 1];
        sum += word;
        weighted += (rest - k) * word;
    }
    s = sum;
    w = weighted;
}

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which its own
// -Wmaybe-uninitialized then reports inside the header (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// block_sums 32 words at a time (HDF5's checksum of a 1 GiB packet at -O2: 4 GB/s per core with
// 16-byte vectors, 35 GB/s with these; the rest of a block, fewer than 32 words, as above). A run
// of words A then B of nb words sums as s = s_A + s_B, w = w_A + nb * s_A + w_B: every word of A
// weighs nb more when B follows it.
KV_AVX512_BW void block_sums_avx512(const std::byte* data, std::size_t n, uint32_t& s,
                                    uint32_t& w) {
    const auto* p = reinterpret_cast<const uint8_t*>(data);
    const std::size_t groups = n / 32;
    uint32_t sum = 0, weighted = 0;
    if (groups > 0) {
        // Word j of a group weighs 32 - j.
        const __m512i weights =
            _mm512_set_epi16(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                             21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32);
        const __m512i ones = _mm512_set1_epi16(1);
        const __m512i low_mask = _mm512_set1_epi16(0xff);
        __m512i vs = _mm512_setzero_si512(), vw = _mm512_setzero_si512();
        for (std::size_t g = 0; g < groups; ++g) {
            const __m512i x = _mm512_loadu_si512(p + 64 * g);
            const __m512i high = _mm512_and_si512(x, low_mask);  // the first byte: the high one
            const __m512i low = _mm512_srli_epi16(x, 8);
            vw = _mm512_add_epi32(vw, _mm512_slli_epi32(vs, 5));
            vw = _mm512_add_epi32(vw, _mm512_slli_epi32(_mm512_madd_epi16(high, weights), 8));
            vw = _mm512_add_epi32(vw, _mm512_madd_epi16(low, weights));
            vs = _mm512_add_epi32(vs, _mm512_slli_epi32(_mm512_madd_epi16(high, ones), 8));
            vs = _mm512_add_epi32(vs, _mm512_madd_epi16(low, ones));
        }
        // Summed as unsigned: the weighted sum may pass 2^31, where _mm512_reduce_add_epi32's
        // int arithmetic would overflow (undefined behaviour, which UBSan reports).
        alignas(64) uint32_t lanes[16];
        _mm512_store_si512(lanes, vs);
        for (const uint32_t lane : lanes)
            sum += lane;
        _mm512_store_si512(lanes, vw);
        for (const uint32_t lane : lanes)
            weighted += lane;
    }
    const std::size_t done = 32 * groups;
    uint32_t rest_sum = 0, rest_weighted = 0;
    block_sums(data + 2 * done, n - done, rest_sum, rest_weighted);
    s = sum + rest_sum;
    w = weighted + static_cast<uint32_t>(n - done) * sum + rest_weighted;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

uint32_t fold(uint32_t x) {
    return (x & 0xffff) + (x >> 16);
}

}  // namespace

void Fletcher32::update(const std::byte* data, std::size_t bytes) {
#if defined(__x86_64__)
    const auto sums = avx512::cpu_supported() ? block_sums_avx512 : block_sums;
#else
    const auto sums = block_sums;
#endif
    std::size_t words = bytes / 2;
    while (words > 0) {
        const std::size_t n = std::min(words, block_words);
        uint32_t s = 0, w = 0;
        sums(data, n, s, w);
        // As HDF5's loop, in 32-bit arithmetic: sum2 gains sum1 after each of the n words.
        sum2_ += static_cast<uint32_t>(n) * sum1_ + w;
        sum1_ += s;
        sum1_ = fold(sum1_);
        sum2_ = fold(sum2_);
        data += 2 * n;
        words -= n;
    }
    if (bytes % 2) {
        sum1_ += uint32_t{static_cast<uint8_t>(*data)} << 8;
        sum2_ += sum1_;
        sum1_ = fold(sum1_);
        sum2_ = fold(sum2_);
    }
}

uint32_t Fletcher32::value() const {
    return (fold(sum2_) << 16) | fold(sum1_);  // one more fold, as HDF5's
}

uint32_t fletcher32(const std::byte* data, std::size_t bytes) {
    Fletcher32 sum;
    sum.update(data, bytes);
    return sum.value();
}

bool fletcher32_matches(const void* stored_bytes, uint32_t computed) {
    const auto* bytes = static_cast<const unsigned char*>(stored_bytes);
    const uint32_t stored = uint32_t{bytes[0]} | uint32_t{bytes[1]} << 8 |
                            uint32_t{bytes[2]} << 16 | uint32_t{bytes[3]} << 24;
    const uint32_t reversed = ((computed & 0x00ff00ffu) << 8) | ((computed >> 8) & 0x00ff00ffu);
    return stored == computed || stored == reversed;
}

void unshuffle(const std::byte* input, std::size_t total, std::size_t size, std::size_t elements,
               std::byte* output) {
    std::size_t i = 0;
#if defined(__SSE2__)
    if (size == 2) {
        for (; i + 16 <= elements; i += 16) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(input + i));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(input + total + i));
            auto* out = reinterpret_cast<__m128i*>(output + 2 * i);
            _mm_storeu_si128(out, _mm_unpacklo_epi8(a, b));
            _mm_storeu_si128(out + 1, _mm_unpackhi_epi8(a, b));
        }
    } else if (size == 4) {
        for (; i + 16 <= elements; i += 16) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(input + i));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(input + total + i));
            const __m128i c =
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(input + 2 * total + i));
            const __m128i d =
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(input + 3 * total + i));
            const __m128i ab_low = _mm_unpacklo_epi8(a, b), ab_high = _mm_unpackhi_epi8(a, b);
            const __m128i cd_low = _mm_unpacklo_epi8(c, d), cd_high = _mm_unpackhi_epi8(c, d);
            auto* out = reinterpret_cast<__m128i*>(output + 4 * i);
            _mm_storeu_si128(out, _mm_unpacklo_epi16(ab_low, cd_low));
            _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(ab_low, cd_low));
            _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(ab_high, cd_high));
            _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(ab_high, cd_high));
        }
    }
#endif
    for (; i < elements; ++i)
        for (std::size_t b = 0; b < size; ++b)
            output[i * size + b] = input[b * total + i];
}

TensorStorage tensor_storage(hid_t dataset) {
    TensorStorage storage;
    const hid_t properties = H5Dget_create_plist(dataset);
    if (properties < 0) {
        H5Eclear2(H5E_DEFAULT);
        return storage;
    }
    const H5D_layout_t layout = H5Pget_layout(properties);
    storage.layout = layout == H5D_CONTIGUOUS ? "contiguous"
                     : layout == H5D_CHUNKED  ? "chunked"
                     : layout == H5D_COMPACT  ? "compact"
                                              : "other";
    bool known = layout == H5D_CONTIGUOUS;
    if (layout == H5D_CHUNKED) {
        hsize_t chunk[4] = {};
        if (H5Pget_chunk(properties, 4, chunk) == 4 && chunk[0] == 1 && chunk[1] == 1) {
            storage.chunk_tokens = static_cast<int64_t>(chunk[2]);
            known = true;
        }
        // Filters in pipeline order; the direct path knows shuffle, zstd and Fletcher32, each
        // at most once and in this order.
        const int count = H5Pget_nfilters(properties);
        int last = -1;
        for (int i = 0; i < std::max(count, 0); ++i) {
            unsigned int flags = 0, values[8] = {};
            std::size_t value_count = 8;
            const H5Z_filter_t id = H5Pget_filter2(properties, static_cast<unsigned>(i), &flags,
                                                   &value_count, values, 0, nullptr, nullptr);
            // hdf5plugin records the (possibly negative) level as an unsigned int.
            if (id == zstd_filter_id)
                storage.zstd_level = value_count > 0 ? static_cast<int>(values[0]) : 3;
            const int rank = id == H5Z_FILTER_SHUFFLE      ? 0
                             : id == zstd_filter_id        ? 1
                             : id == H5Z_FILTER_FLETCHER32 ? 2
                                                           : -1;
            storage.filters.push_back(id == H5Z_FILTER_SHUFFLE      ? "shuffle"
                                      : id == zstd_filter_id        ? "zstd"
                                      : id == H5Z_FILTER_FLETCHER32 ? "fletcher32"
                                      : id == H5Z_FILTER_DEFLATE    ? "deflate"
                                                                 : "filter " + std::to_string(id));
            if (rank <= last) known = false;
            last = rank;
        }
        if (count < 0) known = false;
    }
    H5Pclose(properties);
    H5Eclear2(H5E_DEFAULT);
    storage.direct = known;
    return storage;
}

// A thread costs tens of microseconds to start and join (more when the other cores are busy and
// it waits its turn), what decompressing a few hundred kilobytes takes.
int threads_for(std::size_t bytes, int threads, std::size_t per_thread) {
    return static_cast<int>(
        std::clamp<std::size_t>(bytes / std::max<std::size_t>(per_thread, 1), 1,
                                static_cast<std::size_t>(std::max(threads, 1))));
}

int default_read_threads() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

namespace {

// Runs work(worker, item) for items 0..count-1 on `threads` threads (this one among them), in
// order of items taken from a shared counter; stops taking items once one returns false.
template <class Work>
bool run_parallel(std::size_t count, int threads, const Work& work) {
    std::atomic<std::size_t> next{0};
    std::atomic<bool> failed{false};
    auto loop = [&](int worker) {
        try {
            for (;;) {
                const std::size_t item = next.fetch_add(1, std::memory_order_relaxed);
                if (item >= count || failed.load(std::memory_order_relaxed)) return;
                if (!work(worker, item)) failed = true;
            }
        } catch (...) {  // an allocation: the caller reads through HDF5 instead
            failed = true;
        }
    };
    const int used =
        static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), count));
    std::vector<std::thread> helpers;
    try {
        for (int worker = 1; worker < used; ++worker)
            helpers.emplace_back(loop, worker);
    } catch (...) {  // no thread to be had: the others do the work
    }
    loop(0);
    for (std::thread& helper : helpers)
        helper.join();
    return !failed;
}

struct Scratch {
    std::unique_ptr<std::byte[]> data;
    std::size_t size = 0;
    std::byte* get(std::size_t bytes) {
        if (bytes > size) {
            data = std::make_unique_for_overwrite<std::byte[]>(bytes);
            size = bytes;
        }
        return data.get();
    }
};

struct Worker {
    Scratch stored, decoded;
    ZSTD_DCtx* zstd = nullptr;
    ~Worker() { ZSTD_freeDCtx(zstd); }
};

// Workers kept between reads: a packet of a few hundred tokens is a few dozen small chunks, and
// a zstd context and scratch buffers made for each read (their pages faulted in anew) cost about
// as much as decompressing them. As many as were ever taken at once; scratch buffers past 4 MiB
// (a file of large chunks) are not kept.
class WorkerPool {
  public:
    std::unique_ptr<Worker> take() {
        const std::lock_guard lock(mutex_);
        if (free_.empty()) return std::make_unique<Worker>();
        std::unique_ptr<Worker> worker = std::move(free_.back());
        free_.pop_back();
        return worker;
    }
    // Called from a destructor: a worker that cannot be kept is freed.
    void give(std::unique_ptr<Worker> worker) noexcept {
        constexpr std::size_t largest_kept = std::size_t{4} << 20;
        for (Scratch* scratch : {&worker->stored, &worker->decoded})
            if (scratch->size > largest_kept) *scratch = Scratch{};
        try {
            const std::lock_guard lock(mutex_);
            free_.push_back(std::move(worker));
        } catch (...) {
        }
    }

  private:
    std::mutex mutex_;
    std::vector<std::unique_ptr<Worker>> free_;
};

WorkerPool& worker_pool() {
    static WorkerPool pool;
    return pool;
}

struct Chunk {
    haddr_t address = 0;
    hsize_t size = 0;
    unsigned mask = 0;
    std::byte* target = nullptr;  // where its first row goes
    std::size_t rows = 0;  // rows of the tensor it holds (fewer than T at the end of a plane)
    std::size_t plane = 0, first = 0;  // which rows: plane (layer * heads + head), first row
};

// Reads `bytes` at `at` into `out` in pieces that Fletcher32 sums while they are in the cache.
bool read_summed(const RawSource& raw, uint64_t at, std::size_t bytes, std::byte* out,
                 Fletcher32* sum) {
    constexpr std::size_t piece = 256 * block_bytes;  // 180 KiB
    for (std::size_t done = 0; done < bytes;) {
        const std::size_t n = std::min(piece, bytes - done);
        if (!raw.read(at + done, n, out + done)) return false;
        if (sum) sum->update(out + done, n);
        done += n;
    }
    return true;
}

}  // namespace

bool read_tensor_directly(hid_t dataset, const RawSource& raw, std::size_t element_size,
                          const hsize_t (&dims)[4], const PlaneTargets& target, int threads,
                          std::size_t bytes_per_thread) {
    if (threads <= 0) threads = default_read_threads();
    const TensorStorage storage = tensor_storage(dataset);
    if (!storage.direct) return false;
    const std::size_t row_bytes = static_cast<std::size_t>(dims[3]) * element_size;
    const std::size_t planes = static_cast<std::size_t>(dims[0] * dims[1]);
    const auto length = static_cast<std::size_t>(dims[2]);
    const std::size_t total = planes * length * row_bytes;
    if (total == 0) return true;

    if (storage.layout == "contiguous") {
        const haddr_t address = H5Dget_offset(dataset);
        if (address == HADDR_UNDEF || H5Dget_storage_size(dataset) != total) {
            H5Eclear2(H5E_DEFAULT);
            return false;
        }
        // Each plane in pieces of about 4 MiB of whole rows.
        const std::size_t plane_bytes = length * row_bytes;
        const std::size_t piece =
            std::max<std::size_t>(1, (std::size_t{4} << 20) / row_bytes) * row_bytes;
        const std::size_t per_plane = (plane_bytes + piece - 1) / piece;
        return run_parallel(planes * per_plane, threads_for(total, threads, bytes_per_thread),
                            [&](int, std::size_t item) {
                                const std::size_t plane = item / per_plane,
                                                  at = item % per_plane * piece;
                                const std::size_t bytes = std::min(piece, plane_bytes - at);
                                if (!raw.read(address + plane * plane_bytes + at, bytes,
                                              target.plane(plane / dims[1], plane % dims[1]) + at))
                                    return false;
                                if (target.landed)
                                    target.landed(plane / dims[1], plane % dims[1], at / row_bytes,
                                                  bytes / row_bytes);
                                return true;
                            });
    }

    // Chunked [1, 1, T, D]: where each chunk is and which filters it went through.
    const auto chunk_tokens = static_cast<std::size_t>(storage.chunk_tokens);
    if (chunk_tokens == 0) return false;
    const std::size_t chunk_bytes = chunk_tokens * row_bytes;
    {
        const hid_t properties = H5Dget_create_plist(dataset);
        hsize_t chunk[4] = {};
        const bool whole_rows = H5Pget_chunk(properties, 4, chunk) == 4 && chunk[3] == dims[3];
        bool shuffle_fits = true;  // a shuffle of another size is not this path's
        for (int i = 0; whole_rows && i < H5Pget_nfilters(properties); ++i) {
            unsigned int flags = 0, values[8] = {};
            std::size_t value_count = 8;
            if (H5Pget_filter2(properties, static_cast<unsigned>(i), &flags, &value_count, values,
                               0, nullptr, nullptr) == H5Z_FILTER_SHUFFLE &&
                (value_count < 1 || values[0] != element_size))
                shuffle_fits = false;
        }
        H5Pclose(properties);
        H5Eclear2(H5E_DEFAULT);
        if (!whole_rows || !shuffle_fits) return false;
    }
    const std::size_t per_plane = (length + chunk_tokens - 1) / chunk_tokens;
    // HDF5 1.10 takes longer to say where a chunk is the more chunks a file has (tens of
    // microseconds each, then more): past a few thousand, its own pipeline reads them sooner.
    if (planes * per_plane > max_direct_chunks) return false;
    std::vector<Chunk> chunks(planes * per_plane);
    for (std::size_t plane = 0; plane < planes; ++plane)
        for (std::size_t c = 0; c < per_plane; ++c) {
            Chunk& chunk = chunks[plane * per_plane + c];
            const hsize_t at[4] = {plane / dims[1], plane % dims[1], c * chunk_tokens, 0};
            if (H5Dget_chunk_info_by_coord(dataset, at, &chunk.mask, &chunk.address, &chunk.size) <
                    0 ||
                chunk.address == HADDR_UNDEF || chunk.address > raw.size ||
                chunk.size > raw.size - chunk.address) {
                H5Eclear2(H5E_DEFAULT);
                return false;  // a chunk never written (HDF5 fills it), or not in the file
            }
            chunk.target =
                target.plane(plane / dims[1], plane % dims[1]) + c * chunk_tokens * row_bytes;
            chunk.rows = std::min(chunk_tokens, length - c * chunk_tokens);
            chunk.plane = plane;
            chunk.first = c * chunk_tokens;
        }

    threads = threads_for(total, threads, bytes_per_thread);
    std::vector<std::unique_ptr<Worker>> workers(static_cast<std::size_t>(threads));
    for (auto& worker : workers)
        worker = worker_pool().take();
    struct GiveBack {
        std::vector<std::unique_ptr<Worker>>& workers;
        ~GiveBack() {
            for (auto& worker : workers)
                worker_pool().give(std::move(worker));
        }
    } give_back{workers};
    const std::vector<std::string>& filters = storage.filters;
    // One chunk into its place; false where it is not as it should be.
    auto read_chunk = [&](Worker& worker, const Chunk& chunk) {
        bool shuffled = false, compressed = false, summed = false;
        for (std::size_t i = 0; i < filters.size(); ++i) {
            if (chunk.mask & (1u << i)) continue;  // skipped for this chunk
            shuffled = shuffled || filters[i] == "shuffle";
            compressed = compressed || filters[i] == "zstd";
            summed = summed || filters[i] == "fletcher32";
        }
        const std::size_t payload = static_cast<std::size_t>(chunk.size) - (summed ? 4 : 0);
        if (chunk.size < (summed ? 4u : 0u)) return false;
        std::byte* out = chunk.target;
        const std::size_t out_bytes = chunk.rows * row_bytes;
        if (!compressed && payload != chunk_bytes) return false;
        if (!compressed && !shuffled) {
            // The chunk is the rows: read straight into the tensor, summed as they come.
            Fletcher32 sum;
            if (chunk.rows == chunk_tokens) {
                if (!read_summed(raw, chunk.address, chunk_bytes, out, summed ? &sum : nullptr))
                    return false;
            } else {
                std::byte* whole = worker.decoded.get(chunk_bytes);
                if (!read_summed(raw, chunk.address, chunk_bytes, whole, summed ? &sum : nullptr))
                    return false;
                std::memcpy(out, whole, out_bytes);
            }
            unsigned char stored[4];
            return !summed || (raw.read(chunk.address + chunk_bytes, 4, stored) &&
                               fletcher32_matches(stored, sum.value()));
        }
        // Checked as stored, then decompressed, then unshuffled into the tensor.
        std::byte* bytes = worker.stored.get(std::max<std::size_t>(chunk.size, 1));
        if (!raw.read(chunk.address, static_cast<std::size_t>(chunk.size), bytes)) return false;
        if (summed && !fletcher32_matches(bytes + payload, fletcher32(bytes, payload)))
            return false;
        const std::byte* plain = bytes;
        if (compressed) {
            // Straight into the tensor when nothing follows and the chunk is whole.
            std::byte* into =
                !shuffled && chunk.rows == chunk_tokens ? out : worker.decoded.get(chunk_bytes);
            if (!worker.zstd) worker.zstd = ZSTD_createDCtx();
            if (!worker.zstd) return false;
            const std::size_t size =
                ZSTD_decompressDCtx(worker.zstd, into, chunk_bytes, bytes, payload);
            if (ZSTD_isError(size) || size != chunk_bytes) return false;
            if (into == out) return true;
            plain = into;
        } else if (payload != chunk_bytes) {
            return false;
        }
        if (shuffled)
            unshuffle(plain, chunk_bytes / element_size, element_size, out_bytes / element_size,
                      out);
        else
            std::memcpy(out, plain, out_bytes);
        return true;
    };
    return run_parallel(chunks.size(), threads, [&](int index, std::size_t item) {
        const Chunk& chunk = chunks[item];
        if (!read_chunk(*workers[static_cast<std::size_t>(index)], chunk)) return false;
        if (target.landed)
            target.landed(chunk.plane / dims[1], chunk.plane % dims[1], chunk.first, chunk.rows);
        return true;
    });
}

}  // namespace kv::format
