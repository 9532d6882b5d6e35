// RMSNorm over the last dimension, float32:
//   y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)   (eps inside the root, plain w)
// Backward, with g = dy * w:
//   dx = rstd * (g - x * rstd^2 * mean(g * x))   (activation gradient: `=`)
//   dw += sum_rows dy * x * rstd                  (weight gradient: `+=`, deterministic)
#pragma once

#include <cstdint>

namespace ds::ops {

// x, y [rows, dim]; w [dim]; rstd [rows] is saved for backward. y may alias x.
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim, float eps);
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim);

}  // namespace ds::ops
