// The two arithmetic paths behind ops::gemm (ops/matmul.h), for matmul.cc and
// matmul_bf16.cc only. Both take arguments gemm has already checked (M, N, K
// > 0, leading dimensions large enough).
#pragma once

#include <omp.h>

#include <cstdint>
#include <utility>

#include "ops/matmul.h"

namespace ds::ops::detail {

// Limits the calling thread's OpenMP team to one thread while alive: oneDNN
// threads a call over omp_get_max_threads(), and each block is one thread's.
class SingleThreaded {
 public:
  SingleThreaded() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThreaded() { omp_set_num_threads(saved_); }
  SingleThreaded(const SingleThreaded&) = delete;
  SingleThreaded& operator=(const SingleThreaded&) = delete;

 private:
  int saved_;
};

// The edges {rows, cols} of the blocks C [M, N] is cut into, from the shape
// alone: each block is one single-threaded kernel call, the threads share out
// the blocks, and no block cuts the reduction over K.
// min_blocks and min_split_work (0: the float32 path's 8 and 2^21) set how
// far a product is cut.
std::pair<int64_t, int64_t> gemm_block_shape(int64_t M, int64_t N, int64_t K, int64_t min_blocks = 0,
                                             double min_split_work = 0);

// float32 operands on oneDNN's sgemm.
void gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Operands rounded to bf16, products summed in float32.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, GemmOperand A, int64_t lda,
               GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace ds::ops::detail
