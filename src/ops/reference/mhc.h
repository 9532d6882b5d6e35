// Scalar reference for ops/mhc.h, straight from the formulas there, in any
// floating type (the tests use double).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace ds::ref {

template <typename T>
T mhc_sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

// mix [tokens, m] = (x_t . fn_i) / sqrt(mean(x_t^2) + norm_eps), x [tokens, nd], fn [m, nd].
template <typename T>
std::vector<T> mhc_mixes(const std::vector<T>& x, const std::vector<T>& fn, int64_t tokens, int64_t nd, int64_t m,
                         double norm_eps) {
  std::vector<T> mix(tokens * m);
  for (int64_t t = 0; t < tokens; ++t) {
    T ss = 0;
    for (int64_t i = 0; i < nd; ++i) ss += x[t * nd + i] * x[t * nd + i];
    const T s = T(1) / std::sqrt(ss / T(nd) + T(norm_eps));
    for (int64_t r = 0; r < m; ++r) {
      T dot = 0;
      for (int64_t i = 0; i < nd; ++i) dot += fn[r * nd + i] * x[t * nd + i];
      mix[t * m + r] = dot * s;
    }
  }
  return mix;
}

// DeepSeek-V4: row softmax + eps, then columns, then iters - 1 times rows
// and columns, each divided by (sum + eps). MaxText v1 (`v1`): column
// softmax, then iters times rows and columns, each divided by max(sum, 1e-12).
template <typename T>
void mhc_sinkhorn(T* M, int64_t n, int64_t iters, double eps, bool v1 = false) {
  for (int64_t j = 0; j < n; ++j) {
    auto at = [&](int64_t k) -> T& { return v1 ? M[k * n + j] : M[j * n + k]; };
    T mx = at(0);
    for (int64_t k = 1; k < n; ++k) mx = std::max(mx, at(k));
    T sum = 0;
    for (int64_t k = 0; k < n; ++k) sum += std::exp(at(k) - mx);
    for (int64_t k = 0; k < n; ++k) at(k) = std::exp(at(k) - mx) / sum + T(v1 ? 0.0 : eps);
  }
  auto den = [&](T sum) { return v1 ? std::max(sum, T(1e-12)) : sum + T(eps); };
  auto cols = [&] {
    for (int64_t k = 0; k < n; ++k) {
      T sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += M[j * n + k];
      const T q = den(sum);
      for (int64_t j = 0; j < n; ++j) M[j * n + k] /= q;
    }
  };
  auto rows = [&] {
    for (int64_t j = 0; j < n; ++j) {
      T sum = 0;
      for (int64_t k = 0; k < n; ++k) sum += M[j * n + k];
      const T q = den(sum);
      for (int64_t k = 0; k < n; ++k) M[j * n + k] /= q;
    }
  };
  if (v1) {
    for (int64_t i = 0; i < iters; ++i) {
      rows();
      cols();
    }
    return;
  }
  cols();
  for (int64_t i = 1; i < iters; ++i) {
    rows();
    cols();
  }
}

// mhc_pre: a [tokens, d], post [tokens, n], comb [tokens, n, n].
template <typename T>
void mhc_pre(std::vector<T>& a, std::vector<T>& post, std::vector<T>& comb, const std::vector<T>& x,
             const std::vector<T>& fn, const std::vector<T>& base, const std::vector<T>& scale, int64_t tokens,
             int64_t n, int64_t d, int64_t iters, double eps, double norm_eps, bool v1 = false) {
  const int64_t m = (2 + n) * n;
  const auto mix = mhc_mixes(x, fn, tokens, n * d, m, norm_eps);
  a.assign(tokens * d, T(0));
  post.assign(tokens * n, T(0));
  comb.assign(tokens * n * n, T(0));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* z = mix.data() + t * m;
    for (int64_t j = 0; j < n; ++j) {
      const T pre = mhc_sigmoid(z[j] * scale[0] + base[j]) + T(v1 ? 0.0 : eps);
      post[t * n + j] = T(2) * mhc_sigmoid(z[n + j] * scale[1] + base[n + j]);
      for (int64_t i = 0; i < d; ++i) a[t * d + i] += pre * x[(t * n + j) * d + i];
    }
    for (int64_t i = 0; i < n * n; ++i) comb[t * n * n + i] = z[2 * n + i] * scale[2] + base[2 * n + i];
    mhc_sinkhorn(comb.data() + t * n * n, n, iters, eps, v1);
  }
}

// mhc_post: x_out [tokens, n, d] = post_k o + sum_j comb[j][k] x_j.
template <typename T>
std::vector<T> mhc_post(const std::vector<T>& o, const std::vector<T>& x, const std::vector<T>& post,
                        const std::vector<T>& comb, int64_t tokens, int64_t n, int64_t d) {
  std::vector<T> y(tokens * n * d);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < n; ++k)
      for (int64_t i = 0; i < d; ++i) {
        T v = post[t * n + k] * o[t * d + i];
        for (int64_t j = 0; j < n; ++j) v += comb[(t * n + j) * n + k] * x[(t * n + j) * d + i];
        y[(t * n + k) * d + i] = v;
      }
  return y;
}

// mhc_head: y [tokens, d] = sum_j (sigmoid(mix_j scale_0 + base_j) + eps) x_j.
template <typename T>
std::vector<T> mhc_head(const std::vector<T>& x, const std::vector<T>& fn, const std::vector<T>& base,
                        const std::vector<T>& scale, int64_t tokens, int64_t n, int64_t d, double eps,
                        double norm_eps) {
  const auto mix = mhc_mixes(x, fn, tokens, n * d, n, norm_eps);
  std::vector<T> y(tokens * d, T(0));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < n; ++j) {
      const T pre = mhc_sigmoid(mix[t * n + j] * scale[0] + base[j]) + T(eps);
      for (int64_t i = 0; i < d; ++i) y[t * d + i] += pre * x[(t * n + j) * d + i];
    }
  return y;
}

}  // namespace ds::ref
