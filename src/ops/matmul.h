// Dense matrix products, row-major float32.
//
// gemm() is the one entry point to the BLAS (oneDNN's sgemm, which picks its
// kernels from the CPU's features at run time). Called from inside an OpenMP
// parallel region it runs on the calling thread only, which is how the tiled
// kernels (attention, grouped matmul) use it.
//
// matmul: C[M,N] = op(A) op(B), op(A) [M,K], op(B) [K,N]; A is [M,K] or, when
// trans_a, [K,M]; B is [K,N] or, when trans_b, [N,K] (a Hugging Face Linear
// weight [out, in] is used as B with trans_b).
//   dA = dC op(B)^T   (activation gradient: overwritten, `=`)
//   dB = op(A)^T dC   (weight gradient: accumulated, `+=`)
#pragma once

#include <cstdint>

namespace ds::ops {

// C = alpha * op(A) op(B) + beta * C with explicit leading dimensions.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

void matmul_forward(float* c, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool trans_a = false,
                    bool trans_b = false);
// da (may be null) is overwritten; db (may be null) is accumulated into.
void matmul_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t M, int64_t N,
                     int64_t K, bool trans_a = false, bool trans_b = false);

// Batched: `batch` independent products with element strides between batches
// (a stride of 0 broadcasts that operand).
void matmul_batched_forward(float* c, const float* a, const float* b, int64_t batch, int64_t M, int64_t N, int64_t K,
                            int64_t stride_a, int64_t stride_b, int64_t stride_c, bool trans_a = false,
                            bool trans_b = false);
// da is overwritten; db is accumulated (over the batch too when stride_b is 0).
// A broadcast a (stride_a 0) gets the sum of its gradients over the batch.
void matmul_batched_backward(float* da, float* db, const float* dc, const float* a, const float* b, int64_t batch,
                             int64_t M, int64_t N, int64_t K, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                             bool trans_a = false, bool trans_b = false);

}  // namespace ds::ops
