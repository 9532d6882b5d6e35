#include "train/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>

#include "core/error.h"
#include "core/system.h"
#include "io/text_input.h"
#include "io/yaml_entries.h"
#include "model/family_kind.h"
#include "ops/fp8_quant.h"
#include "ops/matmul.h"

namespace ds::train {

namespace fs = std::filesystem;

std::string TrainConfig::run_dir() const { return (fs::path(base_output_directory) / run_name).string(); }

namespace {

using Setter = std::function<void(TrainConfig&, const YAML::Node&)>;

std::vector<std::string> string_list(const YAML::Node& n) {
  std::vector<std::string> v;
  if (n.IsNull()) return v;
  if (n.IsScalar()) {  // a single regex, or "[]"-less command-line form
    v.push_back(n.as<std::string>());
    return v;
  }
  DS_CHECK(n.IsSequence(), "expected a list of strings");
  for (const auto& x : n) v.push_back(x.as<std::string>());
  return v;
}

const std::map<std::string, Setter>& train_keys() {
  static const std::map<std::string, Setter> keys = [] {
    std::map<std::string, Setter> k;
    auto str = [&](const char* key, std::string TrainConfig::*f) {
      k[key] = [f](TrainConfig& c, const YAML::Node& n) { c.*f = n.IsNull() ? "" : n.as<std::string>(); };
    };
    auto i64 = [&](const char* key, int64_t TrainConfig::*f) {
      k[key] = [f](TrainConfig& c, const YAML::Node& n) { c.*f = n.as<int64_t>(); };
    };
    auto dbl = [&](const char* key, double TrainConfig::*f) {
      k[key] = [f](TrainConfig& c, const YAML::Node& n) { c.*f = n.as<double>(); };
    };
    auto bol = [&](const char* key, bool TrainConfig::*f) {
      k[key] = [f](TrainConfig& c, const YAML::Node& n) { c.*f = n.as<bool>(); };
    };
    str("run_name", &TrainConfig::run_name);
    str("base_output_directory", &TrainConfig::base_output_directory);
    str("model_name", &TrainConfig::model_name);
    str("hf_config", &TrainConfig::hf_config);
    str("load_parameters_path", &TrainConfig::load_parameters_path);
    k["init_weights_seed"] = [](TrainConfig& c, const YAML::Node& n) { c.init_weights_seed = n.as<uint64_t>(); };
    dbl("init_weights_std", &TrainConfig::init_weights_std);
    str("dtype", &TrainConfig::dtype);
    str("weight_dtype", &TrainConfig::weight_dtype);
    str("quantization", &TrainConfig::quantization);
    i64("steps", &TrainConfig::steps);
    dbl("learning_rate", &TrainConfig::learning_rate);
    dbl("warmup_steps_fraction", &TrainConfig::warmup_steps_fraction);
    str("lr_schedule_type", &TrainConfig::lr_schedule_type);
    dbl("learning_rate_final_fraction", &TrainConfig::learning_rate_final_fraction);
    // The name before MaxText added WSD schedules.
    dbl("cosine_learning_rate_final_fraction", &TrainConfig::learning_rate_final_fraction);
    i64("learning_rate_schedule_steps", &TrainConfig::learning_rate_schedule_steps);
    dbl("wsd_decay_steps_fraction", &TrainConfig::wsd_decay_steps_fraction);
    str("wsd_decay_style", &TrainConfig::wsd_decay_style);
    str("opt_type", &TrainConfig::opt_type);
    dbl("adam_b1", &TrainConfig::adam_b1);
    dbl("adam_b2", &TrainConfig::adam_b2);
    dbl("adam_eps", &TrainConfig::adam_eps);
    dbl("adam_eps_root", &TrainConfig::adam_eps_root);
    dbl("adam_weight_decay", &TrainConfig::adam_weight_decay);
    k["adamw_mask"] = [](TrainConfig& c, const YAML::Node& n) { c.adamw_mask = string_list(n); };
    k["trainable_parameters_mask"] = [](TrainConfig& c, const YAML::Node& n) {
      c.trainable_parameters_mask = string_list(n);
    };
    dbl("gradient_clipping_threshold", &TrainConfig::gradient_clipping_threshold);
    i64("gradient_accumulation_steps", &TrainConfig::gradient_accumulation_steps);
    i64("max_consecutive_skipped_steps", &TrainConfig::max_consecutive_skipped_steps);
    k["per_device_batch_size"] = [](TrainConfig& c, const YAML::Node& n) {
      const double v = n.as<double>();
      // Range first: converting inf or 1e19 to int64 is undefined.
      DS_CHECK(v >= 1 && v <= 0x1p53 && v == std::floor(v), "per_device_batch_size {} must be a whole number >= 1", v);
      c.per_device_batch_size = static_cast<int64_t>(v);
    };
    i64("max_target_length", &TrainConfig::max_target_length);
    dbl("z_loss_multiplier", &TrainConfig::z_loss_multiplier);
    dbl("load_balance_loss_weight", &TrainConfig::load_balance_loss_weight);
    dbl("mtp_loss_scaling_factor", &TrainConfig::mtp_loss_scaling_factor);
    dbl("indexer_loss_scaling_factor", &TrainConfig::indexer_loss_scaling_factor);
    bol("indexer_sparse_training", &TrainConfig::indexer_sparse_training);
    str("remat_policy", &TrainConfig::remat_policy);
    k["dataset_type"] = [](TrainConfig& c, const YAML::Node& n) { c.data.dataset_type = n.as<std::string>(); };
    k["synthetic_task"] = [](TrainConfig& c, const YAML::Node& n) { c.data.synthetic_task = n.as<std::string>(); };
    k["dataset_path"] = [](TrainConfig& c, const YAML::Node& n) { c.data.dataset_path = n.as<std::string>(); };
    k["packing"] = [](TrainConfig& c, const YAML::Node& n) { c.data.packing = n.as<bool>(); };
    k["data_shuffle_seed"] = [](TrainConfig& c, const YAML::Node& n) { c.data.seed = n.as<uint64_t>(); };
    str("tokenizer_path", &TrainConfig::tokenizer_path);
    i64("eval_interval", &TrainConfig::eval_interval);
    i64("eval_steps", &TrainConfig::eval_steps);
    i64("eval_per_device_batch_size", &TrainConfig::eval_per_device_batch_size);
    dbl("target_eval_loss", &TrainConfig::target_eval_loss);
    bol("enable_checkpointing", &TrainConfig::enable_checkpointing);
    i64("checkpoint_period", &TrainConfig::checkpoint_period);
    k["max_num_checkpoints_to_keep"] = [](TrainConfig& c, const YAML::Node& n) {
      c.max_num_checkpoints_to_keep = n.IsNull() || n.as<std::string>() == "None" ? -1 : n.as<int64_t>();
    };
    bol("save_checkpoint_on_completion", &TrainConfig::save_checkpoint_on_completion);
    bol("resume", &TrainConfig::resume);
    i64("log_period", &TrainConfig::log_period);
    for (const std::string& key : dist::MeshConfig::keys())
      k[key] = [key](TrainConfig& c, const YAML::Node& n) { c.mesh.set(key, n.as<int64_t>()); };
    dbl("collective_timeout_seconds", &TrainConfig::collective_timeout_seconds);
    str("expert_dispatch", &TrainConfig::expert_dispatch);
    bol("expert_grad_comm_fp8", &TrainConfig::expert_grad_comm_fp8);
    bol("use_batch_split_schedule", &TrainConfig::use_batch_split_schedule);
    i64("batch_split_factor", &TrainConfig::batch_split_factor);
    dbl("link_model_latency_us", &TrainConfig::link_model_latency_us);
    dbl("link_model_gbps", &TrainConfig::link_model_gbps);
    i64("timeline_step", &TrainConfig::timeline_step);
    return k;
  }();
  return keys;
}

// Per-name remat settings for remat_policy=custom (MaxText's configurable names).
bool is_remat_name(const std::string& key) {
  for (int i = 0; i < model::kResidualCount; ++i)
    if (key == model::residual_name(static_cast<model::Residual>(i))) return true;
  return key == "mlpwi" || key == "qkv_proj" || key == "indexer_cutoff_threshold";
}

// f(), with a YAML or JSON exception that no key's own check expected
// turned into a ds::Error that names `source`.
template <class F>
auto naming_source(const std::string& source, F&& f) {
  try {
    return f();
  } catch (const YAML::Exception& e) {
    DS_FAIL("{}: a value of the wrong type or out of range: {}", source, e.what());
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("{}: {}", source, e.what());
  }
}

std::string find_preset(const std::string& name, const std::string& source) {
  std::vector<fs::path> tries;
  if (name.ends_with(".yml") || name.ends_with(".yaml")) tries.push_back(name);
  const fs::path dir = fs::path(source).parent_path();
  for (const fs::path& d : {dir, dir.parent_path(), fs::path(".")}) {
    tries.push_back(d / (name + ".yml"));
    tries.push_back(d / "configs" / (name + ".yml"));
  }
  std::error_code ec;
  for (const auto& p : tries)
    if (fs::is_regular_file(p, ec)) return p.string();
  DS_FAIL("model_name '{}': no preset {}.yml found (looked next to {} and in configs/)", name, name, source);
}

void check_config(const RunConfig& rc) {
  const TrainConfig& t = rc.train;
  const auto family_box = model_family(rc);
  const model::Family& family = *family_box;
  const int64_t max_positions = family.max_positions();
  DS_CHECK(!t.run_name.empty() && t.run_name.find('/') == std::string::npos && t.run_name != "." && t.run_name != "..",
           "run_name '{}' must be a non-empty folder name", t.run_name);
  DS_CHECK(!t.base_output_directory.empty(), "base_output_directory must not be empty");
  DS_CHECK(t.steps >= 1, "steps {} must be >= 1", t.steps);
  DS_CHECK(t.learning_rate >= 0 && std::isfinite(t.learning_rate), "learning_rate {} must be >= 0", t.learning_rate);
  DS_CHECK(t.warmup_steps_fraction >= 0 && t.warmup_steps_fraction <= 1, "warmup_steps_fraction {} not in [0, 1]",
           t.warmup_steps_fraction);
  DS_CHECK(t.lr_schedule_type == "cosine" || t.lr_schedule_type == "wsd", "lr_schedule_type '{}' is not cosine or wsd",
           t.lr_schedule_type);
  DS_CHECK(t.learning_rate_final_fraction >= 0 && t.learning_rate_final_fraction <= 1,
           "learning_rate_final_fraction {} not in [0, 1]", t.learning_rate_final_fraction);
  DS_CHECK(t.learning_rate_schedule_steps == -1 || t.learning_rate_schedule_steps >= 1,
           "learning_rate_schedule_steps {} must be -1 (= steps) or >= 1", t.learning_rate_schedule_steps);
  DS_CHECK(t.wsd_decay_style == "linear" || t.wsd_decay_style == "cosine",
           "wsd_decay_style '{}' is not linear or cosine", t.wsd_decay_style);
  if (t.lr_schedule_type == "wsd")
    DS_CHECK(t.wsd_decay_steps_fraction > 0 && t.warmup_steps_fraction + t.wsd_decay_steps_fraction <= 1,
             "wsd: warmup_steps_fraction {} + wsd_decay_steps_fraction {} must be <= 1 (and decay > 0)",
             t.warmup_steps_fraction, t.wsd_decay_steps_fraction);
  DS_CHECK(t.opt_type == "adamw", "opt_type '{}' is not supported (adamw)", t.opt_type);
  DS_CHECK(t.adam_b1 >= 0 && t.adam_b1 < 1 && t.adam_b2 >= 0 && t.adam_b2 < 1,
           "adam_b1 {} and adam_b2 {} must be in [0, 1)", t.adam_b1, t.adam_b2);
  DS_CHECK(t.adam_eps >= 0 && t.adam_eps_root >= 0 && t.adam_eps + t.adam_eps_root > 0,
           "adam_eps {} and adam_eps_root {} must be >= 0 and not both 0", t.adam_eps, t.adam_eps_root);
  DS_CHECK(t.adam_weight_decay >= 0, "adam_weight_decay {} must be >= 0", t.adam_weight_decay);
  DS_CHECK(t.gradient_clipping_threshold >= 0, "gradient_clipping_threshold {} must be >= 0 (0: off)",
           t.gradient_clipping_threshold);
  DS_CHECK(t.gradient_accumulation_steps >= 1, "gradient_accumulation_steps {} must be >= 1",
           t.gradient_accumulation_steps);
  DS_CHECK(t.max_consecutive_skipped_steps >= 1, "max_consecutive_skipped_steps {} must be >= 1",
           t.max_consecutive_skipped_steps);
  DS_CHECK(t.per_device_batch_size >= 1 && t.per_device_batch_size <= (1 << 20),
           "per_device_batch_size {} not in [1, 2^20]", t.per_device_batch_size);
  DS_CHECK(t.max_target_length >= 2, "max_target_length {} must be >= 2", t.max_target_length);
  DS_CHECK(t.max_target_length <= max_positions,
           "max_target_length {} is longer than the model allows (max_position_embeddings {})", t.max_target_length,
           max_positions);
  DS_CHECK(t.z_loss_multiplier >= 0 && t.load_balance_loss_weight >= 0 && t.mtp_loss_scaling_factor >= 0,
           "z_loss_multiplier, load_balance_loss_weight and mtp_loss_scaling_factor must be >= 0");
  ops::parse_gemm_dtype(t.dtype);  // float32 or bfloat16, else one clear error
  ops::parse_quantization(t.quantization);
  DS_CHECK(t.weight_dtype == "float32",
           "weight_dtype '{}': the master weights, gradients and AdamW moments are float32 (dtype sets the "
           "arithmetic)",
           t.weight_dtype);
  DS_CHECK(t.eval_interval == -1 || t.eval_interval >= 1, "eval_interval {} must be -1 (off) or >= 1", t.eval_interval);
  DS_CHECK(t.eval_interval == -1 || t.data.dataset_type == "tokens",
           "eval_interval {}: dataset_type={} has no eval split (only tokens, from `deepseek prepare`, has one)",
           t.eval_interval, t.data.dataset_type);
  DS_CHECK(t.eval_steps == -1 || t.eval_steps >= 1, "eval_steps {} must be -1 or >= 1", t.eval_steps);
  DS_CHECK(t.eval_per_device_batch_size >= 0, "eval_per_device_batch_size {} must be >= 0",
           t.eval_per_device_batch_size);
  DS_CHECK(t.checkpoint_period >= 1, "checkpoint_period {} must be >= 1", t.checkpoint_period);
  DS_CHECK(t.max_num_checkpoints_to_keep == -1 || t.max_num_checkpoints_to_keep >= 1,
           "max_num_checkpoints_to_keep {} must be >= 1 (or None: keep all)", t.max_num_checkpoints_to_keep);
  DS_CHECK(t.collective_timeout_seconds >= 0, "collective_timeout_seconds {} must be >= 0 (0: wait forever)",
           t.collective_timeout_seconds);
  DS_CHECK(t.expert_dispatch == "alltoall" || t.expert_dispatch == "allgather",
           "expert_dispatch '{}' is not alltoall or allgather", t.expert_dispatch);
  DS_CHECK(t.link_model_latency_us >= 0 && t.link_model_gbps >= 0,
           "link_model_latency_us {} and link_model_gbps {} must be >= 0", t.link_model_latency_us, t.link_model_gbps);
  DS_CHECK(t.batch_split_factor >= 1, "batch_split_factor {} must be >= 1", t.batch_split_factor);
  if (t.use_batch_split_schedule) {
    DS_CHECK(t.batch_split_factor >= 2, "use_batch_split_schedule needs batch_split_factor >= 2 (it is {})",
             t.batch_split_factor);
    DS_CHECK(t.per_device_batch_size % t.batch_split_factor == 0,
             "batch_split_factor {} does not divide per_device_batch_size {}", t.batch_split_factor,
             t.per_device_batch_size);
  }
  DS_CHECK(t.log_period >= 1, "log_period {} must be >= 1", t.log_period);
  DS_CHECK(t.init_weights_std > 0, "init_weights_std {} must be positive", t.init_weights_std);
  for (const auto& list : {&t.adamw_mask, &t.trainable_parameters_mask})
    for (const auto& re : *list) try {
        std::regex r(re);
      } catch (const std::regex_error& e) {
        DS_FAIL("'{}' is not a valid regular expression: {}", re, e.what());
      }
  // What the model's family does not offer: one clear line each.
  DS_CHECK(t.indexer_loss_scaling_factor >= 0, "indexer_loss_scaling_factor {} must be >= 0",
           t.indexer_loss_scaling_factor);
  model::LossOptions lo;
  lo.load_balance_loss_weight = t.load_balance_loss_weight;
  lo.indexer_loss_scaling_factor = t.indexer_loss_scaling_factor;
  lo.indexer_sparse_training = t.indexer_sparse_training;
  lo.batch_split_factor = t.use_batch_split_schedule ? t.batch_split_factor : 1;
  family.check_loss_options(lo);
  // A DSA model's indexer learns from its loss alone: with it off, a mask
  // that leaves only indexer tensors trainable trains nothing.
  if (family.reports_indexer_loss() && t.indexer_loss_scaling_factor == 0 && !t.trainable_parameters_mask.empty()) {
    std::vector<std::regex> res;
    for (const auto& re : t.trainable_parameters_mask) res.emplace_back(re);
    bool other = false;
    for (const auto& i : family.layout()) {
      if (!i.trainable() || i.name.find(".indexer.") != std::string::npos) continue;
      for (const auto& r : res) other |= std::regex_search(i.name, r);
    }
    DS_CHECK(other,
             "trainable_parameters_mask leaves only the indexer trainable but indexer_loss_scaling_factor is 0: "
             "nothing would learn (the indexer learns from its KL loss alone; the dense warm-up uses e.g. 0.01)");
  }
}

}  // namespace

namespace {

// The model's family: the one a Hugging Face config's model_type names, else
// the one the keys' decoder_block names, else the preset's (else the default).
const model::FamilyKind& model_kind(const model::ModelKeys& in, const std::vector<io::YamlEntry>& rest) {
  if (!in.hf_config.empty()) return model::kind_of_model_type(model::config_model_type(in.hf_config));
  const model::FamilyKind* kind = model::kind_of_entries(rest);
  if (!kind) kind = model::kind_of_entries(in.preset_entries);
  return kind ? *kind : model::default_family_kind();
}

// The model of a run from `rest` (the keys that are not training keys):
// its family's model keys go to the family's kind, remat names to
// `custom_remat`; any other key is an error.
void read_model(RunConfig& rc, const std::vector<io::YamlEntry>& rest, const std::string& source,
                std::vector<std::pair<std::string, std::string>>& custom_remat) {
  const TrainConfig& t = rc.train;
  model::ModelKeys in;
  in.source = source;
  in.hf_config = !t.hf_config.empty() ? t.hf_config : t.load_parameters_path;
  if (!in.hf_config.empty()) {
    std::error_code ec;
    if (fs::is_directory(in.hf_config, ec)) in.hf_config = (fs::path(in.hf_config) / "config.json").string();
  } else if (!t.model_name.empty()) {
    in.preset = find_preset(t.model_name, source);
    in.preset_entries = io::yaml_entries(io::read_file(in.preset, "preset"), {}, in.preset, "");
  }
  const model::FamilyKind& kind = model_kind(in, rest);
  const std::vector<std::string> over_hf = kind.keys_over_hf_config();
  std::string over_hf_text;
  for (size_t i = 0; i < over_hf.size(); ++i)
    over_hf_text += (i == 0 ? "" : i + 1 == over_hf.size() ? " and " : ", ") + over_hf[i];
  for (const auto& e : rest) {
    if (kind.is_model_key(e.key)) {
      DS_CHECK(in.hf_config.empty() || std::find(over_hf.begin(), over_hf.end(), e.key) != over_hf.end(),
               "{}: model key '{}' cannot change a Hugging Face config (only {})", e.where, e.key, over_hf_text);
      in.keys.push_back(e);
    } else if (is_remat_name(e.key)) {
      DS_CHECK(e.value.IsScalar(), "{}: remat name '{}' takes remat, device or offload, not a list or mapping", e.where,
               e.key);
      custom_remat.emplace_back(e.key, e.value.Scalar());
    } else {
      DS_FAIL("{}: unknown key '{}' (neither a training key nor a {} model key)", e.where, e.key, kind.name());
    }
  }
  static_cast<model::ModelSpec&>(rc) = kind.from_run_keys(in);
}

RunConfig build_run_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                           const std::string& source) {
  // Every key in order: the file's, then the overrides (a later one wins).
  const auto entries = io::yaml_entries(yaml_text, overrides, source, "command line");

  RunConfig rc;
  TrainConfig& t = rc.train;
  std::map<std::string, YAML::Node> given;
  std::vector<io::YamlEntry> rest;  // model keys, remat names, unknown keys
  for (const auto& e : entries) {
    given[e.key] = e.value;
    const auto& keys = train_keys();
    if (auto it = keys.find(e.key); it != keys.end()) {
      try {
        it->second(t, e.value);
      } catch (const YAML::Exception& ex) {
        DS_FAIL("{}: key '{}' has a value of the wrong type: {}", e.where, e.key, ex.what());
      } catch (const Error& ex) {
        DS_FAIL("{}: key '{}': {}", e.where, e.key, ex.what());
      }
    } else {
      rest.push_back(e);
    }
  }
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, value] : given) j[key] = io::yaml_flow_text(value);
  t.as_json = j;

  std::vector<std::pair<std::string, std::string>> custom_remat;
  read_model(rc, rest, source, custom_remat);
  // A model whose Engram hashes token classes takes them from
  // tokenizer_path, else the Hugging Face folder's tokenizer.json.
  if (rc.family_kind().hashes_token_classes(rc)) {
    std::string tok = t.tokenizer_path;
    if (tok.empty() && !t.hf_config.empty()) {
      std::error_code ec;
      const fs::path hf(t.hf_config);
      tok = ((fs::is_directory(hf, ec) ? hf : hf.parent_path()) / "tokenizer.json").string();
    }
    if (tok.empty() && !t.load_parameters_path.empty())
      tok = (fs::path(t.load_parameters_path) / "tokenizer.json").string();
    DS_CHECK(!tok.empty(), "{}: Engram over token classes needs tokenizer_path (its token classes)", source);
    rc.family_kind().attach_token_classes(rc, tok);
  }
  DS_CHECK(t.remat_policy == "custom" || custom_remat.empty(),
           "per-name remat settings ('{}') need remat_policy=custom",
           custom_remat.empty() ? "" : custom_remat.front().first);
  t.remat = model::RematPolicy::from_name(t.remat_policy, custom_remat);
  t.data.batch = t.per_device_batch_size;
  t.data.seq = t.max_target_length;
  t.data.vocab_size = model_family(rc)->vocab_size();
  check_config(rc);
  return rc;
}

}  // namespace

RunConfig parse_run_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                           const std::string& source) {
  // The keys' own checks name the key; a conversion none of them expected
  // still ends as a ds::Error that names the file.
  return naming_source(source, [&] { return build_run_config(yaml_text, overrides, source); });
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_run_config(io::read_file(path, "config"), overrides, path);
}

std::unique_ptr<model::Family> model_family(const RunConfig& rc) { return rc.family(); }

int64_t training_memory_bytes(const RunConfig& rc) {
  const auto family = model_family(rc);
  const TrainConfig& t = rc.train;
  // In double: the sizes are each bounded, their product need not fit int64.
  const double tokens = static_cast<double>(t.per_device_batch_size) * static_cast<double>(t.max_target_length);
  const double saved = family->saved_bytes_per_token(t.remat, t.dtype == "bfloat16", t.max_target_length);
  const double bytes =
      16.0 * static_cast<double>(family->numel()) + tokens * (8.0 * static_cast<double>(family->vocab_size()) + saved);
  return bytes >= 0x1p62 ? int64_t{1} << 62 : static_cast<int64_t>(bytes);
}

void check_training_memory(const RunConfig& rc) {
  const int64_t have = physical_memory_bytes();
  const int64_t need = training_memory_bytes(rc);
  if (have <= 0 || need <= have) return;
  const auto family = model_family(rc);
  const double state = 16.0 * static_cast<double>(family->numel()) / 1073741824.0;
  DS_FAIL(
      "per_device_batch_size {} x max_target_length {} with remat_policy {}: training needs about {:.1f} GiB "
      "(parameters, gradients and AdamW moments {:.1f} GiB, activations {:.1f} GiB), more than this machine's "
      "{:.1f} GiB of memory",
      rc.train.per_device_batch_size, rc.train.max_target_length, rc.train.remat_policy,
      static_cast<double>(need) / 1073741824.0, state, static_cast<double>(need) / 1073741824.0 - state,
      static_cast<double>(have) / 1073741824.0);
}

}  // namespace ds::train
