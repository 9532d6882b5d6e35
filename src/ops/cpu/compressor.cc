// Compressor pooling (ops/compressor.h): one task per entry, each channel's
// softmax over its slots in a fixed order, so results do not depend on the
// thread count. The channels are Highway vector lanes (compiled once per SIMD
// target, dispatched at run time, core/simd.h), loaded contiguously where the
// scalar loops strode over tokens; the channels past the last whole vector
// run the same code one lane at a time. The arithmetic is the scalar loops':
// libm's exp lane by lane, every product rounded before its sum (this file
// is compiled without contraction, as x86-64's baseline code is), so the
// results are bitwise those of the plain loops on every target and every
// CPU. The V4 fixtures' simulated fp8/fp4 roundings downstream are that
// sensitive: the polynomial exp of the other kernels, or fused
// multiply-adds, moved the QAT fixture's MTP logits past its tolerance.
#include "ops/compressor.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/compressor.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
// Internal linkage, so that same-named kernels of other files do not collide.
namespace {
namespace hn = hwy::HWY_NAMESPACE;

// The slots of entry b: (token, channel offset) pairs, previous window's
// first halves first.
struct Slots {
  int64_t first_token[2], count[2], offset[2];
  int groups;
};

Slots EntrySlots(int64_t b, const CompressorDims& d) {
  const int64_t m = d.ratio;
  if (!d.overlap) return {{b * m, 0}, {m, 0}, {0, 0}, 1};
  if (b == 0) return {{0, 0}, {m, 0}, {d.dim, 0}, 1};
  return {{(b - 1) * m, b * m}, {m, m}, {0, d.dim}, 2};
}

// Calls f(k) with the index into P and Z of every slot of channel i, in
// slot order.
template <typename F>
HWY_INLINE void ForSlots(const Slots& s, int64_t width, int64_t i, F&& f) {
  for (int g = 0; g < s.groups; ++g)
    for (int64_t j = 0; j < s.count[g]; ++j) f((s.first_token[g] + j) * width + s.offset[g] + i);
}

// std::exp of every lane.
template <class D, class V = hn::VFromD<D>>
HWY_INLINE V LibmExp(D d, V x) {
  HWY_ALIGN float buf[hn::MaxLanes(d)];
  hn::Store(x, d, buf);
  for (size_t j = 0; j < hn::Lanes(d); ++j) buf[j] = std::exp(buf[j]);
  return hn::Load(d, buf);
}

// The softmax of the gates over the slots of the Lanes(d) channels from i:
// their max and sum of exps; returns sum_j exp(Z_j - max) P_j.
template <class D, class V = hn::VFromD<D>>
HWY_INLINE V PoolLanes(D d, const Slots& s, const float* P, const float* Z, int64_t width, int64_t i, V& mx, V& sum) {
  mx = hn::Set(d, -std::numeric_limits<float>::infinity());
  ForSlots(s, width, i, [&](int64_t k) { mx = hn::Max(mx, hn::LoadU(d, Z + k)); });
  sum = hn::Zero(d);
  V acc = hn::Zero(d);
  ForSlots(s, width, i, [&](int64_t k) {
    const V e = LibmExp(d, hn::Sub(hn::LoadU(d, Z + k), mx));
    sum = hn::Add(sum, e);
    acc = hn::Add(acc, hn::Mul(e, hn::LoadU(d, P + k)));
  });
  return acc;
}

template <class D>
HWY_INLINE void ForwardLanes(D d, const Slots& s, const float* P, const float* Z, int64_t width, int64_t i, float* o) {
  hn::VFromD<D> mx, sum;
  const auto acc = PoolLanes(d, s, P, Z, width, i, mx, sum);
  hn::StoreU(hn::Div(acc, sum), d, o + i);
}

// C = sum_j w_j P_j: dP_j += w_j dC, dZ_j += w_j (P_j - C) dC.
template <class D>
HWY_INLINE void BackwardLanes(D d, const Slots& s, const float* P, const float* Z, const float* g_out, int64_t width,
                              int64_t i, float* dP, float* dZ) {
  hn::VFromD<D> mx, sum;
  const auto c = hn::Div(PoolLanes(d, s, P, Z, width, i, mx, sum), sum);
  const auto g = hn::LoadU(d, g_out + i);
  ForSlots(s, width, i, [&](int64_t k) {
    const auto w = hn::Div(LibmExp(d, hn::Sub(hn::LoadU(d, Z + k), mx)), sum);
    hn::StoreU(hn::Add(hn::LoadU(d, dP + k), hn::Mul(w, g)), d, dP + k);
    hn::StoreU(hn::Add(hn::LoadU(d, dZ + k), hn::Mul(hn::Mul(w, hn::Sub(hn::LoadU(d, P + k), c)), g)), d, dZ + k);
  });
}

// Calls f(tag, i) for the channels [0, dim): whole vectors of them, then
// the rest one lane at a time.
template <typename F>
HWY_INLINE void ForChannels(int64_t dim, F&& f) {
  const hn::ScalableTag<float> d;
  const hn::CappedTag<float, 1> d1;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= dim; i += N) f(d, i);
  for (; i < dim; ++i) f(d1, i);
}

// Entries [b0, b1): out [entries, dim] from P, Z [tokens, width].
void PoolForward(float* out, const float* P, const float* Z, int64_t b0, int64_t b1, const CompressorDims& d) {
  const int64_t D = d.dim, W = d.width();
  for (int64_t b = b0; b < b1; ++b) {
    const Slots s = EntrySlots(b, d);
    float* o = out + b * D;
    ForChannels(D, [&](auto tag, int64_t i) { ForwardLanes(tag, s, P, Z, W, i, o); });
  }
}

// Entries [b0, b1): dP, dZ [tokens, width] += the gradients from dout
// [entries, dim].
void PoolBackward(float* dP, float* dZ, const float* dout, const float* P, const float* Z, int64_t b0, int64_t b1,
                  const CompressorDims& d) {
  const int64_t D = d.dim, W = d.width();
  for (int64_t b = b0; b < b1; ++b) {
    const Slots s = EntrySlots(b, d);
    const float* g = dout + b * D;
    ForChannels(D, [&](auto tag, int64_t i) { BackwardLanes(tag, s, P, Z, g, W, i, dP, dZ); });
  }
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(PoolForward);
HWY_EXPORT(PoolBackward);

namespace {

void check_dims(const CompressorDims& d) {
  DS_CHECK(d.tokens >= 0 && d.dim > 0 && d.ratio > 0, "compressor: tokens {} dim {} ratio {}", d.tokens, d.dim,
           d.ratio);
}

}  // namespace

void compressor_pool_forward(float* out, const float* P, const float* Z, const CompressorDims& d) {
  check_dims(d);
  const int64_t B = d.entries();
  parallel_ranges(B, B * d.ratio * d.dim >= (int64_t{1} << 14), [&](int64_t b0, int64_t b1) {
    DS_DISPATCH(PoolForward)(out, P, Z, b0, b1, d);
  });
}

void compressor_pool_backward(float* dP, float* dZ, const float* dout, const float* P, const float* Z,
                              const CompressorDims& d) {
  check_dims(d);
  const int64_t B = d.entries();
  // With overlap an entry's slots reach into the previous window, whose
  // first halves no other entry touches: entries write disjoint elements,
  // so they run in parallel.
  parallel_ranges(B, B * d.ratio * d.dim >= (int64_t{1} << 14), [&](int64_t b0, int64_t b1) {
    DS_DISPATCH(PoolBackward)(dP, dZ, dout, P, Z, b0, b1, d);
  });
}

}  // namespace ds::ops
#endif  // HWY_ONCE
