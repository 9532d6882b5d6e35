// DeepSeek-V4's attention core: multi-query attention in which every query
// has its own list of keys and the values are the keys themselves (one K=V
// latent shared by all heads), with a per-head sink logit.
//
// For query i, head h, and the keys k_j of its list (j = 0 .. n_i - 1):
//   s_j = scale * q[i, h] . k_j
//   lse = log(exp(sink[h]) + sum_j exp(s_j))      (no sink: the sum alone)
//   p_j = exp(s_j - lse),  out[i, h] = sum_j p_j k_j
// The sink enlarges the denominator and has no value. A query's list is
// what it may see (V4: its sliding window and its compressed entries); the
// caller builds it, so causality and sparsity are the list's business.
//
// Backward (D = dout . out per query and head, dp_j = dout . k_j):
//   ds_j = p_j (dp_j - D)
//   dq = scale sum_j ds_j k_j                                   (`=`)
//   dk_j += scale sum_h ds_j q_h + sum_h p_j dout_h             (K and V)
//   dsink[h] += -exp(sink[h] - lse) D
// Keys come as row pointers, so a list can mix keys from several places (a
// cache's window, the new tokens, compressed entries) without copies; their
// gradients go to the rows of a parallel pointer array. The backward adds
// them query by query in order, so results do not depend on the threads.
#pragma once

#include <cstdint>

namespace ds::ops {

struct SparseMqaDims {
  int64_t queries = 0;
  int64_t heads = 1;
  int64_t dim = 1;  // of queries and keys
  float scale = 1.0f;
};

// q, out [queries, heads, dim]; lse [queries, heads]; query i's keys are
// rows[offsets[i]] .. rows[offsets[i + 1] - 1] (dim floats each; a list may
// be empty only with a sink: its output is then zero); sink [heads] or null.
void sparse_mqa_forward(float* out, float* lse, const float* q, const float* const* rows, const int64_t* offsets,
                        const float* sink, const SparseMqaDims& d);

// dq `=`; drows (parallel to rows, or null: no key gradients) and dsink (or
// null) `+=`.
void sparse_mqa_backward(float* dq, float* const* drows, float* dsink, const float* dout, const float* out,
                         const float* lse, const float* q, const float* const* rows, const int64_t* offsets,
                         const float* sink, const SparseMqaDims& d);

}  // namespace ds::ops
