// Scalar reference for ops/sparse_attention.h: each query's keys as indices
// into one key matrix, the softmax with its sink written out.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/sparse_attention.h"

namespace ds::ref {

// keys [n, dim]; lists[i] the key indices of query i; sink empty: none.
template <typename T>
std::vector<T> sparse_mqa(const std::vector<T>& q, const std::vector<T>& keys,
                          const std::vector<std::vector<int64_t>>& lists, const std::vector<T>& sink,
                          const ops::SparseMqaDims& d) {
  const int64_t H = d.heads, D = d.dim;
  std::vector<T> out(d.queries * H * D, T(0));
  for (int64_t i = 0; i < d.queries; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const T* qv = &q[(i * H + h) * D];
      std::vector<T> s;
      for (int64_t j : lists[i]) {
        T dot = 0;
        for (int64_t c = 0; c < D; ++c) dot += qv[c] * keys[j * D + c];
        s.push_back(T(d.scale) * dot);
      }
      T mx = sink.empty() ? T(-INFINITY) : sink[h];
      for (T v : s) mx = v > mx ? v : mx;
      T sum = sink.empty() ? T(0) : std::exp(sink[h] - mx);
      for (T v : s) sum += std::exp(v - mx);
      for (size_t k = 0; k < s.size(); ++k)
        for (int64_t c = 0; c < D; ++c)
          out[(i * H + h) * D + c] += std::exp(s[k] - mx) / sum * keys[lists[i][k] * D + c];
    }
  return out;
}

}  // namespace ds::ref
