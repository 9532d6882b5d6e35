// MLA decode attention over the latent cache (weight absorption), for the
// queries of one sequence that continue a cache.
//
// The cache holds per token only the normalised latent c_kv [kvl] and the
// rotated shared rope key k_pe [rope]. With kv_b_proj = [W_UK; W_UV] per head
// (rows [nope | v] x kvl), the expanded keys and values are
//   k_h[t] = [c_kv[t] W_UK_h^T | k_pe[t]],  v_h[t] = c_kv[t] W_UV_h^T,
// and attention folds W_UK into the query and W_UV into the output, so the
// T cached tokens are read once for all heads:
//   q_lat = q_nope W_UK_h                        [kvl]
//   s[t]  = scale * (q_lat . c_kv[t] + q_pe . k_pe[t])   for t <= past + j
//   ctx_h = (softmax(s) c_kv) W_UV_h^T          [v]
// Query j (0 <= j < n) sits at position past + j and sees the cached tokens
// 0..past+j (the cache already holds the n new tokens: T = past + n).
//
// Single-threaded: callers run one sequence per task. Results do not depend
// on how sequences are assigned to threads.
#pragma once

#include <cstdint>

namespace ds::ops {

struct LatentAttentionDims {
  int64_t heads = 1, nope = 0, rope = 0, v_dim = 1, kv_lora = 1;
  float scale = 1.0f;
};

// q [n, heads, nope + rope] with row stride ldq (elements between tokens);
// c_kv [T, kv_lora]; k_pe [T, rope]; w_kvb [heads * (nope + v_dim), kv_lora]
// float32; ctx [n, heads, v_dim] with row stride ldc.
void latent_attention_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                              const float* k_pe, const float* w_kvb, int64_t n, int64_t past,
                              const LatentAttentionDims& d);

// DeepSeek-V3.2 sparse attention (DSA) over the latent cache: query j
// attends only to the k cached tokens idx[j * k .. j * k + k) (each < T,
// the rows of c_kv and k_pe), with the same absorbed formulation. Results do
// not depend on the order of a query's indices beyond summation order; the
// indexer hands them in ascending order.
void latent_attention_sparse_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                                     const float* k_pe, const float* w_kvb, int64_t n, const int32_t* idx, int64_t k,
                                     const LatentAttentionDims& d);

// Causal softmax in place of score rows S [rows, T] (row stride T): row r is
// query r % n at position past + r % n and sees keys 0..past + r % n; the
// rest of the row becomes 0. Shared by the latent and the naive cache paths.
void causal_softmax_rows(float* S, int64_t rows, int64_t n, int64_t past, int64_t T);

}  // namespace ds::ops
