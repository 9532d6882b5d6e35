// DeepSeek-V4's configuration (Hugging Face model_type deepseek_v4: V4-Flash,
// V4-Pro and their -Base checkpoints), read from the folder's config.json.
//
// Each layer's attention kind comes from compress_ratios (0: sliding window
// only, 4: compressed sparse attention with the lightning indexer, 128:
// heavily compressed attention); the list holds num_hidden_layers entries
// plus one per MTP layer. Configs written by Hugging Face's own class carry
// layer_types (and compress_rates) instead; both are read.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/engram_hash.h"

namespace ds::model {

enum class V4Scoring { SqrtSoftplus, Sigmoid, Softmax };

// Which release's architecture: DeepSeek-V4, or DeepSeek-V4.1 (model_type
// deepseek_v41), whose backbone differs in ways the fields below switch:
// CSA2 (compressed KV and index keys shared from source layers, ratios 1
// and 2, no HCA, no position embedding in the compressors), lagged
// single-pass mHC without hc_head, no per-head query norm, the fp8 window
// and fp4 entry roundings in blocks of 32 and 16, no Hadamard rotation in
// the indexer, and Engram layers.
enum class V4Generation { V4, V41 };

struct V4Config {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;  // d
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;  // H query heads over one shared K=V head
  int64_t head_dim = 0;             // D = nope + rope
  int64_t qk_rope_head_dim = 0;     // R, the rotated tail of every head
  int64_t q_lora_rank = 0;
  int64_t o_groups = 0, o_lora_rank = 0;
  int64_t sliding_window = 0;
  std::vector<int64_t> compress_ratios;  // main layers, then MTP layers (missing MTP entries: 0)
  double rope_theta = 10000.0;           // m = 0 layers: plain RoPE
  double compress_rope_theta = 0.0;      // m > 0 layers, with YaRN when rope_scaling is set
  YarnScaling rope_scaling;              // magnitude scaling is never applied in V4
  int64_t max_position_embeddings = 0;
  // MoE (every layer)
  int64_t n_routed_experts = 0, n_shared_experts = 0, num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  V4Scoring scoring_func = V4Scoring::SqrtSoftplus;
  double routed_scaling_factor = 1.0;
  int64_t num_hash_layers = 0;       // the first layers route by token id (ffn.gate.tid2eid)
  double swiglu_limit = 0.0;         // 0: no clamp
  std::string expert_dtype = "fp8";  // routed experts: "fp4" (packed e2m1, e8m0 per 32) or "fp8"
  // Lightning indexer (CSA layers)
  int64_t index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  // mHC
  int64_t hc_mult = 0, hc_sinkhorn_iters = 0;
  double hc_eps = 1e-6;
  double rms_norm_eps = 1e-6;
  int64_t num_nextn_predict_layers = 0;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = 0, eos_token_id = 1;
  int64_t fp8_block_rows = 128, fp8_block_cols = 128;
  // A `deepseek quantize` folder (quantization_config quant_method deepseek_cpp):
  // its U8 matrices are rows of q8_0, q4_k, q4_1 or q6_k blocks.
  bool block_quantized = false;

  V4Generation generation = V4Generation::V4;
  // CSA2 (V4.1): the layers that own a compressor (their entries and index
  // keys are the compressed cache of every later layer up to the next
  // source), the layers that run the indexer (their top-k serves the
  // layers up to the next), and the one whose candidate blocks (the best
  // candidate_topk_blocks blocks of candidate_block_size entries) restrict
  // the index sources after it (-1: none).
  std::vector<int64_t> kv_source_layers, index_source_layers;
  int64_t candidate_source_layer = -1, candidate_topk_blocks = 0, candidate_block_size = 0;
  // Engram (V4.1, model/engram_v41.h) before each layer of engram_layers:
  // (N - 1) orders of engram_heads hashes (N = engram_max_ngram_size) into
  // tables of engram_num_embeddings rows of engram_head_dim, primes from
  // engram_vocab_base, int64 multipliers from the compressed vocabulary of
  // engram_compressed_vocab classes (engram_token_classes, from the
  // folder's tokenizer.json); missing history reads engram_pad_id's class.
  std::vector<int64_t> engram_layers, engram_num_embeddings;
  int64_t engram_max_ngram_size = 0, engram_heads = 0, engram_head_dim = 0, engram_vocab_base = 0;
  int64_t engram_pad_id = 2, engram_compressed_vocab = 0;
  std::shared_ptr<const std::vector<int32_t>> engram_token_classes;  // [vocab_size]
  int64_t image_token_id = -1;

  bool v41() const { return generation == V4Generation::V41; }
  // The per-head RMS norm of the query (V4), the lagged mHC (V4.1).
  bool q_head_norm() const { return !v41(); }
  bool lagged_mhc() const { return v41(); }
  // Whether layer l computes compressed entries (V4: every m > 0 layer) and
  // runs the indexer (V4: m = 4), and the layers whose entries and top-k a
  // compressed layer l reads (V4: itself).
  bool owns_compressor(int64_t l) const;
  bool owns_indexer(int64_t l) const;
  int64_t kv_source_of(int64_t l) const;
  int64_t index_source_of(int64_t l) const;
  // Whether layer l's attention picks entries through an indexer (V4: CSA, m = 4; V4.1: every m > 0).
  bool sparse_entries(int64_t l) const { return v41() ? compress_ratio(l) > 0 : compress_ratio(l) == 4; }
  // Layer l's place in engram_layers (-1: no Engram before it).
  int64_t engram_slot(int64_t l) const;
  int64_t engram_columns() const { return (engram_max_ngram_size - 1) * engram_heads; }
  // The fp8 rounding of the window's K=V vectors: over the non-rope dims in
  // blocks of 64 (V4) or over all of them in blocks of 32 (V4.1).
  int64_t window_fp8_block() const { return v41() ? 32 : 64; }
  // DeepSeek-V4.1's token classes from a tokenizer.json (checked against
  // engram_compressed_vocab); nothing to do without Engram layers.
  void attach_engram_classes(const std::string& tokenizer_json);

  int64_t nope_dim() const { return head_dim - qk_rope_head_dim; }
  // m of main layer l (l < num_hidden_layers) or MTP layer l - num_hidden_layers.
  int64_t compress_ratio(int64_t layer) const;
  bool hash_routed(int64_t layer) const { return layer < num_hash_layers && layer < num_hidden_layers; }
  void validate() const;
  void validate_v41() const;  // validate()'s part for V4.1's fields
  nlohmann::json to_v41_json() const;
  // Weights of the main model (embedding, layers, head; MTP not counted).
  int64_t parameter_count() const;

  static V4Config from_hf_json_text(const std::string& text, const std::string& source = "config.json");
  // DeepSeek-V4.1's config.json (model/v41_config.cc): the released layout
  // (model_type deepseek_v41 with the text model's keys in text_config) or
  // the official inference code's flat ModelArgs names.
  static V4Config from_v41_json(const nlohmann::json& j, const std::string& source);
  // The fields both releases name alike (from_hf_json_text's work, unchecked).
  static V4Config read_hf_fields(const nlohmann::json& j, const std::string& source);
  // Engram's hashing (model/engram_hash.h, DeepSeek's int64 scheme).
  EngramHashSpec engram_hash_spec() const;
  static V4Config from_hf_json_file(const std::string& path);
  // config.json for this config (weights in float dtypes: no
  // quantization_config); from_hf_json_text reads it back to the same config.
  nlohmann::json to_hf_json() const;

  // MaxText's keys for a DeepSeek-V4 model (decoder_block deepseek4, as its
  // deepseek4-284b.yml spells them), each with the Hugging Face field it
  // sets: base_emb_dim, base_num_query_heads, base_num_kv_heads (1),
  // base_num_decoder_layers, base_moe_mlp_dim (base_mlp_dim, when given,
  // must equal it: V4 has no dense MLP), vocab_size, head_dim,
  // qk_rope_head_dim (64), q_lora_rank, o_groups, o_lora_rank,
  // sliding_window_size, compress_ratios, mhc_expansion_rate (hc_mult),
  // sinkhorn_iterations (hc_sinkhorn_iters, 20), hc_eps (1e-6),
  // first_num_hash_layers, indexer_n_heads / indexer_head_dim /
  // indexer_topk, num_experts, num_experts_per_tok, shared_experts (1),
  // routed_score_func (sqrtsoftplus), routed_scaling_factor,
  // mlp_activations_limit (swiglu_limit), rope_max_timescale,
  // compressed_rope_max_timescale, rope_type (default, or yarn with
  // rope_factor, original_max_position_embeddings, beta_fast, beta_slow:
  // YaRN on the compressed layers, as DeepSeek's checkpoints), max_position_embeddings,
  // normalization_layer_epsilon, logits_via_embedding; and, checked only:
  // decoder_block, attention_type (compressed), mlp_activations
  // ([silu, linear]), enable_dropout (false). `entries` are key / value in
  // order (a later one wins); `source` names them in errors.
  static V4Config from_maxtext(const std::vector<std::pair<std::string, nlohmann::json>>& entries,
                               const std::string& source);
  static bool is_maxtext_key(const std::string& key);
};

// Whether a config.json object is DeepSeek-V4.1's official flat one.
bool v41_flat_config(const nlohmann::json& j);

// The model_type of a config.json ("" when it has none): which loader a
// folder needs. DeepSeek-V4.1's official flat config (no model_type, the
// ModelArgs names with engram_layer_ids or kv_source_layers) reads as
// deepseek_v41.
std::string config_model_type(const std::string& config_json_path);
bool is_v4_model_type(const std::string& model_type);  // deepseek_v4 or deepseek_v41

}  // namespace ds::model
