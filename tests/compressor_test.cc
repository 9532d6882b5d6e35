// DeepSeek-V4's compressor pooling (ops/compressor.h): plain and overlapping
// windows against the double reference, a hand-checked case, the backward
// against central differences, thread-count and vector-lane independence.
#include "ops/compressor.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "ops/reference/compressor.h"
#include "test_util.h"

using ds::ops::CompressorDims;

namespace {
namespace compressor_test {

CompressorDims dims(int64_t tokens, int64_t dim, int64_t ratio, bool overlap) {
  CompressorDims d;
  d.tokens = tokens;
  d.dim = dim;
  d.ratio = ratio;
  d.overlap = overlap;
  return d;
}

TEST(Compressor, PoolsAsTheReferenceDoes) {
  // 4 whole windows and 3 leftover tokens (no entry for them).
  for (bool overlap : {false, true})
    for (int64_t m : {1, 4, 5}) {
      const auto d = dims(4 * m + 3, 6, m, overlap);
      const auto P = ds::test::randn(d.tokens * d.width(), 1), Z = ds::test::randn(d.tokens * d.width(), 2, 2.0f);
      std::vector<float> out(d.entries() * d.dim);
      ds::ops::compressor_pool_forward(out.data(), P.data(), Z.data(), d);
      ds::test::expect_close(out, ds::ref::compressor_pool(ds::test::to_double(P), ds::test::to_double(Z), d), 1e-6, 0,
                             overlap ? "overlap" : "plain");
    }
}

TEST(Compressor, HandCheckedWindows) {
  // m = 2, one channel, equal gates: each entry is a mean. Plain: entry b is
  // the mean of tokens 2b, 2b+1. Overlap: entry 1 is the mean of tokens 0, 1
  // (first channel) and 2, 3 (second channel); entry 0 of tokens 0, 1's
  // second channel only.
  const std::vector<float> P1 = {1, 2, 3, 4}, Z1(4, 0.5f);
  std::vector<float> out(2);
  ds::ops::compressor_pool_forward(out.data(), P1.data(), Z1.data(), dims(4, 1, 2, false));
  EXPECT_EQ(out, (std::vector<float>{1.5f, 3.5f}));
  const std::vector<float> P2 = {1, 10, 2, 20, 3, 30, 4, 40}, Z2(8, 0.0f);  // [token][first, second]
  ds::ops::compressor_pool_forward(out.data(), P2.data(), Z2.data(), dims(4, 1, 2, true));
  EXPECT_EQ(out[0], 15.0f);                     // (10 + 20) / 2
  EXPECT_EQ(out[1], (1.0f + 2 + 30 + 40) / 4);  // previous window's first halves, this one's second
  // A gate far above the others takes its slot's value.
  std::vector<float> Z3 = {0, 0, 80, 0};
  ds::ops::compressor_pool_forward(out.data(), P1.data(), Z3.data(), dims(4, 1, 2, false));
  EXPECT_EQ(out[1], 3.0f);
}

TEST(Compressor, BackwardMatchesCentralDifferences) {
  for (bool overlap : {false, true}) {
    const auto d = dims(3 * 4 + 2, 5, 4, overlap);
    const auto P = ds::test::randn(d.tokens * d.width(), 3), Z = ds::test::randn(d.tokens * d.width(), 4, 2.0f);
    const auto g = ds::test::randn(d.entries() * d.dim, 5);
    const auto Pd = ds::test::to_double(P), Zd = ds::test::to_double(Z), G = ds::test::to_double(g);
    std::vector<float> dP(P.size(), 0.25f), dZ(Z.size(), -0.5f);  // accumulated into
    ds::ops::compressor_pool_backward(dP.data(), dZ.data(), g.data(), P.data(), Z.data(), d);
    for (auto& v : dP) v -= 0.25f;
    for (auto& v : dZ) v += 0.5f;
    auto fP = [&](const std::vector<double>& v) {
      return ds::test::weighted_sum(ds::ref::compressor_pool(v, Zd, d), G);
    };
    auto fZ = [&](const std::vector<double>& v) {
      return ds::test::weighted_sum(ds::ref::compressor_pool(Pd, v, d), G);
    };
    ds::test::expect_close(dP, ds::test::numeric_grad(fP, Pd), 1e-5, 1e-6, "dP");
    ds::test::expect_close(dZ, ds::test::numeric_grad(fZ, Zd), 1e-5, 1e-6, "dZ");
    // The tokens past the last whole window, and with overlap the last
    // window's first halves, get no gradient.
    for (int64_t i = d.entries() * d.ratio * d.width(); i < static_cast<int64_t>(dP.size()); ++i)
      EXPECT_EQ(dP[i], 0.0f);
    if (overlap) {
      for (int64_t t = (d.entries() - 1) * d.ratio; t < d.entries() * d.ratio; ++t) {
        for (int64_t i = 0; i < d.dim; ++i) {
          EXPECT_EQ(dP[t * d.width() + i], 0.0f);
        }
      }
    }
  }
}

TEST(Compressor, ResultsDoNotDependOnTheThreadCount) {
  const auto d = dims(64 * 4, 128, 4, true);
  const auto P = ds::test::randn(d.tokens * d.width(), 6), Z = ds::test::randn(d.tokens * d.width(), 7);
  const auto g = ds::test::randn(d.entries() * d.dim, 8);
  ds::test::expect_same_for_any_thread_count([&] {
    std::vector<float> out(d.entries() * d.dim), dP(P.size(), 0.0f), dZ(Z.size(), 0.0f);
    ds::ops::compressor_pool_forward(out.data(), P.data(), Z.data(), d);
    ds::ops::compressor_pool_backward(dP.data(), dZ.data(), g.data(), P.data(), Z.data(), d);
    out.insert(out.end(), dP.begin(), dP.end());
    out.insert(out.end(), dZ.begin(), dZ.end());
    return out;
  });
}

// A channel's result is the same whether it is one lane of a full vector or
// one of the channels past the last whole vector (computed a lane at a
// time): every channel of a 37-wide entry against the same channel pooled
// alone, forward and backward, bit for bit.
TEST(Compressor, ChannelsDoNotDependOnTheirLane) {
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "plain");
    const int64_t D = 37, halves = overlap ? 2 : 1;
    const auto d = dims(5 * 4, D, 4, overlap), d1 = dims(5 * 4, 1, 4, overlap);
    const auto P = ds::test::randn(d.tokens * d.width(), 9), Z = ds::test::randn(d.tokens * d.width(), 10, 2.0f);
    const auto g = ds::test::randn(d.entries() * D, 11);
    std::vector<float> out(d.entries() * D), dP(P.size(), 0.0f), dZ(Z.size(), 0.0f);
    ds::ops::compressor_pool_forward(out.data(), P.data(), Z.data(), d);
    ds::ops::compressor_pool_backward(dP.data(), dZ.data(), g.data(), P.data(), Z.data(), d);
    for (int64_t c = 0; c < D; ++c) {
      // Channel c alone: its column of each half of P and Z, its column of g.
      std::vector<float> P1(d.tokens * halves), Z1(P1.size()), g1(d.entries()), out1(d.entries());
      std::vector<float> dP1(P1.size(), 0.0f), dZ1(P1.size(), 0.0f);
      for (int64_t t = 0; t < d.tokens; ++t)
        for (int64_t h = 0; h < halves; ++h) {
          P1[t * halves + h] = P[t * d.width() + h * D + c];
          Z1[t * halves + h] = Z[t * d.width() + h * D + c];
        }
      for (int64_t b = 0; b < d.entries(); ++b) g1[b] = g[b * D + c];
      ds::ops::compressor_pool_forward(out1.data(), P1.data(), Z1.data(), d1);
      ds::ops::compressor_pool_backward(dP1.data(), dZ1.data(), g1.data(), P1.data(), Z1.data(), d1);
      for (int64_t b = 0; b < d.entries(); ++b) ASSERT_EQ(out[b * D + c], out1[b]) << "channel " << c << " entry " << b;
      for (int64_t t = 0; t < d.tokens; ++t)
        for (int64_t h = 0; h < halves; ++h) {
          ASSERT_EQ(dP[t * d.width() + h * D + c], dP1[t * halves + h]) << "channel " << c << " token " << t;
          ASSERT_EQ(dZ[t * d.width() + h * D + c], dZ1[t * halves + h]) << "channel " << c << " token " << t;
        }
    }
  }
}

TEST(Compressor, BadDimsAreErrors) {
  std::vector<float> buf(16);
  EXPECT_THROW(ds::ops::compressor_pool_forward(buf.data(), buf.data(), buf.data(), dims(4, 1, 0, false)), ds::Error);
  EXPECT_THROW(ds::ops::compressor_pool_forward(buf.data(), buf.data(), buf.data(), dims(4, 0, 2, false)), ds::Error);
}

}  // namespace compressor_test
}  // namespace
