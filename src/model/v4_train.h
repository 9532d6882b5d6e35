// DeepSeek-V4's training loss and its gradient, from the same forward that
// generation runs (model/v4_model.h), which keeps its activations
// (V4Saved) for the backward here.
//
//   lm_loss = mean over the counted targets of
//             CE(logits_t, target_t) + z_loss_multiplier lse_t^2
//
// (MaxText's lm_loss, z term included), plus with an MTP layer
//
//   mtp_loss = mtp_loss_scaling_factor x mean over counted targets t + 1 of
//              CE(mtp_logits_t, target_{t+1})
//
// (MaxText's pooled MTP loss, no z term). Each sequence of the batch is its
// own (positions 0 .. length - 1, a fresh state): a packed training row is
// cut into its document pieces, so attention, the compressors' windows and
// the indexer never cross a document. The
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
#include <string>
#include <utility>
#include <vector>

#include "model/model.h"
#include "model/remat.h"
#include "model/v4_config.h"
#include "model/v4_params.h"
#include "model/v4_weights.h"

namespace ds::model {

// A V4 model's float32 parameters in one buffer, in for_each_v4_param order
// (the trainer's master weights, gradients and Adam moments share the
// layout). tid2eid is held there as floats (its expert ids are exact) and,
// for the forward, as the int32 table of `tables`.
struct V4FlatParams {
  std::vector<float> data;
  V4Params<float*> ptr;                      // into data
  V4View view;                               // float32 views of the same memory (tid2eid: I32 views of tables)
  std::vector<std::vector<int32_t>> tables;  // per layer (hash-routed layers)

  V4FlatParams() = default;
  V4FlatParams(const V4FlatParams&) = delete;
  V4FlatParams& operator=(const V4FlatParams&) = delete;
  V4FlatParams(V4FlatParams&&) = default;
  V4FlatParams& operator=(V4FlatParams&&) = default;

  static int64_t numel(const V4Config& c);
  static V4FlatParams zeros(const V4Config& c);
  // Pointers over `base` (numel floats, outliving the result), no views.
  static V4FlatParams wrap(const V4Config& c, float* base);
  // Pointers, views and tables over `base` (numel floats, outliving the
  // result; the tables are zero until sync_tables).
  static V4FlatParams over(const V4Config& c, float* base);
  // The int32 tables from the floats (after the buffer is filled); ds::Error
  // for an entry that is not an expert id.
  void sync_tables(const V4Config& c);
};

// A hash-routed layer's token -> experts table (tensor `name`, `cols`
// experts per token) from its floats f into table (sized by the caller);
// ds::Error for an entry that is not an expert id.
void v4_hash_table(const V4Config& c, const std::string& name, const float* f, int64_t cols,
                   std::vector<int32_t>& table);

// The tensors of the layout above as the trainer's ParamInfo list. Roles:
// the routing bias moves only by the balancing rule; tid2eid and the
// lightning indexer are Untrained (this loss gives the indexer no gradient,
// so weight decay alone would shrink it).
std::vector<ParamInfo> v4_param_infos(const V4Config& c);

struct V4TrainBatch {
  std::vector<int32_t> inputs, targets;  // every sequence's tokens, one sequence after another
  std::vector<int64_t> lengths;          // tokens of each sequence
  std::vector<uint8_t> counted;          // per target: 1 when it counts in the loss (empty: all count)
  std::vector<int64_t> row_of;           // per sequence: the packed row it came from (empty: its own)
  int64_t packed_rows = 0;               // rows of the packed batch, padding rows too (0: the sequences)

  // `batch` sequences of `seq` tokens, every target counted.
  static V4TrainBatch rows(int64_t batch, int64_t seq, std::vector<int32_t> inputs, std::vector<int32_t> targets);
  // The document pieces of packed rows (segment ids 1, 2, ... with
  // positions from 0 in each; padding, segment 0, dropped); a target counts
  // when its target_segment_id is not 0. ds::Error when a piece's positions
  // do not count 0, 1, ...
  static V4TrainBatch from_packed(const TrainBatch& packed);
};

struct V4LossOptions {
  double z_loss_multiplier = 0.0;
  double grad_scale = 1.0;   // the gradient added is grad_scale x dloss/dparam
  bool expert_load = false;  // report each layer's assignments per expert
  // A model with an MTP layer: its loss (false: none, as in eval).
  bool mtp = true;
  double mtp_loss_scaling_factor = 0.1;
  // Data parallelism: this batch is one shard of a whole one with these
  // counted targets (v4_loss_weights of the whole batch); every term, and
  // so the gradient, is this shard's share of the whole batch's (0: this
  // batch is the whole).
  double whole_targets = 0, whole_mtp_targets = 0;
  // Which residuals the forward keeps (the gradients do not depend on it).
  RematPolicy remat = RematPolicy::keep_all();
  // Expert parallelism (V4Options::exchange; null: none). Every rank of the
  // expert axis must call with a batch of at least one token.
  TokenExchange* exchange = nullptr;
  // MaxText's load-balance loss on the score-routed layers (model/v4_balance.h;
  // 0: none), with the whole batch's packed rows (0: this batch's).
  double load_balance_loss_weight = 0;
  int64_t whole_rows = 0;
  // FSDP (V4Options::stream; null: the weights are all in w).
  LayerStream* stream = nullptr;
  // The batch-split schedule (MaxText's use_batch_split_schedule): the
  // batch's packed rows cut into this many parts of equal count, each
  // layer's forward and backward run over the parts in turn so that one
  // part's expert exchange overlaps the next part's compute (model/staged.h).
  // The loss is the whole batch's; the gradients are equal up to the order
  // of their sums.
  int64_t batch_split = 1;
};

// Counted targets of a batch, and those of its MTP rows (target t + 1 of
// each sequence, t + 1 < its length).
struct V4LossWeights {
  double targets = 0, mtp_targets = 0;
};
V4LossWeights v4_loss_weights(const V4TrainBatch& b);

struct V4LossTerms {
  double loss = 0, lm_loss = 0, z_loss = 0, mtp_loss = 0;  // loss = lm_loss + mtp_loss + moe_lb_loss
  double moe_lb_loss = 0;
  int64_t tokens = 0, mtp_tokens = 0;             // counted targets
  std::vector<std::vector<int64_t>> expert_load;  // per layer, the MTP block last (opt.expert_load)
  size_t saved_bytes = 0;                         // residuals held at the end of the forward
};

// w: float32 views of every float parameter (tid2eid as I32). With grads,
// grad_scale x dloss/dparam is added into each non-null leaf (shapes as the
// parameter tree's; the indexer's and the bias's leaves are left as they
// are).
V4LossTerms v4_loss_and_grad(const V4Config& cfg, const V4View& w, V4Params<float*>* grads, const V4TrainBatch& b,
                             const V4LossOptions& opt = {});

}  // namespace ds::model
