#include "ops/rmsnorm.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace ds::ops {

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim, float eps) {
  DS_CHECK(rows >= 0 && dim > 0, "rmsnorm: rows={} dim={}", rows, dim);
  DS_CHECK(eps >= 0.0f, "rmsnorm: eps must be non-negative, got {}", eps);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    // Double accumulation makes the row statistic independent of vector width.
    double ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    const float rs = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    rstd[r] = rs;
    for (int64_t j = 0; j < dim; ++j) yr[j] = xr[j] * rs * w[j];
  }
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim) {
  DS_CHECK(rows >= 0 && dim > 0, "rmsnorm_backward: rows={} dim={}", rows, dim);
  const int64_t nblocks = reduce_blocks(rows);
  // dw partials per fixed block of rows, summed in block order afterwards, so
  // the result does not depend on the thread count.
  std::vector<float> partial(dw ? static_cast<size_t>(nblocks * dim) : 0, 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t r0 = b * kReduceBlock, r1 = std::min(rows, r0 + kReduceBlock);
    float* pw = dw ? partial.data() + b * dim : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      const float* dyr = dy + r * dim;
      const float rs = rstd[r];
      if (dx) {
        double dot = 0;  // sum_j dy_j w_j x_j
        for (int64_t j = 0; j < dim; ++j) dot += static_cast<double>(dyr[j]) * w[j] * xr[j];
        const float c = static_cast<float>(dot / dim) * rs * rs;
        float* dxr = dx + r * dim;
        for (int64_t j = 0; j < dim; ++j) dxr[j] = rs * (dyr[j] * w[j] - xr[j] * c);
      }
      if (pw)
        for (int64_t j = 0; j < dim; ++j) pw[j] += dyr[j] * xr[j] * rs;
    }
  }
  if (dw)
    for (int64_t b = 0; b < nblocks; ++b)
      for (int64_t j = 0; j < dim; ++j) dw[j] += partial[b * dim + j];
}

}  // namespace ds::ops
