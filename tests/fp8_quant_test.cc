// quantization=fp8_full (ops/fp8_quant.h): the fp8 rounding against the
// dtype module's encoders, per-channel quantization against a plain
// reference of qwix's rule, and the linear layer's forward and backward
// under it against a float64 reference that applies every step of the rule
// (the operands' e4m3 quantization, the gradient's scale shift and e5m2
// quantization); the test checks that skipping any one step would be seen.
#include "ops/fp8_quant.h"

#include <cfloat>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "test_util.h"

namespace ds {
namespace {
namespace fp8_quant_test {

using ops::Fp8Kind;

float encode_decode(float x, Fp8Kind k) {
  return k == Fp8Kind::kE4m3 ? e4m3_to_f32(f32_to_e4m3(x)) : e5m2_to_f32(f32_to_e5m2(x));
}

TEST(Fp8Quant, RoundingMatchesTheEncoders) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f,     1.0625f,  1.125f, 1.1875f, 447.0f,     448.0f,      464.0f,
                           1e6f, -1e6f, 57344.0f, 61440.0f, 1e-3f,  2e-3f,   1.0f / 512, 3.0f / 1024, 1e-9f};
  const auto r = test::randn(20000, 3, 40.0f);
  xs.insert(xs.end(), r.begin(), r.end());
  for (int e = -20; e < 18; ++e)
    for (int m = 0; m < 64; ++m) xs.push_back(std::ldexp(1.0f + m / 64.0f, e));  // ties and binade edges
  for (const Fp8Kind k : {Fp8Kind::kE4m3, Fp8Kind::kE5m2})
    for (const float x : xs) {
      const float want = encode_decode(std::clamp(x, -ops::fp8_max(k), ops::fp8_max(k)), k);
      ASSERT_EQ(ops::fp8_round(x, k), want) << x << (k == Fp8Kind::kE4m3 ? " e4m3" : " e5m2");
    }
}

// qwix's rule written out plainly: absmax over the channel, scale = absmax /
// qmax (1 below sqrt(FLT_MIN)), q = fp8(clip(x / scale)); in bf16, x, the
// scale and x / scale are rounded to bf16 first.
struct RefQuant {
  std::vector<float> q, scale;
};
float bf(float x) { return bf16_to_f32(f32_to_bf16(x)); }
RefQuant ref_rows(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8Kind k, bool use_bf16) {
  RefQuant r{std::vector<float>(x.size()), std::vector<float>(static_cast<size_t>(rows))};
  const float qmax = ops::fp8_max(k);
  for (int64_t i = 0; i < rows; ++i) {
    float m = 0;
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, std::fabs(use_bf16 ? bf(x[i * cols + j]) : x[i * cols + j]));
    float s = m / qmax;
    if (use_bf16) s = bf(s);
    if (s < std::sqrt(FLT_MIN)) s = 1.0f;
    r.scale[i] = s;
    for (int64_t j = 0; j < cols; ++j) {
      float t = (use_bf16 ? bf(x[i * cols + j]) : x[i * cols + j]) / s;
      if (use_bf16) t = bf(t);
      r.q[i * cols + j] = encode_decode(std::clamp(t, -qmax, qmax), k);
    }
  }
  return r;
}

std::vector<float> transpose(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = x[i * cols + j];
  return t;
}

TEST(Fp8Quant, RowsAndColumnsFollowTheRule) {
  const int64_t R = 37, C = 53;
  auto x = test::randn(R * C, 5, 3.0f);
  for (int64_t j = 0; j < C; ++j) x[5 * C + j] = 0.0f;  // an all-zero row: scale 1, q 0
  x[7 * C + 3] = 1e-30f;                                // a row of tiny values next to the zero row
  for (const Fp8Kind k : {Fp8Kind::kE4m3, Fp8Kind::kE5m2})
    for (const bool use_bf16 : {false, true}) {
      std::vector<float> q(x.size()), s(R);
      ops::fp8_quantize_rows(q.data(), s.data(), x.data(), R, C, C, k, use_bf16);
      const RefQuant want = ref_rows(x, R, C, k, use_bf16);
      EXPECT_EQ(q, want.q);
      EXPECT_EQ(s, want.scale);
      EXPECT_EQ(s[5], 1.0f);
      // Columns: the rows of the transpose.
      std::vector<float> qc(x.size()), sc(C);
      ops::fp8_quantize_cols(qc.data(), sc.data(), x.data(), R, C, C, k, use_bf16);
      const RefQuant wc = ref_rows(transpose(x, R, C), C, R, k, use_bf16);
      EXPECT_EQ(transpose(qc, R, C), wc.q);
      EXPECT_EQ(sc, wc.scale);
    }
}

// The linear layer under fp8_full against float64 sums of the rule's
// quantized values. Each reference step can be left out, to show that the
// comparison would see it.
struct Steps {
  bool quantize_x = true, quantize_w = true, shift = true, quantize_g = true;
};

struct LinearRef {
  std::vector<double> y, dx, dw;
};

LinearRef linear_ref(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy, int64_t M,
                     int64_t N, int64_t K, Steps st) {
  auto q_or_keep = [](const std::vector<float>& v, int64_t rows, int64_t cols, Fp8Kind k, bool on) {
    RefQuant r = ref_rows(v, rows, cols, k, false);
    if (!on) {
      r.q = v;
      r.scale.assign(static_cast<size_t>(rows), 1.0f);
    }
    return r;
  };
  const RefQuant qx = q_or_keep(x, M, K, Fp8Kind::kE4m3, st.quantize_x);
  const RefQuant qw = q_or_keep(w, N, K, Fp8Kind::kE4m3, st.quantize_w);
  LinearRef r{std::vector<double>(M * N), std::vector<double>(M * K), std::vector<double>(N * K)};
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(qx.q[i * K + k]) * qw.q[j * K + k];
      r.y[i * N + j] = s * qx.scale[i] * qw.scale[j];
    }
  // dx = dy W: dy times W's scale per feature, e5m2 per row.
  std::vector<float> g(dy.size());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) g[i * N + j] = dy[i * N + j] * (st.shift ? qw.scale[j] : 1.0f);
  const RefQuant qg = q_or_keep(g, M, N, Fp8Kind::kE5m2, st.quantize_g);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t j = 0; j < N; ++j)
        s += double(qg.q[i * N + j]) * qw.q[j * K + k] * (st.shift ? 1.0 : double(qw.scale[j]));
      r.dx[i * K + k] = s * qg.scale[i];
    }
  // dW = dy^T x: dy times x's scale per row, e5m2 per feature.
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) g[i * N + j] = dy[i * N + j] * (st.shift ? qx.scale[i] : 1.0f);
  const RefQuant qgt = q_or_keep(transpose(g, M, N), N, M, Fp8Kind::kE5m2, st.quantize_g);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t i = 0; i < M; ++i)
        s += double(qgt.q[j * M + i]) * qx.q[i * K + k] * (st.shift ? 1.0 : double(qx.scale[i]));
      r.dw[j * K + k] = s * qgt.scale[j];
    }
  return r;
}

// Largest |got - want| relative to the largest |want|.
double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double e = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    e = std::max(e, std::fabs(got[i] - want[i]));
    m = std::max(m, std::fabs(want[i]));
  }
  return e / m;
}

TEST(Fp8Quant, LinearFollowsEveryStepOfTheRule) {
  const int64_t M = 48, N = 40, K = 56;
  const auto x = test::randn(M * K, 11), w = test::randn(N * K, 12, 0.1f), dy = test::randn(M * N, 13, 0.01f);
  std::vector<float> y(M * N), dx(M * K), dw(N * K, 0.0f);
  {
    const ops::ScopedQuantization fp8(ops::Quantization::kFp8Full);
    const ops::WeightView wv{w.data(), DType::F32, N, K};
    ops::linear_forward(y.data(), x.data(), wv, M);
    ops::linear_backward(dx.data(), dw.data(), dy.data(), x.data(), wv, M);
  }
  const LinearRef want = linear_ref(x, w, dy, M, N, K, {});
  // float32 sums of exact fp8 products, then two scale multiplications: a
  // few float32 roundings of the largest output, far below fp8's 2^-4.
  const double tol = 1e-5;
  EXPECT_LT(rel_err(y, want.y), tol);
  EXPECT_LT(rel_err(dx, want.dx), tol);
  EXPECT_LT(rel_err(dw, want.dw), tol);
  // Each step leaves its mark far above that tolerance.
  const Steps skips[] = {
      {false, true, true, true}, {true, false, true, true}, {true, true, false, true}, {true, true, true, false}};
  const char* names[] = {"x's e4m3", "W's e4m3", "the gradient's scale shift", "the gradient's e5m2"};
  for (int s = 0; s < 4; ++s) {
    const LinearRef other = linear_ref(x, w, dy, M, N, K, skips[s]);
    const double moved = std::max({rel_err(y, other.y), rel_err(dx, other.dx), rel_err(dw, other.dw)});
    EXPECT_GT(moved, 100 * tol) << "skipping " << names[s] << " would go unseen";
  }
}

// Under bf16 arithmetic the fp8 values pass through gemm's bf16 path
// unchanged (they are bf16 values already), so the products are the same
// sums; only the quantization's bf16 roundings differ.
TEST(Fp8Quant, Bf16ArithmeticQuantizesInBf16) {
  const int64_t M = 64, N = 48, K = 96;
  const auto x = test::randn(M * K, 21), w = test::randn(N * K, 22, 0.1f);
  std::vector<float> y(M * N);
  {
    const ops::ScopedQuantization fp8(ops::Quantization::kFp8Full);
    const ops::ScopedGemmDtype bf16(ops::GemmDtype::kBf16);
    ops::linear_forward(y.data(), x.data(), ops::WeightView{w.data(), DType::F32, N, K}, M);
  }
  const RefQuant qx = ref_rows(x, M, K, Fp8Kind::kE4m3, true), qw = ref_rows(w, N, K, Fp8Kind::kE4m3, true);
  std::vector<double> want(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(qx.q[i * K + k]) * qw.q[j * K + k];
      want[i * N + j] = s * qx.scale[i] * qw.scale[j];
    }
  EXPECT_LT(rel_err(y, want), 1e-5);
}

TEST(Fp8Quant, ParsesMaxTextNames) {
  EXPECT_EQ(ops::parse_quantization(""), ops::Quantization::kNone);
  EXPECT_EQ(ops::parse_quantization("fp8_full"), ops::Quantization::kFp8Full);
  EXPECT_THROW(ops::parse_quantization("int8"), Error);
  EXPECT_EQ(ops::quantization(), ops::Quantization::kNone);
}

}  // namespace fp8_quant_test
}  // namespace
}  // namespace ds
