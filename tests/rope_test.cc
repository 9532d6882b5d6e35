// RoPE / YaRN: the frequencies against an independent computation and their
// known structure, the rotation against the seed's matrix formulation, the
// relation between the two layouts, norm preservation, position 0, the
// reference backward against finite differences, the float32 kernels against
// the reference, strided and in-place use, and bad inputs.
#include "ops/rope.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <utility>
#include <vector>

#include "core/error.h"
#include "ops/reference/rope.h"
#include "test_util.h"

namespace ds {
namespace {
namespace rope_test {

using ops::RopeConfig;
using ops::RopeLayout;
using test::expect_close;
using test::randn;
using test::to_double;

// DeepSeek-V3's rope_scaling: qk_rope_head_dim 64, theta 1e4, factor 40 over an
// original context of 4096, beta_fast 32, beta_slow 1.
RopeConfig deepseek_v3() {
  RopeConfig c;
  c.dim = 64;
  c.theta = 10000.0;
  c.factor = 40.0;
  c.original_max_position = 4096;
  c.beta_fast = 32.0;
  c.beta_slow = 1.0;
  return c;
}

std::vector<float> frequencies(const RopeConfig& c) {
  std::vector<float> f(c.dim / 2);
  ops::rope_frequencies(f.data(), c);
  return f;
}

// Base inverse frequency theta^(-2i/dim), in double.
double base_freq(const RopeConfig& c, int64_t i) { return 1.0 / std::pow(c.theta, 2.0 * i / c.dim); }

// Ramp ends in pair-index units (YaRN's correction range), in double.
double ramp_end(const RopeConfig& c, double beta) {
  return c.dim * std::log(c.original_max_position / (beta * 2 * std::numbers::pi)) / (2 * std::log(c.theta));
}

// YaRN frequencies written from the seed's vectorised form: a weight
// `smooth` per pair from a clipped linear function of the pair index.
std::vector<double> yarn_frequencies(const RopeConfig& c) {
  const double low = std::max(std::floor(ramp_end(c, c.beta_fast)), 0.0);
  const double high = std::min(std::ceil(ramp_end(c, c.beta_slow)), double(c.dim - 1));
  const double diff = high > low ? high - low : 0.001;
  std::vector<double> f(c.dim / 2);
  for (int64_t i = 0; i < c.dim / 2; ++i) {
    double lin = (i - low) / diff;
    lin = lin < 0 ? 0 : (lin > 1 ? 1 : lin);
    const double smooth = 1 - lin;
    f[i] = base_freq(c, i) / c.factor * (1 - smooth) + base_freq(c, i) * smooth;
  }
  return f;
}

TEST(RopeFrequencies, MatchIndependentYarnComputation) {
  const RopeConfig c = deepseek_v3();
  const auto got = frequencies(c);
  const auto want = yarn_frequencies(c);
  // Both evaluate the same double expression up to operation order and round
  // once to float, so they may differ by at most one float ulp (2^-23 relative).
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], std::ldexp(want[i], -23)) << i;
}

TEST(RopeFrequencies, DeepSeekV3Structure) {
  const RopeConfig c = deepseek_v3();
  // By hand: low = floor(64 ln(4096 / (64 pi)) / (2 ln 1e4)) = floor(10.47),
  // high = ceil(64 ln(4096 / (2 pi)) / (2 ln 1e4)) = ceil(22.51).
  const int64_t low = 10, high = 23;
  EXPECT_EQ(std::floor(ramp_end(c, c.beta_fast)), low);
  EXPECT_EQ(std::ceil(ramp_end(c, c.beta_slow)), high);
  const auto f = frequencies(c);
  for (int64_t i = 0; i < c.dim / 2; ++i) {
    const float base = static_cast<float>(base_freq(c, i));
    const float scaled = static_cast<float>(base_freq(c, i) / c.factor);
    if (i <= low) {
      EXPECT_EQ(f[i], base) << i;  // smooth = 1: the high frequencies are kept exactly
    } else if (i >= high) {
      EXPECT_EQ(f[i], scaled) << i;  // smooth = 0: fully interpolated
    } else {
      EXPECT_LT(f[i], base) << i;  // on the ramp: strictly between the two
      EXPECT_GT(f[i], scaled) << i;
    }
  }
  EXPECT_EQ(f[0], 1.0f);
}

TEST(RopeFrequencies, FactorOneIsPlainRope) {
  RopeConfig c = deepseek_v3();
  c.factor = 1.0;
  for (int64_t dim : {64, 128, 2}) {
    c.dim = dim;
    const auto f = frequencies(c);
    for (int64_t i = 0; i < dim / 2; ++i) EXPECT_EQ(f[i], static_cast<float>(base_freq(c, i))) << dim << " " << i;
  }
}

TEST(RopeFrequencies, BadConfigThrows) {
  std::vector<float> f(64);
  RopeConfig c = deepseek_v3();
  c.dim = 63;
  EXPECT_THROW(ops::rope_frequencies(f.data(), c), Error);
  c = deepseek_v3();
  c.theta = 1.0;
  EXPECT_THROW(ops::rope_frequencies(f.data(), c), Error);
  c = deepseek_v3();
  c.factor = 0.0;
  EXPECT_THROW(ops::rope_frequencies(f.data(), c), Error);
  c = deepseek_v3();
  c.beta_slow = -1.0;
  EXPECT_THROW(ops::rope_frequencies(f.data(), c), Error);
}

// Fixed problem: compact [tokens, heads, dim] with the V3 frequencies scaled to dim.
struct Problem {
  int64_t tokens, heads, dim;
  std::vector<float> x, freqs;
  std::vector<int32_t> pos;

  Problem(int64_t t, int64_t h, int64_t d, std::vector<int32_t> p, uint64_t seed)
      : tokens(t), heads(h), dim(d), x(randn(t * h * d, seed)), pos(std::move(p)) {
    RopeConfig c = deepseek_v3();
    c.dim = d;
    freqs = frequencies(c);
  }
  std::vector<float> forward(const std::vector<float>& in, RopeLayout layout) const {
    std::vector<float> y(in.size());
    ops::rope_forward(y.data(), in.data(), pos.data(), freqs.data(), tokens, heads, dim, heads * dim, dim, layout);
    return y;
  }
  std::vector<float> backward(const std::vector<float>& dy, RopeLayout layout) const {
    std::vector<float> dx(dy.size());
    ops::rope_backward(dx.data(), dy.data(), pos.data(), freqs.data(), tokens, heads, dim, heads * dim, dim, layout);
    return dx;
  }
};

class RopeLayouts : public ::testing::TestWithParam<RopeLayout> {};

// The seed's formulation for interleaved pairs: y = x cos + (x M) sin, with
// M = eye[swap] * negate, swap = [1, 0, 3, 2, ...], negate = -1 on even columns.
TEST(Rope, InterleavedMatchesSeedMatrixForm) {
  const Problem p(3, 2, 8, {0, 7, 4000}, 1);
  const int64_t d = p.dim;
  std::vector<double> M(d * d, 0.0);
  for (int64_t j = 0; j < d; ++j) {
    const int64_t swap = j % 2 == 0 ? j + 1 : j - 1;
    for (int64_t k = 0; k < d; ++k) M[j * d + k] = (swap == k ? 1.0 : 0.0) * (k % 2 == 0 ? -1.0 : 1.0);
  }
  std::vector<double> want(p.x.size());
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t k = 0; k < d; ++k) {
        const float angle = static_cast<float>(p.pos[t]) * p.freqs[k / 2];  // freqs repeated twice
        const float* xh = p.x.data() + (t * p.heads + h) * d;
        double xm = 0;
        for (int64_t j = 0; j < d; ++j) xm += double(xh[j]) * M[j * d + k];
        want[(t * p.heads + h) * d + k] = xh[k] * std::cos(double(angle)) + xm * std::sin(double(angle));
      }
  // Float32 rotation of values of order 1: a few ulp of max |x|.
  expect_close(p.forward(p.x, RopeLayout::Interleaved), want, 1e-6, 0);
}

// Half-split rotation of x equals the interleaved rotation of the
// interleaved-order copy of x, read back in half-split order.
TEST(Rope, HalfSplitIsInterleavedUnderPermutation) {
  const Problem p(4, 3, 16, {0, 1, 99, 163839}, 2);
  const int64_t half = p.dim / 2;
  // perm[k]: position in the half-split head of interleaved element k.
  std::vector<int64_t> perm(p.dim);
  for (int64_t i = 0; i < half; ++i) {
    perm[2 * i] = i;
    perm[2 * i + 1] = i + half;
  }
  std::vector<float> xi(p.x.size());
  for (int64_t r = 0; r < p.tokens * p.heads; ++r)
    for (int64_t k = 0; k < p.dim; ++k) xi[r * p.dim + k] = p.x[r * p.dim + perm[k]];
  const auto yi = p.forward(xi, RopeLayout::Interleaved);
  std::vector<float> back(p.x.size());
  for (int64_t r = 0; r < p.tokens * p.heads; ++r)
    for (int64_t k = 0; k < p.dim; ++k) back[r * p.dim + perm[k]] = yi[r * p.dim + k];
  // The same pairs meet the same cos/sin in the same operations: bitwise equal.
  EXPECT_EQ(p.forward(p.x, RopeLayout::HalfSplit), back);
}

TEST_P(RopeLayouts, PositionZeroIsIdentity) {
  const Problem p(2, 3, 64, {0, 0}, 3);
  EXPECT_EQ(p.forward(p.x, GetParam()), p.x);  // cos 0 = 1 and sin 0 = 0 exactly
  EXPECT_EQ(p.backward(p.x, GetParam()), p.x);
}

TEST_P(RopeLayouts, RotationPreservesPairNorms) {
  const Problem p(3, 2, 64, {1, 4096, 100000}, 4);
  const auto y = p.forward(p.x, GetParam());
  for (int64_t r = 0; r < p.tokens * p.heads; ++r)
    for (int64_t i = 0; i < p.dim / 2; ++i) {
      int64_t a, b;
      ref::rope_pair(i, p.dim, GetParam(), a, b);
      const float* xr = p.x.data() + r * p.dim;
      const float* yr = y.data() + r * p.dim;
      const double nx = double(xr[a]) * xr[a] + double(xr[b]) * xr[b];
      const double ny = double(yr[a]) * yr[a] + double(yr[b]) * yr[b];
      // cos^2 + sin^2 = 1 up to the float rounding of c, s and the products: ~1e-7 relative.
      EXPECT_NEAR(ny, nx, 1e-6 * nx) << r << " " << i;
    }
}

// L = sum(g * rope(x)) in double: the reference backward is its gradient.
TEST_P(RopeLayouts, ReferenceBackwardMatchesFiniteDifferences) {
  const Problem p(3, 2, 8, {0, 5, 1000}, 5);
  const auto x = to_double(p.x), g = to_double(randn(p.x.size(), 6));
  const auto dx = ref::rope_backward(g, p.pos, p.freqs, p.tokens, p.heads, p.dim, GetParam());
  const auto f = [&](const std::vector<double>& v) {
    return test::weighted_sum(ref::rope(v, p.pos, p.freqs, p.tokens, p.heads, p.dim, GetParam()), g);
  };
  // The objective is linear in x: central differences are exact up to the
  // rounding of f, ~1e-16 * |f| / h = 1e-10 with h = 1e-6.
  expect_close(dx, test::numeric_grad(f, x), 0, 1e-8);
}

TEST_P(RopeLayouts, FastMatchesReference) {
  // Positions up to DeepSeek-V3's 163840-token context.
  const Problem p(5, 3, 64, {0, 1, 4095, 4096, 163839}, 7);
  const auto dy = randn(p.x.size(), 8);
  const auto y = ref::rope(to_double(p.x), p.pos, p.freqs, p.tokens, p.heads, p.dim, GetParam());
  const auto dx = ref::rope_backward(to_double(dy), p.pos, p.freqs, p.tokens, p.heads, p.dim, GetParam());
  // Same float32 angles; cos/sin rounded to float and two float products per
  // output: a few ulp of the largest |x| (~4), far below 1e-6 of it.
  expect_close(p.forward(p.x, GetParam()), y, 1e-6, 0, "y");
  expect_close(p.backward(dy, GetParam()), dx, 1e-6, 0, "dx");
  // Backward is the inverse: rotating back recovers x to rounding.
  expect_close(p.backward(p.forward(p.x, GetParam()), GetParam()), to_double(p.x), 1e-6, 0, "x");
}

// q_pe inside q [tokens, heads, 192] (128 nope + 64 rope per head), rotated in
// place through strides: only the rope slice changes, and it changes as a
// compact rotation would.
TEST_P(RopeLayouts, StridedInPlaceTouchesOnlyTheRopeSlice) {
  const int64_t tokens = 4, heads = 3, qk = 192, nope = 128, rope = 64;
  const Problem p(tokens, heads, rope, {3, 0, 70000, 12}, 9);
  const auto q0 = randn(tokens * heads * qk, 10);
  std::vector<float> compact(tokens * heads * rope);
  for (int64_t r = 0; r < tokens * heads; ++r)
    for (int64_t k = 0; k < rope; ++k) compact[r * rope + k] = q0[r * qk + nope + k];
  const auto y = p.forward(compact, GetParam());
  const auto dx = p.backward(compact, GetParam());
  for (bool fwd : {true, false}) {
    std::vector<float> q = q0;
    float* qpe = q.data() + nope;  // [tokens, heads, 64] with strides (heads * 192, 192)
    if (fwd)
      ops::rope_forward(qpe, qpe, p.pos.data(), p.freqs.data(), tokens, heads, rope, heads * qk, qk, GetParam());
    else
      ops::rope_backward(qpe, qpe, p.pos.data(), p.freqs.data(), tokens, heads, rope, heads * qk, qk, GetParam());
    const auto& want = fwd ? y : dx;
    for (int64_t r = 0; r < tokens * heads; ++r)
      for (int64_t k = 0; k < qk; ++k) {
        const float expect = k < nope ? q0[r * qk + k] : want[r * rope + k - nope];
        ASSERT_EQ(q[r * qk + k], expect) << (fwd ? "forward" : "backward") << " row " << r << " col " << k;
      }
  }
}

// k_pe: a single shared head (heads = 1), in place.
TEST_P(RopeLayouts, SingleHeadInPlaceMatchesOutOfPlace) {
  const Problem p(6, 1, 64, {0, 1, 2, 3, 4, 5}, 11);
  const auto y = p.forward(p.x, GetParam());
  std::vector<float> z = p.x;
  ops::rope_forward(z.data(), z.data(), p.pos.data(), p.freqs.data(), p.tokens, 1, p.dim, p.dim, p.dim, GetParam());
  EXPECT_EQ(z, y);
}

// A packed batch repeats its positions (fewer positions than tokens): the
// cos and sin are then taken once per position, with the same bits as one
// token at a time, forward and backward.
TEST_P(RopeLayouts, RepeatedPositionsMatchOneTokenAtATime) {
  const Problem p(9, 3, 64, {0, 1, 2, 3, 0, 1, 2, 0, 1}, 13);
  for (bool fwd : {true, false}) {
    const auto y = fwd ? p.forward(p.x, GetParam()) : p.backward(p.x, GetParam());
    std::vector<float> z(p.x.size());
    const int64_t row = p.heads * p.dim;
    for (int64_t t = 0; t < p.tokens; ++t) {
      auto* f = fwd ? &ops::rope_forward : &ops::rope_backward;
      f(z.data() + t * row, p.x.data() + t * row, p.pos.data() + t, p.freqs.data(), 1, p.heads, p.dim, row, p.dim,
        GetParam());
    }
    EXPECT_EQ(z, y) << (fwd ? "forward" : "backward");
  }
}

// Positions up to a few thousand take their cos and sin from a table kept
// between calls, far ones are computed per call: both give the same bits,
// forward and backward, and a table made for other frequencies is not reused.
TEST_P(RopeLayouts, TabledAnglesEqualDirectOnes) {
  const std::vector<int32_t> near = {0, 1, 5, 100, 4000, 7};
  std::vector<int32_t> with_far = near;
  with_far.push_back(163839);  // past the table: the whole call computes its angles directly
  const Problem a(static_cast<int64_t>(near.size()), 2, 64, near, 21);
  Problem far(static_cast<int64_t>(with_far.size()), 2, 64, with_far, 21);
  Problem other = a;  // other frequencies, same size
  for (float& f : other.freqs) f *= 0.75f;
  Problem other_far = far;
  other_far.freqs = other.freqs;
  const int64_t n = a.x.size();
  std::copy(a.x.begin(), a.x.end(), far.x.begin());
  other_far.x = far.x;
  for (int round = 0; round < 2; ++round)  // the second round reuses the tables
    for (bool fwd : {true, false}) {
      auto run = [&](const Problem& p) { return fwd ? p.forward(p.x, GetParam()) : p.backward(p.x, GetParam()); };
      const auto direct = run(far), direct_other = run(other_far);
      const auto tabled = run(a), tabled_other = run(other);
      ASSERT_EQ(tabled, std::vector<float>(direct.begin(), direct.begin() + n)) << "round " << round << " fwd " << fwd;
      ASSERT_EQ(tabled_other, std::vector<float>(direct_other.begin(), direct_other.begin() + n))
          << "round " << round << " fwd " << fwd;
      ASSERT_NE(tabled, tabled_other);
    }
  // More sets of frequencies than a thread keeps tables for, met in turn
  // (each set's table is evicted and rebuilt): still the direct bits.
  for (int round = 0; round < 2; ++round)
    for (int i = 0; i < 6; ++i) {
      Problem p = a, q = far;
      for (float& f : p.freqs) f *= 1.0f - 0.05f * static_cast<float>(i);
      q.freqs = p.freqs;
      const auto direct = q.forward(q.x, GetParam());
      ASSERT_EQ(p.forward(p.x, GetParam()), std::vector<float>(direct.begin(), direct.begin() + n))
          << "round " << round << " set " << i;
    }
}

INSTANTIATE_TEST_SUITE_P(Layouts, RopeLayouts, ::testing::Values(RopeLayout::Interleaved, RopeLayout::HalfSplit));

TEST(Rope, ResultIndependentOfThreadCount) {
  const Problem p(7, 5, 64, {0, 9, 8, 7, 6, 5, 100000}, 12);
  test::expect_same_for_any_thread_count([&] { return p.forward(p.x, RopeLayout::Interleaved); });
}

TEST(Rope, BadInputsThrowAndWriteNothing) {
  Problem p(3, 2, 8, {0, -1, 5}, 13);
  std::vector<float> y(p.x.size(), 7.0f);
  EXPECT_THROW(
      ops::rope_forward(y.data(), p.x.data(), p.pos.data(), p.freqs.data(), 3, 2, 8, 16, 8, RopeLayout::Interleaved),
      Error);
  EXPECT_EQ(y, std::vector<float>(p.x.size(), 7.0f));
  EXPECT_THROW(
      ops::rope_backward(y.data(), p.x.data(), p.pos.data(), p.freqs.data(), 3, 2, 8, 16, 8, RopeLayout::HalfSplit),
      Error);
  p.pos[1] = 1;
  EXPECT_THROW(
      ops::rope_forward(y.data(), p.x.data(), p.pos.data(), p.freqs.data(), 3, 2, 7, 16, 8, RopeLayout::Interleaved),
      Error);  // odd dim
  EXPECT_THROW(
      ops::rope_forward(y.data(), p.x.data(), p.pos.data(), p.freqs.data(), 3, 2, 8, 16, 4, RopeLayout::Interleaved),
      Error);  // heads overlap
  EXPECT_NO_THROW(
      ops::rope_forward(y.data(), p.x.data(), p.pos.data(), p.freqs.data(), 3, 2, 8, 16, 8, RopeLayout::Interleaved));
}

}  // namespace rope_test
}  // namespace
}  // namespace ds
