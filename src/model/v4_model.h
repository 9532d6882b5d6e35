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
// (fp8 / fp4 widened inside the kernels), activations are float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/v4_config.h"
#include "model/v4_weights.h"

namespace ds::model {

struct V4Options {
  bool qat = true;  // the fp8 / fp4 roundings of DeepSeek's inference code
};

// A compressor's pending rows: the projections (P, Z with the position
// embedding added) of the tokens from `start` on that a later entry still
// pools: the open window, and with overlap the complete one before it.
struct V4CompressorCarry {
  int64_t start = 0;
  std::vector<float> P, Z;  // [rows, width]
};

// What one layer keeps of one sequence between forwards.
struct V4LayerState {
  std::vector<float> window;      // [sliding_window, head_dim] ring: token s at slot s % sliding_window
  V4CompressorCarry carry;        // m > 0
  std::vector<float> entries;     // m > 0: compressed K=V entries [count, head_dim]
  V4CompressorCarry index_carry;  // m == 4
  std::vector<float> index_keys;  // m == 4: the indexer's keys [count, index_head_dim]
  size_t bytes() const;
};

struct V4State {
  int64_t length = 0;  // tokens seen
  std::vector<V4LayerState> layers;
  size_t bytes() const;
};

// Bytes a sequence's state holds after `tokens` tokens (float32 storage,
// every layer): the window, the carries and the entries, as V4State::bytes
// counts them.
size_t v4_state_bytes(const V4Config& c, int64_t tokens);

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

  const V4Config& config() const { return cfg_; }
  const V4Options& options() const { return opt_; }

 private:
  // The new tokens of one sequence: rows [row, row + n) of the batch, at
  // positions start, start + 1, ...
  struct Segment {
    V4State* state;
    const int32_t* ids;
    int64_t start, n, row;
  };
  void attention(float* out, const float* a, int64_t layer, const std::vector<Segment>& segs, const int32_t* positions,
                 int64_t n);
  void compress(std::vector<float>& entries, V4CompressorCarry& carry, const float* a,
                const V4CompressorParams<ops::WeightView>& p, int64_t dim, int64_t ratio, bool index_keys, int64_t p0,
                int64_t n);
  void moe(float* out, const float* x, const int32_t* ids, int64_t layer, int64_t n);

  const V4Config& cfg_;
  const V4View& w_;
  V4Options opt_;
  std::vector<float> freqs_window_, freqs_compressed_;  // [qk_rope_head_dim / 2]
};

}  // namespace ds::model
