// Elementwise and row-wise activations, float32.
//   silu_mul: out = silu(a) * b, silu(a) = a * sigmoid(a)   (the gated MLP)
//     da = dout * b * s * (1 + a (1 - s)),  db = dout * silu(a)      (`=`)
//     With limit L > 0 (DeepSeek-V4's swiglu_limit) the inputs are clamped
//     first, out = silu(min(a, L)) * clamp(b, -L, L), and the gradients pass
//     only where the clamps do (a <= L, -L <= b <= L, as torch.clamp's).
//   sigmoid:  y = 1 / (1 + exp(-x));  dx = dy * y * (1 - y)          (`=`)
//   softmax over the last dim of [rows, cols], max-subtracted:
//     dx = y * (dy - sum(dy * y))                                    (`=`)
#pragma once

#include <cstdint>

namespace ds::ops {

void silu_mul_forward(float* out, const float* a, const float* b, int64_t n, float limit = 0.0f);
void silu_mul_backward(float* da, float* db, const float* dout, const float* a, const float* b, int64_t n,
                       float limit = 0.0f);

void sigmoid_forward(float* y, const float* x, int64_t n);
void sigmoid_backward(float* dx, const float* dy, const float* y, int64_t n);

void softmax_forward(float* y, const float* x, int64_t rows, int64_t cols);
void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t cols);

}  // namespace ds::ops
