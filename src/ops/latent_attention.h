// MLA attention over the latent cache (weight absorption), for queries that
// continue a cache: decode steps, and prefill chunks too short to be worth
// expanding the cache.
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
// Every head of a sequence is one query row of a multi-query attention over
// the cache's tokens (key [c_kv | k_pe], value c_kv), computed on the
// attention's register tiles (ops/cpu/attention_tiles.h) with an online
// softmax; a decode step's long cache is split into chunks of keys whose
// partial results are merged in order. The absorptions are products over all
// the call's rows at once, so a batch of sequences reads the absorbed
// weights once per step. Threaded over heads, sequences, query rows and key
// chunks; every result is the same bits for any thread count and whichever
// other sequences share the call.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/linear.h"

namespace ds::ops {

struct LatentAttentionDims {
  int64_t heads = 1, nope = 0, rope = 0, v_dim = 1, kv_lora = 1;
  float scale = 1.0f;
  // kv_b_proj itself, for a call without `absorbed` (the CPU backend, where
  // reads_kv_b holds): W_UK_h is widened from it a head at a time into the
  // layout absorb_kv_b gives (the same products, the same bits), and
  // ctx_h = lat W_UV_h^T is a linear layer over its rows in their stored
  // dtype, at most 8 rows of lat at a time (ops/linear.h's decode kernels
  // and precision; a row's result does not depend on the other rows). No
  // float32 copy is kept, and a step reads kv_b's own bytes (DeepSeek-V3:
  // 16 MiB of fp8 a layer rather than 64 MiB of float32).
  const WeightView* kv_b = nullptr;
};

// Whether the CPU's latent_attention_forward can read kv_b itself: bf16, a
// block format (q8_0, q4_k, ...), or block-scaled e4m3 whose heads' W_UV_h
// rows start on scale blocks. Float32 (the absorbed copy is no larger) and
// the rest take the absorbed copy.
bool reads_kv_b(const WeightView& kv_b, const LatentAttentionDims& d);

// The absorbed projections, float32, from kv_b_proj [heads * (nope + v_dim),
// kv_lora] (any dtype): per head W_UK_h [nope, kvlp], then per head W_UV_h^T
// [kv_lora, vp], where kvlp and vp round kv_lora and v_dim up to 16 (zero
// columns). Made once per layer and kept.
std::vector<float> absorb_kv_b(const WeightView& kv_b, const LatentAttentionDims& d);
// The bytes absorb_kv_b's result takes.
size_t absorbed_kv_b_bytes(const LatentAttentionDims& d);

// One sequence's queries for latent_attention_forward.
struct LatentQueries {
  const float* q = nullptr;     // [n, heads, nope + rope], rows ldq apart
  float* ctx = nullptr;         // [n, heads, v_dim], rows ldc apart
  const float* c_kv = nullptr;  // the cache's latents, [tokens, kv_lora]
  const float* k_pe = nullptr;  // the cache's rope keys, [tokens, rope]
  int64_t n = 1;                // new queries
  int64_t past = 0;             // query j sees tokens 0..past + j
  // DeepSeek-V3.2 sparse attention (DSA): with n = 1, the query sees only
  // the past + 1 tokens keys[0..past] (rows of c_kv and k_pe), in that
  // order (the indexer hands them in ascending order). Null: dense.
  const int32_t* keys = nullptr;
};

// ctx of every sequence in seqs[0, count); `absorbed` from absorb_kv_b, or
// null with d.kv_b set (the CPU backend only).
void latent_attention_forward(const LatentQueries* seqs, int64_t count, int64_t ldq, int64_t ldc, const float* absorbed,
                              const LatentAttentionDims& d);

// One sequence: q [n, heads, nope + rope] (row stride ldq), c_kv [T,
// kv_lora], k_pe [T, rope], ctx [n, heads, v_dim] (row stride ldc).
void latent_attention_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                              const float* k_pe, const float* absorbed, int64_t n, int64_t past,
                              const LatentAttentionDims& d);

// DSA over the latent cache for n queries of one sequence: query j attends
// only to the k cached tokens idx[j * k .. j * k + k) (each < T, the rows of
// c_kv and k_pe).
void latent_attention_sparse_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                                     const float* k_pe, const float* absorbed, int64_t n, const int32_t* idx, int64_t k,
                                     const LatentAttentionDims& d);

// Causal softmax in place of score rows S [rows, T] (row stride T): row r is
// query r % n at position past + r % n and sees keys 0..past + r % n; the
// rest of the row becomes 0. Used by the naive cache path.
void causal_softmax_rows(float* S, int64_t rows, int64_t n, int64_t past, int64_t T);

}  // namespace ds::ops
