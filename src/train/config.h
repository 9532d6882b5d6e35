// The configuration of a training run, in MaxText's key names: a YAML file
// plus bare `key=value` overrides, as `python train.py base.yml key=value`.
//
// One flat namespace: the model keys of the model's family (base_emb_dim,
// num_experts, mtp_num_layers, routed_bias_update_rate, ...) and the
// training keys below. A key that is neither is an error. The model comes
// from, in this order of precedence:
//   hf_config=PATH             a Hugging Face config.json (or its folder);
//   load_parameters_path=DIR   a Hugging Face folder, whose config.json is
//                              used when no hf_config is given;
//   model_name=NAME            a preset: NAME.yml, or configs/NAME.yml next to
//                              the config file, its parent, or the working
//                              folder;
// with the model keys of the file and the command line applied on top of a
// preset (with a Hugging Face config only mtp_num_layers and
// routed_bias_update_rate may be changed). The family is the one the
// config.json's model_type names, else the one the keys' or the preset's
// decoder_block names (MaxText's deepseek when none is named).
// This file sorts the keys; which are model keys, and the model built from
// them, are the family's kind's business (model/family_kind.h, each
// family's in model/<family>/kind.cc).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/mesh.h"
#include "model/config.h"
#include "model/family.h"
#include "model/family_kind.h"
#include "model/remat.h"
#include "train/data.h"

namespace ds::train {

struct TrainConfig {
  // Where everything goes: base_output_directory/run_name.
  std::string run_name = "default";
  std::string base_output_directory = "runs";
  // Model source (see above).
  std::string model_name, hf_config, load_parameters_path;
  uint64_t init_weights_seed = 0;
  double init_weights_std = 0.006;  // normal std of every matrix (DeepSeek-V3's)
  std::string dtype = "float32", weight_dtype = "float32";
  std::string quantization;  // "" or fp8_full (ops/fp8_quant.h)

  // Steps and schedule (MaxText's maxtext_utils schedule).
  int64_t steps = 150001;
  double learning_rate = 3e-5;
  double warmup_steps_fraction = 0.1;
  std::string lr_schedule_type = "cosine";  // cosine | wsd
  double learning_rate_final_fraction = 0.1;
  int64_t learning_rate_schedule_steps = -1;  // -1: steps
  double wsd_decay_steps_fraction = 0.1;
  std::string wsd_decay_style = "linear";  // linear | cosine

  // Optimizer (AdamW, optax semantics).
  std::string opt_type = "adamw";
  double adam_b1 = 0.9, adam_b2 = 0.95, adam_eps = 1e-8, adam_eps_root = 0.0, adam_weight_decay = 0.1;
  std::vector<std::string> adamw_mask;                 // regexes (searched in the HF name): no weight decay
  std::vector<std::string> trainable_parameters_mask;  // regexes: only matching tensors train ([] = all)
  double gradient_clipping_threshold = 1.0;            // 0: off
  int64_t gradient_accumulation_steps = 1;
  int64_t max_consecutive_skipped_steps = 5;  // non-finite loss or gradients this many times in a row: stop

  // Batch and loss.
  int64_t per_device_batch_size = 12;
  int64_t max_target_length = 2048;
  double z_loss_multiplier = 0.0;
  double load_balance_loss_weight = 0.0;
  double mtp_loss_scaling_factor = 0.1;
  // DeepSeek-V3.2's indexer (a model with use_indexer): its KL loss weight
  // and the stage (false: dense warm-up, attention dense; true: sparse
  // training, top-k attention).
  double indexer_loss_scaling_factor = 0.0;
  bool indexer_sparse_training = false;
  model::RematPolicy remat;
  std::string remat_policy = "full";

  // Data.
  DataConfig data;  // dataset_type, synthetic_task, dataset_path, data_shuffle_seed
  std::string tokenizer_path;
  int64_t eval_interval = -1;  // -1: no eval
  int64_t eval_steps = -1;     // -1: one pass over the eval split (at most eval_steps_cap batches)
  int64_t eval_per_device_batch_size = 0;
  double target_eval_loss = 0.0;  // > 0: stop once the eval loss is below it

  // Checkpoints and logging.
  bool enable_checkpointing = true;
  int64_t checkpoint_period = 10000;
  int64_t max_num_checkpoints_to_keep = -1;  // -1: keep all
  bool save_checkpoint_on_completion = true;
  bool resume = false;
  int64_t log_period = 10;  // plain-text progress line every N steps when stderr is not a terminal

  // Processes (mpirun): the mesh (ici_/dcn_{data,fsdp,expert}_parallelism)
  // and how long a collective may wait for the other ranks.
  dist::MeshConfig mesh;
  double collective_timeout_seconds = 300;
  std::string expert_dispatch = "alltoall";  // alltoall | allgather (expert parallelism)
  bool expert_grad_comm_fp8 = false;
  // The batch-split schedule: each rank's batch runs each layer as
  // batch_split_factor micro-batches, one's expert exchange overlapping the
  // others' compute.
  bool use_batch_split_schedule = false;
  int64_t batch_split_factor = 1;
  // A modeled link (dist/link_model.h) under the expert and fsdp axes'
  // collectives, to measure overlap on one machine (0 GB/s: off).
  double link_model_latency_us = 0, link_model_gbps = 0;
  // Step whose batch-split schedule of the first MoE layer is drawn to
  // timeline.svg in the run folder (-1: none).
  int64_t timeline_step = -1;  // the expert output gradient moves as e5m2 + row scales

  // Every key as given (after overrides), for the run folder and checkpoints.
  nlohmann::json as_json;

  std::string run_dir() const;
  int64_t schedule_steps() const { return learning_rate_schedule_steps > 0 ? learning_rate_schedule_steps : steps; }
};

// The model (model::ModelSpec: its family's kind and that family's
// configuration) and the training keys.
struct RunConfig : model::ModelSpec {
  TrainConfig train;
};

// The run's model behind the family seam (model/family.h).
std::unique_ptr<model::Family> model_family(const RunConfig& rc);

// Parses the YAML text plus overrides; `source` names the file in errors and
// is where relative preset lookups start. ds::Error (one line) for unknown
// keys, wrong types and impossible values.
RunConfig parse_run_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                           const std::string& source);
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides);

// Refuses, before anything is allocated, a run whose memory cannot fit this
// machine (physical memory, as `generate` checks its KV cache). The estimate
// errs high: float32 parameters, gradients and both AdamW moments (16
// bytes a parameter, whole on every rank), plus one micro-batch's
// activations: per token the logits and their gradient (2 x vocab floats)
// and what the family's forward keeps for the backward under the run's
// remat policy and dtype (model::Family::saved_bytes_per_token).
int64_t training_memory_bytes(const RunConfig& rc);
void check_training_memory(const RunConfig& rc);

}  // namespace ds::train
