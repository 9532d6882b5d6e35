// DeepSeek-V4's forward: one code path for a whole prompt and for each new
// token of a generation, the difference being only what a sequence's state
// already holds.
//
//   X = embed(ids) copied into hc_mult streams                 [T, n, d]
//   per layer:  (a, post, comb) = mhc_pre(X);  o = attention(rmsnorm(a))
//               X = mhc_post(o, X, post, comb);  the same around the MoE
//   logits = head(rmsnorm(mhc_head(X)))
//
// Attention (layer kind from compress_ratios, m): q = wq_b(rmsnorm(wq_a a))
// per head RMS-normalised, one K=V latent kv = rmsnorm(wkv a), RoPE on the
// last qk_rope_head_dim dims of both (theta = rope_theta when m = 0, else
// compress_rope_theta with YaRN). Query t attends, with a per-head sink
// logit that only enlarges the softmax's denominator, to
//   - the window: the K=V of tokens t - sliding_window < s <= t;
//   - m = 128: every compressed entry whose window is complete (b < (t+1)/m);
//   - m = 4: the index_topk of those the lightning indexer scores highest;
// the output's rope dims are rotated back by -t and go through the grouped
// low-rank projection (wo_a per group of heads, then wo_b). Compressed
// entries pool every m tokens' projections (ops/compressor.h; m = 4 with the
// overlapping windows), then RMSNorm and RoPE at position b m. MoE: hash
// routing (tid2eid) on the first num_hash_layers layers, sqrt(softplus)
// scores plus the selection bias elsewhere, clamped SwiGLU experts and the
// shared expert.
//
// Quantization-aware simulation (on by default, DeepSeek's own inference
// code): the K=V latent's and the compressed entries' non-rope dims are
// rounded to fp8 (e4m3, power-of-two scales per 64), the indexer's queries
// and keys to fp4 (e2m1, per 32) after a Hadamard rotation. Off, the model
// computes as Hugging Face's implementation does. Weights are used as stored
// (fp8 / fp4 widened inside the kernels), activations are float32 (holding
// bf16 values when training under dtype=bfloat16; see V4LayerSaved).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/held.h"
#include "model/engram_hash.h"
#include "model/remat.h"
#include "model/staged.h"
#include "model/stages.h"
#include "model/v4_config.h"
#include "model/v4_weights.h"
#include "ops/expert_selection.h"
#include "ops/mhc.h"
#include "ops/sparse_attention.h"

namespace ds::model {

class LayerStream;

struct V4Options {
  bool qat = true;  // the fp8 / fp4 roundings of DeepSeek's inference code
  // DeepSeek-V4.1: DeepSeek's released inference code publishes a KV
  // source's index keys only at a step that completes one of its entries,
  // so at the other decode steps a ratio-2 index source scores the keys
  // published last (another source's, their first rows). Off (the default),
  // every index source scores its own KV source's keys, as a full forward,
  // and so training, does; on, decoding follows the released code.
  bool late_index_keys = false;
  // V4.1: the Engram tables are file mappings (a loaded folder, not a
  // trainer's buffers): the pages of the rows each step reads are released
  // from the process again (core/system.h, release_file_pages).
  bool release_engram_pages = false;
  // With the roundings, a sequence's indexer keys (kept as fp4 codes) are
  // widened once per forward while there are at most this many, and scored
  // by sgemm; beyond, every query scores them from the codes directly.
  int64_t widen_index_keys_up_to = 4096;
  // Training with expert parallelism: each routed row is computed on the
  // rank of its expert (model/stages.h's TokenExchange, collective over the
  // expert axis: every rank must run the same layers in the same order).
  TokenExchange* exchange = nullptr;
  // Training under FSDP: each layer's (and the MTP block's) weights are
  // acquired from this stream just before use and released after (units
  // 0 .. L - 1, then L for the MTP block; model/model.h's LayerStream).
  LayerStream* stream = nullptr;
};

// A compressor's pending rows: the projections (P, Z with the position
// embedding added) of the tokens from `start` on that a later entry still
// pools: the open window, and with overlap the complete one before it.
struct V4CompressorCarry {
  int64_t start = 0;
  std::vector<float> P, Z;  // [rows, width]
  // While a step may still be undone (V4Model::mark): the rows dropped
  // since the mark, positions [held_start, start).
  bool hold = false;
  int64_t held_start = 0;
  std::vector<float> held_P, held_Z;
};

// What one layer keeps of one sequence between forwards. With the roundings
// on (the default) the compressed entries and the indexer's keys are kept as
// the codes they were rounded to, which loses nothing: an entry's non-rope
// dims as e4m3 codes with an e8m0 scale per 64, its rope dims as float32; a
// key as packed e2m1 codes with an e8m0 scale per 32. Without the roundings
// they are float32 rows.
struct V4LayerState {
  std::vector<float> window;      // [sliding_window, head_dim] ring: token s at slot s % sliding_window
  V4CompressorCarry carry;        // m > 0
  V4CompressorCarry index_carry;  // m == 4
  int64_t count = 0;              // compressed entries (and indexer keys)
  std::vector<float> entries;     // float32 layout: [count, head_dim]
  std::vector<float> index_keys;  // float32 layout: [count, index_head_dim]
  std::vector<uint8_t> entry_codes, entry_scales;  // code layout: [count, nope], [count, nope / 64]
  std::vector<float> entry_rope;                   // code layout: [count, qk_rope_head_dim]
  std::vector<uint8_t> key_codes, key_scales;      // code layout: [count, index_head_dim / 2], [count, / 32]
  // V4.1's entries in the code layout: packed e2m1 [count, head_dim / 2] and
  // an e4m3 scale per 16 values [count, head_dim / 16].
  std::vector<uint8_t> entry_fp4, entry_fp4_scales;
  size_t bytes() const;
};

struct V4State {
  int64_t length = 0;  // tokens seen
  std::vector<V4LayerState> layers;
  // V4.1's Engram: the token classes of the last engram_max_ngram_size - 1
  // positions, oldest first (the pad class before the sequence's start).
  std::vector<int32_t> engram_history;
  // V4.1 with late_index_keys: the index source whose keys were published last (-1: none yet).
  int64_t published_keys = -1;
  size_t bytes() const;
};

// Speculative decoding: what a step changes in a state's layers [l0, l1)
// before it runs (V4Model::mark), so that its last tokens can be dropped
// again (V4Model::rewind). Entries and keys only grow, so their counts and
// sizes are enough; the window ring's slots the step overwrites are copied;
// the compressors' carries keep the rows they drop (V4CompressorCarry::hold).
struct V4LayerMark {
  int64_t count = 0;
  std::vector<size_t> sizes;  // of the entry and key lists, in V4Model::rewind's order
  std::vector<float> slots;   // the window's rows of positions [start, start + n) (empty: no window yet)
};
struct V4StateMark {
  int64_t l0 = 0, l1 = 0;    // the layers marked (main layers from 0; the MTP block alone)
  int64_t start = 0, n = 0;  // the positions the step appends
  std::vector<V4LayerMark> layers;
  std::vector<int32_t> engram_history;
  int64_t published_keys = -1;
};

// Forgets a mark of st (the carries stop keeping the rows they drop).
void v4_settle(V4State& st);

// The MTP block's rows of one sequence (speculative decoding): `hidden`, the
// main model's last-layer streams [n, hc, d] of positions start .. start +
// n - 1 (or, to chain a draft, the MTP block's own), and `next`, the tokens
// that follow those positions.
struct V4DraftRequest {
  V4State* state;
  const float* hidden;
  const int32_t* next;
  int64_t start, n;
};

// What one forward pass of a batch carries from layer to layer besides the
// streams (DeepSeek-V4.1): the pre mix each token's next sub-layer collapses
// its streams with (lagged mHC; [n, hc], one-hot before the first layer),
// the Engram rows' ids, the last index source's top-k (its reader layers
// reuse it) and the candidate source's blocks (the later index sources
// choose only among their entries).
struct V4PassContext {
  std::vector<float> pin;                    // [n, hc]
  std::vector<std::vector<int32_t>> engram;  // per Engram layer: [n, columns]
  int64_t picked_layer = -1;
  std::vector<std::vector<int32_t>> picked;  // per row: entries, ascending
  bool have_candidates = false;
  std::vector<std::vector<int32_t>> candidates;  // per row: allowed blocks, ascending (empty: every block)
  // The picked entries widened from their codes, for the layers that read
  // the same (KV source, index source): per sequence, entry -> row of decoded.
  std::pair<int64_t, int64_t> decoded_for{-1, -1};
  std::vector<std::vector<int64_t>> slot;
  std::vector<std::vector<float>> decoded;
};

// The router's selection rule of a V4 config (flat top-k, no groups).
ops::ExpertSelectionConfig v4_selection_config(const V4Config& c);
// The mHC mixing of `tokens` rows, and the attention over the K=V latent
// (head_dim^-1/2 scale) of `queries` rows, as a V4 config sets them.
ops::MhcDims v4_mhc_dims(const V4Config& c, int64_t tokens);
ops::SparseMqaDims v4_attention_dims(const V4Config& c, int64_t queries);

// The roundings' blocks: the K=V latent's and the entries' fp8 (per 64), the
// indexer's fp4 (per 32).
inline constexpr int64_t kV4LatentFp8Block = 64;
inline constexpr int64_t kV4IndexFp4Block = 32;
// DeepSeek-V4.1's compressed entries: fp4 in groups of 16 with e4m3 scales.
inline constexpr int64_t kV41EntryFp4Block = 16;
// The first row a compressor's carry holds after `tokens` tokens.
int64_t v4_carry_start(int64_t tokens, int64_t ratio);

// Bytes a sequence's state holds after `tokens` tokens (every layer): the
// window, the carries and the entries and keys, in the code layout (the
// default, with the roundings) or float32, as V4State::bytes counts them.
// With mtp_tokens > 0, also the MTP block's layer after that many of its
// positions (speculative decoding).
size_t v4_state_bytes(const V4Config& c, int64_t tokens, bool codes = true, int64_t mtp_tokens = 0);

// The new tokens of one sequence in a batch forward: rows [row, row + n) of
// the batch, at positions start, start + 1, ...
struct V4Segment {
  V4State* state;
  const int32_t* ids;
  int64_t start, n, row;
};

// What a training forward keeps for the backward (model/v4_train.h), per
// layer. Rows are the batch's new tokens; compressor buffers are per
// sequence (each a fresh state: its whole prompt in one forward).
struct V4CompressorSaved {
  Buffer<float> P, Z;         // projections (+ position embedding) [tokens, width]
  std::vector<float> pooled;  // entries before their norm [entries, dim]
  std::vector<float> rstd;    // [entries]
};
// The attention's residuals, under MaxText's checkpoint names (model/remat.h;
// its compressed attention tags query_proj, kv_proj, attention_out and
// out_proj; the q-LoRA's two are MLA's):
//   query_wa_proj  qr_lin           wq_a a, before q_norm
//   mla_q          qr, rstd_qr      the q latent after q_norm
//   query_proj     q_lin, rstd_q, q the queries before the head norm; after it and RoPE
//   kv_wa_proj     kv_lin           wkv a, before kv_norm
//   kv_proj        kv, rstd_kv      the shared K=V latent after kv_norm and RoPE
//   context        o, lse           the attention kernel's output and log-sum-exp
//   attention_out  o2               the output rotated back (the projection's input)
//   out_proj       V4LayerSaved::o  the grouped projection's output
// The rest (the compressors' buffers, the key lists, the grouped
// projection's low-rank z) has no name: it is kept only while every named
// residual of the sub-layer is.
struct V4AttentionSaved {
  Buffer<float> qr_lin, qr, rstd_qr;
  Buffer<float> q_lin, rstd_q, q;  // [N, H, D]
  Buffer<float> kv_lin, rstd_kv, kv;
  std::vector<V4CompressorSaved> comp;  // per sequence (m > 0)
  Buffer<float> o, lse;
  Buffer<float> o2, z;  // z: [N, G r]
  // Every query's keys (offsets into these lists): key_seg -1 for row key_idx
  // of kv, else entry key_idx of that sequence's compressed entries.
  std::vector<int32_t> key_seg;
  std::vector<int64_t> key_idx, offsets;
};
// The tasks of a MoE layer's expert compute over rows grouped by expert
// (sizes[e] rows of expert e, in expert order, as model/stages.h's route
// leaves them, or as the exchange delivers them): first[e] is expert e's
// first row; tasks lists the experts that have rows, the largest first,
// after -1 for the shared expert (n rows) when there is one.
struct V4ExpertTasks {
  std::vector<int64_t> first, tasks;
  V4ExpertTasks() = default;
  V4ExpertTasks(const std::vector<int32_t>& sizes, bool shared, int64_t n);
  int64_t rows(int64_t e) const { return first[static_cast<size_t>(e + 1)] - first[static_cast<size_t>(e)]; }
  int64_t total() const { return first.empty() ? 0 : first.back(); }
  // Whether the tasks run on a thread each rather than one after another
  // with every thread inside each product: many experts whose products
  // (width hidden -> intermediate) are small.
  bool as_tasks(int64_t hidden, int64_t intermediate) const;
};
// A V4 expert as model/stages.h's MLP (gate w1, up w3, down w2), whose
// mlp_forward / mlp_backward run it with the config's swiglu_limit.
template <class T>
MlpParams<T> as_mlp(const V4MlpParams<T>& p) {
  return {p.w1, p.w3, p.w2};
}
// The MoE's residuals: the routed experts' w1 x, w3 x and outputs under
// moe_mlpwi_0 (or mlpwi_0), moe_mlpwi_1 and moe_mlpwo (or mlpwo), the shared
// expert's w1 x and w3 x under mlpwi_0 and mlpwi_1, as MaxText's sparse
// expert path tags them. The expert products are recomputed together when
// any of them was dropped (as model/layer.h's are). The routing stays
// (expert loads and the balance loss read it); the rest has no name.
struct V4MoeSaved {
  // The router's choice (model/stages.h's selection and route; the logits
  // are not kept): experts, combine weights, unbiased scores [N, E], and the
  // assignments sorted by expert.
  Routing r;
  std::vector<float> bias;  // the selection bias [E] (empty: none), as the forward read it
  V4ExpertTasks tasks;
  Buffer<float> g, u, y;  // routed rows, expert-major: w1 x and w3 x [N K, I], the outputs [N K, d]
  Buffer<float> sg, su;   // shared expert [N, I]
  // With expert parallelism: the exchange's plan, the rows this rank
  // computes (every rank's rows of its experts, grouped by expert: `local`)
  // and their inputs xl; g and u are then those rows' ([local rows, I]).
  ExchangePlan plan;
  V4ExpertTasks local;
  Buffer<float> xl;
};
// A layer's: its input streams X (decoder_layer_input, always kept: the
// reruns start from it), around each sub-layer the mHC mixing and the norm
// (no name), the sub-layer's residuals. Under dtype=bfloat16 the streams
// are bf16 values (each sub-layer rounds its input and output, as MaxText's
// bf16 activations) and X and X1 are held in bf16, and so are the named
// residuals (the stages round them where they are made; drop() holds them
// as bf16, rerun_layer widens them back).
struct V4LayerSaved {
  // Whether a sub-layer is whole (nothing to recompute).
  bool has_attention() const { return !a0.empty(); }
  bool has_moe() const { return !f0.empty(); }
  // Bytes held (the residual memory of a remat policy).
  size_t bytes() const;
  HeldFloats X;                                // the layer's input streams [N, hc, d]
  Buffer<float> a0, rstd_a, a, post, comb, o;  // around the attention
  V4AttentionSaved attn;
  HeldFloats X1;                                  // streams between the two sub-layers
  Buffer<float> f0, rstd_f, f, fpost, fcomb, fo;  // around the MoE
  V4MoeSaved moe;
  // V4.1: the weights that collapsed each sub-layer's input (lagged mHC:
  // the sub-layer before's pre, one-hot before the first layer) [N, hc],
  // and around Engram the streams before it [N, hc, d], the rows looked
  // up [N, columns x head dim] and their projection kv [N, (hc + 1) d].
  // Always kept (small next to the streams, or what rebuilds them).
  Buffer<float> a_pin, f_pin;
  Buffer<float> eX, e_rows, e_kv;
  // The kept named residuals as bf16 codes (each must hold bf16 values),
  // and back.
  void hold_bf16();
  void widen();

 private:
  static constexpr size_t kHeld = 15;
  std::array<Buffer<float>*, kHeld> held_buffers();
  std::array<HeldFloats, kHeld> held_;
};
// Around a head: the streams it contracts, the mhc_head output, its norm;
// V4.1's lagged mHC collapses with pre [R, hc] (the last layer's FFN mix).
struct V4HeadSaved {
  std::vector<float> X, y, rstd_y, pre;
};
// The MTP layer (depth 1): row r is token rows[r] of the batch with the
// next token ids[r] at position pos[r] of its sequence.
struct V4MtpSaved {
  std::vector<V4Segment> segs;  // the MTP rows as sequences (the MTP block's layer states)
  std::vector<int64_t> rows;
  std::vector<int32_t> ids, pos;
  std::vector<float> e0, rstd_e, e;  // the next token's embedding, before and after enorm [R, d]
  std::vector<float> h0, rstd_h, h;  // the main streams, before and after hnorm [R, hc, d]
  V4HeadSaved head;                  // its own mhc_head and norm; the block's in V4Saved::layers[L]
};
// The bytes V4Saved holds per token of sequences of `seq` tokens after a
// forward that kept `keep` (dtype=bfloat16: the streams and named
// residuals at 2 bytes): every layer's, the MTP block's and the head's.
// At or above what V4Saved::bytes() counts (the top-k lists of the
// compressed layers are taken whole); train::training_memory_bytes'
// activation estimate (model::Family::saved_bytes_per_token). V4Model::drop
// says what each name keeps.
double v4_saved_bytes_per_token(const V4Config& cfg, const RematPolicy& keep, bool bf16, int64_t seq);
struct V4Saved {
  size_t bytes() const;
  // Set before the forward: the residuals each layer keeps. A sub-layer
  // that loses one also loses its unnamed ones (and the attention the
  // streams X1 after it); rerun_layer() rebuilds what is missing with the
  // forward's own code, so the backward's result does not change.
  RematPolicy keep = RematPolicy::keep_all();
  std::vector<int32_t> ids, pos;
  std::vector<std::vector<int32_t>> engram;  // V4.1: each Engram layer's row ids [n, columns]
  std::vector<V4Segment> segs;       // the batch's sequences (their states hold the compressed entries)
  std::vector<V4LayerSaved> layers;  // the main layers (then the MTP block)
  V4HeadSaved head;                  // the last layer's output streams of logit_rows
  std::vector<int64_t> logit_rows;   // rows whose logits were computed
  std::vector<V4MtpSaved> mtp;
};

// New tokens for one sequence of a batch.
struct V4Request {
  V4State* state;
  const int32_t* ids;
  int64_t n;
};

class V4Model {
 public:
  V4Model(const V4Config& cfg, const V4View& w, V4Options opt = {});

  V4State new_state() const;
  // Appends `n` tokens to the sequence of `st` (positions continue from
  // st.length) and returns the logits of every new token [n, vocab] when
  // all_logits, else of the last one [vocab].
  std::vector<float> forward(V4State& st, const int32_t* ids, int64_t n, bool all_logits);
  // Several sequences in one forward (their projections and experts share
  // each weight read): the logits of every new token in request order, or
  // of each non-empty request's last token.
  std::vector<float> forward(const std::vector<V4Request>& batch, bool all_logits);
  // The same forward keeping what the training backward reads (the states
  // must be fresh and outlive *saved; saved may be null). With mtp_logits
  // (whole sequences, one MTP layer), also the MTP layer's logits: for each
  // sequence of n tokens, n - 1 rows predicting token t + 2 from token t's
  // main streams and token t + 1, in request order.
  std::vector<float> forward(const std::vector<V4Request>& batch, bool all_logits, V4Saved* saved,
                             std::vector<float>* mtp_logits = nullptr);
  // Speculative decoding (infer/v4_engine.h). forward(batch, all_logits)
  // keeping every new token's last-layer streams [n, hc, d] in *hidden.
  std::vector<float> forward_keep(const std::vector<V4Request>& batch, bool all_logits, std::vector<float>* hidden);
  // The MTP block over each request's rows, appended to its state's MTP
  // layer at positions start ..: the logits of each request's last row
  // [vocab] in order, and in *last its output streams [hc, d] (what a
  // chained draft reads in place of the model's).
  std::vector<float> draft(const std::vector<V4DraftRequest>& batch, std::vector<float>* last);
  // Before a step that appends at most n tokens at position `start` to
  // layers [l0, l1) of st: what rewind() needs (and the carries of those
  // layers start keeping what they drop).
  V4StateMark mark(V4State& st, int64_t l0, int64_t l1, int64_t start, int64_t n) const;
  // Drops the marked step's positions from `length` on: the layers, now at
  // position `now`, hold what a step of only the tokens before `length`
  // would have left (start <= length <= now <= start + n). For the main
  // layers st.length becomes length, and ids (the step's tokens) advance
  // V4.1's Engram history again.
  void rewind(V4State& st, const V4StateMark& mark, int64_t now, int64_t length, const int32_t* ids) const;
  // The training forward: forward(batch, true, saved, mtp_normed) stopped
  // before the LM head's product. It returns every row's normed head input
  // [n, hidden] (the logits are these rows times head_weight()^T, which a
  // fused loss takes a vocabulary chunk at a time), and with mtp_normed the
  // MTP layer's rows likewise.
  std::vector<float> forward_normed(const std::vector<V4Request>& batch, V4Saved* saved,
                                    std::vector<float>* mtp_normed = nullptr);
  // The batch-split schedule's training forward: forward_normed of several
  // batches (parts[i], keeping saved[i], its MTP rows into (*mtp_normed)[i]),
  // run a layer at a time over all of them (model/staged.h's
  // run_interleaved): while one part's expert exchange is in flight the
  // next part computes. Each part's result is what forward_normed gives it
  // alone; under FSDP each layer is acquired once for all parts.
  std::vector<std::vector<float>> forward_normed_parts(const std::vector<std::vector<V4Request>>& parts,
                                                       const std::vector<V4Saved*>& saved,
                                                       std::vector<std::vector<float>>* mtp_normed = nullptr);
  // Training under a remat policy: rebuilds the residuals of layer l (the
  // MTP block when l = num_hidden_layers) that the forward dropped, from its
  // kept input streams, with the forward's own code (the layer's state in
  // every sequence is rebuilt with them). Nothing to do when all are there.
  // A Staged task: with expert parallelism it pauses at each exchange.
  Staged rerun_layer(int64_t l, V4Saved& saved);

  // The LM head [vocab, hidden] (the embedding when tied).
  const ops::WeightView& head_weight() const { return cfg_.tie_word_embeddings ? w_.embed : w_.head; }

  const V4Config& config() const { return cfg_; }
  const V4Options& options() const { return opt_; }
  // The RoPE frequencies of a layer [qk_rope_head_dim / 2]: the compressed
  // layers' (YaRN) or the sliding-window ones'.
  const float* rope_frequencies(int64_t layer) const {
    return cfg_.compress_ratio(layer) > 0 ? freqs_compressed_.data() : freqs_window_.data();
  }

 private:
  using Segment = V4Segment;
  // One batch's pass through the model: its sequences, ids, positions and
  // streams X [n, hc, d] (X2 scratch of the same size).
  struct Pass {
    std::vector<Segment> segs;
    std::vector<int32_t> ids, pos;
    int64_t n = 0;
    Buffer<float> X, X2;
    V4PassContext cx;
  };
  // The checks, the rows and the embedding of a batch (saved set up).
  Pass begin_pass(const std::vector<V4Request>& batch, V4Saved* saved, bool mtp) const;
  // Every layer over every pass, a layer at a time (each layer's passes
  // interleaved at their expert exchanges), then the MTP block and the
  // heads: each pass's logits (or normed rows), its MTP layer's in mtp_out.
  std::vector<std::vector<float>> run_passes(std::vector<Pass>& passes, bool all_logits,
                                             const std::vector<V4Saved*>& saved,
                                             std::vector<std::vector<float>>* mtp_out, bool logits);
  // One layer (or the MTP block, l = num_hidden_layers) on the streams X
  // [n, hc, d], X2 scratch of the same size; a Staged task that pauses at
  // the expert exchange (model/staged.h).
  Staged layer_forward(Buffer<float>& X, Buffer<float>& X2, int64_t l, const std::vector<Segment>& segs,
                       const int32_t* ids, const int32_t* pos, int64_t n, V4LayerSaved* ls,
                       V4PassContext* cx = nullptr);
  // V4.1: Engram's update of the streams X [n, hc, d] before layer l.
  void engram(float* X, int64_t l, int64_t n, const V4PassContext& cx, V4LayerSaved* ls = nullptr) const;
  // V4.1: the Engram ids of a pass's rows into cx, from each sequence's
  // history (which the pass then advances: advance_engram_history).
  void engram_ids(V4PassContext& cx, const std::vector<Segment>& segs, const int32_t* ids, int64_t n) const;
  void advance_engram_history(const std::vector<Segment>& segs) const;
  // One of its sub-layers: X = mhc_post(f(rmsnorm(mhc_pre(X))), X), f the
  // attention or (ffn) the MoE; with ls, its residuals move there.
  Staged sublayer(Buffer<float>& X, Buffer<float>& X2, int64_t l, bool ffn, const std::vector<Segment>& segs,
                  const int32_t* ids, const int32_t* pos, int64_t n, V4LayerSaved* ls, V4PassContext* cx = nullptr);
  // After a training forward's layer: what saved's keep flags drop.
  void drop(V4LayerSaved& ls, const V4Saved& saved) const;
  // Both public batch forwards: with logits the head's product, else the
  // normed rows it would multiply.
  std::vector<float> run(const std::vector<V4Request>& batch, bool all_logits, V4Saved* saved,
                         std::vector<float>* mtp_out, bool logits);
  // head(rmsnorm(mhc_head(Xr))) for R rows, or without logits rmsnorm(mhc_head(Xr)).
  // V4.1 (lagged mHC): the streams are collapsed with pre [R, hc], the last
  // layer's FFN mix, instead.
  std::vector<float> head_forward(const float* Xr, int64_t R, const ops::WeightView& fn, const ops::WeightView& base,
                                  const ops::WeightView& scale, const ops::WeightView& norm, V4HeadSaved* sv,
                                  bool logits, const float* pre = nullptr);
  // The MTP layer over the main streams X of a pass: out its logits (or normed rows).
  Staged mtp_forward(std::vector<float>& out, const float* X, const std::vector<Segment>& segs,
                     const std::vector<int32_t>& ids, V4Saved* saved, bool logits);
  // The MTP block's layer over R rows: h the main streams [R, hc, d]
  // (normed in place), next the tokens that follow them, at positions pos of
  // the sequences msegs; its output streams into Xm.
  Staged mtp_layer(Buffer<float>& Xm, Buffer<float>& h, const std::vector<int32_t>& next,
                   const std::vector<int32_t>& pos, const std::vector<Segment>& msegs, V4MtpSaved* ms, V4Saved* saved);
  // The attention (model/v4_attention.cc), as stages that each fill the
  // buffers of S they find empty (all in a forward; in a remat rerun those
  // the policy dropped) from those of the stages before: the query, the
  // K=V latent, the compressors (sequence states), the indexer's choice, the
  // attention over window and entries with the sink, the grouped output
  // projection (into out unless null). keep: training (values before each
  // norm kept apart, no roundings), with sv; inference works in place.
  void attention(float* out, const float* a, int64_t layer, const std::vector<Segment>& segs, const int32_t* positions,
                 int64_t n, V4AttentionSaved* sv, V4PassContext* cx = nullptr);
  void query_stage(V4AttentionSaved& S, const float* a, int64_t layer, const int32_t* pos, int64_t n, bool keep) const;
  void kv_stage(V4AttentionSaved& S, const float* a, int64_t layer, const int32_t* pos, int64_t n, bool keep) const;
  void compress_stage(V4AttentionSaved& S, const float* a, int64_t layer, const std::vector<Segment>& segs, int64_t n,
                      bool keep);
  // Each query's compressed entries: HCA every visible one, CSA the
  // indexer's top index_topk.
  std::vector<std::vector<int32_t>> index_stage(const float* qr, const float* a, int64_t layer,
                                                const std::vector<Segment>& segs, const std::vector<int32_t>& seg_of,
                                                const int32_t* pos, int64_t n, V4PassContext* cx = nullptr) const;
  // V4.1: one query's choice from its scores over the visible entries
  // (score is changed): the candidate source's blocks kept into
  // cand (when not null), the later index sources' restricted to allowed.
  void v41_choose(std::vector<int32_t>& pk, std::vector<float>& score, std::vector<int32_t>* cand,
                  const std::vector<int32_t>* allowed) const;
  void attend_stage(V4AttentionSaved& S, int64_t layer, const std::vector<Segment>& segs,
                    const std::vector<int32_t>& seg_of, const std::vector<std::vector<int32_t>>& picked,
                    const int32_t* pos, int64_t n, bool keep, V4PassContext* cx = nullptr);
  void output_stage(float* out, V4AttentionSaved& S, int64_t layer, const int32_t* pos, int64_t n, bool keep) const;
  // The entries (or with index_keys the indexer's keys) whose windows the
  // new tokens close, appended to st in its layout. proj, when given, holds
  // the n new rows' wkv and wgate projections ([n, width] each, computed for
  // a whole batch at once); otherwise they are computed here from a.
  // With v41 (a V4.1 KV source's attention weights), also the index keys
  // (v41_index_keys), and the entries kept as values.
  void compress(V4LayerState& st, const float* a, const V4CompressorParams<ops::WeightView>& p, int64_t dim,
                int64_t ratio, bool index_keys, int64_t p0, int64_t n, V4CompressorSaved* sv,
                const std::pair<const float*, const float*>& proj = {nullptr, nullptr},
                const V4AttentionParams<ops::WeightView>* v41 = nullptr);
  // V4.1: k = k_norm(wk E) of k new entries E [k, head_dim] (normed, before
  // their RoPE), RoPE at the entries' positions, appended to st (fp4 codes
  // with the roundings, else float32).
  void v41_index_keys(V4LayerState& st, const float* E, const V4AttentionParams<ops::WeightView>& p, const int32_t* pos,
                      int64_t k) const;
  // count values of indexer keys appended to st as fp4 codes (blocks of 32).
  void store_key_codes(V4LayerState& st, const float* keys, int64_t count) const;
  Staged moe(float* out, const float* x, const int32_t* ids, int64_t layer, int64_t n, V4MoeSaved* sv);
  // The routed experts' rows ys [n K, d] (expert-major: r's sorted order,
  // et's tasks) and the shared expert's output into out, computed here, or
  // with the exchange on the ranks of their experts; g and u as V4MoeSaved
  // holds them.
  void experts_local(float* out, Buffer<float>& ys, const float* x, int64_t layer, const Routing& r,
                     const V4ExpertTasks& et, Buffer<float>* inner, V4MoeSaved* sv);
  Staged experts_exchanged(float* out, Buffer<float>& ys, const float* x, int64_t layer, const Routing& r,
                           Buffer<float>* inner, V4MoeSaved* sv);

  // The state's layer whose compressed entries (and index keys) layer l reads.
  const V4LayerState& entries_state(const V4State& st, int64_t l) const {
    return st.layers[static_cast<size_t>(cfg_.kv_source_of(l))];
  }
  // Whether compressed entries are kept as codes (with the roundings: V4's
  // fp8 with the rope dims as floats, V4.1's fp4 with e4m3 scales).
  bool entry_codes() const { return opt_.qat; }

  const V4Config& cfg_;
  const V4View& w_;
  V4Options opt_;
  std::vector<float> freqs_window_, freqs_compressed_;  // [qk_rope_head_dim / 2]
  // V4.1's Engram: each layer's hashing, the pad's class.
  std::vector<EngramLayerHash> engram_hash_;
  int32_t engram_pad_ = 0;
};

}  // namespace ds::model
