// Scalar reference for ops/routing.h, written from the definitions with
// library sorts (no counting sort, no insertion buffer).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace ds::ref {

// Per row, the indices of the k largest values, descending; a stable sort on
// "greater" keeps equal values in index order, so ties go to the lower index.
template <typename T>
std::vector<int32_t> topk(const std::vector<T>& x, int64_t rows, int64_t cols, int64_t k) {
  std::vector<int32_t> out(rows * k), idx(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const T* v = x.data() + r * cols;
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [v](int32_t a, int32_t b) { return v[a] > v[b]; });
    std::copy(idx.begin(), idx.begin() + k, out.begin() + r * k);
  }
  return out;
}

struct Routing {
  std::vector<int32_t> order, inverse, group_sizes;
};

// Assignment ids stably sorted by expert; inverse and group sizes from that.
inline Routing route_indices(const std::vector<int32_t>& experts, int64_t num_experts) {
  const int64_t n = experts.size();
  Routing r{std::vector<int32_t>(n), std::vector<int32_t>(n), std::vector<int32_t>(num_experts, 0)};
  std::iota(r.order.begin(), r.order.end(), 0);
  std::stable_sort(r.order.begin(), r.order.end(), [&](int32_t a, int32_t b) { return experts[a] < experts[b]; });
  for (int64_t i = 0; i < n; ++i) r.inverse[r.order[i]] = static_cast<int32_t>(i);
  for (int32_t e : experts) ++r.group_sizes[e];
  return r;
}

// out [tokens * k, dim]: out[r] = x[order[r] / k].
template <typename T>
std::vector<T> route(const std::vector<T>& x, const std::vector<int32_t>& order, int64_t k, int64_t dim) {
  std::vector<T> out(order.size() * dim);
  for (size_t r = 0; r < order.size(); ++r)
    for (int64_t c = 0; c < dim; ++c) out[r * dim + c] = x[order[r] / k * dim + c];
  return out;
}

// Each x[t] is copied to k sorted rows, so its gradient is the sum of theirs:
// dx[t] = sum_r [order[r] / k == t] dout[r], written here as a scatter over r.
template <typename T>
std::vector<T> route_backward(const std::vector<T>& dout, const std::vector<int32_t>& order, int64_t tokens, int64_t k,
                              int64_t dim) {
  std::vector<T> dx(tokens * dim, T(0));
  for (size_t r = 0; r < order.size(); ++r)
    for (int64_t c = 0; c < dim; ++c) dx[order[r] / k * dim + c] += dout[r * dim + c];
  return dx;
}

// out [n, dim]: out[a] = y[inverse[a]].
template <typename T>
std::vector<T> unroute(const std::vector<T>& y, const std::vector<int32_t>& inverse, int64_t dim) {
  std::vector<T> out(inverse.size() * dim);
  for (size_t a = 0; a < inverse.size(); ++a)
    for (int64_t c = 0; c < dim; ++c) out[a * dim + c] = y[inverse[a] * dim + c];
  return out;
}

// A permutation's gradient is the inverse permutation: dy[inverse[a]] = dout[a].
template <typename T>
std::vector<T> unroute_backward(const std::vector<T>& dout, const std::vector<int32_t>& inverse, int64_t dim) {
  std::vector<T> dy(inverse.size() * dim);
  for (size_t a = 0; a < inverse.size(); ++a)
    for (int64_t c = 0; c < dim; ++c) dy[inverse[a] * dim + c] = dout[a * dim + c];
  return dy;
}

}  // namespace ds::ref
