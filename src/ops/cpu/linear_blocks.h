// linear.cc's kernels for block-quantized weights (q8_0, q4_k, q4_1;
// ops/block_quant.h).
#pragma once

#include <cstdint>

#include "ops/linear.h"

namespace ds::ops::detail {

// Rows [r0, r1) of w dequantized into out [(r1 - r0), cols].
void widen_block_rows(float* out, const WeightView& w, int64_t r0, int64_t r1);
// y[m][r] (+)= x[m] . W[r] for m < M (<= 8), r in [r0, r1): the codes are
// widened in registers, each block's scales applied to its vectors.
void gemv_blocks(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const WeightView& w, int64_t r0,
                 int64_t r1, bool accumulate);
// The same for q8_0 with x rounded to 8 bits a block of 32, and for q6_k
// with x rounded a block of 256 (QuantizedX::kInt8; ops/cpu/linear_int8x.cc).
// Need the vector kernels (BlockVectors).
void gemv_q8_0_int8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const WeightView& w, int64_t r0,
                    int64_t r1, bool accumulate);
void gemv_q6_k_int8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const WeightView& w, int64_t r0,
                    int64_t r1, bool accumulate);

}  // namespace ds::ops::detail
