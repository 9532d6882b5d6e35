// DeepSeek-V4's kind (model/family_kind.h): decoder_block deepseek4 (or
// deepseek_v4), model_type deepseek_v4, MaxText's V4 keys
// (V4Config::from_maxtext) and two training keys: routed_bias_update_rate
// (the balancing rate, which V4's config.json does not carry) and
// mtp_num_layers (0 or 1: the V4 loss chains no second MTP depth).
#include <filesystem>

#include "core/error.h"
#include "io/text_input.h"
#include "model/family_kind.h"

namespace ds::model {

namespace {

bool training_key(const std::string& key) { return key == "routed_bias_update_rate" || key == "mtp_num_layers"; }

class V4Kind final : public FamilyKind {
 public:
  std::string name() const override { return "DeepSeek-V4"; }
  bool claims_decoder_block(const std::string& value) const override {
    return value == "deepseek4" || value == "deepseek_v4";
  }
  bool claims_model_type(const std::string& t) const override { return is_v4_model_type(t); }
  bool is_model_key(const std::string& key) const override {
    return training_key(key) || V4Config::is_maxtext_key(key);
  }
  std::vector<std::string> keys_over_hf_config() const override {
    return {"mtp_num_layers", "routed_bias_update_rate"};
  }

  ModelSpec from_run_keys(const ModelKeys& in) const override {
    ModelSpec s = spec();
    std::vector<std::pair<std::string, nlohmann::json>> keys;
    std::optional<int64_t> mtp;
    for (const auto& e : in.keys) {
      if (!training_key(e.key)) {
        keys.emplace_back(e.key, io::entry_json(e));
        continue;
      }
      try {
        if (e.key == "routed_bias_update_rate") s.v4_routed_bias_update_rate = e.value.as<double>();
        if (e.key == "mtp_num_layers") mtp = e.value.as<int64_t>();
        DS_CHECK(!mtp || (*mtp >= 0 && *mtp <= 1),
                 "{}: mtp_num_layers {}: DeepSeek-V4 training has at most one MTP layer (DeepSeek's checkpoints "
                 "carry one, mtp.0, and the V4 loss chains no second depth after it)",
                 e.where, io::yaml_flow_text(e.value));
      } catch (const YAML::Exception& ex) {
        DS_FAIL("{}: key '{}' has a value of the wrong type: {}", e.where, e.key, ex.what());
      }
    }
    if (!in.hf_config.empty())
      s.v4 = V4Config::from_hf_json_text(io::read_file(in.hf_config, "hf_config"), in.hf_config);
    else
      s.v4 = from_maxtext_keys(in, keys);
    if (mtp) s.v4->num_nextn_predict_layers = *mtp;
    DS_CHECK(s.v4->num_nextn_predict_layers <= 1,
             "num_nextn_predict_layers {}: DeepSeek-V4 trains at most one MTP layer (set mtp_num_layers=0 or 1)",
             s.v4->num_nextn_predict_layers);
    s.v4->validate();
    DS_CHECK(s.v4_routed_bias_update_rate >= 0, "routed_bias_update_rate {} must be >= 0",
             s.v4_routed_bias_update_rate);
    return s;
  }

  ModelSpec from_hf_config(const std::string& text, const std::string& source) const override {
    ModelSpec s = spec();
    s.v4 = V4Config::from_hf_json_text(text, source);
    return s;
  }

  ModelSpec from_preset(const std::string& path, const std::vector<io::YamlEntry>& entries,
                        const std::vector<std::string>&) const override {
    std::vector<std::pair<std::string, nlohmann::json>> all;
    for (const auto& e : entries) {
      DS_CHECK(V4Config::is_maxtext_key(e.key),
               "{}: '{}' is not a key of a DeepSeek-V4 model (decoder_block deepseek4)", e.where, e.key);
      all.emplace_back(e.key, io::entry_json(e));
    }
    ModelSpec s = spec();
    s.v4 = V4Config::from_maxtext(all, path);
    s.v4->validate();
    return s;
  }

  // DeepSeek-V4.1's Engram layers.
  bool hashes_token_classes(const ModelSpec& s) const override {
    return s.v4.has_value() && !s.v4->engram_layers.empty();
  }
  void attach_token_classes(ModelSpec& s, const std::string& tokenizer_json) const override {
    DS_CHECK(std::filesystem::is_regular_file(tokenizer_json),
             "DeepSeek-V4.1's Engram hashes the tokenizer's token classes, and '{}' is not a file", tokenizer_json);
    s.v4->attach_engram_classes(tokenizer_json);
  }

  std::unique_ptr<Family> family(const ModelSpec& s) const override {
    DS_CHECK(s.v4.has_value(), "internal: a DeepSeek-V4 model without its configuration");
    return v4_family(*s.v4, s.v4_routed_bias_update_rate);
  }

 private:
  ModelSpec spec() const {
    ModelSpec s;
    s.kind = this;
    return s;
  }

  // The preset's keys with the user's on top (or the user's alone).
  static V4Config from_maxtext_keys(const ModelKeys& in,
                                    const std::vector<std::pair<std::string, nlohmann::json>>& keys) {
    std::vector<std::pair<std::string, nlohmann::json>> alone, all;
    for (const auto& e : in.preset_entries) alone.emplace_back(e.key, io::entry_json(e));
    all = alone;
    all.insert(all.end(), keys.begin(), keys.end());
    std::vector<std::string> given;
    for (const auto& [k, v] : keys) given.push_back(k + "=" + v.dump());
    V4Config c;
    blaming_user_keys(
        in, given,
        [&] {
          c = V4Config::from_maxtext(all, in.preset.empty() ? in.source : in.preset);
          c.validate();
        },
        [&] { V4Config::from_maxtext(alone, in.preset).validate(); });
    return c;
  }
};

}  // namespace

const FamilyKind& v4_kind() {
  static const V4Kind kind;
  return kind;
}

std::optional<V4Config> v4_preset(const std::string& path, const std::vector<std::string>& overrides) {
  const auto entries = io::yaml_entries(io::read_file(path, "preset"), overrides, path, "--set");
  if (kind_of_entries(entries) != &v4_kind()) return std::nullopt;
  return model_from_preset(path, overrides).v4;
}

}  // namespace ds::model
