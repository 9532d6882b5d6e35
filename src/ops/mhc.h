// DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual
// stream is n = hc_mult streams X [T, n, d]. Around each sub-layer (attention,
// MoE), for every token t:
//
//   v = X_t flattened [n d],  s = 1 / sqrt(mean(v^2) + norm_eps)
//   mix = (fn v) s                     fn [(2 + n) n, n d]: n pre, n post, n x n comb
//   pre_j  = sigmoid(mix_j scale_0 + base_j) + eps
//   post_j = 2 sigmoid(mix_{n+j} scale_1 + base_{n+j})
//   comb   = sinkhorn(mix_{2n + j n + k} scale_2 + base_{2n + j n + k})   (row j, column k)
//   a      = sum_j pre_j X_t,j                        (the sub-layer's input)
//   X'_t,k = post_k o_t + sum_j comb[j][k] X_t,j      (mhc_post, o the sub-layer's output)
//
// sinkhorn(M): row softmax plus eps, each column divided by (its sum + eps),
// then iters - 1 times every row divided by (its sum + eps) and every column
// likewise. The final contraction (mhc_head) has n mixes, pre only and no
// Sinkhorn. This is DeepSeek's inference code's arithmetic in float32 (it
// stores the results as bf16; here they stay float32).
//
// Each forward has its backward (the Sinkhorn unrolled), for training.
//
// MhcKind::MaxTextV1 is MaxText's seed-era mHC (the layer wrapper any
// DeepSeek layer can have): pre_j = sigmoid(...) without eps, and its
// Sinkhorn takes each column's softmax, then iters times divides every row
// by max(its sum, 1e-12) and every column likewise (a clipped normaliser
// passes its gradient through unscaled by the sum's own derivative). Its
// learned RMSNorm scale is the caller's: fn's column i times gamma_i.
#pragma once

#include <cstdint>

namespace ds::ops {

enum class MhcKind {
  DeepSeekV4,  // DeepSeek's inference code (and MaxText's head): eps in pre and in every Sinkhorn step
  MaxTextV1,   // MaxText's seed-era mHC: no eps in pre, clipped Sinkhorn sums
};

struct MhcDims {
  int64_t tokens = 0;
  int64_t streams = 0;  // n (hc_mult)
  int64_t dim = 0;      // d (hidden size)
  int64_t sinkhorn_iters = 20;
  float eps = 1e-6f;       // hc_eps
  float norm_eps = 1e-6f;  // rms_norm_eps
  MhcKind kind = MhcKind::DeepSeekV4;
  int64_t mixes() const { return (2 + streams) * streams; }
  // The eps added to pre_j.
  float pre_eps() const { return kind == MhcKind::DeepSeekV4 ? eps : 0.0f; }
  // Row and column normalizations after the softmax.
  int64_t sinkhorn_steps() const { return kind == MhcKind::DeepSeekV4 ? 2 * sinkhorn_iters - 1 : 2 * sinkhorn_iters; }
};

// mhc_pre: a [T, d], post [T, n], comb [T, n, n] from x [T, n, d] and the
// layer's fn [(2 + n) n, n d], base [(2 + n) n], scale [3].
// With pre_out [T, n], also the pre weights; a may then be null (DeepSeek-V4.1's
// lagged mHC collapses the streams with the previous sub-layer's pre).
void mhc_pre_forward(float* a, float* post, float* comb, const float* x, const float* fn, const float* base,
                     const float* scale, const MhcDims& dims, float* pre_out = nullptr);

// a [T, D] = sum_j w[t, j] x[t, j] for the streams x [T, n, D] and weights w [T, n].
void mhc_collapse(float* a, const float* x, const float* w, int64_t T, int64_t n, int64_t D);

// Gradients of mhc_pre given da [T, d], dpost [T, n], dcomb [T, n, n]:
// dx [T, n, d] is accumulated into (+=), as are dfn, dbase and dscale. Any of
// dfn, dbase, dscale may be null. Recomputes the forward's intermediates.
// dpre_in [T, n] (or null) is a gradient of the pre weights from elsewhere
// (V4.1: the next sub-layer's collapse); da may then be null (this
// sub-layer's input was not collapsed with its own pre).
void mhc_pre_backward(float* dx, float* dfn, float* dbase, float* dscale, const float* da, const float* dpost,
                      const float* dcomb, const float* x, const float* fn, const float* base, const float* scale,
                      const MhcDims& dims, const float* dpre_in = nullptr);

// mhc_collapse's backward given da [T, D]: dx += w da, dw [T, n] `=` x . da.
void mhc_collapse_backward(float* dx, float* dw, const float* da, const float* x, const float* w, int64_t T, int64_t n,
                           int64_t D);

// mhc_post: x_out [T, n, d] = post_k o + sum_j comb[j][k] x_j. x_out must not
// alias x.
void mhc_post_forward(float* x_out, const float* o, const float* x, const float* post, const float* comb,
                      const MhcDims& dims);

// Gradients of mhc_post given dx_out: do [T, d], dx [T, n, d], dpost [T, n],
// dcomb [T, n, n], each accumulated into (+=).
void mhc_post_backward(float* d_o, float* dx, float* dpost, float* dcomb, const float* dx_out, const float* o,
                       const float* x, const float* post, const float* comb, const MhcDims& dims);

// mhc_head: y [T, d] = sum_j (sigmoid(mix_j scale_0 + base_j) + eps) x_j with
// mix = (fn v) s, fn [n, n d], base [n], scale [1].
void mhc_head_forward(float* y, const float* x, const float* fn, const float* base, const float* scale,
                      const MhcDims& dims);
// Its gradients given dy [T, d]: dx (+=), and dfn, dbase, dscale (+=, each may
// be null).
void mhc_head_backward(float* dx, float* dfn, float* dbase, float* dscale, const float* dy, const float* x,
                       const float* fn, const float* base, const float* scale, const MhcDims& dims);

}  // namespace ds::ops
