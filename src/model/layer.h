// A DeepSeek decoder layer from the stage functions, with its residuals under
// MaxText's checkpoint names, kept as a remat policy (model/remat.h) says.
//
//   h1 = h + out_proj(MLA(rmsnorm(h)))
//   h2 = h1 + FFN(rmsnorm(h1))        FFN: dense MLP or DeepSeekMoE
//
// With mHC (mhc_expansion_rate k > 1, model/mhc_block.h) h is k streams
// [N, k, D] and each sub-layer is wrapped: h1 = mhc_post(out_proj(MLA(
// rmsnorm(mhc_pre(h))))), h2 likewise with the FFN, each with its own module.
//
// layer_forward is the one forward: generation calls it with a KV store
// (attention over cached tokens) and keeps nothing; training calls it with
// the packed batch's layout and keeps what the policy names. layer_backward
// first recomputes, with the same forward code, every residual the policy
// dropped, so gradients are bitwise the same under every policy.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/held.h"
#include "model/remat.h"
#include "model/stages.h"

namespace ds::model {

// The tokens of one forward: `batch` rows of `seq` tokens (N = batch * seq),
// with positions (RoPE) and segment ids (attention never crosses a segment;
// null: one segment per row).
// The sequences packed in a generation step's rows: sequence i's new tokens
// are rows [row0, row0 + count), after the N - 1 tokens `history` (oldest
// first; null: it starts here). Engram's look-backs stay within each.
struct SequenceRows {
  int64_t row0 = 0, count = 0;
  const int32_t* history = nullptr;
};

struct TokenLayout {
  int64_t batch = 1, seq = 0;
  const int32_t* positions = nullptr;
  const int32_t* segment_ids = nullptr;
  // The token ids [N]: Engram layers hash them (null in a model without).
  const int32_t* ids = nullptr;
  // Generation: the sequences in the rows. Null: each of the `batch` rows
  // is a sequence from its start (as MaxText, Engram's look-backs cross
  // the packed documents' segment ids).
  const std::vector<SequenceRows>* sequences = nullptr;
  int64_t tokens() const { return batch * seq; }
};

// What attention over a KV cache reads of the new tokens [N rows each].
struct AttentionInputs {
  const float* query_proj;  // [N, H, qk]
  const float* mla_kv;      // [N, kv_lora]
  const float* k_pe;        // [N, rope]
  const float* x;           // the normed layer input [N, D] (the DSA indexer's keys and head weights)
  const float* mla_q;       // q-LoRA latent after its norm [N, q_lora] (the indexer's queries); null without q-LoRA
};

// Attention over a KV cache, provided by the generation engine: writes the
// attention output [N, H * v] (and updates its cache).
class KvAttention {
 public:
  virtual ~KvAttention() = default;
  virtual void attend(float* attention_out, int64_t layer, const AttentionInputs& in,
                      const AttentionParams<ops::WeightView>& p, const StageConfig& s) = 0;
  // Engram layers: the conv input rows [history, G D] before sequence i's
  // new tokens (oldest first; null: none yet), and the new tokens' rows
  // [count, G D] to keep.
  virtual const float* engram_history(int64_t layer, int64_t i) = 0;
  virtual void engram_keep(int64_t layer, int64_t i, const float* rows, int64_t count) = 0;
};

// Everything a layer's forward produced. Named buffers are empty when not
// kept; the rest (norm outputs, routing, routed rows) is always recomputed.
// Under dtype=bfloat16 the layer's input is a bf16 value (layer_forward
// rounds the residual stream), and so is every named residual (the stages
// round them where they are made): between the forward and the backward
// they are held as bf16 (hold_bf16, widen); the norms' rstd and the
// attention's lse stay float32.
struct LayerSaved {
  HeldFloats decoder_layer_input;  // h [N, D] ([N, k, D] with mHC)
  Buffer<float> query_wa_proj, mla_q, q_rstd, query_proj;
  Buffer<float> kv_wa_proj, mla_kv, kv_rstd, k_pe, key_proj, value_proj;
  Buffer<float> attention_out, lse;  // lse: with `context`
  Buffer<float> out_proj;
  Buffer<float> mlpwi_0, mlpwi_1, mlpwo;              // dense MLP, or the shared experts of a MoE layer
  Buffer<float> moe_mlpwi_0, moe_mlpwi_1, moe_mlpwo;  // routed experts, rows sorted by expert
  // The kept named residuals as bf16 codes (each must hold bf16 values),
  // and back (before the backward reads them).
  void hold_bf16();
  void widen();
  size_t bytes() const;

 private:
  static constexpr size_t kHeld = 15;
  std::array<Buffer<float>*, kHeld> held_buffers();
  std::array<HeldFloats, kHeld> held_;
};

// The bytes LayerSaved holds per token after a forward that kept `keep`,
// summed over the model's layers (the MTP layers' included): each kept
// named residual's width, held at 2 bytes under `bf16` (4 otherwise), and
// the float32 rstd and lse beside them. train::training_memory_bytes'
// activation estimate (model::Family::saved_bytes_per_token); drop() in
// layer.cc says what each name keeps.
double saved_bytes_per_token(const ModelConfig& cfg, int64_t mtp_layers, const RematPolicy& keep, bool bf16);

// One layer forward. h [N, D] ([N, k, D] with mHC) is updated in place (h -> h2). Under
// ops::gemm_dtype() bf16 (MaxText's dtype=bfloat16) h is rounded to bf16 on
// entry and h2 on exit, as MaxText's decoder layers take and give bf16
// activations (the rounding's gradient is the identity). With kv, the
// attention is the engine's; else causal attention over `layout` (training,
// or a fresh prompt). With saved, the layer input and the residuals `keep`
// names are left in *saved; stats, when not null, receive the expert load
// and balance loss (MoE layers).
struct LayerStats {
  std::vector<int64_t> load;  // MoE: assignments per expert
  double lb_loss = 0;         // MoE: the balance loss (with load_balance_loss_weight > 0)
};
void layer_forward(float* h, const LayerView& p, int64_t layer, const StageConfig& s, const TokenLayout& layout,
                   KvAttention* kv, LayerSaved* saved, const RematPolicy& keep, LayerStats* stats = nullptr);

// The batch-split schedule: the layout's rows cut into saved.size()
// micro-batches of consecutive rows, each with its own residuals, run
// interleaved (model/staged.h) so that one's expert exchange travels while
// the others compute; loads add up and the balance loss is their mean. Only
// training uses it (no cache). One part is layer_forward.
void layer_forward_split(float* h, const LayerView& p, int64_t layer, const StageConfig& s, const TokenLayout& layout,
                         std::vector<LayerSaved>& saved, const RematPolicy& keep, LayerStats* stats);

// Backward of layer_forward: dh [N, D] ([N, k, D] with mHC) holds dL/dh2 on entry and dL/dh on
// return. Weight gradients are added into g. `saved` must hold
// decoder_layer_input; missing residuals are recomputed (and then freed).
// With s.load_balance_loss_weight > 0, the layer's balance loss (MaxText's:
// weight * E^2 * mean_{b,e} f * P) is differentiated too, scaled by dloss_lb.
// With s.indexer_loss_weight > 0, a main-decoder layer of a DSA model also
// computes its indexer loss (the KL of the indexer's scores against the
// attention's distribution over the keys, summed over the queries; every
// input detached), adds it to *indexer_loss and its gradient, times the
// weight, into the indexer's weights: the indexer learns from the KL alone,
// the rest of the model never sees it.
void layer_backward(float* dh, LayerGrads& g, LayerSaved& saved, const LayerView& p, int64_t layer,
                    const StageConfig& s, const TokenLayout& layout, double dloss_lb, double* indexer_loss = nullptr);

// Backward of layer_forward_split, its parts interleaved the same way.
void layer_backward_split(float* dh, LayerGrads& g, std::vector<LayerSaved>& saved, const LayerView& p, int64_t layer,
                          const StageConfig& s, const TokenLayout& layout, double dloss_lb,
                          double* indexer_loss = nullptr);

// The balance-loss value of a MoE layer for a routing (see layer_backward).
double balance_loss(const Routing& r, const float* bias, int64_t batch, int64_t seq, double lb_weight);

}  // namespace ds::model
