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

namespace ds::model {

// config.json for `cfg` (round-trips through ModelConfig::from_hf_json_text).
nlohmann::json to_hf_json(const ModelConfig& cfg);

struct InitOptions {
  uint64_t seed = 0;
  DType dtype = DType::BF16;  // of the matrices; norms are 1 and the routing bias 0, stored in f32
  float init_std = 0.006f;    // normal std of every matrix (DeepSeek-V3's initialisation)
};

// Writes DIR/config.json and DIR/model.safetensors (atomically). DIR is
// created if missing; existing files of those names are replaced.
void write_random_checkpoint(const ModelConfig& cfg, const std::string& dir, const InitOptions& opt);

}  // namespace ds::model
