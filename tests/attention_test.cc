// Causal attention with segment ids: the double reference's backward against
// finite differences, the reference's segment semantics, then the tiled
// float32 kernels (forward out and lse, backward dq, dk, dv) against the
// reference on edge layouts (one token, one segment, many short segments,
// ragged tiles, several tiles, MLA head sizes, per-row layouts, unsorted ids),
// the vectorized exp against std::exp, bad sizes, and bitwise reproducibility
// over thread counts.
#include "ops/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/reference/attention.h"
#include "test_util.h"

namespace ds::ops::detail {
// The kernel's vectorized exp (ops/cpu/attention.cc): x[j] = exp(x[j] - shift),
// returns the sum.
float attention_exp_row(float* x, int64_t n, float shift);
int64_t set_attention_pack_budget(int64_t bytes);
}  // namespace ds::ops::detail

namespace ds {
namespace {
namespace attention_test {

using ds::test::ThreadCountGuard;

using ops::AttentionDims;
using test::expect_close;
using test::randn;
using test::to_double;

// Segment ids [T] of consecutive segments with the given lengths.
std::vector<int32_t> from_lengths(const std::vector<int>& lengths) {
  std::vector<int32_t> ids;
  for (size_t s = 0; s < lengths.size(); ++s) ids.insert(ids.end(), lengths[s], static_cast<int32_t>(s));
  return ids;
}

struct Problem {
  AttentionDims d;
  std::vector<int32_t> seg;  // [B, T] or empty
  std::vector<uint8_t> sel;  // [B, T, T] or empty
  std::vector<float> q, k, v, dout;

  Problem(AttentionDims dims, std::vector<int32_t> ids, uint64_t seed, float qk_std = 1.0f) : d(dims), seg(ids) {
    const int64_t rows = d.batch * d.seq * d.heads;
    q = randn(rows * d.qk_dim, seed, qk_std);
    k = randn(rows * d.qk_dim, seed + 1, qk_std);
    v = randn(rows * d.v_dim, seed + 2);
    dout = randn(rows * d.v_dim, seed + 3);
    if (!seg.empty()) {
      EXPECT_EQ(static_cast<int64_t>(seg.size()), d.batch * d.seq);
    }
  }
  const int32_t* ids() const { return seg.empty() ? nullptr : seg.data(); }
  const uint8_t* selected() const { return sel.empty() ? nullptr : sel.data(); }
};

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// The fast kernels; outputs start as NaN so that any element left unwritten
// shows up.
Result run_fast(const Problem& p) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t rows = p.d.batch * p.d.seq * p.d.heads;
  Result r{std::vector<float>(rows * p.d.v_dim, nan), std::vector<float>(rows, nan),
           std::vector<float>(rows * p.d.qk_dim, nan), std::vector<float>(rows * p.d.qk_dim, nan),
           std::vector<float>(rows * p.d.v_dim, nan)};
  ops::attention_forward(r.out.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(), p.ids(), p.d, p.selected());
  ops::attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), r.out.data(), r.lse.data(), p.q.data(),
                          p.k.data(), p.v.data(), p.ids(), p.d, p.selected());
  return r;
}

// Tolerances of float32 against the double reference, relative to the largest
// magnitude of each tensor. Scores carry float32 rounding of dot products of
// length Dqk (~1e-7 relative), and the exp about 2 ulp; out is a convex
// combination of v rows, and the cases below show out and lse errors of
// 1e-7 to 4e-7 of their scale, so 5e-6 leaves a >10x margin while a wrong
// mask or a lost rescale (errors of order 1) cannot pass. The gradients
// subtract D = dout . out from dP, terms of the same size whose difference
// can be small, and add longer sums: errors up to 6e-7 seen, 1e-5 allowed.
constexpr double kOutTol = 5e-6;
constexpr double kGradTol = 1e-5;

void expect_matches_reference(const Problem& p, double out_tol = kOutTol, double grad_tol = kGradTol,
                              double grad_atol = 0) {
  const Result r = run_fast(p);
  std::vector<double> out, lse, dq, dk, dv;
  ref::attention_forward(out, lse, to_double(p.q), to_double(p.k), to_double(p.v), p.seg, p.d, p.sel);
  ref::attention_backward(dq, dk, dv, to_double(p.dout), to_double(p.q), to_double(p.k), to_double(p.v), p.seg, p.d,
                          p.sel);
  expect_close(r.out, out, out_tol, 0, "out");
  // lse is a log-sum of scores of size ~|s|: absolute float32 rounding of
  // those, hence the same tolerance relative to max|lse|.
  expect_close(r.lse, lse, out_tol, 0, "lse");
  expect_close(r.dq, dq, grad_tol, grad_atol, "dq");
  expect_close(r.dk, dk, grad_tol, grad_atol, "dk");
  expect_close(r.dv, dv, grad_tol, grad_atol, "dv");
  for (float x : r.lse) ASSERT_TRUE(std::isfinite(x));
}

float default_scale(int64_t qk_dim) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(qk_dim))); }

// ---------------------------------------------------------------- reference

// Reference backward vs central finite differences of the reference forward,
// in double, for L = sum(w * out) with random w, on tiny packed sequences
// (sorted ids in one row, unsorted ids in the other).
TEST(AttentionReference, BackwardMatchesFiniteDifferences) {
  struct Case {
    int64_t T;
    std::vector<int32_t> seg;
  };
  const Case cases[] = {
      {5, {}},
      {6, {0, 0, 1, 1, 1, 2, /**/ 4, 4, 4, 4, 4, 4}},
      {7, {0, 0, 1, 1, 1, 1, 2, /**/ 3, 8, 3, 3, 8, 8, 3}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "T=" << c.T);
    const AttentionDims d{2, c.T, 2, 3, 2, 0.7f};
    const Problem p(d, c.seg, 100 + c.T, 1.5f);
    const auto q = to_double(p.q), k = to_double(p.k), v = to_double(p.v), w = to_double(p.dout);
    std::vector<double> dq, dk, dv;
    ref::attention_backward(dq, dk, dv, w, q, k, v, p.seg, d);  // dL/dout = w
    auto loss = [&](const std::vector<double>& qq, const std::vector<double>& kk, const std::vector<double>& vv) {
      std::vector<double> out, lse;
      ref::attention_forward(out, lse, qq, kk, vv, p.seg, d);
      return test::weighted_sum(out, w);
    };
    // Central differences with h = 1e-6 are off by ~h^2 |L'''| ~ 1e-12 plus
    // rounding ~1e-16 |L| / h ~ 1e-10; the gradients are of order 1.
    const double tol = 1e-8;
    expect_close(dq, test::numeric_grad([&](const std::vector<double>& x) { return loss(x, k, v); }, q), 0, tol, "dq");
    expect_close(dk, test::numeric_grad([&](const std::vector<double>& x) { return loss(q, x, v); }, k), 0, tol, "dk");
    expect_close(dv, test::numeric_grad([&](const std::vector<double>& x) { return loss(q, k, x); }, v), 0, tol, "dv");
  }
}

// With an attention sink: the reference's backward (dsink too) against
// central differences, and a sink of -inf changing nothing.
TEST(AttentionReference, SinkBackwardMatchesFiniteDifferences) {
  const AttentionDims d{2, 6, 3, 4, 3, 0.6f};
  const Problem p(d, {0, 0, 1, 1, 1, 2, /**/ 4, 4, 4, 4, 4, 4}, 77, 1.5f);
  const std::vector<double> sink = {0.3, -1.2, 2.5};
  const auto q = to_double(p.q), k = to_double(p.k), v = to_double(p.v), w = to_double(p.dout);
  std::vector<double> dq, dk, dv, dsink;
  ref::attention_backward(dq, dk, dv, w, q, k, v, p.seg, d, {}, sink, &dsink);
  auto loss = [&](const std::vector<double>& qq, const std::vector<double>& kk, const std::vector<double>& vv,
                  const std::vector<double>& ss) {
    std::vector<double> out, lse;
    ref::attention_forward(out, lse, qq, kk, vv, p.seg, d, {}, ss);
    return test::weighted_sum(out, w);
  };
  const double tol = 1e-8;
  expect_close(dq, test::numeric_grad([&](const std::vector<double>& x) { return loss(x, k, v, sink); }, q), 0, tol,
               "dq");
  expect_close(dk, test::numeric_grad([&](const std::vector<double>& x) { return loss(q, x, v, sink); }, k), 0, tol,
               "dk");
  expect_close(dv, test::numeric_grad([&](const std::vector<double>& x) { return loss(q, k, x, sink); }, v), 0, tol,
               "dv");
  expect_close(dsink, test::numeric_grad([&](const std::vector<double>& x) { return loss(q, k, v, x); }, sink), 0, tol,
               "dsink");
  std::vector<double> o1, l1, o2, l2;
  const double inf = std::numeric_limits<double>::infinity();
  ref::attention_forward(o1, l1, q, k, v, p.seg, d);
  ref::attention_forward(o2, l2, q, k, v, p.seg, d, {}, {-inf, -inf, -inf});
  EXPECT_EQ(o1, o2);
}

// A packed row of segments gives, for each segment, what that segment alone
// gives as its own sequence (the reference checks itself against its own
// unpacked runs, so the segment rule is not just the same code twice).
TEST(AttentionReference, PackedSegmentsEqualSeparateSequences) {
  const std::vector<int> lengths = {3, 1, 4, 2};
  const int64_t T = 10, H = 2, Dk = 3, Dv = 2;
  const Problem p({1, T, H, Dk, Dv, 0.5f}, from_lengths(lengths), 7);
  std::vector<double> out, lse;
  ref::attention_forward(out, lse, to_double(p.q), to_double(p.k), to_double(p.v), p.seg, p.d);
  int64_t t0 = 0;
  for (int len : lengths) {
    auto slice = [&](const std::vector<float>& x, int64_t D) {
      return to_double(std::vector<float>(x.begin() + t0 * H * D, x.begin() + (t0 + len) * H * D));
    };
    std::vector<double> o1, l1;
    ref::attention_forward(o1, l1, slice(p.q, Dk), slice(p.k, Dk), slice(p.v, Dv), {}, {1, len, H, Dk, Dv, 0.5f});
    for (int64_t i = 0; i < len * H * Dv; ++i) EXPECT_NEAR(out[t0 * H * Dv + i], o1[i], 1e-12);  // same sums in double
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < len; ++i) EXPECT_NEAR(lse[h * T + t0 + i], l1[h * len + i], 1e-12);
    t0 += len;
  }
}

// ---------------------------------------------------------------- fast vs reference

// Queries continuing a sequence (inference with a cache): the last n rows of
// the double reference's causal attention over the whole sequence, for
// continuations that start on, before and after tile edges, and every
// thread count giving the same bits.
TEST(Attention, ContinuingQueriesMatchTheWholeSequence) {
  for (const auto& [past, n] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {0, 130}, {1, 1}, {5, 3}, {127, 1}, {128, 128}, {200, 129}, {300, 260}, {1000, 64}}) {
    const int64_t T = past + n, H = 3, Dqk = 24, Dv = 8;
    const AttentionDims whole{1, T, H, Dqk, Dv, default_scale(Dqk)};
    const Problem p(whole, {}, 500 + past + n);
    std::vector<double> want, lse;
    ref::attention_forward(want, lse, to_double(p.q), to_double(p.k), to_double(p.v), {}, whole);
    want.erase(want.begin(), want.begin() + past * H * Dv);
    const AttentionDims d{1, n, H, Dqk, Dv, whole.scale};
    const float* q = p.q.data() + past * H * Dqk;
    auto run = [&] {
      std::vector<float> out(n * H * Dv, std::numeric_limits<float>::quiet_NaN());
      ops::attention_forward_past(out.data(), q, p.k.data(), p.v.data(), past, d);
      return out;
    };
    const std::string what = "past " + std::to_string(past) + " n " + std::to_string(n);
    expect_close(run(), want, kOutTol, 0, what.c_str());
    test::expect_same_for_any_thread_count(run);
    if (past == 0) {  // the same tiles and fold as the training forward: its bits
      std::vector<float> out(n * H * Dv), lse(n * H);
      ops::attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), nullptr, d);
      EXPECT_EQ(run(), out) << what;
    }
  }
  // One sequence only; bad sizes are errors.
  std::vector<float> x(64, 0.0f);
  EXPECT_THROW(ops::attention_forward_past(x.data(), x.data(), x.data(), x.data(), 0, AttentionDims{2, 1, 1, 4, 4, 1}),
               Error);
  EXPECT_THROW(ops::attention_forward_past(x.data(), x.data(), x.data(), x.data(), -1, AttentionDims{1, 1, 1, 4, 4, 1}),
               Error);
}

TEST(Attention, OneToken) {
  // A single query attends only to itself: out = v exactly (p = exp(0) = 1,
  // l = 1) and lse = its own score.
  const Problem p({2, 1, 3, 5, 4, 0.3f}, {}, 20);
  const Result r = run_fast(p);
  EXPECT_EQ(r.out, p.v);
  // dq and dk are exactly 0 (dS = p (dP - D) with dP = D = dout . v); float32
  // leaves the rounding of two length-4 dot products of size ~2, ~1e-7,
  // times scale and |k|: 1e-6 absolute.
  expect_matches_reference(p, kOutTol, kGradTol, 1e-6);
}

TEST(Attention, OneSegment) {
  expect_matches_reference(Problem({1, 37, 2, 16, 8, default_scale(16)}, {}, 21));
  // Segment ids that are all equal take the path without a segment mask and
  // must agree with no ids at all.
  expect_matches_reference(Problem({1, 37, 2, 16, 8, default_scale(16)}, std::vector<int32_t>(37, 5), 21));
}

TEST(Attention, ManyShortSegments) {
  // Lengths 1, 2, ..., 24: 300 tokens, segments both inside tiles and across
  // tile edges, and early key tiles that later query tiles skip.
  std::vector<int> lengths;
  for (int n = 1; n <= 24; ++n) lengths.push_back(n);
  expect_matches_reference(Problem({1, 300, 2, 12, 10, default_scale(12)}, from_lengths(lengths), 22));
}

TEST(Attention, RaggedLastTile) {
  // Sequence lengths that no tile size (a power of two >= 16) divides.
  for (int64_t T : {17, 63, 65, 129, 255, 257}) {
    SCOPED_TRACE(testing::Message() << "T=" << T);
    expect_matches_reference(Problem({1, T, 1, 8, 8, default_scale(8)}, {}, 23 + T));
  }
}

TEST(Attention, SeveralTiles) {
  // T = 200 and 400 span several query and key tiles; segments of 70 and 130
  // (or 330) tokens start and end inside tiles, and with 400 tokens whole key
  // tiles of the first segment lie before query tiles of the second.
  expect_matches_reference(Problem({1, 200, 2, 16, 16, default_scale(16)}, {}, 24));
  expect_matches_reference(Problem({1, 200, 2, 16, 16, default_scale(16)}, from_lengths({70, 130}), 25));
  expect_matches_reference(Problem({1, 400, 2, 16, 16, default_scale(16)}, from_lengths({70, 330}), 25));
}

TEST(Attention, UnsortedIdsSkipNothingTheyNeed) {
  // The first half is id 0 except for one id 1 in the middle of every 16
  // tokens, so any tile of a multiple of 16 tokens there starts and ends
  // with 0 yet holds 1s; the second half is all 1. A skip that looked only at
  // a tile's first and last id would drop keys the second half must see.
  const int64_t T = 256;
  std::vector<int32_t> seg(T);
  for (int64_t t = 0; t < T; ++t) seg[t] = t >= T / 2 || t % 16 == 8 ? 1 : 0;
  expect_matches_reference(Problem({1, T, 2, 8, 8, default_scale(8)}, seg, 29));
}

TEST(Attention, LargeScoresExerciseTheRunningMax) {
  // Scores with a standard deviation of ~9: the row max moves by many units
  // between key tiles, so a missing or wrong rescale of O and l would be far
  // off. Larger scores carry proportionally larger float32 rounding (3e-6 of
  // the scale seen in dq), hence the tolerances 5x the default.
  expect_matches_reference(Problem({1, 200, 2, 16, 16, default_scale(16)}, from_lengths({150, 50}), 26, 3.0f),
                           5 * kOutTol, 5 * kGradTol);
}

// DSA's top-k attention in training: a selection of keys per query on top
// of the causal and segment masks, over several tiles, some queries losing
// their own key, some tiles fully masked for a query.
TEST(Attention, SelectedKeysOnly) {
  for (int64_t topk : {1, 5, 40}) {
    SCOPED_TRACE(topk);
    const int64_t B = 2, T = 150;
    Problem p({B, T, 2, 16, 8, default_scale(16)}, from_lengths({90, 60, 150}), 40 + topk);
    p.sel.assign(B * T * T, 0);
    // Query i keeps the topk visible keys of a fixed pseudo-random order.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<int64_t> vis;
        for (int64_t j = 0; j <= i; ++j)
          if (p.seg[b * T + j] == p.seg[b * T + i]) vis.push_back(j);
        std::sort(vis.begin(), vis.end(),
                  [&](int64_t x, int64_t y) { return (x * 7919 + i) % 101 < (y * 7919 + i) % 101; });
        for (size_t n = 0; n < vis.size() && static_cast<int64_t>(n) < topk; ++n) p.sel[(b * T + i) * T + vis[n]] = 1;
      }
    // With one key per query p is 1 and dq, dk are 0 exactly; the kernel's
    // dp - D leaves rounding of ~1e-7 there.
    expect_matches_reference(p, kOutTol, kGradTol, topk == 1 ? 1e-5 : 0);
  }
  // A query with no key left is an error, not NaN.
  Problem bad({1, 4, 1, 4, 4, 0.5f}, {}, 3);
  bad.sel.assign(16, 1);
  for (int j = 0; j < 4; ++j) bad.sel[2 * 4 + j] = 0;
  std::vector<float> out(16), lse(4);
  EXPECT_THROW(ops::attention_forward(out.data(), lse.data(), bad.q.data(), bad.k.data(), bad.v.data(), nullptr, bad.d,
                                      bad.selected()),
               Error);
}

TEST(Attention, SinkMatchesReference) {
  // DeepSeek-V4's sink: sinks below, near and far above the scores (the last
  // takes most of each row's mass), over several tiles and segments.
  const AttentionDims d{2, 150, 3, 16, 8, default_scale(16)};
  Problem p(d, from_lengths({90, 60, 150}), 91);
  const std::vector<float> sink = {-3.0f, 0.5f, 12.0f};
  const int64_t rows = d.batch * d.seq * d.heads;
  std::vector<float> out(rows * d.v_dim), lse(rows), dq(rows * d.qk_dim), dk(rows * d.qk_dim), dv(rows * d.v_dim);
  std::vector<float> dsink(3, 0.25f);
  ops::attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), p.ids(), d, nullptr, sink.data());
  ops::attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), out.data(), lse.data(), p.q.data(),
                          p.k.data(), p.v.data(), p.ids(), d, nullptr, sink.data(), dsink.data());
  for (auto& x : dsink) x -= 0.25f;  // accumulated into
  const std::vector<double> sd(sink.begin(), sink.end());
  std::vector<double> ro, rl, rdq, rdk, rdv, rds;
  ref::attention_forward(ro, rl, to_double(p.q), to_double(p.k), to_double(p.v), p.seg, d, {}, sd);
  ref::attention_backward(rdq, rdk, rdv, to_double(p.dout), to_double(p.q), to_double(p.k), to_double(p.v), p.seg, d,
                          {}, sd, &rds);
  expect_close(out, ro, kOutTol, 0, "out");
  expect_close(lse, rl, kOutTol, 0, "lse");
  expect_close(dq, rdq, kGradTol, 0, "dq");
  expect_close(dk, rdk, kGradTol, 0, "dk");
  expect_close(dv, rdv, kGradTol, 0, "dv");
  expect_close(dsink, rds, kGradTol, 0, "dsink");
}

TEST(Attention, MlaHeadSizes) {
  // DeepSeek-V3 MLA: qk head dim 128 + 64 = 192, v head dim 128.
  expect_matches_reference(Problem({1, 130, 2, 192, 128, default_scale(192)}, from_lengths({40, 90}), 27));
  // The small preset's heads (32 + 16, v 32): whole vectors of keys and
  // values on every target, T = 128 one diagonal tile; then a second tile.
  expect_matches_reference(Problem({2, 128, 6, 48, 32, default_scale(48)}, {}, 30));
  expect_matches_reference(Problem({1, 200, 3, 48, 32, default_scale(48)}, {}, 31));
}

TEST(Attention, BatchRowsWithDifferentLayouts) {
  // Row 0: one segment; row 1: short segments; row 2: two long ones; row 3:
  // unsorted ids that revisit earlier values (no skipping may assume order).
  const int64_t T = 300;
  std::vector<int32_t> seg(T, 0);
  std::vector<int> shorts;
  for (int n = 1, left = T; left > 0; n = n % 9 + 1) shorts.push_back(std::min(n, left)), left -= shorts.back();
  const auto row1 = from_lengths(shorts), row2 = from_lengths({145, 155});
  seg.insert(seg.end(), row1.begin(), row1.end());
  seg.insert(seg.end(), row2.begin(), row2.end());
  for (int64_t t = 0; t < T; ++t) seg.push_back(static_cast<int32_t>((t * 7 + t / 13) % 3));
  expect_matches_reference(Problem({4, T, 2, 12, 6, default_scale(12)}, seg, 28));
}

// ---------------------------------------------------------------- pieces and errors

TEST(Attention, VectorizedExpMatchesStdExp) {
  // The kernel's exp on a dense grid over [-100, 10] (every argument the
  // softmax sees is <= 0, plus a margin) in a length that leaves a partial
  // vector at the end.
  std::vector<float> x;
  for (float t = -100.0f; t <= 10.0f; t += 0.0123f) x.push_back(t);
  x.push_back(0.0f);
  x.push_back(-std::numeric_limits<float>::infinity());
  std::vector<float> y = x;
  const float sum = ops::detail::attention_exp_row(y.data(), static_cast<int64_t>(y.size()), 0.0f);
  double want_sum = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(static_cast<double>(x[i]));
    want_sum += want;
    if (x[i] < -87.33654f) {
      // Below the smallest normal float the result is flushed to exactly 0.
      EXPECT_EQ(y[i], 0.0f) << x[i];
    } else {
      // Cody-Waite reduction plus a degree-6 polynomial: 8.3e-8 relative at
      // worst on a fine grid; 2.4e-7 (2 ulp of float) keeps a margin for
      // other instruction sets (with or without fused multiply-add).
      EXPECT_LE(std::fabs(y[i] - want), 2.4e-7 * want) << "exp(" << x[i] << ")";
    }
  }
  EXPECT_EQ(y[y.size() - 2], 1.0f);  // exp(0) is exactly 1: a row's max contributes exactly 1
  // Float32 summation of ~9000 terms in at least 4 partial sums: ~1e-6 relative.
  EXPECT_NEAR(sum, want_sum, 1e-5 * want_sum);
  // The shift is subtracted before the exp.
  std::vector<float> z = {2.5f, 3.0f, 1.0f};
  ops::detail::attention_exp_row(z.data(), 3, 3.0f);
  EXPECT_EQ(z[1], 1.0f);
  EXPECT_NEAR(z[0], std::exp(-0.5), 5e-7 * std::exp(-0.5));
}

TEST(Attention, BadSizesThrow) {
  std::vector<float> buf(64, 1.0f);
  float* f = buf.data();
  const AttentionDims good{1, 2, 1, 2, 2, 1.0f};
  EXPECT_NO_THROW(ops::attention_forward(f, f + 8, f + 16, f + 24, f + 32, nullptr, good));
  for (AttentionDims d :
       {AttentionDims{0, 2, 1, 2, 2, 1.0f}, AttentionDims{1, 0, 1, 2, 2, 1.0f}, AttentionDims{1, 2, -1, 2, 2, 1.0f},
        AttentionDims{1, 2, 1, 0, 2, 1.0f}, AttentionDims{1, 2, 1, 2, -3, 1.0f},
        AttentionDims{1, 2, 1, 2, 2, std::numeric_limits<float>::infinity()}}) {
    EXPECT_THROW(ops::attention_forward(f, f + 8, f + 16, f + 24, f + 32, nullptr, d), Error);
    EXPECT_THROW(ops::attention_backward(f, f + 8, f + 16, f + 24, f + 32, f + 40, f + 44, f + 48, f + 52, nullptr, d),
                 Error);
  }
  EXPECT_THROW(ops::attention_forward(nullptr, f, f, f, f, nullptr, good), Error);
}

TEST(Attention, BitwiseReproducibleOverThreadCounts) {
  ThreadCountGuard guard;
  // Several tiles in every direction and a segment layout with skipped pairs.
  const Problem p(
      {2, 300, 3, 24, 16, default_scale(24)},
      [] {
        auto a = from_lengths({30, 200, 70});
        auto b = from_lengths({5, 5, 290});
        a.insert(a.end(), b.begin(), b.end());
        return a;
      }(),
      30);
  Result first;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    const Result r = run_fast(p);
    if (threads == 1) {
      first = r;
      continue;
    }
    SCOPED_TRACE(testing::Message() << threads << " threads");
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same(r.out, first.out));
    EXPECT_TRUE(same(r.lse, first.lse));
    EXPECT_TRUE(same(r.dq, first.dq));
    EXPECT_TRUE(same(r.dk, first.dk));
    EXPECT_TRUE(same(r.dv, first.dv));
  }
}

// A batch of rows [B, T] (the generation engine's equal-length prompts)
// gives each row the bits of a call over that row alone.
TEST(Attention, EachBatchRowHasTheBitsOfItsOwnCall) {
  const int64_t B = 3, T = 150, H = 6, Dqk = 48, Dv = 32;
  const Problem p({B, T, H, Dqk, Dv, default_scale(Dqk)}, {}, 43);
  std::vector<float> out(B * T * H * Dv), lse(B * H * T);
  ops::attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), nullptr, p.d);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<float> o(T * H * Dv), l(H * T);
    ops::attention_forward(o.data(), l.data(), p.q.data() + b * T * H * Dqk, p.k.data() + b * T * H * Dqk,
                           p.v.data() + b * T * H * Dv, nullptr, {1, T, H, Dqk, Dv, default_scale(Dqk)});
    EXPECT_EQ(o, std::vector<float>(out.begin() + b * T * H * Dv, out.begin() + (b + 1) * T * H * Dv)) << "row " << b;
    EXPECT_EQ(l, std::vector<float>(lse.begin() + b * H * T, lse.begin() + (b + 1) * H * T)) << "row " << b;
  }
}

TEST(Attention, PackingAFewHeadsAtATimeChangesNoBit) {
  // A long context with many heads packs its keys and values a group of
  // heads at a time; a budget of one byte makes every group the smallest
  // (two heads per thread), which must give the bits of one group, in the
  // training forward and in continuing queries, for any thread count.
  ThreadCountGuard guard;
  const Problem p({2, 200, 5, 24, 16, default_scale(24)}, from_lengths({120, 80, 200}), 41);
  const AttentionDims cont{1, 70, 5, 24, 16, default_scale(24)};
  auto forward = [&] {
    std::vector<float> out(p.q.size() / 24 * 16), lse(2 * 5 * 200);
    ops::attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), p.seg.data(), p.d);
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  auto past = [&] {  // row 0's last 70 queries against its 200 keys
    std::vector<float> out(70 * 5 * 16);
    ops::attention_forward_past(out.data(), p.q.data() + 130 * 5 * 24, p.k.data(), p.v.data(), 130, cont);
    return out;
  };
  omp_set_num_threads(2);
  const auto whole = forward(), whole_past = past();
  const int64_t saved = ops::detail::set_attention_pack_budget(1);
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    EXPECT_EQ(forward(), whole) << threads << " threads";
    EXPECT_EQ(past(), whole_past) << threads << " threads";
  }
  ops::detail::set_attention_pack_budget(saved);
}

}  // namespace attention_test
}  // namespace
}  // namespace ds
