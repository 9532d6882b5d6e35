// Grouped (ragged) matmul: the double reference's backward against finite
// differences; the float32 tiled kernel against the reference on ragged
// layouts (empty groups anywhere, rows past the groups, one-row groups, one
// group holding everything, nothing at all) in both rhs layouts; bad group
// sizes; and bitwise reproducibility across thread counts.
#include "ops/grouped_matmul.h"

#include <omp.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/reference/grouped_matmul.h"
#include "ops/reference/matmul.h"
#include "test_util.h"

namespace ds {
namespace {
namespace grouped_matmul_test {

using ds::test::ThreadCountGuard;

using test::expect_close;
using test::randn;
using test::to_double;

// float32 vs the double reference: outputs are dot products of at most 1100
// float32 terms of size ~1, whose rounding (~sqrt(1100) * 6e-8 of the terms) is
// well below 1e-5 of the largest output (itself ~sqrt(terms)); a single wrong
// or missing term is far above it.
constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

struct Case {
  std::string name;
  std::vector<int32_t> sizes;
  int64_t M, K, N;
};

// Forward, dlhs and drhs (accumulated onto random prior contents) of the fast
// kernel vs the reference, for one layout of groups and one rhs layout.
void check_against_reference(const Case& c, bool trans_rhs) {
  SCOPED_TRACE(c.name + (trans_rhs ? " (trans_rhs)" : ""));
  const int64_t G = static_cast<int64_t>(c.sizes.size()), M = c.M, K = c.K, N = c.N;
  const auto lhs = randn(M * K, 1), rhs = randn(G * K * N, 2), dout = randn(M * N, 3), drhs0 = randn(G * K * N, 4);
  std::vector<float> out(M * N, 7.0f), dlhs(M * K, 7.0f), drhs = drhs0;  // 7s: stale values to overwrite
  ops::grouped_matmul_forward(out.data(), lhs.data(), rhs.data(), c.sizes.data(), G, M, K, N, trans_rhs);
  ops::grouped_matmul_backward(dlhs.data(), drhs.data(), dout.data(), lhs.data(), rhs.data(), c.sizes.data(), G, M, K,
                               N, trans_rhs);
  const auto want_out = ref::grouped_matmul(to_double(lhs), to_double(rhs), c.sizes, M, K, N, trans_rhs);
  std::vector<double> want_dlhs, want_drhs = to_double(drhs0);
  ref::grouped_matmul_backward(want_dlhs, want_drhs, to_double(dout), to_double(lhs), to_double(rhs), c.sizes, M, K, N,
                               trans_rhs);
  expect_close(out, want_out, kRtol, kAtol, "out");
  expect_close(dlhs, want_dlhs, kRtol, kAtol, "dlhs");
  expect_close(drhs, want_drhs, kRtol, kAtol, "drhs");

  // Rows past the groups are exactly zero; an empty group's drhs is untouched.
  const int64_t used = std::accumulate(c.sizes.begin(), c.sizes.end(), int64_t{0});
  for (int64_t i = used * N; i < M * N; ++i) ASSERT_EQ(out[i], 0.0f) << "out row " << i / N;
  for (int64_t i = used * K; i < M * K; ++i) ASSERT_EQ(dlhs[i], 0.0f) << "dlhs row " << i / K;
  for (int64_t g = 0; g < G; ++g) {
    if (c.sizes[g] == 0) {
      EXPECT_EQ(0, std::memcmp(drhs.data() + g * K * N, drhs0.data() + g * K * N, K * N * sizeof(float))) << g;
    }
  }

  // Either gradient may be skipped.
  std::vector<float> dlhs_only(M * K, 7.0f), drhs_only = drhs0;
  ops::grouped_matmul_backward(dlhs_only.data(), nullptr, dout.data(), lhs.data(), rhs.data(), c.sizes.data(), G, M, K,
                               N, trans_rhs);
  ops::grouped_matmul_backward(nullptr, drhs_only.data(), dout.data(), lhs.data(), rhs.data(), c.sizes.data(), G, M, K,
                               N, trans_rhs);
  EXPECT_EQ(dlhs_only, dlhs);
  EXPECT_EQ(drhs_only, drhs);
}

// The reference is a loop of plain matmuls: check it is one, group by group,
// against ref::matmul (an independent formulation of the same product).
TEST(GroupedMatmulReference, IsAMatmulPerGroup) {
  const std::vector<int32_t> sizes = {2, 0, 3};
  const int64_t G = 3, M = 6, K = 4, N = 5;
  const auto lhs = to_double(randn(M * K, 5)), rhs = to_double(randn(G * K * N, 6));
  for (const bool trans_rhs : {false, true}) {
    const auto out = ref::grouped_matmul(lhs, rhs, sizes, M, K, N, trans_rhs);
    int64_t r = 0;
    for (int64_t g = 0; g < G; ++g) {
      const std::vector<double> lg(lhs.begin() + r * K, lhs.begin() + (r + sizes[g]) * K);
      const std::vector<double> rg(rhs.begin() + g * K * N, rhs.begin() + (g + 1) * K * N);
      const std::vector<double> og(out.begin() + r * N, out.begin() + (r + sizes[g]) * N);
      // Same sums of products in the same order: equal to double rounding.
      expect_close(og, ref::matmul(lg, rg, sizes[g], N, K, false, trans_rhs), 1e-14, 0, "group");
      r += sizes[g];
    }
    for (int64_t i = r * N; i < M * N; ++i) EXPECT_EQ(out[i], 0.0);
  }
}

// Reference backward vs central finite differences of the reference forward in
// double, L = sum(w * out), with an empty group and a row past the groups.
TEST(GroupedMatmulReference, BackwardMatchesFiniteDifferences) {
  const std::vector<int32_t> sizes = {2, 0, 1, 2};
  const int64_t G = 4, M = 6, K = 3, N = 4;
  for (const bool trans_rhs : {false, true}) {
    const auto lhs = to_double(randn(M * K, 7)), rhs = to_double(randn(G * K * N, 8)), w = to_double(randn(M * N, 9));
    std::vector<double> dlhs, drhs;
    ref::grouped_matmul_backward(dlhs, drhs, w, lhs, rhs, sizes, M, K, N, trans_rhs);
    const auto f_lhs = [&](const std::vector<double>& x) {
      return test::weighted_sum(ref::grouped_matmul(x, rhs, sizes, M, K, N, trans_rhs), w);
    };
    const auto f_rhs = [&](const std::vector<double>& x) {
      return test::weighted_sum(ref::grouped_matmul(lhs, x, sizes, M, K, N, trans_rhs), w);
    };
    // Bilinear objective: central differences are exact up to the rounding of
    // f, ~1e-16 * |f| / h ~ 1e-10 for h = 1e-6.
    expect_close(dlhs, test::numeric_grad(f_lhs, lhs), 0, 1e-8, "dlhs");
    expect_close(drhs, test::numeric_grad(f_rhs, rhs), 0, 1e-8, "drhs");
  }
}

class GroupedMatmulLayouts : public ::testing::TestWithParam<bool> {};

TEST_P(GroupedMatmulLayouts, MatchesReference) {
  const bool trans_rhs = GetParam();
  const std::vector<Case> cases = {
      {"ragged", {5, 17, 1, 9}, 32, 24, 20},
      {"all rows in one group", {30}, 30, 19, 21},
      {"empty first, middle and last groups", {0, 6, 0, 0, 11, 0}, 17, 16, 12},
      {"rows past the groups", {4, 3}, 12, 10, 9},
      {"no rows at all", {0, 0, 0}, 0, 8, 8},
      {"only empty groups, rows past them", {0, 0}, 5, 8, 8},
      {"no groups", {}, 4, 8, 8},
      {"single-row groups", {1, 1, 1, 1, 1}, 6, 33, 17},
      {"one row, one column", {1, 0}, 1, 7, 1},
      // Outputs wider and taller than one tile, so several gemm calls share
      // one group and each sees an offset sub-block of lhs, rhs and out.
      {"multi-tile groups", {600, 3, 70}, 700, 40, 1100},
      {"K = 0", {3, 2}, 6, 0, 5},
      {"N = 0", {3, 2}, 6, 5, 0},
  };
  for (const Case& c : cases) check_against_reference(c, trans_rhs);
}

INSTANTIATE_TEST_SUITE_P(RhsLayouts, GroupedMatmulLayouts, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "trans_rhs" : "plain"; });

TEST(GroupedMatmul, BadGroupSizesThrow) {
  std::vector<float> out(16), lhs(16), rhs(64), dlhs(16), drhs(64), dout(16);
  const std::vector<int32_t> negative = {3, -1}, too_many = {3, 2};  // M = 4 rows only
  for (const auto* sizes : {&negative, &too_many}) {
    EXPECT_THROW(ops::grouped_matmul_forward(out.data(), lhs.data(), rhs.data(), sizes->data(), 2, 4, 4, 4), Error);
    EXPECT_THROW(ops::grouped_matmul_backward(dlhs.data(), drhs.data(), dout.data(), lhs.data(), rhs.data(),
                                              sizes->data(), 2, 4, 4, 4),
                 Error);
  }
  const std::vector<int32_t> ok = {2, 2};
  EXPECT_THROW(ops::grouped_matmul_forward(out.data(), lhs.data(), rhs.data(), ok.data(), 2, -4, 4, 4), Error);
  EXPECT_THROW(ops::grouped_matmul_forward(out.data(), lhs.data(), rhs.data(), nullptr, 2, 4, 4, 4), Error);
}

// drhs sums over each group's rows; the result, and the other two products,
// must be bitwise identical whatever the thread count. The shapes span many
// tiles of unequal work, so the threads split the tiles differently each time.
TEST(GroupedMatmul, BitwiseReproducibleAcrossThreadCounts) {
  ThreadCountGuard guard;
  struct Layout {
    std::vector<int32_t> sizes;
    int64_t M, K, N;
  };
  // Many tiles of unequal work, dealt out differently for each thread count;
  // and a few large tiles, each of which gemm splits over the threads itself.
  const Layout layouts[] = {{{700, 0, 5, 1, 300, 64}, 1100, 40, 600}, {{1500, 0}, 1500, 40, 300}};
  for (const Layout& l : layouts) {
    for (const bool trans_rhs : {false, true}) {
      const int64_t G = l.sizes.size(), M = l.M, K = l.K, N = l.N;
      const auto lhs = randn(M * K, 10), rhs = randn(G * K * N, 11), dout = randn(M * N, 12);
      std::vector<float> out[3], dlhs[3], drhs[3];
      for (int t = 0; t < 3; ++t) {
        omp_set_num_threads(t + 1);
        out[t].assign(M * N, 0.0f);
        dlhs[t].assign(M * K, 0.0f);
        drhs[t].assign(G * K * N, 0.5f);
        ops::grouped_matmul_forward(out[t].data(), lhs.data(), rhs.data(), l.sizes.data(), G, M, K, N, trans_rhs);
        ops::grouped_matmul_backward(dlhs[t].data(), drhs[t].data(), dout.data(), lhs.data(), rhs.data(),
                                     l.sizes.data(), G, M, K, N, trans_rhs);
      }
      for (int t = 1; t < 3; ++t) {
        EXPECT_EQ(0, std::memcmp(out[0].data(), out[t].data(), out[0].size() * sizeof(float))) << t + 1 << " threads";
        EXPECT_EQ(0, std::memcmp(dlhs[0].data(), dlhs[t].data(), dlhs[0].size() * sizeof(float))) << t + 1;
        EXPECT_EQ(0, std::memcmp(drhs[0].data(), drhs[t].data(), drhs[0].size() * sizeof(float))) << t + 1;
      }
    }
  }
  // A lone one-row group is a single matrix-vector product, the shape whose
  // reduction the BLAS would otherwise split between threads.
  const std::vector<int32_t> one = {1};
  const int64_t K1 = 200000, N1 = 3;
  const auto lhs = randn(K1, 13), rhs = randn(K1 * N1, 14);
  std::vector<float> out[3];
  for (int t = 0; t < 3; ++t) {
    omp_set_num_threads(t + 1);
    out[t].assign(N1, 0.0f);
    ops::grouped_matmul_forward(out[t].data(), lhs.data(), rhs.data(), one.data(), 1, 1, K1, N1);
  }
  for (int t = 1; t < 3; ++t) EXPECT_EQ(0, std::memcmp(out[0].data(), out[t].data(), N1 * sizeof(float))) << t + 1;
}

}  // namespace grouped_matmul_test
}  // namespace
}  // namespace ds
