// The generation engine: runs the model's one forward (model/layer.h) over
// new tokens of many sequences, with the attention over a KV cache. Latent
// caches attend in the latent space (ops/latent_attention.h); naive caches,
// fresh prompts and long continuations (expand_continuation) attend over
// expanded keys and values.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "infer/kv_cache.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/stages.h"
#include "model/weights.h"

namespace ds::infer {

class Model;
struct ModelOptions;

namespace detail {
// For tests: the float32 absorbed kv_b's size per layer up to which the CPU
// keeps that copy rather than reading kv_b itself (4 MiB); returns the
// previous value.
size_t set_small_absorbed_bytes(size_t bytes);
}  // namespace detail

// DeepSeek-V2/V3/V3.2's face to generation (infer/model.h's open_model picks it).
std::unique_ptr<Model> open_v3_model(const std::string& dir, const ModelOptions& opt);

// One thread at a time: step() fills per-layer tables on first use
// (absorbed_kv_b_), so two threads stepping one engine, even over different
// caches, race. A server runs every step on one thread (infer/batcher.h).
class Engine {
 public:
  Engine(const model::ModelConfig& cfg, const model::ParamsView& w);

  // Appends new tokens to each sequence of `cache` (tokens[s] may be empty)
  // and returns logits: for every new token in order (sequence by sequence)
  // when all_logits, else one row per sequence that received tokens (its last
  // token). Positions continue from each sequence's cached length.
  // With hidden, also each new token's last hidden state (before the final
  // norm), every row in order [N, hidden_size]: what the MTP layer reads.
  std::vector<float> step(KvCache& cache, const std::vector<std::vector<int32_t>>& tokens, bool all_logits,
                          std::vector<float>* hidden = nullptr);

  // The MTP layer (depth 1, as model/model.cc trains it) over new positions
  // of each sequence: next[s] holds the tokens that follow the positions
  // cache.seqs[s].draft_length, ... of the main model, hidden[s] the main
  // model's hidden states there [next[s].size(), hidden_size]. Appends them
  // to the MTP layer's cache (layer num_hidden_layers of a cache made with
  // one more layer) and returns the MTP logits of each sequence's last new
  // position (one row per sequence with positions, in order): its guess at
  // the token after next. `ahead`: how far past the main model's length the
  // MTP layer may go (a chained draft reads its own last hidden state in
  // place of the main model's, at a position the model has not read yet);
  // `out_hidden`, when given, gets each such sequence's last new hidden
  // state [rows, hidden_size] (before the head's norm), for the next link.
  std::vector<float> mtp_step(KvCache& cache, const std::vector<std::vector<int32_t>>& next,
                              const std::vector<const float*>& hidden, int64_t ahead = 0,
                              std::vector<float>* out_hidden = nullptr);
  // Whether the MTP layer's weights are loaded (load_model with mtp).
  bool has_mtp() const { return !w_.mtp.empty(); }

  const model::ModelConfig& config() const { return cfg_; }

  // See model::StageConfig::task_parallel_assignments; tests set it to run
  // either expert schedule.
  void set_task_parallel_assignments(int64_t n) { stages_.task_parallel_assignments = n; }

  // DeepSeek-V3.2: attend to every key and skip the indexer, i.e. run the
  // model as dense MLA (benchmarks compare the two). Off by default.
  void set_dense_attention(bool dense) { dense_attention_ = dense; }
  bool dense_attention() const { return dense_attention_; }

 private:
  const model::ModelConfig& cfg_;
  const model::ParamsView& w_;
  // The final norm `norm` and the head on rows `rows` of h [*, hidden_size].
  std::vector<float> head(const float* h, const std::vector<int64_t>& rows, const ops::WeightView& norm,
                          const int32_t* positions) const;

  model::StageConfig stages_;
  // Drops a sequence's oldest Engram conv rows beyond what the look-back needs.
  void trim_engram_rows(SequenceCache& sc) const;
  std::vector<std::vector<float>> absorbed_kv_b_;  // per layer, ops::absorb_kv_b on first decode use (device backends)
  bool dense_attention_ = false;
  friend class CacheAttention;
};

// Whether n new tokens continuing a sequence with `past` cached tokens attend
// through keys and values expanded from the cache (the tiled attention,
// threaded over heads and query tiles) rather than in the latent space (one
// task per sequence): with a latent cache, when that costs fewer
// multiply-adds; with a naive cache (already expanded), from 16 tokens on.
// Decode (few tokens) always stays in the latent space.
bool expand_continuation(const model::ModelConfig& c, int64_t past, int64_t n, bool latent_cache);

// A loaded Hugging Face model folder and an engine over it.
struct LoadedModel {
  model::ModelConfig config;
  io::SafetensorsSet files;
  model::ModelWeights weights;
  std::unique_ptr<Engine> engine;  // refers to config and weights above
};

// With mtp, the checkpoint's MTP layer too (speculative decoding).
std::unique_ptr<LoadedModel> load_model(const std::string& dir, bool mtp = false);

}  // namespace ds::infer
