// Loading a Hugging Face model folder: config.json, safetensors weights and,
// when present, tokenizer.json.
#pragma once

#include <memory>
#include <string>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/transformer.h"
#include "model/weights.h"

namespace ds::model {

struct LoadedModel {
  ModelConfig config;
  io::SafetensorsSet files;
  ModelWeights weights;
  std::unique_ptr<Transformer> transformer;  // refers to config and weights above
};

// The folder's config.json alone (checked): what a program needs to check a
// request before it reads any weight.
ModelConfig load_config(const std::string& dir);

std::unique_ptr<LoadedModel> load_model(const std::string& dir);

}  // namespace ds::model
