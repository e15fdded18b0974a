// Matrix-vector products for one-token decoding, where reading the weights is the whole cost.
//
// libtorch 1.13 streams f32 weights at ~30 GB/s through `mv` but bf16 weights at ~4 GB/s (it has
// no bf16 matrix-vector kernel), which made bf16 decoding 8x slower than f32 despite half the
// bytes. These kernels read bf16 or f32 rows with AVX512-BF16, AVX-512 or AVX2 (chosen at run
// time, with a portable fallback), accumulate in f32, and split rows over libtorch's threads.
#pragma once

#include <cstdint>

namespace kv {

/// y[n] = sum_k weights[n][k] * x[k] for n < rows; weights row-major (bf16 as raw bits). With
/// AVX512-BF16 the bf16 kernels round x to bf16 first, which is exact for bf16 activations.
void gemv_bf16(const uint16_t* weights, const float* x, float* y, int64_t rows, int64_t columns);
void gemv_f32(const float* weights, const float* x, float* y, int64_t rows, int64_t columns);

/// A few tokens through bf16 weights (a short question's prefill): y[t * rows + n] = sum_k
/// weights[n][k] * x[t * columns + k] for t < tokens, with the weights read from memory once
/// for all of them (blocks of rows kept in L2 while every token goes over them), each output
/// the same bits as gemv_bf16 gives that token alone. Only where gemm_few_bf16_fits: 1 to
/// max_few_tokens tokens on a CPU with AVX-512 or AVX2, and with AVX512-BF16 columns a multiple
/// of 32 (without it, each block of rows is widened to float32 once for all the tokens); throws
/// otherwise.
inline constexpr int64_t max_few_tokens = 64;
bool gemm_few_bf16_fits(int64_t tokens, int64_t columns);
void gemm_few_bf16(const uint16_t* weights, const float* x, float* y, int64_t tokens, int64_t rows,
                   int64_t columns);

/// bf16 values (raw bits) widened to float32, exactly; float32 rounded to bf16 to nearest even
/// (a NaN to 0x7fc0), as at::BFloat16 rounds. With AVX-512, 16 at a time.
void widen_bf16(const uint16_t* in, float* out, int64_t count);
void round_to_bf16(const float* in, uint16_t* out, int64_t count);

/// Serial building blocks for kernels that parallelise at a coarser level (attention over heads):
/// y[n] = dot(rows[n], x) for n < count, and out[d] += sum_n weights[n] * rows[n][d].
void dot_rows_bf16(const uint16_t* rows, const float* x, float* y, int64_t count, int64_t columns);
void dot_rows_f32(const float* rows, const float* x, float* y, int64_t count, int64_t columns);
/// dot_rows_f32 for many short rows (an index scoring candidates): with AVX-512 16 rows at a time,
/// their sums folded together instead of reduced one by one; the sums are added in another order,
/// so they may differ from dot_rows_f32's in the last bits.
void dot_many_rows_f32(const float* rows, const float* x, float* y, int64_t count, int64_t columns);
/// dot_many_rows_f32 over bf16 rows (raw bits), widened exactly: the same bits as float32 rows
/// holding the same values.
void dot_many_rows_bf16(const uint16_t* rows, const float* x, float* y, int64_t count,
                        int64_t columns);
void accumulate_rows_bf16(const uint16_t* rows, const float* weights, float* out, int64_t count,
                          int64_t columns);
void accumulate_rows_f32(const float* rows, const float* weights, float* out, int64_t count,
                         int64_t columns);
/// The same over rows in a cache's storage type, bf16 (raw bits) or f32, read as they are.
struct StoredRows {
    const void* data;
    bool bf16;
};
void dot_rows(StoredRows rows, const float* x, float* y, int64_t count, int64_t columns);
void accumulate_rows(StoredRows rows, const float* weights, float* out, int64_t count,
                     int64_t columns);
/// Attention of `count` query rows [count, columns] (float32) over the stored rows of one kv
/// head, row r over the first visible[r] keys and values: out[r] = sum_n p[n] values[n], p =
/// softmax(scale * dot(keys[n], queries[r])) over n < visible[r], zeros where visible[r] is 0.
/// The same bits as dot_rows, softmax_scaled_in_place and accumulate_rows (into zeros) row by
/// row, which is one-token decoding's arithmetic; but each block of keys and of values is read
/// once for every row while it is in the core's cache, where row by row read the whole head
/// again for each row (a short question over a long context: 36 rows of a 1B model's kv head,
/// 36 passes over 4 MiB). Serial: callers split kv heads over threads.
void attend_rows(StoredRows keys, StoredRows values, const float* queries, int64_t count,
                 const int64_t* visible, int64_t columns, float scale, float* out);
/// x[n] = expf(x[n] - shift) for n < count, in place, with the bits of glibc's expf (2.27 and
/// later): on AVX-512 16 lanes and on AVX2 8 go at once in its arithmetic; expf itself elsewhere.
void exp_shifted_in_place(float* x, int64_t count, float shift);
/// scores[n] = softmax(scale * scores)[n] for n < count, in place: the maximum in float, the
/// exponentials in float, their sum in double. One-token attention in memory and streamed from
/// disk both use it, so that the two give the same bits.
void softmax_scaled_in_place(float* scores, int64_t count, float scale);

/// The instruction set the kernels use here: "avx512-bf16", "avx512", "avx2" or "portable".
const char* gemv_isa();

/// Whether bf16 matrix products are better done in float32 here: libtorch 1.13 has oneDNN's bf16
/// kernels only with AVX-512; without it, its own bf16 gemm took a 1B model's 16-token question
/// 29 s (~1.4 GFLOP/s) on 2 AVX2 cores, and its products lie further from float64.
bool widen_bf16_matmuls();

}  // namespace kv
