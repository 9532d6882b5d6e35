// Engram, DeepSeek's conditional n-gram memory, as MaxText's DeepSeek layer
// runs it (its `engram_layers`): before the attention of such a layer, every
// token looks up one row per hash column of its hashed 2..N-grams
// (model/engram_hash.h) and adds a gated value to each of the G residual
// streams (G = mhc_expansion_rate; 1 without mHC):
//
//   x^_g  = rmsnorm(x_g; engram_layernorm)                per stream g
//   e     = [E[id_0], ..., E[id_{C-1}]]                   C = (N - 1) H rows of D_head
//   k^_g  = rmsnorm(key_proj_g(e) + b_k,g; k_norm_g)      one key per stream
//   q^_g  = rmsnorm(x^_g; q_norm_g)
//   a_g   = <q^_g, k^_g> / sqrt(D),  alpha_g = sigmoid(sign(a_g) sqrt(max(|a_g|, 1e-6)))
//   v     = value_proj(e) + b_v                           one value for all streams
//   u_g   = alpha_g v
//   n_g   = rmsnorm(u_g; conv_norm_g)
//   y     = sum_r w_r * n[t - (K - 1 - r) N]              depthwise causal conv over the
//                                                         sequence (K taps, dilation N)
//   x_g  += u_g + silu(y_g)
//
// The conv starts at zero (so the output is u at initialisation); the look-
// back never crosses the start of a sequence (generation hands the rows
// before a new token in as history). Backward: every weight's gradient, and
// the table's only at the rows looked up (scatter-add, repeats accumulate).
#pragma once

#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "model/config.h"
#include "model/params.h"
#include "ops/linear.h"

namespace ds::model {

struct EngramDims {
  int64_t streams = 1;   // G
  int64_t dim = 0;       // D
  int64_t columns = 0;   // C = (N - 1) H
  int64_t head_dim = 0;  // D_head
  int64_t kernel = 4;    // K
  int64_t dilation = 3;  // N
  float eps = 1e-6f;
  int64_t width() const { return streams * dim; }
  int64_t history() const { return (kernel - 1) * dilation; }  // conv rows before a token
};
EngramDims engram_dims(const ModelConfig& c);

// A run of consecutive rows that is one sequence's: count tokens from row0,
// after `history` conv-input rows [dims.history(), G D] (oldest first; null:
// the sequence starts at row0).
struct EngramSegment {
  int64_t row0 = 0, count = 0;
  const float* history = nullptr;
};

// What a forward computed; a backward reads it (recomputed there, never kept).
struct EngramActs {
  Buffer<float> xn, x_rstd;       // x^ [T, G, D], rstd [T, G]
  Buffer<float> e;                // [T, C D_head]
  Buffer<float> kappa, k_rstd;    // key before its norm [T, G, D], rstd [T, G]
  Buffer<float> q_rstd;           // [T, G]
  Buffer<float> a, alpha;         // [T, G]
  Buffer<float> v;                // [T, D]
  Buffer<float> u, n, n_rstd, y;  // [T, G, D], n's rstd [T, G]
};

// x [T, G, D] += the Engram output, from the rows ids [T, C] of p.table.
// With acts, the intermediates are left there (a backward needs them; n
// holds the conv's input rows, which generation keeps as history).
void engram_forward(float* x, const int32_t* ids, const EngramParams<ops::WeightView>& p, const EngramDims& d,
                    const std::vector<EngramSegment>& segs, int64_t T, EngramActs* acts = nullptr);

// Given dy = dL/d(x out) [T, G, D] and the forward's acts over the same
// rows (its input x_in): dx += the Engram path's share (the caller's dx
// already holds dy's direct share, or is dy itself), weight gradients `+=`
// into g (null leaves: none wanted; the table's only at the rows in ids).
void engram_backward(float* dx, EngramParams<float*>& g, const float* dy, const float* x_in, const int32_t* ids,
                     const EngramActs& acts, const EngramParams<ops::WeightView>& p, const EngramDims& d,
                     const std::vector<EngramSegment>& segs, int64_t T);

}  // namespace ds::model
