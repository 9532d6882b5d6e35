// Writes tiny random DeepSeek checkpoints (config.json + safetensors) for the
// model tests: every Hugging Face tensor name the config implies.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/rng.h"
#include "infer/engine.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/model.h"
#include "model/params.h"
#include "model/weights.h"

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

// Writes config.json and model.safetensors (bf16 weights) into `dir`; with
// mtp, the MTP layers the config names too (else only what `extra` adds).
inline void write_random_model(const std::string& dir, const nlohmann::json& config, uint64_t seed = 7,
                               const std::vector<std::pair<std::string, Tensor>>& extra = {}, bool mtp = false) {
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
  model::for_each_param(c, mtp ? c.num_nextn_predict_layers : 0, [&](const model::ParamInfo& info) {
    switch (info.role) {
      case model::ParamRole::Embedding:
        add(info.name, info.shape, 1.0f);
        break;
      case model::ParamRole::Norm:
        add(info.name, info.shape, 0.1f, 1.0f);
        break;
      case model::ParamRole::Projection:
        add(info.name, info.shape, 0.2f);
        break;
      case model::ParamRole::NormBias:
        add(info.name, info.shape, 0.1f);
        break;
      case model::ParamRole::Router:
      case model::ParamRole::IndexerHeadWeights:
      case model::ParamRole::LmHead:
        add(info.name, info.shape, 0.3f);
        break;
      case model::ParamRole::RoutingBias: {
        Tensor b = Tensor::empty(info.shape, DType::F32);
        fill_normal(b.data<float>(), b.numel(), 0.1f, seed, stream++);
        ts.emplace_back(info.name, b);
        break;
      }
      case model::ParamRole::Untrained:  // DeepSeek-V4 only
        break;
      // mHC (mhc_expansion_rate > 1): away from its initialisation, so that
      // every stream mixes differently.
      case model::ParamRole::MhcMatrix:
        add(info.name, info.shape, 0.3f);
        break;
      case model::ParamRole::MhcBias:
        add(info.name, info.shape, 0.5f);
        break;
      case model::ParamRole::MhcScale:
        add(info.name, info.shape, 0.3f, 0.8f);
        break;
      // Engram: a table of order-1 rows, a conv that is not zero.
      case model::ParamRole::EngramTable:
        add(info.name, info.shape, 1.0f);
        break;
      case model::ParamRole::EngramConv:
        add(info.name, info.shape, 0.3f);
        break;
      case model::ParamRole::Bias:
        add(info.name, info.shape, 0.1f);
        break;
    }
  });
  for (const auto& e : extra) ts.push_back(e);
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), ts);
}

// The training forward's loss of one document (one row, one segment, every
// target counted), and the mean cross-entropy of the engine's logits [T, V]
// on the same targets: the two must agree.
inline double one_document_train_loss(const model::ModelConfig& c, const model::ParamsView& p,
                                      const std::vector<int32_t>& in, const std::vector<int32_t>& target) {
  const auto T = static_cast<int64_t>(in.size());
  model::TrainBatch b;
  b.batch = 1;
  b.seq = T;
  b.inputs = in;
  b.targets = target;
  for (int64_t t = 0; t < T; ++t) b.positions.push_back(static_cast<int32_t>(t));
  b.segment_ids.assign(T, 1);
  b.target_segment_ids.assign(T, 1);
  return model::loss_and_grad(c, p, nullptr, b, model::LossOptions{}, model::RematPolicy::keep_all()).loss;
}
inline double mean_cross_entropy(const std::vector<float>& logits, const std::vector<int32_t>& target, int64_t V) {
  const auto T = static_cast<int64_t>(target.size());
  double ce = 0;
  for (int64_t t = 0; t < T; ++t) {
    const float* z = &logits[t * V];
    double mx = z[0], s = 0;
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(z[v]));
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(z[v]) - mx);
    ce += mx + std::log(s) - z[target[t]];
  }
  return ce / static_cast<double>(T);
}

// Logits of every position of `ids`: the first `prefix` tokens in one step,
// then one token per step through a cache of `kind`.
inline std::vector<float> incremental_logits(infer::LoadedModel& m, const std::vector<int32_t>& ids, size_t prefix,
                                             infer::CacheKind kind) {
  infer::KvCache cache(kind, 1, m.config.num_hidden_layers);
  auto out = m.engine->step(cache, {{ids.begin(), ids.begin() + prefix}}, true);
  for (size_t t = prefix; t < ids.size(); ++t) {
    auto one = m.engine->step(cache, {{ids[t]}}, true);
    out.insert(out.end(), one.begin(), one.end());
  }
  return out;
}

}  // namespace ds::test
