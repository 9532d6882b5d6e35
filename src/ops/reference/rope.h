// Scalar reference for ops/rope.h (compact [tokens, heads, dim] layout).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/rope.h"

namespace ds::ref {

// Indices (a, b) of rotary pair i in one head of the given layout.
inline void rope_pair(int64_t i, int64_t dim, ops::RopeLayout layout, int64_t& a, int64_t& b) {
  if (layout == ops::RopeLayout::Interleaved) {
    a = 2 * i;
    b = 2 * i + 1;
  } else {
    a = i;
    b = i + dim / 2;
  }
}

// y = R x per pair, R = [[cos, -sin], [sin, cos]] of angle float(pos) * freq
// (the angle rounded to float32 as the op specifies, cos/sin taken in T).
template <typename T>
std::vector<T> rope(const std::vector<T>& x, const std::vector<int32_t>& positions, const std::vector<float>& freqs,
                    int64_t tokens, int64_t heads, int64_t dim, ops::RopeLayout layout) {
  std::vector<T> y(x.size());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < dim / 2; ++i) {
        const float angle = static_cast<float>(positions[t]) * freqs[i];
        const T c = std::cos(T(angle)), s = std::sin(T(angle));
        int64_t a, b;
        rope_pair(i, dim, layout, a, b);
        const T* xh = x.data() + (t * heads + h) * dim;
        T* yh = y.data() + (t * heads + h) * dim;
        yh[a] = c * xh[a] - s * xh[b];
        yh[b] = s * xh[a] + c * xh[b];
      }
  return y;
}

// dx = R^T dy per pair, R^T = [[cos, sin], [-sin, cos]]: the output is linear in
// x with matrix R, so its gradient applies the transpose.
template <typename T>
std::vector<T> rope_backward(const std::vector<T>& dy, const std::vector<int32_t>& positions,
                             const std::vector<float>& freqs, int64_t tokens, int64_t heads, int64_t dim,
                             ops::RopeLayout layout) {
  std::vector<T> dx(dy.size());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < dim / 2; ++i) {
        const float angle = static_cast<float>(positions[t]) * freqs[i];
        const T c = std::cos(T(angle)), s = std::sin(T(angle));
        int64_t a, b;
        rope_pair(i, dim, layout, a, b);
        const T* g = dy.data() + (t * heads + h) * dim;
        T* d = dx.data() + (t * heads + h) * dim;
        d[a] = c * g[a] + s * g[b];
        d[b] = -s * g[a] + c * g[b];
      }
  return dx;
}

}  // namespace ds::ref
