// A plain scalar transcription of MaxText's Engram layer (model/engram.h's
// formula, one position at a time), templated so that the tests run it in
// double: the reference the float32 stage is checked against, and the
// function whose central differences check its backward.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace ds::test {

template <typename T>
struct EngramRef {
  int64_t G, D, C, Dh, K, dil;
  double eps;
  std::vector<T> norm, table, key, key_bias, value, value_bias, q_norm, k_norm, conv_norm, conv;
  // key [G D, C Dh] and value [D, C Dh] row-major (out, in); conv [K, G D].

  static std::vector<T> rms(const T* x, const T* w, int64_t n, double eps) {
    T ss = 0;
    for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
    const T r = T(1) / std::sqrt(ss / T(n) + T(eps));
    std::vector<T> y(n);
    for (int64_t j = 0; j < n; ++j) y[j] = x[j] * r * w[j];
    return y;
  }

  // x [S, G, D] of one sequence -> x + o; ids [S, C] table rows.
  std::vector<T> forward(const std::vector<T>& x, const std::vector<int32_t>& ids, int64_t S) const {
    const int64_t W = G * D;
    std::vector<T> u(S * W), n(S * W), out = x;
    for (int64_t t = 0; t < S; ++t) {
      std::vector<T> e;
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < Dh; ++j) e.push_back(table[ids[t * C + c] * Dh + j]);
      std::vector<T> v(D);
      for (int64_t j = 0; j < D; ++j) {
        T s = value_bias[j];
        for (int64_t i = 0; i < C * Dh; ++i) s += value[j * C * Dh + i] * e[i];
        v[j] = s;
      }
      for (int64_t g = 0; g < G; ++g) {
        std::vector<T> kap(D);
        for (int64_t j = 0; j < D; ++j) {
          T s = key_bias[g * D + j];
          for (int64_t i = 0; i < C * Dh; ++i) s += key[(g * D + j) * C * Dh + i] * e[i];
          kap[j] = s;
        }
        const auto kh = rms(kap.data(), &k_norm[g * D], D, eps);
        const auto xh = rms(&x[(t * G + g) * D], norm.data(), D, eps);
        const auto qh = rms(xh.data(), &q_norm[g * D], D, eps);
        T a = 0;
        for (int64_t j = 0; j < D; ++j) a += qh[j] * kh[j];
        a /= std::sqrt(T(D));
        const T sgn = a > 0 ? T(1) : a < 0 ? T(-1) : T(0);
        const T m = std::fabs(a) > T(1e-6) ? std::fabs(a) : T(1e-6);
        const T alpha = T(1) / (T(1) + std::exp(-sgn * std::sqrt(m)));
        for (int64_t j = 0; j < D; ++j) u[(t * G + g) * D + j] = alpha * v[j];
        const auto nn = rms(&u[(t * G + g) * D], &conv_norm[g * D], D, eps);
        for (int64_t j = 0; j < D; ++j) n[(t * G + g) * D + j] = nn[j];
      }
    }
    for (int64_t t = 0; t < S; ++t)
      for (int64_t ch = 0; ch < W; ++ch) {
        T y = 0;
        for (int64_t r = 0; r < K; ++r) {
          const int64_t src = t - (K - 1 - r) * dil;
          if (src >= 0) y += conv[r * W + ch] * n[src * W + ch];
        }
        out[t * W + ch] += u[t * W + ch] + y / (T(1) + std::exp(-y));
      }
    return out;
  }
};

}  // namespace ds::test
