// Dense matmul on oneDNN's sgemm. See ops/matmul.h for the layouts and the
// gradient formulas; the comments here are about how each product is mapped
// onto gemm calls and how those are threaded.
#include "ops/matmul.h"

#include <dnnl.h>
#include <omp.h>

#include <utility>

#include "core/error.h"

namespace ds::ops {

namespace {

// Limits the calling thread's OpenMP team to one thread while alive.
class SingleThreaded {
 public:
  SingleThreaded() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThreaded() { omp_set_num_threads(saved_); }
  SingleThreaded(const SingleThreaded&) = delete;
  SingleThreaded& operator=(const SingleThreaded&) = delete;

 private:
  int saved_;
};

// Below this many multiply-adds a product is not worth sharing out (~20 us of
// work on one core).
constexpr double kMinSplitWork = 1 << 21;

// How gemm shares C [M, N] between T threads: a grid of tm x tn blocks with
// tm * tn = T, one single-threaded sgemm per block. Of the grids whose blocks
// keep at least 16 rows and 16 columns, it picks the one that packs the least:
// every block packs its rows of A (M/tm x K) and its columns of B (K x N/tn),
// K (M tn + N tm) in all. Returns {1, 1} when the product is too small.
std::pair<int64_t, int64_t> split_grid(int64_t M, int64_t N, int64_t K, int T) {
  std::pair<int64_t, int64_t> best{1, 1};
  if (static_cast<double>(M) * N * K < kMinSplitWork) return best;
  double best_cost = -1;
  for (int64_t tm = 1; tm <= T; ++tm) {
    if (T % tm) continue;
    const int64_t tn = T / tm;
    if ((tm > 1 && M < 16 * tm) || (tn > 1 && N < 16 * tn)) continue;
    const double cost = static_cast<double>(M) * tn + static_cast<double>(N) * tm;
    if (best_cost < 0 || cost < best_cost) {
      best = {tm, tn};
      best_cost = cost;
    }
  }
  return best;
}

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

// Outside a parallel region the product is split into a grid of blocks, one
// single-threaded sgemm each, rather than left to oneDNN's own threading: with
// a row-major B^T (a Linear weight) oneDNN's partition ran 15-35% slower than
// this split on projection shapes (512x1408x2048, 256x2048x7168, 2 threads),
// and no slower elsewhere. The
// split never cuts the reduction over K, so each element of C comes from one
// single-threaded dot product whatever the thread count. For the same reason a
// matrix-vector product, whose reduction oneDNN would cut into per-thread
// pieces, runs on one thread when it is too small or too thin to split.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
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
  const int T = omp_in_parallel() ? 1 : omp_get_max_threads();
  const auto [tm, tn] = T > 1 ? split_grid(M, N, K, T) : std::pair<int64_t, int64_t>{1, 1};
  dnnl_status_t st = dnnl_success;
  if (tm * tn > 1) {
    // Block (i, j): rows [M i / tm, M (i+1) / tm), columns likewise but on
    // multiples of 16 so that every block starts on a cache line of C.
#pragma omp parallel for schedule(static) num_threads(T)
    for (int64_t blk = 0; blk < tm * tn; ++blk) {
      const int64_t i = blk / tn, j = blk % tn;
      const int64_t m0 = M * i / tm, m1 = M * (i + 1) / tm;
      const int64_t n0 = N * j / tn / 16 * 16, n1 = j + 1 == tn ? N : N * (j + 1) / tn / 16 * 16;
      const float* Ab = A + (trans_a ? m0 : m0 * lda);
      const float* Bb = B + (trans_b ? n0 * ldb : n0);
      const dnnl_status_t s =
          sgemm(trans_a, trans_b, m1 - m0, n1 - n0, K, alpha, Ab, lda, Bb, ldb, beta, C + m0 * ldc + n0, ldc);
      if (s != dnnl_success) {
#pragma omp atomic write
        st = s;
      }
    }
  } else if (T > 1 && (M == 1 || N == 1)) {
    SingleThreaded one;
    st = sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    st = sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  DS_CHECK(st == dnnl_success, "gemm: oneDNN sgemm failed with status {} (M={} N={} K={})", static_cast<int>(st), M, N,
           K);
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
