#include "model/v4_config.h"

#include <fmt/format.h>

#include <cmath>
#include <initializer_list>
#include <map>
#include <set>
#include <tuple>

#include "core/error.h"
#include "io/text_input.h"
#include "model/json_fields.h"

namespace ds::model {

namespace {

using namespace json_fields;

// Far above V4-Pro (d 7168, 61 layers, 128 heads, 384 experts, 1M
// positions), low enough that no product of two of them overflows.
constexpr int64_t kVocab = int64_t{1} << 24, kHidden = int64_t{1} << 17, kLayers = 1 << 12, kHeads = 1 << 12;
constexpr int64_t kHeadDim = 1 << 12, kExperts = 1 << 16, kWidth = int64_t{1} << 20, kPositions = int64_t{1} << 26;
constexpr int64_t kParameters = int64_t{1} << 43;

std::vector<int64_t> int_list(const json& v, const char* key, const std::string& src) {
  DS_CHECK(v.is_array() && static_cast<int64_t>(v.size()) <= kLayers, "{}: key '{}' must be an array of integers", src,
           key);
  std::vector<int64_t> out;
  for (const json& e : v) out.push_back(strict_int(e, key, src));
  return out;
}

}  // namespace

int64_t V4Config::compress_ratio(int64_t layer) const {
  DS_CHECK(layer >= 0 && layer < num_hidden_layers + num_nextn_predict_layers, "internal: layer {} out of range",
           layer);
  return layer < static_cast<int64_t>(compress_ratios.size()) ? compress_ratios[static_cast<size_t>(layer)] : 0;
}

int64_t V4Config::parameter_count() const {
  int64_t total = 0;
  auto add = [&](std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) DS_CHECK(!__builtin_mul_overflow(n, d, &n), "config: the model's size overflows 64 bits");
    DS_CHECK(!__builtin_add_overflow(total, n, &total), "config: the model's size overflows 64 bits");
  };
  const int64_t d = hidden_size, H = num_attention_heads, D = head_dim, n = hc_mult;
  add({vocab_size, d});
  if (!tie_word_embeddings) add({vocab_size, d});
  for (int64_t l = 0; l < num_hidden_layers && total <= kParameters; ++l) {
    add({2 * (2 + n) * n, n * d});
    add({q_lora_rank, d + H * D});
    add({D, d});
    add({o_groups * o_lora_rank, H * D / std::max<int64_t>(o_groups, 1) + d});
    const int64_t m = compress_ratio(l);
    if (owns_compressor(l)) add({(m == 4 ? 4 : 2) * D, d});
    if (owns_indexer(l)) add({index_n_heads * index_head_dim, q_lora_rank + d});
    if (engram_slot(l) >= 0) {
      add({engram_num_embeddings[static_cast<size_t>(engram_slot(l))], engram_head_dim});
      add({(n + 1) * d, engram_columns() * engram_head_dim});
    }
    add({n_routed_experts, d});
    add({3 * moe_intermediate_size, d, n_routed_experts + n_shared_experts});
  }
  return total;
}

void V4Config::validate() const {
  auto in_range = [](int64_t v, int64_t lo, int64_t hi, const char* k) {
    DS_CHECK(v >= lo && v <= hi, "config: {} = {} is outside the supported range [{}, {}]", k, v, lo, hi);
  };
  auto finite = [](double v, const char* k) {
    DS_CHECK(std::isfinite(v) && std::fabs(v) <= 1e12, "config: {} = {} is not a finite number of sensible size", k, v);
  };
  in_range(vocab_size, 1, kVocab, "vocab_size");
  in_range(hidden_size, 1, kHidden, "hidden_size");
  in_range(num_hidden_layers, 1, kLayers, "num_hidden_layers");
  in_range(num_attention_heads, 1, kHeads, "num_attention_heads");
  in_range(head_dim, 2, kHeadDim, "head_dim");
  in_range(qk_rope_head_dim, 2, head_dim, "qk_rope_head_dim");
  in_range(q_lora_rank, 1, kWidth, "q_lora_rank");
  in_range(o_groups, 1, num_attention_heads, "o_groups");
  in_range(o_lora_rank, 1, kWidth, "o_lora_rank");
  in_range(sliding_window, 1, int64_t{1} << 16, "sliding_window");
  in_range(max_position_embeddings, 1, kPositions, "max_position_embeddings");
  in_range(n_routed_experts, 1, kExperts, "n_routed_experts");
  in_range(n_shared_experts, 0, 1, "n_shared_experts");
  in_range(num_experts_per_tok, 1, n_routed_experts, "num_experts_per_tok");
  in_range(moe_intermediate_size, 1, kWidth, "moe_intermediate_size");
  in_range(num_hash_layers, 0, num_hidden_layers, "num_hash_layers");
  in_range(hc_mult, 1, 64, "hc_mult");
  in_range(hc_sinkhorn_iters, 1, 1000, "hc_sinkhorn_iters");
  in_range(num_nextn_predict_layers, 0, 64, "num_nextn_predict_layers");
  in_range(bos_token_id, 0, vocab_size - 1, "bos_token_id");
  in_range(eos_token_id, 0, vocab_size - 1, "eos_token_id");
  finite(rope_theta, "rope_theta");
  finite(compress_rope_theta, "compress_rope_theta");
  finite(routed_scaling_factor, "routed_scaling_factor");
  finite(swiglu_limit, "swiglu_limit");
  finite(hc_eps, "hc_eps");
  finite(rms_norm_eps, "rms_norm_eps");
  finite(rope_scaling.factor, "rope_scaling.factor");
  DS_CHECK(qk_rope_head_dim % 2 == 0, "config: qk_rope_head_dim {} must be even (rotary pairs)", qk_rope_head_dim);
  if (v41())
    DS_CHECK(head_dim % 32 == 0, "config: head_dim {} must be a multiple of 32 (the K=V vectors' fp8 blocks)",
             head_dim);
  else
    DS_CHECK(nope_dim() % 64 == 0,
             "config: head_dim - qk_rope_head_dim = {} must be a multiple of 64 (the K=V latent's fp8 blocks)",
             nope_dim());
  DS_CHECK(num_attention_heads % o_groups == 0, "config: num_attention_heads {} must be a multiple of o_groups {}",
           num_attention_heads, o_groups);
  DS_CHECK(rope_theta > 1.0, "config: rope_theta must exceed 1, got {}", rope_theta);
  DS_CHECK(rms_norm_eps > 0 && rms_norm_eps < 1, "config: rms_norm_eps must be in (0, 1), got {}", rms_norm_eps);
  DS_CHECK(hc_eps >= 0 && hc_eps < 1, "config: hc_eps must be in [0, 1), got {}", hc_eps);
  DS_CHECK(swiglu_limit >= 0, "config: swiglu_limit must be >= 0 (0: none), got {}", swiglu_limit);
  DS_CHECK(routed_scaling_factor > 0, "config: routed_scaling_factor must be positive, got {}", routed_scaling_factor);
  DS_CHECK(expert_dtype == "fp4" || expert_dtype == "fp8", "config: expert_dtype '{}' is not supported (fp4, fp8)",
           expert_dtype);
  if (expert_dtype == "fp4")
    DS_CHECK(hidden_size % 32 == 0 && moe_intermediate_size % 32 == 0,
             "config: fp4 experts need hidden_size and moe_intermediate_size multiples of 32 (got {}, {})", hidden_size,
             moe_intermediate_size);
  DS_CHECK(static_cast<int64_t>(compress_ratios.size()) >= num_hidden_layers,
           "config: compress_ratios has {} entries, fewer than num_hidden_layers {}", compress_ratios.size(),
           num_hidden_layers);
  bool any_compressed = false, any_csa = false;
  for (size_t l = 0; l < compress_ratios.size(); ++l) {
    const int64_t m = compress_ratios[l];
    if (v41())
      DS_CHECK(m >= 0 && m <= 2, "config: compress_ratios[{}] = {} is not a DeepSeek-V4.1 ratio (0, 1, 2)", l, m);
    else
      DS_CHECK(m == 0 || m == 4 || m == 128 || (m > 1 && m <= 1024 && static_cast<int64_t>(l) < num_hidden_layers),
               "config: compress_ratios[{}] = {} is not supported (0, 4, or a ratio in [2, 1024])", l, m);
    if (static_cast<int64_t>(l) >= num_hidden_layers) {
      if (v41()) continue;  // the DSpark draft stages' entries, not loaded
      DS_CHECK(m == 0, "config: compress_ratios[{}] = {}: MTP layers attend over the sliding window only", l, m);
      continue;
    }
    any_compressed |= m > 0;
    any_csa |= sparse_entries(static_cast<int64_t>(l));
  }
  if (any_compressed) DS_CHECK(compress_rope_theta > 1.0, "config: compress_rope_theta must exceed 1");
  if (any_csa) {
    in_range(index_n_heads, 1, kHeads, "index_n_heads");
    in_range(index_head_dim, qk_rope_head_dim, kHeadDim, "index_head_dim");
    in_range(index_topk, 1, kPositions, "index_topk");
    if (v41())
      DS_CHECK(index_head_dim % 32 == 0, "config: index_head_dim {} must be a multiple of 32 (fp4 blocks)",
               index_head_dim);
    else
      DS_CHECK((index_head_dim & (index_head_dim - 1)) == 0 && index_head_dim % 32 == 0,
               "config: index_head_dim {} must be a power of two and a multiple of 32 (Hadamard rotation, fp4 blocks)",
               index_head_dim);
  }
  if (v41()) validate_v41();
  if (rope_scaling.enabled) {
    DS_CHECK(rope_scaling.factor >= 1.0, "config: rope_scaling.factor must be >= 1, got {}", rope_scaling.factor);
    in_range(rope_scaling.original_max_position_embeddings, 1, kPositions,
             "rope_scaling.original_max_position_embeddings");
    DS_CHECK(rope_scaling.beta_fast > rope_scaling.beta_slow && rope_scaling.beta_slow > 0,
             "config: rope_scaling needs beta_fast > beta_slow > 0 (got {} and {})", rope_scaling.beta_fast,
             rope_scaling.beta_slow);
  }
  in_range(fp8_block_rows, 1, kHidden, "fp8 weight_block_size rows");
  in_range(fp8_block_cols, 1, kHidden, "fp8 weight_block_size cols");
  const int64_t params = parameter_count();
  DS_CHECK(params <= kParameters, "config: the model would have {} or more parameters, above the supported limit",
           params);
}

V4Config V4Config::from_hf_json_text(const std::string& text, const std::string& src) {
  const json j = parse_object(text, src);
  if (v41_flat_config(j) || get_or<std::string>(j, "model_type", "", src) == "deepseek_v41")
    return from_v41_json(j, src);
  const std::string type = get<std::string>(j, "model_type", src);
  DS_CHECK(type == "deepseek_v4", "{}: model_type '{}' is not deepseek_v4", src, type);
  return validated(read_hf_fields(j, src), src);
}

V4Config V4Config::read_hf_fields(const json& j, const std::string& src) {
  const std::string act = get_or<std::string>(j, "hidden_act", "silu", src);
  DS_CHECK(act == "silu", "{}: hidden_act '{}' is not supported (silu)", src, act);
  V4Config c;
  c.vocab_size = get<int64_t>(j, "vocab_size", src);
  c.hidden_size = get<int64_t>(j, "hidden_size", src);
  c.num_hidden_layers = get<int64_t>(j, "num_hidden_layers", src);
  c.num_attention_heads = get<int64_t>(j, "num_attention_heads", src);
  const int64_t kv_heads = get_or<int64_t>(j, "num_key_value_heads", 1, src);
  DS_CHECK(kv_heads == 1, "{}: num_key_value_heads {}: DeepSeek-V4 has one shared K=V head", src, kv_heads);
  c.head_dim = get<int64_t>(j, "head_dim", src);
  c.qk_rope_head_dim = get<int64_t>(j, "qk_rope_head_dim", src);
  c.q_lora_rank = get<int64_t>(j, "q_lora_rank", src);
  c.o_groups = get<int64_t>(j, "o_groups", src);
  c.o_lora_rank = get<int64_t>(j, "o_lora_rank", src);
  c.sliding_window = get<int64_t>(j, "sliding_window", src);
  if (j.contains("compress_ratios") && !j["compress_ratios"].is_null()) {
    c.compress_ratios = int_list(j["compress_ratios"], "compress_ratios", src);
  } else {
    // Hugging Face's own class writes the kinds by name.
    DS_CHECK(j.contains("layer_types") && j["layer_types"].is_array(),
             "{}: neither compress_ratios nor layer_types is given", src);
    std::map<std::string, int64_t> rate = {
        {"sliding_attention", 0}, {"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}};
    if (j.contains("compress_rates") && j["compress_rates"].is_object())
      for (auto& [k, v] : j["compress_rates"].items())
        if (rate.count(k) && k != "sliding_attention") rate[k] = strict_int(v, "compress_rates", src);
    DS_CHECK(static_cast<int64_t>(j["layer_types"].size()) <= kLayers, "{}: layer_types is too long", src);
    for (const json& t : j["layer_types"]) {
      DS_CHECK(t.is_string() && rate.count(t.get<std::string>()), "{}: unknown layer type {}", src, brief(t));
      c.compress_ratios.push_back(rate[t.get<std::string>()]);
    }
  }
  c.rope_theta = get_or<double>(j, "rope_theta", 10000.0, src);
  c.compress_rope_theta = get_or<double>(j, "compress_rope_theta", 0.0, src);
  c.rope_scaling = read_rope_scaling(j, src);
  c.max_position_embeddings = get_or<int64_t>(j, "max_position_embeddings", 1 << 20, src);
  c.n_routed_experts = get<int64_t>(j, "n_routed_experts", src);
  c.n_shared_experts = get_or<int64_t>(j, "n_shared_experts", 1, src);
  c.num_experts_per_tok = get<int64_t>(j, "num_experts_per_tok", src);
  c.moe_intermediate_size = get<int64_t>(j, "moe_intermediate_size", src);
  const std::string sf = get_or<std::string>(j, "scoring_func", "sqrtsoftplus", src);
  if (sf == "sqrtsoftplus")
    c.scoring_func = V4Scoring::SqrtSoftplus;
  else if (sf == "sigmoid")
    c.scoring_func = V4Scoring::Sigmoid;
  else if (sf == "softmax")
    c.scoring_func = V4Scoring::Softmax;
  else
    DS_FAIL("{}: scoring_func '{}' is not supported (sqrtsoftplus, sigmoid, softmax)", src, sf);
  c.routed_scaling_factor = get_or<double>(j, "routed_scaling_factor", 1.0, src);
  c.num_hash_layers = get_or<int64_t>(j, "num_hash_layers", 0, src);
  c.swiglu_limit = get_or<double>(j, "swiglu_limit", 0.0, src);
  c.expert_dtype = get_or<std::string>(j, "expert_dtype", "fp8", src);
  c.index_n_heads = get_or<int64_t>(j, "index_n_heads", 0, src);
  c.index_head_dim = get_or<int64_t>(j, "index_head_dim", 0, src);
  c.index_topk = get_or<int64_t>(j, "index_topk", 0, src);
  c.hc_mult = get<int64_t>(j, "hc_mult", src);
  c.hc_sinkhorn_iters = get<int64_t>(j, "hc_sinkhorn_iters", src);
  c.hc_eps = get<double>(j, "hc_eps", src);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6, src);
  c.num_nextn_predict_layers = get_or<int64_t>(j, "num_nextn_predict_layers", 0, src);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false, src);
  c.bos_token_id = get_or<int64_t>(j, "bos_token_id", 0, src);
  c.eos_token_id = get_or<int64_t>(j, "eos_token_id", 1, src);
  if (j.contains("quantization_config") && !j["quantization_config"].is_null()) {
    const json& q = j["quantization_config"];
    DS_CHECK(q.is_object(), "{}: quantization_config must be an object", src);
    c.block_quantized = read_quantization(q, get_or<std::string>(q, "quant_method", "fp8", src), src, c.fp8_block_rows,
                                          c.fp8_block_cols);
    // The K=V latent's fp8 simulation uses power-of-two scales, the rule of
    // every released V4 checkpoint.
    const std::string scale = get_or<std::string>(q, "scale_fmt", "ue8m0", src);
    DS_CHECK(scale == "ue8m0", "{}: scale_fmt '{}' is not supported (ue8m0)", src, scale);
  }
  return c;
}

V4Config V4Config::from_hf_json_file(const std::string& path) {
  return from_hf_json_text(io::read_file(path, "config"), path);
}

json V4Config::to_hf_json() const {
  if (v41()) return to_v41_json();
  json j = {{"model_type", "deepseek_v4"},
            {"architectures", {"DeepseekV4ForCausalLM"}},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", 1},
            {"head_dim", head_dim},
            {"qk_rope_head_dim", qk_rope_head_dim},
            {"q_lora_rank", q_lora_rank},
            {"o_groups", o_groups},
            {"o_lora_rank", o_lora_rank},
            {"sliding_window", sliding_window},
            {"compress_ratios", compress_ratios},
            {"rope_theta", rope_theta},
            {"compress_rope_theta", compress_rope_theta},
            {"rope_scaling", nullptr},
            {"max_position_embeddings", max_position_embeddings},
            {"n_routed_experts", n_routed_experts},
            {"n_shared_experts", n_shared_experts},
            {"num_experts_per_tok", num_experts_per_tok},
            {"moe_intermediate_size", moe_intermediate_size},
            {"scoring_func", scoring_func == V4Scoring::SqrtSoftplus ? "sqrtsoftplus"
                             : scoring_func == V4Scoring::Sigmoid    ? "sigmoid"
                                                                     : "softmax"},
            {"routed_scaling_factor", routed_scaling_factor},
            {"num_hash_layers", num_hash_layers},
            {"swiglu_limit", swiglu_limit},
            {"expert_dtype", expert_dtype},
            {"index_n_heads", index_n_heads},
            {"index_head_dim", index_head_dim},
            {"index_topk", index_topk},
            {"hc_mult", hc_mult},
            {"hc_sinkhorn_iters", hc_sinkhorn_iters},
            {"hc_eps", hc_eps},
            {"rms_norm_eps", rms_norm_eps},
            {"num_nextn_predict_layers", num_nextn_predict_layers},
            {"tie_word_embeddings", tie_word_embeddings},
            {"bos_token_id", bos_token_id},
            {"eos_token_id", eos_token_id},
            {"hidden_act", "silu"}};
  if (rope_scaling.enabled)
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", rope_scaling.factor},
                         {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings},
                         {"beta_fast", rope_scaling.beta_fast},
                         {"beta_slow", rope_scaling.beta_slow}};
  return j;
}

namespace {

// MaxText key -> Hugging Face field (the value carried over as it is).
const std::map<std::string, std::string>& maxtext_fields() {
  static const std::map<std::string, std::string> m = {
      {"base_emb_dim", "hidden_size"},
      {"base_num_query_heads", "num_attention_heads"},
      {"base_num_kv_heads", "num_key_value_heads"},
      {"base_num_decoder_layers", "num_hidden_layers"},
      {"base_moe_mlp_dim", "moe_intermediate_size"},
      {"vocab_size", "vocab_size"},
      {"head_dim", "head_dim"},
      {"qk_rope_head_dim", "qk_rope_head_dim"},
      {"q_lora_rank", "q_lora_rank"},
      {"o_groups", "o_groups"},
      {"o_lora_rank", "o_lora_rank"},
      {"sliding_window_size", "sliding_window"},
      {"compress_ratios", "compress_ratios"},
      {"mhc_expansion_rate", "hc_mult"},
      {"sinkhorn_iterations", "hc_sinkhorn_iters"},
      {"hc_eps", "hc_eps"},
      {"first_num_hash_layers", "num_hash_layers"},
      {"indexer_n_heads", "index_n_heads"},
      {"indexer_head_dim", "index_head_dim"},
      {"indexer_topk", "index_topk"},
      {"num_experts", "n_routed_experts"},
      {"num_experts_per_tok", "num_experts_per_tok"},
      {"shared_experts", "n_shared_experts"},
      {"routed_score_func", "scoring_func"},
      {"routed_scaling_factor", "routed_scaling_factor"},
      {"mlp_activations_limit", "swiglu_limit"},
      {"rope_max_timescale", "rope_theta"},
      {"compressed_rope_max_timescale", "compress_rope_theta"},
      {"max_position_embeddings", "max_position_embeddings"},
      {"normalization_layer_epsilon", "rms_norm_eps"},
      {"logits_via_embedding", "tie_word_embeddings"},
  };
  return m;
}

// Keys read besides those: the YaRN settings and the checked-only ones.
const std::set<std::string>& maxtext_other_keys() {
  static const std::set<std::string> s = {
      "decoder_block", "attention_type", "mlp_activations", "enable_dropout",
      "base_mlp_dim",  "rope_type",      "rope_factor",     "original_max_position_embeddings",
      "beta_fast",     "beta_slow"};
  return s;
}

}  // namespace

bool V4Config::is_maxtext_key(const std::string& key) {
  return maxtext_fields().count(key) > 0 || maxtext_other_keys().count(key) > 0;
}

V4Config V4Config::from_maxtext(const std::vector<std::pair<std::string, json>>& entries, const std::string& src) {
  std::map<std::string, json> given;
  for (const auto& [k, v] : entries) {
    DS_CHECK(is_maxtext_key(k), "{}: '{}' is not a key of a DeepSeek-V4 model (decoder_block deepseek4)", src, k);
    given[k] = v;
  }
  auto str = [&](const char* k, const std::string& def) {
    if (!given.count(k)) return def;
    DS_CHECK(given[k].is_string(), "{}: key '{}' must be a string", src, k);
    return given[k].get<std::string>();
  };
  const std::string block = str("decoder_block", "");
  DS_CHECK(block == "deepseek4" || block == "deepseek_v4", "{}: decoder_block '{}' is not deepseek4", src, block);
  DS_CHECK(str("attention_type", "compressed") == "compressed", "{}: attention_type '{}': DeepSeek-V4 is 'compressed'",
           src, str("attention_type", ""));
  if (given.count("mlp_activations"))
    DS_CHECK(given["mlp_activations"] == json::array({"silu", "linear"}),
             "{}: mlp_activations {} is not supported ([silu, linear])", src, given["mlp_activations"].dump());
  if (given.count("enable_dropout"))
    DS_CHECK(given["enable_dropout"] == false, "{}: enable_dropout: DeepSeek-V4 trains without dropout", src);
  if (given.count("base_mlp_dim") && given.count("base_moe_mlp_dim"))
    DS_CHECK(given["base_mlp_dim"] == given["base_moe_mlp_dim"],
             "{}: base_mlp_dim {} differs from base_moe_mlp_dim {}; DeepSeek-V4 has no dense MLP (its shared expert "
             "is base_moe_mlp_dim wide)",
             src, given["base_mlp_dim"].dump(), given["base_moe_mlp_dim"].dump());
  for (const char* k : {"base_emb_dim", "base_num_query_heads", "base_num_decoder_layers", "base_moe_mlp_dim",
                        "vocab_size", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window_size",
                        "compress_ratios", "mhc_expansion_rate", "num_experts", "num_experts_per_tok"})
    DS_CHECK(given.count(k), "{}: a DeepSeek-V4 model needs key '{}'", src, k);
  json j = {{"model_type", "deepseek_v4"},
            {"qk_rope_head_dim", 64},
            {"hc_sinkhorn_iters", 20},
            {"hc_eps", 1e-6},
            {"n_shared_experts", 1}};
  for (const auto& [k, field] : maxtext_fields())
    if (given.count(k)) j[field] = given[k];
  const std::string rope = str("rope_type", "default");
  if (rope == "yarn") {
    json r = {{"type", "yarn"}};
    for (const auto& [k, field] :
         std::map<std::string, std::string>{{"rope_factor", "factor"},
                                            {"original_max_position_embeddings", "original_max_position_embeddings"},
                                            {"beta_fast", "beta_fast"},
                                            {"beta_slow", "beta_slow"}})
      if (given.count(k)) r[field] = given[k];
    j["rope_scaling"] = r;
  } else {
    DS_CHECK(rope == "default", "{}: rope_type '{}' is not supported (default, yarn)", src, rope);
  }
  return from_hf_json_text(j.dump(), src);
}

bool is_v4_model_type(const std::string& t) { return t == "deepseek_v4" || t == "deepseek_v41"; }

std::string config_model_type(const std::string& path) {
  const json j = parse_object(io::read_file(path, "config"), path);
  if (v41_flat_config(j)) return "deepseek_v41";
  if (!j.contains("model_type") || !j["model_type"].is_string()) return "";
  return j["model_type"].get<std::string>();
}

}  // namespace ds::model
