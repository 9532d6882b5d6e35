#include "model/load.h"

#include <filesystem>

#include "core/error.h"

namespace ds::model {

ModelConfig load_config(const std::string& dir) {
  namespace fs = std::filesystem;
  DS_CHECK(fs::is_directory(dir), "model folder '{}' does not exist or is not a folder", dir);
  return ModelConfig::from_hf_json_file((fs::path(dir) / "config.json").string());
}

}  // namespace ds::model
