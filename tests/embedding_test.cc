// Embedding: the reference gradient against finite differences, the gather
// and the scatter-add (`+=`, repeated ids) against the reference, bitwise
// thread-count independence of the scatter, and ids outside the vocabulary.
#include "ops/embedding.h"

#include <omp.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/reference/embedding.h"
#include "test_util.h"

namespace ds {
namespace {
namespace embedding_test {

using test::expect_close;
using test::randn;
using test::to_double;

// Ids with repeats, drawn from a small vocabulary by a fixed rule.
std::vector<int32_t> make_ids(int64_t tokens, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> ids(tokens);
  const auto u = randn(tokens, seed);
  for (int64_t t = 0; t < tokens; ++t)
    ids[t] = static_cast<int32_t>(static_cast<int64_t>(std::fabs(u[t]) * 7919) % vocab);
  return ids;
}

TEST(Embedding, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t vocab = 5, dim = 3;
  const std::vector<int32_t> ids = {4, 1, 4, 0, 4, 1};
  const auto table = to_double(randn(vocab * dim, 1)), g = to_double(randn(ids.size() * dim, 2));
  std::vector<double> dtable(vocab * dim, 0.0);
  ref::embedding_backward(dtable, g, ids, dim);
  const auto f = [&](const std::vector<double>& v) { return test::weighted_sum(ref::embedding(ids, v, dim), g); };
  // Linear in the table: central differences are exact up to the rounding of
  // f, ~1e-16 |f| / h = 1e-10 with h = 1e-6.
  expect_close(dtable, test::numeric_grad(f, table), 0, 1e-8);
}

TEST(Embedding, ForwardGathersRows) {
  const int64_t vocab = 50, dim = 37, tokens = 20;
  const auto ids = make_ids(tokens, vocab, 3);
  const auto table = randn(vocab * dim, 4);
  std::vector<float> out(tokens * dim);
  ops::embedding_forward(out.data(), ids.data(), table.data(), tokens, vocab, dim);
  EXPECT_EQ(out, ref::embedding(ids, table, dim));  // a copy: bitwise
}

// Pre-filled dtable: the kernel adds, in token order, exactly as the float
// reference does, so the two agree bitwise; rows no token uses are untouched.
TEST(Embedding, BackwardScatterAddsRepeatedIds) {
  const int64_t vocab = 9, dim = 300, tokens = 40;
  auto ids = make_ids(tokens, vocab - 1, 5);  // the last row is never used
  ids[0] = ids[7] = ids[39] = 2;
  const auto dout = randn(tokens * dim, 6);
  const auto d0 = randn(vocab * dim, 7);
  std::vector<float> got = d0, want = d0;
  ops::embedding_backward(got.data(), dout.data(), ids.data(), tokens, vocab, dim);
  ref::embedding_backward(want, dout, ids, dim);
  EXPECT_EQ(got, want);
  for (int64_t j = 0; j < dim; ++j) EXPECT_EQ(got[(vocab - 1) * dim + j], d0[(vocab - 1) * dim + j]);
  // And against the double reference: row sums of up to ~10 float terms of
  // order 1, so 1e-6 of the largest value is several ulp.
  std::vector<double> wd = to_double(d0);
  ref::embedding_backward(wd, to_double(dout), ids, dim);
  expect_close(got, wd, 1e-6, 0);
}

TEST(Embedding, BackwardBitwiseIndependentOfThreadCount) {
  const int64_t vocab = 7, dim = 600, tokens = 300;  // three column slices, many repeats
  const auto ids = make_ids(tokens, vocab, 8);
  const auto dout = randn(tokens * dim, 9, 10.0f);
  const auto d0 = randn(vocab * dim, 10);
  const auto run = [&] {
    std::vector<float> d = d0;
    ops::embedding_backward(d.data(), dout.data(), ids.data(), tokens, vocab, dim);
    return d;
  };
  test::expect_same_for_any_thread_count(run);
}

TEST(Embedding, IdsOutsideVocabularyThrowAndWriteNothing) {
  const int64_t vocab = 4, dim = 3;
  const auto table = randn(vocab * dim, 11);
  for (int32_t bad : {4, -1, 1 << 30}) {
    const std::vector<int32_t> ids = {0, bad, 1};
    std::vector<float> out(3 * dim, 5.0f), d(vocab * dim, 5.0f);
    EXPECT_THROW(ops::embedding_forward(out.data(), ids.data(), table.data(), 3, vocab, dim), Error) << bad;
    EXPECT_THROW(ops::embedding_backward(d.data(), out.data(), ids.data(), 3, vocab, dim), Error) << bad;
    EXPECT_EQ(out, std::vector<float>(3 * dim, 5.0f));
    EXPECT_EQ(d, std::vector<float>(vocab * dim, 5.0f));
  }
  std::vector<float> out(dim);
  const std::vector<int32_t> ids = {0};
  EXPECT_THROW(ops::embedding_forward(out.data(), ids.data(), table.data(), 1, vocab, 0), Error);
  EXPECT_THROW(ops::embedding_forward(out.data(), ids.data(), table.data(), -1, vocab, dim), Error);
}

}  // namespace embedding_test
}  // namespace
}  // namespace ds
