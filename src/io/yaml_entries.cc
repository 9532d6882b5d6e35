#include "io/yaml_entries.h"

#include <map>
#include <regex>

#include "core/error.h"
#include "io/tokenizer.h"

namespace ds::io {

std::vector<YamlEntry> yaml_entries(const std::string& text, const std::vector<std::string>& overrides,
                                    const std::string& source, const std::string& override_source) {
  // YAML is UTF-8, and the values end up in JSON (the run folder's config).
  check_utf8(text, source.c_str());
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    DS_FAIL("{} is not valid YAML: {}", source, e.what());
  }
  DS_CHECK(root.IsMap() || root.IsNull(), "{} must be a mapping of keys to values", source);
  std::vector<YamlEntry> entries;
  std::map<std::string, int> line_of;  // a key given twice in one file would silently take the last value
  for (auto it = root.begin(); it != root.end(); ++it) {
    DS_CHECK(it->first.IsScalar(), "{}: every key must be a name, not a list, a mapping or nothing", source);
    const int line = it->first.Mark().line + 1;
    const auto [at, fresh] = line_of.emplace(it->first.Scalar(), line);
    DS_CHECK(fresh, "{}: key '{}' is given twice (lines {} and {})", source, it->first.Scalar(), at->second, line);
    entries.push_back({it->first.Scalar(), it->second, source});
  }
  for (const auto& o : overrides) {
    check_utf8(o, fmt::format("{} argument", override_source).c_str());
    const auto eq = o.find('=');
    DS_CHECK(eq != std::string::npos && eq > 0, "{}: '{}' is not key=value", override_source, o);
    YAML::Node v;
    try {
      v = YAML::Load(o.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      DS_FAIL("{}: '{}' has a bad value: {}", override_source, o, e.what());
    }
    entries.push_back({o.substr(0, eq), v, override_source});
  }
  return entries;
}

std::string yaml_flow_text(const YAML::Node& n) {
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

nlohmann::json yaml_to_json(const YAML::Node& n) {
  if (n.IsNull()) return nullptr;
  if (n.IsSequence()) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& x : n) a.push_back(yaml_to_json(x));
    return a;
  }
  if (n.IsMap()) {
    nlohmann::json o = nlohmann::json::object();
    for (const auto& kv : n) {
      DS_CHECK(kv.first.IsScalar(), "a mapping's keys must be names, not lists, mappings or nothing");
      o[kv.first.Scalar()] = yaml_to_json(kv.second);
    }
    return o;
  }
  const std::string text = n.Scalar();
  if (n.Tag() != "!") {  // an unquoted scalar
    static const std::regex integer("[-+]?[0-9]+"), number("[-+]?([0-9]+\\.?[0-9]*|\\.[0-9]+)([eE][-+]?[0-9]+)?");
    try {
      if (std::regex_match(text, integer)) return n.as<int64_t>();
      if (std::regex_match(text, number)) return n.as<double>();
    } catch (const YAML::Exception&) {
      DS_FAIL("the number {} is out of range", text);
    }
    if (text == "true" || text == "True" || text == "false" || text == "False") return n.as<bool>();
  }
  return text;
}

nlohmann::json entry_json(const YamlEntry& e) {
  try {
    return yaml_to_json(e.value);
  } catch (const Error& ex) {
    DS_FAIL("{}: key '{}': {}", e.where, e.key, ex.what());
  }
}

}  // namespace ds::io
