#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/text_input.h"
#include "model/init.h"
#include "model/v4_weights.h"
#include "model/weights.h"
#include "ops/linear.h"

namespace ds::train {

namespace fs = std::filesystem;

namespace {

constexpr int kFormat = 1;

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  DS_CHECK(fd >= 0, "cannot open folder '{}' to flush it", dir.string());
  const int r = ::fsync(fd);
  ::close(fd);
  DS_CHECK(r == 0, "flushing folder '{}' failed", dir.string());
}

// The layout's tensors, laid out one after another from base, as borrowed
// float32 tensors under their names.
std::vector<std::pair<std::string, Tensor>> named(const std::vector<model::ParamInfo>& layout, const float* base) {
  std::vector<std::pair<std::string, Tensor>> v;
  int64_t off = 0;
  for (const auto& i : layout) {
    v.emplace_back(i.name, Tensor::borrow(const_cast<float*>(base) + off, i.shape, DType::F32));
    off += i.numel();
  }
  return v;
}

// Copies the float32 tensors of `file` into the layout at base, checking names and shapes.
void read_tree(const fs::path& file, const std::vector<model::ParamInfo>& layout, float* base) {
  DS_CHECK(fs::is_regular_file(file), "checkpoint file '{}' is missing", file.string());
  const auto st = io::SafetensorsSet::open_files({file.string()});
  int64_t off = 0;
  for (const auto& i : layout) {
    DS_CHECK(st.contains(i.name), "'{}' lacks tensor '{}'", file.string(), i.name);
    const Tensor t = st.tensor(i.name);
    DS_CHECK(t.shape() == i.shape && t.dtype() == DType::F32, "'{}': tensor '{}' is {} {}, expected F32 {}",
             file.string(), i.name, dtype_name(t.dtype()), shape_str(t.shape()), shape_str(i.shape));
    const Tensor c = t.contiguous();
    std::copy_n(c.data<float>(), i.numel(), base + off);
    off += i.numel();
  }
  DS_CHECK(layout.size() == st.names().size(), "'{}' holds {} tensors, the model has {}: another model's checkpoint?",
           file.string(), st.names().size(), layout.size());
}

// The first float of a V2/V3 tree laid out by FlatParams (zeros or wrap).
float* tree_base(const model::ModelConfig& cfg, int64_t mtp, const model::FlatParams& p) {
  float* base = nullptr;
  model::for_each_param(
      cfg, mtp, [&](const model::ParamInfo&, float* const& x) { base = base ? base : x; }, p.ptr);
  return base;
}

}  // namespace

std::string save_checkpoint(const std::string& checkpoints_dir, const model::ModelConfig& cfg, int64_t mtp,
                            const model::FlatParams& params, const model::FlatParams* adam_m,
                            const model::FlatParams* adam_v, const CheckpointState& state) {
  return save_checkpoint(checkpoints_dir, model::param_infos(cfg, mtp), tree_base(cfg, mtp, params),
                         adam_m ? tree_base(cfg, mtp, *adam_m) : nullptr,
                         adam_v ? tree_base(cfg, mtp, *adam_v) : nullptr, state, mtp);
}

std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<model::ParamInfo>& layout,
                            const float* params, const float* adam_m, const float* adam_v, const CheckpointState& state,
                            int64_t mtp) {
  const fs::path root(checkpoints_dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  DS_CHECK(!ec && fs::is_directory(root), "cannot create checkpoint folder '{}': {}", root.string(), ec.message());
  const std::string name = "step_" + std::to_string(state.step);
  const fs::path tmp = root / (name + ".tmp"), final = root / name;
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  DS_CHECK(!ec, "cannot create '{}': {}", tmp.string(), ec.message());
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  io::save_safetensors((tmp / "params.safetensors").string(), named(layout, params), meta);
  if (adam_m) io::save_safetensors((tmp / "adam_m.safetensors").string(), named(layout, adam_m), meta);
  if (adam_v) io::save_safetensors((tmp / "adam_v.safetensors").string(), named(layout, adam_v), meta);
  nlohmann::json j = {{"format", kFormat},
                      {"step", state.step},
                      {"data_state", state.data_state},
                      {"consecutive_skipped", state.consecutive_skipped},
                      {"mtp_layers", mtp},
                      {"has_optimizer", adam_m != nullptr},
                      {"model_config", state.model_config},
                      {"run_config", state.run_config},
                      {"tokenizer", state.tokenizer}};
  io::write_file_atomic((tmp / "state.json").string(), j.dump(2) + "\n");
  fsync_dir(tmp);
  // A checkpoint of the same step (a rerun) is replaced whole.
  if (fs::exists(final)) {
    const fs::path old = root / (name + ".old.tmp");
    fs::remove_all(old, ec);
    fs::rename(final, old, ec);
    DS_CHECK(!ec, "cannot move the old '{}' aside: {}", final.string(), ec.message());
    fs::rename(tmp, final, ec);
    DS_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp.string(), final.string(), ec.message());
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp, final, ec);
    DS_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp.string(), final.string(), ec.message());
  }
  fsync_dir(root);
  return final.string();
}

std::vector<int64_t> list_checkpoints(const std::string& checkpoints_dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return steps;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || !n.starts_with("step_") || n.size() > 5 + 18) continue;
    const std::string digits = n.substr(5);
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    steps.push_back(std::stoll(digits));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

void prune_checkpoints(const std::string& checkpoints_dir, int64_t keep) {
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec))
    if (e.path().filename().string().ends_with(".tmp")) fs::remove_all(e.path(), ec);
  if (keep < 1) return;
  const auto steps = list_checkpoints(checkpoints_dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i)
    fs::remove_all(fs::path(checkpoints_dir) / ("step_" + std::to_string(steps[i])), ec);
}

CheckpointState read_checkpoint_state(const std::string& dir) {
  const fs::path state = fs::path(dir) / "state.json";
  DS_CHECK(fs::is_regular_file(state), "'{}' is not a checkpoint (no state.json)", dir);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_file(state.string(), "checkpoint state"));
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("checkpoint '{}' is corrupt: state.json: {}", dir, e.what());
  }
  try {
    DS_CHECK(j.at("format").get<int>() == kFormat, "checkpoint '{}' has format {}, this build reads {}", dir,
             j.at("format").get<int>(), kFormat);
    CheckpointState s;
    s.step = j.at("step").get<int64_t>();
    s.data_state = j.at("data_state");
    s.consecutive_skipped = j.at("consecutive_skipped").get<int64_t>();
    s.model_config = j.at("model_config");
    s.run_config = j.value("run_config", nlohmann::json::object());
    s.tokenizer = j.value("tokenizer", std::string());
    DS_CHECK(s.step >= 0, "checkpoint '{}': negative step", dir);
    return s;
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("checkpoint '{}' is corrupt: state.json: {}", dir, e.what());
  }
}

CheckpointState load_checkpoint(const std::string& dir, const model::ModelConfig& cfg, int64_t mtp,
                                model::FlatParams& params, model::FlatParams* adam_m, model::FlatParams* adam_v) {
  return load_checkpoint(dir, model::param_infos(cfg, mtp), tree_base(cfg, mtp, params),
                         adam_m ? tree_base(cfg, mtp, *adam_m) : nullptr,
                         adam_v ? tree_base(cfg, mtp, *adam_v) : nullptr);
}

CheckpointState load_checkpoint(const std::string& dir, const std::vector<model::ParamInfo>& layout, float* params,
                                float* adam_m, float* adam_v) {
  CheckpointState s = read_checkpoint_state(dir);
  const fs::path d(dir);
  try {
    read_tree(d / "params.safetensors", layout, params);
    if (adam_m) read_tree(d / "adam_m.safetensors", layout, adam_m);
    if (adam_v) read_tree(d / "adam_v.safetensors", layout, adam_v);
  } catch (const Error& e) {
    DS_FAIL("checkpoint '{}' is corrupt or from another model: {}", dir, e.what());
  }
  return s;
}

}  // namespace ds::train
