#include "ops/linear.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/matmul.h"

namespace ds::ops {

namespace {

void check_weight(const WeightView& w) {
  DS_CHECK(w.data != nullptr && w.rows > 0 && w.cols > 0, "linear: empty weight [{}, {}]", w.rows, w.cols);
  DS_CHECK(dtype_is_float(w.dtype), "linear: weight dtype {} is not floating", dtype_name(w.dtype));
  const bool fp8 = w.dtype == DType::F8E4M3 || w.dtype == DType::F8E5M2;
  DS_CHECK(!fp8 || (w.scale_inv != nullptr && w.block_rows > 0 && w.block_cols > 0),
           "linear: fp8 weight [{}, {}] needs its block scale_inv", w.rows, w.cols);
}

// Rows widened per gemm call: enough columns of output for an efficient
// product, small enough that the float32 block stays in L2 for typical widths.
constexpr int64_t kRowBlock = 64;

// fp8 has 256 codes: decode through a table instead of per-element bit work.
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

// Decode-sized products (a few rows of x) are bound by reading the weight
// once. Widening it into a buffer and calling sgemm would write and read it
// again as float32, so these rows are multiplied straight from the stored
// dtype: bf16 widens in registers (a 16-bit shift), other dtypes widen one
// weight row into a small (L1-resident) buffer.
constexpr int64_t kGemvMaxRows = 8;
constexpr int kLanes = 16;

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Calls f(std::integral_constant<int, n>{}) for a run-time n in [1, Max], so
// kernels can take a row count as a template argument.
template <int Max, typename F>
inline __attribute__((always_inline)) void with_count(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// y[m] = sum_c x[m][c] * w(c) for M rows of x; w read once. Lane-wise partial
// sums in a fixed order, so results do not depend on threads.
template <int M, typename Load>
inline __attribute__((always_inline)) void dot_rows(float* out, const float* const* x, Load w, int64_t cols) {
  float lane[M][kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float wv = w(c + l);
      for (int m = 0; m < M; ++m) lane[m][l] += x[m][c + l] * wv;
    }
  for (int m = 0; m < M; ++m) {
    float tail = 0;
    for (int64_t t = c; t < cols; ++t) tail += x[m][t] * w(t);
    float sum = 0;
    for (int l = 0; l < kLanes; ++l) sum += lane[m][l];
    out[m] = sum + tail;
  }
}

template <int M>
inline __attribute__((always_inline)) void gemv_bf16_impl(float* y, int64_t ldy, const float* x, int64_t ldx,
                                                          const uint16_t* w, int64_t cols, int64_t r0, int64_t r1,
                                                          bool accumulate) {
  const float* xs[M];
  for (int m = 0; m < M; ++m) xs[m] = x + m * ldx;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* wr = w + r * cols;
    float out[M];
    dot_rows<M>(
        out, xs, [wr](int64_t c) { return bf16_bits_to_f32(wr[c]); }, cols);
    for (int m = 0; m < M; ++m) y[m * ldy + r] = accumulate ? y[m * ldy + r] + out[m] : out[m];
  }
}

template <int M>
inline __attribute__((always_inline)) void gemv_f32_impl(float* y, int64_t ldy, const float* x, int64_t ldx,
                                                         const float* wr, int64_t cols, int64_t r, bool accumulate) {
  const float* xs[M];
  for (int m = 0; m < M; ++m) xs[m] = x + m * ldx;
  float out[M];
  dot_rows<M>(
      out, xs, [wr](int64_t c) { return wr[c]; }, cols);
  for (int m = 0; m < M; ++m) y[m * ldy + r] = accumulate ? y[m * ldy + r] + out[m] : out[m];
}

// AVX-512 (F, plus BW and VL for the masked 16-bit tail loads): 16 columns
// per step, R weight rows at a time so each x load feeds R FMAs. GCC's own
// vectorisation of the portable kernel keeps 256-bit vectors and shuffles the
// row pointers through general registers, about half this speed.
// GCC 12 warns inside its own headers that _mm512_undefined's value may be
// used uninitialised (a known false positive of the masked intrinsics).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define DS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

DS_AVX512 inline __m512 widen_bf16x16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Horizontal sums of 16 vectors in one tree of shuffles and adds (45
// instructions instead of 16 separate reductions of 8): lane 4t + u of the
// result is the sum of the lanes of a[4u + t]. Each sum is added in the same
// order as _mm512_reduce_add_ps (halves, quarters, then pairs).
DS_AVX512 inline __attribute__((always_inline)) __m512 reduce16(const __m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)  // lanes 0-7: a[2j] folded in half, 8-15: a[2j+1]
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xee));
  for (int j = 0; j < 4; ++j)  // 128-bit lane t: a[4j + t] folded to 4
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xdd));
  for (int j = 0; j < 2; ++j)  // then to 2 (elements 0+2 and 1+3)
    d[j] =
        _mm512_add_ps(_mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0x44), _mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0xee));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
}

// Weight sources for the decode kernel: Rows<R>(r) widens 16 columns of rows
// r..r+R-1 at a time into float32 registers. Columns come in blocks of
// block_cols() that share a scale (the whole row when there is none);
// start_block(c0) is called where each block starts.
struct Bf16Weight {
  const uint16_t* w;
  int64_t cols;
  template <int R>
  struct Rows {
    const uint16_t* w;
    int64_t cols, r;
    int64_t block_cols() const { return cols; }
    void start_block(int64_t) {}
    DS_AVX512 __m512 load(int i, int64_t c) const {
      return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r + i) * cols + c)));
    }
    DS_AVX512 __m512 load_tail(int i, int64_t c, __mmask16 m) const {
      return widen_bf16x16(_mm256_maskz_loadu_epi16(m, w + (r + i) * cols + c));
    }
    // The same columns of the next block of rows, one cache line at a time.
    static constexpr int64_t kColumnsPerLine = 32;
    DS_AVX512 __attribute__((always_inline)) void prefetch_next(int i, int64_t c) const {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R + i) * cols + c), _MM_HINT_T0);
    }
  };
  template <int R>
  Rows<R> rows(int64_t r) const {
    return {w, cols, r};
  }
};

// fp8 e4m3 with block scales (DeepSeek-V3 checkpoints). A byte sign-extended
// to 32 bits and shifted left by 20 has the sign in bit 31 (and copies of it
// in 28-30, masked off) and exponent and mantissa in bits 20-26: as float32
// that is the e4m3 value times 2^-120, exact for subnormals too, so
// multiplying by 2^120 and then by the block's scale gives the same float32
// weight widen_rows does. (The one exception is e4m3's NaN code, 0x7f/0xff,
// which reads as 480 here; quantized checkpoints do not contain it.)
struct Fp8Weight {
  const uint8_t* w;
  int64_t cols;
  const float* scale_inv;
  int64_t block_rows, block_cols, scale_cols;
  template <int R>
  struct Rows {
    const uint8_t* w;
    int64_t cols, r, bc;
    const float* srow[R];
    __m512 scale[R];
    int64_t block_cols() const { return bc; }
    DS_AVX512 void start_block(int64_t c0) {
      for (int i = 0; i < R; ++i) scale[i] = _mm512_set1_ps(srow[i][c0 / bc]);
    }
    DS_AVX512 __m512 widen(__m128i bytes, int i) const {
      const __m512i v = _mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20),
                                         _mm512_set1_epi32(static_cast<int32_t>(0x87f00000u)));
      return _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(v), _mm512_set1_ps(0x1p120f)), scale[i]);
    }
    DS_AVX512 __m512 load(int i, int64_t c) const {
      return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (r + i) * cols + c)), i);
    }
    DS_AVX512 __m512 load_tail(int i, int64_t c, __mmask16 m) const {
      return widen(_mm_maskz_loadu_epi8(m, w + (r + i) * cols + c), i);
    }
    static constexpr int64_t kColumnsPerLine = 64;
    DS_AVX512 __attribute__((always_inline)) void prefetch_next(int i, int64_t c) const {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R + i) * cols + c), _MM_HINT_T0);
    }
  };
  template <int R>
  Rows<R> rows(int64_t r) const {
    Rows<R> s{w, cols, r, block_cols, {}, {}};
    for (int i = 0; i < R; ++i) s.srow[i] = scale_inv + ((r + i) / block_rows) * scale_cols;
    return s;
  }
};

// Rows [r, r + R) of W against M rows of x (M, R <= 4): 16 columns per step,
// each x load feeding R FMAs and each widened weight vector M.
template <int M, int R, typename Weight>
DS_AVX512 inline __attribute__((always_inline)) void gemv_avx512_block(float* y, int64_t ldy, const float* x,
                                                                       int64_t ldx, const Weight& wt, int64_t cols,
                                                                       int64_t r, bool accumulate) {
  auto src = wt.template rows<R>(r);
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  const int64_t B = src.block_cols();
  for (int64_t c0 = 0; c0 < cols; c0 += B) {
    src.start_block(c0);
    const int64_t c1 = std::min(cols, c0 + B);
    auto step = [&](int64_t c) DS_AVX512 {
      __m512 wv[R];
      for (int i = 0; i < R; ++i) wv[i] = src.load(i, c);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * ldx + c);
        for (int i = 0; i < R; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
      }
    };
    // One cache line of each weight row per iteration, with a prefetch of
    // the same line of the next block's rows.
    constexpr int64_t kLine = decltype(src)::kColumnsPerLine;
    int64_t c = c0;
    for (; c + kLine <= c1; c += kLine) {
      for (int i = 0; i < R; ++i) src.prefetch_next(i, c);
      for (int64_t s = 0; s < kLine; s += 16) step(c + s);
    }
    for (; c + 16 <= c1; c += 16) step(c);
    if (c < c1) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (c1 - c)) - 1u);
      __m512 wv[R];
      for (int i = 0; i < R; ++i) wv[i] = src.load_tail(i, c, tail);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + c);
        for (int i = 0; i < R; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
      }
    }
  }
  __m512 in[16];
  for (int q = 0; q < 16; ++q) in[q] = _mm512_setzero_ps();
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) in[4 * i + m] = acc[i][m];  // -> lane 4m + i
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(in));
  const __mmask8 rows = static_cast<__mmask8>((1u << R) - 1u);
  for (int m = 0; m < M; ++m) {
    float* out = y + m * ldy + r;
    __m128 v = _mm_load_ps(sums + 4 * m);
    if (accumulate) v = _mm_add_ps(v, _mm_maskz_loadu_ps(rows, out));
    _mm_mask_storeu_ps(out, rows, v);
  }
}

// Rows [r, r1) of W against M (<= 4) rows of x.
template <int M, typename Weight>
DS_AVX512 inline __attribute__((always_inline)) void gemv_avx512_m(float* y, int64_t ldy, const float* x, int64_t ldx,
                                                                   const Weight& wt, int64_t cols, int64_t r,
                                                                   int64_t r1, bool accumulate) {
  for (; r + 4 <= r1; r += 4) gemv_avx512_block<M, 4>(y, ldy, x, ldx, wt, cols, r, accumulate);
  if (r < r1)
    with_count<3>(r1 - r,
                  [&](auto n) DS_AVX512 { gemv_avx512_block<M, n()>(y, ldy, x, ldx, wt, cols, r, accumulate); });
}

// M (<= 8) rows of x: four weight rows at a time (a few KiB, still in L1 for
// the second pass), against up to four rows of x per pass.
template <int M, typename Weight>
DS_AVX512 void gemv_avx512_impl(float* y, int64_t ldy, const float* x, int64_t ldx, const Weight& wt, int64_t cols,
                                int64_t r0, int64_t r1, bool accumulate) {
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t e = std::min(r1, r + 4);
    gemv_avx512_m<(M < 4 ? M : 4)>(y, ldy, x, ldx, wt, cols, r, e, accumulate);
    if constexpr (M > 4) gemv_avx512_m<M - 4>(y + 4 * ldy, ldy, x + 4 * ldx, ldx, wt, cols, r, e, accumulate);
  }
}

// Calls KERNEL<M>(args...) for the run-time row count M in [1, kGemvMaxRows].
#define DS_FOR_ROWS(M, KERNEL, ...)  \
  switch (M) {                       \
    case 1:                          \
      return KERNEL<1>(__VA_ARGS__); \
    case 2:                          \
      return KERNEL<2>(__VA_ARGS__); \
    case 3:                          \
      return KERNEL<3>(__VA_ARGS__); \
    case 4:                          \
      return KERNEL<4>(__VA_ARGS__); \
    case 5:                          \
      return KERNEL<5>(__VA_ARGS__); \
    case 6:                          \
      return KERNEL<6>(__VA_ARGS__); \
    case 7:                          \
      return KERNEL<7>(__VA_ARGS__); \
    default:                         \
      return KERNEL<8>(__VA_ARGS__); \
  }

template <typename Weight>
DS_AVX512 void gemv_avx512(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const Weight& wt,
                           int64_t cols, int64_t r0, int64_t r1, bool accumulate) {
  DS_FOR_ROWS(M, gemv_avx512_impl, y, ldy, x, ldx, wt, cols, r0, r1, accumulate)
}

// Prefill-sized products (M > kGemvMaxRows) in outer-product form: lanes run
// along rows of x, so x is packed transposed, 32 rows per panel
// (xt[k][0..31], zero-padded), and each weight element is broadcast straight
// from bf16 (see bcast_tile). No horizontal sums and no float32 copy of the
// weight; each output is one fused multiply-add chain over k in order, so
// the result does not depend on the thread count or on how rows are split.
constexpr int kPanel = 32;  // rows of x per panel (two vectors)
constexpr int kTileN = 12;  // weight rows per tile: 24 accumulators

// r[i][j] <- r[j][i] for a 16 x 16 block of floats.
DS_AVX512 inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // interleave 32-bit pairs of rows i, i+1
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // Then 64-bit pairs: r[4g + c], lane L, holds column 4L + c of rows
  // 4g..4g+3.
  for (int g = 0; g < 16; g += 4)
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[g + h]), b = _mm512_castps_pd(t[g + h + 2]);
      r[g + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[g + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  // Last, a 4 x 4 transpose of the 128-bit lanes of r[c], r[4 + c],
  // r[8 + c], r[12 + c] for each c.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// xt[k][j] = x[j][k] for j < rows (<= kPanel), zero for rows <= j < kPanel.
DS_AVX512 void pack_panel(float* xt, const float* x, int64_t ldx, int64_t rows, int64_t K) {
  for (int64_t j0 = 0; j0 < kPanel; j0 += 16)
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int64_t kn = std::min<int64_t>(16, K - k0);
      const __mmask16 ks = static_cast<__mmask16>((1u << kn) - 1u);
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j0 + j < rows ? _mm512_maskz_loadu_ps(ks, x + (j0 + j) * ldx + k0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t k = 0; k < kn; ++k) _mm512_storeu_ps(xt + (k0 + k) * kPanel + j0, r[k]);
    }
}

template <int NR, int MV>
DS_AVX512 inline __attribute__((always_inline)) void bcast_tile(float* tile, const float* xt, const float* w,
                                                                int64_t K) {
  // Weights already widened (row-major, stride K): a broadcast memory
  // operand of the FMA.
  __m512 acc[NR][MV];
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xt + k * kPanel + 16 * v);
    for (int n = 0; n < NR; ++n) {
      const __m512 b = _mm512_set1_ps(w[n * K + k]);
      for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_fmadd_ps(xv[v], b, acc[n][v]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(tile + n * kPanel + 16 * v, acc[n][v]);
}

template <int NR, int MV>
DS_AVX512 inline __attribute__((always_inline)) void bcast_tile(float* tile, const float* xt, const uint16_t* w,
                                                                int64_t K) {
  __m512 acc[NR][MV];
  // A bf16 value is the high half of a float32. Column 0 is read alone;
  // every later column k is the high half of the 32-bit pair that starts at
  // k - 1, so a broadcast of that pair masked with 0xffff0000 (one vpandd
  // with a memory operand) is element k as float32, and nothing outside the
  // row is read.
  for (int n = 0; n < NR; ++n) {
    const __m512 b = _mm512_set1_ps(bf16_bits_to_f32(w[n * K]));
    for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_mul_ps(_mm512_loadu_ps(xt + 16 * v), b);
  }
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t k = 1; k < K; ++k) {
    __m512 xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xt + k * kPanel + 16 * v);
    for (int n = 0; n < NR; ++n) {
      int32_t pair;
      std::memcpy(&pair, w + n * K + k - 1, sizeof pair);
      const __m512 b = _mm512_castsi512_ps(_mm512_and_si512(_mm512_set1_epi32(pair), hi_mask));
      for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_fmadd_ps(xv[v], b, acc[n][v]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(tile + n * kPanel + 16 * v, acc[n][v]);
}

// Weight rows [r0, r1) (bf16, or float32 already widened) against one panel
// of `rows` (<= 32) rows of x.
template <int MV, typename T>
DS_AVX512 void bcast_rows(float* y, int64_t ldy, const float* xt, int64_t rows, const T* w, int64_t K, int64_t r0,
                          int64_t r1, bool accumulate) {
  alignas(64) float tile[kTileN * kPanel];
  for (int64_t n0 = r0; n0 < r1; n0 += kTileN) {
    const int nr = static_cast<int>(std::min<int64_t>(kTileN, r1 - n0));
    const T* wn = w + n0 * K;
    with_count<kTileN>(nr, [&](auto n) DS_AVX512 { bcast_tile<n(), MV>(tile, xt, wn, K); });
    // The tile holds y transposed: turn each 16 x 16 block back.
    const __mmask16 cols = static_cast<__mmask16>((1u << nr) - 1u);
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
      __m512 r[16];
      for (int n = 0; n < 16; ++n) r[n] = n < nr ? _mm512_load_ps(tile + n * kPanel + m0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t m = m0; m < std::min<int64_t>(rows, m0 + 16); ++m) {
        float* ym = y + m * ldy + n0;
        __m512 v = r[m - m0];
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(cols, ym));
        _mm512_mask_storeu_ps(ym, cols, v);
      }
    }
  }
}

// Weight rows per chunk: a chunk stays in cache while every panel of x passes
// over it.
constexpr int64_t kChunkN = 8 * kTileN;

// Panels per group when the threads split the rows of x: 128 rows, packed
// into a per-thread buffer that stays in L2.
constexpr int64_t kGroupPanels = 4;

// Widens rows [r0, r1) of an e4m3 weight with block scales to float32
// (the values widen_rows gives), 16 columns per instruction sequence.
DS_AVX512 void widen_fp8_rows(float* out, const Fp8Weight& f, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    auto src = f.rows<1>(r);
    float* o = out + (r - r0) * f.cols;
    for (int64_t c0 = 0; c0 < f.cols; c0 += f.block_cols) {
      src.start_block(c0);
      const int64_t c1 = std::min(f.cols, c0 + f.block_cols);
      int64_t c = c0;
      for (; c + 16 <= c1; c += 16) _mm512_storeu_ps(o + c, src.load(0, c));
      if (c < c1) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (c1 - c)) - 1u);
        _mm512_mask_storeu_ps(o + c, tail, src.load_tail(0, c, tail));
      }
    }
  }
}

// bf16 weights are read in place; e4m3 weights (fp8 non-null) are widened a
// chunk of rows at a time into a per-thread buffer that every panel of x
// then reuses, small enough (about 256 KiB) to stay in L2.
void linear_avx512(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint16_t* w,
                   const Fp8Weight* fp8, int64_t N, int64_t K, bool accumulate) {
  const int64_t panels = (M + kPanel - 1) / kPanel;
  const int64_t chunk =
      fp8 ? std::clamp<int64_t>((int64_t{1} << 18) / (4 * K) / kTileN * kTileN, kTileN, kChunkN) : kChunkN;
  // Panels [p0, p1) of x (packed at xt, panel p0 first) against weight rows
  // [r0, r1), a chunk of weight rows at a time.
  auto run = [&](const float* xt, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
    Buffer<float> wide(fp8 ? static_cast<size_t>(chunk * K) : 0);
    for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
      const int64_t c1 = std::min(r1, c0 + chunk);
      if (fp8) widen_fp8_rows(wide.data(), *fp8, c0, c1);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t rows = std::min<int64_t>(kPanel, M - p * kPanel);
        const float* panel = xt + (p - p0) * K * kPanel;
        float* yp = y + p * kPanel * ldy;
        if (fp8 && rows > 16)
          bcast_rows<2>(yp + c0, ldy, panel, rows, wide.data(), K, 0, c1 - c0, accumulate);
        else if (fp8)
          bcast_rows<1>(yp + c0, ldy, panel, rows, wide.data(), K, 0, c1 - c0, accumulate);
        else if (rows > 16)
          bcast_rows<2>(yp, ldy, panel, rows, w, K, c0, c1, accumulate);
        else
          bcast_rows<1>(yp, ldy, panel, rows, w, K, c0, c1, accumulate);
      }
    }
  };
  auto pack = [&](float* xt, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      pack_panel(xt + (p - p0) * K * kPanel, x + p * kPanel * ldx, ldx, std::min<int64_t>(kPanel, M - p * kPanel), K);
  };
  const bool parallel = M * N * K >= (int64_t{1} << 16);
  const int64_t groups = (panels + kGroupPanels - 1) / kGroupPanels;
  if (groups >= 2 * num_threads()) {
    // Many rows of x: each thread packs and multiplies its own groups of
    // panels against the whole weight. Packing all of x up front instead
    // would write it out to memory and read it back.
    parallel_ranges(groups, parallel, [&](int64_t g0, int64_t g1) {
      Buffer<float> xt(static_cast<size_t>(kGroupPanels * K * kPanel));
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = g * kGroupPanels, p1 = std::min(panels, p0 + kGroupPanels);
        pack(xt.data(), p0, p1);
        run(xt.data(), 0, N, p0, p1);
      }
    });
    return;
  }
  // Few rows of x: pack them once; the threads split the weight rows in whole
  // tiles (each reads only its share of the weight) when there are enough,
  // else the panels.
  Buffer<float> xt(static_cast<size_t>(panels * K * kPanel));
  parallel_ranges(panels, M * K >= (int64_t{1} << 15),
                  [&](int64_t p0, int64_t p1) { pack(xt.data() + p0 * K * kPanel, p0, p1); });
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  if (tiles >= 4 * num_threads() || tiles >= 4 * panels) {
    parallel_ranges(tiles, parallel,
                    [&](int64_t t0, int64_t t1) { run(xt.data(), t0 * kTileN, std::min(N, t1 * kTileN), 0, panels); });
  } else {
    parallel_ranges(panels, parallel, [&](int64_t p0, int64_t p1) { run(xt.data() + p0 * K * kPanel, 0, N, p0, p1); });
  }
}

#pragma GCC diagnostic pop

// DEEPSEEK_DISABLE_AVX512=1 forces the portable kernel (the tests run both).
bool have_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && !std::getenv("DEEPSEEK_DISABLE_AVX512");
  return yes;
}

#define DS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

DS_CLONES void gemv_bf16_portable(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint16_t* w,
                                  int64_t cols, int64_t r0, int64_t r1, bool accumulate) {
  DS_FOR_ROWS(M, gemv_bf16_impl, y, ldy, x, ldx, w, cols, r0, r1, accumulate)
}

void gemv_bf16(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t cols,
               int64_t r0, int64_t r1, bool accumulate) {
  if (have_avx512bw()) {
    gemv_avx512(y, ldy, x, ldx, M, Bf16Weight{w, cols}, cols, r0, r1, accumulate);
  } else {
    gemv_bf16_portable(y, ldy, x, ldx, M, w, cols, r0, r1, accumulate);
  }
}

// One already widened weight row r.
DS_CLONES void gemv_f32_row(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const float* wr,
                            int64_t cols, int64_t r,
                            bool accumulate){DS_FOR_ROWS(M, gemv_f32_impl, y, ldy, x, ldx, wr, cols, r, accumulate)}

Fp8Weight fp8_weight(const WeightView& w) {
  return {static_cast<const uint8_t*>(w.data),       w.cols, w.scale_inv, w.block_rows, w.block_cols,
          (w.cols + w.block_cols - 1) / w.block_cols};
}

}  // namespace

WeightView row_slice(const WeightView& w, int64_t r0, int64_t r1) {
  DS_CHECK(0 <= r0 && r0 < r1 && r1 <= w.rows, "row_slice: rows [{}, {}) of {}", r0, r1, w.rows);
  WeightView v = w;
  v.data = static_cast<const char*>(w.data) + static_cast<size_t>(r0 * w.cols) * dtype_size(w.dtype);
  v.rows = r1 - r0;
  if (w.scale_inv) {
    DS_CHECK(r0 % w.block_rows == 0, "row_slice: row {} is not on a {}-row scale block boundary", r0, w.block_rows);
    v.scale_inv = w.scale_inv + (r0 / w.block_rows) * ((w.cols + w.block_cols - 1) / w.block_cols);
  }
  return v;
}

void widen_rows(float* out, const WeightView& w, int64_t r0, int64_t r1) {
  DS_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.rows, "widen_rows: rows [{}, {}) of {}", r0, r1, w.rows);
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

void linear_forward(float* y, const float* x, const WeightView& w, int64_t M, int64_t ldx, int64_t ldy,
                    bool accumulate) {
  check_weight(w);
  DS_CHECK(M >= 0 && ldx >= w.cols && ldy >= w.rows, "linear: M={} ldx={} ldy={} for weight [{}, {}]", M, ldx, ldy,
           w.rows, w.cols);
  if (M == 0) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  if (w.dtype == DType::F32 && !w.scale_inv) {
    gemm(false, true, M, w.rows, w.cols, 1.0f, x, ldx, static_cast<const float*>(w.data), w.cols, beta, y, ldy);
    return;
  }
  // e4m3 with scale blocks a whole number of 16-column steps wide (128 in
  // DeepSeek-V3) widens in registers too; other fp8 layouts widen rows with
  // the table.
  const bool fp8_kernel = w.dtype == DType::F8E4M3 && w.scale_inv && w.block_cols % 16 == 0 && have_avx512bw();
  if (M <= kGemvMaxRows) {
    // Rows of W split evenly over the threads; a weight too small to repay
    // waking them runs on the calling thread.
    parallel_ranges(w.rows, w.rows * w.cols >= (int64_t{1} << 16), [&](int64_t r0, int64_t r1) {
      if (w.dtype == DType::BF16) {
        gemv_bf16(y, ldy, x, ldx, M, static_cast<const uint16_t*>(w.data), w.cols, r0, r1, accumulate);
      } else if (fp8_kernel) {
        gemv_avx512(y, ldy, x, ldx, M, fp8_weight(w), w.cols, r0, r1, accumulate);
      } else {
        Buffer<float> row(static_cast<size_t>(w.cols));
        for (int64_t r = r0; r < r1; ++r) {
          widen_rows(row.data(), w, r, r + 1);
          gemv_f32_row(y, ldy, x, ldx, M, row.data(), w.cols, r, accumulate);
        }
      }
    });
    return;
  }
  if (w.dtype == DType::BF16 && have_avx512bw()) {
    linear_avx512(y, ldy, x, ldx, M, static_cast<const uint16_t*>(w.data), nullptr, w.rows, w.cols, accumulate);
    return;
  }
  if (fp8_kernel) {
    const Fp8Weight f = fp8_weight(w);
    linear_avx512(y, ldy, x, ldx, M, nullptr, &f, w.rows, w.cols, accumulate);
    return;
  }
  // Each thread widens its own blocks of output rows and multiplies them
  // single-threaded; the blocks are independent, so no reduction is involved.
  const int64_t nblocks = (w.rows + kRowBlock - 1) / kRowBlock;
#pragma omp parallel if (!omp_in_parallel())
  {
    Buffer<float> buf(static_cast<size_t>(kRowBlock * w.cols));
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t r0 = b * kRowBlock, r1 = std::min(w.rows, r0 + kRowBlock);
      widen_rows(buf.data(), w, r0, r1);
      gemm(false, true, M, r1 - r0, w.cols, 1.0f, x, ldx, buf.data(), w.cols, beta, y + r0, ldy);
    }
  }
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
