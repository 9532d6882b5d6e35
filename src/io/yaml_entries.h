// The key/value pairs of a YAML mapping followed by "key=value" overrides
// (values parsed as YAML scalars), in order, each tagged with where it came
// from; shared by the model presets and the training configs.
#pragma once

#include <yaml-cpp/yaml.h>

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

}  // namespace ds::io
