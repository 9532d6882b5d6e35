// DeepSeek-V4's attention core (ops/sparse_attention.h): per-query key lists
// with K = V and a sink, against the double reference, the backward against
// central differences, and thread-count independence.
#include "ops/sparse_attention.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "ops/reference/sparse_attention.h"
#include "test_util.h"

using ds::ops::SparseMqaDims;

namespace {
namespace sparse_attention_test {

struct Case {
  SparseMqaDims d;
  int64_t nkeys;
  std::vector<std::vector<int64_t>> lists;
  std::vector<int64_t> offsets;
};

// Lists of varying length over nkeys keys (some shared between queries, one
// repeated within a list, one empty when there is a sink); `extra` more keys
// in every list that is not empty (lists longer than two vectors).
Case make_case(int64_t queries, int64_t heads, int64_t dim, int64_t nkeys, bool empty_list, int64_t extra = 0) {
  Case c;
  c.d.queries = queries;
  c.d.heads = heads;
  c.d.dim = dim;
  c.d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  c.nkeys = nkeys;
  c.offsets.push_back(0);
  for (int64_t i = 0; i < queries; ++i) {
    std::vector<int64_t> l;
    if (!(empty_list && i == 1))
      for (int64_t j = 0; j < 1 + (i * 5 + 3) % 7 + extra; ++j) l.push_back((i * 3 + j * 5) % nkeys);
    if (i == 2 && !l.empty()) l.push_back(l.front());  // a key twice
    c.lists.push_back(l);
    c.offsets.push_back(c.offsets.back() + static_cast<int64_t>(l.size()));
  }
  return c;
}

template <typename T>
std::vector<T*> row_pointers(std::vector<T>& keys, const Case& c) {
  std::vector<T*> rows;
  for (const auto& l : c.lists)
    for (int64_t j : l) rows.push_back(keys.data() + j * c.d.dim);
  return rows;
}

// The small shapes, and lists of 36 to 43 keys with an odd head count and a
// dimension that is no multiple of any vector length (every tail of the
// kernels' tiles).
TEST(SparseAttention, MatchesTheReference) {
  for (bool with_sink : {false, true})
    for (bool odd : {false, true}) {
      Case c = odd ? make_case(5, 3, 37, 45, with_sink, 35) : make_case(6, 3, 8, 9, with_sink);
      auto q = ds::test::randn(c.d.queries * c.d.heads * c.d.dim, 1);
      auto keys = ds::test::randn(c.nkeys * c.d.dim, 2);
      std::vector<float> sink;
      if (with_sink) sink = ds::test::randn(c.d.heads, 3);
      std::vector<float> out(q.size()), lse(c.d.queries * c.d.heads);
      const auto rows = row_pointers(keys, c);
      ds::ops::sparse_mqa_forward(out.data(), lse.data(), q.data(), rows.data(), c.offsets.data(),
                                  with_sink ? sink.data() : nullptr, c.d);
      const auto want = ds::ref::sparse_mqa(ds::test::to_double(q), ds::test::to_double(keys), c.lists,
                                            ds::test::to_double(sink), c.d);
      ds::test::expect_close(out, want, 1e-5, 1e-6, with_sink ? "sink" : "no sink");
    }
}

TEST(SparseAttention, HandChecked) {
  // One query, one head, two keys with equal scores (q orthogonal to both):
  // the output is their mean; a sink of log 2 makes it a third each.
  const std::vector<float> q = {0, 0, 1}, k0 = {1, 0, 0}, k1 = {0, 1, 0};
  const float* rows[] = {k0.data(), k1.data()};
  const int64_t offsets[] = {0, 2};
  SparseMqaDims d;
  d.queries = 1;
  d.heads = 1;
  d.dim = 3;
  std::vector<float> out(3), lse(1);
  ds::ops::sparse_mqa_forward(out.data(), lse.data(), q.data(), rows, offsets, nullptr, d);
  EXPECT_FLOAT_EQ(out[0], 0.5f);
  EXPECT_FLOAT_EQ(out[1], 0.5f);
  EXPECT_FLOAT_EQ(lse[0], std::log(2.0f));
  const float sink = std::log(2.0f);
  ds::ops::sparse_mqa_forward(out.data(), lse.data(), q.data(), rows, offsets, &sink, d);
  EXPECT_FLOAT_EQ(out[0], 0.25f);
  EXPECT_FLOAT_EQ(lse[0], std::log(4.0f));
}

TEST(SparseAttention, BackwardMatchesCentralDifferences) {
  for (bool with_sink : {false, true})
    for (bool odd : {false, true}) {
      Case c = odd ? make_case(4, 3, 37, 45, with_sink, 35) : make_case(5, 2, 6, 7, with_sink);
      auto q = ds::test::randn(c.d.queries * c.d.heads * c.d.dim, 11);
      auto keys = ds::test::randn(c.nkeys * c.d.dim, 12);
      std::vector<float> sink;
      if (with_sink) sink = ds::test::randn(c.d.heads, 13);
      const auto g = ds::test::randn(q.size(), 14);
      const float* sp = with_sink ? sink.data() : nullptr;
      std::vector<float> out(q.size()), lse(c.d.queries * c.d.heads);
      auto rows = row_pointers(keys, c);
      ds::ops::sparse_mqa_forward(out.data(), lse.data(), q.data(), rows.data(), c.offsets.data(), sp, c.d);
      std::vector<float> dq(q.size(), 7.0f), dkeys(keys.size(), 0.5f), dsink(c.d.heads, -0.25f);
      auto drows = row_pointers(dkeys, c);
      ds::ops::sparse_mqa_backward(dq.data(), drows.data(), with_sink ? dsink.data() : nullptr, g.data(), out.data(),
                                   lse.data(), q.data(), rows.data(), c.offsets.data(), sp, c.d);
      for (auto& v : dkeys) v -= 0.5f;  // accumulated into
      for (auto& v : dsink) v += 0.25f;
      const auto Q = ds::test::to_double(q), K = ds::test::to_double(keys), S = ds::test::to_double(sink);
      const auto G = ds::test::to_double(g);
      auto loss = [&](const std::vector<double>& qq, const std::vector<double>& kk, const std::vector<double>& ss) {
        return ds::test::weighted_sum(ds::ref::sparse_mqa(qq, kk, c.lists, ss, c.d), G);
      };
      ds::test::expect_close(dq, ds::test::numeric_grad([&](const auto& v) { return loss(v, K, S); }, Q), 1e-5, 1e-6,
                             "dq");
      ds::test::expect_close(dkeys, ds::test::numeric_grad([&](const auto& v) { return loss(Q, v, S); }, K), 1e-5, 1e-6,
                             "dkeys");
      if (with_sink)
        ds::test::expect_close(dsink, ds::test::numeric_grad([&](const auto& v) { return loss(Q, K, v); }, S), 1e-5,
                               1e-6, "dsink");
    }
}

// Three blocks of queries, long lists, odd shapes.
TEST(SparseAttention, ResultsDoNotDependOnTheThreadCount) {
  Case c = make_case(600, 3, 37, 50, true, 20);
  auto q = ds::test::randn(c.d.queries * c.d.heads * c.d.dim, 21);
  auto keys = ds::test::randn(c.nkeys * c.d.dim, 22);
  const auto sink = ds::test::randn(c.d.heads, 23), g = ds::test::randn(q.size(), 24);
  ds::test::expect_same_for_any_thread_count([&] {
    std::vector<float> out(q.size()), lse(c.d.queries * c.d.heads), dq(q.size()), dkeys(keys.size(), 0.0f),
        dsink(c.d.heads, 0.0f);
    auto rows = row_pointers(keys, c);
    auto drows = row_pointers(dkeys, c);
    ds::ops::sparse_mqa_forward(out.data(), lse.data(), q.data(), rows.data(), c.offsets.data(), sink.data(), c.d);
    ds::ops::sparse_mqa_backward(dq.data(), drows.data(), dsink.data(), g.data(), out.data(), lse.data(), q.data(),
                                 rows.data(), c.offsets.data(), sink.data(), c.d);
    for (auto* v : {&lse, &dq, &dkeys, &dsink}) out.insert(out.end(), v->begin(), v->end());
    return out;
  });
}

TEST(SparseAttention, BadInputsAreErrors) {
  std::vector<float> buf(8, 1.0f);
  const float* rows[] = {buf.data()};
  const int64_t empty[] = {0, 0}, bad[] = {0, 1, 0};
  SparseMqaDims d;
  d.queries = 1;
  d.dim = 2;
  // An empty list needs a sink; offsets must not decrease.
  EXPECT_THROW(ds::ops::sparse_mqa_forward(buf.data(), buf.data(), buf.data(), rows, empty, nullptr, d), ds::Error);
  d.queries = 2;
  EXPECT_THROW(ds::ops::sparse_mqa_forward(buf.data(), buf.data(), buf.data(), rows, bad, buf.data(), d), ds::Error);
  d.dim = 0;
  EXPECT_THROW(ds::ops::sparse_mqa_forward(buf.data(), buf.data(), buf.data(), rows, empty, buf.data(), d), ds::Error);
}

}  // namespace sparse_attention_test
}  // namespace
