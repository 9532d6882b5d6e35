// Which family a configuration describes, and its model from it: the other
// half of the family seam (model/family.h). A family's kind knows what
// names it (a preset's `decoder_block`, a config.json's `model_type`), its
// model keys, and how to build its configuration from a preset, the user's
// keys or a Hugging Face config.json; the training config (train/config.cc)
// and `deepseek init` ask the registry below and never name a family.
//
// Each family's kind lives with its family: DeepSeek-V2/V3/V3.2 in
// model/v3/kind.cc, DeepSeek-V4 in model/v4/kind.cc.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/yaml_entries.h"
#include "model/config.h"
#include "model/family.h"
#include "model/v4_config.h"

namespace ds::model {

class FamilyKind;

// A model as a configuration describes it: the kind that built it and that
// kind's configuration (the other families' fields stay default). The
// fields are the families' own configuration types, for code that works
// below the seam (a family's tests, its benchmarks).
struct ModelSpec {
  const FamilyKind* kind = nullptr;  // null: default_family_kind()
  ModelConfig model;                 // DeepSeek-V2/V3/V3.2
  // DeepSeek-V4, and its aux-loss-free balancing rate (a training key for
  // V4, a ModelConfig field for V3).
  std::optional<V4Config> v4;
  double v4_routed_bias_update_rate = 0.0;

  const FamilyKind& family_kind() const;
  // The model behind the family seam.
  std::unique_ptr<Family> family() const;
};

// What a training run's configuration says of its model (train/config.h
// describes the keys). At most one of hf_config and preset is set.
struct ModelKeys {
  std::string source;                         // the run's configuration: errors name it when there is no preset
  std::string hf_config;                      // a Hugging Face config.json ("" when none)
  std::string preset;                         // a preset file ("" when none)
  std::vector<io::YamlEntry> preset_entries;  // its entries
  // The user's keys that FamilyKind::is_model_key took, in order (a later
  // one wins); over a Hugging Face config only keys_over_hf_config().
  std::vector<io::YamlEntry> keys;
};

class FamilyKind {
 public:
  virtual ~FamilyKind() = default;

  // Whose model keys these are, in messages: "DeepSeek-V2/V3", "DeepSeek-V4".
  virtual std::string name() const = 0;
  // Whether a preset's or the keys' `decoder_block` value, or a
  // config.json's `model_type`, names this family.
  virtual bool claims_decoder_block(const std::string& value) const = 0;
  virtual bool claims_model_type(const std::string& model_type) const = 0;
  // Whether `key` is one of this family's model keys in a training config.
  virtual bool is_model_key(const std::string& key) const = 0;
  // The model keys a training config may give on top of a Hugging Face config.
  virtual std::vector<std::string> keys_over_hf_config() const = 0;

  // A training run's model, checked (ds::Error naming the key or file at fault).
  virtual ModelSpec from_run_keys(const ModelKeys& in) const = 0;
  // A model from the text of a Hugging Face config.json; `source` names it in errors.
  virtual ModelSpec from_hf_config(const std::string& text, const std::string& source) const = 0;
  // A model from a preset file alone with key=value `overrides` (as
  // `deepseek init --set` gives them); `entries` are the file's and the
  // overrides', as io::yaml_entries reads them.
  virtual ModelSpec from_preset(const std::string& path, const std::vector<io::YamlEntry>& entries,
                                const std::vector<std::string>& overrides) const = 0;

  // The family of a model this kind built.
  virtual std::unique_ptr<Family> family(const ModelSpec& spec) const = 0;

  // Whether the model hashes the tokenizer's token classes (an Engram over
  // them), and attaching them to it from a tokenizer.json (ds::Error when
  // that is not a file, or gives another class count than the config says).
  virtual bool hashes_token_classes(const ModelSpec&) const { return false; }
  virtual void attach_token_classes(ModelSpec&, const std::string& /*tokenizer_json*/) const {}
};

// The kinds, each once; the first is the default.
const FamilyKind& v3_kind();  // model/v3/kind.cc
const FamilyKind& v4_kind();  // model/v4/kind.cc
const std::vector<const FamilyKind*>& family_kinds();
// The kind of a model that names no other family (MaxText's decoder_block
// deepseek); its parser reports a decoder_block or model_type no kind claims.
const FamilyKind& default_family_kind();

// The kind that the last `decoder_block` among `entries` names (null: none
// names a family besides the default).
const FamilyKind* kind_of_entries(const std::vector<io::YamlEntry>& entries);
// The kind that claims a config.json's model_type (else the default).
const FamilyKind& kind_of_model_type(const std::string& model_type);

// A model from a preset (with `overrides`, as `deepseek init --set`), or
// from a Hugging Face config.json file, of the family it names.
ModelSpec model_from_preset(const std::string& path, const std::vector<std::string>& overrides);
ModelSpec model_from_hf_config_file(const std::string& path);

// For the kinds' from_run_keys: build(); when it fails but preset_alone()
// does not, the error is the user's keys' doing and is rethrown naming
// where they were given (the places of in.keys named in `given`) and `given` (key=value each, the
// last value of a key), not the preset.
void blaming_user_keys(const ModelKeys& in, const std::vector<std::string>& given, const std::function<void()>& build,
                       const std::function<void()>& preset_alone);

// DeepSeek-V4's configuration from a preset, checked as `deepseek init`
// checks it; nullopt when the preset is of another family.
std::optional<V4Config> v4_preset(const std::string& path, const std::vector<std::string>& overrides);

}  // namespace ds::model
