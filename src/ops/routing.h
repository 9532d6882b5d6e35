// Top-k selection and the sort-by-expert permutation (route / unroute).
//
// top-k: per row, the k largest values in descending order; ties go to the
// lower index (as jax.lax.top_k and torch.topk on CPU do for equal values).
//
// Routing: a token t choosing experts e[t*k + j] (j < k) gives n = T*k
// assignments. route_indices sorts them by expert with a stable order (ties
// keep assignment order), so expert g's rows are contiguous:
//   order[r]    = the assignment id (t*k + j) at sorted row r
//   inverse[a]  = the sorted row of assignment a (inverse permutation)
//   group_sizes[g] = number of assignments to expert g
// route:   out[r] = x[order[r] / k]             (gather; backward: dx[t] = sum_j dout[inverse[t*k+j]], `=`)
// unroute: out[a] = y[inverse[a]]               (back to assignment order, [T*k, D];
//                                                backward: dy[r] = dout[order[r]], `=`)
#pragma once

#include <cstdint>

namespace ds::ops {

void topk(int32_t* indices, float* values, const float* x, int64_t rows, int64_t cols, int64_t k);

// experts [n] with values in [0, num_experts); throws on an out-of-range id.
void route_indices(int32_t* order, int32_t* inverse, int32_t* group_sizes, const int32_t* experts, int64_t n,
                   int64_t num_experts);

// x [tokens, dim] -> out [tokens * k, dim] in sorted order.
void route_forward(float* out, const float* x, const int32_t* order, int64_t tokens, int64_t k, int64_t dim);
void route_backward(float* dx, const float* dout, const int32_t* inverse, int64_t tokens, int64_t k, int64_t dim);

// y [n, dim] sorted -> out [n, dim] in assignment order.
void unroute_forward(float* out, const float* y, const int32_t* inverse, int64_t n, int64_t dim);
void unroute_backward(float* dy, const float* dout, const int32_t* order, int64_t n, int64_t dim);

}  // namespace ds::ops
