// Scalar reference for ops/rmsnorm.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace ds::ref {

// y [rows, dim] = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row;
// rstd [rows] is returned through `rstd` when given.
template <typename T>
std::vector<T> rmsnorm(const std::vector<T>& x, const std::vector<T>& w, int64_t rows, int64_t dim, double eps,
                       std::vector<T>* rstd = nullptr) {
  std::vector<T> y(rows * dim);
  if (rstd) rstd->assign(rows, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    T ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += x[r * dim + j] * x[r * dim + j];
    const T rs = T(1) / std::sqrt(ss / T(dim) + T(eps));
    if (rstd) (*rstd)[r] = rs;
    for (int64_t j = 0; j < dim; ++j) y[r * dim + j] = x[r * dim + j] * rs * w[j];
  }
  return y;
}

// Gradients from the chain rule, element by element. With r = rstd and
// dr/dx_k = -r^3 x_k / dim:
//   dL/dx_k = dy_k w_k r + sum_j dy_j w_j x_j dr/dx_k,  dL/dw_j = sum_rows dy_j x_j r.
// dx is overwritten (resized); dw is accumulated into (resized and zeroed only when empty).
template <typename T>
void rmsnorm_backward(std::vector<T>& dx, std::vector<T>& dw, const std::vector<T>& dy, const std::vector<T>& x,
                      const std::vector<T>& w, int64_t rows, int64_t dim, double eps) {
  dx.assign(rows * dim, T(0));
  if (dw.empty()) dw.assign(dim, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x.data() + r * dim;
    const T* dyr = dy.data() + r * dim;
    T ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += xr[j] * xr[j];
    const T rs = T(1) / std::sqrt(ss / T(dim) + T(eps));
    T dot = 0;  // dL/dr = sum_j dy_j x_j w_j, since y_j = x_j r w_j
    for (int64_t j = 0; j < dim; ++j) dot += dyr[j] * w[j] * xr[j];
    for (int64_t k = 0; k < dim; ++k) {
      const T dr_dxk = -rs * rs * rs * xr[k] / T(dim);
      dx[r * dim + k] = dyr[k] * w[k] * rs + dot * dr_dxk;
    }
    for (int64_t j = 0; j < dim; ++j) dw[j] += dyr[j] * xr[j] * rs;
  }
}

}  // namespace ds::ref
