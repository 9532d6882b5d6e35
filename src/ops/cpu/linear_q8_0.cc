// q8_0 weights against x rounded to 8 bits (QuantizedX::kInt8, the
// default; ops/cpu/linear_blocks.h).
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
#include <algorithm>
#include <cstring>

#include "core/buffer.h"
#include "core/simd.h"
#include "ops/block_quant.h"
#include "ops/cpu/linear_blocks.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/linear_q8_0.cc"
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
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    const float v = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
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
  VF acc[4] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
  for (int64_t b = 0; b < cols / kQ8_0Values; ++b) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* q = w + (r + i) * row_bytes + b * kQ8_0Bytes;
      PrefetchL2(q + kPrefetchBytes);
      const int8_t* codes = reinterpret_cast<const int8_t*>(q + 2);
      auto s = hn::Zero(di), t = s;
      for (int64_t l = 0; l < kQ8_0Values; l += L)
        s = hn::ReorderWidenMulAccumulate(di, hn::PromoteTo(d16, hn::LoadU(d8, codes + l)),
                                          hn::LoadU(d16, xq + b * kQ8_0Values + l), s, t);
      acc[i] = hn::MulAdd(hn::ConvertTo(d, hn::RearrangeToOddPlusEven(s, t)), hn::Set(d, dx[b] * half_at(q)), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float v = hn::GetLane(hn::SumOfLanes(d, acc[i]));
    y[r + i] = accumulate ? y[r + i] + v : v;
  }
}
#endif

}  // namespace

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

void gemv_q8_0_int8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const WeightView& w, int64_t r0,
                    int64_t r1, bool accumulate) {
  DS_DISPATCH(GemvQ8_0Int8)(y, ldy, x, ldx, M, static_cast<const uint8_t*>(w.data), w.cols, r0, r1, accumulate);
}

}  // namespace ds::ops::detail
#endif  // HWY_ONCE
