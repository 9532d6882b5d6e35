// Scalar reference for ops/grouped_matmul.h: each group is a plain matmul of
// its rows with its own rhs; rows past sum(group_sizes) stay zero.
#pragma once

#include <cstdint>
#include <vector>

namespace ds::ref {

// Index of element (p, j) of group g's logical [K, N] rhs, whichever way it is stored.
inline int64_t grouped_rhs_index(int64_t g, int64_t p, int64_t j, int64_t K, int64_t N, bool trans_rhs) {
  return trans_rhs ? (g * N + j) * K + p : (g * K + p) * N + j;
}

// out [M, N] from lhs [M, K] and rhs [G, K, N] (or [G, N, K] when trans_rhs).
template <typename T>
std::vector<T> grouped_matmul(const std::vector<T>& lhs, const std::vector<T>& rhs,
                              const std::vector<int32_t>& group_sizes, int64_t M, int64_t K, int64_t N,
                              bool trans_rhs = false) {
  std::vector<T> out(M * N, T(0));
  int64_t r = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(group_sizes.size()); ++g)
    for (int64_t end = r + group_sizes[g]; r < end; ++r)
      for (int64_t j = 0; j < N; ++j) {
        T s = 0;
        for (int64_t p = 0; p < K; ++p) s += lhs[r * K + p] * rhs[grouped_rhs_index(g, p, j, K, N, trans_rhs)];
        out[r * N + j] = s;
      }
  return out;
}

// dlhs [M, K] is overwritten (zero on rows of no group); drhs, in rhs's layout,
// is accumulated into (resized and zeroed only when empty).
template <typename T>
void grouped_matmul_backward(std::vector<T>& dlhs, std::vector<T>& drhs, const std::vector<T>& dout,
                             const std::vector<T>& lhs, const std::vector<T>& rhs,
                             const std::vector<int32_t>& group_sizes, int64_t M, int64_t K, int64_t N,
                             bool trans_rhs = false) {
  const int64_t G = static_cast<int64_t>(group_sizes.size());
  dlhs.assign(M * K, T(0));
  if (drhs.empty()) drhs.assign(G * K * N, T(0));
  int64_t r = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t end = r + group_sizes[g]; r < end; ++r)
      for (int64_t p = 0; p < K; ++p) {
        T s = 0;
        for (int64_t j = 0; j < N; ++j) {
          const int64_t idx = grouped_rhs_index(g, p, j, K, N, trans_rhs);
          s += dout[r * N + j] * rhs[idx];
          drhs[idx] += lhs[r * K + p] * dout[r * N + j];
        }
        dlhs[r * K + p] = s;
      }
}

}  // namespace ds::ref
