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

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

namespace {

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// N int8 codes at p as float32.
HWY_INLINE VF LoadI8(DF d, const uint8_t* HWY_RESTRICT p) {
  const hn::Rebind<int8_t, DF> d8;
  const hn::RebindToSigned<DF> di;
  return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p))));
}

// N bytes at p as int32 lanes (their nibbles are q4_k's codes).
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> LoadU8(DF, const uint8_t* HWY_RESTRICT p) {
  const hn::Rebind<uint8_t, DF> d8;
  const hn::RebindToSigned<DF> di;
  return hn::PromoteTo(di, hn::LoadU(d8, p));
}

// q4_k's scales of one block: a[j] = d sc_j and b[j] = dmin m_j.
void Q4KScales(const uint8_t* blk, float* a, float* b) {
  const float d = half_at(blk), dmin = half_at(blk + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    q4_k_scale_min(blk + 4, j, &sc, &m);
    a[j] = d * static_cast<float>(sc);
    b[j] = dmin * static_cast<float>(m);
  }
}

// y[m][r] (+)= the lane sum of acc<m> (less off[m], when given) for m < M.
// The accumulators are named arguments, not an array (SVE vectors cannot be
// array elements).
template <int M>
HWY_INLINE void Store(float* HWY_RESTRICT y, int64_t ldy, int64_t r, DF d, VF acc0, VF acc1, VF acc2, VF acc3,
                      const float* off, bool accumulate) {
  auto put = [&](int m, VF acc) HWY_ATTR {
    const float v = hn::GetLane(hn::SumOfLanes(d, acc)) - (off ? off[m] : 0.0f);
    float* out = y + m * ldy + r;
    *out = accumulate ? *out + v : v;
  };
  put(0, acc0);
  if constexpr (M > 1) put(1, acc1);
  if constexpr (M > 2) put(2, acc2);
  if constexpr (M > 3) put(3, acc3);
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
  const hn::RebindToSigned<DF> di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ4_KValues * kQ4_KBytes;
  const auto mask = hn::Set(di, 0xF);
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
          const auto bytes = LoadU8(d, q + l);
          const VF lo = hn::ConvertTo(d, hn::And(bytes, mask)), hi = hn::ConvertTo(d, hn::ShiftRight<4>(bytes));
          hn::StoreU(hn::MulSub(lo, a0, b0), d, o + c + 64 * k + l);
          hn::StoreU(hn::MulSub(hi, a1, b1), d, o + c + 64 * k + 32 + l);
        }
      }
    }
  }
}

void WidenQ4_1Rows(float* HWY_RESTRICT out, const uint8_t* HWY_RESTRICT w, int64_t cols, int64_t r0, int64_t r1) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ4_1Values * kQ4_1Bytes;
  const auto mask = hn::Set(di, 0xF);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* blk = w + r * row_bytes;
    float* o = out + (r - r0) * cols;
    for (int64_t c = 0; c < cols; c += kQ4_1Values, blk += kQ4_1Bytes) {
      const VF a = hn::Set(d, half_at(blk)), m = hn::Set(d, half_at(blk + 2));
      for (int64_t l = 0; l < 16; l += N) {
        const auto bytes = LoadU8(d, blk + 4 + l);
        hn::StoreU(hn::MulAdd(hn::ConvertTo(d, hn::And(bytes, mask)), a, m), d, o + c + l);
        hn::StoreU(hn::MulAdd(hn::ConvertTo(d, hn::ShiftRight<4>(bytes)), a, m), d, o + c + 16 + l);
      }
    }
  }
}

// Rows [r0, r1) of a q4_1 weight against M (<= 4) rows of x, whose block
// sums are xs [M][cols / 32].
template <int M>
void GemvQ4_1Pass(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT x, int64_t ldx,
                  const float* HWY_RESTRICT xs, const uint8_t* w, int64_t cols, int64_t r0, int64_t r1,
                  bool accumulate) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ4_1Values * kQ4_1Bytes;
  const int64_t S = cols / kQ4_1Values;
  const auto mask = hn::Set(di, 0xF);
  for (int64_t r = r0; r < r1; ++r) {
    VF acc0 = hn::Zero(d), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    float off[4] = {0, 0, 0, 0};  // minus the offsets' share
    const uint8_t* blk = w + r * row_bytes;
    for (int64_t c = 0, s = 0; c < cols; c += kQ4_1Values, blk += kQ4_1Bytes, ++s) {
      const float m = half_at(blk + 2);
      for (int k = 0; k < M; ++k) off[k] -= m * xs[k * S + s];
      const VF a = hn::Set(d, half_at(blk));
      for (int64_t l = 0; l < 16; l += N) {
        const auto bytes = LoadU8(d, blk + 4 + l);
        const VF lo = hn::Mul(hn::ConvertTo(d, hn::And(bytes, mask)), a);
        const VF hi = hn::Mul(hn::ConvertTo(d, hn::ShiftRight<4>(bytes)), a);
        acc0 = hn::MulAdd(lo, hn::LoadU(d, x + c + l), acc0);
        acc0 = hn::MulAdd(hi, hn::LoadU(d, x + c + 16 + l), acc0);
        if constexpr (M > 1) {
          acc1 = hn::MulAdd(lo, hn::LoadU(d, x + ldx + c + l), acc1);
          acc1 = hn::MulAdd(hi, hn::LoadU(d, x + ldx + c + 16 + l), acc1);
        }
        if constexpr (M > 2) {
          acc2 = hn::MulAdd(lo, hn::LoadU(d, x + 2 * ldx + c + l), acc2);
          acc2 = hn::MulAdd(hi, hn::LoadU(d, x + 2 * ldx + c + 16 + l), acc2);
        }
        if constexpr (M > 3) {
          acc3 = hn::MulAdd(lo, hn::LoadU(d, x + 3 * ldx + c + l), acc3);
          acc3 = hn::MulAdd(hi, hn::LoadU(d, x + 3 * ldx + c + 16 + l), acc3);
        }
      }
    }
    Store<M>(y, ldy, r, d, acc0, acc1, acc2, acc3, off, accumulate);
  }
}

// Rows [r0, r1) of a q8_0 weight against M (<= 4) rows of x.
template <int M>
void GemvQ8_0Pass(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT x, int64_t ldx, const uint8_t* w,
                  int64_t cols, int64_t r0, int64_t r1, bool accumulate) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ8_0Values * kQ8_0Bytes;
  for (int64_t r = r0; r < r1; ++r) {
    VF acc0 = hn::Zero(d), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const uint8_t* blk = w + r * row_bytes;
    for (int64_t c = 0; c < cols; c += kQ8_0Values, blk += kQ8_0Bytes) {
      const VF s = hn::Set(d, half_at(blk));
      for (int64_t i = 0; i < kQ8_0Values; i += N) {
        const VF wv = hn::Mul(LoadI8(d, blk + 2 + i), s);
        acc0 = hn::MulAdd(wv, hn::LoadU(d, x + c + i), acc0);
        if constexpr (M > 1) acc1 = hn::MulAdd(wv, hn::LoadU(d, x + ldx + c + i), acc1);
        if constexpr (M > 2) acc2 = hn::MulAdd(wv, hn::LoadU(d, x + 2 * ldx + c + i), acc2);
        if constexpr (M > 3) acc3 = hn::MulAdd(wv, hn::LoadU(d, x + 3 * ldx + c + i), acc3);
      }
    }
    Store<M>(y, ldy, r, d, acc0, acc1, acc2, acc3, nullptr, accumulate);
  }
}

// Rows [r0, r1) of a q4_k weight against M (<= 4) rows of x, whose
// sub-block sums are xs [M][cols / 32].
template <int M>
void GemvQ4KPass(float* HWY_RESTRICT y, int64_t ldy, const float* HWY_RESTRICT x, int64_t ldx,
                 const float* HWY_RESTRICT xs, const uint8_t* w, int64_t cols, int64_t r0, int64_t r1,
                 bool accumulate) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), row_bytes = cols / kQ4_KValues * kQ4_KBytes;
  const int64_t S = cols / kQ4_KSubBlock;
  const auto mask = hn::Set(di, 0xF);
  for (int64_t r = r0; r < r1; ++r) {
    VF acc0 = hn::Zero(d), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    float off[4] = {0, 0, 0, 0};
    const uint8_t* blk = w + r * row_bytes;
    for (int64_t c = 0; c < cols; c += kQ4_KValues, blk += kQ4_KBytes) {
      float a[8], b[8];
      Q4KScales(blk, a, b);
      const int64_t sub = c / kQ4_KSubBlock;
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 8; ++j) off[m] += b[j] * xs[m * S + sub + j];
      for (int k = 0; k < 4; ++k) {
        const uint8_t* q = blk + 16 + 32 * k;
        const VF a0 = hn::Set(d, a[2 * k]), a1 = hn::Set(d, a[2 * k + 1]);
        const int64_t c0 = c + 64 * k, c1 = c0 + 32;
        for (int64_t l = 0; l < 32; l += N) {
          const auto bytes = LoadU8(d, q + l);
          const VF lo = hn::Mul(hn::ConvertTo(d, hn::And(bytes, mask)), a0);
          const VF hi = hn::Mul(hn::ConvertTo(d, hn::ShiftRight<4>(bytes)), a1);
          acc0 = hn::MulAdd(lo, hn::LoadU(d, x + c0 + l), acc0);
          acc0 = hn::MulAdd(hi, hn::LoadU(d, x + c1 + l), acc0);
          if constexpr (M > 1) {
            acc1 = hn::MulAdd(lo, hn::LoadU(d, x + ldx + c0 + l), acc1);
            acc1 = hn::MulAdd(hi, hn::LoadU(d, x + ldx + c1 + l), acc1);
          }
          if constexpr (M > 2) {
            acc2 = hn::MulAdd(lo, hn::LoadU(d, x + 2 * ldx + c0 + l), acc2);
            acc2 = hn::MulAdd(hi, hn::LoadU(d, x + 2 * ldx + c1 + l), acc2);
          }
          if constexpr (M > 3) {
            acc3 = hn::MulAdd(lo, hn::LoadU(d, x + 3 * ldx + c0 + l), acc3);
            acc3 = hn::MulAdd(hi, hn::LoadU(d, x + 3 * ldx + c1 + l), acc3);
          }
        }
      }
    }
    Store<M>(y, ldy, r, d, acc0, acc1, acc2, acc3, off, accumulate);
  }
}

void GemvBlocks(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint8_t* w, DType t, int64_t cols,
                int64_t r0, int64_t r1, bool accumulate) {
  Buffer<float> xs;
  if (t != DType::Q8_0) {  // each row of x's sums over (sub-)blocks of 32
    const int64_t S = cols / kQ4_KSubBlock;
    xs.resize(static_cast<size_t>(M * S));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t s = 0; s < S; ++s) {
        float v = 0;
        for (int64_t i = 0; i < kQ4_KSubBlock; ++i) v += x[m * ldx + s * kQ4_KSubBlock + i];
        xs[static_cast<size_t>(m * S + s)] = v;
      }
  }
  for (int64_t m = 0; m < M; m += 4) {
    const int64_t mm = std::min<int64_t>(4, M - m);
    float* ym = y + m * ldy;
    const float* xm = x + m * ldx;
    const float* xsm = xs.data() + (t != DType::Q8_0 ? m * (cols / kQ4_KSubBlock) : 0);
    if (t == DType::Q8_0) {
      if (mm == 1) GemvQ8_0Pass<1>(ym, ldy, xm, ldx, w, cols, r0, r1, accumulate);
      if (mm == 2) GemvQ8_0Pass<2>(ym, ldy, xm, ldx, w, cols, r0, r1, accumulate);
      if (mm == 3) GemvQ8_0Pass<3>(ym, ldy, xm, ldx, w, cols, r0, r1, accumulate);
      if (mm == 4) GemvQ8_0Pass<4>(ym, ldy, xm, ldx, w, cols, r0, r1, accumulate);
    } else if (t == DType::Q4_1) {
      if (mm == 1) GemvQ4_1Pass<1>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
      if (mm == 2) GemvQ4_1Pass<2>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
      if (mm == 3) GemvQ4_1Pass<3>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
      if (mm == 4) GemvQ4_1Pass<4>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
    } else {
      if (mm == 1) GemvQ4KPass<1>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
      if (mm == 2) GemvQ4KPass<2>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
      if (mm == 3) GemvQ4KPass<3>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
      if (mm == 4) GemvQ4KPass<4>(ym, ldy, xm, ldx, xsm, w, cols, r0, r1, accumulate);
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
