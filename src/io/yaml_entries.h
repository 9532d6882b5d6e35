// The key/value pairs of a YAML mapping followed by "key=value" overrides
// (values parsed as YAML scalars), in order, each tagged with where it came
// from; shared by the model presets and the training configs.
#pragma once

#include <yaml-cpp/yaml.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ds::io {

struct YamlEntry {
  std::string key;
  YAML::Node value;
  std::string where;  // `source` or `override_source`
};

// One clear error for text that is not UTF-8, not YAML or not a mapping of
// names, a key given twice in the text (naming both lines), or an override
// that is not UTF-8, has no '=' or a value that is not YAML.
std::vector<YamlEntry> yaml_entries(const std::string& text, const std::vector<std::string>& overrides,
                                    const std::string& source, const std::string& override_source);

// A value as YAML's flow style writes it ("3", "[0, 4]"): how a key=value
// override spells it.
std::string yaml_flow_text(const YAML::Node& n);
// A YAML value as JSON: scalars as integers, then numbers, then booleans,
// then strings (as the YAML 1.2 core schema reads them); lists and maps
// alike. ds::Error for a number out of range or a mapping key that is not
// a name.
nlohmann::json yaml_to_json(const YAML::Node& n);
// yaml_to_json of an entry's value; errors name the entry.
nlohmann::json entry_json(const YamlEntry& e);

}  // namespace ds::io
