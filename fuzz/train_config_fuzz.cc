// libFuzzer target for the training run config (ds::train::parse_run_config):
// MaxText-style YAML plus `key=value` overrides, as `deepseek train
// CONFIG.yml key=value ...` reads them. The input is the YAML text, then
// (each after a NUL byte) the overrides. Any input must either give a run
// config that passed its checks or raise ds::Error; a crash, a hang, a
// sanitizer report, another exception type (a YAML::Exception, say) or a
// returned config that breaks the checks it claims is a finding. Run from the
// repository root (scripts/fuzz.sh does), so that model_name finds the presets
// in configs/ and hf_config can name the config.json seeds in fuzz/corpus/.
// Built by fuzz/CMakeLists.txt (cmake -DDEEPSEEK_FUZZ=ON with clang) or
// scripts/fuzz.sh:
//   build-fuzz/fuzz/train_config_fuzz -max_len=4096 -dict=fuzz/train_config.dict fuzz/corpus/train_config
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "train/config.h"
#include "yaml_mutator.h"

namespace {

// The keys the parser knows (training, mesh, remat names, V2/V3 and V4 model
// keys), for the mutator to swap in.
constexpr const char* kKeys[] = {
    // training
    "run_name", "base_output_directory", "model_name", "hf_config", "load_parameters_path", "init_weights_seed",
    "init_weights_std", "dtype", "weight_dtype", "steps", "learning_rate", "warmup_steps_fraction",
    "lr_schedule_type", "learning_rate_final_fraction", "cosine_learning_rate_final_fraction",
    "learning_rate_schedule_steps", "wsd_decay_steps_fraction", "wsd_decay_style", "opt_type", "adam_b1", "adam_b2",
    "adam_eps", "adam_eps_root", "adam_weight_decay", "adamw_mask", "trainable_parameters_mask",
    "gradient_clipping_threshold", "gradient_accumulation_steps", "max_consecutive_skipped_steps",
    "per_device_batch_size", "max_target_length", "z_loss_multiplier", "load_balance_loss_weight",
    "mtp_loss_scaling_factor", "indexer_loss_scaling_factor", "indexer_sparse_training", "remat_policy",
    "dataset_type", "synthetic_task", "dataset_path", "packing", "data_shuffle_seed", "tokenizer_path",
    "eval_interval", "eval_steps", "eval_per_device_batch_size", "target_eval_loss", "enable_checkpointing",
    "checkpoint_period", "max_num_checkpoints_to_keep", "save_checkpoint_on_completion", "resume", "log_period",
    "collective_timeout_seconds", "expert_dispatch", "expert_grad_comm_fp8", "use_batch_split_schedule",
    "batch_split_factor", "link_model_latency_us", "link_model_gbps", "timeline_step",
    // mesh
    "ici_data_parallelism", "ici_fsdp_parallelism", "ici_expert_parallelism", "dcn_data_parallelism",
    "dcn_fsdp_parallelism", "dcn_expert_parallelism",
    // remat_policy custom names
    "decoder_layer_input", "query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv", "query_proj", "key_proj", "value_proj",
    "attention_out", "context", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo",
    "mlpwi", "kv_proj", "qkv_proj", "indexer_cutoff_threshold",
    // DeepSeek-V2/V3 model keys
    "decoder_block", "vocab_size", "base_emb_dim", "base_mlp_dim", "base_moe_mlp_dim", "base_num_decoder_layers",
    "base_num_query_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "rope_max_timescale", "max_position_embeddings", "original_max_position_embeddings", "rope_factor",
    "beta_fast", "beta_slow", "mscale", "num_experts", "shared_experts", "num_experts_per_tok", "n_routing_groups",
    "topk_routing_group", "routed_scaling_factor", "routed_score_func", "first_num_dense_layers",
    "interleave_moe_layer_step", "normalization_layer_epsilon", "mtp_num_layers", "routed_bias_update_rate",
    "logits_via_embedding", "topk_method", "norm_topk_prob", "use_yarn", "model_type", "use_indexer",
    "indexer_n_heads", "indexer_head_dim", "indexer_topk",
    // DeepSeek-V4 (MaxText names)
    "attention_type", "base_num_kv_heads", "head_dim", "o_groups", "o_lora_rank", "sliding_window_size",
    "compress_ratios", "mhc_expansion_rate", "sinkhorn_iterations", "hc_eps", "first_num_hash_layers",
    "mlp_activations", "mlp_activations_limit", "enable_dropout", "rope_type", "compressed_rope_max_timescale"};

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "train_config_fuzz: a returned config breaks: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ds_fuzz::yaml::Parts parts = ds_fuzz::yaml::split(std::string_view(reinterpret_cast<const char*>(data), size));
  // The YAML text is everything before the first NUL; the lines rejoined
  // give it back unchanged.
  std::string text;
  for (size_t i = 0; i < parts.lines.size(); ++i) {
    if (i) text += '\n';
    text += parts.lines[i];
  }
  std::optional<ds::train::RunConfig> parsed;
  try {
    parsed = ds::train::parse_run_config(text, parts.overrides, "fuzz.yml");
  } catch (const ds::Error&) {
    return 0;
  }
  const ds::train::RunConfig& rc = *parsed;
  const ds::train::TrainConfig& t = rc.train;
  // What check_config promises, and what the trainer derives from it.
  if (t.steps < 1 || t.schedule_steps() < 1) broken("steps");
  if (t.per_device_batch_size < 1 || t.max_target_length < 2) broken("batch or length");
  if (t.data.batch != t.per_device_batch_size || t.data.seq != t.max_target_length) broken("data shape");
  if (t.run_dir().empty() || t.run_name.empty() || t.run_name.find('/') != std::string::npos) broken("run_name");
  if (!t.as_json.is_object()) broken("as_json");
  // The trainer writes every key as given to the run folder (as_json.dump()).
  try {
    (void)t.as_json.dump();
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    broken("as_json cannot be written");
  }
  try {
    if (rc.v4) {
      if (t.data.vocab_size != rc.v4->vocab_size || rc.v4->vocab_size < 1) broken("V4 vocab_size");
      if (t.max_target_length > rc.v4->max_position_embeddings) broken("V4 max_target_length");
      rc.v4->validate();
      volatile int64_t params = rc.v4->parameter_count();
      (void)params;
    } else {
      if (t.data.vocab_size != rc.model.vocab_size || rc.model.vocab_size < 1) broken("vocab_size");
      if (t.max_target_length > rc.model.max_position_embeddings) broken("max_target_length");
      rc.model.validate();
      volatile double scale = rc.model.softmax_scale();
      (void)scale;
    }
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    broken("the model config it returned fails validate()");
  }
  return 0;
}

// Half line-level YAML mutations (fuzz/yaml_mutator.h), half libFuzzer's own.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::yaml::mutate(data, size, max_size, seed, kKeys);
}
