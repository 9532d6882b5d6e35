// Block-quantized weights in the linear layers (ops/cpu/linear_blocks.h).
//
// Decode streams the packed rows: each block's f16 scale (q8_0, q4_1), or
// its sub-blocks' scales d sc and offsets dmin m (q4_k), scale the widened
// codes in registers, which feed one FMA per row of x. Offsets do not
// depend on the code: per row of x the sums of each sub-block of x are taken
// once, and each weight row subtracts its offsets times them. Activations
// stay float32 (llama.cpp instead rounds them to 8 bits per block and
// multiplies integers); a 1 GB model's decode is bound by reading the
// weights, and the float path costs about 0.3 instructions a weight.
// Prefill widens chunks of rows to float32 (widen_block_rows) for the
// outer-product kernel, as for every other narrow dtype.
//
// Each output is one fixed sequence of operations whatever the threads do.
#include "ops/cpu/linear_blocks.h"

#include <algorithm>
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

HWY_INLINE float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_bits_to_f32(h);
}

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

// q4_k's scales of one block: a[j] = d sc_j and b[j] = dmin m_j, the
// 6-bit fields unpacked without branches (io/gguf_quants.h's q4_k_scale_min layout).
HWY_INLINE void Q4KScales(const uint8_t* HWY_RESTRICT blk, float* HWY_RESTRICT a, float* HWY_RESTRICT b) {
  const float d = half_at(blk), dmin = half_at(blk + 2);
  const uint8_t* s = blk + 4;
  for (int j = 0; j < 4; ++j) {
    a[j] = d * static_cast<float>(s[j] & 63);
    b[j] = dmin * static_cast<float>(s[j + 4] & 63);
    a[j + 4] = d * static_cast<float>((s[j + 8] & 0xF) | ((s[j] >> 6) << 4));
    b[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
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

// One row of x against R (<= 4) consecutive q4_k rows from r: the rows'
// codes widened and scaled per sub-block, each x vector loaded once for all
// of them, two accumulators a row (the low and the high nibbles); each row's
// offsets against the sub-block sums xs of x. The decode step's kernel (a
// sub-block's scale is one broadcast per row, where DotBlock's generic
// source pays the addressing of every vector).
#define DS_Q4K_ROW(i)                                                                          \
  if constexpr (R > i) {                                                                       \
    const auto bytes = LoadU8(d, q##i + l);                                                    \
    lo##i = hn::MulAdd(hn::Mul(hn::ConvertTo(d, hn::And(bytes, mask)), sa##i), xl, lo##i);     \
    hi##i = hn::MulAdd(hn::Mul(hn::ConvertTo(d, hn::ShiftRight<4>(bytes)), sb##i), xh, hi##i); \
  }
constexpr int64_t kQ4KPrefetchBytes = 8192;

// A block's eight scales a = d sc (Q4KScales) and the row's offset share:
// its mins b = dmin m against xs8, x's sums over the block's sub-blocks.
HWY_INLINE float Q4KBlock(const uint8_t* HWY_RESTRICT blk, const float* HWY_RESTRICT xs8, float* HWY_RESTRICT a) {
  float b[8];
  Q4KScales(blk, a, b);
  float off = 0;
  for (int j = 0; j < 8; ++j) off += b[j] * xs8[j];
  return off;
}

template <int R>
void Q4KOneX(float* HWY_RESTRICT y, const float* HWY_RESTRICT x, const float* HWY_RESTRICT xs, const uint8_t* w,
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
                int64_t r0, int64_t r1, bool accumulate) {
  const BlockRows base{w, block_row_bytes(t, cols)};
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
  if (t == DType::Q4_K && M == 1) {  // decode
    for (int64_t r = r0; r < r1; r += 4)
      with_count<4>(std::min<int64_t>(4, r1 - r),
                    [&](auto n) HWY_ATTR { Q4KOneX<n()>(y, x, xs.data(), w, base.row_bytes, cols, r, accumulate); });
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
  if (!DS_DISPATCH(BlockVectors)()) {
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
  if (!DS_DISPATCH(BlockVectors)()) {  // vectors longer than a block: widen a row at a time
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
  DS_DISPATCH(GemvBlocks)(y, ldy, x, ldx, M, static_cast<const uint8_t*>(w.data), w.dtype, w.cols, r0, r1, accumulate);
}

}  // namespace ds::ops::detail
#endif  // HWY_ONCE
