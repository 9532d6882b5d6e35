// Scalar reference for ops/cross_entropy.h: full [N, V] logits, one row at a
// time, no chunking.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/reference/matmul.h"

namespace ds::ref {

// loss [N] = lse - logits[target] (0 where target < 0); lse [N] through `lse` when given.
template <typename T>
std::vector<T> cross_entropy(const std::vector<T>& logits, const std::vector<int32_t>& targets, int64_t N, int64_t V,
                             std::vector<T>* lse = nullptr) {
  std::vector<T> loss(N, T(0));
  if (lse) lse->assign(N, T(0));
  for (int64_t t = 0; t < N; ++t) {
    const T* l = logits.data() + t * V;
    const T m = *std::max_element(l, l + V);
    T s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(l[v] - m);
    const T z = m + std::log(s);
    if (lse) (*lse)[t] = z;
    if (targets[t] >= 0) loss[t] = z - l[targets[t]];
  }
  return loss;
}

// d loss[t] / d logits[t, v] = softmax[t, v] - [v == target[t]], times dloss[t];
// rows with a negative target get no gradient.
template <typename T>
std::vector<T> cross_entropy_backward(const std::vector<T>& dloss, const std::vector<T>& logits,
                                      const std::vector<int32_t>& targets, int64_t N, int64_t V) {
  std::vector<T> lse;
  cross_entropy(logits, targets, N, V, &lse);
  std::vector<T> d(N * V, T(0));
  for (int64_t t = 0; t < N; ++t) {
    if (targets[t] < 0) continue;
    for (int64_t v = 0; v < V; ++v)
      d[t * V + v] = (std::exp(logits[t * V + v] - lse[t]) - (v == targets[t] ? T(1) : T(0))) * dloss[t];
  }
  return d;
}

// The LM head's loss: logits = h [N, D] W^T, W [V, D].
template <typename T>
std::vector<T> lm_head_cross_entropy(const std::vector<T>& h, const std::vector<T>& w,
                                     const std::vector<int32_t>& targets, int64_t N, int64_t D, int64_t V,
                                     std::vector<T>* lse = nullptr) {
  return cross_entropy(matmul(h, w, N, V, D, false, true), targets, N, V, lse);
}

// dh = dlogits W (overwritten, resized), dw += dlogits^T h (resized and zeroed
// only when empty), through the reference matmul's own chain rule.
template <typename T>
void lm_head_cross_entropy_backward(std::vector<T>& dh, std::vector<T>& dw, const std::vector<T>& dloss,
                                    const std::vector<T>& h, const std::vector<T>& w,
                                    const std::vector<int32_t>& targets, int64_t N, int64_t D, int64_t V) {
  const auto logits = matmul(h, w, N, V, D, false, true);
  matmul_backward(dh, dw, cross_entropy_backward(dloss, logits, targets, N, V), h, w, N, V, D, false, true);
}

}  // namespace ds::ref
