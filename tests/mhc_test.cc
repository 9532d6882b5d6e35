// DeepSeek-V4's mHC (ops/mhc.h): every forward against the double-precision
// reference twin, the backwards against central differences of the twin,
// thread-count independence, and mhc_pre / mhc_post / mhc_head against values
// computed by the independent float64 V4 reference (tests/data/v4/mhc.json).
#include "ops/mhc.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/text_input.h"
#include "ops/reference/mhc.h"
#include "test_util.h"

using ds::ops::MhcDims;

namespace {
namespace mhc_test {

constexpr int64_t kT = 3, kN = 4, kD = 24, kIters = 20;

struct Inputs {
  std::vector<float> x, fn, base, scale, o, hfn, hbase, hscale;
};

// Random inputs; the mixes come out of order 1 so that every Sinkhorn matrix
// is far from uniform (its gradient then matters).
Inputs make_inputs(uint64_t seed) {
  Inputs in;
  const int64_t m = (2 + kN) * kN, nd = kN * kD;
  in.x = ds::test::randn(kT * nd, seed);
  in.fn = ds::test::randn(m * nd, seed + 1, 0.3f);
  in.base = ds::test::randn(m, seed + 2, 0.5f);
  in.scale = {0.8f, 1.1f, 1.7f};
  in.o = ds::test::randn(kT * kD, seed + 3);
  in.hfn = ds::test::randn(kN * nd, seed + 4, 0.3f);
  in.hbase = ds::test::randn(kN, seed + 5, 0.5f);
  in.hscale = {0.9f};
  return in;
}

MhcDims dims() {
  MhcDims d;
  d.tokens = kT;
  d.streams = kN;
  d.dim = kD;
  d.sinkhorn_iters = kIters;
  d.eps = 1e-6f;
  d.norm_eps = 1e-6f;
  return d;
}

TEST(Mhc, ForwardsMatchTheReference) {
  const auto in = make_inputs(1);
  const auto d = dims();
  std::vector<float> a(kT * kD), post(kT * kN), comb(kT * kN * kN);
  ds::ops::mhc_pre_forward(a.data(), post.data(), comb.data(), in.x.data(), in.fn.data(), in.base.data(),
                           in.scale.data(), d);
  std::vector<double> ra, rpost, rcomb;
  using ds::test::to_double;
  ds::ref::mhc_pre(ra, rpost, rcomb, to_double(in.x), to_double(in.fn), to_double(in.base), to_double(in.scale), kT, kN,
                   kD, kIters, 1e-6, 1e-6);
  ds::test::expect_close(a, ra, 1e-5, 0, "a");
  ds::test::expect_close(post, rpost, 1e-5, 0, "post");
  ds::test::expect_close(comb, rcomb, 1e-5, 0, "comb");
  // Columns of comb sum to 1 (the last normalization), rows nearly.
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t k = 0; k < kN; ++k) {
      double col = 0;
      for (int64_t j = 0; j < kN; ++j) col += comb[(t * kN + j) * kN + k];
      EXPECT_NEAR(col, 1.0, 1e-5);
    }
  std::vector<float> y(kT * kN * kD);
  ds::ops::mhc_post_forward(y.data(), in.o.data(), in.x.data(), post.data(), comb.data(), d);
  ds::test::expect_close(y, ds::ref::mhc_post(to_double(in.o), to_double(in.x), rpost, rcomb, kT, kN, kD), 1e-5, 0,
                         "post");
  std::vector<float> h(kT * kD);
  ds::ops::mhc_head_forward(h.data(), in.x.data(), in.hfn.data(), in.hbase.data(), in.hscale.data(), d);
  ds::test::expect_close(h,
                         ds::ref::mhc_head(to_double(in.x), to_double(in.hfn), to_double(in.hbase),
                                           to_double(in.hscale), kT, kN, kD, 1e-6, 1e-6),
                         1e-5, 0, "head");
}

// DeepSeek-V4.1's lagged mHC takes the pre weights out and collapses the
// streams with another sub-layer's: the pre weights are those that give
// mhc_pre's a, and the collapse is their weighted sum.
TEST(Mhc, PreWeightsAndCollapse) {
  const auto in = make_inputs(7);
  const auto d = dims();
  std::vector<float> a(kT * kD), post(kT * kN), comb(kT * kN * kN), pre(kT * kN), post2(kT * kN), comb2(kT * kN * kN),
      a2(kT * kD);
  ds::ops::mhc_pre_forward(a.data(), post.data(), comb.data(), in.x.data(), in.fn.data(), in.base.data(),
                           in.scale.data(), d);
  ds::ops::mhc_pre_forward(nullptr, post2.data(), comb2.data(), in.x.data(), in.fn.data(), in.base.data(),
                           in.scale.data(), d, pre.data());
  EXPECT_EQ(post2, post);
  EXPECT_EQ(comb2, comb);
  ds::ops::mhc_collapse(a2.data(), in.x.data(), pre.data(), kT, kN, kD);
  EXPECT_EQ(a2, a);
  // The collapse with weights of its own: the sum, in double.
  const auto w = ds::test::randn(kT * kN, 9);
  ds::ops::mhc_collapse(a2.data(), in.x.data(), w.data(), kT, kN, kD);
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t i = 0; i < kD; ++i) {
      double want = 0;
      for (int64_t j = 0; j < kN; ++j) want += double(w[t * kN + j]) * in.x[(t * kN + j) * kD + i];
      EXPECT_NEAR(a2[t * kD + i], want, 1e-5) << t << " " << i;
    }
}

TEST(Mhc, PreBackwardMatchesCentralDifferences) {
  // L = sum(wa a) + sum(wp post) + sum(wc comb) for fixed random weights.
  const auto in = make_inputs(7);
  const auto d = dims();
  const auto wa = ds::test::randn(kT * kD, 20), wp = ds::test::randn(kT * kN, 21),
             wc = ds::test::randn(kT * kN * kN, 22);
  using ds::test::to_double;
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& fn, const std::vector<double>& base,
                  const std::vector<double>& scale) {
    std::vector<double> a, post, comb;
    ds::ref::mhc_pre(a, post, comb, x, fn, base, scale, kT, kN, kD, kIters, 1e-6, 1e-6);
    double l = 0;
    for (size_t i = 0; i < a.size(); ++i) l += wa[i] * a[i];
    for (size_t i = 0; i < post.size(); ++i) l += wp[i] * post[i];
    for (size_t i = 0; i < comb.size(); ++i) l += wc[i] * comb[i];
    return l;
  };
  const int64_t m = (2 + kN) * kN;
  std::vector<float> dx(kT * kN * kD, 0.5f), dfn(m * kN * kD, 0.0f), dbase(m, 0.0f), dscale(3, 0.0f);
  ds::ops::mhc_pre_backward(dx.data(), dfn.data(), dbase.data(), dscale.data(), wa.data(), wp.data(), wc.data(),
                            in.x.data(), in.fn.data(), in.base.data(), in.scale.data(), d);
  for (auto& v : dx) v -= 0.5f;  // dx accumulates
  const auto X = to_double(in.x), F = to_double(in.fn), B = to_double(in.base), S = to_double(in.scale);
  const auto gx = ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(v, F, B, S); }, X);
  const auto gf = ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, v, B, S); }, F);
  const auto gb = ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, v, S); }, B);
  const auto gs = ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, B, v); }, S);
  ds::test::expect_close(dx, gx, 2e-4, 1e-6, "dx");
  ds::test::expect_close(dfn, gf, 2e-4, 1e-6, "dfn");
  ds::test::expect_close(dbase, gb, 2e-4, 1e-6, "dbase");
  ds::test::expect_close(dscale, gs, 2e-4, 1e-6, "dscale");
}

// DeepSeek-V4.1's lagged mHC: a sub-layer's pre weights collapse other
// streams y (the next sub-layer's). L = sum(wa collapse(y, pre(x))) +
// sum(wp post(x)) + sum(wc comb(x)); the pre weights' gradient comes from
// the collapse's backward and enters mhc_pre_backward with no da.
TEST(Mhc, LaggedPreBackwardMatchesCentralDifferences) {
  const auto in = make_inputs(11);
  const auto d = dims();
  const auto y = ds::test::randn(kT * kN * kD, 30), wa = ds::test::randn(kT * kD, 31),
             wp = ds::test::randn(kT * kN, 32), wc = ds::test::randn(kT * kN * kN, 33);
  using ds::test::to_double;
  const int64_t m = (2 + kN) * kN, nd = kN * kD;
  // pre(x) in double: sigmoid(mix_j scale_0 + base_j) + eps, mix = (fn v) rsqrt(mean(v^2) + eps).
  auto pre_of = [&](const std::vector<double>& x, const std::vector<double>& fn, const std::vector<double>& base,
                    const std::vector<double>& scale) {
    std::vector<double> pre(kT * kN);
    for (int64_t t = 0; t < kT; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < nd; ++i) ss += x[t * nd + i] * x[t * nd + i];
      const double r = 1.0 / std::sqrt(ss / double(nd) + 1e-6);
      for (int64_t j = 0; j < kN; ++j) {
        double mix = 0;
        for (int64_t i = 0; i < nd; ++i) mix += fn[j * nd + i] * x[t * nd + i];
        pre[t * kN + j] = 1.0 / (1.0 + std::exp(-(mix * r * scale[0] + base[j]))) + 1e-6;
      }
    }
    return pre;
  };
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& fn, const std::vector<double>& base,
                  const std::vector<double>& scale, const std::vector<double>& yy) {
    std::vector<double> a, post, comb;
    ds::ref::mhc_pre(a, post, comb, x, fn, base, scale, kT, kN, kD, kIters, 1e-6, 1e-6);
    const auto pre = pre_of(x, fn, base, scale);
    double l = 0;
    for (int64_t t = 0; t < kT; ++t)
      for (int64_t j = 0; j < kN; ++j)
        for (int64_t i = 0; i < kD; ++i) l += wa[t * kD + i] * pre[t * kN + j] * yy[(t * kN + j) * kD + i];
    for (size_t i = 0; i < post.size(); ++i) l += wp[i] * post[i];
    for (size_t i = 0; i < comb.size(); ++i) l += wc[i] * comb[i];
    return l;
  };
  std::vector<float> pre(kT * kN), post(kT * kN), comb(kT * kN * kN);
  ds::ops::mhc_pre_forward(nullptr, post.data(), comb.data(), in.x.data(), in.fn.data(), in.base.data(),
                           in.scale.data(), d, pre.data());
  std::vector<float> dy(kT * kN * kD, 0.0f), dpre(kT * kN), dx(kT * kN * kD, 0.0f), dfn(m * nd, 0.0f), dbase(m, 0.0f),
      dscale(3, 0.0f);
  ds::ops::mhc_collapse_backward(dy.data(), dpre.data(), wa.data(), y.data(), pre.data(), kT, kN, kD);
  ds::ops::mhc_pre_backward(dx.data(), dfn.data(), dbase.data(), dscale.data(), nullptr, wp.data(), wc.data(),
                            in.x.data(), in.fn.data(), in.base.data(), in.scale.data(), d, dpre.data());
  const auto X = to_double(in.x), F = to_double(in.fn), B = to_double(in.base), S = to_double(in.scale),
             Y = to_double(y);
  ds::test::expect_close(dx,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(v, F, B, S, Y); }, X),
                         2e-4, 1e-6, "dx");
  ds::test::expect_close(dfn,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, v, B, S, Y); }, F),
                         2e-4, 1e-6, "dfn");
  ds::test::expect_close(dbase,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, v, S, Y); }, B),
                         2e-4, 1e-6, "dbase");
  ds::test::expect_close(dscale,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, B, v, Y); }, S),
                         2e-4, 1e-6, "dscale");
  ds::test::expect_close(dy,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, B, S, v); }, Y),
                         2e-4, 1e-6, "dy");
}

TEST(Mhc, PostBackwardMatchesCentralDifferences) {
  const auto in = make_inputs(11);
  const auto d = dims();
  using ds::test::to_double;
  std::vector<double> ra, rpost, rcomb;
  ds::ref::mhc_pre(ra, rpost, rcomb, to_double(in.x), to_double(in.fn), to_double(in.base), to_double(in.scale), kT, kN,
                   kD, kIters, 1e-6, 1e-6);
  const auto w = ds::test::randn(kT * kN * kD, 30);
  const auto O = to_double(in.o), X = to_double(in.x);
  auto loss = [&](const std::vector<double>& o, const std::vector<double>& x, const std::vector<double>& post,
                  const std::vector<double>& comb) {
    const auto y = ds::ref::mhc_post(o, x, post, comb, kT, kN, kD);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += w[i] * y[i];
    return l;
  };
  const std::vector<float> post(rpost.begin(), rpost.end()), comb(rcomb.begin(), rcomb.end());
  std::vector<float> d_o(kT * kD, 0.0f), dx(kT * kN * kD, 0.0f), dpost(kT * kN, 0.0f), dcomb(kT * kN * kN, 0.0f);
  ds::ops::mhc_post_backward(d_o.data(), dx.data(), dpost.data(), dcomb.data(), w.data(), in.o.data(), in.x.data(),
                             post.data(), comb.data(), d);
  const auto P = to_double(post), C = to_double(comb);
  ds::test::expect_close(d_o, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(v, X, P, C); }, O),
                         1e-4, 1e-6, "do");
  ds::test::expect_close(dx, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(O, v, P, C); }, X),
                         1e-4, 1e-6, "dx");
  ds::test::expect_close(dpost,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(O, X, v, C); }, P),
                         1e-4, 1e-6, "dpost");
  ds::test::expect_close(dcomb,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(O, X, P, v); }, C),
                         1e-4, 1e-6, "dcomb");
}

TEST(Mhc, HeadBackwardMatchesCentralDifferences) {
  const auto in = make_inputs(13);
  const auto d = dims();
  using ds::test::to_double;
  const auto w = ds::test::randn(kT * kD, 31);
  const auto X = to_double(in.x), F = to_double(in.hfn), B = to_double(in.hbase), S = to_double(in.hscale);
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& fn, const std::vector<double>& base,
                  const std::vector<double>& scale) {
    const auto y = ds::ref::mhc_head(x, fn, base, scale, kT, kN, kD, 1e-6, 1e-6);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += w[i] * y[i];
    return l;
  };
  std::vector<float> dx(kT * kN * kD, 0.0f), dfn(kN * kN * kD, 0.0f), dbase(kN, 0.0f), dscale(1, 0.0f);
  ds::ops::mhc_head_backward(dx.data(), dfn.data(), dbase.data(), dscale.data(), w.data(), in.x.data(), in.hfn.data(),
                             in.hbase.data(), in.hscale.data(), d);
  ds::test::expect_close(dx, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(v, F, B, S); }, X),
                         2e-4, 1e-6, "dx");
  ds::test::expect_close(dfn, ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, v, B, S); }, F),
                         2e-4, 1e-6, "dfn");
  ds::test::expect_close(dbase,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, v, S); }, B),
                         2e-4, 1e-6, "dbase");
  ds::test::expect_close(dscale,
                         ds::test::numeric_grad([&](const std::vector<double>& v) { return loss(X, F, B, v); }, S),
                         2e-4, 1e-6, "dscale");
}

TEST(Mhc, ResultsDoNotDependOnTheThreadCount) {
  // Enough tokens and width for the threaded paths; DeepSeek-V4's mHC and
  // MaxText's seed-era one.
  for (const auto kind : {ds::ops::MhcKind::DeepSeekV4, ds::ops::MhcKind::MaxTextV1}) {
    MhcDims d = dims();
    d.tokens = 40;
    d.dim = 256;
    d.kind = kind;
    const int64_t nd = d.streams * d.dim, m = d.mixes();
    const auto x = ds::test::randn(d.tokens * nd, 41), fn = ds::test::randn(m * nd, 42, 0.05f),
               base = ds::test::randn(m, 43), da = ds::test::randn(d.tokens * d.dim, 44),
               dp = ds::test::randn(d.tokens * d.streams, 45),
               dc = ds::test::randn(d.tokens * d.streams * d.streams, 46);
    const std::vector<float> scale = {1.0f, 1.0f, 1.0f};
    ds::test::expect_same_for_any_thread_count([&] {
      std::vector<float> a(d.tokens * d.dim), post(d.tokens * d.streams), comb(d.tokens * d.streams * d.streams);
      ds::ops::mhc_pre_forward(a.data(), post.data(), comb.data(), x.data(), fn.data(), base.data(), scale.data(), d);
      std::vector<float> dx(d.tokens * nd, 0.0f), dfn(m * nd, 0.0f), dbase(m, 0.0f), dscale(3, 0.0f);
      ds::ops::mhc_pre_backward(dx.data(), dfn.data(), dbase.data(), dscale.data(), da.data(), dp.data(), dc.data(),
                                x.data(), fn.data(), base.data(), scale.data(), d);
      a.insert(a.end(), comb.begin(), comb.end());
      a.insert(a.end(), dx.begin(), dx.end());
      a.insert(a.end(), dfn.begin(), dfn.end());
      return a;
    });
  }
}

TEST(Mhc, BadDimsAreErrors) {
  MhcDims d = dims();
  d.sinkhorn_iters = 0;
  std::vector<float> buf(4096);
  EXPECT_THROW(
      ds::ops::mhc_pre_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), d),
      ds::Error);
  d = dims();
  std::vector<float> x(kT * kN * kD);
  EXPECT_THROW(ds::ops::mhc_post_forward(x.data(), buf.data(), x.data(), buf.data(), buf.data(), d), ds::Error);
}

TEST(Mhc, MatchesTheIndependentV4Reference) {
  // Layer 1's hc_attn_* and the hc_head_* of a tiny random V4 folder, on
  // random streams, computed in float64 by tests/reference/deepseek_v4_ref.py
  // (tests/reference/make_v4_op_fixtures.py writes the file).
  const nlohmann::json j =
      nlohmann::json::parse(ds::io::read_file(DEEPSEEK_SOURCE_DIR "/tests/data/v4/mhc.json", "mHC fixture"));
  auto vec = [&](const char* k) { return j.at(k).template get<std::vector<float>>(); };
  MhcDims d;
  d.tokens = j.at("tokens");
  d.streams = j.at("streams");
  d.dim = j.at("dim");
  d.sinkhorn_iters = j.at("sinkhorn_iters");
  d.eps = j.at("eps");
  d.norm_eps = j.at("norm_eps");
  const auto x = vec("x"), o = vec("o"), fn = vec("fn"), base = vec("base"), scale = vec("scale");
  std::vector<float> a(d.tokens * d.dim), post(d.tokens * d.streams), comb(d.tokens * d.streams * d.streams);
  ds::ops::mhc_pre_forward(a.data(), post.data(), comb.data(), x.data(), fn.data(), base.data(), scale.data(), d);
  ds::test::expect_close(a, vec("a"), 1e-5, 0, "a");
  ds::test::expect_close(post, vec("post"), 1e-5, 0, "post");
  ds::test::expect_close(comb, vec("comb"), 1e-5, 0, "comb");
  std::vector<float> y(d.tokens * d.streams * d.dim);
  ds::ops::mhc_post_forward(y.data(), o.data(), x.data(), post.data(), comb.data(), d);
  ds::test::expect_close(y, vec("x_out"), 1e-5, 0, "x_out");
  std::vector<float> h(d.tokens * d.dim);
  ds::ops::mhc_head_forward(h.data(), x.data(), vec("head_fn").data(), vec("head_base").data(),
                            vec("head_scale").data(), d);
  ds::test::expect_close(h, vec("head"), 1e-5, 0, "head");
}

}  // namespace mhc_test
}  // namespace
