// Partial vectors and ordered lane sums for the CPU kernels, as Highway
// per-target code. Include it after hwy/highway.h in a file that goes through
// hwy/foreach_target.h.
//
// The number of lanes is a run-time value (SVE) and may be 1 (the scalar
// fallback), so the kernels walk whole vectors and finish with one partial
// vector: these helpers copy it through a buffer on the stack, never touching
// memory past the row, and the partial vector goes through the same
// instructions as the whole ones.

// The include guard toggles with HWY_TARGET_TOGGLE, so that the header is
// compiled again for each target (Highway's convention for "-inl.h" files).
#if defined(DEEPSEEK_OPS_CPU_LANES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef DEEPSEEK_OPS_CPU_LANES_INL_H_
#undef DEEPSEEK_OPS_CPU_LANES_INL_H_
#else
#define DEEPSEEK_OPS_CPU_LANES_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// A vector of p[0, count) followed by `fill` in the remaining lanes
// (count <= Lanes(d)); reads nothing past p + count.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE hn::VFromD<D> LoadPadded(D d, const T* p, size_t count, T fill) {
  HWY_ALIGN T buf[hn::MaxLanes(D())];
  hn::Store(hn::Set(d, fill), d, buf);
  if (count) std::memcpy(buf, p, count * sizeof(T));
  return hn::Load(d, buf);
}

// Writes the first `count` lanes of v to p[0, count); nothing past them.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void StorePartial(D d, hn::VFromD<D> v, T* p, size_t count) {
  HWY_ALIGN T buf[hn::MaxLanes(D())];
  hn::Store(v, d, buf);
  if (count) std::memcpy(p, buf, count * sizeof(T));
}

// p[0, Lanes(d)) where count >= Lanes(d); otherwise p[0, count) padded with
// `fill` (the last vector of a row).
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE hn::VFromD<D> LoadUpTo(D d, const T* p, size_t count, T fill = T{0}) {
  if (count >= hn::Lanes(d)) return hn::LoadU(d, p);
  return LoadPadded(d, p, count, fill);
}

// Stores the first min(count, Lanes(d)) lanes of v to p.
template <class D, typename T = hn::TFromD<D>>
HWY_INLINE void StoreUpTo(D d, hn::VFromD<D> v, T* p, size_t count) {
  if (count >= hn::Lanes(d)) {
    hn::StoreU(v, d, p);
  } else {
    StorePartial(d, v, p, count);
  }
}

// out[i] = f(a[i]) for i < n, a vector at a time; the partial vector at the
// end goes through f too, its padding lanes (zeros) discarded. out may equal
// a: each vector is loaded before it is stored.
template <class D, class F, typename T = hn::TFromD<D>>
HWY_INLINE void Map1(D d, T* out, const T* a, size_t n, F f) {
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(f(hn::LoadU(d, a + i)), d, out + i);
  if (i < n) StorePartial(d, f(LoadPadded(d, a + i, n - i, T{0})), out + i, n - i);
}

// out[i] = f(a[i], b[i]) for i < n, as Map1.
template <class D, class F, typename T = hn::TFromD<D>>
HWY_INLINE void Map2(D d, T* out, const T* a, const T* b, size_t n, F f) {
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(f(hn::LoadU(d, a + i), hn::LoadU(d, b + i)), d, out + i);
  if (i < n) {
    const size_t r = n - i;
    StorePartial(d, f(LoadPadded(d, a + i, r, T{0}), LoadPadded(d, b + i, r, T{0})), out + i, r);
  }
}

// out[i] = f(a[i], b[i], c[i]) for i < n, as Map1.
template <class D, class F, typename T = hn::TFromD<D>>
HWY_INLINE void Map3(D d, T* out, const T* a, const T* b, const T* c, size_t n, F f) {
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(f(hn::LoadU(d, a + i), hn::LoadU(d, b + i), hn::LoadU(d, c + i)), d, out + i);
  if (i < n) {
    const size_t r = n - i;
    StorePartial(d, f(LoadPadded(d, a + i, r, T{0}), LoadPadded(d, b + i, r, T{0}), LoadPadded(d, c + i, r, T{0})),
                 out + i, r);
  }
}

// The largest of x[0, n), n >= 0, or -inf; a NaN is skipped (each step keeps
// m unless x > m, as std::max(m, x) does), so the result does not depend on
// the order of the comparisons except for the sign of a zero maximum.
template <class D>
HWY_INLINE float RowMaxSkippingNaN(D d, const float* x, size_t n) {
  const size_t N = hn::Lanes(d);
  const float ninf = -std::numeric_limits<float>::infinity();
  auto m0 = hn::Set(d, ninf), m1 = m0;
  size_t j = 0;
  // Two accumulators, as a compare and a select per vector form a latency chain.
  for (; j + 2 * N <= n; j += 2 * N) {
    const auto v0 = hn::LoadU(d, x + j), v1 = hn::LoadU(d, x + j + N);
    m0 = hn::IfThenElse(hn::Gt(v0, m0), v0, m0);
    m1 = hn::IfThenElse(hn::Gt(v1, m1), v1, m1);
  }
  for (; j < n; j += N) {
    const auto v = LoadUpTo(d, x + j, n - j, ninf);
    m0 = hn::IfThenElse(hn::Gt(v, m0), v, m0);
  }
  m0 = hn::IfThenElse(hn::Gt(m1, m0), m1, m0);
  HWY_ALIGN float buf[hn::MaxLanes(D())];
  hn::Store(m0, d, buf);
  float m = ninf;
  for (size_t i = 0; i < N; ++i) m = buf[i] > m ? buf[i] : m;
  return m;
}

// The lanes of v added one by one in lane order, in double: a fixed order
// for a given target, where a shuffle tree's order would be the library's.
template <class D>
HWY_INLINE double SumLanesInOrder(D d, hn::VFromD<D> v) {
  HWY_ALIGN hn::TFromD<D> buf[hn::MaxLanes(D())];
  hn::Store(v, d, buf);
  double s = 0;
  for (size_t i = 0; i < hn::Lanes(d); ++i) s += static_cast<double>(buf[i]);
  return s;
}

// dst[i * ldd + j] (+= with kAccumulate) src_j[i] for i, j < 4: four rows of
// four floats, each at its own address, transposed in 128-bit vectors by two
// rounds of interleaves.
template <bool kAccumulate>
HWY_INLINE void TransposeRows4x4(const float* HWY_RESTRICT s0, const float* HWY_RESTRICT s1,
                                 const float* HWY_RESTRICT s2, const float* HWY_RESTRICT s3, float* HWY_RESTRICT dst,
                                 int64_t ldd) {
#if HWY_TARGET != HWY_SCALAR
  const hn::FixedTag<float, 4> d4;
  const hn::Repartition<uint64_t, decltype(d4)> d64;
  const auto a = hn::LoadU(d4, s0), b = hn::LoadU(d4, s1), c = hn::LoadU(d4, s2), e = hn::LoadU(d4, s3);
  // [a0 b0 a1 b1], [a2 b2 a3 b3], [c0 e0 c1 e1], [c2 e2 c3 e3]
  const auto ab_lo = hn::BitCast(d64, hn::InterleaveLower(d4, a, b));
  const auto ab_hi = hn::BitCast(d64, hn::InterleaveUpper(d4, a, b));
  const auto ce_lo = hn::BitCast(d64, hn::InterleaveLower(d4, c, e));
  const auto ce_hi = hn::BitCast(d64, hn::InterleaveUpper(d4, c, e));
  // (Separate stores: SVE vectors cannot be array elements.)
  const auto store = [&](auto v, float* o) HWY_ATTR {
    if constexpr (kAccumulate) {
      hn::StoreU(hn::Add(hn::LoadU(d4, o), v), d4, o);
    } else {
      hn::StoreU(v, d4, o);
    }
  };
  store(hn::BitCast(d4, hn::InterleaveLower(d64, ab_lo, ce_lo)), dst);
  store(hn::BitCast(d4, hn::InterleaveUpper(d64, ab_lo, ce_lo)), dst + ldd);
  store(hn::BitCast(d4, hn::InterleaveLower(d64, ab_hi, ce_hi)), dst + 2 * ldd);
  store(hn::BitCast(d4, hn::InterleaveUpper(d64, ab_hi, ce_hi)), dst + 3 * ldd);
#else
  const float* src[4] = {s0, s1, s2, s3};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) dst[i * ldd + j] = kAccumulate ? dst[i * ldd + j] + src[j][i] : src[j][i];
#endif
}

// Kt [D, ld] (columns [0, width)) = the n rows of D floats transposed,
// columns n .. width - 1 zero: blocks of 4 rows x 4 columns through 128-bit
// vectors, then the edges.
HWY_INLINE void GatherTransposed(float* HWY_RESTRICT Kt, const float* const* rows, int64_t n, int64_t width, int64_t ld,
                                 int64_t D) {
  const int64_t n4 = HWY_TARGET != HWY_SCALAR ? n / 4 * 4 : 0, D4 = D / 4 * 4;
  for (int64_t j = 0; j < n4; j += 4) {
    const float *r0 = rows[j], *r1 = rows[j + 1], *r2 = rows[j + 2], *r3 = rows[j + 3];
    for (int64_t c = 0; c < D4; c += 4) TransposeRows4x4<false>(r0 + c, r1 + c, r2 + c, r3 + c, Kt + c * ld + j, ld);
    for (int64_t c = D4; c < D; ++c) {
      float* dst = Kt + c * ld + j;
      dst[0] = r0[c], dst[1] = r1[c], dst[2] = r2[c], dst[3] = r3[c];
    }
  }
  for (int64_t c = 0; c < D; ++c) {
    float* dst = Kt + c * ld;
    for (int64_t j = n4; j < n; ++j) dst[j] = rows[j][c];
    for (int64_t j = n; j < width; ++j) dst[j] = 0.0f;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#endif  // DEEPSEEK_OPS_CPU_LANES_INL_H_
