// Cross-entropy of the LM head, fused and chunked over the vocabulary.
//
//   logits[t, v] = h[t] . W[v]        h [N, D], W [V, D] (Hugging Face lm_head.weight)
//   loss[t] = lse[t] - logits[t, target[t]],  lse[t] = log sum_v exp(logits[t, v])
// Tokens whose target is negative (padding) get loss 0 and no gradient.
//
// The [N, V] logits are never materialised: forward walks vocabulary chunks
// with an online log-sum-exp; backward recomputes each chunk's logits from h
// and the saved lse:
//   dlogits = (softmax - onehot(target)) * dloss[t]
//   dh = dlogits W   (activation gradient: `=`),  dW += dlogits^T h  (`+=`)
// Work is blocked as [token block x vocab chunk] so the scratch is bounded by
// one such block whatever N and V are.
//
// cross_entropy_forward/backward are the plain versions on given logits
// [N, V] (used by tests and by callers that already have logits).
#pragma once

#include <cstdint>

namespace ds::ops {

struct CrossEntropyChunks {
  int64_t token_block = 256;
  // The most columns a vocabulary chunk has. A vocabulary of fewer than 16
  // such chunks is cut into 16 (of at least 128 columns), so that the threads
  // have chunks to share; V alone decides, never the thread count.
  int64_t vocab_chunk = 2048;
};

// loss [N] and lse [N] are written.
void lm_head_cross_entropy_forward(float* loss, float* lse, const float* h, const float* w, const int32_t* targets,
                                   int64_t N, int64_t D, int64_t V, CrossEntropyChunks chunks = {});
// dh (may be null) is overwritten; dw (may be null) is accumulated.
void lm_head_cross_entropy_backward(float* dh, float* dw, const float* dloss, const float* h, const float* w,
                                    const int32_t* targets, const float* lse, int64_t N, int64_t D, int64_t V,
                                    CrossEntropyChunks chunks = {});

void cross_entropy_forward(float* loss, float* lse, const float* logits, const int32_t* targets, int64_t N, int64_t V);
// dlogits is overwritten.
void cross_entropy_backward(float* dlogits, const float* dloss, const float* logits, const int32_t* targets,
                            const float* lse, int64_t N, int64_t V);

}  // namespace ds::ops
