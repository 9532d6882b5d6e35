// MaxText's seed-era mHC (ops/mhc.h, MhcKind::MaxTextV1), the variant a
// layer wrapper on any DeepSeek layer uses: the clipped Sinkhorn and the toy
// layer against the published float64 test vectors (a transcription of the
// formulas, not MaxText's own output), the forward against the
// double-precision twin, and the backward against its central differences.
// (Thread-count independence: mhc_test, for both kinds.)
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/mhc.h"
#include "ops/reference/mhc.h"
#include "test_util.h"

using ds::ops::MhcDims;
using ds::ops::MhcKind;

namespace {
namespace mhc_v1_test {

MhcDims v1_dims(int64_t tokens, int64_t streams, int64_t dim, int64_t iters) {
  MhcDims d;
  d.tokens = tokens;
  d.streams = streams;
  d.dim = dim;
  d.sinkhorn_iters = iters;
  d.eps = 1e-6f;
  d.norm_eps = 1e-6f;
  d.kind = MhcKind::MaxTextV1;
  return d;
}

const std::vector<float> kA = {0.5f,  -1.0f, 2.0f, 0.0f, 1.0f, 0.0f, -0.5f, 0.3f,
                               -2.0f, 1.5f,  0.0f, 0.7f, 0.2f, 0.1f, -0.3f, 1.0f};

// The inputs of a Sinkhorn alone through mhc_pre: fn = 0 makes every mix 0,
// so the comb logits are the res part of base (A, row-major).
struct SinkhornCase {
  MhcDims d;
  std::vector<float> x, fn, base, scale{1.0f, 1.0f, 1.0f};
  SinkhornCase(const std::vector<float>& A, int64_t iters) : d(v1_dims(1, 4, 2, iters)) {
    x.assign(4 * 2, 1.0f);
    fn.assign(static_cast<size_t>(d.mixes() * 8), 0.0f);
    base.assign(8, 0.0f);
    base.insert(base.end(), A.begin(), A.end());
  }
  std::vector<float> comb() const {
    std::vector<float> a(2), post(4), c(16);
    ds::ops::mhc_pre_forward(a.data(), post.data(), c.data(), x.data(), fn.data(), base.data(), scale.data(), d);
    return c;
  }
};

TEST(MhcV1, SinkhornMatchesTheTestVectors) {
  const std::vector<double> want = {.196148, .037219, .672114, .094519, .532491, .166584, .090842, .210082,
                                    .021444, .603897, .121149, .253509, .249916, .192301, .115895, .441889};
  const auto P = SinkhornCase(kA, 20).comb();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(P[i], want[i], 3e-6) << i;
  for (int64_t a = 0; a < 4; ++a) {
    double row = 0, col = 0;
    for (int64_t b = 0; b < 4; ++b) row += P[a * 4 + b], col += P[b * 4 + a];
    EXPECT_NEAR(row, 1.0, 1e-5);
    EXPECT_NEAR(col, 1.0, 1e-6);
  }
  // One iteration: the first row of the published matrix.
  const auto P1 = SinkhornCase(kA, 1).comb();
  const std::vector<double> row1 = {.219834, .04223, .70147, .107017};
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(P1[i], row1[i], 3e-6) << i;
  // Zero logits: every entry exactly 1/k.
  for (float v : SinkhornCase(std::vector<float>(16, 0.0f), 20).comb()) EXPECT_EQ(v, 0.25f);
  // DeepSeek-V4's variant (eps in every step) differs from v1 in the last digits only.
  SinkhornCase v4(kA, 20);
  v4.d.kind = MhcKind::DeepSeekV4;
  const auto P4 = v4.comb();
  EXPECT_NEAR(P4[2], .672112, 3e-6);
  EXPECT_NEAR(P4[9], .603894, 3e-6);
}

TEST(MhcV1, SinkhornGradientMatchesTheTestVector) {
  // L = sum W (.) P with W[i][j] = sin(i + 2j): through mhc_pre_backward with
  // dcomb = W, the res part of dbase is dL/dA.
  SinkhornCase c(kA, 20);
  std::vector<float> W(16);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 4; ++j) W[static_cast<size_t>(i * 4 + j)] = static_cast<float>(std::sin(i + 2.0 * j));
  const std::vector<float> da(2, 0.0f), dpost(4, 0.0f);
  std::vector<float> dx(8, 0.0f), dbase(24, 0.0f), dscale(3, 0.0f);
  ds::ops::mhc_pre_backward(dx.data(), nullptr, dbase.data(), dscale.data(), da.data(), dpost.data(), W.data(),
                            c.x.data(), c.fn.data(), c.base.data(), c.scale.data(), c.d);
  const std::vector<double> want = {-.005232, .072884,  -.029023, -.038629, .050105,  .078193,  -.087754, -.040544,
                                    .008934,  -.104982, -.003853, .099901,  -.053807, -.046095, .12063,   -.020728};
  for (size_t i = 0; i < 16; ++i) EXPECT_NEAR(dbase[8 + i], want[i], 5e-6) << i;
  // Adding a constant to a row or a column of A barely changes P.
  for (int64_t a = 0; a < 4; ++a) {
    double row = 0, col = 0;
    for (int64_t b = 0; b < 4; ++b) row += dbase[static_cast<size_t>(8 + a * 4 + b)], col += dbase[8 + b * 4 + a];
    EXPECT_NEAR(row, 0.0, 1e-5);
    EXPECT_NEAR(col, 0.0, 1e-5);
  }
}

TEST(MhcV1, ToyLayerMatchesTheTestVectors) {
  // k = 3 streams of d = 4, two tokens, norm_fn the identity, the branch tanh.
  const int64_t k = 3, D = 4, S = 2, kd = k * D;
  MhcDims d = v1_dims(S, k, D, 20);
  std::vector<float> x(static_cast<size_t>(S * kd));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < D; ++j)
        x[static_cast<size_t>((s * k + i) * D + j)] = static_cast<float>(std::sin(0.3 * (s + 1) * (i + 1) + 0.7 * j));
  // fn rows: W_pre, W_post, W_res columns, each entry times the norm scale
  // gamma_m = 1 + 0.1 cos m of its input m (the caller folds gamma in).
  std::vector<float> fn(static_cast<size_t>(d.mixes() * kd));
  for (int64_t m = 0; m < kd; ++m) {
    const double g = 1 + 0.1 * std::cos(static_cast<double>(m));
    for (int64_t i = 0; i < k; ++i) {
      fn[static_cast<size_t>(i * kd + m)] = static_cast<float>(0.05 * std::sin(m + 2.0 * i + 1) * g);
      fn[static_cast<size_t>((k + i) * kd + m)] = static_cast<float>(0.05 * std::cos(static_cast<double>(m - i)) * g);
    }
    for (int64_t r = 0; r < k * k; ++r)
      fn[static_cast<size_t>((2 * k + r) * kd + m)] = static_cast<float>(0.05 * std::sin(0.5 * m + r) * g);
  }
  std::vector<float> base(static_cast<size_t>(d.mixes()));
  for (int64_t i = 0; i < k; ++i) {
    base[static_cast<size_t>(i)] = static_cast<float>(0.1 * i);
    base[static_cast<size_t>(k + i)] = static_cast<float>(-0.1 * i);
    for (int64_t j = 0; j < k; ++j) base[static_cast<size_t>(2 * k + i * k + j)] = i == j ? 0.2f : -0.1f;
  }
  const std::vector<float> scale = {0.7f, 0.9f, 1.1f};
  std::vector<float> a(static_cast<size_t>(S * D)), post(static_cast<size_t>(S * k)),
      comb(static_cast<size_t>(S * k * k));
  ds::ops::mhc_pre_forward(a.data(), post.data(), comb.data(), x.data(), fn.data(), base.data(), scale.data(), d);
  const double h_pre[3] = {.501702, .512666, .558295}, h_post[3] = {.985923, .967669, .933258};
  const double h_res[9] = {.42016, .29392, .28592, .264221, .40683, .328949, .315619, .29925, .385131};
  for (int64_t j = 0; j < D; ++j) {
    double want = 0;
    for (int64_t i = 0; i < k; ++i) want += h_pre[i] * x[static_cast<size_t>(i * D + j)];
    EXPECT_NEAR(a[static_cast<size_t>(j)], want, 3e-6) << "branch input " << j;
  }
  for (int64_t i = 0; i < k; ++i) EXPECT_NEAR(post[static_cast<size_t>(i)], h_post[i], 3e-6) << i;
  for (int64_t i = 0; i < k * k; ++i) EXPECT_NEAR(comb[static_cast<size_t>(i)], h_res[i], 3e-6) << i;
  std::vector<float> f(a.size()), y(x.size());
  for (size_t i = 0; i < a.size(); ++i) f[i] = std::tanh(a[i]);
  ds::ops::mhc_post_forward(y.data(), f.data(), x.data(), post.data(), comb.data(), d);
  const double y00[4] = {1.214618, 1.811332, 1.760824, .996041}, y12[4] = {1.669223, 1.642321, .97788, -.425249};
  for (int64_t j = 0; j < D; ++j) {
    EXPECT_NEAR(y[static_cast<size_t>(j)], y00[j], 3e-6) << "y[0][0] " << j;
    EXPECT_NEAR(y[static_cast<size_t>((1 * k + 2) * D + j)], y12[j], 3e-6) << "y[1][2] " << j;
  }
}

TEST(MhcV1, PreMatchesTheReferenceAndItsCentralDifferences) {
  constexpr int64_t T = 3, n = 4, D = 16, iters = 20;
  const MhcDims d = v1_dims(T, n, D, iters);
  const int64_t m = d.mixes(), nd = n * D;
  const auto x = ds::test::randn(T * nd, 71), fn = ds::test::randn(m * nd, 72, 0.3f),
             base = ds::test::randn(m, 73, 0.5f);
  const std::vector<float> scale = {0.8f, 1.1f, 1.7f};
  using ds::test::to_double;
  std::vector<float> a(T * D), post(T * n), comb(T * n * n);
  ds::ops::mhc_pre_forward(a.data(), post.data(), comb.data(), x.data(), fn.data(), base.data(), scale.data(), d);
  std::vector<double> ra, rpost, rcomb;
  ds::ref::mhc_pre(ra, rpost, rcomb, to_double(x), to_double(fn), to_double(base), to_double(scale), T, n, D, iters,
                   1e-6, 1e-6, /*v1=*/true);
  ds::test::expect_close(a, ra, 1e-5, 0, "a");
  ds::test::expect_close(post, rpost, 1e-5, 0, "post");
  ds::test::expect_close(comb, rcomb, 1e-5, 0, "comb");

  const auto wa = ds::test::randn(T * D, 80), wp = ds::test::randn(T * n, 81), wc = ds::test::randn(T * n * n, 82);
  auto loss = [&](const std::vector<double>& X, const std::vector<double>& F, const std::vector<double>& B,
                  const std::vector<double>& Sc) {
    std::vector<double> A, P, C;
    ds::ref::mhc_pre(A, P, C, X, F, B, Sc, T, n, D, iters, 1e-6, 1e-6, true);
    double l = 0;
    for (size_t i = 0; i < A.size(); ++i) l += wa[i] * A[i];
    for (size_t i = 0; i < P.size(); ++i) l += wp[i] * P[i];
    for (size_t i = 0; i < C.size(); ++i) l += wc[i] * C[i];
    return l;
  };
  std::vector<float> dx(T * nd, 0.0f), dfn(m * nd, 0.0f), dbase(m, 0.0f), dscale(3, 0.0f);
  ds::ops::mhc_pre_backward(dx.data(), dfn.data(), dbase.data(), dscale.data(), wa.data(), wp.data(), wc.data(),
                            x.data(), fn.data(), base.data(), scale.data(), d);
  const auto X = to_double(x), F = to_double(fn), B = to_double(base), Sc = to_double(scale);
  ds::test::expect_close(dx, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(v, F, B, Sc); }, X),
                         2e-4, 1e-6, "dx");
  ds::test::expect_close(dfn,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, v, B, Sc); }, F),
                         2e-4, 1e-6, "dfn");
  ds::test::expect_close(dbase,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, v, Sc); }, B),
                         2e-4, 1e-6, "dbase");
  ds::test::expect_close(dscale,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, B, v); }, Sc),
                         2e-4, 1e-6, "dscale");
}

TEST(MhcV1, ClippedSumsPassTheirGradientUnscaled) {
  // Row 0's logits far below the rest: after the column softmax its sum is
  // about 1e-26, below the 1e-12 floor, so the first row steps divide it by
  // the floor, a constant. Forward and backward against the twin in double.
  std::vector<float> A = kA;
  for (int64_t j = 0; j < 4; ++j) A[static_cast<size_t>(j)] = -60.0f + 0.5f * static_cast<float>(j);
  SinkhornCase c(A, 20);
  const auto P = c.comb();
  std::vector<double> R(A.begin(), A.end());
  ds::ref::mhc_sinkhorn(R.data(), 4, 20, 1e-6, /*v1=*/true);
  ds::test::expect_close(P, R, 1e-4, 1e-30, "P");
  std::vector<float> W(16);
  for (size_t i = 0; i < 16; ++i) W[i] = static_cast<float>(std::cos(0.7 * static_cast<double>(i)));
  const std::vector<float> da(2, 0.0f), dpost(4, 0.0f);
  std::vector<float> dx(8, 0.0f), dbase(24, 0.0f);
  ds::ops::mhc_pre_backward(dx.data(), nullptr, dbase.data(), nullptr, da.data(), dpost.data(), W.data(), c.x.data(),
                            c.fn.data(), c.base.data(), c.scale.data(), c.d);
  auto loss = [&](const std::vector<double>& logits) {
    std::vector<double> M = logits;
    ds::ref::mhc_sinkhorn(M.data(), 4, 20, 1e-6, true);
    double l = 0;
    for (size_t i = 0; i < 16; ++i) l += W[i] * M[i];
    return l;
  };
  const auto g = ds::test::numeric_grad(loss, std::vector<double>(A.begin(), A.end()));
  ds::test::expect_close(std::vector<float>(dbase.begin() + 8, dbase.end()), g, 2e-4, 1e-6, "dA");
}

}  // namespace mhc_v1_test
}  // namespace
