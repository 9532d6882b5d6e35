// The training loss of a DeepSeek model and its gradient, from the same
// stage functions and layer forward that generation runs.
//
//   h0 = layers(embed(inputs))                       (positions, segment ids)
//   lm_loss = sum_t mask_t (lse_t - z_t[target_t] + z_loss_multiplier lse_t^2) / (sum mask + 1e-8)
//   mtp: depth k = 1..D (Hugging Face layout, layer num_hidden_layers + k - 1):
//     x_k = eh_proj([enorm(embed(ids rolled k)) | hnorm(h_{k-1})]),  h_k = layer(x_k)
//     mtp_loss = factor * sum_k sum_t mask_k CE(lm_head(shared_head.norm(h_k))) / (sum_k sum mask_k + 1e-8)
//   moe_lb_loss = mean over MoE layers (MTP ones too) of the layer's balance loss
//   loss = lm_loss + mtp_loss + moe_lb_loss
// as MaxText defines them (the rolls are its segment-aware ones), except that
// an MTP depth's logits go through the checkpoint's own shared_head.norm.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/layer.h"
#include "model/params.h"
#include "model/stages.h"
#include "model/weights.h"

namespace ds::model {

// Float32 parameters (or gradients, or optimizer moments) in one buffer,
// laid out in the parameter tree's walk order.
struct FlatParams {
  std::vector<float> data;
  ModelParams<float*> ptr;  // into data; a tied LM head points at the embedding
  ParamsView view;          // float32 views of the same memory

  FlatParams() = default;
  FlatParams(const FlatParams&) = delete;
  FlatParams& operator=(const FlatParams&) = delete;
  FlatParams(FlatParams&&) = default;
  FlatParams& operator=(FlatParams&&) = default;

  static FlatParams zeros(const ModelConfig& cfg, int64_t mtp_layers);
  // Views over `base`, laid out as zeros() lays out data; owns nothing (data
  // stays empty), base must hold numel() floats and outlive the result.
  static FlatParams wrap(const ModelConfig& cfg, int64_t mtp_layers, float* base);
  // Floats in the tree (without padding).
  static int64_t numel(const ModelConfig& cfg, int64_t mtp_layers);
};

// One batch of `batch` rows of `seq` tokens, [batch * seq] each.
struct TrainBatch {
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> inputs, targets, positions, segment_ids;
  std::vector<int32_t> target_segment_ids;  // 0: the target does not count (padding, end of document)
  void check(const ModelConfig& cfg) const;
};

// Streams the weights of the decoder layers and MTP depths in, and their
// gradients out, one unit at a time (FSDP: all-gathered before use,
// reduce-scattered after). Unit u is decoder layer u for u <
// num_hidden_layers, else MTP depth u - num_hidden_layers. Between
// acquire(u) and release(u) the views of unit u in the ParamsView given to
// loss_and_grad (and, with a backward, unit u's gradient pointers in the
// gradient tree, on zeroed memory) are valid; outside they may point
// anywhere. The embedding, final norm and LM head stay valid throughout.
// Units are used in the order 0..U-1 (forward), then U-1..0 (backward).
class LayerStream {
 public:
  virtual ~LayerStream() = default;
  virtual void begin(int64_t units, bool backward) = 0;
  virtual void acquire(int64_t unit, bool backward) = 0;
  virtual void release(int64_t unit, bool backward) = 0;
};

struct LossOptions {
  double z_loss_multiplier = 0.0;
  double load_balance_loss_weight = 0.0;
  int64_t mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;
  // DSA (a model with an indexer): MaxText's indexer_loss_scaling_factor.
  // The indexer loss is factor x the mean over the main decoder's layers of
  // each layer's KL averaged over the batch's queries (padding included, as
  // MaxText's); it is computed in the backward pass, so only a call with
  // gradients reports it. 0: none.
  double indexer_loss_scaling_factor = 0.0;
  // DSA: MaxText's indexer_sparse_training. The main decoder's attention
  // keeps only each query's top index_topk keys by the indexer's scores, and
  // the indexer loss is taken over those keys (false: dense attention, the
  // warm-up). MTP layers stay dense.
  bool indexer_sparse_training = false;
  // The gradient added is grad_scale x dloss/dparam (gradient accumulation
  // weighs each micro-batch by its share of the counted targets).
  double grad_scale = 1.0;
  // Data parallelism: this batch is one shard of a whole batch whose counted
  // targets, counted MTP targets (over all depths) and rows these are (from
  // loss_weights() of the whole batch). When set (rows > 0) every loss term,
  // and so the gradient, is this shard's share of the whole batch's: the sum
  // over the shards equals the whole batch's loss and gradient.
  struct Whole {
    double targets = 0, mtp_targets = 0;
    int64_t rows = 0;
  } whole;
  LayerStream* stream = nullptr;      // FSDP: per-unit weights and gradients
  TokenExchange* exchange = nullptr;  // expert parallelism
  // The batch-split schedule: each layer runs the batch as this many
  // micro-batches of consecutive rows, interleaved so that one's expert
  // exchange overlaps the others' compute (1: off). Must divide the rows.
  int64_t batch_split_factor = 1;
};

// The normalizers of a batch's loss: counted targets, and counted MTP
// targets over depths 1..mtp_layers (after the segment-aware rolls).
LossOptions::Whole loss_weights(const TrainBatch& batch, int64_t mtp_layers);

struct LossTerms {
  double loss = 0, lm_loss = 0, z_loss = 0, mtp_loss = 0, moe_lb_loss = 0;
  double indexer_loss = 0;                        // DSA: in loss (see LossOptions::indexer_loss_scaling_factor)
  double tokens = 0;                              // targets counted by lm_loss
  std::vector<std::vector<int64_t>> expert_load;  // per MoE layer (main, then MTP): assignments per expert
  size_t saved_bytes = 0;                         // residuals held at the end of the forward
};

// The loss of `batch`; with grads, also adds dloss/dparam into it (the
// routing bias gets none). `policy` decides which residuals the forward
// keeps; the gradients do not depend on it.
LossTerms loss_and_grad(const ModelConfig& cfg, const ParamsView& w, ModelParams<float*>* grads,
                        const TrainBatch& batch, const LossOptions& opt, const RematPolicy& policy);

}  // namespace ds::model
