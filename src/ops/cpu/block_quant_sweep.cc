// The q4_k / q4_1 quantizers' scale sweep (ops/block_quant.cc) in SIMD
// vectors: for each candidate scale, the codes of a sub-block's 32 values
// and three weighted sums over them, which the least-squares fit needs.
// It is most of `deepseek quantize`'s time.
//
// The sums are the plain loop's bit for bit (detail::q4_sweep_sums_plain;
// tests/block_quant_test.cc checks every target against it): the plain loop
// keeps four partial sums, value i going to partial i mod 4 in index order,
// so here four double lanes do the same (one vector of 4 on AVX2 and
// AVX-512, two of 2 on 128-bit targets, four of 1 on the scalar fallback),
// every product and sum rounded alone (this file is compiled without
// floating-point contraction), and the partials are added as the plain loop
// adds them.
#include <cstdint>

#include "ops/block_quant.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/block_quant_sweep.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace {
namespace hn = hwy::HWY_NAMESPACE;

void SweepSums(const float* HWY_RESTRICT xl, const double* HWY_RESTRICT w, const double* HWY_RESTRICT xd, float range,
               double* HWY_RESTRICT sums) {
  constexpr int64_t n = kQ4_KSubBlock;
  const hn::CappedTag<double, 4> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(dd));
  const int64_t G = 4 / N;  // vectors a group of four partials
  using VD = hn::Vec<decltype(dd)>;
  const auto half = hn::Set(df, 0.5f), fifteen = hn::Set(df, 15.0f);
  // Two candidate scales at a time: their sums are independent chains of
  // additions, which the CPU then overlaps.
  constexpr int K = 2;
  static_assert(detail::kQ4SweepSteps % K == 0);
  for (int k0 = 0; k0 < detail::kQ4SweepSteps; k0 += K) {
    hn::Vec<decltype(df)> vis[K];
    for (int t = 0; t < K; ++t)
      vis[t] = hn::Set(df, (15.0f + 0.1f * static_cast<float>(k0 + t - detail::kQ4SweepFirst)) / range);
    VD acc[K][3][4];
    for (int t = 0; t < K; ++t)
      for (int64_t g = 0; g < G; ++g) acc[t][0][g] = acc[t][1][g] = acc[t][2][g] = hn::Zero(dd);
    for (int64_t i = 0; i < n; i += 4)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = i + g * N;
        const auto vx = hn::LoadU(df, xl + at);
        const VD vw = hn::LoadU(dd, w + at), vd = hn::LoadU(dd, xd + at);
        for (int t = 0; t < K; ++t) {
          // min(trunc(iscale (x - lo) + 0.5), 15), as the plain loop's
          // conversion to int: the value is >= 0.5.
          const VD q = hn::PromoteTo(dd, hn::Min(hn::Trunc(hn::Add(hn::Mul(vis[t], vx), half)), fifteen));
          const VD wq = hn::Mul(vw, q);
          acc[t][0][g] = hn::Add(acc[t][0][g], wq);
          acc[t][1][g] = hn::Add(acc[t][1][g], hn::Mul(wq, q));
          acc[t][2][g] = hn::Add(acc[t][2][g], hn::Mul(wq, vd));
        }
      }
    for (int t = 0; t < K; ++t)
      for (int s = 0; s < 3; ++s) {
        double p[4];
        for (int64_t g = 0; g < G; ++g) hn::StoreU(acc[t][s][g], dd, p + g * N);
        sums[3 * (k0 + t) + s] = (p[0] + p[1]) + (p[2] + p[3]);
      }
  }
}

}  // namespace

void Q4SweepSums(const float* xl, const double* w, const double* xd, float range, double* sums) {
  SweepSums(xl, w, xd, range, sums);
}

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(Q4SweepSums);

namespace detail {

void q4_sweep_sums(const float* xl, const double* w, const double* xd, float range, double* sums) {
  DS_DISPATCH(Q4SweepSums)(xl, w, xd, range, sums);
}

}  // namespace detail
}  // namespace ds::ops
#endif  // HWY_ONCE
