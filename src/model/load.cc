#include "model/load.h"

#include <filesystem>

#include "core/error.h"

namespace ds::model {

ModelConfig load_config(const std::string& dir) {
  namespace fs = std::filesystem;
  DS_CHECK(fs::is_directory(dir), "model folder '{}' does not exist or is not a folder", dir);
  return ModelConfig::from_hf_json_file((fs::path(dir) / "config.json").string());
}

std::unique_ptr<LoadedModel> load_model(const std::string& dir) {
  auto m = std::make_unique<LoadedModel>();
  m->config = load_config(dir);
  m->files = io::SafetensorsSet::open_dir(dir);
  m->weights = ModelWeights::load(m->files, m->config);
  m->transformer = std::make_unique<Transformer>(m->config, m->weights);
  return m;
}

}  // namespace ds::model
