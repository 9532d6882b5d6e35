// Scalar reference for ops/matmul.h.
#pragma once

#include <cstdint>
#include <vector>

namespace ds::ref {

// c[M,N] = op(a) op(b); same layout conventions as ops::matmul_forward.
template <typename T>
std::vector<T> matmul(const std::vector<T>& a, const std::vector<T>& b, int64_t M, int64_t N, int64_t K,
                      bool trans_a = false, bool trans_b = false) {
  std::vector<T> c(M * N, T(0));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      T s = 0;
      for (int64_t p = 0; p < K; ++p) s += (trans_a ? a[p * M + i] : a[i * K + p]) * (trans_b ? b[j * K + p] : b[p * N + j]);
      c[i * N + j] = s;
    }
  return c;
}

}  // namespace ds::ref
