// DeepSeek-V3.2 indexer pieces (ops/indexer.h) and the sparse latent
// attention (ops/latent_attention.h) against plain double references: the
// Hadamard rotation against the Sylvester matrix, LayerNorm, e4m3 block
// quantization against a brute-force nearest-code search (ties to even,
// amax and ue8m0 scales), the scores against direct sums, the top-k
// selection against a stable sort, and attention over selected keys against
// dense attention over a cache holding only those keys. The training pieces
// (float32, no fp8): LayerNorm's backward, the dense scores and their
// backward, the KL loss and its gradient against double references and
// their central differences; the selection against topk_indices on the
// visible keys; the attention's key distribution against the attention
// kernel's own output for one-hot values.
#include "ops/indexer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "ops/linear.h"
#include "core/error.h"
#include "io/text_input.h"
#include "ops/attention.h"
#include "ops/latent_attention.h"
#include "ops/reference/latent_attention.h"
#include "test_util.h"

namespace ds {
namespace {
namespace indexer_test {

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

TEST(Indexer, V4RoundingSimulationsMatchTheIndependentReference) {
  // DeepSeek-V4's fp8 (blocks of 64) and fp4 (blocks of 32) quantize-dequantize
  // simulations against the float64 V4 reference (tests/data/v4/quant.json,
  // from tests/reference/make_v4_op_fixtures.py): random blocks of many
  // magnitudes, blocks under the amax floors, and blocks of exact ties.
  const nlohmann::json j = nlohmann::json::parse(
      ds::io::read_file(DEEPSEEK_SOURCE_DIR "/tests/data/v4/quant.json", "quantization fixture"));
  auto vec = [&](const char* k) { return j.at(k).template get<std::vector<float>>(); };
  const auto x = vec("x");
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> y(n);
  // Power-of-two scales divide exactly: bit for bit, ties included.
  ds::ops::fp8_round_blocks(y.data(), x.data(), n, 64, /*ue8m0=*/true);
  EXPECT_EQ(y, vec("fp8_ue8m0"));
  ds::ops::fp4_round_blocks(y.data(), x.data(), n, 32);
  EXPECT_EQ(y, vec("fp4"));
  // Plain scales are amax * fp32(1 / 448) here (as the official kernel and
  // the V3.2 path compute them) and the exact amax / 448 in the reference.
  ds::ops::fp8_round_blocks(y.data(), x.data(), n, 64, /*ue8m0=*/false);
  ds::test::expect_close(y, vec("fp8_plain"), 1e-6, 0, "fp8 plain");
  // In place, and twice is once.
  std::vector<float> z = x;
  ds::ops::fp4_round_blocks(z.data(), z.data(), n, 32);
  EXPECT_EQ(z, vec("fp4"));
  ds::ops::fp4_round_blocks(z.data(), z.data(), n, 32);
  EXPECT_EQ(z, vec("fp4"));
  EXPECT_THROW(ds::ops::fp4_round_blocks(y.data(), x.data(), 48, 32), ds::Error);
}

// DeepSeek-V4.1's fp4 rounding of compressed entries (groups of 16, an
// e4m3 scale, not a power of two) against a double-precision transcription
// of its rule, on blocks of many magnitudes, under the scale floor and on
// exact e2m1 midpoints.
TEST(Indexer, V41EntryRoundingMatchesItsRule) {
  const int64_t n = 16 * 40;
  std::vector<float> x = ds::test::randn(n, 41, 2.0f);
  for (int64_t i = 0; i < 16; ++i) x[static_cast<size_t>(i)] *= 1e-6f;  // under the 6 * 2^-9 floor
  for (int64_t i = 16; i < 32; ++i) x[static_cast<size_t>(i)] *= 300.0f;
  // A block whose scale is exactly 1 (amax 6), holding every e2m1 midpoint.
  const float mids[16] = {6.0f,   0.25f,  0.75f,  1.25f,  1.75f, 2.5f,  3.5f,  5.0f,
                          -0.25f, -0.75f, -1.25f, -1.75f, -2.5f, -3.5f, -5.0f, 0.1f};
  std::copy(mids, mids + 16, x.begin() + 32);
  std::vector<float> y(n);
  ds::ops::fp4_round_blocks_e4m3(y.data(), x.data(), n, 16);
  const double e2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  auto nearest_even = [&](double v) {  // ties to the even code (codes 0, 2, 4, 6 are 0, 1, 2, 4)
    const double a = std::fabs(v);
    int best = 0;
    for (int c = 1; c < 8; ++c) {
      const double d = std::fabs(a - e2m1[c]), db = std::fabs(a - e2m1[best]);
      if (d < db || (d == db && c % 2 == 0)) best = c;
    }
    return std::copysign(e2m1[best], v);
  };
  for (int64_t b = 0; b < n / 16; ++b) {
    double amax = 6.0 * std::ldexp(1.0, -9);
    for (int64_t i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(double(x[b * 16 + i])));
    const double s = ds::e4m3_to_f32(ds::f32_to_e4m3(static_cast<float>(amax / 6.0)));
    for (int64_t i = 0; i < 16; ++i) {
      const double v = std::clamp(double(x[b * 16 + i]) / s, -6.0, 6.0);
      EXPECT_EQ(y[b * 16 + i], static_cast<float>(nearest_even(v) * s)) << "block " << b << " value " << i;
    }
  }
  EXPECT_EQ(y[32 + 1], 0.0f);  // 0.25 -> 0
  EXPECT_EQ(y[32 + 2], 1.0f);  // 0.75 -> 1
  EXPECT_EQ(y[32 + 5], 2.0f);  // 2.5 -> 2
  EXPECT_EQ(y[32 + 6], 4.0f);  // 3.5 -> 4
  EXPECT_EQ(y[32 + 7], 4.0f);  // 5 -> 4
  EXPECT_THROW(ds::ops::fp4_round_blocks_e4m3(y.data(), x.data(), 24, 16), ds::Error);
  // Kept as codes (packed e2m1, an e4m3 scale byte a block): decoding gives
  // the rounded values bit for bit.
  std::vector<uint8_t> packed(n / 2), scales(n / 16);
  std::vector<float> back(n);
  ds::ops::fp4_encode_blocks_e4m3(packed.data(), scales.data(), x.data(), n, 16);
  ds::ops::fp4_decode_blocks_e4m3(back.data(), packed.data(), scales.data(), n, 16);
  EXPECT_EQ(back, y);
}

TEST(Indexer, V4RoundingsKeptAsCodesDecodeToTheRoundedValues) {
  // Values of every magnitude (tiny blocks hit the scale floors), in blocks
  // of 64 (fp8) and 32 (fp4): decoding the codes gives the round functions'
  // results bit for bit, fp4 through the packed-fp4 weight layout.
  const int64_t n = 64 * 12;
  std::vector<float> x = ds::test::randn(n, 31, 3.0f);
  for (int64_t i = 0; i < 64; ++i) x[static_cast<size_t>(i)] *= 1e-7f;
  for (int64_t i = 64; i < 128; ++i) x[static_cast<size_t>(i)] *= 1e4f;
  std::vector<float> want(n), got(n);
  std::vector<uint8_t> codes(n), scales(n / 32);
  ds::ops::fp8_round_blocks(want.data(), x.data(), n, 64, true);
  ds::ops::fp8_encode_blocks(codes.data(), scales.data(), x.data(), n, 64);
  ds::ops::fp8_decode_blocks(got.data(), codes.data(), scales.data(), n, 64);
  EXPECT_EQ(got, want);
  ds::ops::fp4_round_blocks(want.data(), x.data(), n, 32);
  std::vector<uint8_t> packed(n / 2);
  ds::ops::fp4_encode_blocks(packed.data(), scales.data(), x.data(), n, 32);
  ds::ops::WeightView w;
  w.data = packed.data();
  w.dtype = ds::DType::F4E2M1;
  w.rows = n / 128;
  w.cols = 128;
  w.scale_e8m0 = scales.data();
  ds::ops::widen_rows(got.data(), w, 0, w.rows);
  EXPECT_EQ(got, want);
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
  const auto absorbed =
      ops::absorb_kv_b(ops::WeightView{w.data(), DType::F32, H * (d.nope + d.v_dim), d.kv_lora}, d);
  ops::latent_attention_sparse_forward(ctx.data(), H * d.v_dim, q.data(), H * qk, ckv.data(), kpe.data(),
                                       absorbed.data(), n, idx.data(), k, d);
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

// ---------------------------------------------------------------- training

using test::expect_close;
using test::numeric_grad;
using test::randn;
using test::to_double;

// Two rows of 7 tokens; row 0 holds two documents (segments 1 and 2).
constexpr int64_t kB = 2, kT = 7;
const std::vector<int32_t> kSeg = {1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1};
bool visible(int64_t b, int64_t t, int64_t s) { return s <= t && kSeg[b * kT + s] == kSeg[b * kT + t]; }

// Dense scores in double (NaN where not visible).
std::vector<double> ref_scores(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& w,
                               int64_t H, int64_t d) {
  std::vector<double> out(kB * kT * kT, std::nan(""));
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t t = 0; t < kT; ++t)
      for (int64_t s = 0; s < kT; ++s) {
        if (!visible(b, t, s)) continue;
        double acc = 0;
        const int64_t n = b * kT + t;
        for (int64_t h = 0; h < H; ++h) {
          double x = 0;
          for (int64_t i = 0; i < d; ++i) x += q[(n * H + h) * d + i] * k[(b * kT + s) * d + i];
          acc += w[n * H + h] * std::max(0.0, x);
        }
        out[n * kT + s] = acc;
      }
  return out;
}

TEST(IndexerTrain, LayerNormBackwardMatchesFiniteDifferences) {
  const int64_t rows = 5, d = 8;
  const float eps = 1e-6f;
  const auto x = randn(rows * d, 1), w = randn(d, 2), b = randn(d, 3), dy = randn(rows * d, 4);
  auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww, const std::vector<double>& bb) {
    double l = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double mean = 0, var = 0;
      for (int64_t j = 0; j < d; ++j) mean += xx[r * d + j] / d;
      for (int64_t j = 0; j < d; ++j) var += (xx[r * d + j] - mean) * (xx[r * d + j] - mean) / d;
      for (int64_t j = 0; j < d; ++j)
        l += dy[r * d + j] * ((xx[r * d + j] - mean) / std::sqrt(var + eps) * ww[j] + bb[j]);
    }
    return l;
  };
  const auto xd = to_double(x), wd = to_double(w), bd = to_double(b);
  std::vector<float> dx(rows * d), dw(d, 0.5f), db(d, 0.5f);  // dw, db accumulate onto 0.5
  ops::layer_norm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), rows, d, eps);
  auto fx = numeric_grad([&](const std::vector<double>& v) { return loss(v, wd, bd); }, xd);
  auto fw = numeric_grad([&](const std::vector<double>& v) { return loss(xd, v, bd); }, wd);
  auto fb = numeric_grad([&](const std::vector<double>& v) { return loss(xd, wd, v); }, bd);
  for (auto& v : fw) v += 0.5;
  for (auto& v : fb) v += 0.5;
  expect_close(dx, fx, 1e-4, 1e-5, "dx");
  expect_close(dw, fw, 1e-4, 1e-5, "dw");
  expect_close(db, fb, 1e-4, 1e-5, "db");
}

TEST(IndexerTrain, DenseScoresAndTheirBackward) {
  const int64_t H = 3, d = 5, N = kB * kT;
  const auto q = randn(N * H * d, 11), k = randn(N * d, 12), w = randn(N * H, 13);
  std::vector<float> scores(kB * kT * kT);
  ops::indexer_dense_scores(scores.data(), q.data(), k.data(), w.data(), kSeg.data(), kB, kT, H, d);
  const auto want = ref_scores(to_double(q), to_double(k), to_double(w), H, d);
  for (size_t i = 0; i < scores.size(); ++i) {
    if (std::isnan(want[i]))
      EXPECT_EQ(scores[i], -std::numeric_limits<float>::infinity()) << i;
    else
      EXPECT_NEAR(scores[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << i;
  }
  // Backward: L = sum over visible entries of g * score; masked entries of g
  // are garbage the backward must ignore.
  const auto g = randn(scores.size(), 14);
  auto loss = [&](const std::vector<double>& qq, const std::vector<double>& kk, const std::vector<double>& ww) {
    const auto sc = ref_scores(qq, kk, ww, H, d);
    double l = 0;
    for (size_t i = 0; i < sc.size(); ++i)
      if (!std::isnan(sc[i])) l += g[i] * sc[i];
    return l;
  };
  std::vector<float> dq(q.size()), dk(k.size()), dw(w.size());
  ops::indexer_dense_scores_backward(dq.data(), dk.data(), dw.data(), g.data(), q.data(), k.data(), w.data(),
                                     kSeg.data(), kB, kT, H, d);
  const auto qd = to_double(q), kd = to_double(k), wd = to_double(w);
  expect_close(dq, numeric_grad([&](const std::vector<double>& v) { return loss(v, kd, wd); }, qd), 1e-4, 1e-5, "dq");
  expect_close(dk, numeric_grad([&](const std::vector<double>& v) { return loss(qd, v, wd); }, kd), 1e-4, 1e-5, "dk");
  expect_close(dw, numeric_grad([&](const std::vector<double>& v) { return loss(qd, kd, v); }, wd), 1e-4, 1e-5, "dw");
}

TEST(IndexerTrain, SelectTakesTopkOfTheVisibleKeys) {
  const int64_t H = 2, d = 4, N = kB * kT;
  std::vector<float> scores(kB * kT * kT);
  ops::indexer_dense_scores(scores.data(), randn(N * H * d, 21).data(), randn(N * d, 22).data(),
                            randn(N * H, 23).data(), kSeg.data(), kB, kT, H, d);
  scores[6 * kT + 3] = scores[6 * kT + 5] = scores[6 * kT + 4];  // a tie in row 6 (keys 3..6 visible)
  for (int64_t k : {1, 2, 3, 8}) {
    std::vector<uint8_t> sel(scores.size());
    ops::indexer_select(sel.data(), scores.data(), kB, kT, k);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t b = n / kT, t = n % kT;
      std::vector<float> vals;
      std::vector<int32_t> at, picked(static_cast<size_t>(k));
      for (int64_t s = 0; s < kT; ++s)
        if (visible(b, t, s)) {
          vals.push_back(scores[n * kT + s]);
          at.push_back(static_cast<int32_t>(s));
        }
      std::vector<uint8_t> want(kT, 0);
      const int64_t m = ops::topk_indices(picked.data(), vals.data(), static_cast<int64_t>(vals.size()), k);
      EXPECT_EQ(m, std::min<int64_t>(k, static_cast<int64_t>(vals.size())));
      for (int64_t i = 0; i < m; ++i) want[at[picked[i]]] = 1;
      EXPECT_EQ(std::vector<uint8_t>(sel.begin() + n * kT, sel.begin() + (n + 1) * kT), want)
          << "k " << k << " row " << n;
    }
  }
}

// The attention kernel with value[s] = one-hot(s) outputs each head's
// softmax over the keys; the target is their mean over heads.
TEST(IndexerTrain, AttentionKeyDistributionIsTheHeadsMeanSoftmax) {
  const int64_t H = 3, dk = 6, N = kB * kT;
  const float scale = 0.4f;
  const auto q = randn(N * H * dk, 31), k = randn(N * H * dk, 32);
  std::vector<float> v(N * H * kT, 0.0f), out(N * H * kT), lse(N * H);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) v[(n * H + h) * kT + n % kT] = 1.0f;
  ops::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), kSeg.data(),
                         ops::AttentionDims{kB, kT, H, dk, kT, scale});
  std::vector<double> want(N * kT, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < kT; ++s) want[n * kT + s] += out[(n * H + h) * kT + s] / H;
  std::vector<float> target(N * kT);
  ops::attention_key_distribution(target.data(), q.data(), k.data(), kSeg.data(), nullptr, kB, kT, H, dk, scale);
  expect_close(target, want, 1e-5, 1e-6, "dense");
  // Over selected keys only: zero elsewhere, the rest renormalised per head.
  std::vector<uint8_t> sel(N * kT);
  for (size_t i = 0; i < sel.size(); ++i) sel[i] = (i % 3) != 1 || (i % kT) == (i / kT) % kT;  // keeps the diagonal
  std::vector<float> sparse(N * kT);
  ops::attention_key_distribution(sparse.data(), q.data(), k.data(), kSeg.data(), sel.data(), kB, kT, H, dk, scale);
  for (int64_t n = 0; n < N; ++n) {
    double sum = 0;
    for (int64_t s = 0; s < kT; ++s) {
      if (!sel[n * kT + s] || !visible(n / kT, n % kT, s)) {
        EXPECT_EQ(sparse[n * kT + s], 0.0f);
      }
      sum += sparse[n * kT + s];
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
}

TEST(IndexerTrain, KlLossAndItsGradient) {
  const int64_t H = 2, d = 4, N = kB * kT;
  std::vector<float> scores(N * kT), target(N * kT);
  ops::indexer_dense_scores(scores.data(), randn(N * H * d, 41).data(), randn(N * d, 42).data(),
                            randn(N * H, 43).data(), kSeg.data(), kB, kT, H, d);
  ops::attention_key_distribution(target.data(), randn(N * 3 * 4, 44).data(), randn(N * 3 * 4, 45).data(), kSeg.data(),
                                  nullptr, kB, kT, 3, 4, 0.5f);
  std::vector<uint8_t> sel(N * kT);
  ops::indexer_select(sel.data(), scores.data(), kB, kT, 2);
  for (const uint8_t* selected : {static_cast<const uint8_t*>(nullptr), static_cast<const uint8_t*>(sel.data())}) {
    SCOPED_TRACE(selected ? "sparse" : "dense");
    // The sparse target lives on the selected keys.
    std::vector<float> tg = target;
    if (selected)
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0;
        for (int64_t s = 0; s < kT; ++s) sum += selected[n * kT + s] ? tg[n * kT + s] : 0.0;
        for (int64_t s = 0; s < kT; ++s) tg[n * kT + s] = selected[n * kT + s] ? tg[n * kT + s] / sum : 0.0f;
      }
    auto loss = [&](const std::vector<double>& sc) {
      double l = 0;
      for (int64_t n = 0; n < N; ++n) {
        double mx = -1e300, z = 0;
        auto in = [&](int64_t s) { return std::isfinite(sc[n * kT + s]) && (!selected || selected[n * kT + s]); };
        for (int64_t s = 0; s < kT; ++s)
          if (in(s)) mx = std::max(mx, sc[n * kT + s]);
        for (int64_t s = 0; s < kT; ++s)
          if (in(s)) z += std::exp(sc[n * kT + s] - mx);
        for (int64_t s = 0; s < kT; ++s)
          if (in(s)) {
            const double p = std::exp(sc[n * kT + s] - mx) / z, t = tg[n * kT + s];
            l += t * (std::log(t + 1e-8) - std::log(p + 1e-8));
          }
      }
      return l;
    };
    std::vector<float> ds(N * kT);
    const double got = ops::indexer_kl(ds.data(), scores.data(), tg.data(), selected, kB, kT, 0.7);
    const auto sd = to_double(scores);
    EXPECT_NEAR(got, loss(sd), 1e-6 * loss(sd));
    EXPECT_GT(got, 0.0);
    auto fd = numeric_grad([&](const std::vector<double>& v) { return 0.7 * loss(v); }, sd);
    for (size_t i = 0; i < fd.size(); ++i)
      if (!std::isfinite(sd[i])) fd[i] = 0;
    expect_close(ds, fd, 1e-4, 1e-6, "dscores");
  }
  // The target itself as the prediction: zero loss (up to the 1e-8 terms).
  std::vector<float> logp(N * kT), ds(N * kT);
  for (size_t i = 0; i < logp.size(); ++i)
    logp[i] = std::isfinite(scores[i]) ? std::log(std::max(target[i], 1e-30f)) : scores[i];
  EXPECT_NEAR(ops::indexer_kl(ds.data(), logp.data(), target.data(), nullptr, kB, kT, 1.0), 0.0, 1e-5);
}

}  // namespace indexer_test
}  // namespace
}  // namespace ds
