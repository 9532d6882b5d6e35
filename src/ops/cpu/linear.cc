// Linear layers over weights in their stored dtype (ops/linear.h).
//
// The kernels are Highway code, compiled once per SIMD target (AVX-512, AVX2,
// NEON, SVE, scalar) and dispatched at run time (core/simd.h):
//
// - Decode-sized products (M <= 8 rows of x) are bound by reading the weight
//   once. Blocks of 4 weight rows are widened in registers (bf16: a 16-bit
//   shift; e4m3: bit placement and the block scale) and each widened vector
//   feeds the FMAs of up to 4 rows of x; the sums are reduced at the end of
//   the row. Other dtypes widen one row at a time into an L1-sized buffer.
// - Prefill-sized products use an outer-product kernel: x is packed
//   transposed in panels of two vectors of rows, each weight element is
//   broadcast from a chunk of rows widened to float32 into an L2-sized
//   buffer and multiplied into a tile of accumulators, one FMA chain over k
//   per output element. The tiles fetch the next chunk's weight from memory
//   a cache line at a time as they run.
// - In bf16 precision (ops/linear.h) x is rounded to bf16 first. With bf16,
//   fp4 or block-scaled e4m3 weights on a CPU with AVX512-BF16, prefill-sized
//   products then run the same outer-product tiles on bf16 pairs: x packed
//   as pairs of columns, each weight pair (e4m3 widened exactly to bf16, its
//   scale applied to each block's sums; fp4 widened exactly with its scales)
//   broadcast into vdpbf16ps.
//
// Every output element is computed by one call in a fixed order, however the
// rows are shared among threads, so results are bitwise the same for any
// thread count (they differ between targets, whose vector widths differ).
#include "ops/linear.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/backend.h"
#include "ops/block_quant.h"
#include "ops/cpu/linear_blocks.h"
#include "ops/cpu/linear_fp8.h"
#include "ops/fp8_quant.h"
#include "ops/matmul.h"

// Target-independent definitions, seen once (this file is included again
// for every target below).
#ifndef DS_OPS_CPU_LINEAR_ONCE
#define DS_OPS_CPU_LINEAR_ONCE
namespace ds::ops {
namespace {

// fp8 has 256 codes: widen_rows decodes through a table.
struct Fp8Table {
  float e4m3[256], e5m2[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = e4m3_to_f32(static_cast<uint8_t>(i));
      e5m2[i] = e5m2_to_f32(static_cast<uint8_t>(i));
    }
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// An e4m3 weight with block scales, as the kernels read it.
struct Fp8Weight {
  const uint8_t* w;
  int64_t cols;
  const float* scale_inv;
  int64_t block_rows, block_cols, scale_cols;
  const float* scale_row(int64_t r) const { return scale_inv + (r / block_rows) * scale_cols; }
};

// A packed fp4 weight (ops/linear.h): rows of cols / 2 code bytes and of
// cols / 32 e8m0 scale bytes.
constexpr int64_t kFp4Block = 32;  // elements per scale
struct Fp4Weight {
  const uint8_t* w;
  int64_t cols;
  const uint8_t* scales;
  const uint8_t* row(int64_t r) const { return w + r * (cols / 2); }
  const uint8_t* scale_row(int64_t r) const { return scales + r * (cols / kFp4Block); }
};

// The multiplier that turns E2m1Value's value * 2^-125 into value * 2^(e - 127):
// 2^(e - 2), a normal float for e <= 129 (larger scales take the scalar path).
constexpr uint8_t kFp4MaxVectorScale = 129;
inline float fp4_multiplier(uint8_t e) {
  const uint32_t u = (static_cast<uint32_t>(e) + 125) << 23;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Whether every scale byte of rows [r0, r1) is at most kFp4MaxVectorScale.
inline bool fp4_rows_vectorizable(const Fp4Weight& f, int64_t r0, int64_t r1) {
  const uint8_t* s = f.scale_row(r0);
  const int64_t n = (r1 - r0) * (f.cols / kFp4Block);
  uint8_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  return m <= kFp4MaxVectorScale;
}

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One product of a prefill: y (ldy apart) (+)= x W^T. Prefill runs one or
// two over the same x (a gated MLP's gate and up), packing x once: the
// weights' rows then count as one, w0's first (RunProducts).
struct Product {
  float* y;
  int64_t ldy;
  const WeightView* w;
};

}  // namespace
}  // namespace ds::ops
#endif  // DS_OPS_CPU_LINEAR_ONCE

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/linear.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

#include "ops/cpu/gemv-inl.h"
#include "ops/cpu/lanes-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kMaxXRows = 8;  // decode-sized M

size_t VectorLanes() { return hn::Lanes(DF()); }

// ---------------------------------------------------------------- widening

// 16-bit patterns at p as float32: bf16 is the high half of a float32.
HWY_INLINE VF LoadBf16(DF d, const uint16_t* HWY_RESTRICT p) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> du;
  return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, p))));
}

// e4m3 bytes at p times `scale` (the block's scale times 2^120). A byte
// sign-extended to 32 bits and shifted left by 20 has the sign in bit 31
// (copies in 28-30 are masked off) and exponent and mantissa in bits 20-26:
// as float32 that is the e4m3 value times 2^-120, exact for subnormals too.
// One multiplication by scale * 2^120 then rounds the exact product
// value * scale once, as widen_rows does (callers check scale * 2^120 is
// finite). The one exception is e4m3's NaN code (0x7f/0xff), which reads as
// 480 here; quantized checkpoints do not contain it.
HWY_INLINE VF E4m3Bits(DF d, const uint8_t* HWY_RESTRICT p) {
  const hn::Rebind<int8_t, DF> d8;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::And(hn::ShiftLeft<20>(hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p)))),
                            hn::Set(di, static_cast<int32_t>(0x87f00000u)));
  return hn::BitCast(d, bits);
}
HWY_INLINE VF LoadE4m3(DF d, const uint8_t* HWY_RESTRICT p, VF scale) { return hn::Mul(E4m3Bits(d, p), scale); }

constexpr float kE4m3Shift = 0x1p120f;

// Rows [r0, r1) of an e4m3 weight, widened and scaled into out (row-major).
void WidenE4m3Rows(float* HWY_RESTRICT out, const Fp8Weight& f, int64_t r0, int64_t r1) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const float* table = fp8_table().e4m3;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = f.w + r * f.cols;
    const float* s = f.scale_row(r);
    float* o = out + (r - r0) * f.cols;
    for (int64_t c0 = 0, b = 0; c0 < f.cols; c0 += f.block_cols, ++b) {
      const int64_t c1 = std::min(f.cols, c0 + f.block_cols);
      const VF sv = hn::Set(d, s[b] * kE4m3Shift);
      int64_t c = c0;
      for (; c + N <= c1; c += N) hn::StoreU(LoadE4m3(d, wr + c, sv), d, o + c);
      for (; c < c1; ++c) o[c] = table[wr[c]] * s[b];
    }
  }
}

// fp4: the E2M1 codes held in bits [28 - shift, 32 - shift) of each lane as
// float32 values times 2^-125, all normal numbers (a subnormal operand costs
// a microcode assist per multiplication on many x86 CPUs). The code's sign
// goes to bit 31 and its 3 magnitude bits to 24..22 (t = magnitude << 22);
// adding min(t, 2^23) raises the exponent by one for magnitudes of 2 and up
// (exponent and mantissa then read as value * 2^-125) and maps 1 (0.5) to
// 2^23, the float 2^-126. One multiplication by fp4_multiplier(e) =
// 2^(e - 2) gives value * 2^(e - 127) exactly.
HWY_INLINE VF E2m1Value(DF d, hn::Vec<hn::RebindToSigned<DF>> lanes, int shift) {
  const hn::RebindToSigned<DF> di;
  const auto u = hn::And(hn::ShiftRight<6>(hn::ShiftLeftSame(lanes, shift)),  // sign to 31, magnitude to 24..22
                         hn::Set(di, static_cast<int32_t>(0x81c00000u)));
  const auto t = hn::And(u, hn::Set(di, 0x01c00000));
  return hn::BitCast(d, hn::Add(u, hn::Min(t, hn::Set(di, 0x00800000))));
}
// One code byte per lane.
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> LoadFp4Bytes(DF, const uint8_t* HWY_RESTRICT p) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  return hn::PromoteTo(di, hn::LoadU(d8, p));
}

// Rows [r0, r1) of an fp4 weight widened into out (row-major). Vectors of N
// code bytes give N even and N odd elements, stored interleaved; a scale
// block is 16 bytes, so with more than 16 lanes (wide SVE), or a scale above
// kFp4MaxVectorScale, the block is widened one element at a time.
void WidenFp4Rows(float* HWY_RESTRICT out, const Fp4Weight& f, int64_t r0, int64_t r1) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* q = f.row(r);
    const uint8_t* s = f.scale_row(r);
    float* o = out + (r - r0) * f.cols;
    for (int64_t b = 0; b < f.cols / kFp4Block; ++b) {
      const uint8_t* qb = q + b * (kFp4Block / 2);
      float* ob = o + b * kFp4Block;
      if (N <= kFp4Block / 2 && s[b] <= kFp4MaxVectorScale) {
        const VF m = hn::Set(d, fp4_multiplier(s[b]));
        for (int64_t j = 0; j < kFp4Block / 2; j += N) {
          const auto bytes = LoadFp4Bytes(d, qb + j);
          hn::StoreInterleaved2(hn::Mul(E2m1Value(d, bytes, 28), m), hn::Mul(E2m1Value(d, bytes, 24), m), d,
                                ob + 2 * j);
        }
      } else {
        const float sc = e8m0_to_f32(s[b]);
        for (int64_t j = 0; j < kFp4Block / 2; ++j) {
          ob[2 * j] = e2m1_to_f32(qb[j]) * sc;
          ob[2 * j + 1] = e2m1_to_f32(static_cast<uint8_t>(qb[j] >> 4)) * sc;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- decode

// How far ahead of the line it reads the decode kernel asks for a weight
// streamed from memory, into L2 (not L1: a line requested for L1 holds one of
// the core's few L1 miss buffers until it arrives, and those then cap the
// bandwidth). Products with one or two rows of x, as a decode step's experts
// are, read the weight faster than the hardware prefetchers follow rows of a
// few hundred bytes: on a Zen 4, prefetching the next block of rows into L1
// streamed rows of the `small` preset's experts at 19-25 GB/s, 8 KiB ahead
// into L2 at 52-57 (linear_bench's expert_rows_stream_decode row,
// docs/performance.md). Lines past the end of a weight are harmless: a
// prefetch never faults.
constexpr int64_t kStreamPrefetchBytes = 8192;

// Weight sources for the decode kernel. Each has blocks of BlockCols()
// columns sharing a scale (the whole row when there is none): Scales(r) is
// row r's scales, one per block (computed once per row and call: it
// divides), Start(d, sc, b) the scale vector of block b, Load(d, r, c, s)
// widens N columns of row r, and Scalar(r, c, s) one column (for row tails).
struct Bf16Rows {
  const uint16_t* w;
  int64_t cols;
  static constexpr int64_t kColumnsPerLine = 32;  // 64-byte cache line
  static constexpr int64_t kPrefetchBytes = kStreamPrefetchBytes;
  int64_t BlockCols() const { return cols; }
  const float* Scales(int64_t) const { return nullptr; }
  VF Start(DF d, const float*, int64_t) const { return hn::Zero(d); }
  float ScalarScale(const float*, int64_t) const { return 1.0f; }
  const uint16_t* Row(int64_t r) const { return w + r * cols; }
  const void* At(int64_t r, int64_t c) const { return Row(r) + c; }
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF) const { return LoadBf16(d, Row(r) + c); }
  float Scalar(int64_t r, int64_t c, float) const { return bf16_bits_to_f32(Row(r)[c]); }
};

struct Fp8Rows {
  Fp8Weight f;
  static constexpr int64_t kColumnsPerLine = 64;
  static constexpr int64_t kPrefetchBytes = kStreamPrefetchBytes;
  int64_t BlockCols() const { return f.block_cols; }
  const float* Scales(int64_t r) const { return f.scale_row(r); }
  VF Start(DF d, const float* sc, int64_t b) const { return hn::Set(d, sc[b] * kE4m3Shift); }
  float ScalarScale(const float* sc, int64_t b) const { return sc[b]; }
  const uint8_t* Row(int64_t r) const { return f.w + r * f.cols; }
  const void* At(int64_t r, int64_t c) const { return Row(r) + c; }
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF s) const { return LoadE4m3(d, Row(r) + c, s); }
  float Scalar(int64_t r, int64_t c, float s) const { return fp8_table().e4m3[Row(r)[c]] * s; }
};

// e4m3 codes as the bare float32 bits of value * 2^-120 (no scale): for x
// already multiplied by the block's scale * 2^120, which saves a multiply
// per widened weight vector and the scale bookkeeping of the inner loop.
struct Fp8BitsRows {
  const uint8_t* w;
  int64_t cols;
  static constexpr int64_t kColumnsPerLine = 64;
  static constexpr int64_t kPrefetchBytes = kStreamPrefetchBytes;
  int64_t BlockCols() const { return cols; }
  const float* Scales(int64_t) const { return nullptr; }
  VF Start(DF d, const float*, int64_t) const { return hn::Zero(d); }
  float ScalarScale(const float*, int64_t) const { return 1.0f; }
  const uint8_t* Row(int64_t r) const { return w + r * cols; }
  const void* At(int64_t r, int64_t c) const { return Row(r) + c; }
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF) const { return E4m3Bits(d, Row(r) + c); }
  float Scalar(int64_t r, int64_t c, float) const { return fp8_table().e4m3[Row(r)[c]] * (1.0f / kE4m3Shift); }
};

struct F32Rows {
  const float* w;
  int64_t cols;
  static constexpr int64_t kColumnsPerLine = 16;
  static constexpr int64_t kPrefetchBytes = 0;  // rows widened into a cache-resident buffer
  int64_t BlockCols() const { return cols; }
  const float* Scales(int64_t) const { return nullptr; }
  VF Start(DF d, const float*, int64_t) const { return hn::Zero(d); }
  float ScalarScale(const float*, int64_t) const { return 1.0f; }
  const float* Row(int64_t r) const { return w + r * cols; }
  const void* At(int64_t r, int64_t c) const { return Row(r) + c; }
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF) const { return hn::LoadU(d, Row(r) + c); }
  float Scalar(int64_t r, int64_t c, float) const { return Row(r)[c]; }
};

// fp4 rows against x whose columns are permuted in groups of 2N: the group's
// N even columns, then its N odd ones (GemvFp4), so that N code bytes give
// the vector of low nibbles and then the vector of high nibbles. 2N divides
// 32, so every group lies in one scale block, and the columns are a multiple
// of 32, so there are no tails.
struct Fp4Rows {
  Fp4Weight f;
  int64_t lanes;
  // Longer than a scale block, so DotBlock's line loop (and its prefetch)
  // never runs: a prefetch of the next block of rows per 16-byte block
  // measured slower; the hardware follows the rows.
  static constexpr int64_t kColumnsPerLine = 128;
  static constexpr int64_t kPrefetchBytes = 0;
  int64_t BlockCols() const { return kFp4Block; }
  const uint8_t* Scales(int64_t r) const { return f.scale_row(r); }
  VF Start(DF d, const uint8_t* sc, int64_t b) const { return hn::Set(d, fp4_multiplier(sc[b])); }
  float ScalarScale(const uint8_t* sc, int64_t b) const { return e8m0_to_f32(sc[b]); }
  const void* At(int64_t r, int64_t c) const { return f.row(r) + c / 2; }
  HWY_INLINE VF Load(DF d, int64_t r, int64_t c, VF s) const {
    // Low nibbles for the first half of a group, high ones for the second:
    // a shift by 28 or 24 (no branch).
    const auto bytes = LoadFp4Bytes(d, f.row(r) + ((c >> 1) & ~(lanes - 1)));
    return hn::Mul(E2m1Value(d, bytes, 28 - static_cast<int>((c & lanes) != 0) * 4), s);
  }
  float Scalar(int64_t r, int64_t c, float s) const {
    const int64_t g = c / (2 * lanes) * (2 * lanes), j = c - g;
    const int64_t e = g + (j < lanes ? 2 * j : 2 * (j - lanes) + 1);
    const uint8_t byte = f.row(r)[e / 2];
    return e2m1_to_f32(e % 2 ? static_cast<uint8_t>(byte >> 4) : byte) * s;
  }
};

void GemvBf16(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t cols,
              int64_t r0, int64_t r1, bool accumulate) {
  Gemv(y, ldy, x, ldx, M, Bf16Rows{w, cols}, cols, r0, r1, accumulate);
}

void GemvFp8(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const Fp8Weight& f, int64_t r0, int64_t r1,
             bool accumulate) {
  Gemv(y, ldy, x, ldx, M, Fp8Rows{f}, f.cols, r0, r1, accumulate);
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
// E2m1Value of each code 0-15 (AVX2's table kernel reads the first 8,
// the magnitudes).
alignas(64) constexpr float kE2m1Scaled[16] = {
    0.0f,  0x1p-126f,  0x1p-125f,  0x1.8p-125f,  0x1p-124f,  0x1.8p-124f,  0x1p-123f,  0x1.8p-123f,
    -0.0f, -0x1p-126f, -0x1p-125f, -0x1.8p-125f, -0x1p-124f, -0x1.8p-124f, -0x1p-123f, -0x1.8p-123f};
constexpr int64_t kFp4PrefetchBytes = 16384;
#endif

#if HWY_TARGET == HWY_AVX3
// Decode's fp4 kernel on AVX-512: M (<= 4) rows of x (permuted as Fp4Rows
// reads them, rows K apart; 2N = 32 is a scale block) against R (<= 4)
// weight rows from r. A block's scale is applied once to the 16 values a
// code can take, and each code picks its lane of them (vpermps reads an
// index lane's low 4 bits): a widening, a shift and two permutes a block
// of a weight row, for all M rows of x, instead of DotBlock's generic loop
// and E2m1Value's eight operations a vector. The products and their order
// are Fp4Rows's through DotBlock, so the sums are the same bits.
template <int M, int R>
void Fp4Block(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT xp, int64_t K, const Fp4Weight& f,
              int64_t r, bool accumulate) {
  const DF d;
  const __m512 table = _mm512_load_ps(kE2m1Scaled);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < f.cols / kFp4Block; ++b) {
    __m512 xe[M], xo[M];
    for (int m = 0; m < M; ++m)
      xe[m] = _mm512_loadu_ps(xp + m * K + b * kFp4Block), xo[m] = _mm512_loadu_ps(xp + m * K + b * kFp4Block + 16);
#pragma GCC unroll 4  // the accumulators stay in registers
    for (int i = 0; i < R; ++i) {
      const uint8_t* q = f.row(r + i) + b * (kFp4Block / 2);
      if ((b & 3) == 0) PrefetchL2(q + kFp4PrefetchBytes);  // a line every fourth block
      const __m512 t = _mm512_mul_ps(table, _mm512_set1_ps(fp4_multiplier(f.scale_row(r + i)[b])));
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m512 lo = _mm512_permutexvar_ps(codes, t), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), t);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        acc[m][i] = _mm512_fmadd_ps(xe[m], lo, acc[m][i]);
        acc[m][i] = _mm512_fmadd_ps(xo[m], hi, acc[m][i]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) {
      float* out = y + m * ldy + r + i;
      const float v = hn::GetLane(hn::SumOfLanes(d, VF{acc[m][i]}));
      *out = accumulate ? *out + v : v;
    }
}
#endif

#if HWY_TARGET == HWY_AVX2
// Decode's fp4 kernel on AVX2: M (<= 2) rows of x, permuted as Fp4Rows
// reads them (2N = 16: a group's 8 even columns, then its 8 odd ones),
// against R (<= 4) weight rows from r. vpermps reads 3 index bits, so the
// table holds the 8 magnitudes (E2m1Value's, times the block's
// fp4_multiplier) and the sign comes from the code: a lane holding code c
// (0-15) in its low bits, shifted left by 28, carries c's sign in bit 31
// and its magnitude bits in 30..28; the table entry for magnitude k is
// stored with k << 28 xored in already, so one xor with the shifted lane
// cancels those and sets the sign. Per 8 code bytes: a widening, a shift
// for the high nibbles, two permutes, two shifts and two xors, where
// E2m1Value takes eight operations a vector. The values are E2m1Value's
// times the scale (exact, as in Fp4Rows) and each accumulator takes them
// in DotBlock's order (low nibbles of 8 bytes, then their high nibbles),
// so the sums are the same bits as Gemv over Fp4Rows.
alignas(32) constexpr int32_t kE2m1IndexBits[8] = {0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28};

template <int M, int R>
void Fp4Block(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT xp, int64_t K, const Fp4Weight& f,
              int64_t r, bool accumulate) {
  const DF d;
  const __m256 table = _mm256_load_ps(kE2m1Scaled);  // the 8 magnitudes
  const __m256i index_bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(kE2m1IndexBits));
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < f.cols / kFp4Block; ++b) {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const uint8_t* q = f.row(r + i) + b * (kFp4Block / 2);
      if ((b & 3) == 0) PrefetchL2(q + kFp4PrefetchBytes);  // a line every fourth block
      const __m256 scaled = _mm256_mul_ps(table, _mm256_set1_ps(fp4_multiplier(f.scale_row(r + i)[b])));
      const __m256 t = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(scaled), index_bits));
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * g)));
        const __m256i hi = _mm256_srli_epi32(lo, 4);
        const __m256 wl =
            _mm256_xor_ps(_mm256_permutevar8x32_ps(t, lo), _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
        const __m256 wh =
            _mm256_xor_ps(_mm256_permutevar8x32_ps(t, hi), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
        const int64_t c = b * kFp4Block + 16 * g;
#pragma GCC unroll 2
        for (int m = 0; m < M; ++m) {
          acc[m][i] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + m * K + c), wl, acc[m][i]);
          acc[m][i] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + m * K + c + 8), wh, acc[m][i]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) {
      float* out = y + m * ldy + r + i;
      const float v = hn::GetLane(hn::SumOfLanes(d, VF{acc[m][i]}));
      *out = accumulate ? *out + v : v;
    }
}
#endif

// fp4 weight rows [r0, r1) against M (<= 8) rows of x. When one pass of the
// register kernel covers every row of x, the codes are widened in registers,
// with x's columns permuted as Fp4Rows reads them (needs 2N to divide 32),
// and chunks of rows with a scale above kFp4MaxVectorScale (none in real
// checkpoints) are widened a row at a time instead. With more rows of x,
// unpacking the nibbles again for every pass costs more than widening each
// block of 4 weight rows once into an L1/L2 buffer that the passes then read
// as float32.
void GemvFp4(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const Fp4Weight& f, int64_t r0,
             int64_t r1, bool accumulate) {
  const DF d;
  const int64_t K = f.cols, N = static_cast<int64_t>(hn::Lanes(d));
  if (M > kXRowsPerPass) {
    Buffer<float> wide(static_cast<size_t>(4 * K));
    for (int64_t r = r0; r < r1; r += 4) {
      const int64_t rb = std::min(r1, r + 4);
      WidenFp4Rows(wide.data(), f, r, rb);
      Gemv(y + r, ldy, x, ldx, M, F32Rows{wide.data(), K}, K, 0, rb - r, accumulate);
    }
    return;
  }
  Buffer<float> xp(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K; g += 2 * N) {
      VF even, odd;
      hn::LoadInterleaved2(d, x + m * ldx + g, even, odd);
      hn::StoreU(even, d, xp.data() + m * K + g);
      hn::StoreU(odd, d, xp.data() + m * K + g + N);
    }
  constexpr int64_t kChunkRows = 64;
  Buffer<float> row;
  for (int64_t ra = r0; ra < r1; ra += kChunkRows) {
    const int64_t rb = std::min(r1, ra + kChunkRows);
    if (fp4_rows_vectorizable(f, ra, rb)) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2  // the table kernels
      for (int64_t r = ra; r < rb; r += 4)
        with_count<kXRowsPerPass>(M, [&](auto mm) HWY_ATTR {
          with_count<4>(std::min<int64_t>(4, rb - r),
                        [&](auto n) HWY_ATTR { Fp4Block<mm(), n()>(y, ldy, xp.data(), K, f, r, accumulate); });
        });
#else
      Gemv(y, ldy, xp.data(), K, M, Fp4Rows{f, N}, K, ra, rb, accumulate);
#endif
      continue;
    }
    row.resize(static_cast<size_t>(K));
    for (int64_t r = ra; r < rb; ++r) {
      WidenFp4Rows(row.data(), f, r, r + 1);
      Gemv(y + r, ldy, x, ldx, M, F32Rows{row.data(), K}, K, 0, 1, accumulate);
    }
  }
}

// As GemvFp8, with the scales moved from the weight to x: for each block of
// weight rows, x times each column block's scale * 2^120 (the caller checks
// that this is finite) against the bare bits of the codes. Per row block
// that is M * cols multiplies instead of one per weight, and the inner loop
// is load, widen, FMA.
void GemvFp8ScaledX(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const Fp8Weight& f, int64_t r0,
                    int64_t r1, bool accumulate) {
  const DF d;
  const int64_t K = f.cols, N = static_cast<int64_t>(hn::Lanes(d));
  Buffer<float> xs(static_cast<size_t>(M * K));
  const Fp8BitsRows src{f.w, K};
  for (int64_t ra = r0; ra < r1;) {
    const int64_t rb = std::min(r1, (ra / f.block_rows + 1) * f.block_rows);
    const float* sc = f.scale_row(ra);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c0 = 0, b = 0; c0 < K; c0 += f.block_cols, ++b) {
        const int64_t c1 = std::min(K, c0 + f.block_cols);
        const float s = sc[b] * kE4m3Shift;
        const VF sv = hn::Set(d, s);
        int64_t c = c0;
        for (; c + N <= c1; c += N) hn::StoreU(hn::Mul(hn::LoadU(d, x + m * ldx + c), sv), d, xs.data() + m * K + c);
        for (; c < c1; ++c) xs[m * K + c] = x[m * ldx + c] * s;
      }
    Gemv(y, ldy, xs.data(), K, M, src, K, ra, rb, accumulate);
    ra = rb;
  }
}

// Rows of an already widened weight w [rows, cols] into y[m][0, rows).
void GemvF32(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const float* w, int64_t rows, int64_t cols,
             bool accumulate) {
  Gemv(y, ldy, x, ldx, M, F32Rows{w, cols}, cols, 0, rows, accumulate);
}

// ---------------------------------------------------------------- prefill

// x rows per panel: two vectors.
int64_t PanelRows() { return 2 * static_cast<int64_t>(hn::Lanes(DF())); }

// The one-lane scalar target transposes one float at a time.
constexpr bool kVectorTranspose = HWY_TARGET != HWY_SCALAR;

// dst[i * ldd + j] (+)= src[j * lds + i] for i, j < 4: a 4 x 4 block.
HWY_INLINE void Transpose4x4(const float* HWY_RESTRICT src, int64_t lds, float* HWY_RESTRICT dst, int64_t ldd,
                             bool accumulate) {
  if (accumulate) {
    TransposeRows4x4<true>(src, src + lds, src + 2 * lds, src + 3 * lds, dst, ldd);
  } else {
    TransposeRows4x4<false>(src, src + lds, src + 2 * lds, src + 3 * lds, dst, ldd);
  }
}

// xt[k][j] = x[j][k] for j < rows (<= P), zero for rows <= j < P: 4 x 4
// blocks, then the edges one float at a time.
void PackPanel(float* HWY_RESTRICT xt, const float* HWY_RESTRICT x, int64_t ldx, int64_t rows, int64_t K, int64_t P) {
  const int64_t rows4 = kVectorTranspose ? rows / 4 * 4 : 0, K4 = K / 4 * 4;
  // Four rows of xt at a time, written front to back (a panel of xt is
  // larger than L1, so sweeping it once per 4 rows of x would miss on every
  // store).
  for (int64_t k = 0; k < K4; k += 4)
    for (int64_t j = 0; j < rows4; j += 4) Transpose4x4(x + j * ldx + k, ldx, xt + k * P + j, P, false);
  for (int64_t k = K4; k < K; ++k)
    for (int64_t j = 0; j < rows4; ++j) xt[k * P + j] = x[j * ldx + k];
  for (int64_t k = 0; k < K; ++k) {
    float* o = xt + k * P;
    for (int64_t i = rows4; i < rows; ++i) o[i] = x[i * ldx + k];
    for (int64_t i = rows; i < P; ++i) o[i] = 0.0f;
  }
}

// The next chunk of weight rows, fetched into the cache while the current
// one is multiplied. A model's weights do not stay in cache from one step to
// the next, so each chunk comes from memory, and one core widens bf16 from
// memory at under a third of its rate from cache (linear_bench's widen rows
// on a Zen 4: 9 against 28 GB/s), while the FMAs leave the memory idle. The
// lines are spread over the tile kernel's steps of k (`every` apart):
// fetched in bursts, a tile's worth at once, they fill the miss queues and
// hide much less of it.
constexpr int64_t kLineBytes = 64;
constexpr int64_t kNoFetch = std::numeric_limits<int64_t>::max();  // a countdown that never ends

struct LinePrefetch {
  const char* next = nullptr;  // the next line to fetch
  const char* end = nullptr;
  int64_t every = 0;  // steps of k between two lines
};

// Lines of rows [r0, r1) of W over `steps` steps of k, finishing at about
// four fifths of them.
HWY_INLINE LinePrefetch ChunkPrefetch(const WeightView& w, int64_t r0, int64_t r1, int64_t steps) {
  const int64_t row_bytes = w.dtype == DType::F4E2M1   ? w.cols / 2
                            : is_block_format(w.dtype) ? block_row_bytes(w.dtype, w.cols)
                                                       : w.cols * static_cast<int64_t>(dtype_size(w.dtype));
  const auto begin = reinterpret_cast<uintptr_t>(w.data) + static_cast<uintptr_t>(r0 * row_bytes);
  const auto end = reinterpret_cast<uintptr_t>(w.data) + static_cast<uintptr_t>(r1 * row_bytes);
  const uintptr_t first = begin / kLineBytes * kLineBytes;
  const int64_t lines = static_cast<int64_t>((end - first + kLineBytes - 1) / kLineBytes);
  LinePrefetch pf;
  pf.next = reinterpret_cast<const char*>(first);
  pf.end = reinterpret_cast<const char*>(end);
  pf.every = std::max<int64_t>(1, steps * 4 / 5 / std::max<int64_t>(1, lines));
  return pf;
}

// Steps of k from `line` to its fetch (kNoFetch: none left).
HWY_INLINE int64_t FetchCountdown(const LinePrefetch& pf, const char* line) {
  return line < pf.end ? pf.every : kNoFetch;
}

// One step of k of a tile kernel: the next line when the countdown ends.
// The kernel keeps `line` and `countdown` for the tile and stores `line`
// back into pf.next at its end.
HWY_INLINE void FetchStep(const LinePrefetch& pf, const char*& line, int64_t& countdown) {
  if (--countdown == 0) {
    PrefetchL1(line);
    line += kLineBytes;
    countdown = FetchCountdown(pf, line);
  }
}

// Broadcast source for the tile kernel: B(n, k) is W[n0 + n][k] in every lane.
struct F32Bcast {
  const float* w;
  int64_t K;
  HWY_INLINE VF First(DF d, int n) const { return hn::Set(d, w[n * K]); }
  HWY_INLINE VF B(DF d, int n, int64_t k) const { return hn::Set(d, w[n * K + k]); }
};

// tile[n][0, P) = sum_k xt[k][0, P) W[n0 + n][k] for n < NR: accumulators
// c<n>a (panel rows [0, N)) and c<n>b ([N, 2N), only with Two), named for the
// same reason as in DotBlock.
#define DS_TILE_INIT(n)                          \
  if constexpr (NR > n) {                        \
    const VF b = src.First(d, n);                \
    c##n##a = hn::Mul(x0, b);                    \
    if constexpr (Two) c##n##b = hn::Mul(x1, b); \
  }
#define DS_TILE_STEP(n)                                      \
  if constexpr (NR > n) {                                    \
    const VF b = src.B(d, n, k);                             \
    c##n##a = hn::MulAdd(x0, b, c##n##a);                    \
    if constexpr (Two) c##n##b = hn::MulAdd(x1, b, c##n##b); \
  }
#define DS_TILE_STORE(n)                                         \
  if constexpr (NR > n) {                                        \
    hn::StoreU(c##n##a, d, tile + n * P);                        \
    if constexpr (Two) hn::StoreU(c##n##b, d, tile + n * P + N); \
  }
#define DS_TILE_ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)

template <int NR, bool Two, class Src>
HWY_INLINE void Tile(float* HWY_RESTRICT tile, const float* HWY_RESTRICT xt, const Src& src, int64_t K,
                     LinePrefetch& pf) {
  static_assert(NR <= 12, "twelve named accumulator rows");
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), P = 2 * N;
  VF c0a = hn::Zero(d), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a, c3a = c0a, c3b = c0a;
  VF c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a, c6a = c0a, c6b = c0a, c7a = c0a, c7b = c0a;
  VF c8a = c0a, c8b = c0a, c9a = c0a, c9b = c0a, c10a = c0a, c10b = c0a, c11a = c0a, c11b = c0a;
  {
    const VF x0 = hn::LoadU(d, xt);
    const VF x1 = Two ? hn::LoadU(d, xt + N) : x0;
    DS_TILE_ROWS(DS_TILE_INIT)
  }
  const char* line = pf.next;
  int64_t countdown = FetchCountdown(pf, line);
  for (int64_t k = 1; k < K; ++k) {
    const VF x0 = hn::LoadU(d, xt + k * P);
    const VF x1 = Two ? hn::LoadU(d, xt + k * P + N) : x0;
    DS_TILE_ROWS(DS_TILE_STEP)
    FetchStep(pf, line, countdown);
  }
  pf.next = line;
  DS_TILE_ROWS(DS_TILE_STORE)
}
#undef DS_TILE_INIT
#undef DS_TILE_STEP
#undef DS_TILE_STORE
#undef DS_TILE_ROWS

// y[m][n] (+)= tile[n][m] for m < rows, n < nr (tile rows of P floats): 4 x 4
// blocks, then the edges.
HWY_INLINE void StoreTile(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT tile, int64_t rows, int64_t nr,
                           bool accumulate) {
  const int64_t P = PanelRows();
  const int64_t rows4 = kVectorTranspose ? rows / 4 * 4 : 0, nr4 = kVectorTranspose ? nr / 4 * 4 : 0;
  for (int64_t m = 0; m < rows4; m += 4)
    for (int64_t n = 0; n < nr4; n += 4) Transpose4x4(tile + n * P + m, P, y + m * ldy + n, ldy, accumulate);
  for (int64_t m = 0; m < rows; ++m) {
    float* ym = y + m * ldy;
    for (int64_t n = m < rows4 ? nr4 : 0; n < nr; ++n) ym[n] = accumulate ? ym[n] + tile[n * P + m] : tile[n * P + m];
  }
}

// Fetches rows [0, rows) of y's columns [0, nr) for the tile about to be
// computed: each line's first store would otherwise wait for it. (The bf16
// dot kernel gains from it; the float32 tiles, twice as long, did not.)
HWY_INLINE void PrefetchTileRows(float* y, int64_t ldy, int64_t rows, int64_t nr) {
  for (int64_t m = 0; m < rows; ++m) {
    __builtin_prefetch(y + m * ldy, 1, 3);
    __builtin_prefetch(y + m * ldy + nr - 1, 1, 3);
  }
}

// Weight rows [r0, r1) (src indexed from r0) against one panel of `rows`
// (<= P) rows of x, a tile of kTileN rows at a time; the tile holds y
// transposed and is added into y element by element.
template <class Src>
void PanelRowsRange(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT xt, int64_t rows, Src src, int64_t K,
                    int64_t r0, int64_t r1, bool accumulate, LinePrefetch& pf) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  HWY_ALIGN float tile[kTileN * 2 * HWY_LANES(float)];
  const auto* base = src.w;
  for (int64_t n0 = r0; n0 < r1; n0 += kTileN) {
    const int nr = static_cast<int>(std::min<int64_t>(kTileN, r1 - n0));
    src.w = base + (n0 - r0) * K;
    if (rows > N)
      with_count<kTileN>(nr, [&](auto n) HWY_ATTR { Tile<n(), true>(tile, xt, src, K, pf); });
    else
      with_count<kTileN>(nr, [&](auto n) HWY_ATTR { Tile<n(), false>(tile, xt, src, K, pf); });
    StoreTile(y + n0, ldy, tile, rows, nr, accumulate);
  }
}

// Weight rows per chunk: a chunk stays in cache while every panel of x
// passes over it.
constexpr int64_t kChunkN = 8 * kTileN;
// Rows of x per group when the threads split the rows of x: packed into a
// per-thread buffer that stays in L2.
constexpr int64_t kGroupRows = 128;

// Weight rows per chunk for K columns: about 256 KiB as float32, whole tiles.
int64_t ChunkRows(int64_t K) {
  return std::clamp<int64_t>((int64_t{1} << 18) / (4 * K) / kTileN * kTileN, kTileN, kChunkN);
}

// The products' weight rows laid end to end.
HWY_INLINE int64_t ProductRows(const Product* products, int count) {
  int64_t n = 0;
  for (int i = 0; i < count; ++i) n += products[i].w->rows;
  return n;
}

// Calls run(i, r0, r1) for the rows [r0, r1) of product i that rows [r0, r1)
// of the products' rows laid end to end cover.
template <class Run>
HWY_INLINE void RunProducts(const Product* products, int count, int64_t r0, int64_t r1, const Run& run) {
  int64_t base = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t n = products[i].w->rows, lo = std::max(r0, base), hi = std::min(r1, base + n);
    if (lo < hi) run(i, lo - base, hi - base);
    base += n;
  }
}

// The chunks of weight rows [r0, r1) of the products laid end to end, in
// order: product i's rows [c0, c1), at most `chunk` rows each.
struct Chunk {
  int i;
  int64_t c0, c1;
};
HWY_INLINE std::vector<Chunk> ChunksOf(const Product* products, int count, int64_t r0, int64_t r1, int64_t chunk) {
  std::vector<Chunk> chunks;
  RunProducts(products, count, r0, r1, [&](int i, int64_t a, int64_t b) {
    for (int64_t c0 = a; c0 < b; c0 += chunk) chunks.push_back({i, c0, std::min(b, c0 + chunk)});
  });
  return chunks;
}

// The fetch of chunk ci + 1 (if any) spread over chunk ci's tiles against
// `panels` panels of x, of `tile_steps` steps each.
HWY_INLINE LinePrefetch NextChunkPrefetch(const Product* products, const std::vector<Chunk>& chunks, size_t ci,
                                          int64_t panels, int64_t tile_steps) {
  if (ci + 1 >= chunks.size()) return {};
  const Chunk &c = chunks[ci], &next = chunks[ci + 1];
  const int64_t steps = panels * ((c.c1 - c.c0 + kTileN - 1) / kTileN) * tile_steps;
  return ChunkPrefetch(*products[next.i].w, next.c0, next.c1, steps);
}

// How a prefill product of M rows of x against N weight rows of K columns is
// shared among the threads, for panels of x packed into `panel_floats`
// floats each: pack(xt, p0, p1) packs panels [p0, p1) at xt, and
// run(xt, r0, r1, p0, p1) multiplies them (panel p0 at xt) by weight rows
// [r0, r1). Every output element is one run call's, whatever the split.
template <class Pack, class Run>
void SplitPrefill(int64_t M, int64_t N, int64_t K, int64_t panel_floats, const Pack& pack, const Run& run) {
  const int64_t P = PanelRows(), panels = (M + P - 1) / P;
  const bool parallel = M * N * K >= (int64_t{1} << 16);
  const int64_t group_panels = std::max<int64_t>(1, kGroupRows / P);
  const int64_t groups = (panels + group_panels - 1) / group_panels;
  if (groups >= 2 * num_threads()) {
    // Many rows of x: each thread packs and multiplies its own groups of
    // panels against the whole weight. Packing all of x up front instead
    // would write it out to memory and read it back.
    parallel_ranges(groups, parallel, [&](int64_t g0, int64_t g1) {
      Buffer<float> xt(static_cast<size_t>(group_panels * panel_floats));
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = g * group_panels, p1 = std::min(panels, p0 + group_panels);
        pack(xt.data(), p0, p1);
        run(xt.data(), 0, N, p0, p1);
      }
    });
    return;
  }
  // Few rows of x: pack them once; the threads split the weight rows in whole
  // tiles (each reads only its share of the weight) when there are enough,
  // else the panels.
  Buffer<float> xt(static_cast<size_t>(panels * panel_floats));
  parallel_ranges(panels, M * K >= (int64_t{1} << 15),
                  [&](int64_t p0, int64_t p1) { pack(xt.data() + p0 * panel_floats, p0, p1); });
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  if (tiles >= 4 * num_threads() || tiles >= 4 * panels) {
    parallel_ranges(tiles, parallel,
                    [&](int64_t t0, int64_t t1) { run(xt.data(), t0 * kTileN, std::min(N, t1 * kTileN), 0, panels); });
  } else {
    parallel_ranges(panels, parallel,
                    [&](int64_t p0, int64_t p1) { run(xt.data() + p0 * panel_floats, 0, N, p0, p1); });
  }
}

#if HWY_TARGET == HWY_AVX3
// bf16 dot products (AVX512-BF16's vdpbf16ps: per float32 lane, the two
// products of a pair of bf16 added to the accumulator) for the bf16 matmul
// precision, at twice the FMA rate. Highway 1.0 has no target for them, so
// these functions add the feature to the AVX-512 target's own; they run only
// where the CPU has it (HasBf16Dot, core/simd.h's cap).
#define DS_BF16_DOT_ATTR __attribute__((target(HWY_TARGET_STR ",avx512bf16")))

bool HasBf16Dot() { return true; }

// Panel of P (32) rows of x as bf16 pairs: the 32 bits of xp[j * P + m] hold
// x[m][2j] in their low and x[m][2j + 1] in their high half, rounded to the
// nearest bf16 (an odd K's last pair has a zero high half); rows >= `rows`
// are zero. Each row is rounded into `tmp` ([rows][K2] pairs) by
// vcvtne2ps2bf16 (round to nearest even; subnormals become zero, as
// vdpbf16ps would read them anyway), then the pairs are transposed.
DS_BF16_DOT_ATTR void PackPanelBf16(float* HWY_RESTRICT xp, const float* HWY_RESTRICT x, int64_t ldx, int64_t rows,
                                    int64_t K, float* HWY_RESTRICT tmp) {
  const int64_t K2 = (K + 1) / 2, P = PanelRows();
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = x + m * ldx;
    auto* row = reinterpret_cast<uint16_t*>(tmp + m * K2);  // written through vector stores only
    for (int64_t c = 0; c < K; c += 32) {
      const int64_t n = std::min<int64_t>(32, K - c);
      const __mmask16 lo = static_cast<__mmask16>(n >= 16 ? 0xffffu : (1u << n) - 1);
      const __mmask16 hi = static_cast<__mmask16>(n >= 32 ? 0xffffu : n > 16 ? (1u << (n - 16)) - 1 : 0u);
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, xm + c + 16), _mm512_maskz_loadu_ps(lo, xm + c));
      // Up to an even count: an odd K's pad element is the zero loaded above.
      const int64_t store = std::min<int64_t>(32, 2 * K2 - c);
      const __mmask32 keep = store >= 32 ? ~__mmask32{0} : (__mmask32{1} << store) - 1;
      _mm512_mask_storeu_epi16(row + c, keep, (__m512i)v);
    }
  }
  // Transposing 32-bit pairs moves their bits as floats would.
  PackPanel(xp, tmp, K2, rows, K2, P);
}

// tile[n][0, P) = x rows [0, P) . W[n] for n < NR, from a panel of pairs and
// NR bf16 weight rows of K columns (read in place, a 32-bit pair at a time).
// Scaled (block-scaled fp8 widened exactly to bf16): the sums run over each
// block of bc columns (even) and are added into the tile times the block's
// scale, scale[n][block] (scale[n]: row n's scales).
#define DS_DOT_ZERO(n)                         \
  if constexpr (NR > n) {                      \
    c##n##a = _mm512_setzero_ps();             \
    if constexpr (Two) c##n##b = c##n##a;      \
  }
#define DS_DOT_STEP(n)                                                      \
  if constexpr (NR > n) {                                                   \
    uint32_t pair;                                                          \
    std::memcpy(&pair, w + n * K + 2 * j, sizeof pair);                     \
    const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)); \
    c##n##a = _mm512_dpbf16_ps(c##n##a, x0, b);                             \
    if constexpr (Two) c##n##b = _mm512_dpbf16_ps(c##n##b, x1, b);          \
  }
#define DS_DOT_LAST(n)                                                                   \
  if constexpr (NR > n) {                                                                \
    const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[n * K + K - 1])); \
    c##n##a = _mm512_dpbf16_ps(c##n##a, x0, b);                                          \
    if constexpr (Two) c##n##b = _mm512_dpbf16_ps(c##n##b, x1, b);                       \
  }
#define DS_DOT_STORE(n)                                              \
  if constexpr (NR > n) {                                            \
    _mm512_storeu_ps(tile + n * P, c##n##a);                         \
    if constexpr (Two) _mm512_storeu_ps(tile + n * P + 16, c##n##b); \
  }
#define DS_DOT_FOLD(n)                                                                                         \
  if constexpr (NR > n) {                                                                                      \
    const __m512 s = _mm512_set1_ps(scale[n][b0 / bc]);                                                        \
    float* t = tile + n * P;                                                                                   \
    _mm512_storeu_ps(t, b0 ? _mm512_fmadd_ps(c##n##a, s, _mm512_loadu_ps(t)) : _mm512_mul_ps(c##n##a, s));     \
    if constexpr (Two)                                                                                         \
      _mm512_storeu_ps(t + 16,                                                                                 \
                       b0 ? _mm512_fmadd_ps(c##n##b, s, _mm512_loadu_ps(t + 16)) : _mm512_mul_ps(c##n##b, s)); \
  }
#define DS_DOT_ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)

template <int NR, bool Two, bool Scaled>
DS_BF16_DOT_ATTR void TileBf16Dot(float* HWY_RESTRICT tile, const float* HWY_RESTRICT xp,
                                  const uint16_t* HWY_RESTRICT w, int64_t K, const float* const* scale, int64_t bc,
                                  LinePrefetch& pf) {
  static_assert(NR <= 12, "twelve named accumulator rows");
  constexpr int64_t P = 32;
  const int64_t block = Scaled ? bc : K;
  __m512 c0a, c0b, c1a, c1b, c2a, c2b, c3a, c3b, c4a, c4b, c5a, c5b;
  __m512 c6a, c6b, c7a, c7b, c8a, c8b, c9a, c9b, c10a, c10b, c11a, c11b;
  const char* line = pf.next;
  int64_t countdown = FetchCountdown(pf, line);
  for (int64_t b0 = 0; b0 < K; b0 += block) {
    const int64_t b1 = std::min(K, b0 + block);
    DS_DOT_ROWS(DS_DOT_ZERO)
    for (int64_t j = b0 / 2; j < b1 / 2; ++j) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp + j * P);
      const __m512bh x1 = Two ? (__m512bh)_mm512_loadu_si512(xp + j * P + 16) : x0;
      DS_DOT_ROWS(DS_DOT_STEP)
      FetchStep(pf, line, countdown);
    }
    if (b1 % 2) {  // an odd K's last column: its pair's high half is zero in x and in b
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp + b1 / 2 * P);
      const __m512bh x1 = Two ? (__m512bh)_mm512_loadu_si512(xp + b1 / 2 * P + 16) : x0;
      DS_DOT_ROWS(DS_DOT_LAST)
    }
    if constexpr (Scaled) {
      DS_DOT_ROWS(DS_DOT_FOLD)
    } else {
      DS_DOT_ROWS(DS_DOT_STORE)
    }
  }
  pf.next = line;
}
#undef DS_DOT_ZERO
#undef DS_DOT_STEP
#undef DS_DOT_LAST
#undef DS_DOT_STORE
#undef DS_DOT_FOLD
#undef DS_DOT_ROWS

template <int NR, bool Scaled>
DS_BF16_DOT_ATTR void TileBf16DotRows(float* HWY_RESTRICT tile, const float* HWY_RESTRICT xp,
                                      const uint16_t* HWY_RESTRICT w, int64_t K, bool two, const float* const* scale,
                                      int64_t bc, LinePrefetch& pf) {
  if (two)
    TileBf16Dot<NR, true, Scaled>(tile, xp, w, K, scale, bc, pf);
  else
    TileBf16Dot<NR, false, Scaled>(tile, xp, w, K, scale, bc, pf);
}

// Rows [r0, r1) of an e4m3 weight as bf16, without their scales: every e4m3
// value is a bf16 value, so this is exact (the NaN codes read as 480, as in
// LoadE4m3).
void WidenE4m3RowsToBf16(uint16_t* HWY_RESTRICT out, const Fp8Weight& f, int64_t r0, int64_t r1) {
  const DF d;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const VF shift = hn::Set(d, kE4m3Shift);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* q = f.w + r * f.cols;
    uint16_t* o = out + (r - r0) * f.cols;
    int64_t c = 0;
    for (; c + N <= f.cols; c += N) {
      const auto bits = hn::ShiftRight<16>(hn::BitCast(du, hn::Mul(E4m3Bits(d, q + c), shift)));
      hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, bits)), d16, o + c);
    }
    for (; c < f.cols; ++c) o[c] = f32_to_bf16(fp8_table().e4m3[q[c]]);
  }
}

// y (+)= x W^T in bf16 precision over bf16 weights (read in place),
// block-scaled e4m3 weights (widened exactly to bf16 a chunk of rows at a
// time, each block's sums scaled as they are added) or fp4 weights (widened
// with their power-of-two scales, exactly, a chunk at a time): the prefill split and
// tiles of the float32 kernel, with x packed as bf16 pairs and the weight's
// pairs broadcast from memory.
DS_BF16_DOT_ATTR void PrefillBf16Dot(const Product* products, int count, const float* x, int64_t ldx, int64_t M,
                                     bool accumulate) {
  const int64_t K = products[0].w->cols, N = ProductRows(products, count), P = PanelRows(), K2 = (K + 1) / 2,
                panel = K2 * P;
  const int64_t chunk = ChunkRows(K);
  auto pack = [&](float* xt, int64_t p0, int64_t p1) DS_BF16_DOT_ATTR {
    Buffer<float> tmp(static_cast<size_t>(panel));
    for (int64_t p = p0; p < p1; ++p)
      PackPanelBf16(xt + (p - p0) * panel, x + p * P * ldx, ldx, std::min<int64_t>(P, M - p * P), K, tmp.data());
  };
  auto run = [&](const float* xt, int64_t r0, int64_t r1, int64_t p0, int64_t p1) DS_BF16_DOT_ATTR {
    const std::vector<Chunk> chunks = ChunksOf(products, count, r0, r1, chunk);
    const size_t chunk_elems = static_cast<size_t>(std::min(chunk, r1 - r0) * K);
    Buffer<uint16_t> wide;
    Buffer<float> wide32;
    HWY_ALIGN float tile[kTileN * 32];
    const float* scale[kTileN] = {};
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      const auto [i, c0, c1] = chunks[ci];
      const WeightView& w = *products[i].w;
      float* y = products[i].y;
      const int64_t ldy = products[i].ldy;
      const bool fp8 = w.dtype == DType::F8E4M3, fp4 = w.dtype == DType::F4E2M1;
      const Fp8Weight f = fp8 ? Fp8Weight{static_cast<const uint8_t*>(w.data), K, w.scale_inv, w.block_rows,
                                          w.block_cols, (K + w.block_cols - 1) / w.block_cols}
                              : Fp8Weight{};
      const Fp4Weight f4 = fp4 ? Fp4Weight{static_cast<const uint8_t*>(w.data), K, w.scale_e8m0} : Fp4Weight{};
      if ((fp8 || fp4) && wide.size() < chunk_elems) wide.resize(chunk_elems);
      if (fp8) WidenE4m3RowsToBf16(wide.data(), f, c0, c1);
      if (fp4) {  // e2m1 values times powers of two: bf16 holds them exactly
        if (wide32.size() < chunk_elems) wide32.resize(chunk_elems);
        WidenFp4Rows(wide32.data(), f4, c0, c1);
        convert(wide.data(), DType::BF16, wide32.data(), DType::F32, static_cast<size_t>((c1 - c0) * K));
      }
      LinePrefetch pf = NextChunkPrefetch(products, chunks, ci, p1 - p0, K2);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t rows = std::min<int64_t>(P, M - p * P);
        const float* xp = xt + (p - p0) * panel;
        for (int64_t n0 = c0; n0 < c1; n0 += kTileN) {
          const int nr = static_cast<int>(std::min<int64_t>(kTileN, c1 - n0));
          const bool two = rows > P / 2;
          PrefetchTileRows(y + p * P * ldy + n0, ldy, rows, nr);
          if (fp8) {
            for (int n = 0; n < nr; ++n) scale[n] = f.scale_row(n0 + n);
            with_count<kTileN>(nr, [&](auto n) DS_BF16_DOT_ATTR {
              TileBf16DotRows<n(), true>(tile, xp, wide.data() + (n0 - c0) * K, K, two, scale, f.block_cols, pf);
            });
          } else {
            const uint16_t* wn = fp4 ? wide.data() + (n0 - c0) * K : static_cast<const uint16_t*>(w.data) + n0 * K;
            with_count<kTileN>(nr, [&](auto n) DS_BF16_DOT_ATTR {
              TileBf16DotRows<n(), false>(tile, xp, wn, K, two, nullptr, K, pf);
            });
          }
          StoreTile(y + p * P * ldy + n0, ldy, tile, rows, nr, accumulate);
        }
      }
    }
  };
  SplitPrefill(M, N, K, panel, pack, run);
}
#undef DS_BF16_DOT_ATTR
#else
bool HasBf16Dot() { return false; }
#endif  // HWY_TARGET == HWY_AVX3

// y (+)= x W^T for M > kMaxXRows. The weight is widened to f32 a chunk of
// rows at a time (about 256 KiB, L2-sized) into a per-thread buffer that every
// panel of x then reuses: the tile kernel then folds each broadcast into its
// FMA, where reading bf16 in place costs one more vector op per weight. Even
// on AVX2, where the broadcast is a load of its own either way, reading bf16
// pairs in place (one 32-bit broadcast, then a shift or a mask per weight)
// ran 7-17% slower than widening on a Zen 3 (single-thread products of the
// `small` preset's shapes, alternated in one process).
// In bf16 precision x is rounded to bf16 as it is packed (round_x), and the
// dot-product kernel above runs instead where the caller found it usable
// (bf16_dot: bf16, fp4 or block-scaled e4m3 weights on a CPU that has it).
void Prefill(const Product* products, int count, const float* x, int64_t ldx, int64_t M, bool accumulate,
             bool round_x, bool bf16_dot) {
#if HWY_TARGET == HWY_AVX3
  if (bf16_dot) {
    PrefillBf16Dot(products, count, x, ldx, M, accumulate);
    return;
  }
#else
  (void)bf16_dot;
#endif
  const int64_t K = products[0].w->cols, N = ProductRows(products, count), P = PanelRows();
  const int64_t chunk = ChunkRows(K);
  // Panels [p0, p1) of x (packed at xt, panel p0 first) against weight rows
  // [r0, r1) of the products, a chunk of weight rows at a time.
  auto run = [&](const float* xt, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
    Buffer<float> wide(static_cast<size_t>(std::min(chunk, r1 - r0) * K));
    const std::vector<Chunk> chunks = ChunksOf(products, count, r0, r1, chunk);
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      const auto [i, c0, c1] = chunks[ci];
      const Product& product = products[i];
      widen_rows(wide.data(), *product.w, c0, c1);
      LinePrefetch pf = NextChunkPrefetch(products, chunks, ci, p1 - p0, K);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t rows = std::min<int64_t>(P, M - p * P);
        PanelRowsRange(product.y + p * P * product.ldy, product.ldy, xt + (p - p0) * K * P, rows,
                       F32Bcast{wide.data(), K}, K, c0, c1, accumulate, pf);
      }
    }
  };
  auto pack = [&](float* xt, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* panel = xt + (p - p0) * K * P;
      PackPanel(panel, x + p * P * ldx, ldx, std::min<int64_t>(P, M - p * P), K, P);
      if (round_x) round_to_bf16(panel, static_cast<size_t>(K * P));
    }
  };
  SplitPrefill(M, N, K, K * P, pack, run);
}

}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(VectorLanes);
HWY_EXPORT(WidenE4m3Rows);
HWY_EXPORT(WidenFp4Rows);
HWY_EXPORT(GemvFp4);
HWY_EXPORT(GemvBf16);
HWY_EXPORT(GemvFp8);
HWY_EXPORT(GemvFp8ScaledX);
HWY_EXPORT(GemvF32);
HWY_EXPORT(Prefill);
HWY_EXPORT(HasBf16Dot);

namespace {

void check_weight(const WeightView& w) {
  DS_CHECK(w.data != nullptr && w.rows > 0 && w.cols > 0, "linear: empty weight [{}, {}]", w.rows, w.cols);
  if (w.dtype == DType::F4E2M1) {
    DS_CHECK(w.scale_e8m0 != nullptr && w.cols % kFp4Block == 0,
             "linear: fp4 weight [{}, {}] needs its e8m0 scales and a multiple of {} columns", w.rows, w.cols,
             kFp4Block);
    return;
  }
  if (is_block_format(w.dtype)) {
    DS_CHECK(fits_block_format(w.dtype, w.cols), "linear: {} weight [{}, {}] needs a multiple of {} columns",
             dtype_name(w.dtype), w.rows, w.cols, block_values(w.dtype));
    return;
  }
  DS_CHECK(dtype_is_float(w.dtype), "linear: weight dtype {} is not floating", dtype_name(w.dtype));
  const bool fp8 = w.dtype == DType::F8E4M3 || w.dtype == DType::F8E5M2;
  DS_CHECK(!fp8 || (w.scale_inv != nullptr && w.block_rows > 0 && w.block_cols > 0),
           "linear: fp8 weight [{}, {}] needs its block scale_inv", w.rows, w.cols);
}

Fp4Weight fp4_weight(const WeightView& w) {
  return {static_cast<const uint8_t*>(w.data), w.cols, w.scale_e8m0};
}

Fp8Weight fp8_weight(const WeightView& w) {
  return {static_cast<const uint8_t*>(w.data),       w.cols, w.scale_inv, w.block_rows, w.block_cols,
          (w.cols + w.block_cols - 1) / w.block_cols};
}

// The largest |scale| of an e4m3 weight, or infinity if any is not finite
// (or the weight is not block-scaled e4m3).
float max_e4m3_scale(const WeightView& w) {
  if (w.dtype != DType::F8E4M3 || !w.scale_inv) return std::numeric_limits<float>::infinity();
  const int64_t n = ((w.rows + w.block_rows - 1) / w.block_rows) * ((w.cols + w.block_cols - 1) / w.block_cols);
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(w.scale_inv[i]);
    if (!(a <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::infinity();
    m = std::max(m, a);
  }
  return m;
}

// Whether the e4m3 kernels widen w exactly: every scale times 2^120 must be
// finite (scales below 2^8; DeepSeek-V3's are amax / 448 of weights well
// below 1). Otherwise the table path does.
bool e4m3_scales_in_range(const WeightView& w) { return max_e4m3_scale(w) < 0x1p8f; }

// Whether every x times every scale * 2^120 is a finite float, given the
// largest |scale|, so that the scales can be applied to x instead (|x| scale
// below about 2^8; DeepSeek-V3's activations are far below 2^8 / (amax / 448)).
// A NaN in x passes: it gives NaN either way.
bool x_takes_e4m3_scales(const float* x, int64_t M, int64_t ldx, int64_t cols, float max_scale) {
  float mx = 0.0f;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, std::fabs(x[m * ldx + c]));
  return static_cast<double>(mx) * max_scale * 0x1p120 < static_cast<double>(std::numeric_limits<float>::max());
}

}  // namespace

WeightView row_slice(const WeightView& w, int64_t r0, int64_t r1) {
  DS_CHECK(0 <= r0 && r0 < r1 && r1 <= w.rows, "row_slice: rows [{}, {}) of {}", r0, r1, w.rows);
  WeightView v = w;
  v.rows = r1 - r0;
  if (w.dtype == DType::F4E2M1) {
    v.data = fp4_weight(w).row(r0);
    v.scale_e8m0 = fp4_weight(w).scale_row(r0);
    return v;
  }
  if (is_block_format(w.dtype)) {
    v.data = static_cast<const char*>(w.data) + static_cast<size_t>(r0 * block_row_bytes(w.dtype, w.cols));
    return v;
  }
  v.data = static_cast<const char*>(w.data) + static_cast<size_t>(r0 * w.cols) * dtype_size(w.dtype);
  if (w.scale_inv) {
    DS_CHECK(r0 % w.block_rows == 0, "row_slice: row {} is not on a {}-row scale block boundary", r0, w.block_rows);
    v.scale_inv = w.scale_inv + (r0 / w.block_rows) * ((w.cols + w.block_cols - 1) / w.block_cols);
  }
  return v;
}

void widen_rows(float* out, const WeightView& w, int64_t r0, int64_t r1) {
  DS_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.rows, "widen_rows: rows [{}, {}) of {}", r0, r1, w.rows);
  if (w.dtype == DType::F4E2M1) {
    check_weight(w);
    DS_DISPATCH(WidenFp4Rows)(out, fp4_weight(w), r0, r1);
    return;
  }
  if (is_block_format(w.dtype)) {
    check_weight(w);
    detail::widen_block_rows(out, w, r0, r1);
    return;
  }
  if (e4m3_scales_in_range(w)) {
    DS_DISPATCH(WidenE4m3Rows)(out, fp8_weight(w), r0, r1);
    return;
  }
  const size_t es = dtype_size(w.dtype);
  const auto* base = static_cast<const char*>(w.data) + static_cast<size_t>(r0 * w.cols) * es;
  const size_t n = static_cast<size_t>((r1 - r0) * w.cols);
  if (w.dtype == DType::F8E4M3 || w.dtype == DType::F8E5M2) {
    const float* lut = w.dtype == DType::F8E4M3 ? fp8_table().e4m3 : fp8_table().e5m2;
    const auto* q = reinterpret_cast<const uint8_t*>(base);
    for (size_t i = 0; i < n; ++i) out[i] = lut[q[i]];
  } else {
    convert(out, DType::F32, base, w.dtype, n);
  }
  if (w.scale_inv) {
    const int64_t sc = (w.cols + w.block_cols - 1) / w.block_cols;
    for (int64_t r = r0; r < r1; ++r) {
      float* o = out + (r - r0) * w.cols;
      const float* s = w.scale_inv + (r / w.block_rows) * sc;
      for (int64_t b = 0; b < sc; ++b) {  // one scale per run of block_cols columns
        const float f = s[b];
        for (int64_t c = b * w.block_cols; c < std::min(w.cols, (b + 1) * w.block_cols); ++c) o[c] *= f;
      }
    }
  }
}

namespace {
std::atomic<MatmulPrecision> g_precision{MatmulPrecision::kF32};
}  // namespace

void set_matmul_precision(MatmulPrecision p) { g_precision = p; }
MatmulPrecision matmul_precision() { return g_precision; }

MatmulPrecision parse_matmul_precision(std::string_view name) {
  if (name == "f32" || name == "float32") return MatmulPrecision::kF32;
  if (name == "bf16" || name == "bfloat16") return MatmulPrecision::kBf16;
  DS_FAIL("matmul precision '{}' is not one of: f32, bf16", name);
}

std::string_view matmul_precision_name(MatmulPrecision p) { return p == MatmulPrecision::kBf16 ? "bf16" : "f32"; }

bool bf16_dot_products() { return simd_bf16_dot_allowed() && DS_DISPATCH(HasBf16Dot)(); }

namespace {
// Rows of x up to which a product streams the weight (the Gemv kernels);
// more go to the prefill kernels.
constexpr int64_t kGemvRows = 8;

// Float32 weights without scales go to the BLAS.
bool blas_weight(const WeightView& w) { return w.dtype == DType::F32 && !w.scale_inv; }

// Whether a prefill over w runs on bf16 dot products: in bf16 precision, for
// bf16 and fp4 weights and e4m3 ones whose scale blocks are pairs of columns
// wide (128 in DeepSeek-V3), on a CPU that has them.
bool bf16_dot(const WeightView& w, bool bf16_precision) {
  return bf16_precision &&
         (w.dtype == DType::BF16 || w.dtype == DType::F4E2M1 ||
          (w.dtype == DType::F8E4M3 && w.scale_inv && w.block_cols % 2 == 0)) &&
         bf16_dot_products();
}
}  // namespace

void cpu::linear_forward(float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                         bool accumulate) {
  check_weight(w);
  DS_CHECK(M >= 0 && ldx >= w.cols && ldy >= w.rows, "linear: M={} ldx={} ldy={} for weight [{}, {}]", M, ldx, ldy,
           w.rows, w.cols);
  if (M == 0) return;
  if (blas_weight(w) && quantization() == Quantization::kFp8Full) {
    detail::fp8_linear_forward(y, x, static_cast<const float*>(w.data), M, w.rows, w.cols, ldx, ldy, accumulate);
    return;
  }
  if (blas_weight(w)) {
    gemm(false, true, M, w.rows, w.cols, 1.0f, x, ldx, static_cast<const float*>(w.data), w.cols,
         accumulate ? 1.0f : 0.0f, y, ldy);
    return;
  }
  const bool bf16_precision = matmul_precision() == MatmulPrecision::kBf16;
  Buffer<float> rounded;
  if (bf16_precision && M <= kGemvRows) {
    // Decode-sized products stream the weight, whatever the precision: x is
    // rounded to bf16 into a copy and the float32 kernels multiply it.
    rounded = Buffer<float>(static_cast<size_t>(M * w.cols));
    for (int64_t m = 0; m < M; ++m) std::memcpy(rounded.data() + m * w.cols, x + m * ldx, w.cols * sizeof(float));
    round_to_bf16(rounded.data(), rounded.size());
    x = rounded.data();
    ldx = w.cols;
  }
  if (M <= kGemvRows) {
    // e4m3 widens in registers when its scale blocks are whole vectors (128
    // columns in DeepSeek-V3); other layouts and dtypes widen row by row.
    // One pass over the scales serves both checks.
    const float max_scale = max_e4m3_scale(w);
    const int64_t lanes = static_cast<int64_t>(DS_DISPATCH(VectorLanes)());
    const bool fp8_kernel = max_scale < 0x1p8f && w.block_cols % lanes == 0;
    const bool scale_x = fp8_kernel && x_takes_e4m3_scales(x, M, ldx, w.cols, max_scale);
    // Rows of W split evenly over the threads; a weight too small to repay
    // waking them runs on the calling thread.
    // fp4 in registers when a pair of vectors of elements fits in a scale
    // block (up to 512-bit vectors).
    const bool fp4_kernel = w.dtype == DType::F4E2M1 && kFp4Block % (2 * lanes) == 0;
    parallel_ranges(w.rows, w.rows * w.cols >= (int64_t{1} << 16), [&](int64_t r0, int64_t r1) {
      if (is_block_format(w.dtype)) {
        detail::gemv_blocks(y, ldy, x, ldx, M, w, r0, r1, accumulate);
      } else if (fp4_kernel) {
        DS_DISPATCH(GemvFp4)(y, ldy, x, ldx, M, fp4_weight(w), r0, r1, accumulate);
      } else if (w.dtype == DType::BF16) {
        DS_DISPATCH(GemvBf16)(y, ldy, x, ldx, M, static_cast<const uint16_t*>(w.data), w.cols, r0, r1, accumulate);
      } else if (scale_x) {
        DS_DISPATCH(GemvFp8ScaledX)(y, ldy, x, ldx, M, fp8_weight(w), r0, r1, accumulate);
      } else if (fp8_kernel) {
        DS_DISPATCH(GemvFp8)(y, ldy, x, ldx, M, fp8_weight(w), r0, r1, accumulate);
      } else {
        Buffer<float> row(static_cast<size_t>(w.cols));
        for (int64_t r = r0; r < r1; ++r) {
          widen_rows(row.data(), w, r, r + 1);
          DS_DISPATCH(GemvF32)(y + r, ldy, x, ldx, M, row.data(), 1, w.cols, accumulate);
        }
      }
    });
    return;
  }
  const Product product{y, ldy, &w};
  DS_DISPATCH(Prefill)(&product, 1, x, ldx, M, accumulate, bf16_precision, bf16_dot(w, bf16_precision));
}

void linear_forward_pair(float* y0, const WeightView& w0, float* y1, const WeightView& w1, const float* x,
                         int64_t M) {
  check_weight(w0);
  check_weight(w1);
  DS_CHECK(w0.cols == w1.cols, "linear pair: weights [{}, {}] and [{}, {}] differ in columns", w0.rows, w0.cols,
           w1.rows, w1.cols);
  if (blas_weight(w0) && blas_weight(w1) && gemm_dtype() == GemmDtype::kBf16 && M > kGemvRows &&
      quantization() == Quantization::kNone) {
    // Training in bf16: x is rounded once for both products.
    const PreparedOperand xp(x, M * w0.cols);
    gemm(false, true, M, w0.rows, w0.cols, 1.0f, xp.operand(), w0.cols, static_cast<const float*>(w0.data), w0.cols,
         0.0f, y0, w0.rows);
    gemm(false, true, M, w1.rows, w1.cols, 1.0f, xp.operand(), w1.cols, static_cast<const float*>(w1.data), w1.cols,
         0.0f, y1, w1.rows);
    return;
  }
  const bool bf16_precision = matmul_precision() == MatmulPrecision::kBf16;
  const bool dot = bf16_dot(w0, bf16_precision);
  if (M <= kGemvRows || blas_weight(w0) || w1.dtype != w0.dtype || bf16_dot(w1, bf16_precision) != dot) {
    linear_forward(y0, x, w0, M);
    linear_forward(y1, x, w1, M);
    return;
  }
  const Product products[2] = {{y0, w0.rows, &w0}, {y1, w1.rows, &w1}};
  DS_DISPATCH(Prefill)(products, 2, x, w0.cols, M, false, bf16_precision, dot);
}

void linear_backward(float* dx, float* dw, const float* dy, const float* x, const WeightView& w, int64_t M,
                     int64_t ldx, int64_t ldy, bool accumulate_dx) {
  check_weight(w);
  DS_CHECK(w.dtype == DType::F32 && !w.scale_inv, "linear backward needs float32 weights, got {}",
           dtype_name(w.dtype));
  DS_CHECK(M >= 0 && ldx >= w.cols && ldy >= w.rows, "linear backward: M={} ldx={} ldy={} for weight [{}, {}]", M,
           ldx, ldy, w.rows, w.cols);
  if (M == 0) return;
  const float* W = static_cast<const float*>(w.data);
  if (quantization() == Quantization::kFp8Full) {
    detail::fp8_linear_backward(dx, dw, dy, x, W, M, w.rows, w.cols, ldx, ldy, accumulate_dx);
    return;
  }
  // In bf16 dy is rounded once for both products (a plain pointer otherwise).
  const PreparedOperand dyp(dy, dx && dw && gemm_dtype() == GemmDtype::kBf16 ? (M - 1) * ldy + w.rows : 0);
  const GemmOperand& dyo = dyp.operand();
  if (dx) gemm(false, false, M, w.cols, w.rows, 1.0f, dyo, ldy, W, w.cols, accumulate_dx ? 1.0f : 0.0f, dx, ldx);
  if (dw) gemm(true, false, w.rows, w.cols, M, 1.0f, dyo, ldy, x, ldx, 1.0f, dw, w.cols);
}

void quantize_fp8_blocks(uint8_t* q, float* scale_inv, const float* w, int64_t rows, int64_t cols, int64_t block_rows,
                         int64_t block_cols) {
  DS_CHECK(rows > 0 && cols > 0 && block_rows > 0 && block_cols > 0, "quantize_fp8_blocks: [{}, {}] blocks {}x{}", rows,
           cols, block_rows, block_cols);
  const int64_t br = (rows + block_rows - 1) / block_rows, bc = (cols + block_cols - 1) / block_cols;
  for (int64_t i = 0; i < br; ++i)
    for (int64_t j = 0; j < bc; ++j) {
      const int64_t r0 = i * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = j * block_cols, c1 = std::min(cols, c0 + block_cols);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      scale_inv[i * bc + j] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = f32_to_e4m3(w[r * cols + c] / s);
    }
}

}  // namespace ds::ops
#endif  // HWY_ONCE
