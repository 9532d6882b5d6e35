// The quantizers' SIMD kernels (ops/block_quant.cc holds their plain loops,
// tests/block_quant_test.cc checks every target against them bit for bit).
//
// q4_k / q4_1: the fit's scale sweep (for each candidate scale, the codes of
// a sub-block's 32 values and three weighted sums over them), then each
// candidate's least-squares fit and error, then the codes under the chosen
// scale: most of `deepseek quantize`'s time. The plain sweep keeps four
// partial sums, value i going to partial i mod 4 in index order, so here
// four double lanes do the same (one vector of 4 on AVX2 and AVX-512, two
// of 2 on 128-bit targets, four of 1 on the scalar fallback), every product
// and sum rounded alone (this file is compiled without floating-point
// contraction), and the partials are added as the plain loop adds them.
//
// q8_0: ggml's rule, roundf's halves away from zero built from Trunc.
#include <cstdint>
#include <limits>

#include "ops/block_quant.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/block_quant_simd.cc"
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
  constexpr int64_t P = detail::kQ4SweepPad;
  const hn::CappedTag<double, 4> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(dd));  // 1, 2 or 4 (on SVE known at run time only)
  const auto half = hn::Set(df, 0.5f), fifteen = hn::Set(df, 15.0f);
  // Two candidate scales at a time (u, v): their sums are independent
  // chains of additions, which the CPU then overlaps. Partials g N ..
  // g N + N - 1 of the four are one vector; plain variables, not arrays,
  // as SVE's vectors cannot be array elements.
  static_assert(detail::kQ4SweepSteps % 2 == 0);
  for (int k = 0; k < detail::kQ4SweepSteps; k += 2) {
    const auto su = hn::Set(df, (15.0f + 0.1f * static_cast<float>(k - detail::kQ4SweepFirst)) / range);
    const auto sv = hn::Set(df, (15.0f + 0.1f * static_cast<float>(k + 1 - detail::kQ4SweepFirst)) / range);
    double p[2][3][4];
    for (int64_t g = 0; g < 4; g += N) {
      auto u0 = hn::Zero(dd), u1 = u0, u2 = u0, v0 = u0, v1 = u0, v2 = u0;
      for (int64_t i = g; i < n; i += 4) {
        const auto vx = hn::LoadU(df, xl + i);
        const auto vw = hn::LoadU(dd, w + i), vd = hn::LoadU(dd, xd + i);
        // min(trunc(iscale (x - lo) + 0.5), 15), as the plain loop's
        // conversion to int: the value is >= 0.5.
        const auto qu = hn::PromoteTo(dd, hn::Min(hn::Trunc(hn::Add(hn::Mul(su, vx), half)), fifteen));
        const auto qv = hn::PromoteTo(dd, hn::Min(hn::Trunc(hn::Add(hn::Mul(sv, vx), half)), fifteen));
        const auto wu = hn::Mul(vw, qu), wv = hn::Mul(vw, qv);
        u0 = hn::Add(u0, wu);
        u1 = hn::Add(u1, hn::Mul(wu, qu));
        u2 = hn::Add(u2, hn::Mul(wu, vd));
        v0 = hn::Add(v0, wv);
        v1 = hn::Add(v1, hn::Mul(wv, qv));
        v2 = hn::Add(v2, hn::Mul(wv, vd));
      }
      hn::StoreU(u0, dd, p[0][0] + g);
      hn::StoreU(u1, dd, p[0][1] + g);
      hn::StoreU(u2, dd, p[0][2] + g);
      hn::StoreU(v0, dd, p[1][0] + g);
      hn::StoreU(v1, dd, p[1][1] + g);
      hn::StoreU(v2, dd, p[1][2] + g);
    }
    for (int t = 0; t < 2; ++t)
      for (int s = 0; s < 3; ++s) sums[s * P + k + t] = (p[t][s][0] + p[t][s][1]) + (p[t][s][2] + p[t][s][3]);
  }
  for (int s = 0; s < 3; ++s)
    for (int k = detail::kQ4SweepSteps; k < P; ++k) sums[s * P + k] = 0;
}

// Every candidate's least-squares fit and its error, a lane each: the plain
// loop's operations in its order, the branches as selections.
void SweepFits(const double* HWY_RESTRICT sums, double sw, double swx, double swxx, bool any_offset,
               double* HWY_RESTRICT fits) {
  const hn::CappedTag<double, 8> d;  // 8 divides kQ4SweepPad
  constexpr int64_t P = detail::kQ4SweepPad;
  const auto zero = hn::Zero(d), two = hn::Set(d, 2.0), inf = hn::Set(d, std::numeric_limits<double>::infinity());
  const auto vsw = hn::Set(d, sw), vswx = hn::Set(d, swx), vswxx = hn::Set(d, swxx);
  for (int64_t k = 0; k < P; k += static_cast<int64_t>(hn::Lanes(d))) {
    const auto swq = hn::LoadU(d, sums + k), swqq = hn::LoadU(d, sums + P + k), swqx = hn::LoadU(d, sums + 2 * P + k);
    const auto det = hn::Sub(hn::Mul(vsw, swqq), hn::Mul(swq, swq));
    auto a = hn::Div(hn::Sub(hn::Mul(vsw, swqx), hn::Mul(swq, vswx)), det);
    auto c = hn::Div(hn::Sub(hn::Mul(swqq, vswx), hn::Mul(swq, swqx)), det);
    if (!any_offset) {
      const auto up = hn::Gt(c, zero);
      a = hn::IfThenElse(up, hn::IfThenElse(hn::Gt(swqq, zero), hn::Div(swqx, swqq), zero), a);
      c = hn::IfThenElse(up, zero, c);
    }
    const auto ok = hn::And(hn::Gt(det, zero), hn::Gt(a, zero));
    // a a swqq + 2 a c swq + c c sw - 2 a swqx - 2 c swx + swxx, left to right.
    const auto a2 = hn::Mul(two, a);
    auto e = hn::Add(hn::Mul(hn::Mul(a, a), swqq), hn::Mul(hn::Mul(a2, c), swq));
    e = hn::Add(e, hn::Mul(hn::Mul(c, c), vsw));
    e = hn::Sub(e, hn::Mul(a2, swqx));
    e = hn::Sub(e, hn::Mul(hn::Mul(two, c), vswx));
    e = hn::Add(e, vswxx);
    hn::StoreU(hn::IfThenElseZero(hn::Gt(det, zero), a), d, fits + k);
    hn::StoreU(hn::IfThenElseZero(hn::Gt(det, zero), c), d, fits + P + k);
    hn::StoreU(hn::IfThenElse(ok, e, inf), d, fits + 2 * P + k);
  }
}

// clamp(nearbyint((x + b) / a), 0, 15) for a sub-block: Round is
// nearbyint's rounding (to nearest, ties to even).
void Codes(const float* HWY_RESTRICT x, float a, float b, uint8_t* HWY_RESTRICT q) {
  const hn::CappedTag<float, 16> d;  // 16 divides kQ4_KSubBlock
  const auto va = hn::Set(d, a), vb = hn::Set(d, b), lo = hn::Zero(d), hi = hn::Set(d, 15.0f);
  alignas(64) float r[kQ4_KSubBlock];
  for (int64_t i = 0; i < kQ4_KSubBlock; i += static_cast<int64_t>(hn::Lanes(d)))
    hn::StoreU(hn::Min(hn::Max(hn::Round(hn::Div(hn::Add(hn::LoadU(d, x + i), vb), va)), lo), hi), d, r + i);
  for (int64_t i = 0; i < kQ4_KSubBlock; ++i) q[i] = static_cast<uint8_t>(r[i]);
}

// q8_0 (ggml's rule): d = max |x| / 127, its f16 stored, then x / d (the
// unrounded d) rounded half away from zero as roundf does: the integer part,
// plus one away from zero where the (exact) remainder is at least a half.
void Q8Blocks(const float* HWY_RESTRICT x, int64_t blocks, uint8_t* HWY_RESTRICT out) {
  const hn::CappedTag<float, 16> d;  // 16 divides kQ8_0Values
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const auto half = hn::Set(d, 0.5f), one = hn::Set(d, 1.0f), lim = hn::Set(d, 127.0f), nlim = hn::Set(d, -127.0f);
  alignas(64) float r[kQ8_0Values];
  for (int64_t b = 0; b < blocks; ++b, x += kQ8_0Values, out += kQ8_0Bytes) {
    auto m = hn::Zero(d);
    for (int64_t i = 0; i < kQ8_0Values; i += L) m = hn::Max(m, hn::Abs(hn::LoadU(d, x + i)));
    const float amax = hn::GetLane(hn::MaxOfLanes(d, m));
    const float scale = amax / 127.0f;
    detail::q8_0_put_scale(out, scale);
    const auto id = hn::Set(d, scale != 0.0f ? 1.0f / scale : 0.0f);
    for (int64_t i = 0; i < kQ8_0Values; i += L) {
      const auto v = hn::Mul(hn::LoadU(d, x + i), id);
      const auto t = hn::Trunc(v);
      const auto q = hn::IfThenElse(hn::Ge(hn::Abs(hn::Sub(v, t)), half), hn::Add(t, hn::CopySign(one, v)), t);
      hn::StoreU(hn::Min(hn::Max(q, nlim), lim), d, r + i);
    }
    for (int64_t i = 0; i < kQ8_0Values; ++i) out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(r[i]));
  }
}

}  // namespace

void Q4SweepSums(const float* xl, const double* w, const double* xd, float range, double* sums) {
  SweepSums(xl, w, xd, range, sums);
}
void Q4SweepFits(const double* sums, double sw, double swx, double swxx, bool any_offset, double* fits) {
  SweepFits(sums, sw, swx, swxx, any_offset, fits);
}
void Q4Codes(const float* x, float a, float b, uint8_t* q) { Codes(x, a, b, q); }
void Q8_0Blocks(const float* x, int64_t blocks, uint8_t* out) { Q8Blocks(x, blocks, out); }

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(Q4SweepSums);
HWY_EXPORT(Q4SweepFits);
HWY_EXPORT(Q4Codes);
HWY_EXPORT(Q8_0Blocks);

namespace detail {

void q4_sweep_sums(const float* xl, const double* w, const double* xd, float range, double* sums) {
  DS_DISPATCH(Q4SweepSums)(xl, w, xd, range, sums);
}

void q4_sweep_fits(const double* sums, double sw, double swx, double swxx, bool any_offset, double* fits) {
  DS_DISPATCH(Q4SweepFits)(sums, sw, swx, swxx, any_offset, fits);
}

void q4_codes(const float* x, float a, float b, uint8_t* q) { DS_DISPATCH(Q4Codes)(x, a, b, q); }

void q8_0_blocks(const float* x, int64_t blocks, uint8_t* out) { DS_DISPATCH(Q8_0Blocks)(x, blocks, out); }

}  // namespace detail
}  // namespace ds::ops
#endif  // HWY_ONCE
