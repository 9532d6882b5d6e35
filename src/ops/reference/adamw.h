// Scalar reference for ops/adamw.h, in the element type T (double in tests),
// written from the formulas with no vector tricks or blocking.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace ds::ref {

struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, eps_root = 0.0, weight_decay = 0.1;
};

// One AdamW step t (1-based) on every element.
template <typename T>
void adamw_update(std::vector<T>& p, std::vector<T>& m, std::vector<T>& v, const std::vector<T>& g, const AdamW& c,
                  int64_t step) {
  const T bc1 = T(1) - std::pow(T(c.beta1), T(step)), bc2 = T(1) - std::pow(T(c.beta2), T(step));
  for (size_t i = 0; i < p.size(); ++i) {
    m[i] = T(c.beta1) * m[i] + (T(1) - T(c.beta1)) * g[i];
    v[i] = T(c.beta2) * v[i] + (T(1) - T(c.beta2)) * g[i] * g[i];
    const T mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= T(c.lr) * (mhat / (std::sqrt(vhat + T(c.eps_root)) + T(c.eps)) + T(c.weight_decay) * p[i]);
  }
}

// sqrt of the sum of squares of all elements of all tensors, in order.
template <typename T>
T global_grad_norm(const std::vector<std::vector<T>>& grads) {
  T s = 0;
  for (const auto& g : grads)
    for (T x : g) s += x * x;
  return std::sqrt(s);
}

}  // namespace ds::ref
