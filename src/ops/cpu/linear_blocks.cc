// Block-quantized weights in the linear layers (ops/cpu/linear_blocks.h).
//
// Decode streams the packed rows: each block's f16 scale (q8_0, q4_1), or
// its sub-blocks' scales d sc and offsets dmin m (q4_k), scale the widened
// codes in registers, which feed one FMA per row of x. Offsets do not
// depend on the code: per row of x the sums of each sub-block of x are taken
// once, and each weight row subtracts its offsets times them. q4_k's decode
// (QuantizedX::kInt8, the default) instead rounds x to 8 bits a block and
// multiplies the codes as integers (Q4KOneX): widening them to float32 cost
// about 0.3 vector instructions a weight and bound the step by its
// instructions, not by the bytes read. q8_0's decode on 8-bit x is
// ops/cpu/linear_int8x.cc; here it runs on float32 x (QuantizedX::kF32).
// Prefill widens chunks of rows to float32 (widen_block_rows) for the
// outer-product kernel, as for every other narrow dtype.
//
// Each output is one fixed sequence of operations whatever the threads do.
#include "ops/cpu/linear_blocks.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>

#include "core/buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/simd.h"
#include "ops/block_quant.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/linear_blocks.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

#include "ops/cpu/gemv-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

namespace {

// N int8 codes at p as float32.
HWY_INLINE VF LoadI8(DF d, const uint8_t* HWY_RESTRICT p) {
  const hn::Rebind<int8_t, DF> d8;
  const hn::RebindToSigned<DF> di;
  return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p))));
}

// N bytes at p as int32 lanes (their nibbles are codes).
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> LoadU8(DF, const uint8_t* HWY_RESTRICT p) {
  const hn::Rebind<uint8_t, DF> d8;
  const hn::RebindToSigned<DF> di;
  return hn::PromoteTo(di, hn::LoadU(d8, p));
}

// The low (high = false) or high nibbles of N bytes at p, as float32.
HWY_INLINE VF Nibbles(DF d, const uint8_t* HWY_RESTRICT p, bool high) {
  const hn::RebindToSigned<DF> di;
  const auto bytes = LoadU8(d, p);
  return hn::ConvertTo(d, high ? hn::ShiftRight<4>(bytes) : hn::And(bytes, hn::Set(di, 0xF)));
}

// q4_k's 6-bit scales sc_j (out[j]) and mins m_j (out[8 + j]) of one
// block's eight sub-blocks (io/gguf_quants.h's q4_k_scale_min layout),
// unpacked four at a time in 32-bit words: bytes 0-3 of the 12 hold the low
// 6 bits of sc_0..3 (their top 2 bits are sc_4..7's high bits), bytes 4-7
// those of m_0..3 (likewise for m_4..7), bytes 8-11 the low nibbles of
// sc_4..7 and, above them, of m_4..7.
HWY_INLINE void Q4KScaleMins(const uint8_t* HWY_RESTRICT blk, uint8_t* HWY_RESTRICT out) {
  static_assert(std::endian::native == std::endian::little, "the words hold the bytes in memory order");
  uint32_t s[3], u[4];
  std::memcpy(s, blk + 4, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  u[0] = s[0] & kLow6;
  u[1] = (s[2] & kLow4) | (((s[0] >> 6) & kLow2) << 4);
  u[2] = s[1] & kLow6;
  u[3] = ((s[2] >> 4) & kLow4) | (((s[1] >> 6) & kLow2) << 4);
  std::memcpy(out, u, 16);
}

// The same as floats: a[j] = d sc_j and b[j] = dmin m_j.
HWY_INLINE void Q4KScales(const uint8_t* HWY_RESTRICT blk, float* HWY_RESTRICT a, float* HWY_RESTRICT b) {
  const float d = half_at(blk), dmin = half_at(blk + 2);
  uint8_t sm[16];
  Q4KScaleMins(blk, sm);
  for (int j = 0; j < 8; ++j) {
    a[j] = d * static_cast<float>(sm[j]);
    b[j] = dmin * static_cast<float>(sm[8 + j]);
  }
}

// Weight sources for Gemv (ops/cpu/gemv-inl.h) over block rows: blocks of
// 32 columns, each with its scale (q8_0, q4_1: the block's d; q4_k: the
// sub-block's d sc), read where the block is read and applied to the
// widened codes in registers. Scales(r) is the row itself. Offsets (q4_1's
// m, q4_k's dmin m) are not in the sources: GemvBlocks subtracts them
// through the sums of x. The next rows are prefetched into L2 a few KiB
// ahead, as the bf16 rows are (ops/cpu/linear.cc).
struct BlockRows {
  const uint8_t* w;
  int64_t row_bytes;
  static constexpr int64_t kColumnsPerLine = 32;
  static constexpr int64_t kPrefetchBytes = 8192;
  int64_t BlockCols() const { return 32; }
  const uint8_t* Row(int64_t r) const { return w + r * row_bytes; }
  const uint8_t* Scales(int64_t r) const { return Row(r); }
};

struct Q8_0Rows : BlockRows {
  float ScalarScale(const uint8_t* row, int64_t b) const { return half_at(row + b * kQ8_0Bytes); }
  VF Start(DF d, const uint8_t* row, int64_t b) const { return hn::Set(d, ScalarScale(row, b)); }
  const void* At(int64_t r, int64_t c) const { return Row(r) + (c >> 5) * kQ8_0Bytes; }
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF s) const {
    return hn::Mul(LoadI8(d, Row(r) + (c >> 5) * kQ8_0Bytes + 2 + (c & 31)), s);
  }
  float Scalar(int64_t r, int64_t c, float s) const {
    return s * static_cast<float>(static_cast<int8_t>(Row(r)[(c >> 5) * kQ8_0Bytes + 2 + (c & 31)]));
  }
};

struct Q4_1Rows : BlockRows {
  float ScalarScale(const uint8_t* row, int64_t b) const { return half_at(row + b * kQ4_1Bytes); }
  VF Start(DF d, const uint8_t* row, int64_t b) const { return hn::Set(d, ScalarScale(row, b)); }
  const void* At(int64_t r, int64_t c) const { return Row(r) + (c >> 5) * kQ4_1Bytes; }
  // Column c is value c % 32 of its block: the low nibble of byte c % 16
  // for the first 16, the high one for the rest.
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF s) const {
    return hn::Mul(Nibbles(d, Row(r) + (c >> 5) * kQ4_1Bytes + 4 + (c & 15), (c & 16) != 0), s);
  }
  float Scalar(int64_t r, int64_t c, float s) const {
    const uint8_t byte = Row(r)[(c >> 5) * kQ4_1Bytes + 4 + (c & 15)];
    return s * static_cast<float>((c & 16) ? byte >> 4 : byte & 0xF);
  }
};

// q4_k: a block's eight scales and mins are decoded once per row, when its
// first sub-block starts, into the row's context (one per row of the four
// DotBlock takes); the mins stay there for GemvBlocks' offsets.
struct Q4KRow {
  const uint8_t* row;
  float* scales;  // [8]: the current block's d sc
  float* mins;    // [blocks]: every block's dmin m, as the row is read
};

struct Q4KRows : BlockRows {
  Q4KRow* ctx;  // [4]
  const Q4KRow* Scales(int64_t r) const {
    Q4KRow& c = ctx[r & 3];
    c.row = Row(r);
    return &c;
  }
  float ScalarScale(const Q4KRow* c, int64_t b) const {
    if ((b & 7) == 0) Q4KScales(c->row + (b >> 3) * kQ4_KBytes, c->scales, c->mins + b);
    return c->scales[b & 7];
  }
  VF Start(DF d, const Q4KRow* c, int64_t b) const { return hn::Set(d, ScalarScale(c, b)); }
  const void* At(int64_t r, int64_t c) const { return Row(r) + (c >> 8) * kQ4_KBytes; }
  // Column c is value c % 64 of chunk (c % 256) / 64 of its block: the low
  // nibble of the chunk's byte c % 32 for the first 32, the high one after.
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF s) const {
    return hn::Mul(Nibbles(d, Row(r) + (c >> 8) * kQ4_KBytes + 16 + ((c >> 6) & 3) * 32 + (c & 31), (c & 32) != 0), s);
  }
  float Scalar(int64_t r, int64_t c, float s) const {
    const uint8_t byte = Row(r)[(c >> 8) * kQ4_KBytes + 16 + ((c >> 6) & 3) * 32 + (c & 31)];
    return s * static_cast<float>((c & 32) ? byte >> 4 : byte & 0xF);
  }
};

// The decode step's q4_k product on integers (llama.cpp's q8_K x q4_K):
// x is rounded to 8 bits a block of 256, q = nearest(x / dx) with
// dx = max |x| / 127 (QuantizeX256); a weight is d sc_j q - dmin m_j. Per
// block, x . w = dx d sum_j sc_j (q_x . q_j) - dmin sum_j m_j xs_j: the
// products of codes, scales and q_x are summed exactly in 32-bit integers
// within the block; the offsets use x's float32 sums xs, so only the first
// term carries the rounding of x, at most dx / 2 a value. Three kernels:
// AVX-512 (pmaddubsw on 64 codes of two sub-blocks at once, x's sub-blocks
// interleaved to match), AVX2 (pmaddubsw on 32), and the rest (NEON, SVE,
// the scalar fallback): codes times scale in 16 bits, then pair products
// into 32 bits (ReorderWidenMulAccumulate).
using DI32 = hn::RebindToSigned<DF>;
#if HWY_TARGET == HWY_SCALAR  // one lane of each: the pairs are single products
using DI16 = hn::Rebind<int16_t, DI32>;
#else
using DI16 = hn::Repartition<int16_t, DI32>;
#endif
using VI32 = hn::Vec<DI32>;
using VI16 = hn::Vec<DI16>;
constexpr int64_t kQ4KPrefetchBytes = 8192;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
using XQ = int8_t;
constexpr bool kInterleaveX = HWY_TARGET == HWY_AVX3;
#else
using XQ = int16_t;
constexpr bool kInterleaveX = false;
#endif

// Where value c (< 256) of a block of x goes: in order, or (kInterleaveX)
// with each 128 as sub-blocks 0, 2, 1, 3 of its four (low nibbles of two
// chunks, then high nibbles).
constexpr int64_t XSlot(int64_t c) {
  if (!kInterleaveX) return c;
  const int64_t j = (c >> 5) & 3;
  return (c & ~int64_t{127}) + ((j >> 1) | ((j & 1) << 1)) * 32 + (c & 31);
}

void QuantizeX256(const float* HWY_RESTRICT x, int64_t cols, XQ* HWY_RESTRICT q, float* HWY_RESTRICT dx) {
  QuantizeXBlocks<kQ4_KValues>(x, cols, q, dx, XSlot);
}

// A block's d and dmin, and its offset share dmin sum_j m_j xs8_j into off.
HWY_INLINE float Q4KBlockStart(const uint8_t* HWY_RESTRICT blk, const float* HWY_RESTRICT xs8, uint8_t* HWY_RESTRICT sm,
                               float& off) {
  Q4KScaleMins(blk, sm);
  float o = 0;
  for (int j = 0; j < 8; ++j) o += static_cast<float>(sm[8 + j]) * xs8[j];
  off += half_at(blk + 2) * o;
  return half_at(blk);
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
// Q4KBlockStart in vector registers: d and dmin by vcvtph2ps, the offsets
// dmin m_j xs8_j added to eight lanes of off (summed at the row's end).
HWY_INLINE float Q4KBlockStartX86(const uint8_t* HWY_RESTRICT blk, const float* HWY_RESTRICT xs8,
                                  uint8_t* HWY_RESTRICT sm, __m256& off) {
  int32_t halves;
  std::memcpy(&halves, blk, 4);
  const __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
  Q4KScaleMins(blk, sm);
  const __m256 mins =
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8))));
  off = _mm256_fmadd_ps(_mm256_mul_ps(mins, _mm256_loadu_ps(xs8)), _mm256_broadcastss_ps(_mm_movehdup_ps(h)), off);
  return _mm_cvtss_f32(h);
}

// The block kQ4KPrefetchBytes ahead into L2, each of its three cache lines:
// with two of three the hardware left every ninth line to be waited for.
HWY_INLINE void PrefetchQ4KBlock(const uint8_t* blk) {
  PrefetchL2(blk + kQ4KPrefetchBytes);
  PrefetchL2(blk + kQ4KPrefetchBytes + 64);
  PrefetchL2(blk + kQ4KPrefetchBytes + 128);
}

#endif

#if HWY_TARGET == HWY_AVX3
// 64 bytes of codes (chunks c and c + 1) against x's values for the low
// nibbles (sub-blocks 2c, 2c + 2) and the high ones (2c + 1, 2c + 3), each
// 16-bit pair sum times its sub-block's scale (lanes 0-15 and 16-31 of sl,
// sh) into 32 bits.
HWY_INLINE __m512i Q4KChunks512(const uint8_t* HWY_RESTRICT q, __m512i xl, __m512i xh, __m512i sl, __m512i sh,
                                __m512i acc) {
  const __m512i mask = _mm512_set1_epi8(0xF);
  const __m512i codes = _mm512_loadu_si512(q);
  const __m512i lo = _mm512_maddubs_epi16(_mm512_and_si512(codes, mask), xl);
  const __m512i hi = _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(codes, 4), mask), xh);
  return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(lo, sl), _mm512_madd_epi16(hi, sh)));
}

template <int R>
void Q4KOneX(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx,
             const float* HWY_RESTRICT xs, const uint8_t* w, int64_t row_bytes, int64_t cols, int64_t r,
             bool accumulate) {
  // Which scale each 16-bit lane takes, for the four sub-block pairs.
  const __m512i pick[4] = {
      _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0),
      _mm512_set_epi64(0x0003000300030003, 0x0003000300030003, 0x0003000300030003, 0x0003000300030003,
                       0x0001000100010001, 0x0001000100010001, 0x0001000100010001, 0x0001000100010001),
      _mm512_set_epi64(0x0006000600060006, 0x0006000600060006, 0x0006000600060006, 0x0006000600060006,
                       0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0x0004000400040004),
      _mm512_set_epi64(0x0007000700070007, 0x0007000700070007, 0x0007000700070007, 0x0007000700070007,
                       0x0005000500050005, 0x0005000500050005, 0x0005000500050005, 0x0005000500050005)};
  __m512 acc[R];
  __m256 off[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps(), off[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < cols / kQ4_KValues; ++k) {
    const XQ* xb = xq + k * kQ4_KValues;
    const __m512i x0 = _mm512_loadu_si512(xb), x1 = _mm512_loadu_si512(xb + 64);
    const __m512i x2 = _mm512_loadu_si512(xb + 128), x3 = _mm512_loadu_si512(xb + 192);
#pragma GCC unroll 4  // the accumulators stay in registers
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = w + (r + i) * row_bytes + k * kQ4_KBytes;
      PrefetchQ4KBlock(blk);
      alignas(16) uint8_t sm[16];
      const float dw = Q4KBlockStartX86(blk, xs + 8 * k, sm, off[i]);
      const __m512i sc = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_load_si128(reinterpret_cast<__m128i*>(sm))));
      __m512i s = _mm512_setzero_si512();
      s = Q4KChunks512(blk + 16, x0, x1, _mm512_permutexvar_epi16(pick[0], sc), _mm512_permutexvar_epi16(pick[1], sc),
                       s);
      s = Q4KChunks512(blk + 80, x2, x3, _mm512_permutexvar_epi16(pick[2], sc), _mm512_permutexvar_epi16(pick[3], sc),
                       s);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(dx[k] * dw), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float v = _mm512_reduce_add_ps(acc[i]) - SumOf8(off[i]);
    y[r + i] = accumulate ? y[r + i] + v : v;
  }
}
#elif HWY_TARGET == HWY_AVX2
template <int R>
void Q4KOneX(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx,
             const float* HWY_RESTRICT xs, const uint8_t* w, int64_t row_bytes, int64_t cols, int64_t r,
             bool accumulate) {
  const __m256i mask = _mm256_set1_epi8(0xF);
  __m256 acc[R], off[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps(), off[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < cols / kQ4_KValues; ++k) {
    const XQ* xb = xq + k * kQ4_KValues;
#pragma GCC unroll 4  // the accumulators stay in registers
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = w + (r + i) * row_bytes + k * kQ4_KBytes;
      PrefetchQ4KBlock(blk);
      uint8_t sm[16];
      const float dw = Q4KBlockStartX86(blk, xs + 8 * k, sm, off[i]);
      __m256i s = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {  // chunk c: the low nibbles are sub-block 2c, the high ones 2c + 1
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
        const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(codes, mask),
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 64 * c)));
        const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(codes, 4), mask),
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 64 * c + 32)));
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi16(sm[2 * c])),
                                                 _mm256_madd_epi16(hi, _mm256_set1_epi16(sm[2 * c + 1]))));
      }
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx[k] * dw), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float v = SumOf8(acc[i]) - SumOf8(off[i]);
    y[r + i] = accumulate ? y[r + i] + v : v;
  }
}
#else
// Row i's codes for one step of l against x's values: two pair sums a
// 16-bit vector of codes (the low nibbles are sub-block 2c, the high ones
// 2c + 1 of chunk c).
#define DS_Q4K_INT_ROW(i)                                                                               \
  if constexpr (R > i) {                                                                                \
    const VI16 codes = hn::PromoteTo(d16, hn::LoadU(d8, q##i + l));                                     \
    s##i = hn::ReorderWidenMulAccumulate(di, hn::Mul(hn::And(codes, mask), sa##i), xl, s##i, t##i);     \
    s##i = hn::ReorderWidenMulAccumulate(di, hn::Mul(hn::ShiftRight<4>(codes), sb##i), xh, s##i, t##i); \
  }

template <int R>
void Q4KOneX(float* HWY_RESTRICT y, const XQ* HWY_RESTRICT xq, const float* HWY_RESTRICT dx,
             const float* HWY_RESTRICT xs, const uint8_t* w, int64_t row_bytes, int64_t cols, int64_t r,
             bool accumulate) {
  const DF d;
  const DI32 di;
  const DI16 d16;
  const hn::Rebind<uint8_t, DI16> d8;
  const VI16 mask = hn::Set(d16, 0xF);
  const int64_t L = static_cast<int64_t>(hn::Lanes(d16));
  // One accumulator a row, as named variables: SVE's vectors cannot be
  // array elements.
  VF acc0 = hn::Zero(d), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  float off[4] = {0, 0, 0, 0};
  for (int64_t k = 0; k < cols / kQ4_KValues; ++k) {
    uint8_t sm[4][16] = {};
    float dw[4];
    for (int i = 0; i < R; ++i)
      dw[i] = Q4KBlockStart(w + (r + i) * row_bytes + k * kQ4_KBytes, xs + 8 * k, sm[i], off[i]);
    VI32 s0 = hn::Zero(di), s1 = s0, s2 = s0, s3 = s0, t0 = s0, t1 = s0, t2 = s0, t3 = s0;
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q0 = w + r * row_bytes + k * kQ4_KBytes + 16 + 32 * c;
      const uint8_t* q1 = q0 + row_bytes;
      const uint8_t* q2 = q1 + row_bytes;
      const uint8_t* q3 = q2 + row_bytes;
      const VI16 sa0 = hn::Set(d16, sm[0][2 * c]), sb0 = hn::Set(d16, sm[0][2 * c + 1]);
      const VI16 sa1 = hn::Set(d16, sm[1][2 * c]), sb1 = hn::Set(d16, sm[1][2 * c + 1]);
      const VI16 sa2 = hn::Set(d16, sm[2][2 * c]), sb2 = hn::Set(d16, sm[2][2 * c + 1]);
      const VI16 sa3 = hn::Set(d16, sm[3][2 * c]), sb3 = hn::Set(d16, sm[3][2 * c + 1]);
      const XQ* xc = xq + k * kQ4_KValues + 64 * c;
      for (int i = 0; i < R; ++i) PrefetchL2(q0 + i * row_bytes + kQ4KPrefetchBytes);
      for (int64_t l = 0; l < 32; l += L) {
        const VI16 xl = hn::LoadU(d16, xc + l), xh = hn::LoadU(d16, xc + 32 + l);
        DS_Q4K_INT_ROW(0) DS_Q4K_INT_ROW(1) DS_Q4K_INT_ROW(2) DS_Q4K_INT_ROW(3)
      }
    }
    auto add = [&](int i, VI32 s, VI32 t, VF& acc) HWY_ATTR {
      acc = hn::MulAdd(hn::ConvertTo(d, hn::RearrangeToOddPlusEven(s, t)), hn::Set(d, dx[k] * dw[i]), acc);
    };
    add(0, s0, t0, acc0);
    if constexpr (R > 1) add(1, s1, t1, acc1);
    if constexpr (R > 2) add(2, s2, t2, acc2);
    if constexpr (R > 3) add(3, s3, t3, acc3);
  }
  auto out = [&](int i, VF acc) HWY_ATTR {
    const float v = hn::GetLane(hn::SumOfLanes(d, acc)) - off[i];
    y[r + i] = accumulate ? y[r + i] + v : v;
  };
  out(0, acc0);
  if constexpr (R > 1) out(1, acc1);
  if constexpr (R > 2) out(2, acc2);
  if constexpr (R > 3) out(3, acc3);
}
#undef DS_Q4K_INT_ROW
#endif

// One row of x (float32: QuantizedX::kF32) against R (<= 4) consecutive
// q4_k rows from r: the rows' codes widened and scaled per sub-block, each
// x vector loaded once for all of them, two accumulators a row (the low and
// the high nibbles); each row's offsets against the sub-block sums xs of x.
// The decode step's kernel (a sub-block's scale is one broadcast per row,
// where DotBlock's generic source pays the addressing of every vector).
#define DS_Q4K_ROW(i)                                                                          \
  if constexpr (R > i) {                                                                       \
    const auto bytes = LoadU8(d, q##i + l);                                                    \
    lo##i = hn::MulAdd(hn::Mul(hn::ConvertTo(d, hn::And(bytes, mask)), sa##i), xl, lo##i);     \
    hi##i = hn::MulAdd(hn::Mul(hn::ConvertTo(d, hn::ShiftRight<4>(bytes)), sb##i), xh, hi##i); \
  }

// A block's eight scales a = d sc and the row's offset share (Q4KBlockStart's).
HWY_INLINE float Q4KBlock(const uint8_t* HWY_RESTRICT blk, const float* HWY_RESTRICT xs8, float* HWY_RESTRICT a) {
  uint8_t sm[16];
  float off = 0;
  const float d = Q4KBlockStart(blk, xs8, sm, off);
  for (int j = 0; j < 8; ++j) a[j] = d * static_cast<float>(sm[j]);
  return off;
}

template <int R>
void Q4KOneXF32(float* HWY_RESTRICT y, const float* HWY_RESTRICT x, const float* HWY_RESTRICT xs, const uint8_t* w,
                int64_t row_bytes, int64_t cols, int64_t r, bool accumulate) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const auto mask = hn::Set(di, 0xF);
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  VF lo0 = hn::Zero(d), lo1 = lo0, lo2 = lo0, lo3 = lo0, hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0;
  float a[4][8], off[4] = {0, 0, 0, 0};
  for (int64_t k = 0; k < cols / kQ4_KValues; ++k) {
    for (int i = 0; i < R; ++i) off[i] += Q4KBlock(w + (r + i) * row_bytes + k * kQ4_KBytes, xs + 8 * k, a[i]);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q0 = w + r * row_bytes + k * kQ4_KBytes + 16 + 32 * c;
      const uint8_t* q1 = q0 + row_bytes;
      const uint8_t* q2 = q1 + row_bytes;
      const uint8_t* q3 = q2 + row_bytes;
      const VF sa0 = hn::Set(d, a[0][2 * c]), sb0 = hn::Set(d, a[0][2 * c + 1]);
      const VF sa1 = hn::Set(d, a[R > 1 ? 1 : 0][2 * c]), sb1 = hn::Set(d, a[R > 1 ? 1 : 0][2 * c + 1]);
      const VF sa2 = hn::Set(d, a[R > 2 ? 2 : 0][2 * c]), sb2 = hn::Set(d, a[R > 2 ? 2 : 0][2 * c + 1]);
      const VF sa3 = hn::Set(d, a[R > 3 ? 3 : 0][2 * c]), sb3 = hn::Set(d, a[R > 3 ? 3 : 0][2 * c + 1]);
      const float* xc = x + k * kQ4_KValues + 64 * c;
      // The rows ahead into L2 (the four rows are one contiguous run; the
      // hardware alone leaves the loads waiting on memory).
      for (int i = 0; i < R; ++i) PrefetchL2(q0 + i * row_bytes + kQ4KPrefetchBytes);
      for (int64_t l = 0; l < 32; l += N) {
        const VF xl = hn::LoadU(d, xc + l), xh = hn::LoadU(d, xc + 32 + l);
        DS_Q4K_ROW(0) DS_Q4K_ROW(1) DS_Q4K_ROW(2) DS_Q4K_ROW(3)
      }
    }
  }
  auto put = [&](int i, VF lo, VF hi) HWY_ATTR {
    const float v = hn::GetLane(hn::SumOfLanes(d, hn::Add(lo, hi))) - off[i];
    y[r + i] = accumulate ? y[r + i] + v : v;
  };
  put(0, lo0, hi0);
  if constexpr (R > 1) put(1, lo1, hi1);
  if constexpr (R > 2) put(2, lo2, hi2);
  if constexpr (R > 3) put(3, lo3, hi3);
}
#undef DS_Q4K_ROW

// One row of x against R (<= 4) consecutive q8_0 rows from r: per block of
// 32, each row's codes widened against x (loaded once for all rows) into a
// block sum, which its scale then adds to the row's accumulator: one
// multiply a block instead of one a vector, and the rows walked by pointers
// rather than DotBlock's per-vector addressing.
template <int R>
void Q8_0OneX(float* HWY_RESTRICT y, const float* HWY_RESTRICT x, const uint8_t* w, int64_t row_bytes, int64_t cols,
              int64_t r, bool accumulate) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  VF a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
  const uint8_t* q0 = w + r * row_bytes;
  const uint8_t* q1 = q0 + (R > 1 ? row_bytes : 0);
  const uint8_t* q2 = q0 + (R > 2 ? 2 * row_bytes : 0);
  const uint8_t* q3 = q0 + (R > 3 ? 3 * row_bytes : 0);
  for (int64_t b = 0; b < cols / kQ8_0Values; ++b) {
    for (int i = 0; i < R; ++i) PrefetchL2(q0 + i * row_bytes + kQ4KPrefetchBytes);
    VF p0 = hn::Zero(d), p1 = p0, p2 = p0, p3 = p0;
    const float* xb = x + b * kQ8_0Values;
    for (int64_t l = 0; l < kQ8_0Values; l += N) {
      const VF xv = hn::LoadU(d, xb + l);
      p0 = hn::MulAdd(LoadI8(d, q0 + 2 + l), xv, p0);
      if constexpr (R > 1) p1 = hn::MulAdd(LoadI8(d, q1 + 2 + l), xv, p1);
      if constexpr (R > 2) p2 = hn::MulAdd(LoadI8(d, q2 + 2 + l), xv, p2);
      if constexpr (R > 3) p3 = hn::MulAdd(LoadI8(d, q3 + 2 + l), xv, p3);
    }
    a0 = hn::MulAdd(p0, hn::Set(d, half_at(q0)), a0);
    if constexpr (R > 1) a1 = hn::MulAdd(p1, hn::Set(d, half_at(q1)), a1);
    if constexpr (R > 2) a2 = hn::MulAdd(p2, hn::Set(d, half_at(q2)), a2);
    if constexpr (R > 3) a3 = hn::MulAdd(p3, hn::Set(d, half_at(q3)), a3);
    q0 += kQ8_0Bytes, q1 += kQ8_0Bytes, q2 += kQ8_0Bytes, q3 += kQ8_0Bytes;
  }
  auto put = [&](int i, VF a) HWY_ATTR {
    const float v = hn::GetLane(hn::SumOfLanes(d, a));
    y[r + i] = accumulate ? y[r + i] + v : v;
  };
  put(0, a0);
  if constexpr (R > 1) put(1, a1);
  if constexpr (R > 2) put(2, a2);
  if constexpr (R > 3) put(3, a3);
}

}  // namespace

// Whether the vector kernels apply: a whole number of vectors in 16 values
// (q4_1's half block).
bool BlockVectors() {
  const size_t n = hn::Lanes(DF());
  return n <= 16 && 16 % n == 0;
}

void WidenQ8_0Rows(float* HWY_RESTRICT out, const uint8_t* HWY_RESTRICT w, int64_t cols, int64_t r0, int64_t r1) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ8_0Values * kQ8_0Bytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* blk = w + r * row_bytes;
    float* o = out + (r - r0) * cols;
    for (int64_t c = 0; c < cols; c += kQ8_0Values, blk += kQ8_0Bytes) {
      const VF s = hn::Set(d, half_at(blk));
      for (int64_t i = 0; i < kQ8_0Values; i += N) hn::StoreU(hn::Mul(LoadI8(d, blk + 2 + i), s), d, o + c + i);
    }
  }
}

void WidenQ4KRows(float* HWY_RESTRICT out, const uint8_t* HWY_RESTRICT w, int64_t cols, int64_t r0, int64_t r1) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ4_KValues * kQ4_KBytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* blk = w + r * row_bytes;
    float* o = out + (r - r0) * cols;
    for (int64_t c = 0; c < cols; c += kQ4_KValues, blk += kQ4_KBytes) {
      float a[8], b[8];
      Q4KScales(blk, a, b);
      for (int k = 0; k < 4; ++k) {
        const uint8_t* q = blk + 16 + 32 * k;
        const VF a0 = hn::Set(d, a[2 * k]), b0 = hn::Set(d, b[2 * k]);
        const VF a1 = hn::Set(d, a[2 * k + 1]), b1 = hn::Set(d, b[2 * k + 1]);
        for (int64_t l = 0; l < 32; l += N) {
          hn::StoreU(hn::MulSub(Nibbles(d, q + l, false), a0, b0), d, o + c + 64 * k + l);
          hn::StoreU(hn::MulSub(Nibbles(d, q + l, true), a1, b1), d, o + c + 64 * k + 32 + l);
        }
      }
    }
  }
}

void WidenQ4_1Rows(float* HWY_RESTRICT out, const uint8_t* HWY_RESTRICT w, int64_t cols, int64_t r0, int64_t r1) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ4_1Values * kQ4_1Bytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* blk = w + r * row_bytes;
    float* o = out + (r - r0) * cols;
    for (int64_t c = 0; c < cols; c += kQ4_1Values, blk += kQ4_1Bytes) {
      const VF a = hn::Set(d, half_at(blk)), m = hn::Set(d, half_at(blk + 2));
      for (int64_t l = 0; l < 16; l += N) {
        hn::StoreU(hn::MulAdd(Nibbles(d, blk + 4 + l, false), a, m), d, o + c + l);
        hn::StoreU(hn::MulAdd(Nibbles(d, blk + 4 + l, true), a, m), d, o + c + 16 + l);
      }
    }
  }
}

// y[m][r] (+)= x[m] . W[r] for m < M (<= 8), r in [r0, r1) of a block
// weight: Gemv over the scaled codes, then each row's offsets against the
// sums of x over its blocks of 32.
void GemvBlocks(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint8_t* w, DType t, int64_t cols,
                int64_t r0, int64_t r1, bool accumulate, bool int8_x) {
  const BlockRows base{w, block_row_bytes(t, cols)};
  if (t == DType::Q8_0 && M == 1) {  // decode
    for (int64_t r = r0; r < r1; r += 4)
      with_count<4>(std::min<int64_t>(4, r1 - r),
                    [&](auto n) HWY_ATTR { Q8_0OneX<n()>(y, x, w, base.row_bytes, cols, r, accumulate); });
    return;
  }
  if (t == DType::Q8_0) return Gemv(y, ldy, x, ldx, M, Q8_0Rows{base}, cols, r0, r1, accumulate);
  // Each row of x's sums over blocks of 32, for the offsets.
  const int64_t blocks = cols / 32;
  Buffer<float> xs(static_cast<size_t>(M * blocks)), off(static_cast<size_t>(blocks));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < blocks; ++j) {
      float v = 0;
      for (int64_t i = 0; i < 32; ++i) v += x[m * ldx + j * 32 + i];
      xs[static_cast<size_t>(m * blocks + j)] = v;
    }
  if (t == DType::Q4_K && M == 1 && !int8_x) {  // decode on float32 x
    for (int64_t r = r0; r < r1; r += 4)
      with_count<4>(std::min<int64_t>(4, r1 - r),
                    [&](auto n) HWY_ATTR { Q4KOneXF32<n()>(y, x, xs.data(), w, base.row_bytes, cols, r, accumulate); });
    return;
  }
  if (t == DType::Q4_K && int8_x) {  // on integers, each row of x in turn over four rows of W kept in L1
    const int64_t kb = cols / kQ4_KValues;
    Buffer<XQ> xq(static_cast<size_t>(M * cols));
    Buffer<float> dx(static_cast<size_t>(M * kb));
    for (int64_t m = 0; m < M; ++m) QuantizeX256(x + m * ldx, cols, xq.data() + m * cols, dx.data() + m * kb);
    for (int64_t r = r0; r < r1; r += 4)
      with_count<4>(std::min<int64_t>(4, r1 - r), [&](auto n) HWY_ATTR {
        for (int64_t m = 0; m < M; ++m)
          Q4KOneX<n()>(y + m * ldy, xq.data() + m * cols, dx.data() + m * kb, xs.data() + m * blocks, w, base.row_bytes,
                       cols, r, accumulate);
      });
    return;
  }
  // Four rows at a time: the scaled codes, then y[m][r] -= the sum over
  // blocks j of the row's offset j times xs[m][j] (q4_k's mins as the
  // kernel decoded them; q4_1's read again, the rows are in cache).
  Buffer<float> ctx_floats(static_cast<size_t>(4 * (8 + blocks)));
  Q4KRow ctx[4];
  for (int i = 0; i < 4; ++i)
    ctx[i] = {nullptr, ctx_floats.data() + i * (8 + blocks), ctx_floats.data() + i * (8 + blocks) + 8};
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t rb = std::min(r1, r + 4);
    if (t == DType::Q4_1)
      Gemv(y, ldy, x, ldx, M, Q4_1Rows{base}, cols, r, rb, accumulate);
    else
      Gemv(y, ldy, x, ldx, M, Q4KRows{base, ctx}, cols, r, rb, accumulate);
    for (int64_t i = r; i < rb; ++i) {
      const float* o = ctx[i & 3].mins;
      if (t == DType::Q4_1) {
        const uint8_t* row = base.Row(i);
        for (int64_t j = 0; j < blocks; ++j) off[static_cast<size_t>(j)] = -half_at(row + j * kQ4_1Bytes + 2);
        o = off.data();
      }
      for (int64_t m = 0; m < M; ++m) {
        float v = 0;
        for (int64_t j = 0; j < blocks; ++j) v += o[j] * xs[static_cast<size_t>(m * blocks + j)];
        y[m * ldy + i] -= v;
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ds::ops::detail {

HWY_EXPORT(BlockVectors);
HWY_EXPORT(WidenQ8_0Rows);
HWY_EXPORT(WidenQ4KRows);
HWY_EXPORT(WidenQ4_1Rows);
HWY_EXPORT(GemvBlocks);

void widen_block_rows(float* out, const WeightView& w, int64_t r0, int64_t r1) {
  const auto* bytes = static_cast<const uint8_t*>(w.data);
  if (!DS_DISPATCH(BlockVectors)() || w.dtype == DType::Q6_K) {  // q6_k: ggml's own reading
    const int64_t row_bytes = block_row_bytes(w.dtype, w.cols);
    for (int64_t r = r0; r < r1; ++r)
      dequantize_blocks(w.dtype, bytes + r * row_bytes, w.cols, out + (r - r0) * w.cols);
    return;
  }
  if (w.dtype == DType::Q8_0)
    DS_DISPATCH(WidenQ8_0Rows)(out, bytes, w.cols, r0, r1);
  else if (w.dtype == DType::Q4_1)
    DS_DISPATCH(WidenQ4_1Rows)(out, bytes, w.cols, r0, r1);
  else
    DS_DISPATCH(WidenQ4KRows)(out, bytes, w.cols, r0, r1);
}

void gemv_blocks(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const WeightView& w, int64_t r0,
                 int64_t r1, bool accumulate) {
  const bool int8_x = quantized_x() == QuantizedX::kInt8;
  // Vectors longer than a block, or q6_k on float32 x: widen a row at a time.
  if (!DS_DISPATCH(BlockVectors)() || (w.dtype == DType::Q6_K && !int8_x)) {
    Buffer<float> row(static_cast<size_t>(w.cols));
    for (int64_t r = r0; r < r1; ++r) {
      widen_block_rows(row.data(), w, r, r + 1);
      for (int64_t m = 0; m < M; ++m) {
        float v = 0;
        for (int64_t c = 0; c < w.cols; ++c) v += x[m * ldx + c] * row[static_cast<size_t>(c)];
        y[m * ldy + r] = accumulate ? y[m * ldy + r] + v : v;
      }
    }
    return;
  }
  if (w.dtype == DType::Q8_0 && int8_x) return gemv_q8_0_int8(y, ldy, x, ldx, M, w, r0, r1, accumulate);
  if (w.dtype == DType::Q6_K) return gemv_q6_k_int8(y, ldy, x, ldx, M, w, r0, r1, accumulate);
  DS_DISPATCH(GemvBlocks)
  (y, ldy, x, ldx, M, static_cast<const uint8_t*>(w.data), w.dtype, w.cols, r0, r1, accumulate, int8_x);
}

}  // namespace ds::ops::detail

namespace ds::ops {
namespace {
std::atomic<QuantizedX> g_quantized_x{QuantizedX::kInt8};
}  // namespace

void set_quantized_x(QuantizedX q) { g_quantized_x = q; }
QuantizedX quantized_x() { return g_quantized_x; }

QuantizedX parse_quantized_x(std::string_view name) {
  if (name == "int8") return QuantizedX::kInt8;
  if (name == "f32" || name == "float32") return QuantizedX::kF32;
  DS_FAIL("quantized x '{}' is not one of: int8, f32", name);
}

}  // namespace ds::ops
#endif  // HWY_ONCE
