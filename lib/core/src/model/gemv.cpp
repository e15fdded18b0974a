#include "kv/model/gemv.hpp"

#include "isa.hpp"
#include "kernel_scratch.hpp"
#include "kv/avx2_lanes.hpp"
#include "kv/float_convert.hpp"

#include <ATen/Parallel.h>

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*(), which its own
// -Wmaybe-uninitialized and -Wuninitialized then report inside the header (a known false
// positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace kv {
namespace {

inline float as_float(float value) {
    return value;
}
inline float as_float(uint16_t bits) {
    return bf16_to_float(bits);
}

template <typename Weight>
float dot_portable(const Weight* row, const float* x, int64_t columns) {
    float sum = 0;
    for (int64_t k = 0; k < columns; ++k) {
        if constexpr (std::is_same_v<Weight, uint16_t>)
            sum += bf16_to_float(row[k]) * x[k];
        else
            sum += row[k] * x[k];
    }
    return sum;
}

template <typename Weight>
void rows_portable(const Weight* weights, const float* x, float* y, int64_t begin, int64_t end,
                   int64_t columns) {
    for (int64_t n = begin; n < end; ++n)
        y[n] = dot_portable(weights + n * columns, x, columns);
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 widen_bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 values of a row as float32: bf16 widened exactly, float32 as they are.
template <typename Weight>
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const Weight* p) {
    if constexpr (std::is_same_v<Weight, uint16_t>)
        return widen_bf16x16(p);
    else
        return _mm512_loadu_ps(p);
}

// Four rows at a time share each load of x; the tail columns are done in scalar code.
template <typename Weight>
__attribute__((target("avx512f,avx512bw"))) void rows_avx512(const Weight* weights, const float* x,
                                                             float* y, int64_t begin, int64_t end,
                                                             int64_t columns) {
    const int64_t vector_columns = columns & ~int64_t{15};
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const Weight* r0 = weights + n * columns;
        const Weight* r1 = r0 + columns;
        const Weight* r2 = r1 + columns;
        const Weight* r3 = r2 + columns;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
               a3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < vector_columns; k += 16) {
            const __m512 xv = _mm512_loadu_ps(x + k);
            a0 = _mm512_fmadd_ps(load16(r0 + k), xv, a0);
            a1 = _mm512_fmadd_ps(load16(r1 + k), xv, a1);
            a2 = _mm512_fmadd_ps(load16(r2 + k), xv, a2);
            a3 = _mm512_fmadd_ps(load16(r3 + k), xv, a3);
        }
        const int64_t tail = columns - vector_columns;
        y[n] =
            _mm512_reduce_add_ps(a0) + dot_portable(r0 + vector_columns, x + vector_columns, tail);
        y[n + 1] =
            _mm512_reduce_add_ps(a1) + dot_portable(r1 + vector_columns, x + vector_columns, tail);
        y[n + 2] =
            _mm512_reduce_add_ps(a2) + dot_portable(r2 + vector_columns, x + vector_columns, tail);
        y[n + 3] =
            _mm512_reduce_add_ps(a3) + dot_portable(r3 + vector_columns, x + vector_columns, tail);
    }
    rows_portable(weights, x, y, n, end, columns);
}

// x as bf16 (exact when it came from bf16 activations): one vdpbf16ps per 32 weights replaces
// the widen-and-fma of 2 x 16, which is what limits the plain AVX-512 kernel.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void rows_avx512_dpbf16(
    const uint16_t* weights, const uint16_t* x, float* y, int64_t begin, int64_t end,
    int64_t columns) {
    const int64_t vector_columns = columns & ~int64_t{31};
    auto tail_dot = [&](const uint16_t* row) {
        float sum = 0;
        for (int64_t k = vector_columns; k < columns; ++k)
            sum += bf16_to_float(row[k]) * bf16_to_float(x[k]);
        return sum;
    };
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const uint16_t* r0 = weights + n * columns;
        const uint16_t* r1 = r0 + columns;
        const uint16_t* r2 = r1 + columns;
        const uint16_t* r3 = r2 + columns;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
               a3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < vector_columns; k += 32) {
            const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + k));
            a0 = _mm512_dpbf16_ps(a0, reinterpret_cast<__m512bh>(_mm512_loadu_si512(r0 + k)), xv);
            a1 = _mm512_dpbf16_ps(a1, reinterpret_cast<__m512bh>(_mm512_loadu_si512(r1 + k)), xv);
            a2 = _mm512_dpbf16_ps(a2, reinterpret_cast<__m512bh>(_mm512_loadu_si512(r2 + k)), xv);
            a3 = _mm512_dpbf16_ps(a3, reinterpret_cast<__m512bh>(_mm512_loadu_si512(r3 + k)), xv);
        }
        y[n] = _mm512_reduce_add_ps(a0) + tail_dot(r0);
        y[n + 1] = _mm512_reduce_add_ps(a1) + tail_dot(r1);
        y[n + 2] = _mm512_reduce_add_ps(a2) + tail_dot(r2);
        y[n + 3] = _mm512_reduce_add_ps(a3) + tail_dot(r3);
    }
    for (; n < end; ++n) {
        const uint16_t* row = weights + n * columns;
        __m512 a = _mm512_setzero_ps();
        for (int64_t k = 0; k < vector_columns; k += 32)
            a = _mm512_dpbf16_ps(a, reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + k)),
                                 reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + k)));
        y[n] = _mm512_reduce_add_ps(a) + tail_dot(row);
    }
}

// Round to nearest even, as every bf16 conversion does (round_to_bf16).
std::vector<uint16_t> to_bf16(const float* x, int64_t count) {
    std::vector<uint16_t> result(static_cast<std::size_t>(count));
    round_to_bf16(x, result.data(), count);
    return result;
}

// The horizontal sums of 16 vectors as one vector (lane n: the sum of v[n]): pairs of vectors
// folded within 128-bit lanes, then the lanes of four folded into each other, a few shuffles
// for 16 sums where 16 separate reductions cost a chain each.
__attribute__((target("avx512f"))) inline __m512 fold4(__m512 a, __m512 b, __m512 c, __m512 d) {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] partial sums.
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
}

__attribute__((target("avx512f"))) inline __m512 sums16(const __m512* v) {
    const __m512 w0 = fold4(v[0], v[1], v[2], v[3]), w1 = fold4(v[4], v[5], v[6], v[7]),
                 w2 = fold4(v[8], v[9], v[10], v[11]), w3 = fold4(v[12], v[13], v[14], v[15]);
    // Lanes 0+2 and 1+3 of two folded vectors, then of those.
    const __m512 y01 =
        _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x44), _mm512_shuffle_f32x4(w0, w1, 0xEE));
    const __m512 y23 =
        _mm512_add_ps(_mm512_shuffle_f32x4(w2, w3, 0x44), _mm512_shuffle_f32x4(w2, w3, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88),
                         _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

// Many short rows against one x (an index scoring a point's children): 16 rows at a time,
// their sums folded together (sums16), for columns a multiple of 16. bf16 rows are widened
// exactly, so that they give the bits float32 rows of the same values give.
template <typename Weight>
__attribute__((target("avx512f,avx512bw"))) void many_rows_avx512(const Weight* rows,
                                                                  const float* x, float* y,
                                                                  int64_t count, int64_t columns) {
    int64_t n = 0;
    __m512 acc[16];
    // Unrolled, so that the 16 sums stay in registers (a loop over them kept them on the stack:
    // a load and a store around every fma, half of an index query's time at 131k tokens).
    for (; n + 16 <= count; n += 16) {
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
            acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < columns; k += 16) {
            const __m512 xv = _mm512_loadu_ps(x + k);
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r)
                acc[r] = _mm512_fmadd_ps(load16(rows + (n + r) * columns + k), xv, acc[r]);
        }
        _mm512_storeu_ps(y + n, sums16(acc));
    }
    if (n == count) return;
    // The last rows as a block of 16 whose missing rows are zero.
    const int64_t last = count - n;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
        acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < columns; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
            if (r < last)
                acc[r] = _mm512_fmadd_ps(load16(rows + (n + r) * columns + k), xv, acc[r]);
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sums16(acc));
    std::copy_n(sums, count - n, y + n);
}

// 8 values of a row as float32 (load16's AVX2 twin): bf16 widened exactly, float32 as they are.
using avx2::load8;

__attribute__((target("avx2,fma"))) float reduce_avx2(__m256 v) {
    const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_shuffle_ps(sum2, sum2, 1)));
}

// Each row's dot product is one chain of fmas over its vectors, then reduce_avx2. Four rows go
// at once, sharing each load of x, so that four chains overlap: one row at a time waited out
// every fma's latency (a 1B model's decoding step, 2 AVX2 cores: 0.19 s, 0.15 s in fours).
template <typename Weight>
__attribute__((target("avx2,fma"))) void rows_avx2(const Weight* weights, const float* x, float* y,
                                                   int64_t begin, int64_t end, int64_t columns) {
    const int64_t vector_columns = columns & ~int64_t{7};
    const int64_t tail = columns - vector_columns;
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const Weight* r0 = weights + n * columns;
        const Weight* r1 = r0 + columns;
        const Weight* r2 = r1 + columns;
        const Weight* r3 = r2 + columns;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
               a3 = _mm256_setzero_ps();
        for (int64_t k = 0; k < vector_columns; k += 8) {
            const __m256 xv = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(load8(r0 + k), xv, a0);
            a1 = _mm256_fmadd_ps(load8(r1 + k), xv, a1);
            a2 = _mm256_fmadd_ps(load8(r2 + k), xv, a2);
            a3 = _mm256_fmadd_ps(load8(r3 + k), xv, a3);
        }
        y[n] = reduce_avx2(a0) + dot_portable(r0 + vector_columns, x + vector_columns, tail);
        y[n + 1] = reduce_avx2(a1) + dot_portable(r1 + vector_columns, x + vector_columns, tail);
        y[n + 2] = reduce_avx2(a2) + dot_portable(r2 + vector_columns, x + vector_columns, tail);
        y[n + 3] = reduce_avx2(a3) + dot_portable(r3 + vector_columns, x + vector_columns, tail);
    }
    for (; n < end; ++n) {
        const Weight* row = weights + n * columns;
        __m256 a = _mm256_setzero_ps();
        for (int64_t k = 0; k < vector_columns; k += 8)
            a = _mm256_fmadd_ps(load8(row + k), _mm256_loadu_ps(x + k), a);
        y[n] = reduce_avx2(a) + dot_portable(row + vector_columns, x + vector_columns, tail);
    }
}

// One of the accumulate kernels below over a block of V vectors of columns (V = 1..8): out[0, V
// vectors) += sum_n weights[n] * rows[n * stride, ...).
template <typename Weight>
using AccumulateBlock = void (*)(const Weight*, const float*, float*, int64_t, int64_t);

// out += sum_n weights[n] * rows[n]: the columns in blocks of up to 8 vectors of `Lanes`, each
// through kernels[vectors - 1], then the columns past the last whole vector one at a time.
template <typename Weight, int Lanes>
void accumulate_in_blocks(const Weight* rows, const float* weights, float* out, int64_t count,
                          int64_t columns, const AccumulateBlock<Weight> (&kernels)[8]) {
    const int64_t vector_columns = columns & ~int64_t{Lanes - 1};
    for (int64_t d = 0; d < vector_columns; d += 8 * Lanes)
        kernels[std::min<int64_t>(8, (vector_columns - d) / Lanes) - 1](rows + d, weights, out + d,
                                                                        count, columns);
    if (vector_columns < columns)
        for (int64_t n = 0; n < count; ++n) {
            const Weight* row = rows + n * columns;
            for (int64_t d = vector_columns; d < columns; ++d)
                out[d] += weights[n] * as_float(row[d]);
        }
}

// accumulate_avx512 over columns [0, 16 * V) of rows `stride` apart: the outputs stay in
// registers across the rows.
template <typename Weight, int V>
__attribute__((target("avx512f,avx512bw"))) void accumulate_block_avx512(const Weight* rows,
                                                                         const float* weights,
                                                                         float* out, int64_t count,
                                                                         int64_t stride) {
    __m512 acc[V];
#pragma GCC unroll 8
    for (int c = 0; c < V; ++c)
        acc[c] = _mm512_loadu_ps(out + 16 * c);
    for (int64_t n = 0; n < count; ++n) {
        const __m512 weight = _mm512_set1_ps(weights[n]);
#pragma GCC unroll 8
        for (int c = 0; c < V; ++c)
            acc[c] = _mm512_fmadd_ps(load16(rows + n * stride + 16 * c), weight, acc[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < V; ++c)
        _mm512_storeu_ps(out + 16 * c, acc[c]);
}

// out += sum_n weights[n] * rows[n], each output column's fmas in row order. Up to 128 columns
// at a time are kept in registers across all the rows (the same fmas on the same operands in
// the same order as through memory: the same bits); through memory, each row's fma waited for
// the previous row's store to come back (one decoding step of the demo model spent a third of
// its attention there).
template <typename Weight>
void accumulate_avx512(const Weight* rows, const float* weights, float* out, int64_t count,
                       int64_t columns) {
    static constexpr AccumulateBlock<Weight> kernels[8] = {
        accumulate_block_avx512<Weight, 1>, accumulate_block_avx512<Weight, 2>,
        accumulate_block_avx512<Weight, 3>, accumulate_block_avx512<Weight, 4>,
        accumulate_block_avx512<Weight, 5>, accumulate_block_avx512<Weight, 6>,
        accumulate_block_avx512<Weight, 7>, accumulate_block_avx512<Weight, 8>};
    accumulate_in_blocks<Weight, 16>(rows, weights, out, count, columns, kernels);
}

// accumulate_avx2 over columns [0, 8 * V) of rows `stride` apart: the outputs stay in registers
// across the rows.
template <typename Weight, int V>
__attribute__((target("avx2,fma"))) void accumulate_block_avx2(const Weight* rows,
                                                               const float* weights, float* out,
                                                               int64_t count, int64_t stride) {
    __m256 acc[V];
#pragma GCC unroll 8
    for (int c = 0; c < V; ++c)
        acc[c] = _mm256_loadu_ps(out + 8 * c);
    for (int64_t n = 0; n < count; ++n) {
        const __m256 weight = _mm256_set1_ps(weights[n]);
#pragma GCC unroll 8
        for (int c = 0; c < V; ++c)
            acc[c] = _mm256_fmadd_ps(load8(rows + n * stride + 8 * c), weight, acc[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < V; ++c)
        _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// out += sum_n weights[n] * rows[n], each output column's fmas in row order; up to 64 columns at
// a time kept in registers across all the rows (accumulate_avx512's plan, the same bits as
// through memory, where each row's fma waited for the previous row's store).
template <typename Weight>
void accumulate_avx2(const Weight* rows, const float* weights, float* out, int64_t count,
                     int64_t columns) {
    static constexpr AccumulateBlock<Weight> kernels[8] = {
        accumulate_block_avx2<Weight, 1>, accumulate_block_avx2<Weight, 2>,
        accumulate_block_avx2<Weight, 3>, accumulate_block_avx2<Weight, 4>,
        accumulate_block_avx2<Weight, 5>, accumulate_block_avx2<Weight, 6>,
        accumulate_block_avx2<Weight, 7>, accumulate_block_avx2<Weight, 8>};
    accumulate_in_blocks<Weight, 8>(rows, weights, out, count, columns, kernels);
}

template <typename Weight>
void accumulate_portable(const Weight* rows, const float* weights, float* out, int64_t count,
                         int64_t columns) {
    for (int64_t n = 0; n < count; ++n)
        for (int64_t d = 0; d < columns; ++d)
            out[d] += weights[n] * as_float(rows[n * columns + d]);
}

// accumulate_avx512 over `16 / V` rows of weights at once (columns == 16 * V): their outputs stay
// in registers across the value rows, each value row is widened once for all of them, and each
// fma takes the operands accumulate_avx512's takes through memory, in the same order: its bits.
template <typename Weight, int V, int R>
__attribute__((target("avx512f,avx512bw"))) void accumulate_group_avx512(
    const Weight* rows, const float* const* weights, float* const* outs, int64_t count) {
    static_assert(R * V <= 16, "R x V accumulators, 16 registers at most");
    __m512 acc[R][V];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < V; ++c)
            acc[r][c] = _mm512_loadu_ps(outs[r] + 16 * c);
    for (int64_t n = 0; n < count; ++n) {
        const Weight* row = rows + n * 16 * V;
        __m512 values[V];
#pragma GCC unroll 8
        for (int c = 0; c < V; ++c)
            values[c] = load16(row + 16 * c);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const __m512 weight = _mm512_set1_ps(weights[r][n]);
#pragma GCC unroll 8
            for (int c = 0; c < V; ++c)
                acc[r][c] = _mm512_fmadd_ps(values[c], weight, acc[r][c]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < V; ++c)
            _mm512_storeu_ps(outs[r] + 16 * c, acc[r][c]);
}

// accumulate_group_avx512 over `take` rows, a power of two up to 16 / V.
template <typename Weight, int V>
void accumulate_group_of(int64_t take, const Weight* rows, const float* const* weights,
                         float* const* outs, int64_t count) {
    if constexpr (V == 1)
        if (take == 16) return accumulate_group_avx512<Weight, V, 16>(rows, weights, outs, count);
    if constexpr (V <= 2)
        if (take == 8) return accumulate_group_avx512<Weight, V, 8>(rows, weights, outs, count);
    if constexpr (V <= 4)
        if (take == 4) return accumulate_group_avx512<Weight, V, 4>(rows, weights, outs, count);
    if (take == 2) return accumulate_group_avx512<Weight, V, 2>(rows, weights, outs, count);
    accumulate_group_avx512<Weight, V, 1>(rows, weights, outs, count);
}

template <typename Weight>
void dot_rows(const Weight* rows, const float* x, float* y, int64_t count, int64_t columns) {
    switch (isa) {
        case Isa::avx512_bf16:
            if constexpr (std::is_same_v<Weight, uint16_t>) {
                const std::vector<uint16_t> x_bf16 = to_bf16(x, columns);
                return rows_avx512_dpbf16(rows, x_bf16.data(), y, 0, count, columns);
            }
            [[fallthrough]];
        case Isa::avx512:
            return rows_avx512<Weight>(rows, x, y, 0, count, columns);
        case Isa::avx2:
            return rows_avx2<Weight>(rows, x, y, 0, count, columns);
        case Isa::portable:
            return rows_portable(rows, x, y, 0, count, columns);
    }
}

template <typename Weight>
void accumulate_rows(const Weight* rows, const float* weights, float* out, int64_t count,
                     int64_t columns) {
    switch (isa) {
        case Isa::avx512_bf16:
        case Isa::avx512:
            return accumulate_avx512(rows, weights, out, count, columns);
        case Isa::avx2:
            return accumulate_avx2(rows, weights, out, count, columns);
        case Isa::portable:
            return accumulate_portable(rows, weights, out, count, columns);
    }
}

template <typename Weight, typename Rows>
void run_rows(const Weight* weights, const float* x, float* y, int64_t rows, int64_t columns,
              Rows kernel) {
    // Chunks of rows big enough (~256 KB of weights) that scheduling costs nothing.
    const int64_t grain =
        std::max<int64_t>(4, (int64_t{1} << 18) / std::max<int64_t>(1, columns * sizeof(Weight)));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        kernel(weights, x, y, begin, end, columns);
    });
}

// gemv over weights widened to float32 as they are read, on the rows' threads.
template <typename Weight>
void gemv_widened(const Weight* weights, const float* x, float* y, int64_t rows, int64_t columns) {
    switch (isa) {
        case Isa::avx512_bf16:
        case Isa::avx512:
            return run_rows(weights, x, y, rows, columns, rows_avx512<Weight>);
        case Isa::avx2:
            return run_rows(weights, x, y, rows, columns, rows_avx2<Weight>);
        case Isa::portable:
            return run_rows(weights, x, y, rows, columns, rows_portable<Weight>);
    }
}

// attend_rows' blocks: 256 keys (32 KiB of bf16 rows of 64) are read by every query row while
// they are in L1/L2. A multiple of 4, so that dot_rows' 4-row groups (whose remainder rows some
// kernels sum differently) fall on the same keys as in one call over all the keys.
constexpr int64_t attend_block = 256;
static_assert(attend_block % 4 == 0);
// On AVX2 the blocks are widened to float32 and every row reads them again from where they are:
// 256 keys were 64 KiB, out of L1 (the weighted sums waited on L2). 64 keys (16 KiB) stay in L1;
// the AVX2 kernels give each row the same bits in blocks of any even size.
constexpr int64_t attend_block_avx2 = 64;
static_assert(attend_block_avx2 % 2 == 0 && attend_block_avx2 <= attend_block);
// Scores held at once (16 MiB of float32): more rows than fit go in further passes over the keys.
constexpr int64_t attend_score_floats = int64_t{4} << 20;

// The sums of 16 vectors of partial sums, with the bits _mm512_reduce_add_ps gives each: the
// vectors are reduced together by shuffles that add the same pairs it adds for each (the upper
// 256 bits to the lower, the upper 128 to the lower, lanes 2-3 to 0-1, lane 1 to 0), a few
// instructions for 16 sums where one reduction each cost a chain of them. Then + 0, as
// rows_avx512_dpbf16 adds its (empty) tail.
__attribute__((target("avx512f"))) inline void sums16_as_reduce_add(const __m512* acc, float* y) {
    // Upper 256 bits + lower of vectors p and p + 8: [p's 8 sums | p + 8's].
    __m512 halves[8];
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p)
        halves[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[p], acc[p + 8], 0xEE),
                                  _mm512_shuffle_f32x4(acc[p], acc[p + 8], 0x44));
    // Upper 128 bits + lower: 4 sums each of vectors [2q, 2q + 8, 2q + 1, 2q + 9].
    __m512 quarters[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q)
        quarters[q] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * q], halves[2 * q + 1], 0xDD),
                                    _mm512_shuffle_f32x4(halves[2 * q], halves[2 * q + 1], 0x88));
    // Lanes 0 + 2 and 1 + 3, then those two (fold4): vectors 0, 2, .., 14, then 1, 3, .., 15.
    const __m512 sums = fold4(quarters[0], quarters[1], quarters[2], quarters[3]);
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_permutexvar_ps(order, sums), _mm512_setzero_ps()));
}

// rows_avx512_dpbf16 over 16 rows of a multiple of 32 columns, giving its bits: each row's
// vector of partial sums is built by the same dot-product instructions, then reduced by
// sums16_as_reduce_add.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot16_dpbf16(const uint16_t* rows,
                                                                         const uint16_t* x,
                                                                         float* y,
                                                                         int64_t columns) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
        acc[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < columns; k += 32) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + k));
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
            acc[j] = _mm512_dpbf16_ps(
                acc[j], reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows + j * columns + k)), xv);
    }
    sums16_as_reduce_add(acc, y);
}

// The scores of 4 query rows (bf16, `columns` apart) against `count` keys, a multiple of 4, of a
// multiple of 32 columns, into scores[r * stride + n]: 4 keys by 4 rows at a time, each key
// loaded once for the 4 rows (dot16_dpbf16, a row at a time, loads every key once per row and is
// bound by the loads). Each score is the same chain of dot-product instructions and the same
// reduction as there: the same bits.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot4x4_dpbf16(
    const uint16_t* keys, const uint16_t* queries, float* scores, int64_t stride, int64_t count,
    int64_t columns) {
    for (int64_t n = 0; n < count; n += 4) {
        __m512 acc[16];  // [row * 4 + key]
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
            acc[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < columns; k += 32) {
            __m512bh key[4], query[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                key[i] =
                    reinterpret_cast<__m512bh>(_mm512_loadu_si512(keys + (n + i) * columns + k));
                query[i] =
                    reinterpret_cast<__m512bh>(_mm512_loadu_si512(queries + i * columns + k));
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i)
                    acc[r * 4 + i] = _mm512_dpbf16_ps(acc[r * 4 + i], key[i], query[r]);
        }
        alignas(64) float sums[16];
        sums16_as_reduce_add(acc, sums);
        for (int r = 0; r < 4; ++r)
            std::memcpy(scores + r * stride + n, sums + r * 4, 4 * sizeof(float));
    }
}

// reduce_avx2 of 8 vectors at once, lane i of the result with reduce_avx2(v[i])'s bits: the same
// pairs added (the upper 128 bits to the lower, lanes 2-3 to 0-1, lane 1 to 0) for all of them
// by shuffles, where one reduction each cost a chain of its own.
__attribute__((target("avx2,fma"))) inline __m256 sums8_as_reduce_avx2(const __m256* v) {
    // [v2p's lanes i + (i + 4) | v2p+1's].
    __m256 quads[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p)
        quads[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                                 _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
    // Lanes 0 + 2 and 1 + 3: [v0, v0, v2, v2 | v1, v1, v3, v3] and the same of v4-v7.
    __m256 pairs[2];
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p)
        pairs[p] = _mm256_add_ps(_mm256_shuffle_ps(quads[2 * p], quads[2 * p + 1], 0x44),
                                 _mm256_shuffle_ps(quads[2 * p], quads[2 * p + 1], 0xEE));
    // Lane 0 + 1: [v0, v2, v4, v6 | v1, v3, v5, v7].
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], 0x88),
                                      _mm256_shuffle_ps(pairs[0], pairs[1], 0xDD));
    return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The scores of 4 query rows (float32, `columns` apart) against `count` keys, a multiple of 2, of
// a multiple of 8 columns, into scores[r * stride + n]: 2 keys by 4 rows at a time, each key
// loaded once for the 4 rows. Each score is the chain of fmas rows_avx2 makes for it, reduced as
// reduce_avx2 reduces it, plus its empty tail's 0: the same bits.
template <typename Weight>
__attribute__((target("avx2,fma"))) void dot4x2_avx2(const Weight* keys, const float* queries,
                                                     float* scores, int64_t stride, int64_t count,
                                                     int64_t columns) {
    for (int64_t n = 0; n < count; n += 2) {
        __m256 acc[8];  // [row * 2 + key]
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_setzero_ps();
        const Weight* first = keys + n * columns;
        const Weight* second = first + columns;
        for (int64_t k = 0; k < columns; k += 8) {
            const __m256 key0 = load8(first + k), key1 = load8(second + k);
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
                const __m256 query = _mm256_loadu_ps(queries + r * columns + k);
                acc[r * 2] = _mm256_fmadd_ps(key0, query, acc[r * 2]);
                acc[r * 2 + 1] = _mm256_fmadd_ps(key1, query, acc[r * 2 + 1]);
            }
        }
        alignas(32) float sums[8];
        _mm256_store_ps(sums, _mm256_add_ps(sums8_as_reduce_avx2(acc), _mm256_setzero_ps()));
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r)
            std::memcpy(scores + r * stride + n, sums + r * 2, 2 * sizeof(float));
    }
}

// bf16 rows widened to float32 (exactly), 8 values at a time.
__attribute__((target("avx2,fma"))) void widen_bf16_avx2(const uint16_t* in, float* out,
                                                         int64_t count) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(out + i, load8(in + i));
    for (; i < count; ++i)
        out[i] = bf16_to_float(in[i]);
}

// dot_rows over the rows [0, count) of a block, with the query already rounded to bf16 where
// the dot-product instruction is used (dot_rows would round it again on every call).
template <typename Weight>
void dot_block(const Weight* rows, const float* x, const uint16_t* x_bf16, float* y, int64_t count,
               int64_t columns) {
    if constexpr (std::is_same_v<Weight, uint16_t>)
        if (isa == Isa::avx512_bf16) {
            int64_t n = 0;
            if (columns % 32 == 0)
                for (; n + 16 <= count; n += 16)
                    dot16_dpbf16(rows + n * columns, x_bf16, y + n, columns);
            return rows_avx512_dpbf16(rows, x_bf16, y, n, count, columns);
        }
    dot_rows(rows, x, y, count, columns);
}

// The vector kernels' last step of scale_and_max: the maximum of their lanes' maxima and of
// scores[n, count), scaled in place one at a time.
inline float scale_and_max_rest(const float* lanes, int width, float* scores, int64_t n,
                                int64_t count, float scale) {
    float result = lanes[0];
    for (int lane = 1; lane < width; ++lane)
        result = std::max(result, lanes[lane]);
    for (; n < count; ++n)
        result = std::max(result, scores[n] *= scale);
    return result;
}

// softmax_scaled_in_place's first pass, scores[n] *= scale and their maximum, on vectors: the
// products are the same, and the maximum does not depend on the order (a NaN is passed over, as
// std::max(best, NaN) passes over it).
__attribute__((target("avx512f"))) float scale_and_max_avx512(float* scores, int64_t count,
                                                              float scale) {
    const __m512 factor = _mm512_set1_ps(scale);
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t n = 0;
    for (; n + 16 <= count; n += 16) {
        const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(scores + n), factor);
        _mm512_storeu_ps(scores + n, scaled);
        best = _mm512_max_ps(scaled, best);  // the second operand where either is NaN
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, best);
    return scale_and_max_rest(lanes, 16, scores, n, count, scale);
}

// expf's arithmetic on 16 lanes at a time (glibc 2.27 and later, sysdeps/ieee754/flt-32/e_expf.c:
// x * 32 / ln 2 = k + r, 2^(k/32) from a table of 32 doubles, a cubic in r, all in double, one
// rounding to float at the end), so that softmax keeps expf's bits: checked against the library's
// expf for every float from -104 to 89 (tests/unit/core/model/test_ops.cpp). Lanes with |x| >= 88,
// infinities and NaNs, where expf takes its special paths, are left to expf itself. Measured
// here: 2.0 ns a call of expf in a loop, 0.55 ns a lane.
// The table: bits of 2^(i/32) rounded to double, less i << 47 (the exponent the lane adds back).
alignas(64) constexpr uint64_t expf_table[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

// expf's constants: 32 / ln 2, the shift that rounds to an integer in the low bits, and the
// cubic's coefficients scaled to r = x * 32 / ln 2 - k.
constexpr double expf_steps = 32;
constexpr double expf_to_steps = 0x1.71547652b82fep+0 * expf_steps;
constexpr double expf_round_shift = 0x1.8p+52;
constexpr double expf_c0 = 0x1.c6af84b912394p-5 / expf_steps / expf_steps / expf_steps;
constexpr double expf_c1 = 0x1.ebfce50fac4f3p-3 / expf_steps / expf_steps;
constexpr double expf_c2 = 0x1.62e42ff0c52d6p-1 / expf_steps;

__attribute__((target("avx512f"))) inline __m256 expf8_avx512(__m256 x) {
    const __m512d shift = _mm512_set1_pd(expf_round_shift);
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d z = _mm512_mul_pd(_mm512_set1_pd(expf_to_steps), xd);
    __m512d kd = _mm512_add_pd(z, shift);  // z rounded to an integer, in the low bits
    const __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, shift);
    const __m512d r = _mm512_sub_pd(z, kd);
    const __m512i index = _mm512_and_si512(ki, _mm512_set1_epi64(31));
    const auto* table = reinterpret_cast<const __m512i*>(expf_table);
    const __m512i low =
        _mm512_permutex2var_epi64(_mm512_load_si512(table), index, _mm512_load_si512(table + 1));
    const __m512i high = _mm512_permutex2var_epi64(_mm512_load_si512(table + 2), index,
                                                   _mm512_load_si512(table + 3));
    __m512i t =
        _mm512_mask_blend_epi64(_mm512_test_epi64_mask(index, _mm512_set1_epi64(16)), low, high);
    t = _mm512_add_epi64(t, _mm512_slli_epi64(ki, 52 - 5));
    const __m512d s = _mm512_castsi512_pd(t);
    const __m512d c0 = _mm512_set1_pd(expf_c0);
    const __m512d c1 = _mm512_set1_pd(expf_c1);
    const __m512d c2 = _mm512_set1_pd(expf_c2);
    const __m512d cubic = _mm512_fmadd_pd(c0, r, c1);
    const __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(c2, r, _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(cubic, r2, y);
    return _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
}

// expf8_avx512 on 4 lanes of AVX2: the same double arithmetic, the table read by a gather.
__attribute__((target("avx2,fma"))) inline __m128 expf4_avx2(__m128 x) {
    const __m256d shift = _mm256_set1_pd(expf_round_shift);
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d z = _mm256_mul_pd(_mm256_set1_pd(expf_to_steps), xd);
    __m256d kd = _mm256_add_pd(z, shift);  // z rounded to an integer, in the low bits
    const __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, shift);
    const __m256d r = _mm256_sub_pd(z, kd);
    const __m256i index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    __m256i t = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(expf_table), index, 8);
    t = _mm256_add_epi64(t, _mm256_slli_epi64(ki, 52 - 5));
    const __m256d s = _mm256_castsi256_pd(t);
    const __m256d c0 = _mm256_set1_pd(expf_c0);
    const __m256d c1 = _mm256_set1_pd(expf_c1);
    const __m256d c2 = _mm256_set1_pd(expf_c2);
    const __m256d cubic = _mm256_fmadd_pd(c0, r, c1);
    const __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(c2, r, _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(cubic, r2, y);
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, s));
}

// exp_shifted_avx512 on 8 lanes of AVX2.
__attribute__((target("avx2,fma"))) void exp_shifted_avx2(float* x, int64_t count, float shift) {
    const __m256 by = _mm256_set1_ps(shift);
    const __m256i special = _mm256_set1_epi32(0x42b00000);  // 88.0f
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    int64_t n = 0;
    for (; n + 8 <= count; n += 8) {
        const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + n), by);
        const __m128 low = expf4_avx2(_mm256_castps256_ps128(v));
        const __m128 high = expf4_avx2(_mm256_extractf128_ps(v, 1));
        _mm256_storeu_ps(x + n, _mm256_set_m128(high, low));
        // |v| >= 88 as unsigned integers (NaNs and infinities included): expf's special paths.
        const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v), magnitude);
        const __m256i odd = _mm256_cmpeq_epi32(_mm256_max_epu32(bits, special), bits);
        if (const int lanes = _mm256_movemask_ps(_mm256_castsi256_ps(odd))) {
            alignas(32) float values[8];
            _mm256_store_ps(values, v);
            for (int lane = 0; lane < 8; ++lane)
                if (lanes >> lane & 1) x[n + lane] = std::exp(values[lane]);
        }
    }
    for (; n < count; ++n)
        x[n] = std::exp(x[n] - shift);
}

// scale_and_max_avx512 on AVX2.
__attribute__((target("avx2,fma"))) float scale_and_max_avx2(float* scores, int64_t count,
                                                             float scale) {
    const __m256 factor = _mm256_set1_ps(scale);
    __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t n = 0;
    for (; n + 8 <= count; n += 8) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(scores + n), factor);
        _mm256_storeu_ps(scores + n, scaled);
        best = _mm256_max_ps(scaled, best);  // the second operand where either is NaN
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best);
    return scale_and_max_rest(lanes, 8, scores, n, count, scale);
}

// x[n] *= factor on AVX2 vectors.
__attribute__((target("avx2,fma"))) void multiply_avx2(float* x, int64_t count, float factor) {
    const __m256 by = _mm256_set1_ps(factor);
    int64_t n = 0;
    for (; n + 8 <= count; n += 8)
        _mm256_storeu_ps(x + n, _mm256_mul_ps(_mm256_loadu_ps(x + n), by));
    for (; n < count; ++n)
        x[n] *= factor;
}

// x[n] = expf(x[n] - shift) for n < count.
__attribute__((target("avx512f"))) void exp_shifted_avx512(float* x, int64_t count, float shift) {
    const __m512 by = _mm512_set1_ps(shift);
    // expf's special cases: |x| >= 88 (its top 12 bits past 88's), infinities and NaNs.
    const __m512i special = _mm512_set1_epi32(0x42b00000);  // 88.0f
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    int64_t n = 0;
    for (; n < count; n += 16) {
        const __mmask16 lanes =
            count - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << unsigned(count - n)) - 1u);
        const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + n), by);
        const __m256 low = expf8_avx512(_mm512_castps512_ps256(v));
        const __m256 high =
            expf8_avx512(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        const __m512 e = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
        _mm512_mask_storeu_ps(x + n, lanes, e);
        const __mmask16 odd = _mm512_mask_cmpge_epu32_mask(
            lanes, _mm512_and_si512(_mm512_castps_si512(v), magnitude), special);
        if (odd) {
            alignas(64) float values[16];
            _mm512_store_ps(values, v);
            for (int lane = 0; lane < 16; ++lane)
                if (odd >> lane & 1) x[n + lane] = std::exp(values[lane]);
        }
    }
}

// Rows softmaxed together by softmax_rows.
constexpr int64_t softmax_group = 8;

// totals[g] += rows[g][n] for n < common, each row's sum in its own order, the rows' chains of
// dependent additions interleaved and kept in registers (a chain through memory, one row's total
// stored and loaded again at every key, was most of a question's softmax).
template <int Rows>
void add_rows_interleaved(float* const* rows, int64_t common, double* totals) {
    double sums[Rows];
    const float* row[Rows];
#pragma GCC unroll 8
    for (int g = 0; g < Rows; ++g) {
        sums[g] = totals[g];
        row[g] = rows[g];
    }
    for (int64_t n = 0; n < common; ++n)
#pragma GCC unroll 8
        for (int g = 0; g < Rows; ++g)
            sums[g] += row[g][n];
#pragma GCC unroll 8
    for (int g = 0; g < Rows; ++g)
        totals[g] = sums[g];
}

void add_rows_interleaved(float* const* rows, int64_t count, int64_t common, double* totals) {
    switch (count) {
        case 1:
            return add_rows_interleaved<1>(rows, common, totals);
        case 2:
            return add_rows_interleaved<2>(rows, common, totals);
        case 3:
            return add_rows_interleaved<3>(rows, common, totals);
        case 4:
            return add_rows_interleaved<4>(rows, common, totals);
        case 5:
            return add_rows_interleaved<5>(rows, common, totals);
        case 6:
            return add_rows_interleaved<6>(rows, common, totals);
        case 7:
            return add_rows_interleaved<7>(rows, common, totals);
        default:
            return add_rows_interleaved<8>(rows, common, totals);
    }
}
static_assert(softmax_group <= 8);

// x[n] *= factor on vectors: the same products as one at a time.
__attribute__((target("avx512f"))) void multiply_avx512(float* x, int64_t count, float factor) {
    const __m512 by = _mm512_set1_ps(factor);
    int64_t n = 0;
    for (; n + 16 <= count; n += 16)
        _mm512_storeu_ps(x + n, _mm512_mul_ps(_mm512_loadu_ps(x + n), by));
    for (; n < count; ++n)
        x[n] *= factor;
}

// softmax_scaled_in_place over up to softmax_group rows, with its arithmetic for each row: the
// exponentials and their double sum in each row's own order, the rows interleaved so that their
// sums' chains of dependent additions overlap (one row's chain over 32k keys was most of its
// time).
void softmax_rows(float* const* rows, const int64_t* counts, int64_t count, float scale) {
    const bool avx512 = isa == Isa::avx512 || isa == Isa::avx512_bf16;
    const bool avx2 = isa == Isa::avx2;
    float best[softmax_group];
    double total[softmax_group] = {};
    int64_t common = std::numeric_limits<int64_t>::max();
    for (int64_t g = 0; g < count; ++g) {
        common = std::min(common, counts[g]);
        if (avx512) {
            best[g] = scale_and_max_avx512(rows[g], counts[g], scale);
        } else if (avx2) {
            best[g] = scale_and_max_avx2(rows[g], counts[g], scale);
        } else {
            best[g] = -std::numeric_limits<float>::infinity();
            for (int64_t n = 0; n < counts[g]; ++n)
                best[g] = std::max(best[g], rows[g][n] *= scale);
        }
    }
    for (int64_t g = 0; g < count; ++g)
        exp_shifted_in_place(rows[g], counts[g], best[g]);
    if (count > 0) add_rows_interleaved(rows, count, common, total);
    for (int64_t g = 0; g < count; ++g) {
        if (counts[g] == 0) continue;
        float* row = rows[g];
        for (int64_t n = common; n < counts[g]; ++n)
            total[g] += row[n];
        const float inverse = static_cast<float>(1.0 / total[g]);
        if (avx512) {
            multiply_avx512(row, counts[g], inverse);
        } else if (avx2) {
            multiply_avx2(row, counts[g], inverse);
        } else {
            for (int64_t n = 0; n < counts[g]; ++n)
                row[n] *= inverse;
        }
    }
}

// A block of attend_rows' bf16 keys or values widened to float32 (on AVX2).
struct AttendWideBlock {};

// Rows [first, first + rows) of attend_rows: `scores` holds `stride` floats per row.
template <typename Weight>
void attend_row_chunk(const Weight* keys, const Weight* values, const float* queries,
                      const uint16_t* rounded, int64_t first, int64_t rows, const int64_t* visible,
                      int64_t columns, float scale, float* out, float* scores, int64_t stride) {
    int64_t span = 0;
    for (int64_t r = 0; r < rows; ++r)
        span = std::max(span, visible[first + r]);
    // Row r's keys in [begin, end): none before, n of them.
    auto in_block = [&](int64_t r, int64_t begin, int64_t end) {
        return std::max<int64_t>(0, std::min(end, visible[first + r]) - begin);
    };
    // Rows by 4 where the dot-product instruction is used, over the keys the 4 see in common.
    const bool by_four = std::is_same_v<Weight, uint16_t> && rounded && columns % 32 == 0;
    // On AVX2, rows by 4 over pairs of keys the 4 see in common (dot4x2_avx2), and a block of bf16
    // rows read by more than one group of rows widened once for all of them.
    const bool avx2 = isa == Isa::avx2 && columns % 8 == 0;
    const bool widen = avx2 && std::is_same_v<Weight, uint16_t> && rows > 1;
    const int64_t block_keys = avx2 ? attend_block_avx2 : attend_block;
    float* wide = widen ? kernel_scratch<AttendWideBlock>(block_keys * columns) : nullptr;
    auto score_block_avx2 = [&](const auto* block, int64_t begin, int64_t end) {
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) {
            int64_t common = block_keys;
            for (int64_t g = 0; g < 4; ++g)
                common = std::min(common, in_block(r + g, begin, end));
            common &= ~int64_t{1};
            if (common > 0)
                dot4x2_avx2(block, queries + (first + r) * columns, scores + r * stride + begin,
                            stride, common, columns);
            for (int64_t g = 0; g < 4; ++g)
                if (const int64_t n = in_block(r + g, begin, end); n > common)
                    dot_rows(block + common * columns, queries + (first + r + g) * columns,
                             scores + (r + g) * stride + begin + common, n - common, columns);
        }
        for (; r < rows; ++r)
            if (const int64_t n = in_block(r, begin, end); n > 0)
                dot_rows(block, queries + (first + r) * columns, scores + r * stride + begin, n,
                         columns);
    };
    for (int64_t begin = 0; begin < span; begin += block_keys) {
        const int64_t end = std::min(span, begin + block_keys);
        if (avx2) {
            if constexpr (std::is_same_v<Weight, uint16_t>)
                if (widen && rows > 4) {
                    widen_bf16_avx2(keys + begin * columns, wide, (end - begin) * columns);
                    score_block_avx2(static_cast<const float*>(wide), begin, end);
                    continue;
                }
            score_block_avx2(keys + begin * columns, begin, end);
            continue;
        }
        int64_t r = 0;
        for (; by_four && r + 4 <= rows; r += 4) {
            int64_t common = attend_block;
            for (int64_t g = 0; g < 4; ++g)
                common = std::min(common, in_block(r + g, begin, end));
            common &= ~int64_t{3};
            if constexpr (std::is_same_v<Weight, uint16_t>)
                if (common > 0)
                    dot4x4_dpbf16(keys + begin * columns, rounded + (first + r) * columns,
                                  scores + r * stride + begin, stride, common, columns);
            for (int64_t g = 0; g < 4; ++g)
                if (const int64_t n = in_block(r + g, begin, end); n > common)
                    dot_block(keys + (begin + common) * columns,
                              queries + (first + r + g) * columns,
                              rounded + (first + r + g) * columns,
                              scores + (r + g) * stride + begin + common, n - common, columns);
        }
        for (; r < rows; ++r)
            if (const int64_t n = in_block(r, begin, end); n > 0)
                dot_block(keys + begin * columns, queries + (first + r) * columns,
                          rounded ? rounded + (first + r) * columns : nullptr,
                          scores + r * stride + begin, n, columns);
    }
    for (int64_t r = 0; r < rows; r += softmax_group) {
        float* group_rows[softmax_group];
        int64_t counts[softmax_group];
        const int64_t count = std::min(softmax_group, rows - r);
        for (int64_t g = 0; g < count; ++g) {
            group_rows[g] = scores + (r + g) * stride;
            counts[g] = visible[first + r + g];
        }
        softmax_rows(group_rows, counts, count, scale);
    }
    // The weighted sums: rows in register groups where the kernel has one for this width (the
    // group's rows, then the rest in halving groups: a decoding step's 4 query heads of a kv
    // head of 32 columns, one at a time through memory, were a third of its attention).
    const int64_t vectors = columns / 16;
    const bool grouped = (isa == Isa::avx512 || isa == Isa::avx512_bf16) && columns % 16 == 0 &&
                         (vectors == 1 || vectors == 2 || vectors == 4 || vectors == 8);
    const int64_t group = grouped ? 16 / vectors : 1;
    for (int64_t begin = 0; begin < span; begin += block_keys) {
        const int64_t end = std::min(span, begin + block_keys);
        const Weight* block = values + begin * columns;
        int64_t r = 0;
        for (int64_t take = group; grouped && r < rows; r += take) {
            while (take > rows - r)
                take /= 2;
            // The keys every row of the group sees in this block together, then each row's rest.
            int64_t common = attend_block;
            const float* weights[16];
            float* outs[16];
            for (int64_t g = 0; g < take; ++g) {
                common = std::min(common, in_block(r + g, begin, end));
                weights[g] = scores + (r + g) * stride + begin;
                outs[g] = out + (first + r + g) * columns;
            }
            if (common > 0) switch (vectors) {
                    case 1:
                        accumulate_group_of<Weight, 1>(take, block, weights, outs, common);
                        break;
                    case 2:
                        accumulate_group_of<Weight, 2>(take, block, weights, outs, common);
                        break;
                    case 4:
                        accumulate_group_of<Weight, 4>(take, block, weights, outs, common);
                        break;
                    default:
                        accumulate_group_of<Weight, 8>(take, block, weights, outs, common);
                }
            for (int64_t g = 0; g < take; ++g)
                if (const int64_t rest = in_block(r + g, begin, end) - common; rest > 0)
                    accumulate_rows(block + common * columns, weights[g] + common, outs[g], rest,
                                    columns);
        }
        if (widen) {
            if constexpr (std::is_same_v<Weight, uint16_t>) {
                widen_bf16_avx2(block, wide, (end - begin) * columns);
                for (; r < rows; ++r)
                    if (const int64_t n = in_block(r, begin, end); n > 0)
                        accumulate_rows(static_cast<const float*>(wide),
                                        scores + r * stride + begin, out + (first + r) * columns, n,
                                        columns);
            }
        }
        for (; r < rows; ++r)
            if (const int64_t n = in_block(r, begin, end); n > 0)
                accumulate_rows(block, scores + r * stride + begin, out + (first + r) * columns, n,
                                columns);
    }
}

// attend_rows' scores: a fresh zero-filled vector per call (per layer and kv head) cost a 1B
// model's 9-token question over 32k keys 128 allocations of 4.5 MiB, each zero-filled and most
// faulted in anew. Every score is written before it is read (only the keys a row sees are scored,
// softmaxed and summed).
struct AttendScores {};

template <typename Weight>
void attend_rows_typed(const Weight* keys, const Weight* values, const float* queries,
                       int64_t count, const int64_t* visible, int64_t columns, float scale,
                       float* out) {
    std::fill(out, out + count * columns, 0.0f);
    int64_t longest = 0;
    for (int64_t r = 0; r < count; ++r)
        longest = std::max(longest, visible[r]);
    if (longest == 0) return;
    std::vector<uint16_t> rounded;
    if (std::is_same_v<Weight, uint16_t> && isa == Isa::avx512_bf16)
        rounded = to_bf16(queries, count * columns);
    const int64_t chunk = std::clamp<int64_t>(attend_score_floats / longest, 1, count);
    float* scores = kernel_scratch<AttendScores>(chunk * longest);
    for (int64_t first = 0; first < count; first += chunk)
        attend_row_chunk(keys, values, queries, rounded.empty() ? nullptr : rounded.data(), first,
                         std::min(chunk, count - first), visible, columns, scale, out, scores,
                         longest);
}

}  // namespace

void gemv_bf16(const uint16_t* weights, const float* x, float* y, int64_t rows, int64_t columns) {
    if (isa == Isa::avx512_bf16) {
        const std::vector<uint16_t> x_bf16 = to_bf16(x, columns);
        const uint16_t* rounded = x_bf16.data();
        return run_rows(weights, x, y, rows, columns,
                        [rounded](const uint16_t* w, const float*, float* out, int64_t b, int64_t e,
                                  int64_t c) { rows_avx512_dpbf16(w, rounded, out, b, e, c); });
    }
    gemv_widened(weights, x, y, rows, columns);
}

namespace {

uint16_t round_one_to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    if (std::isnan(value)) return 0x7fc0;
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__attribute__((target("avx512f"))) void widen_bf16_avx512(const uint16_t* in, float* out,
                                                          int64_t count) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
        const __m512i wide =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
    for (; i < count; ++i) {
        const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
        std::memcpy(out + i, &bits, sizeof bits);
    }
}

__attribute__((target("avx512f"))) void round_to_bf16_avx512(const float* in, uint16_t* out,
                                                             int64_t count) {
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1),
                  nan = _mm512_set1_epi32(0x7fc0);
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
        const __m512 values = _mm512_loadu_ps(in + i);
        const __m512i bits = _mm512_castps_si512(values);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
        __m512i rounded =
            _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, bias), odd), 16);
        rounded =
            _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q), rounded, nan);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(rounded));
    }
    for (; i < count; ++i)
        out[i] = round_one_to_bf16(in[i]);
}

}  // namespace

void widen_bf16(const uint16_t* in, float* out, int64_t count) {
    if (isa == Isa::avx512 || isa == Isa::avx512_bf16) return widen_bf16_avx512(in, out, count);
    if (isa == Isa::avx2) return widen_bf16_avx2(in, out, count);
    for (int64_t i = 0; i < count; ++i) {
        const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
        std::memcpy(out + i, &bits, sizeof bits);
    }
}

void round_to_bf16(const float* in, uint16_t* out, int64_t count) {
    if (isa == Isa::avx512 || isa == Isa::avx512_bf16) return round_to_bf16_avx512(in, out, count);
    for (int64_t i = 0; i < count; ++i)
        out[i] = round_one_to_bf16(in[i]);
}

bool gemm_few_bf16_fits(int64_t tokens, int64_t columns) {
    if (tokens < 1 || tokens > max_few_tokens) return false;
    return isa == Isa::avx512_bf16 ? columns % 32 == 0 : isa == Isa::avx512 || isa == Isa::avx2;
}

namespace {

struct FewTokensBlock {};  // kernel_scratch tag

// rows_avx2 for two tokens at once: rows [begin, end) of float32 weights times x0 into y0 and
// times x1 into y1, each row's load shared by the two tokens (one token at a time, 5 loads for
// every 4 fmas, waited on L2). Each (row, token) is rows_avx2's chain of fmas and reduction: the
// same bits.
__attribute__((target("avx2,fma"))) void rows_two_tokens_avx2(const float* weights, const float* x0,
                                                              const float* x1, float* y0, float* y1,
                                                              int64_t begin, int64_t end,
                                                              int64_t columns) {
    const int64_t vector_columns = columns & ~int64_t{7};
    const int64_t tail = columns - vector_columns;
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const float* row = weights + n * columns;
        __m256 acc[8];  // [row * 2 + token]
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < vector_columns; k += 8) {
            const __m256 first = _mm256_loadu_ps(x0 + k), second = _mm256_loadu_ps(x1 + k);
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
                const __m256 w = _mm256_loadu_ps(row + r * columns + k);
                acc[r * 2] = _mm256_fmadd_ps(w, first, acc[r * 2]);
                acc[r * 2 + 1] = _mm256_fmadd_ps(w, second, acc[r * 2 + 1]);
            }
        }
        alignas(32) float sums[8];
        _mm256_store_ps(sums, sums8_as_reduce_avx2(acc));
        for (int r = 0; r < 4; ++r) {
            const float* rest = row + r * columns + vector_columns;
            y0[n + r] = sums[r * 2] + dot_portable(rest, x0 + vector_columns, tail);
            y1[n + r] = sums[r * 2 + 1] + dot_portable(rest, x1 + vector_columns, tail);
        }
    }
    rows_avx2(weights, x0, y0, n, end, columns);
    rows_avx2(weights, x1, y1, n, end, columns);
}

// gemm_few_bf16 where gemv_bf16 widens the weights (AVX-512 without its bf16 instructions,
// AVX2): each block of weight rows (~128 KiB as float32, kept in L2) is widened once, then every
// token goes over it with the rows kernel gemv_bf16 uses, which gives float32 rows of the widened
// values the bits it gives the bf16 ones (on AVX2, tokens two at a time by its twin).
template <typename Rows>
void gemm_few_widened(const uint16_t* weights, const float* x, float* y, int64_t tokens,
                      int64_t rows, int64_t columns, Rows kernel) {
    const int64_t block = std::max<int64_t>(4, ((int64_t{1} << 17) / (columns * 4)) & ~int64_t{3});
    const bool pairs = isa == Isa::avx2;
    at::parallel_for(0, (rows + block - 1) / block, 1, [&](int64_t first, int64_t last) {
        float* wide = kernel_scratch<FewTokensBlock>(block * columns);
        for (int64_t b = first; b < last; ++b) {
            const int64_t begin = b * block, end = std::min(rows, begin + block);
            widen_bf16(weights + begin * columns, wide, (end - begin) * columns);
            int64_t t = 0;
            for (; pairs && t + 2 <= tokens; t += 2)
                rows_two_tokens_avx2(wide, x + t * columns, x + (t + 1) * columns,
                                     y + t * rows + begin, y + (t + 1) * rows + begin, 0,
                                     end - begin, columns);
            for (; t < tokens; ++t)
                kernel(wide, x + t * columns, y + t * rows + begin, 0, end - begin, columns);
        }
    });
}

}  // namespace

void gemm_few_bf16(const uint16_t* weights, const float* x, float* y, int64_t tokens, int64_t rows,
                   int64_t columns) {
    if (!gemm_few_bf16_fits(tokens, columns))
        throw std::invalid_argument("gemm_few_bf16: needs AVX-512 or AVX2, 1 to " +
                                    std::to_string(max_few_tokens) +
                                    " tokens and, with AVX512-BF16, a multiple of 32 columns");
    if (isa == Isa::avx512)
        return gemm_few_widened(weights, x, y, tokens, rows, columns, rows_avx512<float>);
    if (isa == Isa::avx2)
        return gemm_few_widened(weights, x, y, tokens, rows, columns, rows_avx2<float>);
    const std::vector<uint16_t> rounded = to_bf16(x, tokens * columns);
    // Blocks of weight rows small enough (~128 KiB) to stay in L2 while every group of 4 tokens
    // goes over them: the weights come from memory once, as one token's gemv reads them.
    const int64_t block = std::max<int64_t>(4, ((int64_t{1} << 17) / (columns * 2)) & ~int64_t{3});
    at::parallel_for(0, (rows + block - 1) / block, 1, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            const int64_t begin = b * block, end = std::min(rows, begin + block);
            const int64_t fours = (end - begin) & ~int64_t{3};
            int64_t t = 0;
            for (; t + 4 <= tokens; t += 4) {
                if (fours > 0)
                    dot4x4_dpbf16(weights + begin * columns, rounded.data() + t * columns,
                                  y + t * rows + begin, rows, fours, columns);
                for (int64_t r = t; r < t + 4; ++r)
                    rows_avx512_dpbf16(weights, rounded.data() + r * columns, y + r * rows,
                                       begin + fours, end, columns);
            }
            for (; t < tokens; ++t)
                rows_avx512_dpbf16(weights, rounded.data() + t * columns, y + t * rows, begin, end,
                                   columns);
        }
    });
}

void gemv_f32(const float* weights, const float* x, float* y, int64_t rows, int64_t columns) {
    gemv_widened(weights, x, y, rows, columns);
}

void dot_rows_bf16(const uint16_t* rows, const float* x, float* y, int64_t count, int64_t columns) {
    dot_rows(rows, x, y, count, columns);
}
void dot_rows_f32(const float* rows, const float* x, float* y, int64_t count, int64_t columns) {
    dot_rows(rows, x, y, count, columns);
}
void dot_many_rows_f32(const float* rows, const float* x, float* y, int64_t count,
                       int64_t columns) {
    if ((isa == Isa::avx512 || isa == Isa::avx512_bf16) && columns % 16 == 0)
        return many_rows_avx512(rows, x, y, count, columns);
    dot_rows(rows, x, y, count, columns);
}
void dot_many_rows_bf16(const uint16_t* rows, const float* x, float* y, int64_t count,
                        int64_t columns) {
    if ((isa == Isa::avx512 || isa == Isa::avx512_bf16) && columns % 16 == 0)
        return many_rows_avx512(rows, x, y, count, columns);
    // rows_avx2 widens each value as it reads it: the bits of the float32 rows below.
    if (isa == Isa::avx2) return rows_avx2(rows, x, y, 0, count, columns);
    // Widened, then as float32 rows: the same bits as those rows would give.
    std::vector<float> wide(static_cast<std::size_t>(count * columns));
    for (std::size_t i = 0; i < wide.size(); ++i)
        wide[i] = bf16_to_float(rows[i]);
    dot_many_rows_f32(wide.data(), x, y, count, columns);
}
void accumulate_rows_bf16(const uint16_t* rows, const float* weights, float* out, int64_t count,
                          int64_t columns) {
    accumulate_rows(rows, weights, out, count, columns);
}
void accumulate_rows_f32(const float* rows, const float* weights, float* out, int64_t count,
                         int64_t columns) {
    accumulate_rows(rows, weights, out, count, columns);
}
void dot_rows(StoredRows rows, const float* x, float* y, int64_t count, int64_t columns) {
    if (rows.bf16)
        dot_rows_bf16(static_cast<const uint16_t*>(rows.data), x, y, count, columns);
    else
        dot_rows_f32(static_cast<const float*>(rows.data), x, y, count, columns);
}
void accumulate_rows(StoredRows rows, const float* weights, float* out, int64_t count,
                     int64_t columns) {
    if (rows.bf16)
        accumulate_rows_bf16(static_cast<const uint16_t*>(rows.data), weights, out, count, columns);
    else
        accumulate_rows_f32(static_cast<const float*>(rows.data), weights, out, count, columns);
}

bool widen_bf16_matmuls() {
    return isa == Isa::avx2 || isa == Isa::portable;
}

const char* gemv_isa() {
    return isa_name(isa);
}

void attend_rows(StoredRows keys, StoredRows values, const float* queries, int64_t count,
                 const int64_t* visible, int64_t columns, float scale, float* out) {
    if (keys.bf16 != values.bf16)
        throw std::invalid_argument("attend_rows: keys and values of one storage type");
    if (keys.bf16)
        attend_rows_typed(static_cast<const uint16_t*>(keys.data),
                          static_cast<const uint16_t*>(values.data), queries, count, visible,
                          columns, scale, out);
    else
        attend_rows_typed(static_cast<const float*>(keys.data),
                          static_cast<const float*>(values.data), queries, count, visible, columns,
                          scale, out);
}

void exp_shifted_in_place(float* x, int64_t count, float shift) {
    if (isa == Isa::avx512 || isa == Isa::avx512_bf16) return exp_shifted_avx512(x, count, shift);
    if (isa == Isa::avx2) return exp_shifted_avx2(x, count, shift);
    for (int64_t n = 0; n < count; ++n)
        x[n] = std::exp(x[n] - shift);
}

void softmax_scaled_in_place(float* scores, int64_t count, float scale) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t n = 0; n < count; ++n)
        best = std::max(best, scores[n] *= scale);
    exp_shifted_in_place(scores, count, best);
    double total = 0;
    for (int64_t n = 0; n < count; ++n)
        total += scores[n];
    const float inverse = static_cast<float>(1.0 / total);
    for (int64_t n = 0; n < count; ++n)
        scores[n] *= inverse;
}

}  // namespace kv
