// gemm in bf16 (GemmDtype::kBf16): C against a float64 product of the
// operands rounded to bf16 here, element by element, within the bound that
// float32 summation allows; a check that each operand's rounding happens (it
// fails when either is skipped); both paths (oneDNN's bf16 matmul where the
// CPU has bf16 dot products, sgemm over the rounded values elsewhere); bits
// that do not depend on the thread count; and the setting's scope.
#include <omp.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/simd.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "test_util.h"

namespace ds {
namespace {
namespace gemm_bf16_test {

using test::randn;

// The error bound, derived. Let a' and b' be the operands rounded to bf16
// (8 significant bits: a' = a (1 + d), |d| <= 2^-8). Each product a' b' has
// at most 16 significant bits, so float32 holds it exactly; the only rounding
// left is the float32 sum of K such terms (and alpha, beta), which in any
// order (oneDNN's pairs, blocks of K, sgemm's kernels) is within
// (K + 2) 2^-24 sum_k |alpha a'_ik b'_kj| + 2^-24 |beta c_ij| of the exact
// value (Higham, Accuracy and Stability, 3.1; one more unit for alpha and
// beta's products). vdpbf16ps treats subnormal bf16 inputs as zero: the data
// here has none. So |C - R| <= that bound, with R the float64 product of the
// rounded operands.
double sum_bound(int64_t K) { return (static_cast<double>(K) + 2) * std::ldexp(1.0, -24); }

struct Case {
  int64_t M, N, K;
  bool ta, tb;
  float alpha, beta;
  int64_t pad;  // extra leading-dimension elements
};

struct Operands {
  std::vector<float> a, b, c;
  int64_t lda, ldb, ldc;
};

Operands make(const Case& t, uint64_t seed) {
  Operands o;
  o.lda = (t.ta ? t.M : t.K) + t.pad;
  o.ldb = (t.tb ? t.K : t.N) + t.pad;
  o.ldc = t.N + t.pad;
  o.a = randn(static_cast<size_t>((t.ta ? t.K : t.M) * o.lda), seed);
  o.b = randn(static_cast<size_t>((t.tb ? t.N : t.K) * o.ldb), seed + 1);
  o.c = randn(static_cast<size_t>(t.M * o.ldc), seed + 2);
  return o;
}

double bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// alpha op(A) op(B) + beta C in float64, with each operand rounded to bf16
// or not, and the sum of |terms| per element (for the bound).
void reference(const Case& t, const Operands& o, bool round_a, bool round_b, std::vector<double>& want,
               std::vector<double>& magnitude) {
  want.assign(static_cast<size_t>(t.M * t.N), 0.0);
  magnitude.assign(want.size(), 0.0);
  for (int64_t i = 0; i < t.M; ++i)
    for (int64_t j = 0; j < t.N; ++j) {
      double s = 0, m = 0;
      for (int64_t k = 0; k < t.K; ++k) {
        const float av = t.ta ? o.a[k * o.lda + i] : o.a[i * o.lda + k];
        const float bv = t.tb ? o.b[j * o.ldb + k] : o.b[k * o.ldb + j];
        const double p = (round_a ? bf16(av) : av) * (round_b ? bf16(bv) : bv);
        s += p;
        m += std::fabs(p);
      }
      want[i * t.N + j] = t.alpha * s + (t.beta == 0 ? 0.0 : t.beta * o.c[i * o.ldc + j]);
      magnitude[i * t.N + j] = std::fabs(t.alpha) * m * sum_bound(t.K) +
                               (t.beta == 0 ? 0.0 : std::ldexp(std::fabs(t.beta * o.c[i * o.ldc + j]), -24));
    }
}

std::vector<float> run_bf16(const Case& t, const Operands& o) {
  ops::ScopedGemmDtype bf16(ops::GemmDtype::kBf16);
  std::vector<float> c = o.c;
  ops::gemm(t.ta, t.tb, t.M, t.N, t.K, t.alpha, o.a.data(), o.lda, o.b.data(), o.ldb, t.beta, c.data(), o.ldc);
  std::vector<float> out(static_cast<size_t>(t.M * t.N));
  for (int64_t i = 0; i < t.M; ++i)
    for (int64_t j = 0; j < t.N; ++j) out[i * t.N + j] = c[i * o.ldc + j];
  return out;
}

// Shapes: tiny (the sgemm path on every CPU), projection-sized ones (oneDNN's
// bf16 matmul where the CPU has it), the last one cut into several blocks,
// edge blocks, every transpose, alpha and beta, padded leading dimensions.
const Case kCases[] = {{3, 5, 7, false, false, 1.0f, 0.0f, 0},        {40, 24, 64, false, true, 1.0f, 0.0f, 3},
                       {300, 520, 96, false, true, 1.0f, 0.0f, 0},    {257, 130, 200, true, false, 1.0f, 1.0f, 5},
                       {96, 1100, 48, false, false, 0.125f, 0.0f, 0}, {130, 70, 300, true, true, 1.0f, 1.0f, 1},
                       {64, 64, 1000, false, true, 2.0f, 0.5f, 0},    {384, 640, 256, false, true, 1.0f, 0.0f, 0}};

class GemmBf16Paths : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    saved_ = simd_bf16_dot_allowed();
    // Allowing them still leaves them off where the dispatched target is
    // not AVX-512 (a capped run) or the CPU lacks them.
    detail::set_simd_bf16_dot_allowed(GetParam() && saved_);
  }
  void TearDown() override { detail::set_simd_bf16_dot_allowed(saved_); }

 private:
  bool saved_ = false;
};

TEST_P(GemmBf16Paths, MatchesFloat64ProductOfRoundedOperands) {
  std::vector<double> want, bound;
  uint64_t seed = 10;
  for (const Case& t : kCases) {
    SCOPED_TRACE(::testing::Message() << t.M << "x" << t.N << "x" << t.K << " ta=" << t.ta << " tb=" << t.tb
                                      << " alpha=" << t.alpha << " beta=" << t.beta);
    const Operands o = make(t, seed += 3);
    const std::vector<float> got = run_bf16(t, o);
    reference(t, o, true, true, want, bound);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_LE(std::fabs(got[i] - want[i]), bound[i]) << "element " << i << ": " << got[i] << " vs " << want[i];
  }
}

// Skipping either rounding moves the result by about 2^-9 of the terms'
// magnitude, far outside the bound: with one operand already exactly bf16,
// the other's rounding must show.
TEST_P(GemmBf16Paths, RoundsEachOperand) {
  const Case t{200, 300, 128, false, true, 1.0f, 0.0f, 0};
  for (const bool round_a : {true, false}) {
    Operands o = make(t, 77);
    // The operand that is not under test holds bf16 values already.
    std::vector<float>& exact = round_a ? o.b : o.a;
    round_to_bf16(exact.data(), exact.size());
    const std::vector<float> got = run_bf16(t, o);
    std::vector<double> unrounded, bound;
    reference(t, o, false, false, unrounded, bound);
    size_t outside = 0;
    for (size_t i = 0; i < got.size(); ++i) outside += std::fabs(got[i] - unrounded[i]) > bound[i];
    // A skipped rounding leaves every element within the bound; a done one
    // moves nearly all of them outside it.
    EXPECT_GT(outside, got.size() * 9 / 10) << (round_a ? "A" : "B") << " was not rounded";
  }
}

TEST_P(GemmBf16Paths, SameBitsForAnyThreadCount) {
  for (const Case& t : kCases) {
    const Operands o = make(t, 5);
    test::expect_same_for_any_thread_count([&] { return run_bf16(t, o); });
  }
}

INSTANTIATE_TEST_SUITE_P(DotProducts, GemmBf16Paths, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Bf16DotsWhereAllowed" : "Float32Sums"; });

// The two paths agree to the bound's order: the same products, summed in
// different orders.
TEST(GemmBf16, PathsAgree) {
  const bool saved = simd_bf16_dot_allowed();
  const Case t{300, 520, 96, false, true, 1.0f, 0.0f, 0};
  const Operands o = make(t, 3);
  const std::vector<float> dots = run_bf16(t, o);
  detail::set_simd_bf16_dot_allowed(false);
  const std::vector<float> sums = run_bf16(t, o);
  detail::set_simd_bf16_dot_allowed(saved);
  std::vector<double> want, bound;
  reference(t, o, true, true, want, bound);
  for (size_t i = 0; i < dots.size(); ++i) ASSERT_LE(std::fabs(dots[i] - sums[i]), 2 * bound[i]) << i;
}

TEST(GemmBf16, FloatIsTheDefaultAndTheScopeRestoresIt) {
  EXPECT_EQ(ops::gemm_dtype(), ops::GemmDtype::kF32);
  {
    ops::ScopedGemmDtype bf16(ops::GemmDtype::kBf16);
    EXPECT_EQ(ops::gemm_dtype(), ops::GemmDtype::kBf16);
    {
      ops::ScopedGemmDtype f32(ops::GemmDtype::kF32);
      EXPECT_EQ(ops::gemm_dtype(), ops::GemmDtype::kF32);
    }
    EXPECT_EQ(ops::gemm_dtype(), ops::GemmDtype::kBf16);
  }
  EXPECT_EQ(ops::gemm_dtype(), ops::GemmDtype::kF32);
}

TEST(GemmBf16, ParsesMaxTextNames) {
  EXPECT_EQ(ops::parse_gemm_dtype("bfloat16"), ops::GemmDtype::kBf16);
  EXPECT_EQ(ops::parse_gemm_dtype("float32"), ops::GemmDtype::kF32);
  EXPECT_EQ(ops::gemm_dtype_name(ops::GemmDtype::kBf16), "bfloat16");
  EXPECT_THROW(ops::parse_gemm_dtype("fp16"), Error);
}

}  // namespace gemm_bf16_test
}  // namespace
}  // namespace ds
