// Linear layers over float32 weights under quantization=fp8_full
// (ops/fp8_quant.h): the products run on fp8 values (exact in float32, and
// in bf16, so gemm's bf16 path multiplies them unchanged), each sum then
// scaled by its row's and column's scales.
#include "ops/cpu/linear_fp8.h"

#include "core/buffer.h"
#include "ops/fp8_quant.h"
#include "ops/matmul.h"

namespace ds::ops::detail {

namespace {

bool bf16_arithmetic() { return gemm_dtype() == GemmDtype::kBf16; }

struct Quantized {
  Buffer<float> q, scale;
};

// Rows of a [rows, cols] matrix (leading dimension ld), one scale per row.
Quantized rows_of(const float* x, int64_t rows, int64_t cols, int64_t ld, Fp8Kind kind) {
  Quantized r{Buffer<float>(static_cast<size_t>(rows * cols)), Buffer<float>(static_cast<size_t>(rows))};
  fp8_quantize_rows(r.q.data(), r.scale.data(), x, rows, cols, ld, kind, bf16_arithmetic());
  return r;
}

}  // namespace

void fp8_linear_forward(float* y, const float* x, const float* W, int64_t M, int64_t N, int64_t K, int64_t ldx,
                        int64_t ldy, bool accumulate) {
  const Quantized qx = rows_of(x, M, K, ldx, Fp8Kind::kE4m3), qw = rows_of(W, N, K, K, Fp8Kind::kE4m3);
  Buffer<float> acc(static_cast<size_t>(M * N));
  gemm(false, true, M, N, K, 1.0f, qx.q.data(), K, qw.q.data(), K, 0.0f, acc.data(), N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const float v = acc[i * N + j] * qx.scale[i] * qw.scale[j];
      y[i * ldy + j] = accumulate ? y[i * ldy + j] + v : v;
    }
}

void fp8_linear_backward(float* dx, float* dw, const float* dy, const float* x, const float* W, int64_t M, int64_t N,
                         int64_t K, int64_t ldx, int64_t ldy, bool accumulate_dx) {
  // The forward's residuals, quantized again (the same values: the rule is
  // deterministic).
  const Quantized qw = rows_of(W, N, K, K, Fp8Kind::kE4m3);
  Buffer<float> g(static_cast<size_t>(M * N));
  if (dx) {
    // dx = dy W: dy takes W's per-feature scale, then e5m2 per row.
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) g[i * N + j] = dy[i * ldy + j] * qw.scale[j];
    const Quantized qg = rows_of(g.data(), M, N, N, Fp8Kind::kE5m2);
    Buffer<float> acc(static_cast<size_t>(M * K));
    gemm(false, false, M, K, N, 1.0f, qg.q.data(), N, qw.q.data(), K, 0.0f, acc.data(), K);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const float v = acc[i * K + k] * qg.scale[i];
        dx[i * ldx + k] = accumulate_dx ? dx[i * ldx + k] + v : v;
      }
  }
  if (dw) {
    // dW += dy^T x: dy takes x's per-row scale, then e5m2 per feature.
    const Quantized qx = rows_of(x, M, K, ldx, Fp8Kind::kE4m3);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) g[i * N + j] = dy[i * ldy + j] * qx.scale[i];
    Quantized qg{Buffer<float>(static_cast<size_t>(M * N)), Buffer<float>(static_cast<size_t>(N))};
    fp8_quantize_cols(qg.q.data(), qg.scale.data(), g.data(), M, N, N, Fp8Kind::kE5m2, bf16_arithmetic());
    Buffer<float> acc(static_cast<size_t>(N * K));
    gemm(true, false, N, K, M, 1.0f, qg.q.data(), N, qx.q.data(), K, 0.0f, acc.data(), K);
    for (int64_t j = 0; j < N; ++j)
      for (int64_t k = 0; k < K; ++k) dw[j * K + k] += acc[j * K + k] * qg.scale[j];
  }
}

}  // namespace ds::ops::detail
