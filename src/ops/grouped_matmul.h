// Grouped (ragged) matrix product, like jax.lax.ragged_dot: the M rows of lhs
// are split into consecutive groups of group_sizes[g] rows, and group g is
// multiplied by its own rhs[g]. This is how routed tokens, sorted by expert,
// meet their expert weights.
//
//   out[r, :] = lhs[r, :] @ rhs[g(r)]          lhs [M, K], rhs [G, K, N] (or, when
//                                              trans_rhs, [G, N, K]), out [M, N]
//   dlhs[r, :] = dout[r, :] @ rhs[g(r)]^T      (activation gradient: `=`)
//   drhs[g] += lhs[rows of g]^T @ dout[rows of g]   (weight gradient: `+=`)
//
// Empty groups are allowed (their drhs is left untouched). sum(group_sizes)
// may be less than M: the remaining rows belong to no group, their out and
// dlhs rows are zero.
#pragma once

#include <cstdint>

namespace ds::ops {

void grouped_matmul_forward(float* out, const float* lhs, const float* rhs, const int32_t* group_sizes, int64_t G,
                            int64_t M, int64_t K, int64_t N, bool trans_rhs = false);
// dlhs and drhs may each be null to skip that product.
void grouped_matmul_backward(float* dlhs, float* drhs, const float* dout, const float* lhs, const float* rhs,
                             const int32_t* group_sizes, int64_t G, int64_t M, int64_t K, int64_t N,
                             bool trans_rhs = false);

}  // namespace ds::ops
