// DeepSeek-V3-family forward pass for inference: embedding, MLA attention
// with a latent (or naive) KV cache, dense and DeepSeekMoE feed-forward
// layers, final norm and LM head. Float32 compute over weights kept in the
// checkpoint's dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "infer/kv_cache.h"
#include "model/config.h"
#include "model/weights.h"

namespace ds::model {

class Transformer {
 public:
  Transformer(const ModelConfig& cfg, const ModelWeights& w);

  // Appends new tokens to each sequence of `cache` (tokens[s] may be empty)
  // and returns logits: for every new token in order (sequence by sequence)
  // when all_logits, else one row per sequence that received tokens (its last
  // token). Positions continue from each sequence's cached length.
  std::vector<float> step(infer::KvCache& cache, const std::vector<std::vector<int32_t>>& tokens, bool all_logits);

  const ModelConfig& config() const { return cfg_; }

  // Up to this many token-expert assignments in a MoE layer, each active
  // expert's products are split into tasks of one parallel loop (decode);
  // above it, each expert's rows are cut into chunks that run as whole MLPs,
  // one chunk per task (prefill). Both agree to rounding; tests set it to run
  // either path.
  void set_task_parallel_assignments(int64_t n) { task_parallel_assignments_ = n; }

 private:
  struct Batch;  // the packed tokens of one step
  void attention(float* out, const float* x, const Layer& L, int64_t layer, const Batch& b, infer::KvCache& cache);
  void mlp(float* out, const float* x, const Mlp& m, int64_t rows) const;
  void moe(float* out, const float* x, const Moe& m, int64_t rows) const;
  void experts_as_tasks(float* shared_out, float* ys, const float* x, const float* xs,
                        const std::vector<int32_t>& sizes, const Moe& m, int64_t rows) const;
  void experts_in_row_tasks(float* shared_out, float* ys, const float* x, const float* xs,
                            const std::vector<int32_t>& sizes, const Moe& m, int64_t rows) const;
  int64_t task_parallel_assignments_ = 64;

  const ModelConfig& cfg_;
  const ModelWeights& w_;
  std::vector<float> rope_freqs_;
  float softmax_scale_;
  std::vector<std::vector<float>> absorbed_kv_b_;  // per layer, widened on first decode use
};

}  // namespace ds::model
