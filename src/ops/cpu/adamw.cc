// AdamW and global gradient-norm clipping (math: ops/adamw.h).
//
// The update is elementwise and memory-bound (reads p, m, v, g; writes p, m, v),
// so it is one vectorized pass split over threads; the bias corrections are
// computed once per call in double.
//
// The global norm is a training reduction and must not depend on the thread
// count. Stronger: it does not depend on how the gradients are cut into
// tensors either. All tensors are treated as one concatenated array, cut into
// fixed blocks of kNormBlock elements; within a block, element i (global index)
// goes to lane i mod L, each lane a double summed in index order; a block's
// value is its lanes summed in lane order, and the blocks are summed in block
// order. Every addition is thus fixed by the global index alone. L is four
// double vectors of the target (16 with AVX2, 32 with AVX-512, 4 on the
// scalar fallback), so the last bits of the norm depend on the target.
//
// The kernels are Highway code, compiled once per SIMD target and dispatched
// at run time (core/simd.h).
#include "ops/adamw.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/adamw.cc"
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

// One AdamW step on p, m, v from g, elementwise, with inv_bc1 = 1 / bc1 and
// inv_bc2 = 1 / bc2.
void AdamwKernel(float* HWY_RESTRICT p, float* HWY_RESTRICT m, float* HWY_RESTRICT v, const float* HWY_RESTRICT g,
                 int64_t len, float b1, float b2, float lr, float eps, float eps_root, float wd, float inv_bc1,
                 float inv_bc2) {
  const DF d;
  const VF vb1 = hn::Set(d, b1), vb2 = hn::Set(d, b2), vc1 = hn::Set(d, 1.0f - b1), vc2 = hn::Set(d, 1.0f - b2);
  const VF vlr = hn::Set(d, lr), veps = hn::Set(d, eps), vwd = hn::Set(d, wd);
  const VF vbc1 = hn::Set(d, inv_bc1), vbc2 = hn::Set(d, inv_bc2), veps_root = hn::Set(d, eps_root);
  const size_t N = hn::Lanes(d), n = static_cast<size_t>(len);
  // The last vector may be partial: loaded into and stored from buffers.
  for (size_t i = 0; i < n; i += N) {
    const size_t r = n - i;
    const VF gi = LoadUpTo(d, g + i, r), pi = LoadUpTo(d, p + i, r);
    const VF mi = hn::MulAdd(vb1, LoadUpTo(d, m + i, r), hn::Mul(vc1, gi));
    const VF vi = hn::MulAdd(vb2, LoadUpTo(d, v + i, r), hn::Mul(hn::Mul(vc2, gi), gi));
    // Sqrt is correctly rounded on every target, and 0 for v = 0.
    const VF step = hn::Div(hn::Mul(mi, vbc1), hn::Add(hn::Sqrt(hn::MulAdd(vi, vbc2, veps_root)), veps));
    StoreUpTo(d, mi, m + i, r);
    StoreUpTo(d, vi, v + i, r);
    StoreUpTo(d, hn::NegMulAdd(vlr, hn::MulAdd(vwd, pi, step), pi), p + i, r);
  }
}

// sum x^2 over the block [g0, g1) of the concatenated gradients, as the
// header describes. grads[0, count) are the tensors that overlap the block and
// start[k] is the global index of grads[k]'s first element (start[count] is
// past the last). Elements before the first whole group of L in a tensor, and
// after the last, are added one by one into the lane array; the whole groups
// go through four vector accumulators loaded from and stored back to it. A
// float squared is exact in double, so either way each addition rounds once
// and gives the same bits.
double BlockSumSquares(const GradSpan* grads, const int64_t* start, int64_t count, int64_t g0, int64_t g1) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dh;  // as many floats as a double vector has lanes
  const int64_t N = static_cast<int64_t>(hn::Lanes(dd)), L = 4 * N;
  HWY_ALIGN double lane[4 * hn::MaxLanes(decltype(dd)())];
  for (int64_t l = 0; l < L; ++l) lane[l] = 0.0;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t lo = std::max(g0, start[k]), hi = std::min(g1, start[k + 1]);
    if (hi <= lo) continue;
    const float* x = grads[k].data + (lo - start[k]);  // x[i - lo] has global index i
    int64_t i = lo;
    for (; i < hi && i % L != 0; ++i) lane[i % L] += static_cast<double>(x[i - lo]) * x[i - lo];
    if (i + L <= hi) {
      auto a0 = hn::Load(dd, lane), a1 = hn::Load(dd, lane + N), a2 = hn::Load(dd, lane + 2 * N),
           a3 = hn::Load(dd, lane + 3 * N);
      for (; i + L <= hi; i += L) {
        const float* p = x + (i - lo);
        const auto v0 = hn::PromoteTo(dd, hn::LoadU(dh, p));
        const auto v1 = hn::PromoteTo(dd, hn::LoadU(dh, p + N));
        const auto v2 = hn::PromoteTo(dd, hn::LoadU(dh, p + 2 * N));
        const auto v3 = hn::PromoteTo(dd, hn::LoadU(dh, p + 3 * N));
        a0 = hn::MulAdd(v0, v0, a0);
        a1 = hn::MulAdd(v1, v1, a1);
        a2 = hn::MulAdd(v2, v2, a2);
        a3 = hn::MulAdd(v3, v3, a3);
      }
      hn::Store(a0, dd, lane);
      hn::Store(a1, dd, lane + N);
      hn::Store(a2, dd, lane + 2 * N);
      hn::Store(a3, dd, lane + 3 * N);
    }
    for (; i < hi; ++i) lane[i % L] += static_cast<double>(x[i - lo]) * x[i - lo];
  }
  double s = 0;
  for (int64_t l = 0; l < L; ++l) s += lane[l];
  return s;
}

void Scale(float* x, float s, int64_t n) {
  const DF d;
  Map1(d, x, x, static_cast<size_t>(n), [d, s](VF v) HWY_ATTR { return hn::Mul(v, hn::Set(d, s)); });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(AdamwKernel);
HWY_EXPORT(BlockSumSquares);
HWY_EXPORT(Scale);

namespace {

// Elements per block of the norm's reduction: large enough that the block
// partials stay few (a 10^9-element shard has 15k), small enough to share out.
// A multiple of every target's lane count L.
constexpr int64_t kNormBlock = int64_t{1} << 16;

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 15;

}  // namespace

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWConfig& cfg,
                  int64_t step) {
  DS_CHECK(n >= 0, "adamw_update: n={}", n);
  DS_CHECK(step >= 1, "adamw_update: step {} must be >= 1 (bias correction is 1 - beta^step)", step);
  DS_CHECK(cfg.beta1 >= 0.0f && cfg.beta1 < 1.0f && cfg.beta2 >= 0.0f && cfg.beta2 < 1.0f,
           "adamw_update: betas ({}, {}) must be in [0, 1)", cfg.beta1, cfg.beta2);
  DS_CHECK(cfg.eps >= 0.0f && cfg.eps_root >= 0.0f && cfg.eps + cfg.eps_root > 0.0f && cfg.lr >= 0.0f &&
               cfg.weight_decay >= 0.0f,
           "adamw_update: lr={} eps={} eps_root={} weight_decay={} (eps and eps_root >= 0, not both 0)", cfg.lr,
           cfg.eps, cfg.eps_root, cfg.weight_decay);
  const double bc1 = 1.0 - std::pow(static_cast<double>(cfg.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(cfg.beta2), static_cast<double>(step));
  const float inv_bc1 = static_cast<float>(1.0 / bc1), inv_bc2 = static_cast<float>(1.0 / bc2);
  // Contiguous slices of a multiple of 16 elements, so each thread's loop runs aligned.
  const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t i0 = 0; i0 < n; i0 += chunk) {
    const int64_t len = std::min(chunk, n - i0);
    DS_DISPATCH(AdamwKernel)
    (param + i0, m + i0, v + i0, grad + i0, len, cfg.beta1, cfg.beta2, cfg.lr, cfg.eps, cfg.eps_root,
     cfg.weight_decay, inv_bc1, inv_bc2);
  }
}

double global_grad_norm(const std::vector<GradSpan>& grads) {
  // start[k]: global index of tensor k's first element.
  std::vector<int64_t> start(grads.size() + 1, 0);
  for (size_t k = 0; k < grads.size(); ++k) {
    DS_CHECK(grads[k].n >= 0 && (grads[k].n == 0 || grads[k].data), "global_grad_norm: tensor {} has n={} data={}", k,
             grads[k].n, static_cast<const void*>(grads[k].data));
    start[k + 1] = start[k] + grads[k].n;
  }
  const int64_t total = start.back(), nblocks = (total + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(nblocks);
#pragma omp parallel for schedule(dynamic, 1) if (total >= kMinParallelWork)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t g0 = b * kNormBlock, g1 = std::min(total, g0 + kNormBlock);
    // The first tensor that ends after g0, then every tensor overlapping [g0, g1).
    const size_t k0 = std::upper_bound(start.begin(), start.end(), g0) - start.begin() - 1;
    size_t k1 = k0;
    while (k1 < grads.size() && start[k1] < g1) ++k1;
    partial[b] =
        DS_DISPATCH(BlockSumSquares)(grads.data() + k0, start.data() + k0, static_cast<int64_t>(k1 - k0), g0, g1);
  }
  double sum = 0;
  for (double p : partial) sum += p;
  return std::sqrt(sum);
}

double clip_grad_norm(const std::vector<GradSpan>& grads, double max_norm) {
  DS_CHECK(max_norm > 0.0, "clip_grad_norm: max_norm {} must be positive", max_norm);
  const double norm = global_grad_norm(grads);
  // A NaN norm fails the comparison: nothing is scaled, and the caller sees the NaN.
  if (!(norm > max_norm)) return norm;
  scale_grads(grads, static_cast<float>(max_norm / norm));
  return norm;
}

void scale_grads(const std::vector<GradSpan>& grads, float s) {
  for (const GradSpan& g : grads) {
    const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) if (g.n >= kMinParallelWork)
    for (int64_t i0 = 0; i0 < g.n; i0 += chunk) DS_DISPATCH(Scale)(g.data + i0, s, std::min(chunk, g.n - i0));
  }
}

}  // namespace ds::ops
#endif  // HWY_ONCE
