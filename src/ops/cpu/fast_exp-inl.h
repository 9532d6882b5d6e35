// A polynomial exp for the CPU kernels' inner loops, as Highway vector code
// (libm's expf works one element at a time), and the shifted exp-and-sum of a
// row that softmax, attention and cross-entropy share. Per-target header: include it after hwy/highway.h in a file that
// goes through hwy/foreach_target.h, which compiles it once per target.

// The include guard toggles with HWY_TARGET_TOGGLE, so that the header is
// compiled again for each target (Highway's convention for "-inl.h" files).
#if defined(DEEPSEEK_OPS_CPU_FAST_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef DEEPSEEK_OPS_CPU_FAST_EXP_INL_H_
#undef DEEPSEEK_OPS_CPU_FAST_EXP_INL_H_
#else
#define DEEPSEEK_OPS_CPU_FAST_EXP_INL_H_
#endif

#include <hwy/highway.h>

#include "ops/cpu/lanes-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// exp(x) per lane for x <= 88, within about 1 ulp: x = n ln2 + r with
// |r| <= ln2/2, exp(r) by the degree-6 minimax polynomial of Cephes' expf,
// times 2^n built as a float from its exponent bits. exp(0) is exactly 1. The
// kernels call it with x <= 0 (x - max, -|a|; a tiny positive x from rounding
// is fine). Below ln(FLT_MIN) = -87.33654, where exp leaves the normal range,
// the result is flushed to 0, -inf included; the clamp keeps 2^n a normal
// number. A NaN argument (of either sign) gives NaN. Multiply-adds are fused
// where the target has FMA, so the last bit may differ between targets.
template <class D, class V = hn::VFromD<D>>
HWY_INLINE V FastExp(D d, V x) {
  const hn::RebindToSigned<D> di;
  const V kMin = hn::Set(d, -87.33654f);
  const V kRound = hn::Set(d, 12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  // False only where x < kMin: a NaN compares false and keeps its bits.
  const auto keep = hn::Not(hn::Lt(x, kMin));
  const V xc = hn::IfThenElse(keep, x, kMin);
  // t = n + 1.5 * 2^23, so n is also the low bits of t's mantissa.
  const V t = hn::MulAdd(xc, hn::Set(d, 1.44269504088896341f), kRound);
  const V n = hn::Sub(t, kRound);
  // r = x - n ln2 with ln2 split in two, whose first part times n is exact for |n| <= 128.
  V r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), xc);
  r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
  V p = hn::Set(d, 1.9875691500e-4f);
  p = hn::MulAdd(p, r, hn::Set(d, 1.3981999507e-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 8.3334519073e-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 4.1665795894e-2f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.6666665459e-1f));
  p = hn::MulAdd(p, r, hn::Set(d, 5.0000001201e-1f));
  p = hn::Add(hn::MulAdd(hn::Mul(p, r), r, r), hn::Set(d, 1.0f));
  // 2^n (n >= -126: a normal float) from t's bits, which needs no float to
  // int conversion (undefined for NaN); 0 where the result is flushed.
  const auto bias = hn::Set(di, 127 - 0x4B400000);  // 127 minus the bits of kRound
  const auto scale = hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, t), bias));
  return hn::Mul(p, hn::BitCast(d, hn::IfThenElseZero(hn::RebindMask(di, keep), scale)));
}

// sum_j exp(x_j - shift) over x[0, n), also stored to y[0, n) if kStore (y
// may equal x). Four float accumulators: at least four partial sums even with
// one lane, and no single add chain to wait on. The terms are positive, so
// there is no cancellation; floats lose ~sqrt(n / lanes) ulp. The lanes are
// added in a fixed order, in double.
template <bool kStore, class D>
HWY_INLINE double ExpShiftedSum(D d, float* y, const float* x, size_t n, float shift) {
  using V = hn::VFromD<D>;
  const size_t N = hn::Lanes(d);
  const V sh = hn::Set(d, shift);
  V s0 = hn::Zero(d), s1 = s0, s2 = s0, s3 = s0;
  size_t j = 0;
  for (; j + 4 * N <= n; j += 4 * N) {
    // All four loads come before the stores, for y == x.
    const V e0 = FastExp(d, hn::Sub(hn::LoadU(d, x + j), sh));
    const V e1 = FastExp(d, hn::Sub(hn::LoadU(d, x + j + N), sh));
    const V e2 = FastExp(d, hn::Sub(hn::LoadU(d, x + j + 2 * N), sh));
    const V e3 = FastExp(d, hn::Sub(hn::LoadU(d, x + j + 3 * N), sh));
    if constexpr (kStore) {
      hn::StoreU(e0, d, y + j);
      hn::StoreU(e1, d, y + j + N);
      hn::StoreU(e2, d, y + j + 2 * N);
      hn::StoreU(e3, d, y + j + 3 * N);
    }
    s0 = hn::Add(s0, e0);
    s1 = hn::Add(s1, e1);
    s2 = hn::Add(s2, e2);
    s3 = hn::Add(s3, e3);
  }
  for (; j < n; j += N) {
    // The padding lanes of a partial vector are exp(0 - shift): kept out of the sum.
    const V e = FastExp(d, hn::Sub(LoadUpTo(d, x + j, n - j), sh));
    if constexpr (kStore) StoreUpTo(d, e, y + j, n - j);
    s0 = hn::Add(s0, hn::IfThenElseZero(hn::FirstN(d, n - j), e));
  }
  return SumLanesInOrder(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3)));
}

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#endif  // DEEPSEEK_OPS_CPU_FAST_EXP_INL_H_
