// Model configuration: the numbers that change a DeepSeek model's math.
//
// Read from a Hugging Face config.json (model_type deepseek_v3, deepseek_v2,
// deepseek_v32) or from a YAML preset with MaxText's key names plus
// `key=value` overrides. Impossible or unsupported values are errors, never
// silent defaults.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/engram_hash.h"

namespace ds::model {

enum class TopkMethod { NoauxTc, GroupLimitedGreedy, Greedy };
enum class ScoringFunc { Sigmoid, Softmax };

struct YarnScaling {
  bool enabled = false;  // false: plain RoPE (rope_scaling null)
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

struct ModelConfig {
  std::string model_type = "deepseek_v3";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP width
  int64_t moe_intermediate_size = 0;  // routed and shared expert width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  // MLA
  int64_t q_lora_rank = 0;  // 0: plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  double rope_theta = 10000.0;
  YarnScaling rope_scaling;
  int64_t max_position_embeddings = 4096;
  // MoE
  int64_t n_routed_experts = 0;  // 0: every layer dense
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  TopkMethod topk_method = TopkMethod::NoauxTc;
  ScoringFunc scoring_func = ScoringFunc::Sigmoid;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double routed_bias_update_rate = 0.0;  // aux-loss-free bias step (training)
  // Other
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t num_nextn_predict_layers = 0;  // MTP modules in the checkpoint
  // DeepSeek-V3.2 sparse-attention indexer (0 heads: none)
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;
  // The indexer's fp8 activation scales: powers of two ("ue8m0", from
  // quantization_config.scale_fmt or a top-level scale_fmt) or amax / 448.
  bool index_scale_ue8m0 = false;
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;
  // fp8 checkpoints: weight_block_size of the quantization_config ({0, 0}: none)
  int64_t fp8_block_rows = 0, fp8_block_cols = 0;
  // `deepseek quantize`'s folders (quantization_config quant_method
  // "deepseek_cpp"): a matrix may be stored as U8 rows of q8_0 or q4_k
  // blocks (model/quantize.h), told apart by their bytes a row.
  bool block_quantized = false;
  // MaxText's manifold-constrained hyper-connections (mHC, its seed-era
  // Sinkhorn) around every layer's attention and FFN: the residual is
  // mhc_expansion_rate streams (k); 1 is the plain residual. config.json:
  // mhc_expansion_rate, mhc_sinkhorn_iterations (written only when k > 1).
  int64_t mhc_expansion_rate = 1;
  int64_t mhc_sinkhorn_iterations = 20;
  // Engram (model/engram.h) before the attention of each layer listed in
  // engram_layers (MaxText's keys; empty: none): 2..N-grams
  // (engram_max_ngram_size N) hashed by engram_num_heads heads each into
  // tables of engram_head_dim columns whose sizes are primes from
  // engram_vocab_bases (one per order); a short conv of engram_kernel_size
  // taps. The hash multipliers come from engram_seed (MaxText's int32
  // scheme); the n-grams are of token ids, or of their classes with
  // engram_compress_tokens; positions before a sequence read engram_pad_id.
  std::vector<int64_t> engram_layers;
  int64_t engram_max_ngram_size = 3;
  int64_t engram_num_heads = 8;
  int64_t engram_head_dim = 0;
  std::vector<int64_t> engram_vocab_bases;
  int64_t engram_kernel_size = 4;
  int64_t engram_seed = 0;
  int64_t engram_pad_id = 0;
  // Hash token classes instead of ids (MaxText's and DeepSeek's compressed
  // tokenizer, io/token_classes.h): the table comes from the tokenizer,
  // attached by whoever reads it (model/load.h from a model folder's
  // tokenizer.json, the training config from tokenizer_path). The classes'
  // count is the compressed vocabulary V' of the hash multipliers.
  bool engram_compress_tokens = false;
  std::shared_ptr<const std::vector<int32_t>> engram_token_classes;  // [vocab_size]
  int32_t engram_class_count = 0;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool has_mhc() const { return mhc_expansion_rate > 1; }
  // Floats of one token's residual between layers: k streams of hidden_size.
  int64_t residual_width() const { return mhc_expansion_rate * hidden_size; }
  bool is_moe_layer(int64_t layer) const;
  bool has_engram() const { return !engram_layers.empty(); }
  bool has_engram(int64_t layer) const;
  // Engram's hash columns per token: (N - 1) orders times the heads.
  int64_t engram_columns() const { return (engram_max_ngram_size - 1) * engram_num_heads; }
  EngramHashSpec engram_hash_spec() const;
  // Attaches the token classes of `tokenizer_json` (a tokenizer.json path)
  // when engram_compress_tokens asks for them; ds::Error naming `who` if the
  // file is missing.
  void attach_engram_classes(const std::string& tokenizer_json, const char* who);
  // Rows of layer `layer`'s Engram table (the sum of its primes).
  int64_t engram_table_rows(int64_t layer) const;
  // (qk_nope + qk_rope)^-0.5, times mscale^2 when YaRN is active.
  double softmax_scale() const;
  // Throws ds::Error naming the first impossible or unsupported value,
  // including sizes above generous upper bounds (so no crafted config reaches
  // an allocation or a kernel with a size that overflows).
  void validate() const;
  void validate_engram() const;  // validate()'s part for the engram_* keys
  // Weights of the checkpoint this config describes (MTP layers included),
  // with checked arithmetic; ds::Error if it overflows. Stops counting once
  // the total is past the supported limit.
  int64_t parameter_count() const;

  // Hugging Face config.json (text or file).
  static ModelConfig from_hf_json_text(const std::string& text, const std::string& source = "config.json");
  static ModelConfig from_hf_json_file(const std::string& path);
  // YAML with MaxText key names; overrides are "key=value" strings applied on
  // top (values parsed as YAML scalars). Unknown keys are errors.
  static ModelConfig from_yaml_text(const std::string& text, const std::vector<std::string>& overrides = {},
                                    const std::string& source = "yaml");
  static ModelConfig from_yaml_file(const std::string& path, const std::vector<std::string>& overrides = {});
  // Whether `key` is one of the YAML model keys above (a training config
  // hands these to the model and keeps the rest).
  static bool is_yaml_key(const std::string& key);
};

}  // namespace ds::model
