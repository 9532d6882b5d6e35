#include "ops/matmul.h"

#include <dnnl.h>

#include "core/error.h"

namespace ds::ops {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  DS_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M={} N={} K={}", M, N, K);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    // No products: C = beta * C (BLAS semantics), without reading C when beta is 0.
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  DS_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N,
           "gemm: leading dimensions lda={} ldb={} ldc={} too small for M={} N={} K={} (trans_a={}, trans_b={})", lda,
           ldb, ldc, M, N, K, trans_a, trans_b);
  dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  DS_CHECK(st == dnnl_success, "gemm: oneDNN sgemm failed with status {} (M={} N={} K={})", static_cast<int>(st), M, N,
           K);
}

void matmul_forward(float* c, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool trans_a,
                    bool trans_b) {
  gemm(trans_a, trans_b, M, N, K, 1.0f, a, trans_a ? M : K, b, trans_b ? K : N, 0.0f, c, N);
}

void matmul_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t M, int64_t N,
                     int64_t K, bool trans_a, bool trans_b) {
  const int64_t lda = trans_a ? M : K, ldb = trans_b ? K : N;
  if (da) {
    // op(A) = dC op(B)^T; stored A is op(A) or its transpose.
    if (!trans_a) gemm(false, !trans_b, M, K, N, 1.0f, dc, N, b, ldb, 0.0f, da, lda);
    else gemm(trans_b, true, K, M, N, 1.0f, b, ldb, dc, N, 0.0f, da, lda);
  }
  if (db) {
    // op(B) += op(A)^T dC.
    if (!trans_b) gemm(!trans_a, false, K, N, M, 1.0f, a, lda, dc, N, 1.0f, db, ldb);
    else gemm(true, trans_a, N, K, M, 1.0f, dc, N, a, lda, 1.0f, db, ldb);
  }
}

void matmul_batched_forward(float* c, const float* a, const float* b, int64_t batch, int64_t M, int64_t N, int64_t K,
                            int64_t stride_a, int64_t stride_b, int64_t stride_c, bool trans_a, bool trans_b) {
  DS_CHECK(batch >= 0 && stride_c >= M * N, "matmul_batched: batch={} stride_c={} for [{}, {}] outputs", batch,
           stride_c, M, N);
  for (int64_t i = 0; i < batch; ++i)
    matmul_forward(c + i * stride_c, a + i * stride_a, b + i * stride_b, M, N, K, trans_a, trans_b);
}

void matmul_batched_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t batch,
                             int64_t M, int64_t N, int64_t K, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                             bool trans_a, bool trans_b) {
  // Sequential over the batch so a broadcast db (stride_b == 0) accumulates in a
  // fixed order; each product is itself multi-threaded.
  for (int64_t i = 0; i < batch; ++i)
    matmul_backward(da ? da + i * stride_a : nullptr, db ? db + i * stride_b : nullptr, dc + i * stride_c,
                    a + i * stride_a, b + i * stride_b, M, N, K, trans_a, trans_b);
}

}  // namespace ds::ops
