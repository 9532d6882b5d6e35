// model/engram.h: MaxText's Engram layer against the published toy values,
// against a float64 transcription (tests/engram_reference.h), every gradient
// against central differences of that transcription, the table's gradient
// only at the rows looked up, and generation's history rows continuing a
// sequence exactly.
#include "model/engram.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "engram_reference.h"
#include "model/weights.h"

using ds::model::EngramActs;
using ds::model::EngramDims;
using ds::model::EngramParams;
using ds::model::EngramSegment;
using ds::ops::WeightView;

namespace {
namespace engram_test {

struct Layer {
  ds::test::EngramRef<double> ref;
  std::vector<float> norm, table, key, key_bias, value, value_bias, q_norm, k_norm, conv_norm, conv;
  EngramDims d;

  EngramParams<WeightView> view() const {
    const int64_t W = d.width(), E = d.columns * d.head_dim;
    EngramParams<WeightView> p;
    p.norm = ds::model::f32_view(norm.data(), d.dim);
    p.table = ds::model::f32_view(table.data(), static_cast<int64_t>(table.size()) / d.head_dim, d.head_dim);
    p.key = ds::model::f32_view(key.data(), W, E);
    p.key_bias = ds::model::f32_view(key_bias.data(), W);
    p.value = ds::model::f32_view(value.data(), d.dim, E);
    p.value_bias = ds::model::f32_view(value_bias.data(), d.dim);
    p.q_norm = ds::model::f32_view(q_norm.data(), W);
    p.k_norm = ds::model::f32_view(k_norm.data(), W);
    p.conv_norm = ds::model::f32_view(conv_norm.data(), W);
    p.conv = ds::model::f32_view(conv.data(), d.kernel, W);
    return p;
  }
  // The float32 weights from the reference's double ones.
  void sync() {
    auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    norm = f(ref.norm), table = f(ref.table), key = f(ref.key), key_bias = f(ref.key_bias), value = f(ref.value);
    value_bias = f(ref.value_bias), q_norm = f(ref.q_norm), k_norm = f(ref.k_norm), conv_norm = f(ref.conv_norm);
    conv = f(ref.conv);
  }
};

std::vector<double> randn(int64_t n, uint64_t seed, double std, double mean = 0) {
  std::vector<float> f(static_cast<size_t>(n));
  ds::fill_normal(f.data(), n, static_cast<float>(std), seed);
  std::vector<double> out(f.begin(), f.end());
  for (auto& v : out) v = static_cast<float>(v + mean);  // float-exact, so both sides hold the same weights
  return out;
}

Layer random_layer(int64_t G, int64_t D, int64_t C, int64_t Dh, int64_t K, int64_t dil, int64_t rows, uint64_t s) {
  Layer L;
  L.d = EngramDims{G, D, C, Dh, K, dil, 1e-6f};
  const int64_t W = G * D, E = C * Dh;
  auto& r = L.ref;
  r.G = G, r.D = D, r.C = C, r.Dh = Dh, r.K = K, r.dil = dil, r.eps = 1e-6;
  r.norm = randn(D, s + 1, 0.2, 1.0);
  r.table = randn(rows * Dh, s + 2, 1.0);
  r.key = randn(W * E, s + 3, 0.4);
  r.key_bias = randn(W, s + 4, 0.1);
  r.value = randn(D * E, s + 5, 0.4);
  r.value_bias = randn(D, s + 6, 0.1);
  r.q_norm = randn(W, s + 7, 0.2, 1.0);
  r.k_norm = randn(W, s + 8, 0.2, 1.0);
  r.conv_norm = randn(W, s + 9, 0.2, 1.0);
  r.conv = randn(K * W, s + 10, 0.5);
  L.sync();
  return L;
}

TEST(Engram, ToyValuesFromTheSpecification) {
  // G = 2, D = 4, S = 5, one head, N = 3 (C = 2 columns), D_head = 2, primes
  // [5, 7] (offsets 0 and 5), K = 2, dilation 3; the module input is x^
  // itself (the input norm of a unit-scale RMS-normed row changes it by eps).
  Layer L;
  L.d = EngramDims{2, 4, 2, 2, 2, 3, 1e-6f};
  auto& r = L.ref;
  r.G = 2, r.D = 4, r.C = 2, r.Dh = 2, r.K = 2, r.dil = 3, r.eps = 1e-6;
  r.table.resize(12 * 2);
  for (int rr = 0; rr < 12; ++rr)
    for (int c = 0; c < 2; ++c) r.table[rr * 2 + c] = 0.1 * (rr + 1) * std::cos(c + rr);
  r.key.resize(8 * 4);
  for (int i = 0; i < 4; ++i)
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < 4; ++j) r.key[(g * 4 + j) * 4 + i] = 0.2 * std::sin(i + 2 * g + 3 * j);
  for (int g = 0; g < 2; ++g)
    for (int j = 0; j < 4; ++j) {
      r.key_bias.push_back(0.01 * (g + j));
      r.k_norm.push_back(1 + 0.05 * g - 0.02 * j);
    }
  r.value.resize(4 * 4);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) r.value[j * 4 + i] = 0.2 * std::cos(i - j);
  for (int j = 0; j < 4; ++j) r.value_bias.push_back(0.02 * j);
  r.norm.assign(4, 1.0);
  r.q_norm.assign(8, 1.0);
  r.conv_norm.assign(8, 1.0);
  for (int rr = 0; rr < 2; ++rr)
    for (int ch = 0; ch < 8; ++ch) r.conv.push_back(0.1 * (rr + 1) * std::sin(ch + 1));
  L.sync();
  const std::vector<int32_t> ids = {0, 5 + 6, 3, 5 + 0, 1, 5 + 5, 4, 5 + 2, 2, 5 + 1};
  std::vector<float> x(5 * 8), x0;
  for (int t = 0; t < 5; ++t)
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < 4; ++j) x[(t * 2 + g) * 4 + j] = static_cast<float>(std::cos(t + 1.5 * g + 0.5 * j));
  x0 = x;
  EngramActs acts;
  ds::model::engram_forward(x.data(), ids.data(), L.view(), L.d, {{0, 5, nullptr}}, 5, &acts);
  const double alpha[5][2] = {
      {.65431, .29466}, {.629127, .401097}, {.354612, .284117}, {.34173, .72511}, {.311394, .610365}};
  for (int t = 0; t < 5; ++t)
    for (int g = 0; g < 2; ++g) EXPECT_NEAR(acts.alpha[t * 2 + g], alpha[t][g], 2e-6) << t << "," << g;
  const double o0[8] = {-.195096, -.049955, .109513, .059628, .059103, -.005306, .105264, .23184};
  const double o4[8] = {-.184838, -.039834, .084627, -.043454, .045045, -.004386, .224034, .423579};
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(x[i] - x0[i], o0[i], 3e-6) << i;
    EXPECT_NEAR(x[32 + i] - x0[32 + i], o4[i], 3e-6) << i;
  }
}

// Two sequences in one batch, with repeated rows (collisions).
struct Case {
  Layer L;
  std::vector<int32_t> ids;
  std::vector<double> x, dy;
  std::vector<EngramSegment> segs;
  int64_t T;
};

Case random_case(int64_t G) {
  Case k;
  k.L = random_layer(G, 6, 3, 4, 3, 2, 9, 40 + G);
  k.T = 13;
  k.segs = {{0, 8, nullptr}, {8, 5, nullptr}};
  const ds::Philox rng(99);
  for (int64_t i = 0; i < k.T * 3; ++i) k.ids.push_back(static_cast<int32_t>(rng.u32(i) % 9));
  k.x = randn(k.T * G * 6, 5, 1.0);
  k.dy = randn(k.T * G * 6, 6, 1.0);
  return k;
}

std::vector<double> ref_forward(const Case& k, const ds::test::EngramRef<double>& r, const std::vector<double>& x) {
  std::vector<double> out;
  const int64_t W = k.L.d.width();
  for (const auto& sg : k.segs) {
    std::vector<double> xs(x.begin() + sg.row0 * W, x.begin() + (sg.row0 + sg.count) * W);
    std::vector<int32_t> is(k.ids.begin() + sg.row0 * r.C, k.ids.begin() + (sg.row0 + sg.count) * r.C);
    const auto o = r.forward(xs, is, sg.count);
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

double ref_loss(const Case& k, const ds::test::EngramRef<double>& r, const std::vector<double>& x) {
  const auto out = ref_forward(k, r, x);
  double l = 0;
  for (size_t i = 0; i < out.size(); ++i) l += out[i] * k.dy[i];
  return l;
}

class EngramGrad : public ::testing::TestWithParam<int64_t> {};

TEST_P(EngramGrad, ForwardAndEveryGradientMatchTheFloat64Reference) {
  Case k = random_case(GetParam());
  const int64_t W = k.L.d.width();
  std::vector<float> x(k.x.begin(), k.x.end()), dy(k.dy.begin(), k.dy.end());
  EngramActs acts;
  ds::model::engram_forward(x.data(), k.ids.data(), k.L.view(), k.L.d, k.segs, k.T, &acts);
  const auto want = ref_forward(k, k.L.ref, k.x);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(x[i], want[i], 2e-5 * (1 + std::fabs(want[i]))) << i;

  // Gradients of L = sum(out * dy).
  EngramParams<std::vector<float>> gbuf;
  const auto& r = k.L.ref;
  auto zeros = [](const std::vector<double>& v) { return std::vector<float>(v.size(), 0.0f); };
  gbuf.norm = zeros(r.norm), gbuf.table = zeros(r.table), gbuf.key = zeros(r.key), gbuf.key_bias = zeros(r.key_bias);
  gbuf.value = zeros(r.value), gbuf.value_bias = zeros(r.value_bias), gbuf.q_norm = zeros(r.q_norm);
  gbuf.k_norm = zeros(r.k_norm), gbuf.conv_norm = zeros(r.conv_norm), gbuf.conv = zeros(r.conv);
  EngramParams<float*> g{gbuf.norm.data(),      gbuf.table.data(),      gbuf.key.data(),    gbuf.key_bias.data(),
                         gbuf.value.data(),     gbuf.value_bias.data(), gbuf.q_norm.data(), gbuf.k_norm.data(),
                         gbuf.conv_norm.data(), gbuf.conv.data()};
  std::vector<float> x_in(k.x.begin(), k.x.end()), dx = dy;  // dx starts as the direct path's share
  ds::model::engram_backward(dx.data(), g, dy.data(), x_in.data(), k.ids.data(), acts, k.L.view(), k.L.d, k.segs, k.T);
  auto check = [&](const char* name, std::vector<double> ds::test::EngramRef<double>::*field,
                   const std::vector<float>& got) {
    auto rr = k.L.ref;
    std::vector<double>& v = rr.*field;
    double scale = 1e-3;
    std::vector<double> fd(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const double h = 1e-6, keep = v[i];
      v[i] = keep + h;
      const double lp = ref_loss(k, rr, k.x);
      v[i] = keep - h;
      const double lm = ref_loss(k, rr, k.x);
      v[i] = keep;
      fd[i] = (lp - lm) / (2 * h);
      scale = std::max(scale, std::fabs(fd[i]));
    }
    for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(got[i], fd[i], 2e-4 * scale) << name << "[" << i << "]";
  };
  check("norm", &ds::test::EngramRef<double>::norm, gbuf.norm);
  check("table", &ds::test::EngramRef<double>::table, gbuf.table);
  check("key", &ds::test::EngramRef<double>::key, gbuf.key);
  check("key_bias", &ds::test::EngramRef<double>::key_bias, gbuf.key_bias);
  check("value", &ds::test::EngramRef<double>::value, gbuf.value);
  check("value_bias", &ds::test::EngramRef<double>::value_bias, gbuf.value_bias);
  check("q_norm", &ds::test::EngramRef<double>::q_norm, gbuf.q_norm);
  check("k_norm", &ds::test::EngramRef<double>::k_norm, gbuf.k_norm);
  check("conv_norm", &ds::test::EngramRef<double>::conv_norm, gbuf.conv_norm);
  check("conv", &ds::test::EngramRef<double>::conv, gbuf.conv);
  // dx against the input's central differences.
  double scale = 1e-3;
  std::vector<double> fd(k.x.size());
  for (size_t i = 0; i < k.x.size(); ++i) {
    auto xp = k.x;
    xp[i] += 1e-6;
    auto xm = k.x;
    xm[i] -= 1e-6;
    fd[i] = (ref_loss(k, k.L.ref, xp) - ref_loss(k, k.L.ref, xm)) / 2e-6;
    scale = std::max(scale, std::fabs(fd[i]));
  }
  for (size_t i = 0; i < fd.size(); ++i) EXPECT_NEAR(dx[i], fd[i], 2e-4 * scale) << "x[" << i << "]";
  (void)W;
}

INSTANTIATE_TEST_SUITE_P(Streams, EngramGrad, ::testing::Values(1, 3));

TEST(Engram, TableGradientTouchesOnlyTheRowsLookedUp) {
  Case k = random_case(2);
  // Rows 0..8 exist; look up only rows 2 and 7.
  for (auto& id : k.ids) id = id % 2 ? 7 : 2;
  std::vector<float> x(k.x.begin(), k.x.end()), dy(k.dy.begin(), k.dy.end()), table(k.L.table.size(), 0.0f);
  EngramActs acts;
  ds::model::engram_forward(x.data(), k.ids.data(), k.L.view(), k.L.d, k.segs, k.T, &acts);
  EngramParams<float*> g;
  g.table = table.data();
  std::vector<float> x_in(k.x.begin(), k.x.end()), dx = dy;
  ds::model::engram_backward(dx.data(), g, dy.data(), x_in.data(), k.ids.data(), acts, k.L.view(), k.L.d, k.segs, k.T);
  for (int64_t row = 0; row < 9; ++row) {
    double mag = 0;
    for (int64_t j = 0; j < 4; ++j) mag += std::fabs(table[row * 4 + j]);
    EXPECT_EQ(mag > 0, row == 2 || row == 7) << row;
  }
}

TEST(Engram, HistoryRowsContinueASequence) {
  // A sequence in one go, and the same sequence as a prefix then the rest
  // one token at a time with the conv's history rows (as generation runs);
  // a history of zeros is a sequence's start.
  Case k = random_case(2);
  const int64_t W = k.L.d.width(), H = k.L.d.history(), S = 8;
  std::vector<float> full(k.x.begin(), k.x.begin() + S * W);
  EngramActs acts;
  ds::model::engram_forward(full.data(), k.ids.data(), k.L.view(), k.L.d, {{0, S, nullptr}}, S, &acts);
  std::vector<float> rows(H * W + S * W, 0.0f);  // zeros before the sequence, then every n row
  const int64_t P = 3;
  std::vector<float> part(k.x.begin(), k.x.begin() + P * W);
  EngramActs a0;
  ds::model::engram_forward(part.data(), k.ids.data(), k.L.view(), k.L.d, {{0, P, nullptr}}, P, &a0);
  std::copy(a0.n.begin(), a0.n.end(), rows.begin() + H * W);
  for (int64_t i = 0; i < P * W; ++i) EXPECT_EQ(part[i], full[i]) << i;
  for (int64_t t = P; t < S; ++t) {
    std::vector<float> one(k.x.begin() + t * W, k.x.begin() + (t + 1) * W);
    EngramActs a1;
    ds::model::engram_forward(one.data(), k.ids.data() + t * 3, k.L.view(), k.L.d, {{0, 1, rows.data() + t * W}}, 1,
                              &a1);
    std::copy(a1.n.begin(), a1.n.end(), rows.begin() + (H + t) * W);
    // One row against eight: the projections' kernels differ in rounding only.
    for (int64_t i = 0; i < W; ++i)
      EXPECT_NEAR(one[i], full[t * W + i], 1e-5 * (1 + std::fabs(full[t * W + i]))) << t << "," << i;
  }
}

}  // namespace engram_test
}  // namespace
