// RMSNorm over the last dimension (math and gradient: ops/rmsnorm.h).
//
// Both directions are memory-bound (forward reads x and w and writes y; backward
// reads dy, x and w and writes dx), so each row is read from memory once: a
// statistics pass, then an output pass that finds the row still in cache. All
// inner loops vectorize. The row statistics (sum x^2, and the backward's
// sum dy w x, which cancels) are accumulated in double, in 16 fixed lanes combined
// in a fixed order: the lanes let the loop vectorize without -ffast-math, and the
// order does not depend on the thread count. (The AVX-512 clone may contract
// multiply-adds into FMAs, so its last bits can differ from the other clones'.)
#include "ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace ds::ops {
namespace {

constexpr int kLanes = 16;

// sum_j x_j^2 in double.
__attribute__((target_clones("avx512f", "avx2", "default"))) double sum_squares(const float* x, int64_t n) {
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += static_cast<double>(x[j + l]) * x[j + l];
  double s = 0;
  for (; j < n; ++j) s += static_cast<double>(x[j]) * x[j];
  for (double v : lane) s += v;
  return s;
}

// y_j = x_j * rs * w_j. y may equal x: every element is read before it is written.
__attribute__((target_clones("avx512f", "avx2", "default"))) void scale_row(float* y, const float* x, const float* w,
                                                                            float rs, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * rs * w[j];
}

// dx_j = rs * (dy_j w_j - x_j c), c = rs^2 mean(dy w x).
// dx may equal dy (an in-place backward): every element is read before it is written.
__attribute__((target_clones("avx512f", "avx2", "default"))) void dx_row(float* dx, const float* dy, const float* x,
                                                                         const float* w, float rs, float c, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dx[j] = rs * (dy[j] * w[j] - x[j] * c);
}

// The row pass of the backward, reading dy and x once: adds dy_j x_j rs to pw
// (the row's share of its block's weight-gradient partial) and returns
// sum_j dy_j w_j x_j in double. Both gradients always come from this one
// kernel, so dw has the same bits whether or not dx is requested, and dx
// whether or not dw is.
__attribute__((target_clones("avx512f", "avx2", "default"))) double dw_row_dot(float* __restrict pw,
                                                                               const float* __restrict dy,
                                                                               const float* __restrict x,
                                                                               const float* __restrict w, float rs,
                                                                               int64_t n) {
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float g = dy[j + l], v = x[j + l];
      pw[j + l] += g * v * rs;
      lane[l] += static_cast<double>(g) * static_cast<double>(w[j + l]) * static_cast<double>(v);
    }
  double s = 0;
  for (; j < n; ++j) {
    pw[j] += dy[j] * x[j] * rs;
    s += static_cast<double>(dy[j]) * static_cast<double>(w[j]) * static_cast<double>(x[j]);
  }
  for (double v : lane) s += v;
  return s;
}

}  // namespace

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim, float eps) {
  DS_CHECK(rows >= 0 && dim > 0, "rmsnorm: rows={} dim={}", rows, dim);
  DS_CHECK(eps >= 0.0f, "rmsnorm: eps must be non-negative, got {}", eps);
  // Rows are independent; a few rows (decode) are not worth a thread team.
  parallel_ranges(rows, rows * dim >= (int64_t{1} << 15), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float rs = static_cast<float>(1.0 / std::sqrt(sum_squares(x + r * dim, dim) / dim + eps));
      rstd[r] = rs;
      scale_row(y + r * dim, x + r * dim, w, rs, dim);
    }
  });
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim) {
  DS_CHECK(rows >= 0 && dim > 0, "rmsnorm_backward: rows={} dim={}", rows, dim);
  const int64_t nblocks = reduce_blocks(rows);
  // dw partials per fixed block of kReduceBlock rows, summed in block order
  // afterwards, so the result does not depend on the thread count.
  std::vector<float> partial(dw ? static_cast<size_t>(nblocks * dim) : 0, 0.0f);
#pragma omp parallel
  {
    // Stands in for the partial when dw is not wanted (its sums are dropped).
    std::vector<float> scratch(dw ? 0 : dim);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t r0 = b * kReduceBlock, r1 = std::min(rows, r0 + kReduceBlock);
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * dim;  // [dim]
        const float* dyr = dy + r * dim;
        const float rs = rstd[r];
        // Before dx is written: dx may overwrite dy in place.
        const double dot = dw_row_dot(dw ? partial.data() + b * dim : scratch.data(), dyr, xr, w, rs, dim);
        if (dx) dx_row(dx + r * dim, dyr, xr, w, rs, static_cast<float>(dot / dim) * rs * rs, dim);
      }
    }
  }
  if (!dw) return;
  // Each column sums its block partials in block order; columns are independent,
  // so splitting them over threads keeps the result bitwise fixed.
  constexpr int64_t kCols = 256;
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < dim; j0 += kCols) {
    const int64_t n = std::min(kCols, dim - j0);
    float sum[kCols] = {};
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* p = partial.data() + b * dim + j0;
      for (int64_t j = 0; j < n; ++j) sum[j] += p[j];
    }
    for (int64_t j = 0; j < n; ++j) dw[j0 + j] += sum[j];
  }
}

}  // namespace ds::ops
