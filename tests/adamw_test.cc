// AdamW and gradient clipping: the float update against the double reference
// over several steps; bias correction against the closed form for a constant
// gradient at steps 1, 2 and 10; decoupled weight decay; the global norm
// against a double sum, bitwise the same for 1, 2 and 3 threads and for any
// cut of the same values into tensors; clipping's threshold, scale and return
// value; and a least-squares problem that AdamW must solve.
#include "ops/adamw.h"

#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "ops/reference/adamw.h"
#include "test_util.h"

namespace ds {
namespace {
namespace adamw_test {

using ds::test::ThreadCountGuard;

using test::expect_close;
using test::randn;
using test::to_double;

ref::AdamW to_ref(const ops::AdamWConfig& c) { return {c.lr, c.beta1, c.beta2, c.eps, c.eps_root, c.weight_decay}; }

// Ten steps with fresh random gradients; sizes with vector tails and one large
// enough to be split between threads.
TEST(AdamW, MatchesReferenceOverSteps) {
  ops::AdamWConfig cfg;
  cfg.lr = 1e-2f;
  for (int64_t n : {1, 37, 70001}) {
    auto p = randn(n, 1), m = std::vector<float>(n, 0.0f), v = std::vector<float>(n, 0.0f);
    auto pd = to_double(p), md = to_double(m), vd = to_double(v);
    for (int64_t step = 1; step <= 10; ++step) {
      const auto g = randn(n, 100 + step, 0.1f);
      ops::adamw_update(p.data(), m.data(), v.data(), g.data(), n, cfg, step);
      ref::adamw_update(pd, md, vd, to_double(g), to_ref(cfg), step);
    }
    // Moments: a few float roundings per step, relative to their size (2^-24
    // each; 10 steps of a contracting recurrence keep it at a few ulp).
    expect_close(m, md, 1e-6, 0, "m");
    expect_close(v, vd, 1e-6, 0, "v");
    // p ~ 1 moves by ~lr per step; each step's change carries ~1e-6 relative
    // error (division, approximate sqrt within 1 ulp) plus p's own rounding
    // (6e-8): 10 steps stay below 1e-6 of |p|, where one wrong term would be off by ~lr.
    expect_close(p, pd, 1e-6, 0, "p");
  }
}

// optax's eps_root sits inside the square root: with eps = 0 the step is
// m_hat / sqrt(v_hat + eps_root), checked against the reference in double.
TEST(AdamW, EpsRootInsideTheSquareRoot) {
  ops::AdamWConfig cfg;
  cfg.lr = 1e-2f;
  cfg.eps = 0.0f;
  cfg.eps_root = 1e-4f;
  const int64_t n = 1001;
  auto p = randn(n, 3), m = std::vector<float>(n, 0.0f), v = std::vector<float>(n, 0.0f);
  auto pd = to_double(p), md = to_double(m), vd = to_double(v);
  for (int64_t step = 1; step <= 3; ++step) {
    // Gradients of the size of sqrt(eps_root), so that the term matters.
    const auto g = randn(n, 200 + step, 0.01f);
    ops::adamw_update(p.data(), m.data(), v.data(), g.data(), n, cfg, step);
    ref::adamw_update(pd, md, vd, to_double(g), to_ref(cfg), step);
  }
  expect_close(p, pd, 1e-6, 0, "p");
  // Closed form at step 1 with g = 0.01 everywhere: m_hat = g, v_hat = g^2,
  // so p moves by lr * g / sqrt(g^2 + 1e-4) = lr / sqrt(2) (by lr without eps_root).
  std::vector<float> q(4, 1.0f), m1(4, 0.0f), v1(4, 0.0f), g1(4, 0.01f);
  cfg.weight_decay = 0.0f;
  ops::adamw_update(q.data(), m1.data(), v1.data(), g1.data(), 4, cfg, 1);
  for (float x : q) EXPECT_NEAR(1.0 - x, 1e-2 / std::sqrt(2.0), 1e-7);
}

// With a constant gradient g from zero moments, m_t = (1 - b1^t) g and
// v_t = (1 - b2^t) g^2, so the bias-corrected step is exactly
// g / (|g| + eps): without the correction it would be (1 - b1^t) / sqrt(1 - b2^t)
// times that (0.45 at t = 1, 0.82 at t = 10 for b = 0.9 / 0.95).
TEST(AdamW, BiasCorrectionAtSteps1_2_10) {
  ops::AdamWConfig cfg;
  cfg.lr = 1e-2f;
  cfg.weight_decay = 0.0f;
  const std::vector<float> g = {0.3f, -2.0f, 1e-3f};
  const int64_t n = g.size();
  std::vector<float> p = {1.0f, -0.5f, 2.0f}, m(n, 0.0f), v(n, 0.0f);
  std::vector<double> want = to_double(p);
  for (int64_t step = 1; step <= 10; ++step) {
    ops::adamw_update(p.data(), m.data(), v.data(), g.data(), n, cfg, step);
    for (int64_t i = 0; i < n; ++i) want[i] -= cfg.lr * (g[i] / (std::fabs(g[i]) + cfg.eps));
    if (step != 1 && step != 2 && step != 10) continue;
    for (int64_t i = 0; i < n; ++i) {
      const double b1t = std::pow(double(cfg.beta1), step), b2t = std::pow(double(cfg.beta2), step);
      // Float moments after `step` recurrences: ~step ulp of their size.
      EXPECT_NEAR(m[i], (1 - b1t) * g[i], 1e-6 * std::fabs(g[i])) << "step " << step << " i " << i;
      EXPECT_NEAR(v[i], (1 - b2t) * g[i] * g[i], 1e-6 * g[i] * g[i]) << "step " << step << " i " << i;
      // Each step's change lr * g / |g| is exact to ~1e-6 relative (the
      // moments' rounding, through the ratio), i.e. 1e-8 absolute per step,
      // plus p's own rounding (~2.4e-7 at |p| = 2): 1e-6 allows for 10 steps,
      // while a missing bias correction would be off by > 1e-3.
      EXPECT_NEAR(p[i], want[i], 1e-6) << "step " << step << " i " << i;
    }
  }
}

// Decay is applied to the parameter, not added to the gradient: a zero
// gradient leaves the moments at 0 and still shrinks p by (1 - lr wd).
TEST(AdamW, WeightDecayIsDecoupled) {
  ops::AdamWConfig cfg;
  cfg.lr = 0.1f;
  cfg.weight_decay = 0.5f;
  std::vector<float> p = {1.0f, -3.0f, 0.25f}, m(3, 0.0f), v(3, 0.0f), g(3, 0.0f);
  const std::vector<float> p0 = p;
  ops::adamw_update(p.data(), m.data(), v.data(), g.data(), 3, cfg, 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(m[i], 0.0f);
    EXPECT_EQ(v[i], 0.0f);
    // One float multiply-subtract of exact inputs: within 1 ulp of |p0|.
    EXPECT_NEAR(p[i], p0[i] * (1.0 - 0.1 * 0.5), 1.2e-7 * std::fabs(p0[i])) << i;
  }
}

TEST(AdamW, BadArgumentsThrow) {
  std::vector<float> p(4), m(4), v(4), g(4);
  ops::AdamWConfig cfg;
  EXPECT_THROW(ops::adamw_update(p.data(), m.data(), v.data(), g.data(), 4, cfg, 0), Error);
  cfg.beta1 = 1.0f;
  EXPECT_THROW(ops::adamw_update(p.data(), m.data(), v.data(), g.data(), 4, cfg, 1), Error);
  cfg.beta1 = 0.9f;
  cfg.eps = 0.0f;
  EXPECT_THROW(ops::adamw_update(p.data(), m.data(), v.data(), g.data(), 4, cfg, 1), Error);
  cfg.eps_root = -1e-8f;
  EXPECT_THROW(ops::adamw_update(p.data(), m.data(), v.data(), g.data(), 4, cfg, 1), Error);
  EXPECT_THROW(ops::clip_grad_norm({{g.data(), 4}}, 0.0), Error);
  EXPECT_THROW(ops::global_grad_norm({{g.data(), -1}}), Error);
}

// Tensor sizes around the norm's 65536-element blocks, with an empty tensor.
std::vector<std::vector<float>> grad_tensors() {
  std::vector<std::vector<float>> t;
  uint64_t seed = 200;
  for (int64_t n : {70000, 1, 0, 65535, 131072, 17, 40000}) t.push_back(randn(n, seed++, 0.01f));
  return t;
}

std::vector<ops::GradSpan> spans(std::vector<std::vector<float>>& t) {
  std::vector<ops::GradSpan> s;
  for (auto& x : t) s.push_back({x.data(), static_cast<int64_t>(x.size())});
  return s;
}

TEST(GradNorm, MatchesDoubleSum) {
  auto t = grad_tensors();
  std::vector<std::vector<double>> td;
  for (const auto& x : t) td.push_back(to_double(x));
  // Both sum the same float squares in double, in different orders: ~1e-16
  // relative per addition over 3e5 terms stays far below 1e-12.
  EXPECT_NEAR(ops::global_grad_norm(spans(t)), ref::global_grad_norm(td), 1e-12 * ref::global_grad_norm(td));
  EXPECT_EQ(ops::global_grad_norm({}), 0.0);
}

// The same bits for 1, 2 and 3 threads, and for the values cut into one
// tensor, into the tensors above, or into pieces of 1000 and of 7.
TEST(GradNorm, BitwiseIndependentOfThreadsAndTensorCuts) {
  ThreadCountGuard guard;
  auto t = grad_tensors();
  std::vector<float> all;
  for (const auto& x : t) all.insert(all.end(), x.begin(), x.end());
  const auto cut = [&](int64_t piece) {
    std::vector<ops::GradSpan> s;
    for (int64_t i = 0; i < static_cast<int64_t>(all.size()); i += piece)
      s.push_back({all.data() + i, std::min<int64_t>(piece, all.size() - i)});
    return s;
  };
  omp_set_num_threads(1);
  const double want = ops::global_grad_norm(spans(t));
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    EXPECT_EQ(ops::global_grad_norm(spans(t)), want) << threads << " threads";
    EXPECT_EQ(ops::global_grad_norm({{all.data(), static_cast<int64_t>(all.size())}}), want) << threads;
    EXPECT_EQ(ops::global_grad_norm(cut(1000)), want) << threads;
    EXPECT_EQ(ops::global_grad_norm(cut(7)), want) << threads;
  }
}

TEST(GradNorm, ClipScalesOnlyAboveTheThreshold) {
  auto t = grad_tensors();
  const double norm = ops::global_grad_norm(spans(t));
  ASSERT_GT(norm, 1.0);  // ~0.01 * sqrt(3.7e5) ~ 6
  // At or below the threshold: nothing changes, the norm is returned.
  const auto before = t;
  EXPECT_EQ(ops::clip_grad_norm(spans(t), norm), norm);
  EXPECT_EQ(ops::clip_grad_norm(spans(t), 2 * norm), norm);
  EXPECT_EQ(t, before);
  // Above it: every element scaled by max / norm (optax), the pre-clip norm returned.
  const double max_norm = 1.0;
  EXPECT_EQ(ops::clip_grad_norm(spans(t), max_norm), norm);
  const float s = static_cast<float>(max_norm / norm);
  for (size_t k = 0; k < t.size(); ++k)
    for (size_t i = 0; i < t[k].size(); ++i) ASSERT_EQ(t[k][i], before[k][i] * s) << k << " " << i;
  // The new norm is max_norm up to float rounding of the scaled values
  // (~1e-7 relative).
  EXPECT_NEAR(ops::global_grad_norm(spans(t)), max_norm, 1e-6);
}

// A NaN gradient gives a NaN norm and no scaling, so the caller can skip the step.
TEST(GradNorm, NanNormIsReturnedUnclipped) {
  std::vector<float> g = {1.0f, std::numeric_limits<float>::quiet_NaN(), 3.0f};
  EXPECT_TRUE(std::isnan(ops::clip_grad_norm({{g.data(), 3}}, 1.0)));
  EXPECT_EQ(g[0], 1.0f);
  EXPECT_EQ(g[2], 3.0f);
}

// Does it learn: least squares ||A x - b||^2 / 2 with b = A x_true, solved by
// AdamW (no decay) with clipping and a linearly decaying learning rate.
TEST(AdamW, SolvesLeastSquares) {
  const int64_t rows = 20, n = 5, steps = 1500;
  const auto A = randn(rows * n, 300), x_true = randn(n, 301);
  std::vector<float> b(rows, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) b[r] += A[r * n + j] * x_true[j];
  const auto loss_and_grad = [&](const std::vector<float>& x, std::vector<float>& g) {
    double loss = 0;
    std::fill(g.begin(), g.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      double res = -b[r];
      for (int64_t j = 0; j < n; ++j) res += A[r * n + j] * x[j];
      loss += 0.5 * res * res;
      for (int64_t j = 0; j < n; ++j) g[j] += static_cast<float>(res * A[r * n + j]);
    }
    return loss;
  };
  std::vector<float> x(n, 0.0f), m(n, 0.0f), v(n, 0.0f), g(n);
  const double loss0 = loss_and_grad(x, g);
  ops::AdamWConfig cfg;
  cfg.weight_decay = 0.0f;
  for (int64_t step = 1; step <= steps; ++step) {
    loss_and_grad(x, g);
    ops::clip_grad_norm({{g.data(), n}}, 10.0);
    cfg.lr = 0.05f * static_cast<float>(steps - step + 1) / steps;
    ops::adamw_update(x.data(), m.data(), v.data(), g.data(), n, cfg, step);
  }
  const double loss = loss_and_grad(x, g);
  // Starting from loss0 ~ 50, a working optimizer ends near 0 (the problem is
  // consistent); a sign error or a broken moment would not go below loss0.
  EXPECT_LT(loss, 1e-6 * loss0) << "loss0 " << loss0;
  for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(x[j], x_true[j], 1e-3) << j;
}

}  // namespace adamw_test
}  // namespace
}  // namespace ds
