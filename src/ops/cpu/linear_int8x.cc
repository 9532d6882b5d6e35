// q8_0 and q6_k weights against x rounded to 8 bits (QuantizedX::kInt8,
// the default; ops/cpu/linear_blocks.h).
//
// x is rounded a block of 32, q8_0's own block, as llama.cpp's q8_0 x q8_0
// product does: dx = the block's max |x| / 127, q_x = nearest(x / dx). For
// each block, x . w = dx d_w (q_x . q_w): the code products are summed
// exactly in 32-bit integers, then scaled once in float32. Widening the
// codes and x to float32 cost three vector operations for every 16 weights
// and bound the decode step by its instructions (57% of the memory
// bandwidth); the integer sum takes one multiply-add a 32 or 64 codes.
// Three kernels: AVX-512 (two blocks a 512-bit vector: |w| times x with w's
// sign by pmaddubsw, pairs summed by pmaddwd, each half scaled by its
// block), AVX2 (the same on one block), and the rest (NEON, SVE, the scalar
// fallback: codes and x as 16-bit lanes, pair products into 32 bits).
//
// q6_k takes x rounded a block of 256, its own block, as llama.cpp's q8_K:
// x . w = dx d (sum_j sc_j (q_j . q_x) - 32 sum_j sc_j xs_j), xs_j the sum
// of q_x over group j of 16, all exact in 32-bit integers. AVX2 and
// AVX-512 rebuild 32 six-bit codes at a time from their low and high bits
// and multiply them by pmaddubsw; the other targets (NEON, SVE, the scalar
// fallback) decode them into 16-bit lanes and sum each block exactly in
// 32-bit lanes, giving the plain loop's bits (tests/linear_blocks_test.cc
// keeps that loop: q6k_int8_plain).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/buffer.h"
#include "core/simd.h"
#include "ops/block_quant.h"
#include "ops/cpu/linear_blocks.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/linear_int8x.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

#include "ops/cpu/gemv-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

namespace {

// How far ahead of the kernel the weight is read into L2: 16 KiB measured
// faster than 8 (stream_rows/q8_0).
constexpr int64_t kPrefetchBytes = 16384;

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
using XQ = int8_t;
#else
using XQ = int16_t;
#endif

constexpr int64_t InOrder(int64_t c) { return c; }

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
// One block's 32 codes at q (its scale before them) against x's 32 values:
// the 16-bit sums of pairs |w| (x with w's sign), summed in pairs again to
// eight 32-bit lanes. |w| <= 128 and |x| <= 127: a pair is at most 32512.
HWY_INLINE __m256i Q8Block256(const uint8_t* HWY_RESTRICT q, __m256i xv) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2));
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
#endif

#if HWY_TARGET == HWY_AVX3
// One row of x against R (<= 4) consecutive rows from r, two blocks a step.
template <int R>
void Q8_0Int(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx, const uint8_t* w,
             int64_t row_bytes, int64_t cols, int64_t r, bool accumulate) {
  const int64_t blocks = cols / kQ8_0Values;
  const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const __m512i xv = _mm512_loadu_si512(xq + b * kQ8_0Values);
    const __m512 dxv = _mm512_insertf32x8(_mm512_set1_ps(dx[b]), _mm256_set1_ps(dx[b + 1]), 1);
#pragma GCC unroll 4  // the accumulators stay in registers
    for (int i = 0; i < R; ++i) {
      const uint8_t* q = w + (r + i) * row_bytes + b * kQ8_0Bytes;
      PrefetchL2(q + kPrefetchBytes);
      PrefetchL2(q + kPrefetchBytes + 64);
      const __m512i wv =
          _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kQ8_0Bytes + 2)), 1);
      const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), zero, xv);
      const __m512i s = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(wv), sx), ones);
      int16_t h0, h1;
      std::memcpy(&h0, q, 2);
      std::memcpy(&h1, q + kQ8_0Bytes, 2);
      const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_set1_epi16(h0), _mm_set1_epi16(h1), 1));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dxv), acc[i]);
    }
  }
  float tail[R] = {};
  if (b < blocks) {  // an odd count of blocks: the last alone
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kQ8_0Values));
    for (int i = 0; i < R; ++i) {
      const uint8_t* q = w + (r + i) * row_bytes + b * kQ8_0Bytes;
      const __m256 s = _mm256_cvtepi32_ps(Q8Block256(q, xv));
      tail[i] = _mm512_reduce_add_ps(_mm512_castps256_ps512(_mm256_mul_ps(s, _mm256_set1_ps(dx[b] * half_at(q)))));
    }
  }
  for (int i = 0; i < R; ++i) {
    const float v = _mm512_reduce_add_ps(acc[i]) + tail[i];
    y[r + i] = accumulate ? y[r + i] + v : v;
  }
}
#elif HWY_TARGET == HWY_AVX2
template <int R>
void Q8_0Int(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx, const uint8_t* w,
             int64_t row_bytes, int64_t cols, int64_t r, bool accumulate) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < cols / kQ8_0Values; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kQ8_0Values));
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const uint8_t* q = w + (r + i) * row_bytes + b * kQ8_0Bytes;
      PrefetchL2(q + kPrefetchBytes);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Q8Block256(q, xv)), _mm256_set1_ps(dx[b] * half_at(q)), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float v = SumOf8(acc[i]);
    y[r + i] = accumulate ? y[r + i] + v : v;
  }
}
#else
using DI32 = hn::RebindToSigned<DF>;
#if HWY_TARGET == HWY_SCALAR  // one lane of each: the pairs are single products
using DI16 = hn::Rebind<int16_t, DI32>;
#else
using DI16 = hn::Repartition<int16_t, DI32>;
#endif

template <int R>
void Q8_0Int(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx, const uint8_t* w,
             int64_t row_bytes, int64_t cols, int64_t r, bool accumulate) {
  const DF d;
  const DI32 di;
  const DI16 d16;
  const hn::Rebind<int8_t, DI16> d8;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d16));
  // One accumulator a row, as named variables: SVE's vectors cannot be
  // array elements.
  VF acc0 = hn::Zero(d), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  auto step = [&](int i, int64_t b, VF& acc) HWY_ATTR {
    const uint8_t* q = w + (r + i) * row_bytes + b * kQ8_0Bytes;
    PrefetchL2(q + kPrefetchBytes);
    const int8_t* codes = reinterpret_cast<const int8_t*>(q + 2);
    auto s = hn::Zero(di), t = s;
    for (int64_t l = 0; l < kQ8_0Values; l += L)
      s = hn::ReorderWidenMulAccumulate(di, hn::PromoteTo(d16, hn::LoadU(d8, codes + l)),
                                        hn::LoadU(d16, xq + b * kQ8_0Values + l), s, t);
    acc = hn::MulAdd(hn::ConvertTo(d, hn::RearrangeToOddPlusEven(s, t)), hn::Set(d, dx[b] * half_at(q)), acc);
  };
  for (int64_t b = 0; b < cols / kQ8_0Values; ++b) {
    step(0, b, acc0);
    if constexpr (R > 1) step(1, b, acc1);
    if constexpr (R > 2) step(2, b, acc2);
    if constexpr (R > 3) step(3, b, acc3);
  }
  auto out = [&](int i, VF acc) HWY_ATTR {
    const float v = hn::GetLane(hn::SumOfLanes(d, acc));
    y[r + i] = accumulate ? y[r + i] + v : v;
  };
  out(0, acc0);
  if constexpr (R > 1) out(1, acc1);
  if constexpr (R > 2) out(2, acc2);
  if constexpr (R > 3) out(3, acc3);
}
#endif

// sum_j sc_j (q_j . q_x) of one q6_k block against 256 values of x, without
// the -32 offset (exact in 32 bits: |q_x| <= 127, q <= 63, |sc| <= 128).
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
HWY_INLINE __m256i Q6KBlock(const uint8_t* HWY_RESTRICT blk, const XQ* HWY_RESTRICT xb) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  __m256i sum = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    // Values 32c..32c + 31 of the half: low nibbles of ql0, ql1, then high
    // ones, each with its two bits of qh above (byte shifts done in 16-bit
    // lanes, the masks keep each byte's own bits).
    const __m256i q[4] = {_mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
                          _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4))};
    for (int c = 0; c < 4; ++c) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 128 * h + 32 * c));
      const __m256i p = _mm256_maddubs_epi16(q[c], xv);  // 16-bit lanes 0-7: group 2c, 8-15: 2c + 1
      const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * c + 1]), _mm_set1_epi16(sc[8 * h + 2 * c]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, s));
    }
  }
  return sum;
}

template <int R>
void Q6KInt(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx,
            const int32_t* HWY_RESTRICT xs, const uint8_t* w, int64_t row_bytes, int64_t cols, int64_t r,
            bool accumulate) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < cols / kQ6_KValues; ++k) {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = w + (r + i) * row_bytes + k * kQ6_KBytes;
      for (int l = 0; l < 4; ++l) PrefetchL2(blk + kPrefetchBytes + 64 * l);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      int32_t off = 0;
      for (int j = 0; j < 16; ++j) off += sc[j] * xs[16 * k + j];
      const __m256i s =
          _mm256_sub_epi32(Q6KBlock(blk, xq + k * kQ6_KValues), _mm256_setr_epi32(32 * off, 0, 0, 0, 0, 0, 0, 0));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx[k] * half_at(blk + 208)), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float v = SumOf8(acc[i]);
    y[r + i] = accumulate ? y[r + i] + v : v;
  }
}
#else
// Codes and x as 16-bit lanes, at most 16 a vector, so that a vector lies in
// one group of 16 values and shares its scale: (q sc) fits in 16 bits
// (q <= 63, |sc| <= 128) and (q sc) x pairs are summed into 32-bit lanes.
// Each block's sum is exact and scaled once, as the plain loop did
// (kept in tests/linear_blocks_test.cc): the result is its, bit for bit.
using D16Q6 = hn::CappedTag<int16_t, 16>;
#if HWY_TARGET == HWY_SCALAR  // one lane of each: the pairs are single products
using D32Q6 = hn::Rebind<int32_t, D16Q6>;
#else
using D32Q6 = hn::RepartitionToWide<D16Q6>;
#endif

// s, t += (q scale) x, pairs of products summed into 32-bit lanes. (The
// accumulators are parameters, not captures: SVE's vectors are sizeless.)
template <class V16, class V32>
HWY_INLINE void Q6KAdd(V16 q, int8_t scale, const XQ* HWY_RESTRICT x, V32& s, V32& t) {
  const D16Q6 d16;
  s = hn::ReorderWidenMulAccumulate(D32Q6(), hn::Mul(q, hn::Set(d16, scale)), hn::LoadU(d16, x), s, t);
}

// sum_j sc_j (q_j . q_x) of one q6_k block, without the -32 offset.
HWY_INLINE int32_t Q6KBlockSum(const uint8_t* HWY_RESTRICT blk, const XQ* HWY_RESTRICT xb) {
  const D16Q6 d16;
  const D32Q6 di;
  const hn::Rebind<uint8_t, D16Q6> d8;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d16));
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const auto m4 = hn::Set(d16, 0xF), m3 = hn::Set(d16, 3);
  auto s = hn::Zero(di), t = s;
  for (int h = 0; h < 2; ++h)
    for (int64_t l = 0; l < 32; l += L) {
      // Values 32c + l of the half (c < 4): a low or a high nibble, with two
      // bits of hb above; group 8h + 2c + l / 16 gives the scale.
      const auto lo0 = hn::PromoteTo(d16, hn::LoadU(d8, blk + 64 * h + l));
      const auto lo1 = hn::PromoteTo(d16, hn::LoadU(d8, blk + 64 * h + 32 + l));
      const auto hb = hn::PromoteTo(d16, hn::LoadU(d8, blk + 128 + 32 * h + l));
      const int8_t* scg = sc + 8 * h + l / 16;
      const XQ* x = xb + 128 * h + l;
      Q6KAdd(hn::Or(hn::And(lo0, m4), hn::ShiftLeft<4>(hn::And(hb, m3))), scg[0], x, s, t);
      Q6KAdd(hn::Or(hn::And(lo1, m4), hn::ShiftLeft<4>(hn::And(hn::ShiftRight<2>(hb), m3))), scg[2], x + 32, s, t);
      Q6KAdd(hn::Or(hn::ShiftRight<4>(lo0), hn::ShiftLeft<4>(hn::And(hn::ShiftRight<4>(hb), m3))), scg[4], x + 64, s,
             t);
      Q6KAdd(hn::Or(hn::ShiftRight<4>(lo1), hn::ShiftLeft<4>(hn::ShiftRight<6>(hb))), scg[6], x + 96, s, t);
    }
  return hn::GetLane(hn::SumOfLanes(di, hn::RearrangeToOddPlusEven(s, t)));
}

template <int R>
void Q6KInt(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx,
            const int32_t* HWY_RESTRICT xs, const uint8_t* w, int64_t row_bytes, int64_t cols, int64_t r,
            bool accumulate) {
  for (int i = 0; i < R; ++i) {
    float acc = 0;
    for (int64_t k = 0; k < cols / kQ6_KValues; ++k) {
      const uint8_t* blk = w + (r + i) * row_bytes + k * kQ6_KBytes;
      for (int l = 0; l < 4; ++l) PrefetchL2(blk + kPrefetchBytes + 64 * l);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      int32_t sum = Q6KBlockSum(blk, xq + k * kQ6_KValues);
      for (int j = 0; j < 16; ++j) sum -= 32 * sc[j] * xs[16 * k + j];
      acc = std::fma(static_cast<float>(sum), dx[k] * half_at(blk + 208), acc);
    }
    y[r + i] = accumulate ? y[r + i] + acc : acc;
  }
}
#endif

}  // namespace

// y[m][r] (+)= x[m] . W[r] for m < M, r in [r0, r1) of a q6_k weight, on x
// rounded to 8 bits a block of 256.
void GemvQ6KInt8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t cols,
                 int64_t r0, int64_t r1, bool accumulate) {
  const int64_t blocks = cols / kQ6_KValues, row_bytes = blocks * kQ6_KBytes;
  Buffer<XQ> xq(static_cast<size_t>(M * cols));
  Buffer<float> dx(static_cast<size_t>(M * blocks));
  Buffer<int32_t> xs(static_cast<size_t>(M * cols / 16));
  for (int64_t m = 0; m < M; ++m) {
    QuantizeXBlocks<kQ6_KValues>(x + m * ldx, cols, xq.data() + m * cols, dx.data() + m * blocks, InOrder);
    for (int64_t g = 0; g < cols / 16; ++g) {
      int32_t s = 0;
      for (int64_t l = 0; l < 16; ++l) s += xq[static_cast<size_t>(m * cols + 16 * g + l)];
      xs[static_cast<size_t>(m * cols / 16 + g)] = s;
    }
  }
  for (int64_t r = r0; r < r1; r += 4)
    with_count<4>(std::min<int64_t>(4, r1 - r), [&](auto n) HWY_ATTR {
      for (int64_t m = 0; m < M; ++m)
        Q6KInt<n()>(y + m * ldy, xq.data() + m * cols, dx.data() + m * blocks, xs.data() + m * cols / 16, w, row_bytes,
                    cols, r, accumulate);
    });
}

// y[m][r] (+)= x[m] . W[r] for m < M, r in [r0, r1) of a q8_0 weight, on
// x rounded to 8 bits a block: each row of x in turn over four weight rows
// kept in L1.
void GemvQ8_0Int8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t cols,
                  int64_t r0, int64_t r1, bool accumulate) {
  const int64_t blocks = cols / kQ8_0Values, row_bytes = blocks * kQ8_0Bytes;
  Buffer<XQ> xq(static_cast<size_t>(M * cols));
  Buffer<float> dx(static_cast<size_t>(M * blocks));
  for (int64_t m = 0; m < M; ++m)
    QuantizeXBlocks<kQ8_0Values>(x + m * ldx, cols, xq.data() + m * cols, dx.data() + m * blocks, InOrder);
  for (int64_t r = r0; r < r1; r += 4)
    with_count<4>(std::min<int64_t>(4, r1 - r), [&](auto n) HWY_ATTR {
      for (int64_t m = 0; m < M; ++m)
        Q8_0Int<n()>(y + m * ldy, xq.data() + m * cols, dx.data() + m * blocks, w, row_bytes, cols, r, accumulate);
    });
}

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ds::ops::detail {

HWY_EXPORT(GemvQ8_0Int8);
HWY_EXPORT(GemvQ6KInt8);

void gemv_q8_0_int8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const WeightView& w, int64_t r0,
                    int64_t r1, bool accumulate) {
  DS_DISPATCH(GemvQ8_0Int8)(y, ldy, x, ldx, M, static_cast<const uint8_t*>(w.data), w.cols, r0, r1, accumulate);
}

void gemv_q6_k_int8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const WeightView& w, int64_t r0,
                    int64_t r1, bool accumulate) {
  DS_DISPATCH(GemvQ6KInt8)(y, ldy, x, ldx, M, static_cast<const uint8_t*>(w.data), w.cols, r0, r1, accumulate);
}

}  // namespace ds::ops::detail
#endif  // HWY_ONCE
