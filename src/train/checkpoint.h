// Training checkpoints and Hugging Face import/export of the float32
// parameter tree.
//
// A checkpoint is the folder RUN/checkpoints/step_N (N = updates applied):
//   params.safetensors   every parameter under its Hugging Face name (float32)
//   adam_m.safetensors   AdamW's first and second moments, same names
//   adam_v.safetensors
//   state.json           step, data position, skipped-step counter, the
//                        model's config.json, the run's keys (written last)
// It is written into step_N.tmp (every file flushed to disk), then renamed
// to step_N and the checkpoints folder flushed, so a folder named step_N is
// always complete; a crash leaves at most a .tmp folder, removed next time.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/model.h"
#include "model/v4_train.h"

namespace ds::train {

struct CheckpointState {
  int64_t step = 0;  // updates applied
  nlohmann::json data_state;
  int64_t consecutive_skipped = 0;
  nlohmann::json model_config;  // Hugging Face config.json (with the MTP layer count)
  nlohmann::json run_config;    // the training keys as given
  std::string tokenizer;        // absolute path of the run's tokenizer.json, or ""
};

// Writes RUN/checkpoints/step_N atomically; returns its path.
std::string save_checkpoint(const std::string& checkpoints_dir, const model::ModelConfig& cfg, int64_t mtp_layers,
                            const model::FlatParams& params, const model::FlatParams* adam_m,
                            const model::FlatParams* adam_v, const CheckpointState& state);

// Any model family: the tensors of `layout` laid out one after another from
// params (and the moments); mtp_layers is recorded in state.json.
std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<model::ParamInfo>& layout,
                            const float* params, const float* adam_m, const float* adam_v, const CheckpointState& state,
                            int64_t mtp_layers);

// The complete checkpoints in the folder, oldest first (steps).
std::vector<int64_t> list_checkpoints(const std::string& checkpoints_dir);
// Removes all but the newest `keep` (keep < 1: none removed) and stale .tmp folders.
void prune_checkpoints(const std::string& checkpoints_dir, int64_t keep);

// Reads a checkpoint folder into params (and moments when given); checks
// every name and shape against cfg. ds::Error (one line) for anything
// missing, malformed or inconsistent.
CheckpointState load_checkpoint(const std::string& dir, const model::ModelConfig& cfg, int64_t mtp_layers,
                                model::FlatParams& params, model::FlatParams* adam_m, model::FlatParams* adam_v);
CheckpointState load_checkpoint(const std::string& dir, const std::vector<model::ParamInfo>& layout, float* params,
                                float* adam_m, float* adam_v);
// Only its state.json (to find the model of a checkpoint before loading it).
CheckpointState read_checkpoint_state(const std::string& dir);

// Parameters from a Hugging Face folder (any float dtype, fp8 with block
// scales), converted to float32; MTP layers from model.layers.{L + k}.
void load_hf_params(const std::string& dir, const model::ModelConfig& cfg, int64_t mtp_layers,
                    model::FlatParams& params);
// A Hugging Face folder from float32 parameters: config.json, model.safetensors
// in `dtype` (F32, BF16 or F16; norms and the routing bias stay float32), and
// for each MTP layer the embed_tokens / shared_head.head copies Hugging Face's
// layout carries.
void export_hf(const std::string& out_dir, const model::ModelConfig& cfg, int64_t mtp_layers,
               const model::FlatParams& params, DType dtype);

// Random initialisation: matrices normal(0, std) (one Philox stream per
// tensor, in tree order, as `deepseek init` does), norms 1, routing bias 0.
void init_params(const model::ModelConfig& cfg, int64_t mtp_layers, model::FlatParams& params, uint64_t seed,
                 float std);

// DeepSeek-V4, in the layout of model::V4FlatParams (tables synced after
// each). Random initialisation: matrices normal(0, std) (one Philox stream
// per tensor in tree order), norm and mHC scales 1, the sinks and the mHC
// and routing biases 0, and each token's hash-routed experts distinct draws.
void init_v4_params(const model::V4Config& c, model::V4FlatParams& p, uint64_t seed, float std);
// Parameters of a V4 folder (any stored dtype: fp8, packed fp4, bf16),
// checked as generation checks them and widened to float32.
void load_v4_hf_params(const std::string& dir, const model::V4Config& c, model::V4FlatParams& p);
// A V4 folder from float32 parameters: upstream tensor names in `dtype`
// (vectors float32, tid2eid int32) and config.json; `deepseek generate` reads it.
// `who` prefixes its errors.
void export_v4_hf(const std::string& out_dir, const model::V4Config& c, const float* params, DType dtype,
                  const char* who = "export");

}  // namespace ds::train
