#include "model/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "core/error.h"
#include "io/text_input.h"
#include "io/token_classes.h"
#include "io/tokenizer.h"
#include "io/yaml_entries.h"
#include "model/json_fields.h"

namespace ds::model {

namespace {

using json = nlohmann::json;
using namespace json_fields;

// The engram_* keys of a config.json (written by to_hf_json).
void read_engram(ModelConfig& c, const json& j, const std::string& src) {
  c.engram_layers = get<std::vector<int64_t>>(j, "engram_layers", src);
  c.engram_max_ngram_size = get_or<int64_t>(j, "engram_max_ngram_size", 3, src);
  c.engram_num_heads = get_or<int64_t>(j, "engram_num_heads", 8, src);
  c.engram_head_dim = get<int64_t>(j, "engram_head_dim", src);
  c.engram_vocab_bases = get<std::vector<int64_t>>(j, "engram_vocab_bases", src);
  c.engram_kernel_size = get_or<int64_t>(j, "engram_kernel_size", 4, src);
  c.engram_seed = get_or<int64_t>(j, "engram_seed", 0, src);
  c.engram_pad_id = get_or<int64_t>(j, "engram_pad_id", 0, src);
  c.engram_compress_tokens = get_or<bool>(j, "engram_compress_tokens", false, src);
}

double yarn_mscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

}  // namespace

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
}

bool ModelConfig::has_engram(int64_t layer) const {
  return std::find(engram_layers.begin(), engram_layers.end(), layer) != engram_layers.end();
}

EngramHashSpec ModelConfig::engram_hash_spec() const {
  // The primes (the tables' sizes) do not depend on V'; before the classes
  // are attached the vocabulary stands in for it.
  const int64_t v = engram_compress_tokens && engram_class_count > 0 ? engram_class_count : vocab_size;
  return EngramHashSpec{engram_layers, engram_max_ngram_size, engram_num_heads, engram_vocab_bases,
                        engram_seed,   v,                     EngramHashScheme::Int32};
}

void ModelConfig::attach_engram_classes(const std::string& tokenizer_json, const char* who) {
  if (!has_engram() || !engram_compress_tokens) return;
  DS_CHECK(std::filesystem::is_regular_file(tokenizer_json),
           "{}: engram_compress_tokens hashes token classes, which come from the tokenizer, and '{}' is not a file",
           who, tokenizer_json);
  const auto c = io::engram_token_classes(io::Tokenizer::from_file(tokenizer_json), vocab_size);
  engram_token_classes = std::make_shared<const std::vector<int32_t>>(c.table);
  engram_class_count = c.count;
}

int64_t ModelConfig::engram_table_rows(int64_t layer) const {
  const auto it = std::find(engram_layers.begin(), engram_layers.end(), layer);
  DS_CHECK(it != engram_layers.end(), "internal: layer {} has no Engram", layer);
  const auto tables = engram_hash_tables(engram_hash_spec());
  return tables[static_cast<size_t>(it - engram_layers.begin())].rows;
}

double ModelConfig::softmax_scale() const {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope_scaling.enabled && rope_scaling.mscale_all_dim != 0.0) {
    const double m = yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

// Upper bounds on the sizes a config may ask for: far above every released
// DeepSeek model (V3: vocab 129280, hidden 7168, 61 layers, 128 heads, 256
// experts, 163840 positions), low enough that no product of them overflows
// before parameter_count() rejects it.
namespace limits {
constexpr int64_t kVocab = int64_t{1} << 24, kHidden = int64_t{1} << 17, kMlp = int64_t{1} << 20;
constexpr int64_t kLayers = 1 << 12, kHeads = 1 << 12, kRank = int64_t{1} << 17, kHeadDim = 1 << 12;
constexpr int64_t kPositions = int64_t{1} << 24, kExperts = 1 << 16, kMtp = 64;
constexpr int64_t kMhcStreams = 64, kSinkhornIterations = 1 << 12;
constexpr int64_t kParameters = int64_t{1} << 43;  // 8.8e12
constexpr double kMaxFloat = 1e12;
}  // namespace limits

int64_t ModelConfig::parameter_count() const {
  // Every term is checked: the caller has bounded each size, not their products.
  int64_t total = 0;
  std::vector<EngramLayerHash> engram_tables;  // computed once, on the first Engram layer
  auto add = [&](std::initializer_list<int64_t> dims, int64_t times = 1) {
    int64_t n = times;
    for (int64_t d : dims) DS_CHECK(!__builtin_mul_overflow(n, d, &n), "config: the model's size overflows 64 bits");
    DS_CHECK(!__builtin_add_overflow(total, n, &total), "config: the model's size overflows 64 bits");
  };
  const int64_t D = hidden_size, H = num_attention_heads, layers = num_hidden_layers + num_nextn_predict_layers;
  add({vocab_size, D}, tie_word_embeddings ? 1 : 2);
  for (int64_t l = 0; l < layers; ++l) {
    if (q_lora_rank > 0)
      add({q_lora_rank, D + H * qk_head_dim()});
    else
      add({H * qk_head_dim(), D});
    add({kv_lora_rank + qk_rope_head_dim, D});
    add({H * (qk_nope_head_dim + v_head_dim), kv_lora_rank});
    add({H * v_head_dim, D});
    if (index_n_heads > 0) add({index_n_heads, index_head_dim, D + q_lora_rank});
    if (is_moe_layer(std::min(l, num_hidden_layers - 1)))
      add({3 * moe_intermediate_size, D}, n_routed_experts + n_shared_experts);
    else
      add({3 * intermediate_size, D});
    if (has_mhc()) {
      // Two mHC modules: norm scale [k D], fn [(2 + k) k, k D], base [(2 + k) k], scale [3].
      const int64_t k = mhc_expansion_rate, mixes = (2 + k) * k;
      add({mixes + 1, k, D}, 2);
      add({mixes + 3}, 2);
    }
    if (l < num_hidden_layers && has_engram(l)) {
      // Table, key and value projections (with biases), input norm, three stream norms, conv.
      const int64_t G = mhc_expansion_rate, in = engram_columns() * engram_head_dim;
      if (engram_tables.empty()) engram_tables = engram_hash_tables(engram_hash_spec());
      const auto at = std::find(engram_layers.begin(), engram_layers.end(), l) - engram_layers.begin();
      add({engram_tables[static_cast<size_t>(at)].rows, engram_head_dim});
      add({G + 1, D, in + 1});
      add({D});
      add({G, D, 3 + engram_kernel_size});
    }
    // Past the limit the exact total no longer matters: thousands of layers
    // need not all be counted.
    if (total > limits::kParameters) break;
  }
  return total;
}

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* k) { DS_CHECK(v > 0, "config: {} must be positive, got {}", k, v); };
  // Upper bounds here, lower bounds below: one line naming the key and value.
  auto at_most = [](int64_t v, int64_t limit, const char* k) {
    DS_CHECK(v <= limit, "config: {} = {} is above the supported limit of {}", k, v, limit);
  };
  auto finite = [](double v, const char* k) {
    DS_CHECK(std::isfinite(v) && std::fabs(v) <= limits::kMaxFloat,
             "config: {} = {} is not a finite number of "
             "sensible size",
             k, v);
  };
  at_most(vocab_size, limits::kVocab, "vocab_size");
  at_most(hidden_size, limits::kHidden, "hidden_size");
  at_most(intermediate_size, limits::kMlp, "intermediate_size");
  at_most(moe_intermediate_size, limits::kMlp, "moe_intermediate_size");
  at_most(num_hidden_layers, limits::kLayers, "num_hidden_layers");
  at_most(num_attention_heads, limits::kHeads, "num_attention_heads");
  at_most(q_lora_rank, limits::kRank, "q_lora_rank");
  at_most(kv_lora_rank, limits::kRank, "kv_lora_rank");
  at_most(qk_nope_head_dim, limits::kHeadDim, "qk_nope_head_dim");
  at_most(qk_rope_head_dim, limits::kHeadDim, "qk_rope_head_dim");
  at_most(v_head_dim, limits::kHeadDim, "v_head_dim");
  at_most(max_position_embeddings, limits::kPositions, "max_position_embeddings");
  at_most(rope_scaling.original_max_position_embeddings, limits::kPositions,
          "rope_scaling.original_max_position_embeddings");
  at_most(n_routed_experts, limits::kExperts, "n_routed_experts");
  at_most(n_shared_experts, limits::kExperts, "n_shared_experts");
  at_most(n_group, limits::kExperts, "n_group");
  at_most(moe_layer_freq, limits::kLayers, "moe_layer_freq");
  at_most(num_nextn_predict_layers, limits::kMtp, "num_nextn_predict_layers");
  at_most(index_n_heads, limits::kHeads, "index_n_heads");
  at_most(index_head_dim, limits::kHeadDim, "index_head_dim");
  at_most(fp8_block_rows, limits::kHidden, "fp8 weight_block_size rows");
  at_most(fp8_block_cols, limits::kHidden, "fp8 weight_block_size cols");
  at_most(mhc_expansion_rate, limits::kMhcStreams, "mhc_expansion_rate");
  at_most(mhc_sinkhorn_iterations, limits::kSinkhornIterations, "sinkhorn_iterations");
  finite(rope_theta, "rope_theta");
  finite(rms_norm_eps, "rms_norm_eps");
  finite(routed_scaling_factor, "routed_scaling_factor");
  finite(routed_bias_update_rate, "routed_bias_update_rate");
  finite(rope_scaling.factor, "rope_scaling.factor");
  finite(rope_scaling.beta_fast, "rope_scaling.beta_fast");
  finite(rope_scaling.beta_slow, "rope_scaling.beta_slow");
  finite(rope_scaling.mscale, "rope_scaling.mscale");
  finite(rope_scaling.mscale_all_dim, "rope_scaling.mscale_all_dim");
  DS_CHECK(moe_layer_freq >= 1, "config: moe_layer_freq must be positive, got {}", moe_layer_freq);
  DS_CHECK(n_routed_experts >= 0, "config: n_routed_experts must be non-negative, got {}", n_routed_experts);
  DS_CHECK(index_n_heads >= 0, "config: index_n_heads must be non-negative, got {}", index_n_heads);
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(kv_lora_rank, "kv_lora_rank");
  positive(qk_nope_head_dim, "qk_nope_head_dim");
  positive(qk_rope_head_dim, "qk_rope_head_dim");
  positive(v_head_dim, "v_head_dim");
  positive(max_position_embeddings, "max_position_embeddings");
  DS_CHECK(q_lora_rank >= 0, "config: q_lora_rank must be 0 (none) or positive, got {}", q_lora_rank);
  DS_CHECK(qk_rope_head_dim % 2 == 0, "config: qk_rope_head_dim must be even for rotary pairs, got {}",
           qk_rope_head_dim);
  DS_CHECK(rope_theta > 1.0, "config: rope_theta must exceed 1, got {}", rope_theta);
  DS_CHECK(rms_norm_eps > 0.0, "config: rms_norm_eps must be positive, got {}", rms_norm_eps);
  if (rope_scaling.enabled) {
    DS_CHECK(rope_scaling.factor >= 1.0, "config: rope_scaling.factor must be >= 1, got {}", rope_scaling.factor);
    DS_CHECK(rope_scaling.original_max_position_embeddings > 0,
             "config: rope_scaling.original_max_position_embeddings must be positive");
    DS_CHECK(
        rope_scaling.beta_fast > 0 && rope_scaling.beta_slow > 0 && rope_scaling.beta_fast > rope_scaling.beta_slow,
        "config: rope_scaling needs beta_fast > beta_slow > 0 (got {} and {})", rope_scaling.beta_fast,
        rope_scaling.beta_slow);
    // Hugging Face multiplies cos/sin by mscale(mscale)/mscale(mscale_all_dim);
    // every DeepSeek checkpoint has the two equal, so the ratio is 1.
    DS_CHECK(yarn_mscale(rope_scaling.factor, rope_scaling.mscale) ==
                 yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim),
             "config: rope_scaling.mscale ({}) differs from mscale_all_dim ({}); rotary magnitude scaling is not "
             "supported",
             rope_scaling.mscale, rope_scaling.mscale_all_dim);
  }
  DS_CHECK(first_k_dense_replace >= 0 && first_k_dense_replace <= num_hidden_layers,
           "config: first_k_dense_replace {} outside [0, num_hidden_layers={}]", first_k_dense_replace,
           num_hidden_layers);
  bool any_dense = n_routed_experts == 0 || first_k_dense_replace > 0 || moe_layer_freq > 1;
  if (any_dense) positive(intermediate_size, "intermediate_size");
  if (n_routed_experts > 0) {
    positive(moe_intermediate_size, "moe_intermediate_size");
    positive(moe_layer_freq, "moe_layer_freq");
    DS_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= n_routed_experts,
             "config: num_experts_per_tok {} must be in [1, n_routed_experts={}]", num_experts_per_tok,
             n_routed_experts);
    DS_CHECK(n_shared_experts >= 0, "config: n_shared_experts must be non-negative");
    DS_CHECK(n_group >= 1 && n_routed_experts % n_group == 0, "config: n_group {} must divide n_routed_experts {}",
             n_group, n_routed_experts);
    DS_CHECK(topk_group >= 1 && topk_group <= n_group, "config: topk_group {} must be in [1, n_group={}]", topk_group,
             n_group);
    if (topk_method != TopkMethod::Greedy) {
      // The chosen groups must hold enough experts for top-k.
      DS_CHECK(topk_group * (n_routed_experts / n_group) >= num_experts_per_tok,
               "config: topk_group {} groups of {} experts cannot supply num_experts_per_tok {}", topk_group,
               n_routed_experts / n_group, num_experts_per_tok);
    }
    if (topk_method == TopkMethod::NoauxTc)
      DS_CHECK(n_routed_experts / n_group >= 2,
               "config: noaux_tc scores a group by its top-2, so groups need >= 2 "
               "experts (n_routed_experts {}, n_group {})",
               n_routed_experts, n_group);
    DS_CHECK(routed_scaling_factor > 0, "config: routed_scaling_factor must be positive, got {}",
             routed_scaling_factor);
  }
  DS_CHECK(num_nextn_predict_layers >= 0, "config: num_nextn_predict_layers must be non-negative");
  DS_CHECK(mhc_expansion_rate >= 1, "config: mhc_expansion_rate must be >= 1 (1: the plain residual), got {}",
           mhc_expansion_rate);
  DS_CHECK(mhc_sinkhorn_iterations >= 1, "config: sinkhorn_iterations must be >= 1, got {}",
           mhc_sinkhorn_iterations);
  // An MTP depth reads the main model's last hidden state and runs a layer
  // of its own; with k streams neither the state it should read (the streams
  // or their sum) nor its own residual is defined by MaxText's mHC.
  DS_CHECK(!has_mhc() || num_nextn_predict_layers == 0,
           "config: mhc_expansion_rate {} with {} multi-token prediction layers: MTP is not defined for mHC "
           "models; set mtp_num_layers: 0",
           mhc_expansion_rate, num_nextn_predict_layers);
  if (has_engram()) validate_engram();
  if (index_n_heads > 0) {
    positive(index_head_dim, "index_head_dim");
    positive(index_topk, "index_topk");
    DS_CHECK(index_head_dim >= qk_rope_head_dim, "config: index_head_dim {} must hold the rope part {}", index_head_dim,
             qk_rope_head_dim);
    DS_CHECK((index_head_dim & (index_head_dim - 1)) == 0,
             "config: index_head_dim {} must be a power of two (the indexer's Hadamard rotation)", index_head_dim);
    DS_CHECK(q_lora_rank > 0, "config: the DeepSeek-V3.2 indexer reads the q-LoRA latent; q_lora_rank must be set");
  }
  DS_CHECK(bos_token_id >= 0 && bos_token_id < vocab_size && eos_token_id >= 0 && eos_token_id < vocab_size,
           "config: bos/eos token ids ({}, {}) outside the vocabulary of {}", bos_token_id, eos_token_id, vocab_size);
  DS_CHECK((fp8_block_rows == 0) == (fp8_block_cols == 0) && fp8_block_rows >= 0 && fp8_block_cols >= 0,
           "config: fp8 weight_block_size [{}, {}] is invalid", fp8_block_rows, fp8_block_cols);
  DS_CHECK(rms_norm_eps < 1.0, "config: rms_norm_eps must be below 1, got {}", rms_norm_eps);
  if (index_n_heads > 0)
    DS_CHECK(index_topk <= max_position_embeddings, "config: index_topk {} exceeds max_position_embeddings {}",
             index_topk, max_position_embeddings);
  const int64_t params = parameter_count();
  DS_CHECK(params <= limits::kParameters,
           "config: the model would have {} or more parameters, above the supported "
           "limit of {}",
           params, limits::kParameters);
}

void ModelConfig::validate_engram() const {
  std::vector<int64_t> seen;
  for (int64_t l : engram_layers) {
    DS_CHECK(l >= 0 && l < num_hidden_layers, "config: engram_layers lists layer {}, outside [0, {})", l,
             num_hidden_layers);
    DS_CHECK(std::find(seen.begin(), seen.end(), l) == seen.end(), "config: engram_layers lists layer {} twice", l);
    seen.push_back(l);
  }
  DS_CHECK(engram_max_ngram_size >= 2 && engram_max_ngram_size <= 16,
           "config: engram_max_ngram_size must be in [2, 16], got {}", engram_max_ngram_size);
  DS_CHECK(engram_num_heads >= 1 && engram_num_heads <= 256, "config: engram_num_heads must be in [1, 256], got {}",
           engram_num_heads);
  DS_CHECK(engram_columns() <= 512, "config: Engram's {} hash columns ((engram_max_ngram_size - 1) x "
           "engram_num_heads) are above the supported 512", engram_columns());
  DS_CHECK(engram_layers.size() <= 64, "config: engram_layers lists {} layers, above the supported 64",
           engram_layers.size());
  DS_CHECK(engram_head_dim >= 1 && engram_head_dim <= limits::kHeadDim,
           "config: engram_head_dim must be in [1, {}], got {}", limits::kHeadDim, engram_head_dim);
  DS_CHECK(engram_kernel_size >= 1 && engram_kernel_size <= 64, "config: engram_kernel_size must be in [1, 64], got {}",
           engram_kernel_size);
  DS_CHECK(static_cast<int64_t>(engram_vocab_bases.size()) == engram_max_ngram_size - 1,
           "config: engram_vocab_bases needs {} entries (one per n-gram order 2..{}), got {}", engram_max_ngram_size - 1,
           engram_max_ngram_size, engram_vocab_bases.size());
  for (int64_t b : engram_vocab_bases) {
    DS_CHECK(b >= 1 && b <= (int64_t{1} << 30), "config: engram_vocab_bases entry {} outside [1, 2^30]", b);
    // Each of the order's heads gets a prime above its base: bound the tables
    // before any prime is searched for.
    DS_CHECK(b * engram_head_dim * engram_num_heads * static_cast<int64_t>(engram_layers.size()) <=
                 limits::kParameters / 2,
             "config: Engram tables from engram_vocab_bases entry {} with {} heads of {} would exceed the supported "
             "size",
             b, engram_num_heads, engram_head_dim);
  }
  DS_CHECK(engram_seed >= 0 && engram_seed <= (int64_t{1} << 40), "config: engram_seed {} outside [0, 2^40]",
           engram_seed);
  DS_CHECK(engram_pad_id >= 0 && engram_pad_id < vocab_size, "config: engram_pad_id {} outside the vocabulary of {}",
           engram_pad_id, vocab_size);
}

ModelConfig ModelConfig::from_hf_json_text(const std::string& text, const std::string& src) {
  const json j = parse_object(text, src);
  ModelConfig c;
  c.model_type = get<std::string>(j, "model_type", src);
  const bool v2 = c.model_type == "deepseek_v2";
  DS_CHECK(v2 || c.model_type == "deepseek_v3" || c.model_type == "deepseek_v32",
           "{}: model_type '{}' is not supported (deepseek_v2, deepseek_v3, deepseek_v32)", src, c.model_type);
  const std::string act = get_or<std::string>(j, "hidden_act", "silu", src);
  DS_CHECK(act == "silu", "{}: hidden_act '{}' is not supported (silu)", src, act);

  c.vocab_size = get<int64_t>(j, "vocab_size", src);
  c.hidden_size = get<int64_t>(j, "hidden_size", src);
  c.intermediate_size = get<int64_t>(j, "intermediate_size", src);
  c.num_hidden_layers = get<int64_t>(j, "num_hidden_layers", src);
  c.num_attention_heads = get<int64_t>(j, "num_attention_heads", src);
  const int64_t kv_heads = get_or<int64_t>(j, "num_key_value_heads", c.num_attention_heads, src);
  DS_CHECK(kv_heads == c.num_attention_heads,
           "{}: num_key_value_heads {} differs from num_attention_heads {}; MLA "
           "has one latent shared by all heads",
           src, kv_heads, c.num_attention_heads);
  c.q_lora_rank = get_or<int64_t>(j, "q_lora_rank", 0, src);
  c.kv_lora_rank = get<int64_t>(j, "kv_lora_rank", src);
  c.qk_nope_head_dim = get<int64_t>(j, "qk_nope_head_dim", src);
  c.qk_rope_head_dim = get<int64_t>(j, "qk_rope_head_dim", src);
  c.v_head_dim = get<int64_t>(j, "v_head_dim", src);
  c.rope_theta = get_or<double>(j, "rope_theta", 10000.0, src);
  c.max_position_embeddings = get_or<int64_t>(j, "max_position_embeddings", v2 ? 2048 : 4096, src);
  c.rope_scaling = read_rope_scaling(j, src);
  // Routing knobs default as the Hugging Face config classes do.
  c.n_routed_experts = get_or<int64_t>(j, "n_routed_experts", v2 ? 0 : 256, src);
  if (c.n_routed_experts > 0) c.moe_intermediate_size = get<int64_t>(j, "moe_intermediate_size", src);
  c.n_shared_experts = get_or<int64_t>(j, "n_shared_experts", v2 ? 0 : 1, src);
  c.num_experts_per_tok = get_or<int64_t>(j, "num_experts_per_tok", v2 ? 0 : 8, src);
  c.n_group = get_or<int64_t>(j, "n_group", v2 ? 1 : 8, src);
  c.topk_group = get_or<int64_t>(j, "topk_group", v2 ? 1 : 4, src);
  const std::string tm = get_or<std::string>(j, "topk_method", v2 ? "greedy" : "noaux_tc", src);
  if (tm == "noaux_tc")
    c.topk_method = TopkMethod::NoauxTc;
  else if (tm == "group_limited_greedy")
    c.topk_method = TopkMethod::GroupLimitedGreedy;
  else if (tm == "greedy")
    c.topk_method = TopkMethod::Greedy;
  else
    DS_FAIL("{}: topk_method '{}' is not supported (noaux_tc, group_limited_greedy, greedy)", src, tm);
  const std::string sf = get_or<std::string>(j, "scoring_func", v2 ? "softmax" : "sigmoid", src);
  if (sf == "sigmoid")
    c.scoring_func = ScoringFunc::Sigmoid;
  else if (sf == "softmax")
    c.scoring_func = ScoringFunc::Softmax;
  else
    DS_FAIL("{}: scoring_func '{}' is not supported (sigmoid, softmax)", src, sf);
  c.norm_topk_prob = get_or<bool>(j, "norm_topk_prob", !v2, src);
  c.routed_scaling_factor = get_or<double>(j, "routed_scaling_factor", v2 ? 1.0 : 2.5, src);
  c.first_k_dense_replace = get_or<int64_t>(j, "first_k_dense_replace", v2 ? 0 : 3, src);
  c.moe_layer_freq = get_or<int64_t>(j, "moe_layer_freq", 1, src);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6, src);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false, src);
  c.num_nextn_predict_layers = get_or<int64_t>(j, "num_nextn_predict_layers", 0, src);
  c.bos_token_id = get_or<int64_t>(j, "bos_token_id", 0, src);
  c.eos_token_id = get_or<int64_t>(j, "eos_token_id", 1, src);
  if (c.model_type == "deepseek_v32") {
    c.index_n_heads = get<int64_t>(j, "index_n_heads", src);
    c.index_head_dim = get<int64_t>(j, "index_head_dim", src);
    c.index_topk = get<int64_t>(j, "index_topk", src);
  }
  // DeepSeek's inference configs write scale_fmt at the top level, Hugging
  // Face's inside quantization_config; the latter wins when both are given.
  auto scale_fmt = [&](const json& o) -> std::optional<std::string> {
    if (!o.is_object() || !o.contains("scale_fmt") || o["scale_fmt"].is_null()) return std::nullopt;
    DS_CHECK(o["scale_fmt"].is_string(), "{}: scale_fmt must be a string or null", src);
    return o["scale_fmt"].get<std::string>();
  };
  std::optional<std::string> fmt = scale_fmt(j);
  if (j.contains("quantization_config"))
    if (auto q = scale_fmt(j["quantization_config"])) fmt = q;
  if (fmt) {
    DS_CHECK(*fmt == "ue8m0", "{}: scale_fmt '{}' is not supported (ue8m0, or none for amax/448 scales)", src, *fmt);
    c.index_scale_ue8m0 = true;
  }
  c.mhc_expansion_rate = get_or<int64_t>(j, "mhc_expansion_rate", 1, src);
  c.mhc_sinkhorn_iterations = get_or<int64_t>(j, "mhc_sinkhorn_iterations", 20, src);
  if (j.contains("engram_layers")) read_engram(c, j, src);
  if (j.contains("quantization_config") && !j["quantization_config"].is_null()) {
    const json& q = j["quantization_config"];
    c.block_quantized =
        read_quantization(q, get_or<std::string>(q, "quant_method", "", src), src, c.fp8_block_rows, c.fp8_block_cols);
  }
  return validated(std::move(c), src);
}

ModelConfig ModelConfig::from_hf_json_file(const std::string& path) {
  return from_hf_json_text(io::read_file(path, "config"), path);
}

namespace {

// MaxText key -> setter. Keys keep MaxText's names so its users need no glossary.
using Setter = void (*)(ModelConfig&, const YAML::Node&);
const std::map<std::string, Setter>& yaml_keys() {
  static const std::map<std::string, Setter> keys = {
#define DS_INT(key, field)                                                      \
  {                                                                             \
    key, [](ModelConfig& c, const YAML::Node& n) { c.field = n.as<int64_t>(); } \
  }
#define DS_DBL(key, field)                                                     \
  {                                                                            \
    key, [](ModelConfig& c, const YAML::Node& n) { c.field = n.as<double>(); } \
  }
#define DS_BOOL(key, field)                                                  \
  {                                                                          \
    key, [](ModelConfig& c, const YAML::Node& n) { c.field = n.as<bool>(); } \
  }
      DS_INT("vocab_size", vocab_size),
      DS_INT("base_emb_dim", hidden_size),
      DS_INT("base_mlp_dim", intermediate_size),
      DS_INT("base_moe_mlp_dim", moe_intermediate_size),
      DS_INT("base_num_decoder_layers", num_hidden_layers),
      DS_INT("base_num_query_heads", num_attention_heads),
      DS_INT("q_lora_rank", q_lora_rank),
      DS_INT("kv_lora_rank", kv_lora_rank),
      DS_INT("qk_nope_head_dim", qk_nope_head_dim),
      DS_INT("qk_rope_head_dim", qk_rope_head_dim),
      DS_INT("v_head_dim", v_head_dim),
      DS_DBL("rope_max_timescale", rope_theta),
      DS_INT("max_position_embeddings", max_position_embeddings),
      DS_INT("original_max_position_embeddings", rope_scaling.original_max_position_embeddings),
      DS_DBL("rope_factor", rope_scaling.factor),
      DS_DBL("beta_fast", rope_scaling.beta_fast),
      DS_DBL("beta_slow", rope_scaling.beta_slow),
      {"mscale", [](ModelConfig& c,
                    const YAML::Node& n) { c.rope_scaling.mscale = c.rope_scaling.mscale_all_dim = n.as<double>(); }},
      DS_INT("num_experts", n_routed_experts),
      DS_INT("shared_experts", n_shared_experts),
      DS_INT("num_experts_per_tok", num_experts_per_tok),
      DS_INT("n_routing_groups", n_group),
      DS_INT("topk_routing_group", topk_group),
      DS_DBL("routed_scaling_factor", routed_scaling_factor),
      DS_DBL("routed_bias_update_rate", routed_bias_update_rate),
      DS_INT("first_num_dense_layers", first_k_dense_replace),
      DS_INT("interleave_moe_layer_step", moe_layer_freq),
      DS_DBL("normalization_layer_epsilon", rms_norm_eps),
      DS_BOOL("logits_via_embedding", tie_word_embeddings),
      DS_INT("mtp_num_layers", num_nextn_predict_layers),
      DS_INT("indexer_n_heads", index_n_heads),
      DS_INT("indexer_head_dim", index_head_dim),
      DS_INT("indexer_topk", index_topk),
      DS_INT("mhc_expansion_rate", mhc_expansion_rate),
      DS_INT("sinkhorn_iterations", mhc_sinkhorn_iterations),
      DS_INT("engram_max_ngram_size", engram_max_ngram_size),
      DS_INT("engram_num_heads", engram_num_heads),
      DS_INT("engram_head_dim", engram_head_dim),
      DS_INT("engram_kernel_size", engram_kernel_size),
      DS_INT("engram_seed", engram_seed),
      DS_INT("engram_pad_id", engram_pad_id),
      DS_BOOL("engram_compress_tokens", engram_compress_tokens),
      {"engram_layers",
       [](ModelConfig& c, const YAML::Node& n) { c.engram_layers = n.as<std::vector<int64_t>>(); }},
      {"engram_vocab_bases",
       [](ModelConfig& c, const YAML::Node& n) { c.engram_vocab_bases = n.as<std::vector<int64_t>>(); }},
#undef DS_INT
#undef DS_DBL
#undef DS_BOOL
      {"routed_score_func",
       [](ModelConfig& c, const YAML::Node& n) {
         const auto s = n.as<std::string>();
         DS_CHECK(s == "sigmoid" || s == "softmax", "routed_score_func '{}' is not sigmoid or softmax", s);
         c.scoring_func = s == "sigmoid" ? ScoringFunc::Sigmoid : ScoringFunc::Softmax;
       }},
      {"topk_method",
       [](ModelConfig& c, const YAML::Node& n) {
         const auto s = n.as<std::string>();
         if (s == "noaux_tc")
           c.topk_method = TopkMethod::NoauxTc;
         else if (s == "group_limited_greedy")
           c.topk_method = TopkMethod::GroupLimitedGreedy;
         else if (s == "greedy")
           c.topk_method = TopkMethod::Greedy;
         else
           DS_FAIL("topk_method '{}' is not noaux_tc, group_limited_greedy or greedy", s);
       }},
      {"norm_topk_prob", [](ModelConfig& c, const YAML::Node& n) { c.norm_topk_prob = n.as<bool>(); }},
      {"use_yarn", [](ModelConfig& c, const YAML::Node& n) { c.rope_scaling.enabled = n.as<bool>(); }},
      {"model_type", [](ModelConfig& c, const YAML::Node& n) { c.model_type = n.as<std::string>(); }},
      // DeepSeek-V3.2's sparse attention (the indexer_* keys size it).
      {"use_indexer",
       [](ModelConfig& c, const YAML::Node& n) { c.model_type = n.as<bool>() ? "deepseek_v32" : "deepseek_v3"; }},
      {"decoder_block",
       [](ModelConfig&, const YAML::Node& n) {
         DS_CHECK(n.as<std::string>() == "deepseek", "decoder_block '{}' is not supported (deepseek)",
                  n.as<std::string>());
       }},
  };
  return keys;
}

void apply_yaml_key(ModelConfig& c, const std::string& key, const YAML::Node& value, const std::string& src) {
  const auto& keys = yaml_keys();
  auto it = keys.find(key);
  if (it == keys.end()) {
    std::string known;
    for (const auto& [k, _] : keys) known += (known.empty() ? "" : ", ") + k;
    DS_FAIL("{}: unknown key '{}' (known: {})", src, key, known);
  }
  try {
    it->second(c, value);
  } catch (const YAML::Exception& e) {
    DS_FAIL("{}: key '{}' has a value of the wrong type: {}", src, key, e.what());
  }
}

}  // namespace

ModelConfig ModelConfig::from_yaml_text(const std::string& text, const std::vector<std::string>& overrides,
                                        const std::string& src) {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.rope_scaling.enabled = false;
  c.rope_scaling.mscale = c.rope_scaling.mscale_all_dim = 1.0;  // MaxText's default mscale
  for (const auto& e : io::yaml_entries(text, overrides, src, "override")) apply_yaml_key(c, e.key, e.value, e.where);
  // A preset that sets a YaRN factor above 1 means YaRN, as MaxText does.
  if (c.rope_scaling.factor > 1.0) c.rope_scaling.enabled = true;
  // The indexer: MaxText's defaults for what use_indexer leaves unset; its
  // keys without use_indexer would be silently ignored there, so an error here.
  if (c.model_type == "deepseek_v32") {
    if (c.index_n_heads == 0) c.index_n_heads = 64;
    if (c.index_head_dim == 0) c.index_head_dim = 128;
    if (c.index_topk == 0) c.index_topk = 2048;
  } else {
    DS_CHECK(c.index_n_heads == 0 && c.index_head_dim == 0 && c.index_topk == 0,
             "{}: indexer_n_heads, indexer_head_dim and indexer_topk need use_indexer: true", src);
  }
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", src, e.what()));
  }
  return c;
}

bool ModelConfig::is_yaml_key(const std::string& key) { return yaml_keys().count(key) > 0; }

ModelConfig ModelConfig::from_yaml_file(const std::string& path, const std::vector<std::string>& overrides) {
  return from_yaml_text(io::read_file(path, "preset"), overrides, path);
}

}  // namespace ds::model
