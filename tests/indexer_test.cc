// DeepSeek-V3.2 indexer pieces (ops/indexer.h) and the sparse latent
// attention (ops/latent_attention.h) against plain double references: the
// Hadamard rotation against the Sylvester matrix, LayerNorm, e4m3 block
// quantization against a brute-force nearest-code search (ties to even,
// amax and ue8m0 scales), the scores against direct sums, the top-k
// selection against a stable sort, and attention over selected keys against
// dense attention over a cache holding only those keys.
#include "ops/indexer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/latent_attention.h"
#include "ops/reference/latent_attention.h"
#include "test_util.h"

namespace ds {
namespace {

std::vector<double> sylvester(int64_t d) {
  std::vector<double> h{1.0};
  for (int64_t n = 1; n < d; n *= 2) {
    std::vector<double> g(4 * n * n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const double v = h[i * n + j];
        g[i * 2 * n + j] = v;
        g[i * 2 * n + j + n] = v;
        g[(i + n) * 2 * n + j] = v;
        g[(i + n) * 2 * n + j + n] = -v;
      }
    h = g;
  }
  return h;
}

TEST(Indexer, HadamardIsTheScaledSylvesterMatrix) {
  for (int64_t d : {1, 2, 8, 128}) {
    const int64_t rows = 3;
    auto x = test::randn(rows * d, 10 + d);
    auto y = x;
    ops::hadamard_rows(y.data(), rows, d);
    const auto h = sylvester(d);
    std::vector<double> want(rows * d);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < d; ++i) {
        double s = 0;
        for (int64_t j = 0; j < d; ++j) s += h[i * d + j] * x[r * d + j];
        want[r * d + i] = s / std::sqrt(static_cast<double>(d));
      }
    test::expect_close(y, want, 1e-6, 1e-6, "hadamard");
    ops::hadamard_rows(y.data(), rows, d);  // orthonormal and symmetric: its own inverse
    test::expect_close(y, test::to_double(x), 1e-6, 1e-6, "twice");
  }
  std::vector<float> z(24);
  EXPECT_THROW(ops::hadamard_rows(z.data(), 1, 24), Error);
}

TEST(Indexer, LayerNormWithBias) {
  const int64_t rows = 4, d = 16;
  auto x = test::randn(rows * d, 1, 3.0f), w = test::randn(d, 2), b = test::randn(d, 3);
  std::vector<float> y(rows * d);
  ops::layer_norm_rows(y.data(), x.data(), w.data(), b.data(), rows, d, 1e-6f);
  std::vector<double> want(rows * d);
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < d; ++j) m += x[r * d + j];
    m /= d;
    for (int64_t j = 0; j < d; ++j) v += (x[r * d + j] - m) * (x[r * d + j] - m);
    v /= d;
    for (int64_t j = 0; j < d; ++j) want[r * d + j] = (x[r * d + j] - m) / std::sqrt(v + 1e-6) * w[j] + b[j];
  }
  test::expect_close(y, want, 1e-5, 1e-5, "layer norm");
}

// The e4m3 code nearest to v (|v| <= 448), ties to the even code.
uint8_t nearest_e4m3(float v) {
  int best = -1;
  double bd = INFINITY;
  for (int c = 0; c < 256; ++c) {
    const float f = e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(f) || (c == 0x80)) continue;  // -0 never wins over +0
    const double dist = std::fabs(static_cast<double>(f) - v);
    if (dist < bd || (dist == bd && (c & 1) == 0)) {
      bd = dist;
      best = c;
    }
  }
  return static_cast<uint8_t>(best);
}

void check_quantized(const std::vector<float>& x, int64_t rows, int64_t d, bool ue8m0) {
  const int64_t nb = ops::indexer_scale_blocks(d);
  std::vector<uint8_t> codes(rows * d);
  std::vector<float> scales(rows * nb), back(rows * d);
  ops::fp8_quantize_rows(codes.data(), scales.data(), x.data(), rows, d, ue8m0);
  ops::fp8_dequantize_rows(back.data(), codes.data(), scales.data(), rows, d);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * 128, c1 = std::min(d, c0 + 128);
      float amax = 1e-4f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * d + c]));
      const float s = scales[r * nb + b];
      if (ue8m0) {
        int e = 0;
        EXPECT_EQ(std::frexp(s, &e), 0.5f) << "a power of two";
        EXPECT_GE(s, amax / 448.0f);
        EXPECT_LT(s / 2, amax / 448.0f);
      } else {
        EXPECT_EQ(s, amax * (1.0f / 448.0f));
      }
      for (int64_t c = c0; c < c1; ++c) {
        const float v = std::clamp(x[r * d + c] / s, -448.0f, 448.0f);
        const uint8_t want = v == 0 ? 0 : nearest_e4m3(v);
        EXPECT_EQ(e4m3_to_f32(codes[r * d + c]), e4m3_to_f32(want)) << "value " << x[r * d + c];
        EXPECT_EQ(back[r * d + c], e4m3_to_f32(codes[r * d + c]) * s);
      }
    }
}

TEST(Indexer, Fp8BlocksWithAmaxAndPowerOfTwoScales) {
  auto x = test::randn(5 * 32, 4, 2.0f);
  check_quantized(x, 5, 32, false);
  check_quantized(x, 5, 32, true);
  // Two blocks of 128 per row, a thousand times apart: each its own scale.
  auto y = test::randn(2 * 256, 5);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t c = 128; c < 256; ++c) y[r * 256 + c] *= 1000.0f;
  check_quantized(y, 2, 256, false);
  check_quantized(y, 2, 256, true);
  // An all-zero vector: amax is clamped to 1e-4, every code is zero.
  std::vector<float> z(16, 0.0f), s(1);
  std::vector<uint8_t> codes(16, 7);
  ops::fp8_quantize_rows(codes.data(), s.data(), z.data(), 1, 16, false);
  EXPECT_EQ(s[0], 1e-4f * (1.0f / 448.0f));
  EXPECT_TRUE(std::all_of(codes.begin(), codes.end(), [](uint8_t c) { return c == 0; }));
}

TEST(Indexer, ScoresAreHeadWeightedReluDots) {
  const int64_t n = 3, H = 4, d = 32, T = 700;  // T spans two key tiles
  auto q = test::randn(n * H * d, 6), w = test::randn(n * H, 7), k = test::randn(T * d, 8);
  std::vector<uint8_t> codes(T * d);
  std::vector<float> scales(T), kd(T * d), got(n * T);
  ops::fp8_quantize_rows(codes.data(), scales.data(), k.data(), T, d, true);
  ops::fp8_dequantize_rows(kd.data(), codes.data(), scales.data(), T, d);
  ops::indexer_scores(got.data(), T, q.data(), w.data(), n, H, d, codes.data(), scales.data(), T);
  std::vector<double> want(n * T, 0.0);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t s = 0; s < T; ++s)
      for (int64_t h = 0; h < H; ++h) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += double(q[(j * H + h) * d + i]) * kd[s * d + i];
        want[j * T + s] += w[j * H + h] * std::max(dot, 0.0);
      }
  test::expect_close(got, want, 1e-5, 1e-5, "scores");
}

TEST(Indexer, TopkTakesTheBestTiesToTheLowerIndex) {
  // Scores from a small set: many ties.
  for (int64_t visible : {1, 5, 12, 64, 300}) {
    std::vector<float> s(visible);
    for (int64_t i = 0; i < visible; ++i) s[i] = static_cast<float>((i * 7919) % 5);
    if (visible > 3) s[3] = NAN;  // ranks below everything
    for (int64_t k : {1, 4, 12}) {
      std::vector<int32_t> order(visible);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        const float sa = std::isnan(s[a]) ? -INFINITY : s[a], sb = std::isnan(s[b]) ? -INFINITY : s[b];
        return sa > sb;
      });
      std::vector<int32_t> want(order.begin(), order.begin() + std::min(k, visible));
      std::sort(want.begin(), want.end());
      std::vector<int32_t> got(k, -1);
      const int64_t m = ops::topk_indices(got.data(), s.data(), visible, k);
      ASSERT_EQ(m, std::min(k, visible));
      got.resize(m);
      EXPECT_EQ(got, want) << "visible " << visible << " k " << k;
    }
  }
}

TEST(Indexer, TopkOfContinuousScoresWithSignsAndDuplicates) {
  const int64_t visible = 5000;
  auto s = test::randn(visible, 30);
  for (int64_t i = 0; i < visible; i += 97) s[i] = s[i / 2];                 // duplicates
  for (int64_t i = 5; i < visible; i += 301) s[i] = (i % 2) ? 0.0f : -0.0f;  // +-0 are equal
  for (int64_t k : {1, 100, 2048, 4999}) {
    std::vector<int32_t> order(visible);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
    std::vector<int32_t> want(order.begin(), order.begin() + k), got(k);
    std::sort(want.begin(), want.end());
    ASSERT_EQ(ops::topk_indices(got.data(), s.data(), visible, k), k);
    EXPECT_EQ(got, want) << "k " << k;
  }
}

TEST(Indexer, SparseLatentAttentionIsDenseAttentionOverTheSelectedKeys) {
  const ops::LatentAttentionDims d{3, 8, 4, 6, 16, 0.3f};
  const int64_t H = d.heads, qk = d.nope + d.rope, T = 50, n = 4, k = 7;
  auto q = test::randn(n * H * qk, 20), ckv = test::randn(T * d.kv_lora, 21), kpe = test::randn(T * d.rope, 22),
       w = test::randn(H * (d.nope + d.v_dim) * d.kv_lora, 23, 0.3f);
  std::vector<int32_t> idx(n * k);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; ++i) idx[j * k + i] = static_cast<int32_t>((j * 11 + i * 7) % T);
  std::vector<float> ctx(n * H * d.v_dim, -1.0f);
  ops::latent_attention_sparse_forward(ctx.data(), H * d.v_dim, q.data(), H * qk, ckv.data(), kpe.data(), w.data(), n,
                                       idx.data(), k, d);
  for (int64_t j = 0; j < n; ++j) {
    // A cache of only the selected keys, which the query sees in full.
    std::vector<double> c(k * d.kv_lora), p(k * d.rope), want;
    for (int64_t i = 0; i < k; ++i) {
      std::copy_n(ckv.begin() + idx[j * k + i] * d.kv_lora, d.kv_lora, c.begin() + i * d.kv_lora);
      std::copy_n(kpe.begin() + idx[j * k + i] * d.rope, d.rope, p.begin() + i * d.rope);
    }
    std::vector<double> qj(q.begin() + j * H * qk, q.begin() + (j + 1) * H * qk);
    ref::latent_attention_forward(want, qj, c, p, test::to_double(w), 1, k - 1, d);
    test::expect_close(std::vector<float>(ctx.begin() + j * H * d.v_dim, ctx.begin() + (j + 1) * H * d.v_dim), want,
                       2e-5, 2e-5, "sparse ctx");
  }
}

}  // namespace
}  // namespace ds
