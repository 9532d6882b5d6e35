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
// goes to lane i mod 16, each lane a double summed in index order; a block's
// value is its lanes summed in lane order, and the blocks are summed in block
// order. Every addition is thus fixed by the global index alone.
#include "ops/adamw.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>

#include "core/error.h"

namespace ds::ops {
namespace {

constexpr int kLanes = 16;

// Elements per block of the norm's reduction: large enough that the block
// partials stay few (a 10^9-element shard has 15k), small enough to share out.
constexpr int64_t kNormBlock = int64_t{1} << 16;

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 15;

// sqrt(v) for v >= 0 without libm: sqrtf keeps its errno path under the
// default -fmath-errno, and that branch stops the update loop from
// vectorizing (5x slower). Reciprocal square root from the exponent bits,
// three Newton steps, then one correction of v y: within 1 ulp of sqrtf for
// normal v (checked over the whole range), 0 for 0, NaN for NaN. Denormal v
// (sqrt(v) < 1.1e-19) is approximate, which nothing next to eps can notice.
inline float sqrt_nonnegative(float v) {
  const int32_t bits = std::max(std::bit_cast<int32_t>(v), std::bit_cast<int32_t>(FLT_MIN));
  const float vc = std::bit_cast<float>(bits);
  float y = std::bit_cast<float>(0x5f375a86 - (bits >> 1));  // ~1/sqrt(vc) within 3.5%
  for (int k = 0; k < 3; ++k) y = y * (1.5f - 0.5f * vc * y * y);
  const float s = v * y;
  return s + 0.5f * y * (v - s * s);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void adamw_kernel(
    float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g, int64_t n, float b1,
    float b2, float lr, float eps, float wd, float inv_bc1, float inv_sqrt_bc2) {
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  for (int64_t i = 0; i < n; ++i) {
    const float mi = b1 * m[i] + c1 * g[i];
    const float vi = b2 * v[i] + c2 * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    // sqrt(v / bc2) = sqrt(v) / sqrt(bc2).
    const float step = (mi * inv_bc1) / (sqrt_nonnegative(vi) * inv_sqrt_bc2 + eps);
    p[i] -= lr * (step + wd * p[i]);
  }
}

// lane[(phase + i) mod 16] += x_i^2 for i < n, each lane in index order.
__attribute__((target_clones("avx512f", "avx2", "default"))) void accumulate_squares(double* lane, const float* x,
                                                                                     int64_t n, int64_t phase) {
  int64_t i = 0;
  // Up to the next multiple of 16 of the global index, one by one.
  for (; i < n && (phase + i) % kLanes != 0; ++i) lane[(phase + i) % kLanes] += static_cast<double>(x[i]) * x[i];
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += static_cast<double>(x[i + l]) * x[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += static_cast<double>(x[i]) * x[i];
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void scale(float* x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWConfig& cfg,
                  int64_t step) {
  DS_CHECK(n >= 0, "adamw_update: n={}", n);
  DS_CHECK(step >= 1, "adamw_update: step {} must be >= 1 (bias correction is 1 - beta^step)", step);
  DS_CHECK(cfg.beta1 >= 0.0f && cfg.beta1 < 1.0f && cfg.beta2 >= 0.0f && cfg.beta2 < 1.0f,
           "adamw_update: betas ({}, {}) must be in [0, 1)", cfg.beta1, cfg.beta2);
  DS_CHECK(cfg.eps > 0.0f && cfg.lr >= 0.0f && cfg.weight_decay >= 0.0f, "adamw_update: lr={} eps={} weight_decay={}",
           cfg.lr, cfg.eps, cfg.weight_decay);
  const double bc1 = 1.0 - std::pow(static_cast<double>(cfg.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(cfg.beta2), static_cast<double>(step));
  const float inv_bc1 = static_cast<float>(1.0 / bc1), inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  // Contiguous slices of a multiple of 16 elements, so each thread's loop runs aligned.
  const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t i0 = 0; i0 < n; i0 += chunk) {
    const int64_t len = std::min(chunk, n - i0);
    adamw_kernel(param + i0, m + i0, v + i0, grad + i0, len, cfg.beta1, cfg.beta2, cfg.lr, cfg.eps, cfg.weight_decay,
                 inv_bc1, inv_sqrt_bc2);
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
    double lane[kLanes] = {};
    // The first tensor that ends after g0, then every tensor overlapping [g0, g1).
    size_t k = std::upper_bound(start.begin(), start.end(), g0) - start.begin() - 1;
    for (; k < grads.size() && start[k] < g1; ++k) {
      const int64_t lo = std::max(g0, start[k]), hi = std::min(g1, start[k + 1]);
      if (hi > lo) accumulate_squares(lane, grads[k].data + (lo - start[k]), hi - lo, lo);
    }
    double s = 0;
    for (double x : lane) s += x;
    partial[b] = s;
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
  const float s = static_cast<float>(max_norm / (norm + 1e-6));
  for (const GradSpan& g : grads) {
    const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) if (g.n >= kMinParallelWork)
    for (int64_t i0 = 0; i0 < g.n; i0 += chunk) scale(g.data + i0, s, std::min(chunk, g.n - i0));
  }
  return norm;
}

}  // namespace ds::ops
