// RMSNorm: the double reference's backward against finite differences, the
// float32 kernel against the reference (DeepSeek-V3 widths included), the `+=`
// rule of the weight gradient, the effect of eps, in-place use, bad sizes, and
// bitwise thread-count independence of both gradients.
#include "ops/rmsnorm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/reference/rmsnorm.h"
#include "test_util.h"

namespace ds {
namespace {
namespace rmsnorm_test {

using ds::test::ThreadCountGuard;

using test::expect_close;
using test::randn;
using test::to_double;

// Outputs of one float32 forward + backward.
struct Fast {
  std::vector<float> y, rstd, dx, dw;
};

// Runs the float32 kernels; dw starts from `dw0` (the `+=` rule).
Fast run_fast(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy,
              const std::vector<float>& dw0, int64_t rows, int64_t dim, float eps) {
  Fast f;
  f.y.resize(rows * dim);
  f.rstd.resize(rows);
  f.dx.resize(rows * dim);
  f.dw = dw0;
  ops::rmsnorm_forward(f.y.data(), f.rstd.data(), x.data(), w.data(), rows, dim, eps);
  ops::rmsnorm_backward(f.dx.data(), f.dw.data(), dy.data(), x.data(), w.data(), f.rstd.data(), rows, dim);
  return f;
}

class RmsnormEps : public ::testing::TestWithParam<double> {};

// L = sum(g * y) differentiated by central differences of the double reference.
TEST_P(RmsnormEps, ReferenceBackwardMatchesFiniteDifferences) {
  const double eps = GetParam();
  const int64_t rows = 3, dim = 5;
  const auto x = to_double(randn(rows * dim, 1)), w = to_double(randn(dim, 2)), g = to_double(randn(rows * dim, 3));
  std::vector<double> dx, dw;
  ref::rmsnorm_backward(dx, dw, g, x, w, rows, dim, eps);
  const auto fx = [&](const std::vector<double>& v) {
    return test::weighted_sum(ref::rmsnorm(v, w, rows, dim, eps), g);
  };
  const auto fw = [&](const std::vector<double>& v) {
    return test::weighted_sum(ref::rmsnorm(x, v, rows, dim, eps), g);
  };
  // h = 1e-6: truncation error ~h^2 |f'''| ~ 1e-12 and rounding ~1e-16 |f| / h
  // ~ 1e-10 for f, y of order 1; 1e-7 is far below any wrong term (order 0.1).
  expect_close(dx, test::numeric_grad(fx, x), 0, 1e-7, "dx");
  expect_close(dw, test::numeric_grad(fw, w), 0, 1e-7, "dw");
}

// eps = 0.5 is large next to mean(x^2) ~ 1, so a wrong placement of eps in the
// gradient would show up.
INSTANTIATE_TEST_SUITE_P(Eps, RmsnormEps, ::testing::Values(0.0, 1e-6, 0.5));

class RmsnormShapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

// Float32 forward and backward vs the double reference; dw is pre-filled to
// check that the kernel adds to it.
TEST_P(RmsnormShapes, FastMatchesReference) {
  const auto [rows, dim] = GetParam();
  const float eps = 1e-6f;
  const auto x = randn(rows * dim, 10, 2.0f), w = randn(dim, 11), dy = randn(rows * dim, 12), dw0 = randn(dim, 13);
  const Fast f = run_fast(x, w, dy, dw0, rows, dim, eps);

  std::vector<double> rstd, dx, dw = to_double(dw0);
  const auto y = ref::rmsnorm(to_double(x), to_double(w), rows, dim, eps, &rstd);
  ref::rmsnorm_backward(dx, dw, to_double(dy), to_double(x), to_double(w), rows, dim, eps);
  // y, rstd and dx are a few float32 roundings away from the double values
  // (relative 2^-24 each; the row statistic is summed in double), so 1e-6 of
  // the largest magnitude is ~10 ulp. dw sums up to 300 float32 terms, whose
  // rounding grows at worst like rows * 2^-24 of the terms: 2e-5 of the largest
  // value covers that while a missing or doubled row would be off by >1e-2.
  // dx = rstd (dy w - x c) cancels (exactly when dim = 1), so its error is
  // measured against the size of the terms, max |rstd dy w|, not against dx.
  double terms = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < dim; ++j) terms = std::max(terms, std::fabs(rstd[r] * dy[r * dim + j] * w[j]));
  expect_close(f.y, y, 1e-6, 0, "y");
  expect_close(f.rstd, rstd, 1e-6, 0, "rstd");
  expect_close(f.dx, dx, 1e-6, 1e-6 * terms, "dx");
  expect_close(f.dw, dw, 2e-5, 0, "dw");
}

// Odd widths exercise the vector tails; 7168 is DeepSeek-V3's hidden size (few
// rows, as at decode), 1536 and 512 its q_a and kv_a layernorm widths.
INSTANTIATE_TEST_SUITE_P(
    Shapes, RmsnormShapes,
    ::testing::Values(std::make_tuple(int64_t{1}, int64_t{1}), std::make_tuple(int64_t{4}, int64_t{37}),
                      std::make_tuple(int64_t{65}, int64_t{16}), std::make_tuple(int64_t{3}, int64_t{7168}),
                      std::make_tuple(int64_t{2}, int64_t{1536}), std::make_tuple(int64_t{300}, int64_t{512})));

// eps sits inside the root: for small activations it changes rstd from
// 1/rms(x) to 1/sqrt(ms(x) + eps), which the test computes directly.
TEST(Rmsnorm, EpsInsideTheRoot) {
  const int64_t rows = 2, dim = 64;
  const auto x = randn(rows * dim, 20, 1e-2f), w = randn(dim, 21);
  std::vector<float> y(rows * dim), rstd(rows), y0(rows * dim), rstd0(rows);
  const float eps = 1e-3f;  // ten times mean(x^2) ~ 1e-4
  ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), rows, dim, eps);
  ops::rmsnorm_forward(y0.data(), rstd0.data(), x.data(), w.data(), rows, dim, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < dim; ++j) ms += double(x[r * dim + j]) * x[r * dim + j] / dim;
    // Both are one float rounding of a double expression: 4 ulp of margin.
    EXPECT_NEAR(rstd[r], 1.0 / std::sqrt(ms + eps), 4e-7 * rstd[r]) << r;
    EXPECT_NEAR(rstd0[r], 1.0 / std::sqrt(ms), 4e-7 * rstd0[r]) << r;
    // ms ~ 1e-4 and eps = 1e-3 make the two differ by a factor ~3.
    EXPECT_GT(rstd0[r], 2.0 * rstd[r]) << r;
  }
}

// y may alias x; dx may alias dy. Both must give the out-of-place bits.
TEST(Rmsnorm, InPlaceMatchesOutOfPlace) {
  const int64_t rows = 5, dim = 70;
  const auto x = randn(rows * dim, 30), w = randn(dim, 31), dy = randn(rows * dim, 32);
  const Fast f = run_fast(x, w, dy, std::vector<float>(dim, 0.0f), rows, dim, 1e-6f);
  std::vector<float> y = x, rstd(rows), d = dy, dw(dim, 0.0f);
  ops::rmsnorm_forward(y.data(), rstd.data(), y.data(), w.data(), rows, dim, 1e-6f);
  ops::rmsnorm_backward(d.data(), dw.data(), d.data(), x.data(), w.data(), rstd.data(), rows, dim);
  EXPECT_EQ(y, f.y);
  EXPECT_EQ(d, f.dx);
  EXPECT_EQ(dw, f.dw);
}

// Either gradient may be skipped (a frozen norm weight, or a first layer whose
// input needs no gradient); the other must not change.
TEST(Rmsnorm, BackwardWithOnlyOneGradient) {
  const int64_t rows = 70, dim = 24;
  const auto x = randn(rows * dim, 40), w = randn(dim, 41), dy = randn(rows * dim, 42);
  const Fast f = run_fast(x, w, dy, std::vector<float>(dim, 0.0f), rows, dim, 1e-6f);
  std::vector<float> dx(rows * dim), dw(dim, 0.0f);
  ops::rmsnorm_backward(dx.data(), nullptr, dy.data(), x.data(), w.data(), f.rstd.data(), rows, dim);
  ops::rmsnorm_backward(nullptr, dw.data(), dy.data(), x.data(), w.data(), f.rstd.data(), rows, dim);
  EXPECT_EQ(dx, f.dx);
  EXPECT_EQ(dw, f.dw);
}

// The weight gradient sums over rows in fixed blocks; row counts around
// multiples of the block size must give the same bits with 1, 2 and 3 threads.
TEST(Rmsnorm, GradientsBitwiseIndependentOfThreadCount) {
  ThreadCountGuard guard;
  const int64_t dim = 40;
  for (int64_t rows : {int64_t{1}, kReduceBlock - 1, kReduceBlock, kReduceBlock + 1, int64_t{300}}) {
    const auto x = randn(rows * dim, 50), w = randn(dim, 51), dy = randn(rows * dim, 52), dw0 = randn(dim, 53);
    omp_set_num_threads(1);
    const Fast want = run_fast(x, w, dy, dw0, rows, dim, 1e-6f);
    for (int threads : {2, 3}) {
      omp_set_num_threads(threads);
      const Fast got = run_fast(x, w, dy, dw0, rows, dim, 1e-6f);
      EXPECT_EQ(got.y, want.y) << rows << " rows, " << threads << " threads";
      EXPECT_EQ(got.dx, want.dx) << rows << " rows, " << threads << " threads";
      EXPECT_EQ(got.dw, want.dw) << rows << " rows, " << threads << " threads";
    }
  }
}

TEST(Rmsnorm, ZeroRowsIsANoOp) {
  std::vector<float> w(8, 1.0f), dw(8, 3.0f);
  ops::rmsnorm_forward(nullptr, nullptr, nullptr, w.data(), 0, 8, 1e-6f);
  ops::rmsnorm_backward(nullptr, dw.data(), nullptr, nullptr, w.data(), nullptr, 0, 8);
  EXPECT_EQ(dw, std::vector<float>(8, 3.0f));
}

TEST(Rmsnorm, BadArgumentsThrow) {
  std::vector<float> x(8), y(8), w(8), rstd(2);
  EXPECT_THROW(ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), 2, 0, 1e-6f), Error);
  EXPECT_THROW(ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), -1, 4, 1e-6f), Error);
  EXPECT_THROW(ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), 2, 4, -1e-6f), Error);
  EXPECT_THROW(ops::rmsnorm_backward(y.data(), w.data(), x.data(), x.data(), w.data(), rstd.data(), 2, 0), Error);
}

}  // namespace rmsnorm_test
}  // namespace
}  // namespace ds
