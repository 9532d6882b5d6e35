// Cross-entropy: the double reference's gradients (logits, h, W) against finite
// differences; the plain and the fused LM-head kernels against the reference
// and each other over chunkings that cut every boundary (N not a multiple of
// the token block, V not a multiple of the vocabulary chunk, N = 1, tiny
// chunks); ignored targets; logits ~100; the `+=` rule on dW; optional
// gradients; bitwise thread-count independence; bad inputs.
#include "ops/cross_entropy.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "ops/matmul.h"
#include "ops/reference/cross_entropy.h"
#include "test_util.h"

namespace ds {
namespace {
namespace cross_entropy_test {

using ds::test::ThreadCountGuard;

using test::expect_close;
using test::randn;
using test::to_double;

// Targets in [0, V), with every `ignore_every`-th one (if > 0) set to -1.
std::vector<int32_t> random_targets(int64_t N, int64_t V, uint64_t seed, int64_t ignore_every = 0) {
  std::vector<int32_t> t(N);
  Philox rng(seed);
  for (int64_t i = 0; i < N; ++i) t[i] = static_cast<int32_t>(rng.u32(i) % V);
  if (ignore_every > 0)
    for (int64_t i = 1; i < N; i += ignore_every) t[i] = -1;
  return t;
}

// Outputs of the fused float32 forward and backward.
struct Fused {
  std::vector<float> loss, lse, dh, dw;
};

Fused run_fused(const std::vector<float>& h, const std::vector<float>& w, const std::vector<int32_t>& targets,
                const std::vector<float>& dloss, const std::vector<float>& dw0, int64_t N, int64_t D, int64_t V,
                ops::CrossEntropyChunks chunks) {
  Fused f{std::vector<float>(N), std::vector<float>(N), std::vector<float>(N * D), dw0};
  ops::lm_head_cross_entropy_forward(f.loss.data(), f.lse.data(), h.data(), w.data(), targets.data(), N, D, V, chunks);
  ops::lm_head_cross_entropy_backward(f.dh.data(), f.dw.data(), dloss.data(), h.data(), w.data(), targets.data(),
                                      f.lse.data(), N, D, V, chunks);
  return f;
}

// The double reference of the same problem; dw starts from dw0.
struct Reference {
  std::vector<double> loss, lse, dh, dw, logits;
};

Reference run_reference(const std::vector<float>& h, const std::vector<float>& w, const std::vector<int32_t>& targets,
                        const std::vector<float>& dloss, const std::vector<float>& dw0, int64_t N, int64_t D,
                        int64_t V) {
  Reference r;
  const auto hd = to_double(h), wd = to_double(w);
  r.loss = ref::lm_head_cross_entropy(hd, wd, targets, N, D, V, &r.lse);
  r.dw = to_double(dw0);
  ref::lm_head_cross_entropy_backward(r.dh, r.dw, to_double(dloss), hd, wd, targets, N, D, V);
  r.logits = ref::matmul(hd, wd, N, V, D, false, true);
  return r;
}

// Largest |logit|: the float errors of logits, lse and loss scale with it.
double logit_scale(const Reference& r) { return std::max(1.0, test::max_abs(r.logits)); }

TEST(CrossEntropy, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t N = 4, D = 3, V = 5;
  const auto h = to_double(randn(N * D, 1)), w = to_double(randn(V * D, 2)), g = to_double(randn(N, 3));
  const std::vector<int32_t> targets = {2, -1, 0, 4};  // one ignored token
  // L = sum_t g[t] loss[t], so dloss = g.
  const auto fh = [&](const std::vector<double>& v) {
    return test::weighted_sum(ref::lm_head_cross_entropy(v, w, targets, N, D, V), g);
  };
  const auto fw = [&](const std::vector<double>& v) {
    return test::weighted_sum(ref::lm_head_cross_entropy(h, v, targets, N, D, V), g);
  };
  std::vector<double> dh, dw;
  ref::lm_head_cross_entropy_backward(dh, dw, g, h, w, targets, N, D, V);
  // h = 1e-6: truncation ~h^2 |f'''| ~ 1e-12, rounding ~1e-16 |f| / h ~ 1e-10;
  // 1e-7 is far below a wrong term (order 0.1).
  expect_close(dh, test::numeric_grad(fh, h), 0, 1e-7, "dh");
  expect_close(dw, test::numeric_grad(fw, w), 0, 1e-7, "dw");
  // The plain loss's gradient to the logits, the piece both of the above use.
  const auto logits = ref::matmul(h, w, N, V, D, false, true);
  const auto fl = [&](const std::vector<double>& v) {
    return test::weighted_sum(ref::cross_entropy(v, targets, N, V), g);
  };
  expect_close(ref::cross_entropy_backward(g, logits, targets, N, V), test::numeric_grad(fl, logits), 0, 1e-7,
               "dlogits");
  // The ignored token has neither loss nor gradient.
  EXPECT_EQ(ref::cross_entropy(logits, targets, N, V)[1], 0.0);
  for (int64_t j = 0; j < D; ++j) EXPECT_EQ(dh[1 * D + j], 0.0);
}

// Plain float kernels on float logits against the double reference.
TEST(CrossEntropy, PlainMatchesReference) {
  for (int64_t V : {1, 7, 37, 300}) {
    const int64_t N = 9;
    const auto logits = randn(N * V, V, 3.0f), dloss = randn(N, V + 1);
    const auto targets = random_targets(N, V, V + 2, 4);
    std::vector<float> loss(N), lse(N), dl(N * V);
    ops::cross_entropy_forward(loss.data(), lse.data(), logits.data(), targets.data(), N, V);
    ops::cross_entropy_backward(dl.data(), dloss.data(), logits.data(), targets.data(), lse.data(), N, V);
    std::vector<double> rlse;
    const auto rloss = ref::cross_entropy(to_double(logits), targets, N, V, &rlse);
    const double scale = std::max(1.0, test::max_abs(to_double(logits)));
    // The inputs are exact, so only the sum of exps (float lanes, ~sqrt(V)
    // ulp) and the exp polynomial (~1 ulp) differ from double: a few ulp of
    // the logits' magnitude for lse and loss; softmax entries are in [0, 1] and
    // carry the relative error of exp(l - lse), ~ulp(scale).
    expect_close(lse, rlse, 0, 1e-6 * scale, "lse");
    expect_close(loss, rloss, 0, 1e-6 * scale, "loss");
    expect_close(dl, ref::cross_entropy_backward(to_double(dloss), to_double(logits), targets, N, V), 0,
                 1e-6 * scale * test::max_abs(to_double(dloss)), "dlogits");
  }
}

// (N, D, V, token_block, vocab_chunk).
using Shape = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;
class FusedShapes : public ::testing::TestWithParam<Shape> {};

// Fused float32 against the double reference and against the plain float path
// (matmul + cross_entropy); dW starts non-zero to check the `+=` rule.
TEST_P(FusedShapes, MatchesReferenceAndPlain) {
  const auto [N, D, V, tb, vc] = GetParam();
  const auto h = randn(N * D, 10), w = randn(V * D, 11, 0.5f), dloss = randn(N, 12), dw0 = randn(V * D, 13);
  const auto targets = random_targets(N, V, 14, 3);
  const Fused f = run_fused(h, w, targets, dloss, dw0, N, D, V, {tb, vc});
  const Reference r = run_reference(h, w, targets, dloss, dw0, N, D, V);
  const double s = logit_scale(r);
  // Float logits carry the gemm's rounding (D terms, a few ulp of |h| |w|),
  // lse and loss that plus the exp sums' few ulp: 2e-6 of the largest logit
  // is ~20 ulp. The gradients are sums of V softmax-weighted rows of W (or
  // N rows of h) whose weights carry the same ~1e-6 s relative error, so they
  // are checked at 2e-6 s relative to their own largest value. A lost chunk or
  // block boundary error would be off by order 1e-1.
  expect_close(f.lse, r.lse, 0, 2e-6 * s, "lse");
  expect_close(f.loss, r.loss, 0, 2e-6 * s, "loss");
  expect_close(f.dh, r.dh, 2e-6 * s, 1e-7, "dh");
  std::vector<double> dw_delta(V * D), want_delta(V * D);
  for (int64_t i = 0; i < V * D; ++i) {
    dw_delta[i] = static_cast<double>(f.dw[i]) - dw0[i];
    want_delta[i] = r.dw[i] - dw0[i];
  }
  // dW itself adds the gradient to dw0 ~ 1 in float (one more rounding of
  // ulp(|dw0|)), so the accumulated value is checked at that level and the
  // gradient part at the relative level above.
  expect_close(f.dw, r.dw, 1e-6, 0, "dw");
  expect_close(dw_delta, want_delta, 2e-6 * s, 4e-7 * test::max_abs(to_double(dw0)), "dw - dw0");

  // The plain path on float logits from the engine's matmul.
  std::vector<float> logits(N * V), loss(N), lse(N), dl(N * V), dh(N * D), dw = dw0;
  ops::matmul_forward(logits.data(), h.data(), w.data(), N, V, D, false, true);
  ops::cross_entropy_forward(loss.data(), lse.data(), logits.data(), targets.data(), N, V);
  ops::cross_entropy_backward(dl.data(), dloss.data(), logits.data(), targets.data(), lse.data(), N, V);
  ops::matmul_backward(dh.data(), dw.data(), dl.data(), h.data(), w.data(), N, V, D, false, true);
  // Two float computations of the same values, each within the bounds above
  // of the reference.
  expect_close(f.loss, loss, 0, 4e-6 * s, "fused vs plain loss");
  expect_close(f.dh, dh, 4e-6 * s, 2e-7, "fused vs plain dh");
  expect_close(f.dw, dw, 2e-6, 0, "fused vs plain dw");
}

INSTANTIATE_TEST_SUITE_P(Chunks, FusedShapes,
                         ::testing::Values(Shape{1, 8, 13, 3, 5},   // N = 1; V = 2 chunks + 3
                                           Shape{10, 8, 23, 3, 5},  // 4 blocks (last 1 row), 5 chunks (last 3 columns)
                                           Shape{17, 16, 100, 4, 7},       // 5 blocks, 15 chunks (last 2)
                                           Shape{9, 12, 40, 3, 5},         // both exact multiples
                                           Shape{37, 24, 513, 8, 64},      // 9 chunks, the last one column wide
                                           Shape{64, 32, 300, 256, 2048},  // the defaults: one block, 128-wide chunks
                                           Shape{300, 16, 1000, 256, 2048},  // defaults: 2 blocks, 8 chunks (last 104)
                                           Shape{6, 5, 11, 1, 1}));        // one-by-one tiles

// Every target ignored: zero loss, zero dh, dW untouched; lse is still the
// log-partition function.
TEST(CrossEntropy, AllTargetsIgnored) {
  const int64_t N = 7, D = 6, V = 19;
  const auto h = randn(N * D, 20), w = randn(V * D, 21), dloss = randn(N, 22), dw0 = randn(V * D, 23);
  const std::vector<int32_t> targets(N, -1);
  const Fused f = run_fused(h, w, targets, dloss, dw0, N, D, V, {3, 5});
  EXPECT_EQ(f.loss, std::vector<float>(N, 0.0f));
  EXPECT_EQ(f.dh, std::vector<float>(N * D, 0.0f));
  EXPECT_EQ(f.dw, dw0);
  const Reference r = run_reference(h, w, targets, dloss, dw0, N, D, V);
  expect_close(f.lse, r.lse, 0, 2e-6 * logit_scale(r), "lse");  // as in MatchesReferenceAndPlain

  std::vector<float> logits(N * V), loss(N), lse(N), dl(N * V, 1.0f);
  ops::matmul_forward(logits.data(), h.data(), w.data(), N, V, D, false, true);
  ops::cross_entropy_forward(loss.data(), lse.data(), logits.data(), targets.data(), N, V);
  ops::cross_entropy_backward(dl.data(), dloss.data(), logits.data(), targets.data(), lse.data(), N, V);
  EXPECT_EQ(loss, std::vector<float>(N, 0.0f));
  EXPECT_EQ(dl, std::vector<float>(N * V, 0.0f));
}

// h scaled so that logits reach a few hundred: exp would overflow without the
// max shift, and the results must stay finite and close to the reference.
TEST(CrossEntropy, LargeLogitsStayFinite) {
  const int64_t N = 12, D = 16, V = 50;
  const auto h = randn(N * D, 30, 25.0f), w = randn(V * D, 31), dloss = randn(N, 32);
  const std::vector<float> dw0(V * D, 0.0f);
  const auto targets = random_targets(N, V, 33);
  const Fused f = run_fused(h, w, targets, dloss, dw0, N, D, V, {5, 7});
  const Reference r = run_reference(h, w, targets, dloss, dw0, N, D, V);
  const double s = logit_scale(r);
  ASSERT_GT(s, 100.0);
  for (float v : f.loss) ASSERT_TRUE(std::isfinite(v));
  for (float v : f.dh) ASSERT_TRUE(std::isfinite(v));
  for (float v : f.dw) ASSERT_TRUE(std::isfinite(v));
  // Same error model as MatchesReferenceAndPlain, scaled by s > 100.
  expect_close(f.loss, r.loss, 0, 2e-6 * s, "loss");
  expect_close(f.dh, r.dh, 2e-6 * s, 0, "dh");
  expect_close(f.dw, r.dw, 2e-6 * s, 0, "dw");
}

// A NaN in one token's hidden state must surface in that token's loss (and
// only there), not vanish inside a max or a flushed exp.
TEST(CrossEntropy, NanPropagatesToItsToken) {
  const int64_t N = 4, D = 8, V = 37;
  auto h = randn(N * D, 35);
  const auto w = randn(V * D, 36);
  h[2 * D + 5] = std::numeric_limits<float>::quiet_NaN();
  const auto targets = random_targets(N, V, 37);
  std::vector<float> loss(N), lse(N);
  ops::lm_head_cross_entropy_forward(loss.data(), lse.data(), h.data(), w.data(), targets.data(), N, D, V, {3, 5});
  for (int64_t t = 0; t < N; ++t) EXPECT_EQ(std::isnan(loss[t]), t == 2) << t;
}

// Skipping one gradient must leave the other bit for bit as it was.
TEST(CrossEntropy, OptionalGradients) {
  const int64_t N = 11, D = 8, V = 29;
  const auto h = randn(N * D, 40), w = randn(V * D, 41), dloss = randn(N, 42), dw0 = randn(V * D, 43);
  const auto targets = random_targets(N, V, 44, 5);
  const ops::CrossEntropyChunks chunks{4, 6};
  const Fused f = run_fused(h, w, targets, dloss, dw0, N, D, V, chunks);
  std::vector<float> dh(N * D), dw = dw0;
  ops::lm_head_cross_entropy_backward(dh.data(), nullptr, dloss.data(), h.data(), w.data(), targets.data(),
                                      f.lse.data(), N, D, V, chunks);
  ops::lm_head_cross_entropy_backward(nullptr, dw.data(), dloss.data(), h.data(), w.data(), targets.data(),
                                      f.lse.data(), N, D, V, chunks);
  EXPECT_EQ(dh, f.dh);
  EXPECT_EQ(dw, f.dw);
}

// Fixed chunk combination order (forward), chunk-owned dW and chunk-ordered dh
// (backward): 1, 2 and 3 threads give the same bits. 11 chunks and 7 blocks,
// neither a multiple of 2 or 3.
TEST(CrossEntropy, BitwiseIndependentOfThreadCount) {
  ThreadCountGuard guard;
  const int64_t N = 50, D = 16, V = 103;
  const auto h = randn(N * D, 50), w = randn(V * D, 51), dloss = randn(N, 52), dw0 = randn(V * D, 53);
  const auto targets = random_targets(N, V, 54, 6);
  const ops::CrossEntropyChunks chunks{8, 10};
  omp_set_num_threads(1);
  const Fused want = run_fused(h, w, targets, dloss, dw0, N, D, V, chunks);
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    const Fused got = run_fused(h, w, targets, dloss, dw0, N, D, V, chunks);
    EXPECT_EQ(got.loss, want.loss) << threads << " threads";
    EXPECT_EQ(got.lse, want.lse) << threads << " threads";
    EXPECT_EQ(got.dh, want.dh) << threads << " threads";
    EXPECT_EQ(got.dw, want.dw) << threads << " threads";
  }
}

// With the default chunks a vocabulary that fits one chunk is still cut
// into chunks the threads share (by V alone): the bits stay the same for
// any thread count.
TEST(CrossEntropy, SmallVocabularyBitwiseIndependentOfThreadCount) {
  ThreadCountGuard guard;
  const int64_t N = 300, D = 24, V = 1000;
  const auto h = randn(N * D, 60), w = randn(V * D, 61), dloss = randn(N, 62), dw0 = randn(V * D, 63);
  const auto targets = random_targets(N, V, 64, 6);
  omp_set_num_threads(1);
  const Fused want = run_fused(h, w, targets, dloss, dw0, N, D, V, {});
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    const Fused got = run_fused(h, w, targets, dloss, dw0, N, D, V, {});
    EXPECT_EQ(got.loss, want.loss) << threads << " threads";
    EXPECT_EQ(got.lse, want.lse) << threads << " threads";
    EXPECT_EQ(got.dh, want.dh) << threads << " threads";
    EXPECT_EQ(got.dw, want.dw) << threads << " threads";
  }
}

TEST(CrossEntropy, ZeroTokensIsANoOp) {
  const int64_t D = 4, V = 9;
  const auto w = randn(V * D, 60);
  std::vector<float> dw(V * D, 2.0f);
  ops::lm_head_cross_entropy_forward(nullptr, nullptr, nullptr, w.data(), nullptr, 0, D, V);
  ops::lm_head_cross_entropy_backward(nullptr, dw.data(), nullptr, nullptr, w.data(), nullptr, nullptr, 0, D, V);
  EXPECT_EQ(dw, std::vector<float>(V * D, 2.0f));
}

TEST(CrossEntropy, BadInputsThrow) {
  const int64_t N = 3, D = 4, V = 9;
  const auto h = randn(N * D, 70), w = randn(V * D, 71), logits = randn(N * V, 72);
  std::vector<float> loss(N), lse(N), dh(N * D), dw(V * D), dl(N * V), dloss(N, 1.0f);
  const std::vector<int32_t> bad = {0, 9, 1}, ok = {0, 8, -5};
  EXPECT_THROW(ops::lm_head_cross_entropy_forward(loss.data(), lse.data(), h.data(), w.data(), bad.data(), N, D, V),
               Error);
  EXPECT_THROW(ops::lm_head_cross_entropy_backward(dh.data(), dw.data(), dloss.data(), h.data(), w.data(), bad.data(),
                                                   lse.data(), N, D, V),
               Error);
  EXPECT_THROW(ops::cross_entropy_forward(loss.data(), lse.data(), logits.data(), bad.data(), N, V), Error);
  EXPECT_THROW(ops::cross_entropy_backward(dl.data(), dloss.data(), logits.data(), bad.data(), lse.data(), N, V),
               Error);
  EXPECT_THROW(
      ops::lm_head_cross_entropy_forward(loss.data(), lse.data(), h.data(), w.data(), ok.data(), N, D, V, {0, 4}),
      Error);
  EXPECT_THROW(
      ops::lm_head_cross_entropy_forward(loss.data(), lse.data(), h.data(), w.data(), ok.data(), N, D, V, {4, 0}),
      Error);
  EXPECT_THROW(ops::lm_head_cross_entropy_forward(loss.data(), lse.data(), h.data(), w.data(), ok.data(), N, 0, V),
               Error);
  // Any negative target is "ignore", not an error.
  EXPECT_NO_THROW(
      ops::lm_head_cross_entropy_forward(loss.data(), lse.data(), h.data(), w.data(), ok.data(), N, D, V, {2, 4}));
  EXPECT_EQ(loss[2], 0.0f);
}

}  // namespace cross_entropy_test
}  // namespace
}  // namespace ds
