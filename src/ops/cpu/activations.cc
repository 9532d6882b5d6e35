// Elementwise and row-wise activations (math and gradients: ops/activations.h).
//
// On tensors larger than the caches these are memory-bound once exp is
// vectorized (FastExp, shared with attention and cross-entropy). The kernels
// are Highway code compiled for every SIMD target and dispatched at run time
// (core/simd.h). Reductions keep a fixed number of accumulators whose lanes
// are combined in a fixed order, so results do not depend on the thread
// count; they do depend on the target (vector width, fused multiply-adds).
//
// Outputs may alias inputs elementwise (out == a in a gated MLP, y == x for an
// in-place softmax): every element is read before it is written.
#include "ops/activations.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/backend.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/activations.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

#include "ops/cpu/fast_exp-inl.h"
#include "ops/cpu/lanes-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
// Internal linkage, so that same-named kernels of other files do not collide.
namespace {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// sigmoid(x) computed without overflow: 1 / (1 + e) for x >= 0, e / (1 + e)
// for x < 0, with e = exp(-|x|) <= 1.
HWY_INLINE VF Sigmoid(DF d, VF x) {
  const VF one = hn::Set(d, 1.0f);
  const VF e = FastExp(d, hn::Neg(hn::Abs(x)));
  return hn::Div(hn::IfNegativeThenElse(x, e, one), hn::Add(one, e));
}

void SiluMulSpan(float* out, const float* a, const float* b, int64_t n) {
  const DF d;
  Map2(d, out, a, b, static_cast<size_t>(n),
       [d](VF x, VF y) HWY_ATTR { return hn::Mul(hn::Mul(x, Sigmoid(d, x)), y); });
}

// One pass that reads a, b and dout once and writes both gradients; da and db
// may alias a and b, as every vector is loaded before either store.
void SiluMulGradSpan(float* da, float* db, const float* dout, const float* a, const float* b, int64_t n) {
  const DF d;
  const VF one = hn::Set(d, 1.0f);
  const size_t N = hn::Lanes(d), len = static_cast<size_t>(n);
  // The last vector may be partial: loaded into and stored from buffers.
  for (size_t i = 0; i < len; i += N) {
    const size_t r = len - i;
    const VF x = LoadUpTo(d, a + i, r), g = LoadUpTo(d, dout + i, r), bi = LoadUpTo(d, b + i, r);
    const VF s = Sigmoid(d, x);
    // d/da silu(a) b = b s (1 + a (1 - s)); d/db = silu(a).
    StoreUpTo(d, hn::Mul(hn::Mul(hn::Mul(g, bi), s), hn::MulAdd(x, hn::Sub(one, s), one)), da + i, r);
    StoreUpTo(d, hn::Mul(g, hn::Mul(x, s)), db + i, r);
  }
}

// silu(min(a, L)) * clamp(b, -L, L), and its gradients masked to where the
// clamps pass.
void SiluMulClampedSpan(float* out, const float* a, const float* b, int64_t n, float limit) {
  const DF d;
  // SVE vectors cannot be captured: the lambda takes the float.
  Map2(d, out, a, b, static_cast<size_t>(n), [d, limit](VF x, VF y) HWY_ATTR {
    const VF L = hn::Set(d, limit);
    const VF xc = hn::Min(x, L);
    return hn::Mul(hn::Mul(xc, Sigmoid(d, xc)), hn::Min(hn::Max(y, hn::Neg(L)), L));
  });
}

void SiluMulClampedGradSpan(float* da, float* db, const float* dout, const float* a, const float* b, int64_t n,
                            float limit) {
  const DF d;
  const VF one = hn::Set(d, 1.0f), L = hn::Set(d, limit), nL = hn::Neg(L), zero = hn::Zero(d);
  const size_t N = hn::Lanes(d), len = static_cast<size_t>(n);
  for (size_t i = 0; i < len; i += N) {
    const size_t r = len - i;
    const VF x = LoadUpTo(d, a + i, r), g = LoadUpTo(d, dout + i, r), bi = LoadUpTo(d, b + i, r);
    const VF xc = hn::Min(x, L), bc = hn::Min(hn::Max(bi, nL), L);
    const VF s = Sigmoid(d, xc);
    const VF ga = hn::Mul(hn::Mul(hn::Mul(g, bc), s), hn::MulAdd(xc, hn::Sub(one, s), one));
    const VF gb = hn::Mul(g, hn::Mul(xc, s));
    StoreUpTo(d, hn::IfThenElse(hn::Le(x, L), ga, zero), da + i, r);
    StoreUpTo(d, hn::IfThenElse(hn::And(hn::Ge(bi, nL), hn::Le(bi, L)), gb, zero), db + i, r);
  }
}

void SigmoidSpan(float* y, const float* x, int64_t n) {
  const DF d;
  Map1(d, y, x, static_cast<size_t>(n), [d](VF v) HWY_ATTR { return Sigmoid(d, v); });
}

void SigmoidGradSpan(float* dx, const float* dy, const float* y, int64_t n) {
  const DF d;
  Map2(d, dx, dy, y, static_cast<size_t>(n),
       [d](VF g, VF s) HWY_ATTR { return hn::Mul(hn::Mul(g, s), hn::Sub(hn::Set(d, 1.0f), s)); });
}

// Float bits mapped to int32 so that integer order is float order (-0 < +0,
// -inf lowest, a NaN above +inf or below -inf by its sign): an integer max is
// exact and has no NaN rule to reconcile between targets. The map is its own
// inverse.
template <class DI, class VI = hn::Vec<DI>>
HWY_INLINE VI FloatOrder(DI di, VI bits) {
  return hn::Xor(bits, hn::And(hn::ShiftRight<31>(bits), hn::Set(di, 0x7FFFFFFF)));
}

// max_j x_j (exact, so two accumulators change nothing).
float RowMax(const float* x, size_t n) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const size_t N = hn::Lanes(d);
  const float pad = std::bit_cast<float>(int32_t{-1});  // a NaN whose order is INT32_MIN: below everything
  auto m0 = hn::Set(di, hwy::LimitsMin<int32_t>());
  auto m1 = m0;
  size_t j = 0;
  for (; j + 2 * N <= n; j += 2 * N) {
    m0 = hn::Max(m0, FloatOrder(di, hn::BitCast(di, hn::LoadU(d, x + j))));
    m1 = hn::Max(m1, FloatOrder(di, hn::BitCast(di, hn::LoadU(d, x + j + N))));
  }
  for (; j < n; j += N) m0 = hn::Max(m0, FloatOrder(di, hn::BitCast(di, LoadUpTo(d, x + j, n - j, pad))));
  const auto m = FloatOrder(di, hn::MaxOfLanes(di, hn::Max(m0, m1)));
  return hn::GetLane(hn::BitCast(d, m));
}

// y_j = exp(x_j - m) / sum_k exp(x_k - m) for the row, m = max_j x_j, except
// that y is 0 where the sum is 0 (a fully masked row, m = -inf). The sum (in
// float) is taken while the exps are computed and stored.
void SoftmaxRow(float* y, const float* x, int64_t cols) {
  const DF d;
  const size_t n = static_cast<size_t>(cols);
  const float m = RowMax(x, n);
  const float s =
      static_cast<float>(ExpShiftedSum<true>(d, y, x, n, m == -std::numeric_limits<float>::infinity() ? 0.0f : m));
  const float scale = s > 0.0f ? 1.0f / s : 0.0f;
  Map1(d, y, y, n, [d, scale](VF v) HWY_ATTR { return hn::Mul(v, hn::Set(d, scale)); });
}

// dx_j = y_j (dy_j - D) with D = sum_j dy_j y_j in double: dy has both signs,
// so the sum can cancel, and double costs nothing on a memory-bound row. The
// float products are exact in double, so fused or not, each step rounds once.
void SoftmaxGradRow(float* dx, const float* dy, const float* y, int64_t cols) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dh;  // as many floats as doubles
  const size_t N = hn::Lanes(dd), n = static_cast<size_t>(cols);
  auto a0 = hn::Zero(dd), a1 = a0, a2 = a0, a3 = a0;
  size_t j = 0;
  for (; j + 4 * N <= n; j += 4 * N) {
    a0 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(dh, dy + j)), hn::PromoteTo(dd, hn::LoadU(dh, y + j)), a0);
    a1 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(dh, dy + j + N)), hn::PromoteTo(dd, hn::LoadU(dh, y + j + N)), a1);
    a2 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(dh, dy + j + 2 * N)), hn::PromoteTo(dd, hn::LoadU(dh, y + j + 2 * N)),
                    a2);
    a3 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(dh, dy + j + 3 * N)), hn::PromoteTo(dd, hn::LoadU(dh, y + j + 3 * N)),
                    a3);
  }
  for (; j < n; j += N)
    a0 = hn::MulAdd(hn::PromoteTo(dd, LoadUpTo(dh, dy + j, n - j)), hn::PromoteTo(dd, LoadUpTo(dh, y + j, n - j)), a0);
  const float dot = static_cast<float>(SumLanesInOrder(dd, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
  const DF df;
  Map2(df, dx, dy, y, n, [df, dot](VF g, VF p) HWY_ATTR { return hn::Mul(p, hn::Sub(g, hn::Set(df, dot))); });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(SiluMulSpan);
HWY_EXPORT(SiluMulGradSpan);
HWY_EXPORT(SiluMulClampedSpan);
HWY_EXPORT(SiluMulClampedGradSpan);
HWY_EXPORT(SigmoidSpan);
HWY_EXPORT(SigmoidGradSpan);
HWY_EXPORT(SoftmaxRow);
HWY_EXPORT(SoftmaxGradRow);

namespace {

// Elementwise work is split into chunks of this many elements; smaller inputs
// stay on the calling thread, where a parallel region would cost more than it saves.
constexpr int64_t kChunk = 16384;

template <typename F>
void for_chunks(int64_t n, F&& f) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_ranges(chunks, chunks > 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) f(c * kChunk, std::min(kChunk, n - c * kChunk));
  });
}

}  // namespace

void cpu::silu_mul_forward(float* out, const float* a, const float* b, int64_t n, float limit) {
  DS_CHECK(n >= 0 && limit >= 0, "silu_mul: n={} limit={}", n, limit);
  if (limit > 0) {
    for_chunks(n, [&](int64_t i, int64_t len) {
      DS_DISPATCH(SiluMulClampedSpan)(out + i, a + i, b + i, len, limit);
    });
    return;
  }
  for_chunks(n, [&](int64_t i, int64_t len) { DS_DISPATCH(SiluMulSpan)(out + i, a + i, b + i, len); });
}

void silu_mul_backward(float* da, float* db, const float* dout, const float* a, const float* b, int64_t n,
                       float limit) {
  DS_CHECK(n >= 0 && limit >= 0, "silu_mul_backward: n={} limit={}", n, limit);
  if (limit > 0) {
    for_chunks(n, [&](int64_t i, int64_t len) {
      DS_DISPATCH(SiluMulClampedGradSpan)(da + i, db + i, dout + i, a + i, b + i, len, limit);
    });
    return;
  }
  for_chunks(n, [&](int64_t i, int64_t len) {
    DS_DISPATCH(SiluMulGradSpan)(da + i, db + i, dout + i, a + i, b + i, len);
  });
}

void cpu::sigmoid_forward(float* y, const float* x, int64_t n) {
  DS_CHECK(n >= 0, "sigmoid: n={}", n);
  for_chunks(n, [&](int64_t i, int64_t len) { DS_DISPATCH(SigmoidSpan)(y + i, x + i, len); });
}

void sigmoid_backward(float* dx, const float* dy, const float* y, int64_t n) {
  DS_CHECK(n >= 0, "sigmoid_backward: n={}", n);
  for_chunks(n, [&](int64_t i, int64_t len) { DS_DISPATCH(SigmoidGradSpan)(dx + i, dy + i, y + i, len); });
}

// A row whose entries are all -inf (fully masked) has no probability mass to
// share; it gives zeros rather than 0/0, and then a zero gradient.
void cpu::softmax_forward(float* y, const float* x, int64_t rows, int64_t cols) {
  DS_CHECK(rows >= 0 && cols > 0, "softmax: rows={} cols={}", rows, cols);
#pragma omp parallel for schedule(static) if (rows * cols > kChunk)
  for (int64_t r = 0; r < rows; ++r) DS_DISPATCH(SoftmaxRow)(y + r * cols, x + r * cols, cols);
}

void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t cols) {
  DS_CHECK(rows >= 0 && cols > 0, "softmax_backward: rows={} cols={}", rows, cols);
#pragma omp parallel for schedule(static) if (rows * cols > kChunk)
  for (int64_t r = 0; r < rows; ++r) DS_DISPATCH(SoftmaxGradRow)(dx + r * cols, dy + r * cols, y + r * cols, cols);
}

}  // namespace ds::ops
#endif  // HWY_ONCE
