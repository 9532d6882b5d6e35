// Dense matmul: the double reference's backward against finite differences,
// then the float32 oneDNN path (gemm, matmul, batched matmul) against the
// reference, the accumulation rules, edge sizes, bad leading dimensions and
// thread-count reproducibility of the weight gradient.
#include "ops/matmul.h"

#include <omp.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "ops/reference/matmul.h"
#include "test_util.h"

namespace ds {
namespace {
namespace matmul_test {

using ds::test::ThreadCountGuard;

using test::expect_close;
using test::randn;
using test::to_double;

// float32 results vs the double reference: each output is a dot product of
// n float32 terms of size ~1, whose rounding error grows like sqrt(n) * 2^-24
// relative to the terms; 1e-5 of the largest output (itself ~sqrt(n)) leaves
// a wide margin for the n <= 700 used here while catching any wrong index.
constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

class MatmulTrans : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

// Reference backward vs central finite differences of the reference forward,
// all in double, for L = sum(w * matmul(a, b)).
TEST_P(MatmulTrans, ReferenceBackwardMatchesFiniteDifferences) {
  const auto [ta, tb] = GetParam();
  const int64_t M = 3, N = 4, K = 5;
  const auto a = to_double(randn(M * K, 1)), b = to_double(randn(K * N, 2)), w = to_double(randn(M * N, 3));
  std::vector<double> da, db;
  ref::matmul_backward(da, db, w, a, b, M, N, K, ta, tb);  // dL/dc = w
  const auto fa = [&](const std::vector<double>& x) {
    return test::weighted_sum(ref::matmul(x, b, M, N, K, ta, tb), w);
  };
  const auto fb = [&](const std::vector<double>& x) {
    return test::weighted_sum(ref::matmul(a, x, M, N, K, ta, tb), w);
  };
  // The objective is bilinear, so central differences are exact up to the
  // rounding of f (~1e-16 * |f| / h = 1e-10 for h = 1e-6).
  expect_close(da, test::numeric_grad(fa, a), 0, 1e-8, "da");
  expect_close(db, test::numeric_grad(fb, b), 0, 1e-8, "db");
}

TEST_P(MatmulTrans, ForwardAndBackwardMatchReference) {
  const auto [ta, tb] = GetParam();
  const int64_t M = 37, N = 29, K = 61;  // odd sizes: no kernel's vector width divides them
  const auto a = randn(M * K, 10), b = randn(K * N, 11), dc = randn(M * N, 12);
  std::vector<float> c(M * N, 7.0f);  // stale values must be overwritten
  ops::matmul_forward(c.data(), a.data(), b.data(), M, N, K, ta, tb);
  expect_close(c, ref::matmul(to_double(a), to_double(b), M, N, K, ta, tb), kRtol, kAtol, "c");

  // da is overwritten (stale 7s); db accumulates onto its prior contents.
  const auto db0 = randn(K * N, 13);
  std::vector<float> da(M * K, 7.0f), db = db0;
  ops::matmul_backward(da.data(), db.data(), dc.data(), a.data(), b.data(), M, N, K, ta, tb);
  std::vector<double> rda, rdb = to_double(db0);
  ref::matmul_backward(rda, rdb, to_double(dc), to_double(a), to_double(b), M, N, K, ta, tb);
  expect_close(da, rda, kRtol, kAtol, "da");
  expect_close(db, rdb, kRtol, kAtol, "db");

  // Either gradient may be skipped; the other is unchanged by that.
  std::vector<float> da_only(M * K), db_only = db0;
  ops::matmul_backward(da_only.data(), nullptr, dc.data(), a.data(), b.data(), M, N, K, ta, tb);
  ops::matmul_backward(nullptr, db_only.data(), dc.data(), a.data(), b.data(), M, N, K, ta, tb);
  EXPECT_EQ(da_only, da);
  EXPECT_EQ(db_only, db);
}

// Products large enough for gemm to split them into per-thread blocks (rows,
// columns or both, depending on the shape and the thread count): correct block
// offsets in every layout, and bitwise the same result for 1, 2 and 3 threads.
TEST_P(MatmulTrans, ThreadedSplitMatchesReferenceAndIsReproducible) {
  ThreadCountGuard guard;
  const auto [ta, tb] = GetParam();
  struct Shape {
    int64_t M, N, K;
  };
  // Wide, tall and square outputs, so both row and column splits are taken.
  for (const Shape& s : {Shape{150, 130, 120}, Shape{33, 700, 100}, Shape{700, 33, 100}}) {
    const int64_t M = s.M, N = s.N, K = s.K;
    SCOPED_TRACE(testing::Message() << M << "x" << N << "x" << K);
    const auto a = randn(M * K, 14), b = randn(K * N, 15), dc = randn(M * N, 16), db0 = randn(K * N, 17);
    const auto want_c = ref::matmul(to_double(a), to_double(b), M, N, K, ta, tb);
    std::vector<double> want_da, want_db = to_double(db0);
    ref::matmul_backward(want_da, want_db, to_double(dc), to_double(a), to_double(b), M, N, K, ta, tb);
    std::vector<float> c1, da1, db1;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      std::vector<float> c(M * N, 7.0f), da(M * K, 7.0f), db = db0;
      ops::matmul_forward(c.data(), a.data(), b.data(), M, N, K, ta, tb);
      ops::matmul_backward(da.data(), db.data(), dc.data(), a.data(), b.data(), M, N, K, ta, tb);
      expect_close(c, want_c, kRtol, kAtol, "c");
      expect_close(da, want_da, kRtol, kAtol, "da");
      expect_close(db, want_db, kRtol, kAtol, "db");
      if (threads == 1) {
        c1 = c, da1 = da, db1 = db;
      } else {
        EXPECT_EQ(0, std::memcmp(c.data(), c1.data(), c.size() * sizeof(float))) << threads << " threads";
        EXPECT_EQ(0, std::memcmp(da.data(), da1.data(), da.size() * sizeof(float))) << threads << " threads";
        EXPECT_EQ(0, std::memcmp(db.data(), db1.data(), db.size() * sizeof(float))) << threads << " threads";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, MatmulTrans, ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// Batched products with a broadcast operand (stride 0): the broadcast one's
// gradient is the sum over the batch, added to what it held before.
TEST(MatmulBatched, BroadcastOperandGradientsSumOverBatch) {
  const int64_t batch = 3, M = 5, N = 7, K = 6;
  for (const bool broadcast_a : {false, true}) {
    const int64_t sa = broadcast_a ? 0 : M * K, sb = broadcast_a ? K * N : 0, sc = M * N;
    const int64_t na = broadcast_a ? M * K : batch * M * K, nb = broadcast_a ? batch * K * N : K * N;
    const auto a = randn(na, 20), b = randn(nb, 21), dc = randn(batch * sc, 22), db0 = randn(nb, 23);
    std::vector<float> c(batch * sc), da(na, 7.0f), db = db0;
    ops::matmul_batched_forward(c.data(), a.data(), b.data(), batch, M, N, K, sa, sb, sc, false, true);
    ops::matmul_batched_backward(da.data(), db.data(), dc.data(), a.data(), b.data(), batch, M, N, K, sa, sb, sc, false,
                                 true);
    std::vector<double> want_c, want_da(na, 0.0), want_db = to_double(db0);
    for (int64_t i = 0; i < batch; ++i) {
      const std::vector<double> ai = to_double({a.begin() + i * sa, a.begin() + i * sa + M * K});
      const std::vector<double> bi = to_double({b.begin() + i * sb, b.begin() + i * sb + K * N});
      const std::vector<double> dci = to_double({dc.begin() + i * sc, dc.begin() + (i + 1) * sc});
      const auto ci = ref::matmul(ai, bi, M, N, K, false, true);
      want_c.insert(want_c.end(), ci.begin(), ci.end());
      std::vector<double> dai, dbi(K * N, 0.0);
      ref::matmul_backward(dai, dbi, dci, ai, bi, M, N, K, false, true);
      for (int64_t j = 0; j < M * K; ++j) want_da[i * sa + j] += dai[j];
      for (int64_t j = 0; j < K * N; ++j) want_db[i * sb + j] += dbi[j];
    }
    SCOPED_TRACE(broadcast_a ? "broadcast a" : "broadcast b");
    expect_close(c, want_c, kRtol, kAtol, "c");
    expect_close(da, want_da, kRtol, kAtol, "da");
    expect_close(db, want_db, kRtol, kAtol, "db");
  }
}

TEST(Gemm, AlphaBetaAndLeadingDimensions) {
  // C = alpha A B^T + beta C on sub-blocks of larger buffers (ld > width);
  // elements outside the block must stay untouched.
  const int64_t M = 4, N = 5, K = 3, lda = 6, ldb = 4, ldc = 9;
  const auto A = randn(M * lda, 30), B = randn(N * ldb, 31), C0 = randn(M * ldc, 32);
  const float alpha = 0.5f, beta = -2.0f;
  std::vector<float> C = C0;
  ops::gemm(false, true, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < ldc; ++j) {
      double want = C0[i * ldc + j];
      if (j < N) {
        double s = 0;
        for (int64_t p = 0; p < K; ++p) s += static_cast<double>(A[i * lda + p]) * B[j * ldb + p];
        want = alpha * s + beta * want;
      }
      // K = 3 products of N(0,1) values: float rounding is ~1e-7 of ~5.
      EXPECT_NEAR(C[i * ldc + j], want, 1e-5) << i << "," << j;
    }
}

TEST(Gemm, EmptySizes) {
  // K = 0: no products, so C = beta C; with beta = 0 even NaN in C is cleared
  // (BLAS does not read C then).
  std::vector<float> C = {1, 2, std::nanf(""), 4, 5, 6};
  ops::gemm(false, false, 2, 3, 0, 1.0f, nullptr, 0, nullptr, 3, 3.0f, C.data(), 3);
  EXPECT_EQ(C[0], 3.0f);
  EXPECT_EQ(C[5], 18.0f);
  ops::gemm(false, false, 2, 3, 0, 1.0f, nullptr, 0, nullptr, 3, 0.0f, C.data(), 3);
  EXPECT_EQ(C, std::vector<float>(6, 0.0f));
  // matmul with K = 0 writes zeros (its da and db have no elements).
  std::vector<float> c(6, 7.0f);
  ops::matmul_forward(c.data(), nullptr, nullptr, 2, 3, 0);
  EXPECT_EQ(c, std::vector<float>(6, 0.0f));
  // M = 0 or N = 0: nothing to write, db gets nothing added.
  std::vector<float> a = randn(8, 34), b = randn(8, 35), db2 = b;
  ops::matmul_forward(nullptr, a.data(), b.data(), 0, 2, 4);
  ops::matmul_forward(nullptr, a.data(), b.data(), 2, 0, 4);
  ops::matmul_backward(nullptr, db2.data(), nullptr, a.data(), b.data(), 0, 2, 4);
  EXPECT_EQ(db2, b);
  std::vector<float> da2(8, 7.0f);
  ops::matmul_backward(da2.data(), nullptr, nullptr, a.data(), b.data(), 2, 0, 4);
  EXPECT_EQ(da2, std::vector<float>(8, 0.0f)) << "N = 0: da = dc b^T is a sum of nothing";
}

TEST(Gemm, BadArgumentsThrow) {
  std::vector<float> A(64), B(64), C(64);
  EXPECT_THROW(ops::gemm(false, false, 4, 4, 4, 1, A.data(), 3, B.data(), 4, 0, C.data(), 4), Error);  // lda < K
  EXPECT_THROW(ops::gemm(true, false, 4, 4, 2, 1, A.data(), 3, B.data(), 4, 0, C.data(), 4), Error);   // lda < M
  EXPECT_THROW(ops::gemm(false, false, 4, 4, 4, 1, A.data(), 4, B.data(), 3, 0, C.data(), 4), Error);  // ldb < N
  EXPECT_THROW(ops::gemm(false, true, 4, 4, 4, 1, A.data(), 4, B.data(), 3, 0, C.data(), 4), Error);   // ldb < K
  EXPECT_THROW(ops::gemm(false, false, 4, 4, 4, 1, A.data(), 4, B.data(), 4, 0, C.data(), 3), Error);  // ldc < N
  EXPECT_THROW(ops::gemm(false, false, 4, 4, 0, 1, A.data(), 4, B.data(), 4, 0, C.data(), 3), Error);  // K = 0 too
  EXPECT_THROW(ops::gemm(false, false, -1, 4, 4, 1, A.data(), 4, B.data(), 4, 0, C.data(), 4), Error);
  EXPECT_THROW(ops::matmul_batched_forward(C.data(), A.data(), B.data(), 2, 2, 2, 2, 4, 4, 3), Error);  // overlap
}

// Weight gradients summed over many tokens must not depend on the thread
// count. A single output column (N = 1) makes the db product a matrix-vector
// one, which the BLAS would otherwise reduce in per-thread pieces.
TEST(MatmulBackward, WeightGradientIsReproducibleAcrossThreadCounts) {
  ThreadCountGuard guard;
  struct Shape {
    int64_t M, N, K;
  };
  for (const Shape& s : {Shape{100000, 1, 8}, Shape{100000, 8, 1}, Shape{3000, 48, 40}}) {
    const int64_t M = s.M, N = s.N, K = s.K;
    const auto a = randn(M * K, 40), b = randn(K * N, 41), dc = randn(M * N, 42);
    std::vector<std::vector<float>> das, dbs;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      std::vector<float> da(M * K), db(K * N, 0.25f);
      ops::matmul_backward(da.data(), db.data(), dc.data(), a.data(), b.data(), M, N, K);
      das.push_back(da);
      dbs.push_back(db);
    }
    for (size_t i = 1; i < dbs.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(dbs[0].data(), dbs[i].data(), dbs[0].size() * sizeof(float)))
          << M << "x" << N << "x" << K;
      EXPECT_EQ(0, std::memcmp(das[0].data(), das[i].data(), das[0].size() * sizeof(float)))
          << M << "x" << N << "x" << K;
    }
  }
}

}  // namespace matmul_test
}  // namespace
}  // namespace ds
