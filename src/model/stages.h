// The stage functions of a DeepSeek decoder layer, cut where MaxText's
// DeepSeek code cuts it: MLA (query_projection, kv_projection,
// get_key_value, attention, out_projection), the dense MLP, and DeepSeekMoE
// (expert_selection, route, expert compute, unroute and combine).
//
// Every stage is a forward and a backward over N packed tokens. Forward
// writes its outputs into caller-provided buffers; the tensors that backward
// needs are outputs too (the residuals, named after MaxText's checkpoint
// names), so inference, training and every remat policy run the same code and
// only decide what they keep. Backward reads the residuals, writes activation
// gradients (`=` unless it says `+=`) and accumulates weight gradients
// (`+=`) into a tree of float32 buffers. Backward needs float32 weights.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/buffer.h"
#include "model/config.h"
#include "model/engram.h"
#include "model/engram_hash.h"
#include "model/params.h"
#include "model/weights.h"
#include "ops/expert_selection.h"

namespace ds::model {

using LayerGrads = LayerParams<float*>;  // null leaves: no gradient wanted

// What the stages derive from the config once.
class TokenExchange;

struct StageConfig {
  explicit StageConfig(const ModelConfig& c);
  const ModelConfig* cfg;
  std::vector<float> rope_freqs;  // YaRN-corrected, [qk_rope_head_dim / 2]
  float softmax_scale;
  ops::ExpertSelectionConfig selection;
  // Inference: up to this many token-expert assignments in a MoE layer, each
  // active expert's products are split into tasks of one parallel loop
  // (decode); above it, each expert's rows are cut into chunks that run as
  // whole MLPs, one chunk per task (prefill). Both agree to rounding.
  int64_t task_parallel_assignments = 64;
  // Training: MaxText's load_balance_loss_weight (0: no balance loss).
  double load_balance_loss_weight = 0.0;
  // Training a DSA model: each layer's indexer loss (the KL of its scores
  // against the attention's key distribution, summed over the layer's
  // queries) enters the loss times this weight (0: not computed).
  double indexer_loss_weight = 0.0;
  // Training a DSA model's sparse stage: each main-decoder layer's attention
  // keeps only its indexer's top index_topk visible keys per query.
  bool indexer_sparse = false;
  // Expert parallelism: moves routed rows to the ranks of their experts (null: none).
  TokenExchange* exchange = nullptr;
  // Engram: each Engram layer's hash tables (engram_layers order) and the layer's sizes.
  std::vector<EngramLayerHash> engram_tables;
  EngramDims engram;
  const EngramLayerHash& engram_table(int64_t layer) const;
};

// MaxText's dtype for activations: under ops::gemm_dtype() bf16 (dtype=
// bfloat16) the stages round each named activation (model/remat.h's names)
// to bf16 where it is made, before anything reads it, as MaxText's bf16
// activations are; a training step then holds them as bf16 (the same
// values, half the bytes) and a recompute makes the same bits. The
// rounding's gradient is the identity. Float32: nothing happens.
bool bf16_activations();
void to_activation_dtype(float* x, int64_t n);

// RMSNorm backward over a scale view: dx `=` (`+=` with accumulate_dx), the
// scale's gradient added into dw when not null.
void norm_backward(float* dx, float* dw, const float* dy, const float* x, const ops::WeightView& w, const float* rstd,
                   int64_t rows, bool accumulate_dx = false);

// ---------------------------------------------------------------- LM head

// The LM head and its loss, fused and chunked over the vocabulary (the
// [N, vocab] logits are never materialised): hn [N, D] normed rows against
// the head [vocab, D] (float32 for the backward; the forward widens a stored
// bf16 or fp8 head once). The loss of a token is its cross-entropy plus
// zm lse^2 (MaxText's z-loss); tokens whose mask is 0 do not count (their
// target is -1 in `targets`: no loss, no gradient).
struct HeadLoss {
  Buffer<float> loss, lse;                   // per token
  std::vector<int32_t> targets;              // -1 where masked
  double ce_sum = 0, z_sum = 0, weight = 0;  // over counted tokens: CE, zm lse^2, count
};
void head_loss_forward(HeadLoss& hl, const float* hn, const ops::WeightView& head, const std::vector<int32_t>& targets,
                       const std::vector<int32_t>& mask, int64_t N, int64_t D, double zm);
// The gradient of scale * sum over counted tokens of (CE + zm lse^2): dhn
// `=`, the head's into dhead (`+=`, may be null).
void head_loss_backward(float* dhn, float* dhead, const HeadLoss& hl, const float* hn, const ops::WeightView& head,
                        int64_t N, int64_t D, double zm, double scale);

// ---------------------------------------------------------------- MLA

// query_projection: x [N, D] (normed) -> query_proj [N, H, qk] with RoPE on
// the rope part. With q-LoRA also query_wa_proj [N, q_lora] (q_a output), mla_q
// [N, q_lora] (after q_a_layernorm) and its rstd [N].
struct QueryOut {
  float* query_proj;
  float* query_wa_proj = nullptr;  // q-LoRA only
  float* mla_q = nullptr;
  float* q_rstd = nullptr;
  bool latent = true;  // compute query_wa_proj, mla_q, q_rstd (else they are inputs)
  bool query = true;   // compute query_proj
};
void query_projection_forward(const QueryOut& out, const float* x, const AttentionParams<ops::WeightView>& p,
                              const StageConfig& s, const int32_t* positions, int64_t N);
// dquery_proj is consumed (overwritten). dx +=.
void query_projection_backward(float* dx, AttentionParams<float*>& g, float* dquery_proj, const float* query_wa_proj,
                               const float* mla_q, const float* q_rstd, const float* x,
                               const AttentionParams<ops::WeightView>& p, const StageConfig& s,
                               const int32_t* positions, int64_t N);

// kv_projection: x -> kv_wa_proj [N, kvl + rope] (kv_a output), mla_kv [N, kvl]
// (latent after kv_a_layernorm), kv_rstd [N], k_pe [N, rope] (rotated).
struct KvOut {
  float* kv_wa_proj;
  float* mla_kv;
  float* kv_rstd;
  float* k_pe;
  bool project = true;  // false: kv_wa_proj is an input; only the norm and RoPE run
};
void kv_projection_forward(const KvOut& out, const float* x, const AttentionParams<ops::WeightView>& p,
                           const StageConfig& s, const int32_t* positions, int64_t N);
// d_mla_kv and dk_pe are consumed. dx +=.
void kv_projection_backward(float* dx, AttentionParams<float*>& g, float* d_mla_kv, float* dk_pe,
                            const float* kv_wa_proj, const float* kv_rstd, const float* x,
                            const AttentionParams<ops::WeightView>& p, const StageConfig& s, const int32_t* positions,
                            int64_t N);

// get_key_value: mla_kv, k_pe -> key_proj [N, H, qk] ([k_nope | k_pe] per
// head), value_proj [N, H, v] (kv_b_proj).
void get_key_value_forward(float* key_proj, float* value_proj, const float* mla_kv, const float* k_pe,
                           const AttentionParams<ops::WeightView>& p, const StageConfig& s, int64_t N);
// d_mla_kv, dk_pe `=`.
void get_key_value_backward(float* d_mla_kv, float* dk_pe, AttentionParams<float*>& g, const float* dkey,
                            const float* dvalue, const float* mla_kv, const AttentionParams<ops::WeightView>& p,
                            const StageConfig& s, int64_t N);

// out_projection: attention_out [N, H*v] -> out_proj [N, D].
void out_projection_forward(float* out, const float* attention_out, const AttentionParams<ops::WeightView>& p,
                            int64_t N);
void out_projection_backward(float* d_attention_out, AttentionParams<float*>& g, const float* dout,
                             const float* attention_out, const AttentionParams<ops::WeightView>& p, int64_t N);

// ---------------------------------------------------------------- DSA indexer

// indexer: the DeepSeek-V3.2 lightning indexer's keys and queries for N
// tokens (ops/indexer.h). From x [N, D] (the normed layer input):
//   k = Hadamard(RoPE_half(LayerNorm(x wk^T)))  -> key_codes [N, Di] e4m3 and
//       key_scales [N, ops::indexer_scale_blocks(Di)]
// and, when query is not null, from mla_q [N, q_lora] (MLA's normed q latent):
//   q = Hadamard(RoPE_half(mla_q wq_b^T))  quantized the same way per head and
//       dequantized into query [N, Hi, Di]
//   head_weights [N, Hi] = (x weights_proj^T) * Hi^-1/2 * Di^-1/2.
// RoPE rotates the first qk_rope_head_dim dims of each head in the half-split
// layout with MLA's (YaRN) frequencies.
struct IndexerOut {
  uint8_t* key_codes;
  float* key_scales;
  float* query = nullptr;
  float* head_weights = nullptr;
};
void indexer_forward(const IndexerOut& out, const float* x, const float* mla_q, const IndexerParams<ops::WeightView>& p,
                     const StageConfig& s, const int32_t* positions, int64_t N);

// The indexer in training (float32: MaxText's and the paper's indexer, the
// inference one without the fp8 rounding and so without the Hadamard
// rotation, which leaves every q . k unchanged). Its inputs x and mla_q are
// detached: its gradients reach only its own weights.
struct IndexerActs {
  Buffer<float> k_lin;  // x wk^T [N, Di] (the LayerNorm's input)
  Buffer<float> k;      // LayerNorm, then RoPE [N, Di]
  Buffer<float> q;      // mla_q wq_b^T, then RoPE [N, Hi, Di]
  Buffer<float> w;      // head weights [N, Hi], scaled by (Hi Di)^-1/2
};
void indexer_train_forward(IndexerActs& a, const float* x, const float* mla_q, const IndexerParams<ops::WeightView>& p,
                           const StageConfig& s, const int32_t* positions, int64_t N);
// From the gradients of q, k and w (ops::indexer_dense_scores_backward):
// the weights' gradients added into g.
void indexer_train_backward(IndexerParams<float*>& g, const float* dq, const float* dk, const float* dw,
                            const IndexerActs& a, const float* x, const float* mla_q,
                            const IndexerParams<ops::WeightView>& p, const StageConfig& s, const int32_t* positions,
                            int64_t N);

// ---------------------------------------------------------------- MLP

// down(silu(gate(x)) * up(x)): mlpwi_0 [N, I] (gate), mlpwi_1 [N, I] (up),
// out [N, D] (mlpwo). Forward with null mlpwi buffers uses its own scratch.
// The activation's variant: swiglu_limit > 0 clamps it as DeepSeek-V4's
// experts do (the gate to at most the limit, the up to +-limit; ops/activations.h).
void mlp_forward(float* out, float* mlpwi_0, float* mlpwi_1, const float* x, const MlpParams<ops::WeightView>& p,
                 int64_t N, float swiglu_limit = 0.0f);
// dx `=` (or `+=` with accumulate_dx).
void mlp_backward(float* dx, MlpParams<float*>& g, const float* dout, const float* mlpwi_0, const float* mlpwi_1,
                  const float* x, const MlpParams<ops::WeightView>& p, int64_t N, bool accumulate_dx,
                  float swiglu_limit = 0.0f);

// ---------------------------------------------------------------- MoE

// expert_selection and route: the router's choice for every token and the
// assignments sorted by expert.
struct Routing {
  int64_t tokens = 0, k = 0;
  Buffer<float> logits;            // [N, E] router output
  Buffer<float> scores;            // [N, E] unbiased scores (sigmoid or softmax)
  Buffer<int32_t> experts;         // [N, K]
  Buffer<float> weights;           // [N, K] combine weights
  Buffer<int32_t> order, inverse;  // sorted row <-> assignment (ops/routing.h)
  std::vector<int32_t> sizes;      // [E] assignments per expert
};
void expert_selection_forward(Routing& r, const float* x, const MoeParams<ops::WeightView>& p, const StageConfig& s,
                              int64_t N);
// route alone: r.order, r.inverse and r.sizes from r.experts (dropless,
// sorted by expert, ties in assignment order), for E experts.
void route(Routing& r, int64_t E);
// dlogits (from the combine weights, and any balance loss) -> dx +=, router +=.
void expert_selection_backward(float* dx, MoeParams<float*>& g, const float* dweights, float* dscores_extra,
                               const Routing& r, const float* x, const MoeParams<ops::WeightView>& p,
                               const StageConfig& s);

// Expert compute: xs [n, D] routed rows (sorted by expert) -> ys [n, D]
// (moe_mlpwo), with moe_mlpwi_0 / moe_mlpwi_1 [n, I] when not null; plus the
// shared experts on x [N, D] -> shared_out [N, D] (zeros when there are none),
// with their mlpwi_0 / mlpwi_1 when not null.
struct ExpertOut {
  float* ys;
  float* shared_out;
  float* moe_mlpwi_0 = nullptr;
  float* moe_mlpwi_1 = nullptr;
  float* shared_mlpwi_0 = nullptr;
  float* shared_mlpwi_1 = nullptr;
};
// `sizes` (when not null) replaces r.sizes: the rows of xs per expert after
// a token exchange (zero for the experts other ranks compute).
void experts_forward(const ExpertOut& out, const float* xs, const float* x, const Routing& r,
                     const MoeParams<ops::WeightView>& p, const StageConfig& s,
                     const std::vector<int32_t>* sizes = nullptr);
// dys -> dxs `=`; shared: dshared_out -> dx +=.
void experts_backward(float* dxs, float* dx, MoeParams<float*>& g, const float* dys, const float* dshared_out,
                      const float* moe_mlpwi_0, const float* moe_mlpwi_1, const float* shared_mlpwi_0,
                      const float* shared_mlpwi_1, const float* xs, const float* x, const Routing& r,
                      const MoeParams<ops::WeightView>& p, const StageConfig& s,
                      const std::vector<int32_t>* sizes = nullptr);

// Expert parallelism: between route and the expert compute, each routed row
// travels to the rank that computes its expert, and the results travel back.
// plan() (collective over the expert axis) takes this rank's rows per expert
// [E] (sorted by expert, as route leaves them) and says where every row
// goes; dispatch moves rows [n, D] in this rank's order to the rows this
// rank computes [local_rows, D], sorted by expert (every rank's rows of one
// expert together); undispatch moves them back. Both are permutations across
// ranks, so each is the other's backward.
struct ExchangePlan {
  int64_t rows = 0;                  // this rank's routed rows (the sum of its sizes)
  std::vector<int32_t> local_sizes;  // [E]: rows this rank computes per expert (0 for others' experts)
  int64_t local_rows = 0;
  std::vector<int64_t> send_rows, recv_rows;  // per rank of the expert axis
  std::vector<int64_t> place;                 // received row i (grouped by sender) -> its row in expert order
  // All-gather dispatch: row j in expert order is row source[j] of the
  // gathered [ranks, max_rows] rows.
  std::vector<int64_t> source;
  int64_t max_rows = 0;
};
class TokenExchange {
 public:
  virtual ~TokenExchange() = default;
  virtual void plan(ExchangePlan& p, const std::vector<int32_t>& sizes) = 0;
  // Start moving rows; the returned function waits for the move and
  // completes `out`. `rows` must stay valid until then. With `gradient`
  // the rows are the backward's gradient of the expert outputs (the
  // transpose of undispatch), which an exchange may move at lower precision.
  virtual std::function<void()> start_dispatch(float* out, const float* rows, const ExchangePlan& p, int64_t D,
                                               bool gradient) = 0;
  virtual std::function<void()> start_undispatch(float* out, const float* rows, const ExchangePlan& p, int64_t D) = 0;
  void dispatch(float* out, const float* rows, const ExchangePlan& p, int64_t D) {
    start_dispatch(out, rows, p, D, false)();
  }
  void dispatch_gradient(float* out, const float* rows, const ExchangePlan& p, int64_t D) {
    start_dispatch(out, rows, p, D, true)();
  }
  void undispatch(float* out, const float* rows, const ExchangePlan& p, int64_t D) {
    start_undispatch(out, rows, p, D)();
  }
};

// unroute and combine: out[t] += sum_j weights[t, j] * ys[inverse[t*K + j]],
// the K terms added in the order of the token's assignments (j = 0 .. K - 1),
// or with CombineOrder::Experts in the order of its experts (ascending ids,
// as DeepSeek's V4 inference code adds them while it loops over the experts:
// its fp8 roundings then see the same sums).
enum class CombineOrder { Assignments, Experts };
void combine_forward(float* out, const float* ys, const Routing& r, int64_t D,
                     CombineOrder order = CombineOrder::Assignments);
// dweights [N, K] `=`, dys [n, D] `=`.
void combine_backward(float* dweights, float* dys, const float* dout, const float* ys, const Routing& r, int64_t D);

}  // namespace ds::model
