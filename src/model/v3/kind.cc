// DeepSeek-V2/V3/V3.2's kind (model/family_kind.h): decoder_block deepseek,
// model_type deepseek_v2 / deepseek_v3 / deepseek_v32, ModelConfig's YAML
// keys (MaxText's names).
#include "core/error.h"
#include "io/text_input.h"
#include "model/family_kind.h"

namespace ds::model {

namespace {

class V3Kind final : public FamilyKind {
 public:
  std::string name() const override { return "DeepSeek-V2/V3"; }
  bool claims_decoder_block(const std::string& value) const override { return value == "deepseek"; }
  bool claims_model_type(const std::string& t) const override {
    return t == "deepseek_v2" || t == "deepseek_v3" || t == "deepseek_v32";
  }
  bool is_model_key(const std::string& key) const override { return ModelConfig::is_yaml_key(key); }
  std::vector<std::string> keys_over_hf_config() const override {
    return {"mtp_num_layers", "routed_bias_update_rate"};
  }

  ModelSpec from_run_keys(const ModelKeys& in) const override {
    std::vector<std::string> overrides;
    std::string zero_experts;  // where num_experts=0 was given, if it was
    for (const auto& e : in.keys) {
      overrides.push_back(e.key + "=" + io::yaml_flow_text(e.value));
      if (e.key == "num_experts") zero_experts = e.value.IsScalar() && e.value.Scalar() == "0" ? e.where : "";
    }
    ModelSpec s = spec();
    if (!in.hf_config.empty()) {
      s.model = ModelConfig::from_hf_json_text(io::read_file(in.hf_config, "hf_config"), in.hf_config);
      for (const auto& e : in.keys) {
        if (e.key == "mtp_num_layers") s.model.num_nextn_predict_layers = e.value.as<int64_t>();
        if (e.key == "routed_bias_update_rate") s.model.routed_bias_update_rate = e.value.as<double>();
      }
      s.model.validate();
    } else if (!in.preset.empty()) {
      blaming_user_keys(
          in, overrides, [&] { s.model = ModelConfig::from_yaml_file(in.preset, overrides); },
          [&] { (void)ModelConfig::from_yaml_file(in.preset); });
    } else {
      DS_CHECK(!overrides.empty(),
               "{}: no model: give model_name=PRESET, hf_config=PATH, load_parameters_path=DIR or the model keys",
               in.source);
      s.model = ModelConfig::from_yaml_text("", overrides, in.source);
    }
    // num_experts=0 on a mixture-of-experts model leaves its MoE layers without routed experts.
    DS_CHECK(zero_experts.empty() || s.model.num_experts_per_tok == 0,
             "{}: num_experts=0 on a mixture-of-experts model (num_experts_per_tok {}): its MoE layers would have "
             "no experts; give a dense model (num_experts_per_tok 0) or at least num_experts_per_tok experts",
             zero_experts, s.model.num_experts_per_tok);
    return s;
  }

  ModelSpec from_hf_config(const std::string& text, const std::string& source) const override {
    ModelSpec s = spec();
    s.model = ModelConfig::from_hf_json_text(text, source);
    return s;
  }

  ModelSpec from_preset(const std::string& path, const std::vector<io::YamlEntry>&,
                        const std::vector<std::string>& overrides) const override {
    ModelSpec s = spec();
    s.model = ModelConfig::from_yaml_file(path, overrides);
    return s;
  }

  // MaxText's Engram with engram_compress_tokens.
  bool hashes_token_classes(const ModelSpec& s) const override {
    return s.model.has_engram() && s.model.engram_compress_tokens;
  }
  void attach_token_classes(ModelSpec& s, const std::string& tokenizer_json) const override {
    s.model.attach_engram_classes(tokenizer_json, "engram_compress_tokens");
  }

  std::unique_ptr<Family> family(const ModelSpec& s) const override {
    return v3_family(s.model, s.model.num_nextn_predict_layers);
  }

 private:
  ModelSpec spec() const {
    ModelSpec s;
    s.kind = this;
    return s;
  }
};

}  // namespace

const FamilyKind& v3_kind() {
  static const V3Kind kind;
  return kind;
}

}  // namespace ds::model
