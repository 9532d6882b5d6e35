#include "model/load.h"

#include <filesystem>

#include "core/error.h"

namespace ds::model {

ModelConfig load_config(const std::string& dir) {
  namespace fs = std::filesystem;
  DS_CHECK(fs::is_directory(dir), "model folder '{}' does not exist or is not a folder", dir);
  ModelConfig c = ModelConfig::from_hf_json_file((fs::path(dir) / "config.json").string());
  c.attach_engram_classes((fs::path(dir) / "tokenizer.json").string(), dir.c_str());
  return c;
}

}  // namespace ds::model
