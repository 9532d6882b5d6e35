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
      for (int64_t p = 0; p < K; ++p)
        s += (trans_a ? a[p * M + i] : a[i * K + p]) * (trans_b ? b[j * K + p] : b[p * N + j]);
      c[i * N + j] = s;
    }
  return c;
}

// Gradients of matmul in the stored layouts of a and b, written element by
// element from dc[i,j] = dL/dc[i,j]:
//   dL/dop(A)[i,p] = sum_j dc[i,j] op(B)[p,j],  dL/dop(B)[p,j] = sum_i op(A)[i,p] dc[i,j].
// da is overwritten (resized to a's size); db is accumulated into (resized and
// zeroed only when empty).
template <typename T>
void matmul_backward(std::vector<T>& da, std::vector<T>& db, const std::vector<T>& dc, const std::vector<T>& a,
                     const std::vector<T>& b, int64_t M, int64_t N, int64_t K, bool trans_a = false,
                     bool trans_b = false) {
  da.assign(M * K, T(0));
  if (db.empty()) db.assign(K * N, T(0));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t p = 0; p < K; ++p) {
      T ga = 0;
      const T av = trans_a ? a[p * M + i] : a[i * K + p];
      for (int64_t j = 0; j < N; ++j) {
        const T bv = trans_b ? b[j * K + p] : b[p * N + j];
        ga += dc[i * N + j] * bv;
        (trans_b ? db[j * K + p] : db[p * N + j]) += av * dc[i * N + j];
      }
      (trans_a ? da[p * M + i] : da[i * K + p]) = ga;
    }
}

}  // namespace ds::ref
