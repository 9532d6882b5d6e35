#include "ops/linear.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
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

// Rows [r, r + R) of W against the M rows of x.
template <int M, int R>
DS_AVX512 inline __attribute__((always_inline)) void gemv_bf16_avx512_rows(float* y, int64_t ldy, const float* x,
                                                                           int64_t ldx, const uint16_t* w, int64_t cols,
                                                                           int64_t r, bool accumulate) {
  const int64_t full = cols / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (cols - full)) - 1u);
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; c += 16) {
    __m512 wv[R];
    for (int i = 0; i < R; ++i)
      wv[i] = widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r + i) * cols + c)));
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + c);
      for (int i = 0; i < R; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
    }
  }
  if (tail) {
    __m512 wv[R];
    for (int i = 0; i < R; ++i) wv[i] = widen_bf16x16(_mm256_maskz_loadu_epi16(tail, w + (r + i) * cols + full));
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + full);
      for (int i = 0; i < R; ++i) acc[i][m] = _mm512_fmadd_ps(xv, wv[i], acc[i][m]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) {
      const float v = _mm512_reduce_add_ps(acc[i][m]);
      float& out = y[m * ldy + r + i];
      out = accumulate ? out + v : v;
    }
}

template <int M>
DS_AVX512 void gemv_bf16_avx512_impl(float* y, int64_t ldy, const float* x, int64_t ldx, const uint16_t* w,
                                     int64_t cols, int64_t r0, int64_t r1, bool accumulate) {
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) gemv_bf16_avx512_rows<M, 2>(y, ldy, x, ldx, w, cols, r, accumulate);
  if (r < r1) gemv_bf16_avx512_rows<M, 1>(y, ldy, x, ldx, w, cols, r, accumulate);
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

DS_AVX512 void gemv_bf16_avx512(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const uint16_t* w,
                                int64_t cols, int64_t r0, int64_t r1, bool accumulate) {
  DS_FOR_ROWS(M, gemv_bf16_avx512_impl, y, ldy, x, ldx, w, cols, r0, r1, accumulate)
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
    gemv_bf16_avx512(y, ldy, x, ldx, M, w, cols, r0, r1, accumulate);
  } else {
    gemv_bf16_portable(y, ldy, x, ldx, M, w, cols, r0, r1, accumulate);
  }
}

// One already widened weight row r.
DS_CLONES void gemv_f32_row(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, const float* wr,
                            int64_t cols, int64_t r, bool accumulate) {
  DS_FOR_ROWS(M, gemv_f32_impl, y, ldy, x, ldx, wr, cols, r, accumulate)
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
      for (int64_t c = 0; c < w.cols; ++c) o[c] *= s[c / w.block_cols];
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
  if (M <= kGemvMaxRows) {
    // Rows of W split evenly over the threads; a weight too small to repay
    // waking them runs on the calling thread.
    parallel_ranges(w.rows, w.rows * w.cols >= (int64_t{1} << 16), [&](int64_t r0, int64_t r1) {
      if (w.dtype == DType::BF16) {
        gemv_bf16(y, ldy, x, ldx, M, static_cast<const uint16_t*>(w.data), w.cols, r0, r1, accumulate);
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
