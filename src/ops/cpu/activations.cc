// Elementwise and row-wise activations (math and gradients: ops/activations.h).
//
// On tensors larger than the caches these are memory-bound once exp is
// vectorized (fast_exp, shared with attention and cross-entropy). The kernels
// are multiversioned (AVX-512, AVX2, baseline); reductions use fixed lanes, so
// results do not depend on the thread count (the AVX-512 clone may contract
// multiply-adds into FMAs, so its last bits can differ from the other clones').
//
// Outputs may alias inputs elementwise (out == a in a gated MLP, y == x for an
// in-place softmax): every element is read before it is written.
#include "ops/activations.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/cpu/fast_exp.h"

namespace ds::ops {
namespace {

// sigmoid(x) and exp(-|x|) computed without overflow: 1 / (1 + e) for x >= 0,
// e / (1 + e) for x < 0, with e = exp(-|x|) <= 1.
inline float sigmoid_stable(float x) {
  const float e = fast_exp(-std::fabs(x));
  return (std::signbit(x) ? e : 1.0f) / (1.0f + e);
}

#define DS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

DS_CLONES void silu_mul_span(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = a[i];
    out[i] = x * sigmoid_stable(x) * b[i];
  }
}

DS_CLONES void silu_mul_grad_span(float* da, float* db, const float* dout, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = a[i], g = dout[i], bi = b[i];
    const float s = sigmoid_stable(x);
    const float gda = g * bi * s * (1.0f + x * (1.0f - s));
    const float gdb = g * (x * s);
    da[i] = gda;
    db[i] = gdb;
  }
}

DS_CLONES void sigmoid_span(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = sigmoid_stable(x[i]);
}

DS_CLONES void sigmoid_grad_span(float* dx, const float* dy, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Float bits mapped to int32 so that integer order is float order (-0 < +0,
// -inf lowest): the compiler vectorizes an integer max reduction but not a
// float one (std::max on floats is not associative in the presence of NaN).
// The map is its own inverse.
inline int32_t float_order(int32_t bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }

// max_j x_j (exact, so the reduction order does not matter).
DS_CLONES float row_max(const float* x, int64_t n) {
  int32_t m = std::numeric_limits<int32_t>::min();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, float_order(std::bit_cast<int32_t>(x[j])));
  return std::bit_cast<float>(float_order(m));
}

// y_j = exp(x_j - m).
DS_CLONES void exp_row(float* y, const float* x, int64_t n, float m) {
  for (int64_t j = 0; j < n; ++j) y[j] = fast_exp(x[j] - m);
}

// sum_j y_j in 16 fixed lanes. Float is enough: the terms are positive, so
// there is no cancellation. (A separate pass over the row, in cache: summing
// inside exp_row, which may write over its input, kept the lanes in memory.)
DS_CLONES float row_sum(const float* y, int64_t n) {
  float lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += y[j + l];
  float s = 0.0f;
  for (; j < n; ++j) s += y[j];
  for (float l : lane) s += l;
  return s;
}

DS_CLONES void scale_row(float* y, int64_t n, float s) {
  for (int64_t j = 0; j < n; ++j) y[j] *= s;
}

// sum_j dy_j y_j in double over 16 lanes: dy has both signs, so the sum can
// cancel, and double costs nothing on a memory-bound row.
DS_CLONES double dot_row(const float* dy, const float* y, int64_t n) {
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += static_cast<double>(dy[j + l]) * y[j + l];
  double s = 0;
  for (; j < n; ++j) s += static_cast<double>(dy[j]) * y[j];
  for (double l : lane) s += l;
  return s;
}

DS_CLONES void softmax_grad_row(float* dx, const float* dy, const float* y, int64_t n, float d) {
  for (int64_t j = 0; j < n; ++j) dx[j] = y[j] * (dy[j] - d);
}

#undef DS_CLONES

// Elementwise work is split into chunks of this many elements; smaller inputs
// stay on the calling thread, where a parallel region would cost more than it saves.
constexpr int64_t kChunk = 16384;

template <typename F>
void for_chunks(int64_t n, F&& f) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_ranges(chunks, chunks > 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) f(c * kChunk, std::min(kChunk, n - c * kChunk));
  });
}

}  // namespace

void silu_mul_forward(float* out, const float* a, const float* b, int64_t n) {
  DS_CHECK(n >= 0, "silu_mul: n={}", n);
  for_chunks(n, [&](int64_t i, int64_t len) { silu_mul_span(out + i, a + i, b + i, len); });
}

void silu_mul_backward(float* da, float* db, const float* dout, const float* a, const float* b, int64_t n) {
  DS_CHECK(n >= 0, "silu_mul_backward: n={}", n);
  for_chunks(n, [&](int64_t i, int64_t len) { silu_mul_grad_span(da + i, db + i, dout + i, a + i, b + i, len); });
}

void sigmoid_forward(float* y, const float* x, int64_t n) {
  DS_CHECK(n >= 0, "sigmoid: n={}", n);
  for_chunks(n, [&](int64_t i, int64_t len) { sigmoid_span(y + i, x + i, len); });
}

void sigmoid_backward(float* dx, const float* dy, const float* y, int64_t n) {
  DS_CHECK(n >= 0, "sigmoid_backward: n={}", n);
  for_chunks(n, [&](int64_t i, int64_t len) { sigmoid_grad_span(dx + i, dy + i, y + i, len); });
}

// A row whose entries are all -inf (fully masked) has no probability mass to
// share; it gives zeros rather than 0/0, and then a zero gradient.
void softmax_forward(float* y, const float* x, int64_t rows, int64_t cols) {
  DS_CHECK(rows >= 0 && cols > 0, "softmax: rows={} cols={}", rows, cols);
#pragma omp parallel for schedule(static) if (rows * cols > kChunk)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;  // [cols]
    float* yr = y + r * cols;
    const float m = row_max(xr, cols);
    exp_row(yr, xr, cols, m == kNegInf ? 0.0f : m);
    const float sum = row_sum(yr, cols);
    scale_row(yr, cols, sum > 0.0f ? 1.0f / sum : 0.0f);
  }
}

void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t cols) {
  DS_CHECK(rows >= 0 && cols > 0, "softmax_backward: rows={} cols={}", rows, cols);
#pragma omp parallel for schedule(static) if (rows * cols > kChunk)
  for (int64_t r = 0; r < rows; ++r) {
    const float d = static_cast<float>(dot_row(dy + r * cols, y + r * cols, cols));
    softmax_grad_row(dx + r * cols, dy + r * cols, y + r * cols, cols, d);
  }
}

}  // namespace ds::ops
