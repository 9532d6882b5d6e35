// Writes tiny random DeepSeek checkpoints (config.json + safetensors) for the
// model tests: every Hugging Face tensor name the config implies.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/rng.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/load.h"

namespace ds::test {

inline nlohmann::json tiny_v3_config() {
  return nlohmann::json::parse(R"({
    "model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 16,
    "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 12, "topk_method": "noaux_tc",
    "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": true, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 128,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": false,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 16, "type": "yarn"}})");
}

// Writes config.json and model.safetensors (bf16 weights) into `dir`.
inline void write_random_model(const std::string& dir, const nlohmann::json& config, uint64_t seed = 7,
                               const std::vector<std::pair<std::string, Tensor>>& extra = {}) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  std::ofstream(fs::path(dir) / "config.json") << config.dump(2);
  const auto c = model::ModelConfig::from_hf_json_text(config.dump());
  std::vector<std::pair<std::string, Tensor>> ts;
  uint64_t stream = 0;
  auto add = [&](const std::string& name, Shape shape, float std, float mean = 0.0f) {
    Tensor t = Tensor::empty(shape, DType::F32);
    fill_normal(t.data<float>(), t.numel(), std, seed, stream++);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] += mean;
    ts.emplace_back(name, t.to(DType::BF16));
  };
  const int64_t D = c.hidden_size, H = c.num_attention_heads, qk = c.qk_head_dim();
  add("model.embed_tokens.weight", {c.vocab_size, D}, 1.0f);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    add(p + ".input_layernorm.weight", {D}, 0.1f, 1.0f);
    add(p + ".post_attention_layernorm.weight", {D}, 0.1f, 1.0f);
    if (c.q_lora_rank > 0) {
      add(p + ".self_attn.q_a_proj.weight", {c.q_lora_rank, D}, 0.2f);
      add(p + ".self_attn.q_a_layernorm.weight", {c.q_lora_rank}, 0.1f, 1.0f);
      add(p + ".self_attn.q_b_proj.weight", {H * qk, c.q_lora_rank}, 0.2f);
    } else {
      add(p + ".self_attn.q_proj.weight", {H * qk, D}, 0.2f);
    }
    add(p + ".self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, D}, 0.2f);
    add(p + ".self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, 0.1f, 1.0f);
    add(p + ".self_attn.kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, 0.2f);
    add(p + ".self_attn.o_proj.weight", {D, H * c.v_head_dim}, 0.2f);
    auto mlp = [&](const std::string& q, int64_t width) {
      add(q + ".gate_proj.weight", {width, D}, 0.2f);
      add(q + ".up_proj.weight", {width, D}, 0.2f);
      add(q + ".down_proj.weight", {D, width}, 0.2f);
    };
    if (c.is_moe_layer(l)) {
      add(p + ".mlp.gate.weight", {c.n_routed_experts, D}, 0.3f);
      if (c.topk_method == model::TopkMethod::NoauxTc) {
        Tensor b = Tensor::empty({c.n_routed_experts}, DType::F32);
        fill_normal(b.data<float>(), b.numel(), 0.1f, seed, stream++);
        ts.emplace_back(p + ".mlp.gate.e_score_correction_bias", b);
      }
      for (int64_t e = 0; e < c.n_routed_experts; ++e)
        mlp(p + ".mlp.experts." + std::to_string(e), c.moe_intermediate_size);
      if (c.n_shared_experts > 0) mlp(p + ".mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts);
    } else {
      mlp(p + ".mlp", c.intermediate_size);
    }
  }
  add("model.norm.weight", {D}, 0.1f, 1.0f);
  add("lm_head.weight", {c.vocab_size, D}, 0.3f);
  for (const auto& e : extra) ts.push_back(e);
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), ts);
}

// Logits of every position of `ids`: the first `prefix` tokens in one step,
// then one token per step through a cache of `kind`.
inline std::vector<float> incremental_logits(model::LoadedModel& m, const std::vector<int32_t>& ids, size_t prefix,
                                             infer::CacheKind kind) {
  infer::KvCache cache(kind, 1, m.config.num_hidden_layers);
  auto out = m.transformer->step(cache, {{ids.begin(), ids.begin() + prefix}}, true);
  for (size_t t = prefix; t < ids.size(); ++t) {
    auto one = m.transformer->step(cache, {{ids[t]}}, true);
    out.insert(out.end(), one.begin(), one.end());
  }
  return out;
}

}  // namespace ds::test
