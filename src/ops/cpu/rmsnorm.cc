// RMSNorm over the last dimension (math and gradient: ops/rmsnorm.h).
//
// Both directions are memory-bound (forward reads x and w and writes y; backward
// reads dy, x and w and writes dx), so each row is read from memory once: a
// statistics pass, then an output pass that finds the row still in cache. The
// row kernels are Highway code, compiled once per SIMD target and dispatched
// at run time (core/simd.h). The row statistics (sum x^2, and the backward's
// sum dy w x, which cancels) are accumulated in double, in a fixed number of
// vector accumulators combined in a fixed order: the order does not depend on
// the thread count, only on the target (its vector width, and fused
// multiply-adds where it has them).
#include "ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/backend.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/rmsnorm.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

#include "ops/cpu/lanes-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
// Internal linkage, so that same-named kernels of other files do not collide.
namespace {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DD = hn::ScalableTag<double>;
using DH = hn::Rebind<float, DD>;  // as many floats as a double vector has lanes

// sum_j x_j^2 in double, in four accumulators (x_j^2 is exact in double, so
// each step rounds once, fused or not).
double SumSquares(const float* x, int64_t len) {
  const DD dd;
  const DH dh;
  const size_t N = hn::Lanes(dd), n = static_cast<size_t>(len);
  auto a0 = hn::Zero(dd), a1 = a0, a2 = a0, a3 = a0;
  size_t j = 0;
  for (; j + 4 * N <= n; j += 4 * N) {
    const auto v0 = hn::PromoteTo(dd, hn::LoadU(dh, x + j));
    const auto v1 = hn::PromoteTo(dd, hn::LoadU(dh, x + j + N));
    const auto v2 = hn::PromoteTo(dd, hn::LoadU(dh, x + j + 2 * N));
    const auto v3 = hn::PromoteTo(dd, hn::LoadU(dh, x + j + 3 * N));
    a0 = hn::MulAdd(v0, v0, a0);
    a1 = hn::MulAdd(v1, v1, a1);
    a2 = hn::MulAdd(v2, v2, a2);
    a3 = hn::MulAdd(v3, v3, a3);
  }
  for (; j < n; j += N) {
    const auto v = hn::PromoteTo(dd, LoadUpTo(dh, x + j, n - j));
    a0 = hn::MulAdd(v, v, a0);
  }
  return SumLanesInOrder(dd, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)));
}

// y_j = x_j * rs * w_j. y may equal x: every element is read before it is written.
void ScaleRow(float* y, const float* x, const float* w, float rs, int64_t n) {
  const DF d;
  Map2(d, y, x, w, static_cast<size_t>(n),
       [d, rs](VF xv, VF wv) HWY_ATTR { return hn::Mul(hn::Mul(xv, hn::Set(d, rs)), wv); });
}

// dx_j = rs * (dy_j w_j - x_j c), c = rs^2 mean(dy w x).
// dx may equal dy (an in-place backward): every element is read before it is written.
void DxRow(float* dx, const float* dy, const float* x, const float* w, float rs, float c, int64_t n) {
  const DF d;
  Map3(d, dx, dy, x, w, static_cast<size_t>(n), [d, rs, c](VF g, VF xv, VF wv) HWY_ATTR {
    return hn::Mul(hn::Set(d, rs), hn::NegMulAdd(xv, hn::Set(d, c), hn::Mul(g, wv)));
  });
}

// The row pass of the backward, reading dy and x once: adds dy_j x_j rs to pw
// (the row's share of its block's weight-gradient partial) and returns
// sum_j dy_j w_j x_j in double. Both gradients always come from this one
// kernel, so dw has the same bits whether or not dx is requested, and dx
// whether or not dw is. Vectors are as wide as the double accumulators, so
// one load of dy and x feeds both sums.
double DwRowDot(float* pw, const float* dy, const float* x, const float* w, float rs, int64_t len) {
  const DD dd;
  const DH dh;
  const size_t N = hn::Lanes(dd), n = static_cast<size_t>(len);
  const auto vrs = hn::Set(dh, rs);
  auto a0 = hn::Zero(dd), a1 = a0;
  size_t j = 0;
  for (; j + 2 * N <= n; j += 2 * N) {
    const auto g0 = hn::LoadU(dh, dy + j), v0 = hn::LoadU(dh, x + j);
    const auto g1 = hn::LoadU(dh, dy + j + N), v1 = hn::LoadU(dh, x + j + N);
    hn::StoreU(hn::MulAdd(hn::Mul(g0, v0), vrs, hn::LoadU(dh, pw + j)), dh, pw + j);
    hn::StoreU(hn::MulAdd(hn::Mul(g1, v1), vrs, hn::LoadU(dh, pw + j + N)), dh, pw + j + N);
    // dy w is exact in double; times x rounds once more.
    const auto gw0 = hn::Mul(hn::PromoteTo(dd, g0), hn::PromoteTo(dd, hn::LoadU(dh, w + j)));
    const auto gw1 = hn::Mul(hn::PromoteTo(dd, g1), hn::PromoteTo(dd, hn::LoadU(dh, w + j + N)));
    a0 = hn::MulAdd(gw0, hn::PromoteTo(dd, v0), a0);
    a1 = hn::MulAdd(gw1, hn::PromoteTo(dd, v1), a1);
  }
  for (; j < n; j += N) {
    const size_t r = n - j;
    const auto g = LoadUpTo(dh, dy + j, r), v = LoadUpTo(dh, x + j, r);
    StoreUpTo(dh, hn::MulAdd(hn::Mul(g, v), vrs, LoadUpTo(dh, pw + j, r)), pw + j, r);
    const auto gw = hn::Mul(hn::PromoteTo(dd, g), hn::PromoteTo(dd, LoadUpTo(dh, w + j, r)));
    a0 = hn::MulAdd(gw, hn::PromoteTo(dd, v), a0);
  }
  return SumLanesInOrder(dd, hn::Add(a0, a1));
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(SumSquares);
HWY_EXPORT(ScaleRow);
HWY_EXPORT(DxRow);
HWY_EXPORT(DwRowDot);

void cpu::rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t dim, float eps) {
  DS_CHECK(rows >= 0 && dim > 0, "rmsnorm: rows={} dim={}", rows, dim);
  DS_CHECK(eps >= 0.0f, "rmsnorm: eps must be non-negative, got {}", eps);
  // Rows are independent; a few rows (decode) are not worth a thread team.
  parallel_ranges(rows, rows * dim >= (int64_t{1} << 15), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float rs = static_cast<float>(1.0 / std::sqrt(DS_DISPATCH(SumSquares)(x + r * dim, dim) / dim + eps));
      rstd[r] = rs;
      DS_DISPATCH(ScaleRow)(y + r * dim, x + r * dim, w, rs, dim);
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
        const double dot = DS_DISPATCH(DwRowDot)(dw ? partial.data() + b * dim : scratch.data(), dyr, xr, w, rs, dim);
        if (dx) DS_DISPATCH(DxRow)(dx + r * dim, dyr, xr, w, rs, static_cast<float>(dot / dim) * rs * rs, dim);
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
#endif  // HWY_ONCE
