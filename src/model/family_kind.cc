#include "model/family_kind.h"

#include <algorithm>

#include "core/error.h"
#include "io/text_input.h"

namespace ds::model {

const std::vector<const FamilyKind*>& family_kinds() {
  static const std::vector<const FamilyKind*> kinds = {&v3_kind(), &v4_kind()};
  return kinds;
}

const FamilyKind& default_family_kind() { return *family_kinds().front(); }

const FamilyKind& ModelSpec::family_kind() const { return kind ? *kind : default_family_kind(); }

std::unique_ptr<Family> ModelSpec::family() const { return family_kind().family(*this); }

const FamilyKind* kind_of_entries(const std::vector<io::YamlEntry>& entries) {
  const FamilyKind* kind = nullptr;
  for (const auto& e : entries) {
    if (e.key != "decoder_block" || !e.value.IsScalar()) continue;
    kind = nullptr;
    for (const FamilyKind* k : family_kinds())
      if (k != &default_family_kind() && k->claims_decoder_block(e.value.Scalar())) kind = k;
  }
  return kind;
}

const FamilyKind& kind_of_model_type(const std::string& model_type) {
  for (const FamilyKind* k : family_kinds())
    if (k->claims_model_type(model_type)) return *k;
  return default_family_kind();
}

ModelSpec model_from_preset(const std::string& path, const std::vector<std::string>& overrides) {
  const auto entries = io::yaml_entries(io::read_file(path, "preset"), overrides, path, "--set");
  const FamilyKind* kind = kind_of_entries(entries);
  // A YAML or JSON exception that no key's own check expected still names the file.
  try {
    return (kind ? *kind : default_family_kind()).from_preset(path, entries, overrides);
  } catch (const YAML::Exception& e) {
    DS_FAIL("{}: a value of the wrong type or out of range: {}", path, e.what());
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("{}: {}", path, e.what());
  }
}

ModelSpec model_from_hf_config_file(const std::string& path) {
  return kind_of_model_type(config_model_type(path)).from_hf_config(io::read_file(path, "config"), path);
}

std::unique_ptr<Family> family_from_hf_config(const nlohmann::json& config, const std::string& source) {
  const bool typed = config.is_object() && config.contains("model_type") && config.at("model_type").is_string();
  const FamilyKind& kind = kind_of_model_type(typed ? config.at("model_type").get<std::string>() : "");
  return kind.from_hf_config(config.dump(), source).family();
}

void blaming_user_keys(const ModelKeys& in, const std::vector<std::string>& given, const std::function<void()>& build,
                       const std::function<void()>& preset_alone) {
  try {
    build();
    return;
  } catch (const Error& e) {
    if (given.empty() || in.preset.empty()) throw;
    try {
      preset_alone();
    } catch (const Error&) {
      throw e;
    }
    std::string msg = e.what();
    for (const std::string& prefix : {in.preset + ": ", std::string("override: ")})
      if (msg.starts_with(prefix)) msg = msg.substr(prefix.size());
    std::vector<std::string> last, sources;
    for (auto k = given.rbegin(); k != given.rend(); ++k) {
      const std::string name = k->substr(0, k->find('='));
      if (std::none_of(last.begin(), last.end(), [&](const std::string& x) { return x.starts_with(name + "="); }))
        last.insert(last.begin(), *k);
    }
    for (const auto& k : in.keys) {
      const bool named =
          std::any_of(given.begin(), given.end(), [&](const std::string& g) { return g.starts_with(k.key + "="); });
      if (named && std::find(sources.begin(), sources.end(), k.where) == sources.end()) sources.push_back(k.where);
    }
    std::string keys, where;
    for (const auto& k : last) keys += (keys.empty() ? "" : ", ") + k;
    for (const auto& w : sources) where += (where.empty() ? "" : " and ") + w;
    DS_FAIL("{}: model keys {} on top of preset '{}': {}", where, keys, in.preset, msg);
  }
}

}  // namespace ds::model
