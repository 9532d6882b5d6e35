// Reading a Hugging Face model folder's config.json.
#pragma once

#include <string>

#include "model/config.h"

namespace ds::model {

// The folder's config.json alone (checked): what a program needs to check a
// request before it reads any weight.
ModelConfig load_config(const std::string& dir);

}  // namespace ds::model
