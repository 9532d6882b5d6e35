#include "ops/linear.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
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

}  // namespace

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
  // Each thread widens its own blocks of output rows and multiplies them
  // single-threaded; the blocks are independent, so no reduction is involved.
  const int64_t nblocks = (w.rows + kRowBlock - 1) / kRowBlock;
#pragma omp parallel
  {
    std::vector<float> buf(static_cast<size_t>(kRowBlock * w.cols));
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
  DS_CHECK(rows > 0 && cols > 0 && block_rows > 0 && block_cols > 0, "quantize_fp8_blocks: [{}, {}] blocks {}x{}",
           rows, cols, block_rows, block_cols);
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
