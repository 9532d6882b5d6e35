// MaxText's mHC as a wrapper around a sub-layer of a DeepSeek-V2/V3 layer
// (mhc_expansion_rate k > 1; the math and the Sinkhorn are ops/mhc.h's
// MhcKind::MaxTextV1). For each token, with the k streams x [k, d]:
//
//   a = mhc_pre(x)  = sum_i p_i x_i              (the branch input, then its norm)
//   f = branch(norm(a))                          (attention, or the MLP / MoE)
//   y = mhc_post(f) : y_m = sum_i P[i][m] x_i + q_m f
//
// with p, q and P from the flattened streams' RMSNorm (scale gamma [k d]) and
// the module's fn, base and scale (model/params.h, MhcParams). The op takes
// the norm without a learned scale, so gamma is folded into fn's columns
// here (fn'[r][i] = fn[r][i] gamma_i) and its gradient recovered from fn''s:
// dgamma_i = sum_r dfn'[r][i] fn[r][i], dfn[r][i] = dfn'[r][i] gamma_i.
#pragma once

#include <cstdint>

#include "core/buffer.h"
#include "model/config.h"
#include "model/params.h"
#include "ops/linear.h"
#include "ops/mhc.h"

namespace ds::model {

// One sub-layer's mixing in one forward (scratch: always recomputed from the
// streams it reads).
struct MhcState {
  Buffer<float> fn;    // fn with gamma folded in [(2 + k) k, k d]
  Buffer<float> a;     // the branch input [N, d]
  Buffer<float> post;  // q [N, k]
  Buffer<float> comb;  // P [N, k, k]
};

// The op's dims for `c` over N tokens.
ops::MhcDims mhc_dims(const ModelConfig& c, int64_t N);

// Fills m from the streams x [N, k, d].
void mhc_block_pre(MhcState& m, const float* x, const MhcParams<ops::WeightView>& p, const ModelConfig& c, int64_t N);
// y [N, k, d] (must not alias x) from the branch output f [N, d].
void mhc_block_post(float* y, const float* f, const float* x, const MhcState& m, const ModelConfig& c, int64_t N);

// Gradients of mhc_post's mixes, handed to the pre backward.
struct MhcGrad {
  Buffer<float> dpost, dcomb;  // [N, k], [N, k, k]
};
// Given dy [N, k, d]: df [N, d] `=`, dx [N, k, d] `+=` (the direct path), and
// g's dpost, dcomb `=`.
void mhc_block_post_backward(float* df, float* dx, MhcGrad& g, const float* dy, const float* f, const float* x,
                             const MhcState& m, const ModelConfig& c, int64_t N);
// Given da [N, d] (the gradient of the branch input) and g: dx `+=`, and the
// module's weight gradients `+=` into dw (null leaves: none wanted).
void mhc_block_pre_backward(float* dx, MhcParams<float*>& dw, const float* da, const MhcGrad& g, const float* x,
                            const MhcState& m, const MhcParams<ops::WeightView>& p, const ModelConfig& c, int64_t N);

// The decoder's ends: every stream a copy of the embedding h [N, d] (x [N, k, d]),
// and their plain sum; the sum's backward is the expansion and vice versa.
void mhc_expand(float* x, const float* h, int64_t N, int64_t k, int64_t d);
void mhc_reduce(float* h, const float* x, int64_t N, int64_t k, int64_t d);

}  // namespace ds::model
