// Scalar reference for ops/activations.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace ds::ref {

// 1 / (1 + exp(-x)), evaluated on the side where exp cannot overflow.
template <typename T>
T sigmoid(T x) {
  if (x >= 0) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

template <typename T>
std::vector<T> sigmoid(const std::vector<T>& x) {
  std::vector<T> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = sigmoid(x[i]);
  return y;
}

// dy/dx = exp(-x) / (1 + exp(-x))^2 = y (1 - y).
template <typename T>
std::vector<T> sigmoid_backward(const std::vector<T>& dy, const std::vector<T>& y) {
  std::vector<T> dx(y.size());
  for (size_t i = 0; i < y.size(); ++i) dx[i] = dy[i] * y[i] * (T(1) - y[i]);
  return dx;
}

// out = a sigmoid(a) b; with limit > 0, a -> min(a, limit) and b -> clamp(b, -limit, limit) first.
template <typename T>
std::vector<T> silu_mul(const std::vector<T>& a, const std::vector<T>& b, double limit = 0) {
  std::vector<T> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const T x = limit > 0 ? std::min(a[i], T(limit)) : a[i];
    const T y = limit > 0 ? std::clamp(b[i], T(-limit), T(limit)) : b[i];
    out[i] = x * sigmoid(x) * y;
  }
  return out;
}

// d(a s(a))/da = s + a s (1 - s) by the product rule with s' = s (1 - s);
// d out / db = a s(a).
template <typename T>
void silu_mul_backward(std::vector<T>& da, std::vector<T>& db, const std::vector<T>& dout, const std::vector<T>& a,
                       const std::vector<T>& b) {
  da.assign(a.size(), T(0));
  db.assign(a.size(), T(0));
  for (size_t i = 0; i < a.size(); ++i) {
    const T s = sigmoid(a[i]);
    da[i] = dout[i] * b[i] * (s + a[i] * s * (T(1) - s));
    db[i] = dout[i] * a[i] * s;
  }
}

// Row-wise softmax of [rows, cols], shifted by the row maximum.
template <typename T>
std::vector<T> softmax(const std::vector<T>& x, int64_t rows, int64_t cols) {
  std::vector<T> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, x[r * cols + j]);
    T s = 0;
    for (int64_t j = 0; j < cols; ++j) s += std::exp(x[r * cols + j] - m);
    for (int64_t j = 0; j < cols; ++j) y[r * cols + j] = std::exp(x[r * cols + j] - m) / s;
  }
  return y;
}

// The Jacobian dy_j/dx_k = y_j (delta_jk - y_k), applied transposed to dy:
// dx_k = sum_j dy_j y_j (delta_jk - y_k).
template <typename T>
std::vector<T> softmax_backward(const std::vector<T>& dy, const std::vector<T>& y, int64_t rows, int64_t cols) {
  std::vector<T> dx(y.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) {
      T s = 0;
      for (int64_t j = 0; j < cols; ++j)
        s += dy[r * cols + j] * y[r * cols + j] * ((j == k ? T(1) : T(0)) - y[r * cols + k]);
      dx[r * cols + k] = s;
    }
  return dx;
}

}  // namespace ds::ref
