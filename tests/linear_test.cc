// Linear layers over narrow weights: every storage dtype against a float32
// product with independently widened (and, for fp8, block-dequantized; for
// fp4, decoded from the format's definition) weights; fp8 block quantization
// error bounds.
#include "ops/linear.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "core/simd.h"
#include "ops/reference/matmul.h"
#include "test_util.h"

using ds::DType;
using ds::ops::WeightView;

namespace {
namespace linear_test {

// Weight [out, in] in `dtype` plus its float32 value, widened by the scalar
// conversions (not by the kernel under test).
struct NarrowWeight {
  std::vector<uint8_t> bytes;
  std::vector<float> scale_inv;
  std::vector<float> value;  // what the kernel must multiply by
  WeightView view;
};

NarrowWeight make_weight(DType dtype, int64_t out, int64_t in, int64_t br, int64_t bc, uint64_t seed) {
  NarrowWeight w;
  auto f = ds::test::randn(out * in, seed, 0.5f);
  w.bytes.resize(out * in * ds::dtype_size(dtype));
  w.value.resize(out * in);
  if (dtype == DType::F8E4M3) {
    const int64_t sr = (out + br - 1) / br, sc = (in + bc - 1) / bc;
    w.scale_inv.resize(sr * sc);
    ds::ops::quantize_fp8_blocks(w.bytes.data(), w.scale_inv.data(), f.data(), out, in, br, bc);
    for (int64_t r = 0; r < out; ++r)
      for (int64_t c = 0; c < in; ++c)
        w.value[r * in + c] = ds::e4m3_to_f32(w.bytes[r * in + c]) * w.scale_inv[(r / br) * sc + c / bc];
  } else {
    ds::convert(w.bytes.data(), dtype, f.data(), DType::F32, f.size());
    ds::convert(w.value.data(), DType::F32, w.bytes.data(), dtype, f.size());
  }
  w.view = {w.bytes.data(), dtype, out, in, w.scale_inv.empty() ? nullptr : w.scale_inv.data(), br, bc};
  return w;
}

// A random fp4 weight [out, in] (every code, scales 2^-8..2^-2) and its value
// by the format's definition (not by the library's decoders).
struct Fp4Weight {
  std::vector<uint8_t> codes, scales;
  std::vector<float> value;
  WeightView view;
};

Fp4Weight make_fp4(int64_t out, int64_t in, uint64_t seed) {
  Fp4Weight w;
  w.codes.resize(out * in / 2);
  w.scales.resize(out * in / 32);
  uint64_t s = seed;
  auto next = [&] { return (s = s * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
  for (auto& b : w.codes) b = static_cast<uint8_t>(next());
  for (auto& e : w.scales) e = static_cast<uint8_t>(119 + next() % 7);
  static constexpr double kMag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  w.value.resize(out * in);
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < in; ++c) {
      const int code = (w.codes[(r * in + c) / 2] >> (c % 2 ? 4 : 0)) & 15;
      const double v = (code & 8 ? -1 : 1) * kMag[code & 7];
      w.value[r * in + c] = static_cast<float>(std::ldexp(v, w.scales[r * (in / 32) + c / 32] - 127));
    }
  w.view = {w.codes.data(), DType::F4E2M1, out, in, nullptr, 128, 128, w.scales.data()};
  return w;
}

// y = x W^T for M random rows of x is bitwise the same for 1, 2 and 3 threads.
void expect_linear_same_for_any_thread_count(const WeightView& w, int64_t M, uint64_t seed) {
  auto x = ds::test::randn(M * w.cols, seed);
  ds::test::expect_same_for_any_thread_count([&] {
    std::vector<float> y(M * w.rows);
    ds::ops::linear_forward(y.data(), x.data(), w, M);
    return y;
  });
}

TEST(Linear, Fp4MatchesItsDefinition) {
  // Decode-sized M (the in-register kernel) and prefill-sized M (widened
  // chunks), a row count that is not a multiple of the 4-row blocks, every
  // SIMD target; a slice of rows is the same weight's rows.
  ds::test::for_each_simd_target([](const char*) {
    for (int64_t M : {1, 2, 3, 5, 8, 9, 17, 40}) {
      auto w = make_fp4(70, 192, 61);
      auto x = ds::test::randn(M * 192, 62);
      std::vector<float> y(M * 70);
      ds::ops::linear_forward(y.data(), x.data(), w.view, M);
      auto want =
          ds::ref::matmul<double>(ds::test::to_double(x), ds::test::to_double(w.value), M, 70, 192, false, true);
      ds::test::expect_close(y, want, 2e-5, 0, "fp4");
      std::vector<float> part(M * 30);
      ds::ops::linear_forward(part.data(), x.data(), ds::ops::row_slice(w.view, 20, 50), M);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t o = 0; o < 30; ++o) EXPECT_EQ(part[m * 30 + o], y[m * 70 + 20 + o]) << m << "," << o;
    }
  });
}

TEST(Linear, Fp4DecodeGivesEachRowOfXTheSameBitsInAnyBatch) {
  // Up to 4 rows of x share each widened weight block (the table kernels
  // of AVX-512 and AVX2, DotBlock elsewhere) but keep their own accumulators and order:
  // each row's outputs are those it gets alone, bit for bit. Targets
  // with 16 vector registers take 2 rows of x a pass, the rest 4; more
  // rows widen the weight to float32 first, another order.
  ds::test::for_each_simd_target([](const char* target) {
    const std::string t = target;
    const int64_t pass = t == "AVX2" || t == "EMU128" || t == "SCALAR" ? 2 : 4;
    auto w = make_fp4(67, 1024, 71);
    auto x = ds::test::randn(4 * 1024, 72);
    std::vector<float> alone(4 * 67);
    for (int64_t m = 0; m < 4; ++m) ds::ops::linear_forward(alone.data() + m * 67, x.data() + m * 1024, w.view, 1);
    for (int64_t M = 2; M <= pass; ++M) {
      std::vector<float> y(M * 67);
      ds::ops::linear_forward(y.data(), x.data(), w.view, M);
      for (int64_t i = 0; i < M * 67; ++i) ASSERT_EQ(y[i], alone[i]) << M << " " << i;
    }
  });
}

TEST(Linear, Fp4WidensExactlyAndTakesEveryScale) {
  // Every code in every scale block, under scales from 2^-127 (e = 0, the
  // subnormal) to 2^127: the largest scale byte the vector path takes (128)
  // and one above it (129, done one element at a time) must agree bit for
  // bit with the definition; the decode kernel must match the product for
  // chunks of rows on either path.
  // The decode kernel takes 64 rows at a time: rows 0-63 have only scales
  // the vector path takes, rows 64-67 every scale.
  const int64_t rows = 68, cols = 8 * 32;
  std::vector<uint8_t> q(rows * cols / 2);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>(i * 37 + 11);
  const std::vector<uint8_t> e = {0, 1, 100, 127, 128, 129, 200, 250};  // 6 x 2^(250 - 127) is still finite
  std::vector<uint8_t> scales(rows * cols / 32);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 32; ++b) scales[r * (cols / 32) + b] = e[(b + r) % (r < 64 ? 5 : e.size())];
  const WeightView w{q.data(), DType::F4E2M1, rows, cols, nullptr, 128, 128, scales.data()};
  ds::test::for_each_simd_target([&](const char*) {
    std::vector<float> out(rows * cols);
    ds::ops::widen_rows(out.data(), w, 0, rows);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t code = static_cast<uint8_t>(q[(r * cols + c) / 2] >> (c % 2 ? 4 : 0));
        const float want = ds::e2m1_to_f32(code) * ds::e8m0_to_f32(scales[r * (cols / 32) + c / 32]);
        ASSERT_EQ(std::bit_cast<uint32_t>(out[r * cols + c]), std::bit_cast<uint32_t>(want))
            << "row " << r << " column " << c << " code " << int{code};
      }
    // The decode kernel against the widened rows (x of about 1e-30 keeps
    // every product finite), to float32 round-off of the sum of |terms|.
    auto x = ds::test::randn(2 * cols, 63, 1e-30f);
    std::vector<float> y(2 * rows);
    ds::ops::linear_forward(y.data(), x.data(), w, 2);
    for (int64_t m = 0; m < 2; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        double want = 0, mag = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const double t = static_cast<double>(x[m * cols + c]) * out[r * cols + c];
          want += t;
          mag += std::fabs(t);
        }
        EXPECT_NEAR(y[m * rows + r], want, 1e-6 * mag) << m << "," << r;
      }
  });
}

TEST(Linear, EveryDtypeMatchesTheWidenedProduct) {
  // 130 x 200 with 128 x 128 blocks: partial blocks on both edges; 130 rows
  // also leave a partial row block inside the kernel. Every SIMD target.
  ds::test::for_each_simd_target([](const char*) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3}) {
      for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64, 100}) {
        auto w = make_weight(dt, 130, 200, 128, 128, 11);
        auto x = ds::test::randn(M * 200, 12);
        std::vector<float> y(M * 130);
        ds::ops::linear_forward(y.data(), x.data(), w.view, M);
        auto want =
            ds::ref::matmul<double>(ds::test::to_double(x), ds::test::to_double(w.value), M, 130, 200, false, true);
        // float32 accumulation over 200 terms of O(1) values: ~1e-5 relative.
        ds::test::expect_close(y, want, 2e-5, 0, ds::dtype_name(dt).data());
      }
    }
  });
}

TEST(Linear, Bf16PrefillSumsInAFixedOrder) {
  // Whatever the tile shapes and the SIMD target, every output of the
  // prefill kernel is the same float32 sum: the first product, then a fused
  // multiply-add per k in order, then (accumulating) added to y. So its bits
  // are known, and a kernel that changes them (another order, a split of K)
  // fails here. The scalar fallback writes a product and a sum, and the file
  // is compiled without contraction (CMakeLists.txt), so there the sum is
  // the plain one on every ISA, aarch64 included. N = 1..13 cover every partial
  // tile, M every partial panel. x row 0 is zero and weight row 0 negative,
  // so that output is -0 (+0 times a negative weight), which a sum started
  // from +0 would turn into +0.
  ds::test::for_each_simd_target([](const char* target) {
    const bool fused = std::string_view(target) != "SCALAR" && std::string_view(target) != "EMU128";
    for (int64_t K : {2, 33, 34, 384})
      for (int64_t N : {1, 5, 6, 7, 12, 13, 70})
        for (int64_t M : {9, 16, 17, 40, 130})
          for (bool accumulate : {false, true}) {
            auto w = make_weight(DType::BF16, N, K, 128, 128, 61);
            for (int64_t c = 0; c < K; ++c) {
              reinterpret_cast<uint16_t*>(w.bytes.data())[c] |= 0x8000;  // negative
              w.value[c] = -std::fabs(w.value[c]);
            }
            const int64_t ldx = K + 3, ldy = N + 5;
            auto x = ds::test::randn(M * ldx, 62);
            std::fill(x.begin(), x.begin() + K, 0.0f);
            std::vector<float> got(M * ldy, 0.0f);
            if (accumulate) got = ds::test::randn(M * ldy, 63);
            std::vector<float> want = got;
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 0; n < N; ++n) {
                float s = x[m * ldx] * w.value[n * K];
                for (int64_t k = 1; k < K; ++k) {
                  if (fused) {
                    s = std::fma(x[m * ldx + k], w.value[n * K + k], s);
                  } else {
                    volatile float p = x[m * ldx + k] * w.value[n * K + k];  // rounded on its own
                    s = p + s;
                  }
                }
                want[m * ldy + n] = accumulate ? want[m * ldy + n] + s : s;
              }
            ds::ops::linear_forward(got.data(), x.data(), w.view, M, ldx, ldy, accumulate);
            ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
                << target << " K " << K << " N " << N << " M " << M << " accumulate " << accumulate;
            if (!accumulate) {
              ASSERT_TRUE(std::signbit(got[0]) && got[0] == 0.0f) << target << " " << got[0];
            }
          }
  });
}

TEST(Linear, Fp8DecodeIsRightWhereScalingXWouldOverflow) {
  // The decode kernel moves e4m3's block scales (times 2^120) onto x when
  // the product stays finite. Activations of 3e5 against scales of about
  // 0.5 * 4 / 448 overflow that product, so the kernel must keep the scales
  // on the weight; moderate activations in the same call shape take the
  // scaled-x path. Both must match the widened product.
  ds::test::for_each_simd_target([](const char*) {
    for (float amplitude : {1.0f, 3e5f}) {
      for (int64_t M : {1, 4, 8}) {
        auto w = make_weight(DType::F8E4M3, 260, 384, 128, 128, 51);
        auto x = ds::test::randn(M * 384, 52, amplitude);
        std::vector<float> y(M * 260);
        ds::ops::linear_forward(y.data(), x.data(), w.view, M);
        auto want =
            ds::ref::matmul<double>(ds::test::to_double(x), ds::test::to_double(w.value), M, 260, 384, false, true);
        ds::test::expect_close(y, want, 2e-5, 0, amplitude > 1 ? "large x" : "moderate x");
      }
    }
  });
}

TEST(Linear, StridesAndAccumulation) {
  // M = 3 and 8 take the decode (few-row) kernel, larger M the prefill path
  // (with 16 lanes: 16 and 17 one and two vectors of rows, 40 a second
  // panel); K = 33 is odd and leaves a partial block of 16 columns.
  ds::test::for_each_simd_target([](const char*) {
    for (DType dt : {DType::BF16, DType::F8E4M3, DType::F16}) {
      for (int64_t M : {3, 8, 9, 16, 17, 40}) {
        auto w = make_weight(dt, 70, 33, 16, 16, 21);
        const int64_t ldx = 40, ldy = 90;
        auto x = ds::test::randn(M * ldx, 22);
        std::vector<float> y(M * ldy, 1.0f);
        ds::ops::linear_forward(y.data(), x.data(), w.view, M, ldx, ldy, /*accumulate=*/true);
        for (int64_t i = 0; i < M; ++i) {
          for (int64_t o = 0; o < 70; ++o) {
            double s = 1.0;  // the accumulated initial value
            for (int64_t c = 0; c < 33; ++c) s += static_cast<double>(x[i * ldx + c]) * w.value[o * 33 + c];
            EXPECT_NEAR(y[i * ldy + o], s, 1e-4) << i << "," << o;  // float32 sums of 33 O(1) terms
          }
          for (int64_t o = 70; o < ldy; ++o) EXPECT_EQ(y[i * ldy + o], 1.0f);  // padding untouched
        }
      }
    }
  });
}

TEST(Linear, ResultsDoNotDependOnTheThreadCount) {
  // 2 rows take the decode kernel, 70 the prefill one; the weight is big
  // enough to run threaded.
  ds::test::for_each_simd_target([](const char*) {
    for (DType dt : {DType::BF16, DType::F8E4M3})
      for (int64_t M : {2, 70}) {
        auto w = make_weight(dt, 515, 301, 128, 128, 41);
        expect_linear_same_for_any_thread_count(w.view, M, 42);
      }
    for (int64_t M : {2, 8, 70}) {  // in-register decode, widened blocks of rows, prefill
      auto w = make_fp4(515, 320, 43);
      expect_linear_same_for_any_thread_count(w.view, M, 44);
    }
  });
}

TEST(Linear, Fp8BlockQuantizationErrorIsBounded) {
  const int64_t R = 150, C = 260;
  auto f = ds::test::randn(R * C, 31);
  f[5] = 0;  // a zero stays zero
  std::vector<uint8_t> q(R * C);
  std::vector<float> s(2 * 3);
  ds::ops::quantize_fp8_blocks(q.data(), s.data(), f.data(), R, C);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const float scale = s[(r / 128) * 3 + c / 128];
      const float back = ds::e4m3_to_f32(q[r * C + c]) * scale;
      const float v = f[r * C + c];
      // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values,
      // absolute error <= half the smallest subnormal step (2^-10) x scale below.
      EXPECT_LE(std::fabs(back - v), std::max(std::fabs(v) * 0.0625f, scale * 0x1p-10f)) << r << "," << c;
    }
  EXPECT_EQ(ds::e4m3_to_f32(q[5]), 0.0f);
  // Each block's largest magnitude maps to the format's maximum, 448.
  float amax = 0;
  for (int64_t r = 0; r < 128; ++r)
    for (int64_t c = 0; c < 128; ++c) amax = std::max(amax, std::fabs(f[r * C + c]));
  EXPECT_FLOAT_EQ(s[0], amax / 448.0f);
}

TEST(Linear, BadWeightsAreErrors) {
  std::vector<float> x(4), y(4);
  WeightView none{};
  EXPECT_THROW(ds::ops::linear_forward(y.data(), x.data(), none, 1), ds::Error);
  std::vector<uint8_t> q(4);
  WeightView no_scale{q.data(), DType::F8E4M3, 2, 2, nullptr, 128, 128};
  EXPECT_THROW(ds::ops::linear_forward(y.data(), x.data(), no_scale, 1), ds::Error);
  WeightView ints{q.data(), DType::I32, 1, 1, nullptr, 128, 128};
  EXPECT_THROW(ds::ops::linear_forward(y.data(), x.data(), ints, 1), ds::Error);
  std::vector<float> w(4, 1.0f);
  WeightView ok{w.data(), DType::F32, 2, 2, nullptr, 128, 128};
  EXPECT_THROW(ds::ops::linear_forward(y.data(), x.data(), ok, 1, 1, 2), ds::Error);  // ldx < in
  // fp4 needs its scales and whole 32-element scale blocks.
  std::vector<uint8_t> codes(32), e(2, 127);
  std::vector<float> x64(64), y2(2);
  WeightView fp4_no_scale{codes.data(), DType::F4E2M1, 2, 32, nullptr, 128, 128, nullptr};
  EXPECT_THROW(ds::ops::linear_forward(y2.data(), x64.data(), fp4_no_scale, 1), ds::Error);
  WeightView fp4_ragged{codes.data(), DType::F4E2M1, 2, 30, nullptr, 128, 128, e.data()};
  EXPECT_THROW(ds::ops::linear_forward(y2.data(), x64.data(), fp4_ragged, 1), ds::Error);
  WeightView fp4_ok{codes.data(), DType::F4E2M1, 2, 32, nullptr, 128, 128, e.data()};
  EXPECT_NO_THROW(ds::ops::linear_forward(y2.data(), x64.data(), fp4_ok, 1));
}

TEST(Linear, E4m3WidensExactlyAsTheScalarDecode) {
  // Every code but the NaN pair (0x7f, 0xff) in each 128-column block,
  // subnormals included, under scales from tiny to the largest the
  // in-register path takes (below 2^8) and one above it (the table path).
  const int64_t rows = 2, cols = 4 * 128;
  std::vector<uint8_t> q(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) q[i] = static_cast<uint8_t>(i * 7 + i / 256);
  for (float big : {255.9f, 300.0f}) {
    const std::vector<float> scale = {1e-30f, 3.7e-3f, 1.0f, big};  // [1, 4] blocks
    const WeightView w{q.data(), DType::F8E4M3, rows, cols, scale.data(), 128, 128};
    ds::test::for_each_simd_target([&](const char*) {
      std::vector<float> out(rows * cols);
      ds::ops::widen_rows(out.data(), w, 0, rows);
      for (int64_t i = 0; i < rows * cols; ++i) {
        if ((q[i] & 0x7f) == 0x7f) continue;
        const float want = ds::e4m3_to_f32(q[i]) * scale[(i % cols) / 128];
        ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want))
            << "code " << int{q[i]} << " at " << i;
      }
    });
  }
}

// Sets the matmul precision for a scope.
struct PrecisionGuard {
  explicit PrecisionGuard(ds::ops::MatmulPrecision p) { ds::ops::set_matmul_precision(p); }
  ~PrecisionGuard() { ds::ops::set_matmul_precision(ds::ops::MatmulPrecision::kF32); }
};

// Runs fn(target, dot) for every SIMD target and, where the target and CPU
// have bf16 dot products and the cap allows them, once with them (dot) and
// once without, then restores what the environment allowed. Returns whether
// the dot products ran, which they must wherever they are allowed.
template <class F>
bool for_each_bf16_path(F fn) {
  const bool allowed = ds::simd_bf16_dot_allowed();
  bool ran_dot = false;
  ds::test::for_each_simd_target([&](const char* target) {
    for (bool dot : {true, false}) {
      if (dot && !allowed) continue;
      ds::detail::set_simd_bf16_dot_allowed(dot);
      if (dot != ds::ops::bf16_dot_products()) continue;  // no such path on this target
      SCOPED_TRACE(dot ? "bf16 dot products" : "float32 kernels on rounded x");
      fn(target, dot);
      ran_dot = ran_dot || dot;
    }
  });
  ds::detail::set_simd_bf16_dot_allowed(allowed);
  EXPECT_EQ(ran_dot, allowed) << "bf16 dot products allowed here but never dispatched";
  return ran_dot;
}

std::vector<double> rounded_to_bf16(const std::vector<float>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = ds::bf16_to_f32(ds::f32_to_bf16(x[i]));
  return r;
}

TEST(Linear, Bf16PrecisionMultipliesXRoundedToBf16) {
  // In bf16 precision every narrow dtype multiplies x rounded to bf16 (by
  // the scalar conversion here), with float32 sums: against a float64
  // product of the rounded x, to float32 accuracy; against the unrounded x
  // it is visibly off (x's rounding error, ~2^-9 relative, is far above the
  // tolerance), so a kernel that skipped the rounding fails. M spans the
  // decode kernel, one and two vectors of a panel and several panels; K = 1
  // and 33 are odd (the dot kernel's last pair is half zero), N = 13 a
  // partial tile.
  PrecisionGuard bf16(ds::ops::MatmulPrecision::kBf16);
  for_each_bf16_path([](const char*, bool) {
    // fp8 with blocks of 16 (tiles straddle row blocks; K = 33 ends in a
    // one-column block), DeepSeek-V3's 128 and an odd 15 (which the dot
    // kernel, pairing columns, leaves to the float32 kernels).
    for (auto [dt, block] : {std::pair{DType::BF16, 16}, {DType::F16, 16}, {DType::F8E4M3, 16},
                             {DType::F8E4M3, 128}, {DType::F8E4M3, 15}})
      for (int64_t K : {1, 2, 33, 200})
        for (int64_t N : {13, 70})
          for (int64_t M : {1, 5, 8, 9, 16, 17, 33, 100}) {
            auto w = make_weight(dt, N, K, block, block, 71);
            auto x = ds::test::randn(M * K, 72);
            std::vector<float> y(M * N);
            ds::ops::linear_forward(y.data(), x.data(), w.view, M);
            const auto wv = ds::test::to_double(w.value);
            const auto want = ds::ref::matmul<double>(rounded_to_bf16(x), wv, M, N, K, false, true);
            const auto plain = ds::ref::matmul<double>(ds::test::to_double(x), wv, M, N, K, false, true);
            ds::test::expect_close(y, want, 2e-5, 0, ds::dtype_name(dt).data());
            double scale = 0, off = 0;
            for (size_t i = 0; i < y.size(); ++i) {
              scale = std::max(scale, std::fabs(plain[i]));
              off = std::max(off, std::fabs(y[i] - plain[i]));
            }
            EXPECT_GT(off, 1e-4 * scale) << ds::dtype_name(dt) << " M " << M << " K " << K << ": x not rounded";
          }
    // fp4 (e2m1 with power-of-two scales: exactly bf16 values).
    for (int64_t K : {32, 320})
      for (int64_t N : {13, 70})
        for (int64_t M : {1, 8, 9, 33, 100}) {
          auto w = make_fp4(N, K, 73);
          auto x = ds::test::randn(M * K, 74);
          std::vector<float> y(M * N);
          ds::ops::linear_forward(y.data(), x.data(), w.view, M);
          const auto want = ds::ref::matmul<double>(rounded_to_bf16(x), ds::test::to_double(w.value), M, N, K, false, true);
          ds::test::expect_close(y, want, 2e-5, 0, "fp4");
        }
  });
}

TEST(Linear, Bf16PrecisionStridesAccumulationAndThreads) {
  // ldx/ldy padding, y += x W^T, NaN and infinity in x, and bitwise the same
  // for any thread count (a weight big enough to run threaded).
  PrecisionGuard bf16(ds::ops::MatmulPrecision::kBf16);
  for_each_bf16_path([](const char*, bool) {
    for (int64_t M : {3, 40}) {
      auto w = make_weight(DType::BF16, 70, 33, 16, 16, 81);
      const int64_t ldx = 40, ldy = 90;
      auto x = ds::test::randn(M * ldx, 82);
      x[1 * ldx + 4] = std::numeric_limits<float>::quiet_NaN();  // row 1: every output NaN
      x[2 * ldx + 7] = std::numeric_limits<float>::infinity();   // row 2: +-inf or NaN
      std::vector<float> y(M * ldy, 1.0f);
      ds::ops::linear_forward(y.data(), x.data(), w.view, M, ldx, ldy, /*accumulate=*/true);
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t o = 0; o < 70; ++o) {
          if (i == 1) {
            EXPECT_TRUE(std::isnan(y[i * ldy + o])) << o;
            continue;
          }
          if (i == 2) {
            EXPECT_FALSE(std::isfinite(y[i * ldy + o])) << o;
            continue;
          }
          double s = 1.0;
          for (int64_t c = 0; c < 33; ++c)
            s += static_cast<double>(ds::bf16_to_f32(ds::f32_to_bf16(x[i * ldx + c]))) * w.value[o * 33 + c];
          EXPECT_NEAR(y[i * ldy + o], s, 1e-4) << i << "," << o;
        }
        for (int64_t o = 70; o < ldy; ++o) EXPECT_EQ(y[i * ldy + o], 1.0f);  // padding untouched
      }
    }
    for (int64_t M : {2, 70, 300}) {
      auto w = make_fp4(515, 320, 85);
      expect_linear_same_for_any_thread_count(w.view, M, 86);
    }
    for (DType dt : {DType::BF16, DType::F8E4M3})
      for (int64_t M : {2, 70, 300}) {
        auto w = make_weight(dt, 515, 301, 128, 128, 83);
        expect_linear_same_for_any_thread_count(w.view, M, 84);
      }
  });
}

TEST(Linear, MatmulPrecisionNames) {
  EXPECT_EQ(ds::ops::parse_matmul_precision("bf16"), ds::ops::MatmulPrecision::kBf16);
  EXPECT_EQ(ds::ops::parse_matmul_precision("bfloat16"), ds::ops::MatmulPrecision::kBf16);
  EXPECT_EQ(ds::ops::parse_matmul_precision("f32"), ds::ops::MatmulPrecision::kF32);
  EXPECT_THROW(ds::ops::parse_matmul_precision("fp8"), ds::Error);
  EXPECT_EQ(ds::ops::matmul_precision_name(ds::ops::MatmulPrecision::kBf16), "bf16");
  EXPECT_EQ(ds::ops::matmul_precision(), ds::ops::MatmulPrecision::kF32);  // the default
}

TEST(Linear, PairIsTwoProductsBitForBit) {
  // linear_forward_pair packs x once for two weights; every element must be
  // the bits of its own linear_forward, in both precisions, on every path,
  // for weights of different heights (the pair's rows are split among the
  // threads as one), and for any thread count. Mismatched dtypes, float32
  // weights and decode-sized M fall back to two calls.
  auto check = [](const WeightView& w0, const WeightView& w1, int64_t M, uint64_t seed) {
    auto x = ds::test::randn(M * w0.cols, seed);
    auto run = [&] {
      std::vector<float> y(M * (w0.rows + w1.rows));
      ds::ops::linear_forward_pair(y.data(), w0, y.data() + M * w0.rows, w1, x.data(), M);
      return y;
    };
    std::vector<float> want(M * (w0.rows + w1.rows));
    ds::ops::linear_forward(want.data(), x.data(), w0, M);
    ds::ops::linear_forward(want.data() + M * w0.rows, x.data(), w1, M);
    EXPECT_EQ(run(), want) << ds::dtype_name(w0.dtype) << "/" << ds::dtype_name(w1.dtype) << " M " << M;
    ds::test::expect_same_for_any_thread_count(run);
  };
  for (auto precision : {ds::ops::MatmulPrecision::kF32, ds::ops::MatmulPrecision::kBf16}) {
    PrecisionGuard guard(precision);
    for_each_bf16_path([&](const char*, bool) {
      for (int64_t M : {5, 9, 40, 300}) {
        for (DType dt : {DType::BF16, DType::F8E4M3, DType::F32}) {
          auto a = make_weight(dt, 70, 129, 128, 128, 91), b = make_weight(dt, 45, 129, 128, 128, 92);
          check(a.view, b.view, M, 93);
        }
        auto a = make_fp4(37, 64, 94), b = make_fp4(50, 64, 95);
        check(a.view, b.view, M, 96);
        auto c = make_weight(DType::BF16, 30, 64, 16, 16, 97), d = make_weight(DType::F8E4M3, 20, 64, 16, 16, 98);
        check(c.view, d.view, M, 99);
      }
    });
  }
  auto a = make_weight(DType::BF16, 8, 10, 16, 16, 1), b = make_weight(DType::BF16, 8, 11, 16, 16, 2);
  std::vector<float> x(40 * 11), y(40 * 16);
  EXPECT_THROW(ds::ops::linear_forward_pair(y.data(), a.view, y.data() + 8, b.view, x.data(), 40), ds::Error);
}

}  // namespace linear_test
}  // namespace
