// New checkpoints from a configuration: the Hugging Face config.json a
// ModelConfig stands for, and randomly initialised weights under every tensor
// name that config implies, written as a model folder any DeepSeek loader
// (ours or Hugging Face's) reads.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "core/dtype.h"
#include "model/config.h"
#include "model/params.h"

namespace ds::model {

// config.json for `cfg` (round-trips through ModelConfig::from_hf_json_text),
// for a checkpoint that holds `mtp_layers` multi-token prediction layers.
nlohmann::json to_hf_json(const ModelConfig& cfg, int64_t mtp_layers = 0);

struct InitOptions {
  uint64_t seed = 0;
  // Of the matrices; norms are 1 and the routing bias 0 (f32). F8E4M3 writes
  // the projections and MLPs as DeepSeek-V3 ships them: e4m3 with a
  // weight_scale_inv per 128 x 128 block, the rest in bf16.
  DType dtype = DType::BF16;
  float init_std = 0.006f;  // normal std of every matrix (DeepSeek-V3's initialisation)
};

// MaxText's mHC initialisation: every scale 0.01, fn N(0, 1 / fan_in) with
// fan_in = k d (its columns), the biases 0, the norm scale 1.
inline constexpr float kMhcScaleInit = 0.01f;
float mhc_fn_std(const ParamInfo& fn);
// MaxText's Engram table initialisation, N(0, 1 / D_head) (D_head its columns).
float engram_table_std(const ParamInfo& table);

// Makes DIR (if missing) ready to receive config.json and model.safetensors:
// ds::Error, prefixed with `who`, if it cannot be created or already holds
// another checkpoint's shards (a loader would read those too).
void prepare_model_folder(const std::string& dir, const char* who);

// Writes DIR/config.json and DIR/model.safetensors (atomically). DIR is
// created if missing; existing files of those names are replaced.
void write_random_checkpoint(const ModelConfig& cfg, const std::string& dir, const InitOptions& opt);

}  // namespace ds::model
