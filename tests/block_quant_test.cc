// q8_0, q4_k and q4_1 rows (ops/block_quant.h): the linear layers' widening
// reads the blocks as ggml reads them (io/gguf_quants.h); q8_0's error
// is within half a step; q4_k's least-squares fit beats the plain min/max
// rule it starts from and stays within its step on every value; edge blocks
// (zero, constant, negative, tiny) and values f16 cannot scale are handled
// or refused.
#include "ops/block_quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "io/gguf_quants.h"
#include "ops/linear.h"
#include "test_util.h"

using ds::DType;

namespace {
namespace block_quant_test {

std::vector<float> gaussian(int64_t n, uint64_t seed, float std = 0.02f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = d(g);
  return x;
}

std::vector<float> roundtrip(DType t, const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint8_t> q(static_cast<size_t>(ds::ops::block_row_bytes(t, n)));
  ds::ops::quantize_blocks(t, x.data(), n, q.data());
  // ggml's reading of the blocks (dequantize_blocks is io/gguf_quants.h's)
  // and the linear layers' vector widening agree, up to the one rounding a
  // fused multiply-subtract saves.
  std::vector<float> y(x.size()), g(x.size());
  ds::ops::dequantize_blocks(t, q.data(), n, y.data());
  const auto gt = t == DType::Q8_0   ? ds::io::gguf::TensorType::Q8_0
                  : t == DType::Q4_1 ? ds::io::gguf::TensorType::Q4_1
                  : t == DType::Q6_K ? ds::io::gguf::TensorType::Q6_K
                                     : ds::io::gguf::TensorType::Q4_K;
  ds::io::gguf::dequantize(gt, q.data(), n, g.data());
  EXPECT_EQ(y, g);
  std::vector<float> wide(x.size());
  ds::ops::widen_rows(wide.data(), ds::ops::WeightView{q.data(), t, 1, n}, 0, 1);
  for (size_t i = 0; i < wide.size(); ++i) EXPECT_NEAR(wide[i], g[i], 1e-6f * (std::fabs(g[i]) + 1e-4f)) << i;
  return y;
}

double rel_rmse(const std::vector<float>& x, const std::vector<float>& y) {
  double e = 0, s = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e += (x[i] - y[i]) * double(x[i] - y[i]);
    s += x[i] * double(x[i]);
  }
  return std::sqrt(e / s);
}

TEST(BlockQuant, Sizes) {
  EXPECT_EQ(ds::ops::block_row_bytes(DType::Q8_0, 64), 68);
  EXPECT_EQ(ds::ops::block_row_bytes(DType::Q6_K, 512), 420);
  EXPECT_EQ(ds::dtype_name(DType::Q6_K), "q6_k");
  EXPECT_EQ(ds::ops::block_row_bytes(DType::Q4_K, 512), 288);
  EXPECT_TRUE(ds::ops::fits_block_format(DType::Q8_0, 96));
  EXPECT_FALSE(ds::ops::fits_block_format(DType::Q4_K, 96));
  EXPECT_THROW(ds::ops::block_row_bytes(DType::Q4_K, 100), ds::Error);
  EXPECT_THROW(ds::dtype_size(DType::Q8_0), ds::Error);
  EXPECT_EQ(ds::dtype_name(DType::Q4_K), "q4_k");
}

TEST(BlockQuant, Q8_0IsWithinHalfAStepAndGgmlsBytes) {
  const auto x = gaussian(32 * 64, 1);
  const auto y = roundtrip(DType::Q8_0, x);
  for (size_t b = 0; b < x.size() / 32; ++b) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    // q is rounded against amax / 127; the stored f16 d differs from it by
    // its rounding, which each of up to 127 steps carries.
    const float d = amax / 127, dh = ds::f16_to_f32(ds::f32_to_f16(d));
    for (int i = 0; i < 32; ++i)
      ASSERT_LE(std::fabs(x[b * 32 + i] - y[b * 32 + i]), 0.5f * d * 1.001f + 127 * std::fabs(dh - d)) << b;
  }
  EXPECT_LT(rel_rmse(x, y), 0.007);
  // Ties round away from zero, as ggml's reference does: 2.5 steps -> 3.
  std::vector<float> tie(32, 0.0f);
  tie[0] = 127.0f;
  tie[1] = 2.5f;
  tie[2] = -2.5f;
  std::vector<uint8_t> q(34);
  ds::ops::quantize_blocks(DType::Q8_0, tie.data(), 32, q.data());
  EXPECT_EQ(static_cast<int8_t>(q[3]), 3);
  EXPECT_EQ(static_cast<int8_t>(q[4]), -3);
}

// The plain rule the fit starts from: per sub-block scale (max - min) / 15
// and offset -min, scales and mins rounded to six bits as q4_k stores them.
std::vector<float> q4_min_max(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t b = 0; b < x.size() / 256; ++b) {
    float a[8], m[8], amax = 0, mmax = 0;
    for (int j = 0; j < 8; ++j) {
      const float* v = &x[b * 256 + j * 32];
      float lo = 0, hi = v[0];
      for (int i = 0; i < 32; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
      a[j] = (hi - lo) / 15;
      m[j] = -lo;
      amax = std::max(amax, a[j]);
      mmax = std::max(mmax, m[j]);
    }
    const float d = ds::f16_to_f32(ds::f32_to_f16(amax / 63)), dm = ds::f16_to_f32(ds::f32_to_f16(mmax / 63));
    for (int j = 0; j < 8; ++j) {
      const float s = d * std::nearbyint(a[j] / d), o = dm * std::nearbyint(m[j] / dm);
      for (int i = 0; i < 32; ++i) {
        const size_t k = b * 256 + j * 32 + i;
        y[k] = s * std::clamp(std::nearbyint((x[k] + o) / s), 0.0f, 15.0f) - o;
      }
    }
  }
  return y;
}

TEST(BlockQuant, Q4_KFitsBetterThanMinMaxAndWithinItsStep) {
  for (uint64_t seed : {2, 3, 4}) {
    auto x = gaussian(256 * 64, seed);
    // Outliers, as real weight rows have.
    for (size_t i = 0; i < x.size(); i += 97) x[i] *= 6;
    const auto y = roundtrip(DType::Q4_K, x);
    const double ours = rel_rmse(x, y), plain = rel_rmse(x, q4_min_max(x));
    EXPECT_LT(ours, 0.95 * plain) << seed;
    EXPECT_LT(ours, 0.12) << seed;
    // Every value within one step of its sub-block's (rounded) scale, and
    // inside the range the block can represent.
    for (size_t b = 0; b < x.size() / 256; ++b) {
      float span = 0;
      for (int i = 0; i < 256; ++i) span = std::max(span, std::fabs(x[b * 256 + i]));
      for (int i = 0; i < 256; ++i) ASSERT_LE(std::fabs(x[b * 256 + i] - y[b * 256 + i]), span / 7.0f) << b;
    }
  }
}

// The fit's sweep, the fits and the codes run as SIMD vectors
// (ops/cpu/block_quant_simd.cc): on every target their results are the
// plain loops' bit for bit, for sub-blocks of
// every kind (Gaussian, outliers, ties on the codes' rounding edges, tiny
// and huge ranges, one value apart from the rest), and so are the blocks.
TEST(BlockQuant, Q4SweepIsThePlainLoopBitForBitOnEveryTarget) {
  namespace dt = ds::ops::detail;
  constexpr int n = static_cast<int>(ds::ops::kQ4_KSubBlock);
  std::vector<std::vector<float>> subs;
  std::mt19937_64 g(11);
  for (int r = 0; r < 200; ++r) {
    auto x = gaussian(n, 100 + r, r % 3 == 0 ? 1e-30f : r % 3 == 1 ? 0.02f : 1e30f);
    if (r % 4 == 1) x[g() % n] *= 9;  // an outlier
    if (r % 4 == 2)                   // codes on rounding edges
      for (int i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int>(g() % 31) - 15) / 2;
    if (r % 4 == 3) std::fill(x.begin() + 1, x.end(), x[0] > 0 ? -x[0] : x[0]);  // all but one equal
    subs.push_back(x);
  }
  std::vector<float> row;  // the sub-blocks whose scales an f16 holds
  for (size_t r = 0; r < subs.size(); ++r)
    if (r % 3 != 2) row.insert(row.end(), subs[r].begin(), subs[r].end());
  row.resize(row.size() / 256 * 256);
  std::vector<uint8_t> want_k, want_1;
  int checked = 0, fits_found = 0;
  ds::test::for_each_simd_target([&](const char* target) {
    for (const auto& x : subs)
      for (bool any_offset : {false, true}) {
        // The sweep's inputs as the fit makes them.
        float lo = any_offset ? x[0] : 0.0f, hi = x[0], sq = 0;
        for (float v : x) lo = std::min(lo, v), hi = std::max(hi, v), sq += v * v;
        if (!(hi > lo)) continue;
        const float rms = std::sqrt(sq / n);
        float xl[n];
        double w[n], xd[n];
        for (int i = 0; i < n; ++i) w[i] = rms + std::fabs(x[i]), xd[i] = x[i], xl[i] = x[i] - lo;
        double plain[3 * dt::kQ4SweepPad], simd[3 * dt::kQ4SweepPad];
        dt::q4_sweep_sums_plain(xl, w, xd, hi - lo, plain);
        dt::q4_sweep_sums(xl, w, xd, hi - lo, simd);
        ASSERT_EQ(std::memcmp(plain, simd, sizeof plain), 0) << target;
        // Each candidate's fit and error.
        double sw = 0, swx = 0, swxx = 0;
        for (int i = 0; i < n; ++i) sw += w[i], swx += w[i] * xd[i], swxx += w[i] * xd[i] * xd[i];
        double fits_plain[3 * dt::kQ4SweepPad], fits[3 * dt::kQ4SweepPad];
        dt::q4_sweep_fits_plain(plain, sw, swx, swxx, any_offset, fits_plain);
        dt::q4_sweep_fits(plain, sw, swx, swxx, any_offset, fits);
        ASSERT_EQ(std::memcmp(fits_plain, fits, sizeof fits), 0) << target;
        int fitted = 0;
        for (int k = 0; k < dt::kQ4SweepSteps; ++k) fitted += std::isfinite(fits[2 * dt::kQ4SweepPad + k]);
        fits_found += fitted > 0;
        // The codes under one of those scales, against nearbyint's.
        const float a = static_cast<float>(fits[0]) > 0 ? static_cast<float>(fits[0]) : (hi - lo) / 15,
                    b = static_cast<float>(-fits[dt::kQ4SweepPad]);
        uint8_t q[n];
        dt::q4_codes(x.data(), a, b, q);
        for (int i = 0; i < n; ++i)
          ASSERT_EQ(q[i], static_cast<uint8_t>(std::clamp(std::nearbyint((x[i] + b) / a), 0.0f, 15.0f))) << target;
        ++checked;
      }
    // Whole blocks: every target writes the same bytes.
    std::vector<uint8_t> k(static_cast<size_t>(ds::ops::block_row_bytes(DType::Q4_K, row.size())));
    std::vector<uint8_t> one(static_cast<size_t>(ds::ops::block_row_bytes(DType::Q4_1, row.size())));
    ds::ops::quantize_blocks(DType::Q4_K, row.data(), row.size(), k.data());
    ds::ops::quantize_blocks(DType::Q4_1, row.data(), row.size(), one.data());
    if (want_k.empty()) want_k = k, want_1 = one;
    EXPECT_EQ(k, want_k) << target;
    EXPECT_EQ(one, want_1) << target;
  });
  EXPECT_GT(checked, 300);
  EXPECT_GT(fits_found * 2, checked);  // most sub-blocks have a fit, not only the plain rule
}

// q8_0's SIMD kernel against its plain loop (ggml's rule, roundf's halves
// away from zero): the same bytes on every target, halves and values just
// below them included.
TEST(BlockQuant, Q8_0KernelIsThePlainLoopOnEveryTarget) {
  auto x = gaussian(32 * 64, 21);
  for (size_t i = 0; i < x.size(); i += 13) x[i] *= 7;
  // A block whose d is 1 (its largest |x| is 127): x / d is x itself.
  const float edge[] = {127.0f,       2.5f,       -2.5f, 0.5f,  -0.5f, 126.5f, -126.5f, 0.49999997f,
                        -0.49999997f, 1.4999999f, 3.5f,  -3.5f, 0.0f,  -0.0f,  1e-30f,  64.5f};
  for (int i = 0; i < 32; ++i) x[i] = edge[i % 16] * (i < 16 ? 1.0f : -1.0f);
  std::fill(x.begin() + 32, x.begin() + 64, 0.0f);  // an all-zero block
  const int64_t blocks = static_cast<int64_t>(x.size()) / 32;
  std::vector<uint8_t> plain(static_cast<size_t>(blocks * 34));
  ds::ops::detail::q8_0_blocks_plain(x.data(), blocks, plain.data());
  EXPECT_EQ(static_cast<int8_t>(plain[2 + 1]), 3);   // 2.5 away from zero
  EXPECT_EQ(static_cast<int8_t>(plain[2 + 7]), 0);   // just below a half
  EXPECT_EQ(static_cast<int8_t>(plain[2 + 4]), -1);  // -0.5 away from zero
  ds::test::for_each_simd_target([&](const char* target) {
    std::vector<uint8_t> got(plain.size());
    ds::ops::detail::q8_0_blocks(x.data(), blocks, got.data());
    EXPECT_EQ(got, plain) << target;
  });
}

// q4_1: the same least-squares fit per block of 32, with an offset of
// either sign; against its plain min/max rule.
TEST(BlockQuant, Q4_1FitsBetterThanMinMax) {
  auto x = gaussian(32 * 512, 8);
  for (size_t i = 0; i < x.size(); i += 89) x[i] *= 6;
  for (size_t i = 0; i < x.size(); i += 64) x[i] += 0.05f;  // blocks whose values are all of one sign
  const auto y = roundtrip(DType::Q4_1, x);
  std::vector<float> plain(x.size());
  for (size_t b = 0; b < x.size() / 32; ++b) {
    float lo = x[b * 32], hi = lo;
    for (int i = 0; i < 32; ++i) lo = std::min(lo, x[b * 32 + i]), hi = std::max(hi, x[b * 32 + i]);
    const float d = ds::f16_to_f32(ds::f32_to_f16((hi - lo) / 15)), m = ds::f16_to_f32(ds::f32_to_f16(lo));
    for (int i = 0; i < 32; ++i)
      plain[b * 32 + i] = d * std::clamp(std::nearbyint((x[b * 32 + i] - m) / d), 0.0f, 15.0f) + m;
  }
  EXPECT_LT(rel_rmse(x, y), 0.95 * rel_rmse(x, plain));
  EXPECT_LT(rel_rmse(x, y), 0.1);
}

TEST(BlockQuant, Q6_KIsWithinHalfAStepAndFinerThanQ4_K) {
  // ggml's layout (the dequantization is ggml's own reading): each value
  // within one step d |sc_j| of its group (the group's largest value maps
  // to q - 32 = -32, so values of the other sign may clip at +31), and the
  // step the group's largest magnitude / 32 rounded up to a multiple of d.
  for (uint64_t seed : {1, 2}) {
    auto x = gaussian(4 * 256, seed);
    x[17] = 0.3f;  // an outlier in one group
    const auto y = roundtrip(DType::Q6_K, x);
    std::vector<uint8_t> q(4 * ds::ops::kQ6_KBytes);
    ds::ops::quantize_blocks(DType::Q6_K, x.data(), 1024, q.data());
    for (size_t g = 0; g < x.size() / 16; ++g) {
      const uint8_t* blk = q.data() + (g / 16) * ds::ops::kQ6_KBytes;
      const float d = ds::f16_to_f32(static_cast<uint16_t>(blk[208] | blk[209] << 8));
      const float step = d * std::fabs(static_cast<float>(static_cast<int8_t>(blk[192 + g % 16])));
      float amax = 0;
      for (size_t i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[16 * g + i]));
      EXPECT_LE(step, (amax / 32 + d) * 1.0001f) << g;
      for (size_t i = 0; i < 16; ++i) ASSERT_NEAR(y[16 * g + i], x[16 * g + i], step * 1.0001f) << seed << " " << g;
    }
    EXPECT_LT(rel_rmse(x, y), 0.04) << seed;
    EXPECT_LT(rel_rmse(x, y), 0.4 * rel_rmse(x, roundtrip(DType::Q4_K, x))) << seed;
  }
}

TEST(BlockQuant, EdgeBlocks) {
  for (DType t : ds::ops::kBlockFormats) {
    const int64_t n = ds::ops::block_values(t);
    std::vector<float> zero(static_cast<size_t>(n), 0.0f), neg(static_cast<size_t>(n), -0.5f),
        pos(static_cast<size_t>(n), 0.25f);
    EXPECT_EQ(roundtrip(t, zero), zero) << ds::dtype_name(t);
    for (float v : roundtrip(t, neg)) EXPECT_NEAR(v, -0.5f, 0.5f / 63) << ds::dtype_name(t);
    for (float v : roundtrip(t, pos)) EXPECT_NEAR(v, 0.25f, 0.25f / 63) << ds::dtype_name(t);
    // Small values: the f16 scales go subnormal (steps of 2^-24), the
    // values stay within a few percent of the largest.
    auto tiny = gaussian(n, 9, 1e-4f);
    float amax = 0;
    for (float v : tiny) amax = std::max(amax, std::fabs(v));
    const auto back = roundtrip(t, tiny);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(back[static_cast<size_t>(i)], tiny[static_cast<size_t>(i)], 0.1f * amax) << ds::dtype_name(t);
    std::vector<uint8_t> q(static_cast<size_t>(ds::ops::block_bytes(t)));
    auto huge = pos;
    huge[3] = 1e12f;  // a scale past f16
    EXPECT_THROW(ds::ops::quantize_blocks(t, huge.data(), n, q.data()), ds::Error);
    auto nan = pos;
    nan[5] = std::nanf("");
    EXPECT_THROW(ds::ops::quantize_blocks(t, nan.data(), n, q.data()), ds::Error);
    EXPECT_THROW(ds::ops::quantize_blocks(t, pos.data(), n - 1, q.data()), ds::Error);
  }
}

}  // namespace block_quant_test
}  // namespace
