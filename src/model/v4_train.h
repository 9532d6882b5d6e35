// DeepSeek-V4's training loss and its gradient, from the same forward that
// generation runs (model/v4_model.h), which keeps its activations
// (V4Saved) for the backward here.
//
//   loss = mean over the batch's tokens of CE(logits_t, target_t)
//
// Each row of the batch is its own sequence (positions 0 .. seq - 1). The
// forward runs without the fp8/fp4 roundings (as Hugging Face's and
// MaxText's V4 train), and the backward goes through every stage: the
// grouped output projection, the inverse rotation, the sparse attention
// with its sink (window and compressed keys alike), the compressors'
// pooling and position embeddings, both RMS norms and RoPE of q and of the
// K=V latent, mHC with its unrolled Sinkhorn, the MoE (router through the
// combine weights, sqrt-softplus or hash routing, clamped SwiGLU experts,
// shared expert), the final mHC contraction, norm and head, and the
// embedding. The routing and indexer choices are constants of the step;
// the indexer's weights get no gradient from this loss (DeepSeek trains the
// indexer with an objective of its own), and neither does the routing bias.
#pragma once

#include <cstdint>
#include <vector>

#include "model/v4_config.h"
#include "model/v4_params.h"
#include "model/v4_weights.h"

namespace ds::model {

struct V4TrainBatch {
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> inputs, targets;  // [batch * seq]
};

struct V4LossTerms {
  double loss = 0;
  int64_t tokens = 0;
};

// w: float32 views of every float parameter (tid2eid as I32). With grads,
// dloss/dparam is added into each non-null leaf (shapes as the parameter
// tree's; the indexer's and the bias's leaves are left as they are).
V4LossTerms v4_loss_and_grad(const V4Config& cfg, const V4View& w, V4Params<float*>* grads, const V4TrainBatch& b);

}  // namespace ds::model
