// DeepSeek-V4.1's Engram layer (model/engram_v41.h) against the values the
// specification computes in float64 from DeepSeek's code (its gate and
// update test), the copysign gate at a zero key, the image mask, and the
// fp8 table's rows (e4m3 codes times their e8m0 scale per 32 columns; ids
// outside the table read zeros), and the backward against central
// differences.
#include "model/engram_v41.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"
#include "model/weights.h"
#include "test_util.h"

namespace {
namespace engram_v41_test {

// n = 2 streams, d = 4, C = 2 columns of De = 2 (e has 4 entries), eps 1e-20.
struct Toy {
  std::vector<float> wkv, w_qk, x, e;
  Toy() {
    for (int o = 0; o < 12; ++o)
      for (int i = 0; i < 4; ++i) wkv.push_back(static_cast<float>(0.2 * std::sin(o + 2 * i + 1)));
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < 4; ++j)
        w_qk.push_back(static_cast<float>((1 + 0.1 * g - 0.05 * j) * (1 - 0.03 * j + 0.02 * g)));
    for (int t = 0; t < 2; ++t)
      for (int j = 0; j < 4; ++j) e.push_back(static_cast<float>(0.1 * (j + 1) * std::cos(j + t)));
    for (int t = 0; t < 2; ++t)
      for (int g = 0; g < 2; ++g)
        for (int j = 0; j < 4; ++j) x.push_back(static_cast<float>(std::cos(t + 1.5 * g + 0.5 * j)));
  }
};

TEST(EngramV41, GateAndUpdateMatchTheSpecification) {
  Toy k;
  std::vector<float> alpha(4);
  ds::model::v41_engram_forward(k.x.data(), k.e.data(), ds::model::f32_view(k.wkv.data(), 12, 4), k.w_qk.data(),
                                {2, 2, 4, 1e-20f}, nullptr, alpha.data());
  const double want_alpha[4] = {0.237043, 0.603348, 0.775015, 0.213111};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(alpha[i], want_alpha[i], 2e-6) << i;
  const double out[2][2][4] = {
      {{0.982136, 0.871796, 0.551914, 0.089071}, {0.025267, -0.430874, -0.771588, -0.943327}},
      {{0.510958, 0.039168, -0.420916, -0.774728}, {-0.809213, -0.998673, -0.937768, -0.646380}}};
  for (int t = 0; t < 2; ++t)
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < 4; ++j) EXPECT_NEAR(k.x[(t * 2 + g) * 4 + j], out[t][g][j], 2e-6) << t << g << j;
}

TEST(EngramV41, ZeroKeyGivesTheCopysignGateAndImagesGetNone) {
  Toy k;
  std::vector<float> zeros(8, 0.0f), alpha(4), x = k.x;
  ds::model::v41_engram_forward(x.data(), zeros.data(), ds::model::f32_view(k.wkv.data(), 12, 4), k.w_qk.data(),
                                {2, 2, 4, 1e-20f}, nullptr, alpha.data());
  for (float a : alpha) EXPECT_NEAR(a, 0.500249999979, 1e-7);  // sigmoid(+1e-3), not 0.5
  const uint8_t image[2] = {0, 1};
  x = k.x;
  ds::model::v41_engram_forward(x.data(), k.e.data(), ds::model::f32_view(k.wkv.data(), 12, 4), k.w_qk.data(),
                                {2, 2, 4, 1e-20f}, image, alpha.data());
  EXPECT_EQ(alpha[2], 0.0f);
  EXPECT_EQ(alpha[3], 0.0f);
  for (int i = 8; i < 16; ++i) EXPECT_EQ(x[i], k.x[i]);  // a masked position's streams are unchanged, bit for bit
  EXPECT_NE(x[0], k.x[0]);
}

TEST(EngramV41, Fp8TableRowsAndIdsOutsideIt) {
  // 3 rows of 40 columns: two scale groups per row (columns 0-31, 32-39).
  const int64_t rows = 3, cols = 40;
  std::vector<uint8_t> codes(rows * cols), scales(rows * 2);
  for (int64_t i = 0; i < rows * cols; ++i) codes[i] = ds::f32_to_e4m3(0.25f * static_cast<float>(i % 13) - 1.5f);
  for (int64_t i = 0; i < rows * 2; ++i) scales[i] = static_cast<uint8_t>(125 + i);  // 2^-2 .. 2^3
  const ds::model::V41EngramTable t{codes.data(), scales.data(), rows, cols};
  const std::vector<int32_t> ids = {2, -1, 0, 3};
  std::vector<float> e(4 * cols, 7.0f);
  ds::model::v41_engram_gather(e.data(), ids.data(), 2, 2, t);
  for (int64_t j = 0; j < cols; ++j) {
    EXPECT_EQ(e[j], ds::e4m3_to_f32(codes[2 * cols + j]) * std::ldexp(1.0f, 125 + 4 + (j >= 32) - 127)) << j;
    EXPECT_EQ(e[cols + j], 0.0f);
    EXPECT_EQ(e[2 * cols + j], ds::e4m3_to_f32(codes[j]) * std::ldexp(1.0f, 125 + (j >= 32) - 127)) << j;
    EXPECT_EQ(e[3 * cols + j], 0.0f);
  }
}

// The backward of x += alpha v against central differences of a double
// transcription of the forward: the streams (through the gate's dot and both
// norms), the key and value rows of kv, the folded weights; an image
// position's gate is constant.
TEST(EngramV41, BackwardMatchesCentralDifferences) {
  const int64_t T = 3, n = 2, D = 8;
  const auto x = ds::test::randn(T * n * D, 51), kv = ds::test::randn(T * (n + 1) * D, 52),
             wqk = ds::test::randn(n * D, 53, 0.5f), r = ds::test::randn(T * n * D, 54);
  const uint8_t image[T] = {0, 0, 1};
  // L = sum(r * out), out = x + alpha v, in double.
  auto loss = [&](const std::vector<double>& X, const std::vector<double>& KV, const std::vector<double>& W) {
    double l = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < n; ++g) {
        double xx = 0, kk = 0, dot = 0;
        for (int64_t j = 0; j < D; ++j) {
          const double xv = X[(t * n + g) * D + j], k = KV[(t * (n + 1) + g) * D + j];
          xx += xv * xv;
          kk += k * k;
          dot += xv * W[g * D + j] * k;
        }
        const double s = dot / std::sqrt(xx / D + 1e-20) / std::sqrt(kk / D + 1e-20) / std::sqrt(double(D));
        const double a = std::copysign(std::sqrt(std::max(std::fabs(s), 1e-6)), s);
        const double alpha = image[t] ? 0.0 : 1.0 / (1.0 + std::exp(-a));
        for (int64_t j = 0; j < D; ++j)
          l += r[(t * n + g) * D + j] * (X[(t * n + g) * D + j] + alpha * KV[(t * (n + 1) + n) * D + j]);
      }
    return l;
  };
  std::vector<float> dx = r, dkv(kv.size()), dw(n * D, 0.0f);
  ds::model::v41_engram_backward(dx.data(), dkv.data(), dw.data(), r.data(), x.data(), kv.data(), wqk.data(),
                                 {T, n, D, 1e-20f}, image);  // dx aliases dout: the direct path is already there
  using ds::test::to_double;
  const auto X = to_double(x), KV = to_double(kv), W = to_double(wqk);
  ds::test::expect_close(dx, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(v, KV, W); }, X),
                         1e-4, 1e-6, "dx");
  ds::test::expect_close(dkv, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, v, W); }, KV),
                         1e-4, 1e-6, "dkv");
  ds::test::expect_close(dw, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, KV, v); }, W),
                         1e-4, 1e-6, "dw_qk");
}

}  // namespace engram_v41_test
}  // namespace
