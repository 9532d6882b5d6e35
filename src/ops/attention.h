// Causal multi-head attention with segment ids, computed in tiles with an
// online softmax (FlashAttention-2 style): no [T, T] matrix is ever held.
//
//   s[i, j] = scale * q[i] . k[j]   allowed when j <= i and seg[i] == seg[j]
//   p = softmax_j(s), out[i] = sum_j p[i, j] v[j]
// Forward saves lse[i] = log sum_j exp(s[i, j]) per (batch, head, query).
// Backward recomputes p from q, k and lse tile by tile:
//   D[i] = dout[i] . out[i],  dp = dout v^T,  ds = p * (dp - D)
//   dq = scale * ds k, dk = scale * ds^T q, dv = p^T dout   (all `=`)
//
// Layouts (row-major): q, k [B, T, H, Dqk]; v, out, dout [B, T, H, Dv];
// lse [B, H, T]; segment_ids [B, T] (null: one segment per sequence). Packed
// documents never attend across a segment boundary. Every query has at least
// itself to attend to, so lse is always finite.
//
// Both directions run in float32 whatever ops::gemm_dtype() is: the products
// of q, k, v around them carry the bf16 rounding in a bf16 model, the
// attention's own scores and sums do not.
#pragma once

#include <cstdint>

namespace ds::ops {

struct AttentionDims {
  int64_t batch = 1;
  int64_t seq = 1;
  int64_t heads = 1;
  int64_t qk_dim = 1;  // qk_nope_head_dim + qk_rope_head_dim in MLA
  int64_t v_dim = 1;
  float scale = 1.0f;  // softmax scale (1/sqrt(qk_dim) times any mscale correction)
};

// `selected` (DSA's top-k attention in training): [B, T, T] bytes; query i
// of row b may attend to key j only where selected[(b T + i) T + j] != 0,
// on top of the causal and segment masks (null: every allowed key). Every
// query must keep at least one key.
//
// `sink` [H] (DeepSeek-V4's attention sink; null: none): one more logit per
// head with no value, p = softmax([s[i, :], sink[h]]) with the sink's share
// dropped, so out[i] = sum_j p[i, j] v[j] sums to less than a convex mix; lse
// includes it. The backward then adds dsink[h] += -sum_i p_sink[i] D[i] when
// dsink is given.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* segment_ids, const AttentionDims& d, const uint8_t* selected = nullptr,
                       const float* sink = nullptr);
// Inference: n new queries continuing one sequence that already has `past`
// tokens. q [n, H, Dqk] (query i at position past + i); k [past + n, H, Dqk]
// and v [past + n, H, Dv] hold every key and value so far; query i attends
// to keys 0..past + i. out [n, H, Dv]. The same tiles and online softmax as
// attention_forward (d.batch must be 1, d.seq = n), threaded over (head,
// query tile); no lse, no segments.
void attention_forward_past(float* out, const float* q, const float* k, const float* v, int64_t past,
                            const AttentionDims& d);

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const int32_t* segment_ids,
                        const AttentionDims& d, const uint8_t* selected = nullptr, const float* sink = nullptr,
                        float* dsink = nullptr);

}  // namespace ds::ops
