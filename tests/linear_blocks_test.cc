// Linear layers over q8_0, q4_k and q4_1 weights (ops/linear.h with
// ops/block_quant.h's formats): decode-sized and prefill-sized products
// against a float64 product over the dequantized weight (the plain loops of
// dequantize_blocks), q4_k's and q8_0's decode (x rounded to 8 bits a block
// of 256 or 32, integer products) against their scalar twins and within the
// bound the rounding allows, q6_k's decode kernel on every SIMD target
// against the plain integer loop it replaced, widen_rows and row_slice
// against the same, the same bits for any thread count, and weights whose
// rows are not whole blocks refused.
#include "ops/cpu/linear_blocks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "io/gguf_quants.h"
#include "ops/block_quant.h"
#include "ops/linear.h"
#include "test_util.h"

using ds::DType;

namespace {
namespace linear_blocks_test {

struct Quantized {
  std::vector<uint8_t> bytes;
  std::vector<float> wide;  // the plain loops' dequantized values
  ds::ops::WeightView view;
};

Quantized make(DType t, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (auto& v : w) v = nd(g) + (g() % 13 == 0 ? 0.1f : 0.0f);
  Quantized q;
  q.bytes.resize(static_cast<size_t>(rows * ds::ops::block_row_bytes(t, cols)));
  ds::ops::quantize_rows(t, w.data(), rows, cols, q.bytes.data());
  q.wide.resize(w.size());
  ds::ops::dequantize_blocks(t, q.bytes.data(), rows * cols, q.wide.data());
  q.view = {q.bytes.data(), t, rows, cols};
  return q;
}

std::vector<float> input(int64_t M, int64_t cols, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(M * cols));
  for (auto& v : x) v = nd(g);
  return x;
}

// How the decode kernels round a block of n values of x to 8 bits: the
// step dx = amax / 127 and the multiplier 127 / amax (0 for a block of
// zeros), in float32 arithmetic; a value becomes nearest(x * inv).
struct XRounding {
  float dx, inv;
};
XRounding x_rounding(const float* xb, int n) {
  float amax = 0;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xb[i]));
  return {amax / 127.0f, amax > 0 ? 127.0f / amax : 0.0f};
}

// The one-row q4_k product as the decode kernel defines it, in float64 over
// exact integers: x rounded per block of 256 to q = nearest(x * 127 / amax)
// with dx = amax / 127 (float32 arithmetic, as the kernel), then per block
// dx d sum_j sc_j (q . codes_j) - dmin sum_j m_j (sum of x over sub-block j).
// `bound` gets how far that may be from x . w: each x is moved by at most
// dx / 2, times |d sc_j code|, summed.
double q4k_decode_twin(const float* x, const uint8_t* row, int64_t cols, double* bound) {
  double y = 0;
  *bound = 0;
  for (int64_t k = 0; k < cols / 256; ++k, row += 144) {
    const float* xb = x + k * 256;
    const auto [dx, inv] = x_rounding(xb, 256);
    const double d = ds::f16_bits_to_f32(static_cast<uint16_t>(row[0] | row[1] << 8));
    const double dmin = ds::f16_bits_to_f32(static_cast<uint16_t>(row[2] | row[3] << 8));
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      ds::io::gguf::q4_k_scale_min(row + 4, j, &sc, &m);
      int64_t dot = 0;
      double xsum = 0, wsum = 0;
      for (int i = 0; i < 32; ++i) {
        const int c = j * 32 + i;
        const uint8_t byte = row[16 + (j / 2) * 32 + i];
        const int code = (j & 1) ? byte >> 4 : byte & 0xF;
        dot += static_cast<int64_t>(std::nearbyint(xb[c] * inv)) * code;
        xsum += xb[c];
        wsum += code;
      }
      y += double(dx) * d * sc * double(dot) - dmin * m * xsum;
      *bound += 0.5 * double(dx) * d * sc * wsum;
    }
  }
  return y;
}

// The same for q8_0 (llama.cpp's q8_0 x q8_0): x rounded per block of 32,
// then per block dx d (q . codes).
double q8_0_decode_twin(const float* x, const uint8_t* row, int64_t cols, double* bound) {
  double y = 0;
  *bound = 0;
  for (int64_t k = 0; k < cols / 32; ++k, row += 34) {
    const float* xb = x + k * 32;
    const auto [dx, inv] = x_rounding(xb, 32);
    const double d = ds::f16_bits_to_f32(static_cast<uint16_t>(row[0] | row[1] << 8));
    int64_t dot = 0, wsum = 0;
    for (int i = 0; i < 32; ++i) {
      const int code = static_cast<int8_t>(row[2 + i]);
      dot += static_cast<int64_t>(std::nearbyint(xb[i] * inv)) * code;
      wsum += std::abs(code);
    }
    y += double(dx) * d * double(dot);
    *bound += 0.5 * double(dx) * std::fabs(d) * double(wsum);
  }
  return y;
}

// The same for q6_k (llama.cpp's q8_K x q6_K): x rounded per block of 256,
// then per block dx d sum_j sc_j ((q - 32) . q_x) over its groups of 16,
// the codes read as ggml's dequantize_row_q6_K reads them.
double q6k_decode_twin(const float* x, const uint8_t* row, int64_t cols, double* bound) {
  double y = 0;
  *bound = 0;
  for (int64_t k = 0; k < cols / 256; ++k, row += 210) {
    const float* xb = x + k * 256;
    const auto [dx, inv] = x_rounding(xb, 256);
    const double d = ds::f16_bits_to_f32(static_cast<uint16_t>(row[208] | row[209] << 8));
    int64_t dot = 0, wsum = 0;
    for (int v = 0; v < 256; ++v) {
      const int h = v / 128, c = (v % 128) / 32, l = v % 32;
      const uint8_t lo = row[64 * h + 32 * (c & 1) + l], hb = row[128 + 32 * h + l];
      const int q = ((c < 2 ? lo : lo >> 4) & 0xF) | ((hb >> (2 * c)) & 3) << 4;
      const int w = static_cast<int8_t>(row[192 + v / 16]) * (q - 32);
      dot += static_cast<int64_t>(std::nearbyint(xb[v] * inv)) * w;
      wsum += std::abs(w);
    }
    y += double(dx) * d * double(dot);
    *bound += 0.5 * double(dx) * std::fabs(d) * double(wsum);
  }
  return y;
}

// The decode kernels' product on 8-bit x (QuantizedX::kInt8) for q4_k, q8_0
// and q6_k; q4_1 keeps x as it is.
bool rounds_x(DType t, int64_t M) {
  return t != DType::Q4_1 && M <= 8 && ds::ops::quantized_x() == ds::ops::QuantizedX::kInt8;
}
double decode_twin(DType t, const float* x, const uint8_t* row, int64_t cols, double* bound) {
  return t == DType::Q4_K   ? q4k_decode_twin(x, row, cols, bound)
         : t == DType::Q6_K ? q6k_decode_twin(x, row, cols, bound)
                            : q8_0_decode_twin(x, row, cols, bound);
}

// One row of q6_k against x as the decode kernel's plain loop summed it:
// x rounded per block of 256 (float32 arithmetic, nearest-even), the block's
// integer sum sc_j (q - 32) q_x exact in 32 bits, scaled once by a fused
// multiply-add into a float32 total.
float q6k_int8_plain(const float* x, const uint8_t* row, int64_t cols) {
  float acc = 0;
  for (int64_t k = 0; k < cols / 256; ++k, row += 210) {
    const float* xb = x + k * 256;
    const auto [dx, inv] = x_rounding(xb, 256);
    int32_t sum = 0;
    for (int v = 0; v < 256; ++v) {
      const int h = v / 128, c = (v % 128) / 32, l = v % 32;
      const uint8_t lo = row[64 * h + 32 * (c & 1) + l], hb = row[128 + 32 * h + l];
      const int q = ((c < 2 ? lo : lo >> 4) & 0xF) | ((hb >> (2 * c)) & 3) << 4;
      sum += static_cast<int8_t>(row[192 + v / 16]) * (q - 32) * static_cast<int32_t>(std::nearbyint(xb[v] * inv));
    }
    acc = std::fma(static_cast<float>(sum), dx * ds::f16_bits_to_f32(static_cast<uint16_t>(row[208] | row[209] << 8)),
                   acc);
  }
  return acc;
}

// The q6_k decode kernel on 8-bit x against that plain loop on every target:
// NEON, SVE and the scalar fallback give its bits; AVX2 and AVX-512 add each
// block's integer sums in eight float lanes, within float32 rounding of it.
TEST(LinearBlocksQ6K, DecodeIsThePlainIntegerLoopOnEveryTarget) {
  const int64_t rows = 11, cols = 768;
  const Quantized q = make(DType::Q6_K, rows, cols, 9);
  const int64_t row_bytes = ds::ops::block_row_bytes(DType::Q6_K, cols);
  for (int64_t M : {1, 3}) {
    auto x = input(M, cols, 20 + static_cast<uint64_t>(M));
    std::fill(x.begin() + 256, x.begin() + 512, 0.0f);  // a block of zeros (dx = 0)
    std::vector<float> want(static_cast<size_t>(M * rows)), mag(want.size());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        want[m * rows + r] = q6k_int8_plain(x.data() + m * cols, q.bytes.data() + r * row_bytes, cols);
        for (int64_t c = 0; c < cols; ++c) mag[m * rows + r] += std::fabs(x[m * cols + c] * q.wide[r * cols + c]);
      }
    ds::test::for_each_simd_target([&](const char* target) {
      const bool generic = std::string(target).rfind("AVX", 0) != 0;
      for (bool accumulate : {false, true}) {
        std::vector<float> y(want.size(), 0.5f);
        ds::ops::detail::gemv_q6_k_int8(y.data(), rows, x.data(), cols, M, q.view, 0, rows, accumulate);
        for (size_t i = 0; i < y.size(); ++i) {
          const float w = accumulate ? 0.5f + want[i] : want[i];
          if (generic)
            ASSERT_EQ(y[i], w) << "M " << M << " at " << i;
          else
            ASSERT_NEAR(y[i], w, 1e-6 * mag[i] + 1e-6) << "M " << M << " at " << i;
        }
      }
    });
  }
}

class LinearBlocksTest : public ::testing::TestWithParam<DType> {};
class LinearBlocksDecode : public ::testing::TestWithParam<DType> {};

TEST_P(LinearBlocksDecode, RoundsXToEightBitsABlock) {
  const DType t = GetParam();
  // q8_0: an odd count of blocks, so the AVX-512 kernel's lone last block runs.
  const int64_t rows = 13, cols = t == DType::Q8_0 ? 1056 : 1024, block = t == DType::Q8_0 ? 32 : 256;
  const Quantized q = make(t, rows, cols, 8);
  const int64_t row_bytes = ds::ops::block_row_bytes(t, cols);
  for (uint64_t seed : {1, 2, 3}) {
    auto x = input(1, cols, seed);
    x[5] = 0;  // a block of zeros (dx = 0) too
    if (seed == 3) std::fill(x.begin(), x.begin() + block, 0.0f);
    std::vector<float> y(static_cast<size_t>(rows));
    ds::ops::linear_forward(y.data(), x.data(), q.view, 1);
    double worst = 0, used = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double bound, exact = 0, mag = 0;
      const double twin = decode_twin(t, x.data(), q.bytes.data() + r * row_bytes, cols, &bound);
      for (int64_t c = 0; c < cols; ++c) {
        exact += double(x[c]) * q.wide[r * cols + c];
        mag += std::fabs(double(x[c]) * q.wide[r * cols + c]);
      }
      // The kernel is the twin up to float32 sums; the twin is x . w up to the rounding of x.
      ASSERT_NEAR(y[r], twin, 2e-6 * mag + 1e-6) << "row " << r << " exact " << exact;
      ASSERT_LE(std::fabs(twin - exact), bound + 1e-9) << "row " << r;
      worst = std::max(worst, std::fabs(twin - exact) / mag);
      used = std::max(used, std::fabs(twin - exact) / bound);
    }
    // The rounding is there (a kernel on float32 x would miss the twin) and
    // of the size 8 bits give.
    EXPECT_GT(worst, 1e-5);
    EXPECT_LT(worst, 1e-2);
    EXPECT_GT(used, 0.01);
  }
}

TEST_P(LinearBlocksTest, ProductsMatchTheDequantizedWeight) {
  const DType t = GetParam();
  const int64_t rows = 37, cols = 512;
  const Quantized q = make(t, rows, cols, 5);
  for (const auto qx : {ds::ops::QuantizedX::kInt8, ds::ops::QuantizedX::kF32}) {
    ds::ops::set_quantized_x(qx);
    for (int64_t M : {1, 2, 3, 4, 5, 8, 9, 40}) {
      const auto x = input(M, cols, 10 + static_cast<uint64_t>(M));
      std::vector<float> y(static_cast<size_t>(M * rows), 7.0f);
      ds::ops::linear_forward(y.data(), x.data(), q.view, M);
      // Decode-sized products on 8-bit x by default (RoundsXToEightBitsABlock).
      const bool twin = rounds_x(t, M);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) {
          double want = 0, mag = 0, bound;
          for (int64_t c = 0; c < cols; ++c) {
            want += double(x[m * cols + c]) * q.wide[r * cols + c];
            mag += std::fabs(double(x[m * cols + c]) * q.wide[r * cols + c]);
          }
          if (twin)
            want = decode_twin(t, &x[m * cols], q.bytes.data() + r * ds::ops::block_row_bytes(t, cols), cols, &bound);
          ASSERT_NEAR(y[m * rows + r], want, 2e-6 * mag + 1e-7) << ds::dtype_name(t) << " M " << M << " row " << r;
        }
      // accumulate adds to what is there.
      std::vector<float> acc(static_cast<size_t>(M * rows), 1.0f);
      ds::ops::linear_forward(acc.data(), x.data(), q.view, M, cols, rows, /*accumulate=*/true);
      for (size_t i = 0; i < acc.size(); ++i) ASSERT_NEAR(acc[i], y[i] + 1.0f, 1e-5f * (1 + std::fabs(y[i])));
    }
  }
  ds::ops::set_quantized_x(ds::ops::QuantizedX::kInt8);
}

TEST_P(LinearBlocksTest, WidenRowsAndRowSlices) {
  const DType t = GetParam();
  const int64_t rows = 9, cols = 768;
  const Quantized q = make(t, rows, cols, 6);
  std::vector<float> wide(static_cast<size_t>(rows * cols));
  ds::ops::widen_rows(wide.data(), q.view, 0, rows);
  for (size_t i = 0; i < wide.size(); ++i)  // one rounding apart at most (a fused multiply-subtract)
    ASSERT_NEAR(wide[i], q.wide[i], 1e-6f * (std::fabs(q.wide[i]) + 1e-3f)) << i;
  const auto s = ds::ops::row_slice(q.view, 4, 7);
  std::vector<float> part(static_cast<size_t>(3 * cols));
  ds::ops::widen_rows(part.data(), s, 0, 3);
  for (int64_t i = 0; i < 3 * cols; ++i)
    ASSERT_EQ(part[static_cast<size_t>(i)], wide[static_cast<size_t>(4 * cols + i)]);
}

TEST_P(LinearBlocksTest, TheSameBitsForAnyThreadCount) {
  const DType t = GetParam();
  const int64_t rows = 300, cols = 1024;
  const Quantized q = make(t, rows, cols, 7);
  for (int64_t M : {1, 3, 20}) {
    const auto x = input(M, cols, 3);
    std::vector<std::vector<float>> ys;
    for (int threads : {1, 2, 3}) {
      ds::set_num_threads(threads);
      std::vector<float> y(static_cast<size_t>(M * rows));
      ds::ops::linear_forward(y.data(), x.data(), q.view, M);
      ys.push_back(y);
    }
    ds::set_num_threads(2);
    EXPECT_EQ(ys[0], ys[1]) << M;
    EXPECT_EQ(ys[0], ys[2]) << M;
  }
}

TEST_P(LinearBlocksTest, RowsThatAreNotWholeBlocksAreRefused) {
  const DType t = GetParam();
  std::vector<uint8_t> bytes(4096);
  const ds::ops::WeightView w{bytes.data(), t, 2, ds::ops::block_values(t) + 16};
  std::vector<float> x(static_cast<size_t>(w.cols)), y(2);
  EXPECT_THROW(ds::ops::linear_forward(y.data(), x.data(), w, 1), ds::Error);
}

INSTANTIATE_TEST_SUITE_P(Formats, LinearBlocksDecode, ::testing::Values(DType::Q8_0, DType::Q4_K, DType::Q6_K),
                         [](const auto& info) { return std::string(ds::dtype_name(info.param)); });
INSTANTIATE_TEST_SUITE_P(Formats, LinearBlocksTest,
                         ::testing::Values(DType::Q8_0, DType::Q4_K, DType::Q4_1, DType::Q6_K),
                         [](const auto& info) { return std::string(ds::dtype_name(info.param)); });

}  // namespace linear_blocks_test
}  // namespace
