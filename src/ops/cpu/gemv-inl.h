// The decode kernel of the linear layers, as Highway per-target code shared
// by ops/cpu/linear.cc (bf16, fp8, fp4, float32 rows) and
// ops/cpu/linear_blocks.cc (q8_0, q4_k, q4_1 rows): DotBlock multiplies up
// to 4 weight rows by up to 4 rows of x, every widened weight vector
// feeding each x row's FMA, with independent accumulators per pair; Gemv
// walks the rows. A weight source (Src) says how its rows widen (see the
// sources in linear.cc). Include it after hwy/highway.h in a file that goes
// through hwy/foreach_target.h.

// Target-independent, seen once.
#ifndef DEEPSEEK_OPS_CPU_GEMV_ONCE
#define DEEPSEEK_OPS_CPU_GEMV_ONCE
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/dtype.h"

namespace ds::ops {
// Calls f(std::integral_constant<int, n>{}) for a run-time n in [1, Max], so
// kernels can take a row count as a template argument.
template <int Max, typename F>
inline __attribute__((always_inline)) void with_count(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

}  // namespace ds::ops
#endif  // DEEPSEEK_OPS_CPU_GEMV_ONCE

// The include guard toggles with HWY_TARGET_TOGGLE (Highway's convention
// for "-inl.h" files): compiled again for each target.
#if defined(DEEPSEEK_OPS_CPU_GEMV_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef DEEPSEEK_OPS_CPU_GEMV_INL_H_
#undef DEEPSEEK_OPS_CPU_GEMV_INL_H_
#else
#define DEEPSEEK_OPS_CPU_GEMV_INL_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Targets with 16 vector registers (AVX2, SSE, the scalar fallback) get
// smaller register tiles than those with 32 (AVX-512, NEON, SVE).
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3 || HWY_TARGET == HWY_SCALAR || \
    HWY_TARGET == HWY_EMU128
constexpr int kXRowsPerPass = 2;  // decode: 4 weight rows x 2 x rows = 8 accumulators
constexpr int kTileN = 6;         // prefill: 6 weight rows x 2 vectors = 12 accumulators
#else
constexpr int kXRowsPerPass = 4;  // 16 accumulators
constexpr int kTileN = 12;        // 24 accumulators
#endif
HWY_INLINE void PrefetchL2(const void* p) { __builtin_prefetch(p, 0, 2); }
HWY_INLINE void PrefetchL1(const void* p) { __builtin_prefetch(p, 0, 3); }

// The f16 at p (F16C's vcvtph2ps on x86, exact as the portable widening).
HWY_INLINE float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
  return _cvtsh_ss(h);
#else
  return f16_bits_to_f32(h);
#endif
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
// The sum of a 256-bit vector's 8 floats.
HWY_INLINE float SumOf8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// x rounded to 8 bits a block of B values, as llama.cpp rounds the
// activations of its quantized products: dx[k] = the block's max |x| / 127,
// and value c of block k stored as nearest(x / dx) at q[k B + slot(c)]
// (Q: int8_t, or int16_t for kernels that multiply 16-bit lanes). slot must
// keep each aligned vector of a block together.
template <int64_t B, class Q, class Slot>
HWY_INLINE void QuantizeXBlocks(const float* HWY_RESTRICT x, int64_t cols, Q* HWY_RESTRICT q, float* HWY_RESTRICT dx,
                                Slot slot) {
  const DF d;
  const hn::Rebind<Q, DF> dq;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t k = 0; k < cols / B; ++k) {
    const float* xb = x + k * B;
    VF amax = hn::Zero(d);
    for (int64_t l = 0; l < B; l += N) amax = hn::Max(amax, hn::Abs(hn::LoadU(d, xb + l)));
    const float m = hn::GetLane(hn::MaxOfLanes(d, amax));
    dx[k] = m / 127.0f;
    const VF inv = hn::Set(d, m > 0 ? 127.0f / m : 0.0f);
    for (int64_t l = 0; l < B; l += N)
      hn::StoreU(hn::DemoteTo(dq, hn::NearestInt(hn::Mul(hn::LoadU(d, xb + l), inv))), dq, q + k * B + slot(l));
  }
}

// y[m][r + i] (+)= x[m] . W[r + i] for m < M (<= 4) and i < R (<= 4): each
// widened weight vector feeds M FMAs and each x vector R. Accumulators are
// named variables (SVE vectors cannot be array elements); a_mi is x row m
// against weight row r + i. Columns past the last whole vector of a block
// are summed in scalar tails.
#define DS_X_ROW(m)                                             \
  if constexpr (M > m) {                                        \
    const VF xv = hn::LoadU(d, x + m * ldx + cs);               \
    a##m##0 = hn::MulAdd(xv, w0, a##m##0);                      \
    if constexpr (R > 1) a##m##1 = hn::MulAdd(xv, w1, a##m##1); \
    if constexpr (R > 2) a##m##2 = hn::MulAdd(xv, w2, a##m##2); \
    if constexpr (R > 3) a##m##3 = hn::MulAdd(xv, w3, a##m##3); \
  }
#define DS_SUM(m, i)                                                      \
  if constexpr (M > m && R > i) {                                         \
    float* out = y + m * ldy + r + i;                                     \
    const float v = hn::GetLane(hn::SumOfLanes(d, a##m##i)) + tail[m][i]; \
    *out = accumulate ? *out + v : v;                                     \
  }

template <int M, int R, class Src>
HWY_INLINE void DotBlock(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT x, int64_t ldx, const Src& src,
                         int64_t cols, int64_t r, bool accumulate) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  VF a00 = hn::Zero(d), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  VF a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  float tail[4][4] = {};
  // One cache line of each row per step of the main loop, with a prefetch
  // kPrefetchBytes ahead of each (none for sources already in cache).
  const int64_t line = std::max<int64_t>(Src::kColumnsPerLine, N);
  const int64_t B = src.BlockCols();
  const decltype(src.Scales(r)) sc[4] = {src.Scales(r), R > 1 ? src.Scales(r + 1) : nullptr,
                                         R > 2 ? src.Scales(r + 2) : nullptr, R > 3 ? src.Scales(r + 3) : nullptr};
  for (int64_t c0 = 0, b = 0; c0 < cols; c0 += B, ++b) {
    const int64_t c1 = std::min(cols, c0 + B);
    const VF s0 = src.Start(d, sc[0], b);
    const VF s1 = R > 1 ? src.Start(d, sc[1], b) : s0;
    const VF s2 = R > 2 ? src.Start(d, sc[2], b) : s0;
    const VF s3 = R > 3 ? src.Start(d, sc[3], b) : s0;
    // One step: N columns of every weight row against every x row (a macro
    // rather than a lambda, which could not capture SVE vectors).
#define DS_STEP(col)                                       \
  {                                                        \
    const int64_t cs = (col);                              \
    const VF w0 = src.Load(d, r, cs, s0);                  \
    const VF w1 = R > 1 ? src.Load(d, r + 1, cs, s1) : w0; \
    const VF w2 = R > 2 ? src.Load(d, r + 2, cs, s2) : w0; \
    const VF w3 = R > 3 ? src.Load(d, r + 3, cs, s3) : w0; \
    DS_X_ROW(0) DS_X_ROW(1) DS_X_ROW(2) DS_X_ROW(3)        \
  }
    int64_t c = c0;
    for (; c + line <= c1; c += line) {
      if constexpr (Src::kPrefetchBytes > 0)
        for (int i = 0; i < R; ++i) PrefetchL2(static_cast<const char*>(src.At(r + i, c)) + Src::kPrefetchBytes);
      for (int64_t s = 0; s < line; s += N) DS_STEP(c + s)
    }
    for (; c + N <= c1; c += N) DS_STEP(c)
#undef DS_STEP
    for (int i = 0; i < R && c < c1; ++i) {
      const float si = src.ScalarScale(sc[i], b);
      for (int64_t t = c; t < c1; ++t) {
        const float wv = src.Scalar(r + i, t, si);
        for (int m = 0; m < M; ++m) tail[m][i] += x[m * ldx + t] * wv;
      }
    }
  }
  DS_SUM(0, 0)
  DS_SUM(0, 1)
  DS_SUM(0, 2) DS_SUM(0, 3) DS_SUM(1, 0) DS_SUM(1, 1) DS_SUM(1, 2) DS_SUM(1, 3) DS_SUM(2, 0) DS_SUM(2, 1) DS_SUM(2, 2)
      DS_SUM(2, 3) DS_SUM(3, 0) DS_SUM(3, 1) DS_SUM(3, 2) DS_SUM(3, 3)
}
#undef DS_X_ROW
#undef DS_SUM

// Weight rows [r0, r1) against M (<= 8) rows of x: four weight rows at a
// time (a few KiB, still in L1 for the next pass), kXRowsPerPass rows of x
// per pass over them.
template <class Src>
void Gemv(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT x, int64_t ldx, int64_t M, const Src& src,
          int64_t cols, int64_t r0, int64_t r1, bool accumulate) {
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t rows = std::min<int64_t>(4, r1 - r);
    for (int64_t m = 0; m < M; m += kXRowsPerPass) {
      with_count<kXRowsPerPass>(std::min<int64_t>(kXRowsPerPass, M - m), [&](auto mm) HWY_ATTR {
        with_count<4>(rows, [&](auto rr) HWY_ATTR {
          DotBlock<mm(), rr()>(y + m * ldy, ldy, x + m * ldx, ldx, src, cols, r, accumulate);
        });
      });
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#endif  // DEEPSEEK_OPS_CPU_GEMV_INL_H_
