// DeepSeek-V4.1's Engram, as DeepSeek's inference code runs it (no
// convolution, no input norm, no biases), for generation:
//
//   e     = the rows looked up, concatenated (C columns of De): the table is
//           e4m3 with one e8m0 scale per 32 columns of a row; an id outside
//           the table reads a zero row
//   kv    = wkv e                          [(n + 1) d]: n keys, then the value
//   s_g   = <x_g, w_g * key_g> / sqrt(d) * rsqrt(mean(x_g^2) + eps) * rsqrt(mean(key_g^2) + eps)
//           with w = q_weight * k_weight (folded), per stream g of the n
//   alpha = sigmoid(copysign(sqrt(max(|s_g|, 1e-6)), s_g))   (+0 gives sigmoid(1e-3));
//           0 at an image position
//   x_g  += alpha_g v                      (one value for every stream)
//
// The hash ids are model/engram_hash.h's int64 scheme with kEngramDead for
// image positions. DeepSeek-V4.1's model (model/v4_model.h) runs it before
// each layer of its config's engram_layers.
#pragma once

#include <cstdint>

#include "ops/linear.h"

namespace ds::model {

// An fp8 Engram table: codes [rows, cols] e4m3, scales [rows, ceil(cols / 32)] e8m0.
struct V41EngramTable {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, cols = 0;
};

// e [T, C cols] from ids [T, C].
void v41_engram_gather(float* e, const int32_t* ids, int64_t T, int64_t C, const V41EngramTable& table);
// The same from a loaded table: fp8 (the view's scale_e8m0 holds the
// scales) or a float dtype.
void v41_engram_gather(float* e, const int32_t* ids, int64_t T, int64_t C, const ops::WeightView& table);

struct V41EngramDims {
  int64_t tokens = 0;
  int64_t streams = 4;  // n (hc_mult)
  int64_t dim = 0;      // d
  float eps = 1e-20f;   // rms_norm_eps
};

// x [T, n, d] += alpha v from e [T, wkv.cols] through wkv [(n + 1) d, C De]
// and the folded weights w_qk [n, d]; `image` (null: none) marks positions
// whose gate is 0. alpha [T, n] is written when not null.
// With kv_out [T, (n + 1) d], also the projection wkv e (training keeps it).
void v41_engram_forward(float* x, const float* e, const ops::WeightView& wkv, const float* w_qk, const V41EngramDims& d,
                        const uint8_t* image = nullptr, float* alpha = nullptr, float* kv_out = nullptr);

// The backward of x += alpha v given dout [T, n, d] (the updated streams'
// gradient), the streams x before the update and kv [T, (n + 1) d]:
// dx [T, n, d] `+=` the gate's path (the direct path, dout itself, is the
// caller's; dx may alias dout), dkv [T, (n + 1) d] `=` (the caller takes
// wkv's and the table rows' gradients from it), dw_qk [n, d] `+=` (the
// folded weights': q_weight's is dw_qk * k_weight, k_weight's dw_qk *
// q_weight). Where |s| <= 1e-6 the gate is constant (its square root is
// floored), as are image positions'.
void v41_engram_backward(float* dx, float* dkv, float* dw_qk, const float* dout, const float* x, const float* kv,
                         const float* w_qk, const V41EngramDims& d, const uint8_t* image = nullptr);

}  // namespace ds::model
