// linear.cc's path under quantization=fp8_full (ops/fp8_quant.h), for
// float32 weights W [N, K] (out, in): y [M, N] = x [M, K] W^T.
#pragma once

#include <cstdint>

namespace ds::ops::detail {

void fp8_linear_forward(float* y, const float* x, const float* W, int64_t M, int64_t N, int64_t K, int64_t ldx,
                        int64_t ldy, bool accumulate);
// dx (=, or += with accumulate_dx) and dW (+=), either may be null.
void fp8_linear_backward(float* dx, float* dw, const float* dy, const float* x, const float* W, int64_t M, int64_t N,
                         int64_t K, int64_t ldx, int64_t ldy, bool accumulate_dx);

}  // namespace ds::ops::detail
