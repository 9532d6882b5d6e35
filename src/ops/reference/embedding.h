// Scalar reference for ops/embedding.h.
#pragma once

#include <cstdint>
#include <vector>

namespace ds::ref {

// out [tokens, dim] = table [vocab, dim] rows picked by ids.
template <typename T>
std::vector<T> embedding(const std::vector<int32_t>& ids, const std::vector<T>& table, int64_t dim) {
  std::vector<T> out(ids.size() * dim);
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t j = 0; j < dim; ++j) out[t * dim + j] = table[ids[t] * dim + j];
  return out;
}

// out is linear in table with d out[t, j] / d table[v, j] = [ids[t] == v]:
// dtable[v, j] += sum over tokens t with ids[t] == v of dout[t, j].
template <typename T>
void embedding_backward(std::vector<T>& dtable, const std::vector<T>& dout, const std::vector<int32_t>& ids,
                        int64_t dim) {
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t j = 0; j < dim; ++j) dtable[ids[t] * dim + j] += dout[t * dim + j];
}

}  // namespace ds::ref
