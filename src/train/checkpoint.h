// Training checkpoints and Hugging Face import/export of the float32
// parameter tree.
//
// A checkpoint is the folder RUN/checkpoints/step_N (N = updates applied):
//   params.safetensors   every parameter under its Hugging Face name (float32)
//   adam_m.safetensors   AdamW's first and second moments, same names
//   adam_v.safetensors
//   state.json           step, data position, skipped-step counter, the
//                        model's config.json, the run's keys, and each
//                        file's size and CRC-32 (written last)
// Each safetensors file names its role (params, adam_m, adam_v) in its
// metadata. Loading checks, besides names and shapes: the checksums, the
// roles, the step against the folder's step_N, finite values (parameters and
// first moments below 2^64 in magnitude, so their squares are finite
// float32), second moments >= 0. A checkpoint written before checksums
// (format 1) loads with a warning: its values are still checked.
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
#include "model/hf_params.h"
#include "model/model.h"

namespace ds::train {

struct CheckpointState {
  int64_t step = 0;  // updates applied
  nlohmann::json data_state;
  int64_t consecutive_skipped = 0;
  nlohmann::json model_config;  // Hugging Face config.json (with the MTP layer count)
  nlohmann::json run_config;    // the training keys as given
  std::string tokenizer;        // absolute path of the run's tokenizer.json, or ""
  nlohmann::json files;         // file name -> {bytes, crc32}; null: written before checksums
};

// The CRC-32 (zlib's) of a file's bytes as 8 lower-case hex digits.
std::string file_crc32(const std::string& path);

// Writes RUN/checkpoints/step_N atomically; returns its path.
std::string save_checkpoint(const std::string& checkpoints_dir, const model::ModelConfig& cfg, int64_t mtp_layers,
                            const model::FlatParams& params, const model::FlatParams* adam_m,
                            const model::FlatParams* adam_v, const CheckpointState& state);

// Any model family: the tensors of `layout` laid out one after another from
// params (and the moments); mtp_layers is recorded in state.json.
std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<model::ParamInfo>& layout,
                            const float* params, const float* adam_m, const float* adam_v, const CheckpointState& state,
                            int64_t mtp_layers);

// The complete checkpoints in the folder, oldest first (steps): folders named
// step_N holding a state.json (a folder being written or removed has
// another name).
std::vector<int64_t> list_checkpoints(const std::string& checkpoints_dir);
// Removes all but the newest `keep` (keep < 1: none removed) and stale .tmp
// folders. Each is renamed to step_N.pruned.tmp first, so a kill midway
// never leaves a partial step_N.
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

// Hugging Face import and export and random initialisation live with the
// model (model/hf_params.h); the training code keeps these names.
using model::export_hf;
using model::init_params;
using model::load_hf_params;

}  // namespace ds::train
