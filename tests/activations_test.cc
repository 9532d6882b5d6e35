// Activations: the double references' backwards against finite differences,
// the float32 kernels against the references (odd sizes, sizes split over
// threads), numerical stability at large |x|, masked and fully masked softmax
// rows, in-place use, thread-count independence and bad sizes.
#include "ops/activations.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "ops/reference/activations.h"
#include "test_util.h"

namespace ds {
namespace {
namespace activations_test {

using test::expect_close;
using test::randn;
using test::to_double;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Finite differences: h = 1e-6 on smooth functions of order-1 inputs gives
// truncation ~1e-12 and rounding ~1e-10; 1e-7 is far below any real mistake.
constexpr double kFdTol = 1e-7;

TEST(ActivationsReference, SiluMulBackwardMatchesFiniteDifferences) {
  const auto a = to_double(randn(9, 1, 2.0f)), b = to_double(randn(9, 2)), g = to_double(randn(9, 3));
  std::vector<double> da, db;
  ref::silu_mul_backward(da, db, g, a, b);
  const auto fa = [&](const std::vector<double>& v) { return test::weighted_sum(ref::silu_mul(v, b), g); };
  const auto fb = [&](const std::vector<double>& v) { return test::weighted_sum(ref::silu_mul(a, v), g); };
  expect_close(da, test::numeric_grad(fa, a), 0, kFdTol, "da");
  expect_close(db, test::numeric_grad(fb, b), 0, kFdTol, "db");
}

TEST(ActivationsReference, SigmoidBackwardMatchesFiniteDifferences) {
  const auto x = to_double(randn(9, 4, 3.0f)), g = to_double(randn(9, 5));
  const auto dx = ref::sigmoid_backward(g, ref::sigmoid(x));
  const auto f = [&](const std::vector<double>& v) { return test::weighted_sum(ref::sigmoid(v), g); };
  expect_close(dx, test::numeric_grad(f, x), 0, kFdTol);
}

TEST(ActivationsReference, SoftmaxBackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, cols = 5;
  const auto x = to_double(randn(rows * cols, 6, 2.0f)), g = to_double(randn(rows * cols, 7));
  const auto dx = ref::softmax_backward(g, ref::softmax(x, rows, cols), rows, cols);
  const auto f = [&](const std::vector<double>& v) { return test::weighted_sum(ref::softmax(v, rows, cols), g); };
  expect_close(dx, test::numeric_grad(f, x), 0, kFdTol);
}

// Sizes: a tail shorter than one vector, one vector plus a tail, and a size
// the kernels split over threads in several chunks.
class ElementwiseSizes : public ::testing::TestWithParam<int64_t> {};

TEST_P(ElementwiseSizes, SiluMulMatchesReference) {
  const int64_t n = GetParam();
  const auto a = randn(n, 10, 3.0f), b = randn(n, 11), g = randn(n, 12);
  std::vector<float> out(n), da(n), db(n);
  ops::silu_mul_forward(out.data(), a.data(), b.data(), n);
  ops::silu_mul_backward(da.data(), db.data(), g.data(), a.data(), b.data(), n);
  std::vector<double> rda, rdb;
  ref::silu_mul_backward(rda, rdb, to_double(g), to_double(a), to_double(b));
  // Each output is a handful of float operations on values of order 1 plus a
  // ~1-ulp exp: a few ulp of each value, well under 1e-6 of the largest.
  expect_close(out, ref::silu_mul(to_double(a), to_double(b)), 1e-6, 0, "out");
  expect_close(da, rda, 1e-6, 0, "da");
  expect_close(db, rdb, 1e-6, 0, "db");
}

TEST_P(ElementwiseSizes, ClampedSiluMulMatchesReferenceAndFiniteDifferences) {
  // DeepSeek-V4's clamped SwiGLU with limit 2: a third of the inputs (std 3)
  // fall outside the clamps.
  const int64_t n = GetParam();
  const double L = 2.0;
  const auto a = randn(n, 15, 3.0f), b = randn(n, 16, 3.0f), g = randn(n, 17);
  std::vector<float> out(n), da(n), db(n);
  ops::silu_mul_forward(out.data(), a.data(), b.data(), n, static_cast<float>(L));
  ops::silu_mul_backward(da.data(), db.data(), g.data(), a.data(), b.data(), n, static_cast<float>(L));
  expect_close(out, ref::silu_mul(to_double(a), to_double(b), L), 1e-6, 0, "out");
  if (n > 64) return;  // central differences element by element on the small sizes
  const auto A = to_double(a), B = to_double(b), G = to_double(g);
  const auto fa = [&](const std::vector<double>& v) { return test::weighted_sum(ref::silu_mul(v, B, L), G); };
  const auto fb = [&](const std::vector<double>& v) { return test::weighted_sum(ref::silu_mul(A, v, L), G); };
  expect_close(da, test::numeric_grad(fa, A), 1e-5, 1e-6, "da");
  expect_close(db, test::numeric_grad(fb, B), 1e-5, 1e-6, "db");
}

TEST_P(ElementwiseSizes, SigmoidMatchesReference) {
  const int64_t n = GetParam();
  const auto x = randn(n, 13, 4.0f), g = randn(n, 14);
  std::vector<float> y(n), dx(n);
  ops::sigmoid_forward(y.data(), x.data(), n);
  ops::sigmoid_backward(dx.data(), g.data(), y.data(), n);
  const auto ry = ref::sigmoid(to_double(x));
  // Elementwise relative: a small sigmoid must be accurate relative to itself
  // (router scores are compared and normalised). exp within ~1 ulp, then one
  // add and one divide: 1e-6 is ~8 ulp.
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(y[i], ry[i], 1e-6 * ry[i]) << "x = " << x[i];
  // dx from the float y: three float products, a few ulp of the largest value.
  expect_close(dx, ref::sigmoid_backward(to_double(g), to_double(y)), 1e-6, 0, "dx");
}

INSTANTIATE_TEST_SUITE_P(Sizes, ElementwiseSizes, ::testing::Values(1, 7, 16, 37, 40000));

// Relative accuracy over the whole normal range of the result, where the
// polynomial exp is used for arguments from 0 down to -85.
TEST(Sigmoid, RelativeAccuracyAcrossRange) {
  std::vector<float> x;
  for (float v = -85.0f; v <= 85.0f; v += 0.0137f) x.push_back(v);
  std::vector<float> y(x.size());
  ops::sigmoid_forward(y.data(), x.data(), x.size());
  const auto ry = ref::sigmoid(to_double(x));
  // As above: ~8 ulp of each value.
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], ry[i], 1e-6 * ry[i]) << "x = " << x[i];
}

// Large |x|: no overflow to inf or 0/0. Below ln(2^-126) the result is flushed
// to 0 (the true value is under 1.2e-38).
TEST(Sigmoid, StableForLargeMagnitudes) {
  const std::vector<float> x = {100.0f, -100.0f, 1000.0f, -1000.0f, 88.0f, -88.0f, 0.0f, -0.0f, kInf, -kInf};
  std::vector<float> y(x.size()), dx(x.size()), out(x.size()), da(x.size()), db(x.size());
  const std::vector<float> ones(x.size(), 1.0f);
  ops::sigmoid_forward(y.data(), x.data(), x.size());
  ops::sigmoid_backward(dx.data(), ones.data(), y.data(), x.size());
  // The first six: silu(+-inf) and the zeros are left out.
  ops::silu_mul_forward(out.data(), x.data(), ones.data(), x.size() - 4);
  ops::silu_mul_backward(da.data(), db.data(), ones.data(), x.data(), ones.data(), x.size() - 4);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(std::isfinite(y[i]) && std::isfinite(dx[i])) << x[i];
    if (x[i] > 50) {
      EXPECT_EQ(y[i], 1.0f) << x[i];  // 1 - sigmoid(50) < 2^-72
    }
    if (x[i] < -50) {
      EXPECT_LE(y[i], 2e-22f) << x[i];  // sigmoid(-50) ~ 1.9e-22
    }
    EXPECT_GE(y[i], 0.0f);
  }
  EXPECT_EQ(y[6], 0.5f);
  EXPECT_EQ(y[7], 0.5f);
  for (size_t i = 0; i + 4 < x.size(); ++i) {
    EXPECT_TRUE(std::isfinite(out[i]) && std::isfinite(da[i]) && std::isfinite(db[i])) << x[i];
    if (x[i] > 50) {
      EXPECT_EQ(out[i], x[i]);  // silu(x) = x there
      EXPECT_EQ(da[i], 1.0f);
    } else {
      EXPECT_EQ(out[i], 0.0f);  // |silu(x)| < 100 * 3.8e-44 rounds to 0 or is flushed
      EXPECT_EQ(da[i], 0.0f);
    }
  }
}

class SoftmaxShapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(SoftmaxShapes, MatchesReference) {
  const auto [rows, cols] = GetParam();
  const auto x = randn(rows * cols, 20, 3.0f), g = randn(rows * cols, 21);
  std::vector<float> y(rows * cols), dx(rows * cols);
  ops::softmax_forward(y.data(), x.data(), rows, cols);
  ops::softmax_backward(dx.data(), g.data(), y.data(), rows, cols);
  const auto ry = ref::softmax(to_double(x), rows, cols);
  // Each probability is exp(x - m) (the float subtraction rounds by up to
  // 2^-24 |x - m| absolute, which exp turns into that relative error; exp
  // itself ~1 ulp) times the reciprocal of a float sum (~1e-7 relative for
  // these lengths): 6e-8 |x - m| + 1e-6 relative to each value.
  for (int64_t r = 0; r < rows; ++r) {
    float m = -kInf;
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, x[r * cols + j]);
    for (int64_t i = r * cols; i < (r + 1) * cols; ++i)
      ASSERT_NEAR(y[i], ry[i], (6e-8 * (m - x[i]) + 1e-6) * ry[i]) << i;
  }
  // dx from the float y; the row dot product is summed in double, so the error
  // is a few ulp of the largest |y dy|.
  expect_close(dx, ref::softmax_backward(to_double(g), to_double(y), rows, cols), 1e-6, 0, "dx");
}

INSTANTIATE_TEST_SUITE_P(Shapes, SoftmaxShapes,
                         ::testing::Values(std::make_tuple(int64_t{1}, int64_t{1}),
                                           std::make_tuple(int64_t{3}, int64_t{5}),
                                           std::make_tuple(int64_t{4}, int64_t{33}),
                                           std::make_tuple(int64_t{2}, int64_t{256}),
                                           std::make_tuple(int64_t{40}, int64_t{1000})));

// Logits around 1000 (exp would overflow without the max shift) and masked
// (-inf) entries; a fully masked row gives zeros.
TEST(Softmax, LargeLogitsMaskedAndFullyMaskedRows) {
  const int64_t rows = 3, cols = 40;
  auto x = randn(rows * cols, 30);
  for (int64_t j = 0; j < cols; ++j) {
    x[j] += 1000.0f;
    if (j % 3 == 0) x[cols + j] = -kInf;
    x[2 * cols + j] = -kInf;
  }
  std::vector<float> y(rows * cols), dx(rows * cols);
  const auto g = randn(rows * cols, 31);
  ops::softmax_forward(y.data(), x.data(), rows, cols);
  ops::softmax_backward(dx.data(), g.data(), y.data(), rows, cols);
  for (int64_t r = 0; r < 2; ++r) {
    double s = 0;
    for (int64_t j = 0; j < cols; ++j) {
      EXPECT_TRUE(std::isfinite(y[r * cols + j]) && std::isfinite(dx[r * cols + j]));
      s += y[r * cols + j];
    }
    EXPECT_NEAR(s, 1.0, 1e-6);  // 40 terms each within ~1e-7 relative
  }
  // The reference shifts by the max as well, so it is exact here in double.
  std::vector<double> finite0(x.begin(), x.begin() + cols);
  const auto ry = ref::softmax(finite0, 1, cols);
  for (int64_t j = 0; j < cols; ++j) EXPECT_NEAR(y[j], ry[j], 1e-6 * ry[j]) << j;
  for (int64_t j = 0; j < cols; ++j) {
    if (j % 3 == 0) {
      EXPECT_EQ(y[cols + j], 0.0f) << j;
    }
    EXPECT_EQ(y[2 * cols + j], 0.0f) << j;
    EXPECT_EQ(dx[2 * cols + j], 0.0f) << j;
  }
}

TEST(Activations, InPlaceMatchesOutOfPlace) {
  const int64_t n = 100, rows = 4, cols = 25;
  const auto a = randn(n, 40, 2.0f), b = randn(n, 41), g = randn(n, 42);
  std::vector<float> out(n), da(n), db(n), y(n), dx(n);
  ops::silu_mul_forward(out.data(), a.data(), b.data(), n);
  ops::silu_mul_backward(da.data(), db.data(), g.data(), a.data(), b.data(), n);
  ops::softmax_forward(y.data(), a.data(), rows, cols);
  ops::softmax_backward(dx.data(), g.data(), y.data(), rows, cols);

  std::vector<float> ia = a, ib = b;
  ops::silu_mul_forward(ia.data(), ia.data(), b.data(), n);  // out == a, as in the gated MLP
  EXPECT_EQ(ia, out);
  ia = a;
  ops::silu_mul_backward(ia.data(), ib.data(), g.data(), ia.data(), ib.data(), n);  // da == a, db == b
  EXPECT_EQ(ia, da);
  EXPECT_EQ(ib, db);
  std::vector<float> s = a, d = g;
  ops::softmax_forward(s.data(), s.data(), rows, cols);
  EXPECT_EQ(s, y);
  ops::softmax_backward(d.data(), d.data(), y.data(), rows, cols);
  EXPECT_EQ(d, dx);
  std::vector<float> sg = a;
  ops::sigmoid_forward(sg.data(), sg.data(), n);
  EXPECT_EQ(sg, [&] {
    std::vector<float> t(n);
    ops::sigmoid_forward(t.data(), a.data(), n);
    return t;
  }());
}

TEST(Activations, ResultsIndependentOfThreadCount) {
  const int64_t n = 50000, rows = 50, cols = 1000;
  const auto a = randn(n, 50), b = randn(n, 51);
  const auto run = [&] {
    std::vector<float> out(n), y(n);
    ops::silu_mul_forward(out.data(), a.data(), b.data(), n);
    ops::softmax_forward(y.data(), a.data(), rows, cols);
    out.insert(out.end(), y.begin(), y.end());
    return out;
  };
  test::expect_same_for_any_thread_count(run);
}

TEST(Activations, BadSizesThrow) {
  std::vector<float> x(4), y(4);
  EXPECT_THROW(ops::silu_mul_forward(y.data(), x.data(), x.data(), -1), Error);
  EXPECT_THROW(ops::sigmoid_forward(y.data(), x.data(), -1), Error);
  EXPECT_THROW(ops::softmax_forward(y.data(), x.data(), 2, 0), Error);
  EXPECT_THROW(ops::softmax_backward(y.data(), x.data(), x.data(), -1, 2), Error);
  EXPECT_NO_THROW(ops::silu_mul_forward(y.data(), x.data(), x.data(), 0));
}

}  // namespace activations_test
}  // namespace
}  // namespace ds
