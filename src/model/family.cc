#include "model/family.h"

#include "model/config.h"
#include "model/v4_config.h"

namespace ds::model {

std::unique_ptr<Family> family_from_hf_config(const nlohmann::json& config, const std::string& source) {
  const std::string text = config.dump();
  const bool v4 = config.is_object() && config.contains("model_type") && config.at("model_type").is_string() &&
                  config.at("model_type").get<std::string>() == "deepseek_v4";
  if (v4) {
    const auto c = V4Config::from_hf_json_text(text, source);
    return v4_family(c, 0.0);
  }
  const auto c = ModelConfig::from_hf_json_text(text, source);
  return v3_family(c, c.num_nextn_predict_layers);
}

}  // namespace ds::model
