// Dense matmul on oneDNN's sgemm. See ops/matmul.h for the layouts and the
// gradient formulas; the comments here are about how each product is mapped
// onto gemm calls and how those are threaded.
#include "ops/matmul.h"

#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "core/error.h"
#include "ops/cpu/gemm_internal.h"

namespace ds::ops {

namespace {

// Below this many multiply-adds a product is one block (~20 us of work on
// one core): not worth sharing out.
constexpr double kMinSplitWork = 1 << 21;

// Largest block of C one sgemm call computes. Big enough that packing its
// rows of A and columns of B (K (rows + cols) floats) costs little next to
// its K rows cols multiply-adds, small enough that mid-sized products still
// give every thread of a many-core machine a block.
constexpr int64_t kBlockRows = 512;
constexpr int64_t kBlockCols = 1024;
// Large products are cut further, down to 32 x 64 blocks of at least
// 2 kMinSplitWork, until there are this many blocks to share out.
constexpr int64_t kMinBlocks = 8;

// Splits n into ceil(n / max_block) blocks of nearly equal size, rounded up
// to a multiple of 16 so that blocks start on a cache line of C.
int64_t block_edge(int64_t n, int64_t max_block) {
  const int64_t blocks = (n + max_block - 1) / max_block;
  return std::min(n, ((n + blocks - 1) / blocks + 15) / 16 * 16);
}

}  // namespace

// The edges {rows, cols} of the blocks C [M, N] is cut into, from the shape
// alone (see gemm).
std::pair<int64_t, int64_t> detail::gemm_block_shape(int64_t M, int64_t N, int64_t K, int64_t min_blocks,
                                                     double min_split_work) {
  if (min_blocks == 0) min_blocks = kMinBlocks;
  if (min_split_work == 0) min_split_work = kMinSplitWork;
  if (static_cast<double>(M) * N * K < min_split_work) return {M, N};
  int64_t bm = block_edge(M, kBlockRows), bn = block_edge(N, kBlockCols);
  while (((M + bm - 1) / bm) * ((N + bn - 1) / bn) < min_blocks &&
         static_cast<double>(bm) * bn * K >= 2 * min_split_work) {
    // Halve the longer edge (columns count double: they are the fast
    // dimension of C and of the packed panels).
    const bool cols = bn >= 2 * bm ? bn > 64 : bm <= 32;
    const int64_t nbm = cols ? bm : block_edge(M, bm / 2), nbn = cols ? block_edge(N, bn / 2) : bn;
    if ((nbm == bm && nbn == bn) || (nbn < 64 && nbn < N) || (nbm < 32 && nbm < M)) break;
    bm = nbm;
    bn = nbn;
  }
  return {bm, bn};
}

namespace {

dnnl_status_t sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  return dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// dA = dC op(B)^T (written with factor beta_a on the old dA: 0 overwrites, 1
// accumulates) and dB += op(A)^T dC, in the stored layouts of A and B.
void backward_products(float* da, float beta_a, float* db, const float* dc, const float* a, const float* b, int64_t M,
                       int64_t N, int64_t K, bool trans_a, bool trans_b) {
  const int64_t lda = trans_a ? M : K, ldb = trans_b ? K : N;
  if (da) {
    // Stored A is op(A) [M,K] itself, or its transpose [K,M] = op(B) dC^T.
    if (!trans_a)
      gemm(false, !trans_b, M, K, N, 1.0f, dc, N, b, ldb, beta_a, da, lda);
    else
      gemm(trans_b, true, K, M, N, 1.0f, b, ldb, dc, N, beta_a, da, lda);
  }
  if (db) {
    // Stored B is op(B) [K,N] += op(A)^T dC, or its transpose [N,K] += dC^T op(A).
    if (!trans_b)
      gemm(!trans_a, false, K, N, M, 1.0f, a, lda, dc, N, 1.0f, db, ldb);
    else
      gemm(true, trans_a, N, K, M, 1.0f, dc, N, a, lda, 1.0f, db, ldb);
  }
}

}  // namespace

// The product is cut into blocks of C whose edges depend on M, N and K alone
// (block_shape), one single-threaded sgemm each; the threads share out the
// blocks. No block cuts the reduction over K, and a block's bits depend only
// on its shape and data, so C is bitwise the same for any thread count, also
// where oneDNN's kernels (its AVX2 ones) give different bits for different
// call shapes. oneDNN's own threading is never used: it cuts K for a
// matrix-vector product, and with a row-major B^T (a Linear weight) its
// partition ran 15-35% slower than blocks on projection shapes.
void detail::gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                      int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // The blocks depend on the shape alone. oneDNN's result for an element
  // depends on the shape of the call that computes it (its blocking of K
  // does, on some ISAs), so the thread count may only decide which thread
  // runs which block, never where the blocks are.
  // (Copied out of the pair: clang before 16 cannot capture structured
  // bindings in the OpenMP region's lambda.)
  const auto block = detail::gemm_block_shape(M, N, K);
  const int64_t bm = block.first, bn = block.second;
  const int64_t gm = (M + bm - 1) / bm, gn = (N + bn - 1) / bn;
  dnnl_status_t st = dnnl_success;
  if (gm * gn > 1) {
    const int T = omp_in_parallel() ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), gm * gn));
#pragma omp parallel for schedule(static) num_threads(T) if (T > 1)
    for (int64_t blk = 0; blk < gm * gn; ++blk) {
      const int64_t m0 = blk / gn * bm, n0 = blk % gn * bn;
      const int64_t m1 = std::min(M, m0 + bm), n1 = std::min(N, n0 + bn);
      const float* Ab = A + (trans_a ? m0 : m0 * lda);
      const float* Bb = B + (trans_b ? n0 * ldb : n0);
      detail::SingleThreaded one;
      const dnnl_status_t s =
          sgemm(trans_a, trans_b, m1 - m0, n1 - n0, K, alpha, Ab, lda, Bb, ldb, beta, C + m0 * ldc + n0, ldc);
      if (s != dnnl_success) {
#pragma omp atomic write
        st = s;
      }
    }
  } else {
    // One block: oneDNN may thread it, but a product this small or this thin
    // (a matrix-vector product) would have its reduction over K cut into
    // per-thread pieces, so it runs on one thread.
    detail::SingleThreaded one;
    st = sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  DS_CHECK(st == dnnl_success, "gemm: oneDNN sgemm failed with status {} (M={} N={} K={})", static_cast<int>(st), M, N,
           K);
}

namespace {

std::atomic<GemmDtype> g_gemm_dtype{GemmDtype::kF32};

}  // namespace

void set_gemm_dtype(GemmDtype t) { g_gemm_dtype = t; }
GemmDtype gemm_dtype() { return g_gemm_dtype; }

GemmDtype parse_gemm_dtype(std::string_view name) {
  if (name == "float32") return GemmDtype::kF32;
  if (name == "bfloat16") return GemmDtype::kBf16;
  DS_FAIL("dtype '{}' is not one of: float32, bfloat16", name);
}

std::string_view gemm_dtype_name(GemmDtype t) { return t == GemmDtype::kBf16 ? "bfloat16" : "float32"; }

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, GemmOperand A, int64_t lda,
          GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc) {
  DS_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M={} N={} K={}", M, N, K);
  if (M == 0 || N == 0) return;
  DS_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N,
           "gemm: leading dimensions lda={} ldb={} ldc={} too small for M={} N={} K={} (trans_a={}, trans_b={})", lda,
           ldb, ldc, M, N, K, trans_a, trans_b);
  if (K == 0) {
    // No products: C = beta * C (BLAS semantics), without reading C when beta is 0.
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  if (gemm_dtype() == GemmDtype::kBf16) {
    detail::gemm_bf16(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    DS_CHECK(A.f32 && B.f32 && !A.rounded && !B.rounded,
             "gemm: operands prepared for bfloat16 multiplied in float32 (gemm_dtype changed between them)");
    detail::gemm_f32(trans_a, trans_b, M, N, K, alpha, A.f32, lda, B.f32, ldb, beta, C, ldc);
  }
}

void matmul_forward(float* c, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool trans_a,
                    bool trans_b) {
  gemm(trans_a, trans_b, M, N, K, 1.0f, a, trans_a ? M : K, b, trans_b ? K : N, 0.0f, c, N);
}

void matmul_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t M, int64_t N,
                     int64_t K, bool trans_a, bool trans_b) {
  DS_CHECK(M >= 0 && N >= 0 && K >= 0, "matmul_backward: negative size M={} N={} K={}", M, N, K);
  backward_products(da, 0.0f, db, dc, a, b, M, N, K, trans_a, trans_b);
}

void matmul_batched_forward(float* c, const float* a, const float* b, int64_t batch, int64_t M, int64_t N, int64_t K,
                            int64_t stride_a, int64_t stride_b, int64_t stride_c, bool trans_a, bool trans_b) {
  DS_CHECK(batch >= 0 && stride_a >= 0 && stride_b >= 0 && (batch <= 1 || stride_c >= M * N),
           "matmul_batched: batch={} strides a={} b={} c={} for [{}, {}] outputs", batch, stride_a, stride_b, stride_c,
           M, N);
  for (int64_t i = 0; i < batch; ++i)
    matmul_forward(c + i * stride_c, a + i * stride_a, b + i * stride_b, M, N, K, trans_a, trans_b);
}

void matmul_batched_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t batch,
                             int64_t M, int64_t N, int64_t K, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                             bool trans_a, bool trans_b) {
  DS_CHECK(batch >= 0 && stride_a >= 0 && stride_b >= 0 && (batch <= 1 || stride_c >= M * N),
           "matmul_batched_backward: batch={} strides a={} b={} c={} for [{}, {}] outputs", batch, stride_a, stride_b,
           stride_c, M, N);
  DS_CHECK(M >= 0 && N >= 0 && K >= 0, "matmul_batched_backward: negative size M={} N={} K={}", M, N, K);
  // Sequential over the batch so a broadcast db (stride_b == 0) accumulates in a
  // fixed order; each product is itself multi-threaded. A broadcast A
  // (stride_a == 0) gets the sum over the batch: the first product overwrites
  // da, the later ones add to it.
  for (int64_t i = 0; i < batch; ++i) {
    const float beta_a = (stride_a == 0 && i > 0) ? 1.0f : 0.0f;
    backward_products(da ? da + i * stride_a : nullptr, beta_a, db ? db + i * stride_b : nullptr, dc + i * stride_c,
                      a + i * stride_a, b + i * stride_b, M, N, K, trans_a, trans_b);
  }
}

}  // namespace ds::ops
