// ModelConfig from Hugging Face config.json and MaxText-named YAML presets:
// every field that changes the math is read, and bad values are errors.
#include "model/config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"

using ds::model::ModelConfig;
using ds::model::ScoringFunc;
using ds::model::TopkMethod;
using json = nlohmann::json;

namespace {
namespace config_test {

// The DeepSeek-V3 config.json as published (fields that matter here).
json v3_config() {
  return json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": true, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": false,
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}
  })");
}

void expect_error(const json& j, const std::string& needle) {
  try {
    ModelConfig::from_hf_json_text(j.dump());
    ADD_FAILURE() << "accepted a config that should fail with '" << needle << "'";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, ReadsDeepSeekV3) {
  ModelConfig c = ModelConfig::from_hf_json_text(v3_config().dump());
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_TRUE(c.rope_scaling.enabled);
  EXPECT_EQ(c.rope_scaling.factor, 40);
  EXPECT_EQ(c.topk_method, TopkMethod::NoauxTc);
  EXPECT_EQ(c.scoring_func, ScoringFunc::Sigmoid);
  EXPECT_EQ(c.fp8_block_rows, 128);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_TRUE(c.is_moe_layer(60));
  // softmax scale = 192^-0.5 * (0.1 * 1 * ln 40 + 1)^2, computed independently.
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(192.0), 1e-15);
}

TEST(ModelConfig, NullQLoraAndNullRopeScalingMeanPlainPaths) {
  json j = v3_config();
  j["q_lora_rank"] = nullptr;
  j["rope_scaling"] = nullptr;
  ModelConfig c = ModelConfig::from_hf_json_text(j.dump());
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_FALSE(c.rope_scaling.enabled);
  EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));
  j["q_lora_rank"] = 0;
  EXPECT_EQ(ModelConfig::from_hf_json_text(j.dump()).q_lora_rank, 0);
}

TEST(ModelConfig, ReadsDeepSeekV2LiteStyle) {
  json j = json::parse(R"({"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
    "q_lora_rank": null, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "norm_topk_prob": false, "scoring_func": "softmax", "max_position_embeddings": 163840,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"}})");
  ModelConfig c = ModelConfig::from_hf_json_text(j.dump());
  EXPECT_EQ(c.topk_method, TopkMethod::Greedy);
  EXPECT_EQ(c.scoring_func, ScoringFunc::Softmax);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.q_lora_rank, 0);
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(192.0), 1e-15);
  j["topk_method"] = "group_limited_greedy";
  j["n_group"] = 8;
  j["topk_group"] = 3;
  EXPECT_EQ(ModelConfig::from_hf_json_text(j.dump()).topk_method, TopkMethod::GroupLimitedGreedy);
}

TEST(ModelConfig, ReadsDeepSeekV32Indexer) {
  json j = v3_config();
  j["model_type"] = "deepseek_v32";
  j["index_n_heads"] = 64;
  j["index_head_dim"] = 128;
  j["index_topk"] = 2048;
  ModelConfig c = ModelConfig::from_hf_json_text(j.dump());
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_FALSE(c.index_scale_ue8m0);  // no scale_fmt: amax / 448 scales
  // The scale format: top level (DeepSeek's inference configs) or inside
  // quantization_config (Hugging Face's).
  j["scale_fmt"] = "ue8m0";
  EXPECT_TRUE(ModelConfig::from_hf_json_text(j.dump()).index_scale_ue8m0);
  j["scale_fmt"] = nullptr;
  EXPECT_FALSE(ModelConfig::from_hf_json_text(j.dump()).index_scale_ue8m0);
  j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"scale_fmt", "ue8m0"}};
  EXPECT_TRUE(ModelConfig::from_hf_json_text(j.dump()).index_scale_ue8m0);
  j["quantization_config"]["scale_fmt"] = "e5m2";
  expect_error(j, "scale_fmt 'e5m2'");
  j.erase("quantization_config");
  j["index_head_dim"] = 96;
  expect_error(j, "power of two");
  j["index_head_dim"] = 128;
  j["q_lora_rank"] = nullptr;
  expect_error(j, "q_lora_rank");
  j["q_lora_rank"] = 1536;
  j.erase("index_topk");
  expect_error(j, "index_topk");
}

TEST(ModelConfig, ImpossibleOrUnsupportedValuesAreErrors) {
  auto with = [](const char* key, json v) {
    json j = v3_config();
    j[key] = v;
    return j;
  };
  expect_error(with("model_type", "llama"), "model_type");
  expect_error(with("hidden_act", "gelu"), "hidden_act");
  expect_error(with("hidden_size", 0), "hidden_size");
  expect_error(with("hidden_size", "big"), "hidden_size");
  expect_error(with("qk_rope_head_dim", 63), "even");
  expect_error(with("num_key_value_heads", 1), "num_key_value_heads");
  expect_error(with("n_group", 7), "n_group");
  expect_error(with("topk_group", 9), "topk_group");
  expect_error(with("num_experts_per_tok", 300), "num_experts_per_tok");
  expect_error(with("topk_method", "random"), "topk_method");
  expect_error(with("scoring_func", "relu"), "scoring_func");
  expect_error(with("first_k_dense_replace", 62), "first_k_dense_replace");
  expect_error(with("eos_token_id", 200000), "eos");
  json j = v3_config();
  j["rope_scaling"]["type"] = "linear";
  expect_error(j, "rope_scaling type");
  j = v3_config();
  j["rope_scaling"]["mscale"] = 0.5;
  expect_error(j, "mscale");
  j = v3_config();
  j["quantization_config"]["fmt"] = "e5m2";
  expect_error(j, "quantization");
  j = v3_config();
  j.erase("kv_lora_rank");
  expect_error(j, "kv_lora_rank");
  EXPECT_THROW(ModelConfig::from_hf_json_text("{oops"), ds::Error);
  EXPECT_THROW(ModelConfig::from_hf_json_file("/nonexistent/config.json"), ds::Error);
}

TEST(ModelConfig, YamlPresetWithMaxTextNamesAndOverrides) {
  const std::string yaml = R"(
decoder_block: deepseek
vocab_size: 512
base_emb_dim: 64
base_mlp_dim: 128
base_moe_mlp_dim: 32
base_num_decoder_layers: 3
base_num_query_heads: 4
q_lora_rank: 0
kv_lora_rank: 32
qk_nope_head_dim: 16
qk_rope_head_dim: 8
v_head_dim: 16
num_experts: 8
shared_experts: 1
num_experts_per_tok: 2
n_routing_groups: 4
topk_routing_group: 2
first_num_dense_layers: 1
rope_factor: 4
original_max_position_embeddings: 256
)";
  ModelConfig c = ModelConfig::from_yaml_text(yaml, {"num_experts_per_tok=3", "routed_score_func=softmax"});
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_EQ(c.scoring_func, ScoringFunc::Softmax);
  EXPECT_TRUE(c.rope_scaling.enabled);  // rope_factor > 1 turns YaRN on
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_THROW(ModelConfig::from_yaml_text(yaml + "no_such_key: 1\n"), ds::Error);
  EXPECT_THROW(ModelConfig::from_yaml_text(yaml, {"base_emb_dim"}), ds::Error);
  EXPECT_THROW(ModelConfig::from_yaml_text(yaml, {"base_emb_dim=wide"}), ds::Error);
  EXPECT_THROW(ModelConfig::from_yaml_text(yaml, {"num_experts_per_tok=9"}), ds::Error);
  EXPECT_THROW(ModelConfig::from_yaml_text("[1, 2"), ds::Error);
}

TEST(ModelConfig, ShippedPresetsAreValid) {
  for (const char* name : {"tiny", "small"}) {
    ModelConfig c = ModelConfig::from_yaml_file(fmt::format("{}/configs/{}.yml", DEEPSEEK_SOURCE_DIR, name));
    EXPECT_GT(c.n_routed_experts, 0) << name;
  }
}

TEST(ModelConfig, YamlUseIndexerMakesAV32ModelWithMaxTextDefaults) {
  const std::string tiny = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/tiny.yml";
  ModelConfig c = ModelConfig::from_yaml_file(tiny, {"use_indexer=true", "indexer_topk=16"});
  EXPECT_EQ(c.model_type, "deepseek_v32");
  EXPECT_EQ(c.index_n_heads, 64);    // MaxText's indexer_n_heads
  EXPECT_EQ(c.index_head_dim, 128);  // and indexer_head_dim
  EXPECT_EQ(c.index_topk, 16);
  EXPECT_EQ(ModelConfig::from_yaml_file(tiny, {"use_indexer=false"}).index_n_heads, 0);
  // Indexer sizes without use_indexer would do nothing: an error.
  try {
    ModelConfig::from_yaml_file(tiny, {"indexer_n_heads=4"});
    ADD_FAILURE() << "indexer keys without use_indexer were accepted";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("use_indexer"), std::string::npos) << e.what();
  }
}

}  // namespace config_test
}  // namespace
