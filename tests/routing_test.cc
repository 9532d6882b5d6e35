// Top-k and the sort-by-expert permutation: top-k against a stable-sort
// reference (ties, signed zeros, infinities, the NaN error, both selection
// paths), route_indices against std::stable_sort (one expert, empty experts,
// k = 1 and 8, bad ids), the gathers against the reference, the round trip
// through per-expert processing, and the backward passes against finite
// differences and by adjointness.
#include "ops/routing.h"

#include <omp.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "ops/reference/routing.h"
#include "test_util.h"

namespace ds {
namespace {
namespace routing_test {

using ds::test::ThreadCountGuard;

using test::expect_close;
using test::randn;
using test::to_double;

// Values on a coarse grid (multiples of 1/4 in [-2, 2)) so that rows are full of ties.
std::vector<float> coarse(size_t n, uint64_t seed) {
  std::vector<float> x(n);
  Philox rng(seed);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int>(rng.u32(i) % 16) - 8) / 4.0f;
  return x;
}

std::vector<int32_t> random_experts(int64_t n, int64_t num_experts, uint64_t seed) {
  std::vector<int32_t> e(n);
  Philox rng(seed);
  for (int64_t i = 0; i < n; ++i) e[i] = static_cast<int32_t>(rng.u32(i) % num_experts);
  return e;
}

struct TopK {
  std::vector<int32_t> idx;
  std::vector<float> val;
};

TopK run_topk(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t k) {
  TopK t{std::vector<int32_t>(rows * k), std::vector<float>(rows * k)};
  ops::topk(t.idx.data(), t.val.data(), x.data(), rows, cols, k);
  return t;
}

void expect_topk_matches_reference(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t k) {
  const TopK got = run_topk(x, rows, cols, k);
  EXPECT_EQ(got.idx, ref::topk(x, rows, cols, k)) << rows << "x" << cols << " k=" << k;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) ASSERT_EQ(got.val[r * k + j], x[r * cols + got.idx[r * k + j]]);
}

// k up to 32 takes the insertion path, above it the partial sort; k = cols is
// a full sort. Both random (distinct) and tie-heavy rows.
TEST(TopK, MatchesStableSortReference) {
  const int64_t rows = 13;
  for (int64_t cols : {1, 7, 64, 256}) {
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{8}, int64_t{33}, cols}) {
      if (k > cols) continue;
      expect_topk_matches_reference(randn(rows * cols, cols + k), rows, cols, k);
      expect_topk_matches_reference(coarse(rows * cols, cols + k + 1), rows, cols, k);
    }
  }
}

TEST(TopK, TiesGoToTheLowerIndexOnBothPaths) {
  // Hand-written: the three 3s come in index order, then the 2.
  const std::vector<float> x = {1, 3, 3, 2, 3};
  EXPECT_EQ(run_topk(x, 1, 5, 4).idx, (std::vector<int32_t>{1, 2, 4, 3}));
  // 40 equal values with k = 35 (partial-sort path): the first 35 indices.
  const std::vector<float> same(40, 0.5f);
  std::vector<int32_t> first(35);
  std::iota(first.begin(), first.end(), 0);
  EXPECT_EQ(run_topk(same, 1, 40, 35).idx, first);
}

// -0 equals +0 (a tie, so index order), and infinities sort at the ends.
TEST(TopK, SignedZerosAndInfinities) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {-inf, -0.0f, 0.0f, inf, -1.0f};
  EXPECT_EQ(run_topk(x, 1, 5, 5).idx, (std::vector<int32_t>{3, 1, 2, 4, 0}));
}

// NaN is rejected on both paths, wherever it is in the row.
TEST(TopK, NanThrows) {
  for (int64_t k : {1, 40}) {
    for (int64_t pos : {0, 17, 63}) {
      auto x = randn(2 * 64, 5);
      x[64 + pos] = std::numeric_limits<float>::quiet_NaN();
      EXPECT_THROW(run_topk(x, 2, 64, k), Error) << "k=" << k << " pos=" << pos;
    }
  }
}

TEST(TopK, BadKThrows) {
  const auto x = randn(12, 6);
  std::vector<int32_t> idx(12);
  std::vector<float> val(12);
  EXPECT_THROW(ops::topk(idx.data(), val.data(), x.data(), 2, 6, 0), Error);
  EXPECT_THROW(ops::topk(idx.data(), val.data(), x.data(), 2, 6, 7), Error);
  EXPECT_THROW(ops::topk(idx.data(), val.data(), x.data(), 2, 0, 1), Error);
}

// Enough rows to run in parallel; rows are independent, so any thread count
// must reproduce the reference.
TEST(TopK, ThreadCountDoesNotMatter) {
  ThreadCountGuard guard;
  const int64_t rows = 300, cols = 256;
  const auto x = coarse(rows * cols, 7);
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    expect_topk_matches_reference(x, rows, cols, 8);
  }
}

struct Routed {
  std::vector<int32_t> order, inverse, sizes;
};

Routed run_route_indices(const std::vector<int32_t>& experts, int64_t num_experts) {
  const int64_t n = experts.size();
  Routed r{std::vector<int32_t>(n), std::vector<int32_t>(n), std::vector<int32_t>(num_experts)};
  ops::route_indices(r.order.data(), r.inverse.data(), r.sizes.data(), experts.data(), n, num_experts);
  return r;
}

void expect_indices_match_reference(const std::vector<int32_t>& experts, int64_t num_experts) {
  const Routed got = run_route_indices(experts, num_experts);
  const ref::Routing want = ref::route_indices(experts, num_experts);
  EXPECT_EQ(got.order, want.order);
  EXPECT_EQ(got.inverse, want.inverse);
  EXPECT_EQ(got.sizes, want.group_sizes);
}

TEST(RouteIndices, MatchesStableSort) {
  for (int64_t k : {1, 8})
    for (int64_t tokens : {1, 37, 200}) expect_indices_match_reference(random_experts(tokens * k, 16, tokens + k), 16);
}

// Everything on one expert: the order is the identity and the other groups are empty.
TEST(RouteIndices, AllOnOneExpert) {
  const std::vector<int32_t> experts(24, 5);
  const Routed got = run_route_indices(experts, 8);
  std::vector<int32_t> iota(24);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(got.order, iota);
  EXPECT_EQ(got.inverse, iota);
  EXPECT_EQ(got.sizes, (std::vector<int32_t>{0, 0, 0, 0, 0, 24, 0, 0}));
}

// Only even experts used (odd ones empty, the last expert too).
TEST(RouteIndices, EmptyExperts) {
  auto experts = random_experts(60, 5, 3);
  for (auto& e : experts) e *= 2;  // in {0, 2, 4, 6, 8} of 10
  expect_indices_match_reference(experts, 10);
  const Routed got = run_route_indices(experts, 10);
  for (int g = 1; g < 10; g += 2) EXPECT_EQ(got.sizes[g], 0) << g;
}

TEST(RouteIndices, NoAssignments) {
  std::vector<int32_t> sizes(4, 9);
  ops::route_indices(nullptr, nullptr, sizes.data(), nullptr, 0, 4);
  EXPECT_EQ(sizes, std::vector<int32_t>(4, 0));
}

TEST(RouteIndices, OutOfRangeExpertThrows) {
  for (int32_t bad : {-1, 4}) {
    std::vector<int32_t> experts = {0, 1, bad, 3}, order(4), inverse(4), sizes(4);
    EXPECT_THROW(ops::route_indices(order.data(), inverse.data(), sizes.data(), experts.data(), 4, 4), Error) << bad;
  }
}

// The gathers copy rows, so they must reproduce the reference bit for bit.
TEST(Route, ForwardMatchesReference) {
  for (int64_t k : {1, 8}) {
    const int64_t tokens = 37, dim = 20, n = tokens * k;
    const auto experts = random_experts(n, 16, 40 + k);
    const Routed r = run_route_indices(experts, 16);
    const auto x = randn(tokens * dim, 41), y = randn(n * dim, 42);
    std::vector<float> xs(n * dim), out(n * dim), dy(n * dim);
    ops::route_forward(xs.data(), x.data(), r.order.data(), tokens, k, dim);
    EXPECT_EQ(xs, ref::route(x, r.order, k, dim));
    ops::unroute_forward(out.data(), y.data(), r.inverse.data(), n, dim);
    EXPECT_EQ(out, ref::unroute(y, r.inverse, dim));
    ops::unroute_backward(dy.data(), y.data(), r.order.data(), n, dim);
    EXPECT_EQ(dy, ref::unroute_backward(y, r.inverse, dim));
  }
}

// route -> per-expert work on contiguous groups -> unroute gives, in
// assignment order, each token's row processed by the expert it chose. The
// "expert" here multiplies by (g + 1), exact in float for these values.
TEST(Route, RoundTripThroughExpertGroups) {
  const int64_t tokens = 29, k = 8, dim = 6, E = 12, n = tokens * k;
  const auto experts = random_experts(n, E, 50);
  const Routed r = run_route_indices(experts, E);
  const auto x = coarse(tokens * dim, 51);
  std::vector<float> xs(n * dim), out(n * dim);
  ops::route_forward(xs.data(), x.data(), r.order.data(), tokens, k, dim);
  int64_t row = 0;
  for (int64_t g = 0; g < E; ++g)
    for (int32_t i = 0; i < r.sizes[g]; ++i, ++row)
      for (int64_t c = 0; c < dim; ++c) xs[row * dim + c] *= static_cast<float>(g + 1);
  ASSERT_EQ(row, n);
  ops::unroute_forward(out.data(), xs.data(), r.inverse.data(), n, dim);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = 0; c < dim; ++c)
        ASSERT_EQ(out[(t * k + j) * dim + c], x[t * dim + c] * static_cast<float>(experts[t * k + j] + 1))
            << t << " " << j << " " << c;
}

// The double reference's backward against central differences of its forward.
TEST(Route, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t tokens = 4, k = 3, dim = 2, n = tokens * k;
  const auto experts = random_experts(n, 5, 60);
  const ref::Routing r = ref::route_indices(experts, 5);
  const auto x = to_double(randn(tokens * dim, 61)), y = to_double(randn(n * dim, 62));
  const auto g = to_double(randn(n * dim, 63));
  const auto fx = [&](const std::vector<double>& v) { return test::weighted_sum(ref::route(v, r.order, k, dim), g); };
  const auto fy = [&](const std::vector<double>& v) { return test::weighted_sum(ref::unroute(v, r.inverse, dim), g); };
  // Both maps are linear, so central differences are exact up to rounding
  // (~1e-16 |f| / h = 1e-10 with h = 1e-6); 1e-8 is still far below a missing term.
  expect_close(ref::route_backward(g, r.order, tokens, k, dim), test::numeric_grad(fx, x), 0, 1e-8, "route dx");
  expect_close(ref::unroute_backward(g, r.inverse, dim), test::numeric_grad(fy, y), 0, 1e-8, "unroute dy");
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// The float kernels against the reference, and as adjoints of their forwards:
// <route(x), y> = <x, route_backward(y)>, <unroute(y), z> = <y, unroute_backward(z)>.
TEST(Route, BackwardMatchesReferenceAndIsTheAdjoint) {
  for (int64_t k : {1, 8}) {
    const int64_t tokens = 33, dim = 17, n = tokens * k;
    const auto experts = random_experts(n, 16, 70 + k);
    const Routed r = run_route_indices(experts, 16);
    const auto x = randn(tokens * dim, 71), y = randn(n * dim, 72), z = randn(n * dim, 73);
    std::vector<float> xs(n * dim), dx(tokens * dim), uy(n * dim), dy(n * dim);
    ops::route_forward(xs.data(), x.data(), r.order.data(), tokens, k, dim);
    ops::route_backward(dx.data(), y.data(), r.inverse.data(), tokens, k, dim);
    ops::unroute_forward(uy.data(), y.data(), r.inverse.data(), n, dim);
    ops::unroute_backward(dy.data(), z.data(), r.order.data(), n, dim);
    // dx sums k float terms of order 1 in j order rather than the reference's
    // sorted order: at most k roundings of 2^-24 relative each.
    expect_close(dx, ref::route_backward(to_double(y), r.order, tokens, k, dim), 1e-6, 0, "route dx");
    // The inner products sum n * dim products of order 1 in double; the two
    // sides differ only by the float rounding of dx's sums (~k 2^-24 per entry,
    // sqrt(tokens * dim) entries of random sign), so 1e-5 absolute is generous.
    EXPECT_NEAR(dot(xs, y), dot(x, dx), 1e-5) << "route, k=" << k;
    // unroute and its backward only move values: the sums agree to double rounding.
    EXPECT_NEAR(dot(uy, z), dot(y, dy), 1e-9) << "unroute, k=" << k;
  }
}

// Tokens are independent rows; the j-order sum must give the same bits for any
// thread count.
TEST(Route, BackwardBitwiseIndependentOfThreadCount) {
  ThreadCountGuard guard;
  const int64_t tokens = 300, k = 8, dim = 32, n = tokens * k;
  const Routed r = run_route_indices(random_experts(n, 64, 80), 64);
  const auto dout = randn(n * dim, 81);
  std::vector<float> want(tokens * dim), got(tokens * dim);
  omp_set_num_threads(1);
  ops::route_backward(want.data(), dout.data(), r.inverse.data(), tokens, k, dim);
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    ops::route_backward(got.data(), dout.data(), r.inverse.data(), tokens, k, dim);
    EXPECT_EQ(got, want) << threads << " threads";
  }
}

TEST(Route, BadIndicesThrow) {
  const int64_t tokens = 2, k = 2, dim = 3, n = tokens * k;
  std::vector<float> x(tokens * dim), out(n * dim);
  std::vector<int32_t> bad = {0, 1, 4, 2};
  EXPECT_THROW(ops::route_forward(out.data(), x.data(), bad.data(), tokens, k, dim), Error);
  EXPECT_THROW(ops::route_backward(x.data(), out.data(), bad.data(), tokens, k, dim), Error);
  EXPECT_THROW(ops::unroute_forward(out.data(), out.data(), bad.data(), n, dim), Error);
  EXPECT_THROW(ops::unroute_backward(out.data(), out.data(), bad.data(), n, dim), Error);
  std::vector<int32_t> ok = {0, 1, 2, 3};
  EXPECT_THROW(ops::route_forward(out.data(), x.data(), ok.data(), tokens, 0, dim), Error);
  EXPECT_THROW(ops::unroute_forward(out.data(), out.data(), ok.data(), n, 0), Error);
}

}  // namespace routing_test
}  // namespace
}  // namespace ds
