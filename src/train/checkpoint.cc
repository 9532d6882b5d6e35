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

void load_hf_params(const std::string& dir, const model::ModelConfig& cfg, int64_t mtp, model::FlatParams& params) {
  // The generation loader finds and checks every tensor (names, shapes, fp8
  // block scales, non-finite values); each is then widened to float32.
  const auto st = io::SafetensorsSet::open_dir(dir);
  const auto w = model::ModelWeights::load(st, cfg, mtp);
  model::for_each_param(
      cfg, mtp, [](const model::ParamInfo&, const ops::WeightView& v, float*& x) { ops::widen_rows(x, v, 0, v.rows); },
      w.view, params.ptr);
}

void export_hf(const std::string& out_dir, const model::ModelConfig& cfg, int64_t mtp, const model::FlatParams& params,
               DType dtype) {
  DS_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
           "export: weights can be written as f32, bf16 or f16, not {}", dtype_name(dtype));
  model::prepare_model_folder(out_dir, "export");
  std::vector<std::pair<std::string, Tensor>> ts;
  auto put = [&](const std::string& name, const Tensor& f32, bool vector) {
    ts.emplace_back(name, vector || dtype == DType::F32 ? f32.to(DType::F32) : f32.to(dtype));
  };
  model::for_each_param(
      cfg, mtp,
      [&](const model::ParamInfo& i, float* const& x) {
        put(i.name, Tensor::borrow(x, i.shape, DType::F32), i.shape.size() == 1);
      },
      params.ptr);
  // Hugging Face's MTP layers carry their own copies of the embedding and head.
  const float* head = params.ptr.lm_head;
  for (int64_t k = 0; k < mtp; ++k) {
    const std::string p = "model.layers." + std::to_string(cfg.num_hidden_layers + k);
    put(p + ".embed_tokens.weight", Tensor::borrow(params.ptr.embed, {cfg.vocab_size, cfg.hidden_size}, DType::F32),
        false);
    put(p + ".shared_head.head.weight",
        Tensor::borrow(const_cast<float*>(head), {cfg.vocab_size, cfg.hidden_size}, DType::F32), false);
  }
  io::save_safetensors((fs::path(out_dir) / "model.safetensors").string(), ts, {{"format", "pt"}});
  auto j = model::to_hf_json(cfg, mtp);
  j["torch_dtype"] = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  io::write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
}

void init_params(const model::ModelConfig& cfg, int64_t mtp, model::FlatParams& params, uint64_t seed, float std) {
  uint64_t stream = 0;  // one Philox stream per matrix, as write_random_checkpoint
  model::for_each_param(
      cfg, mtp,
      [&](const model::ParamInfo& i, float*& x) {
        switch (i.role) {
          case model::ParamRole::Norm:
            std::fill(x, x + i.numel(), 1.0f);
            break;
          case model::ParamRole::RoutingBias:
          case model::ParamRole::NormBias:
            std::fill(x, x + i.numel(), 0.0f);
            break;
          default:
            fill_normal(x, i.numel(), std, seed, stream++);
        }
      },
      params.ptr);
}

void init_v4_params(const model::V4Config& c, model::V4FlatParams& p, uint64_t seed, float std) {
  uint64_t stream = 0;  // one Philox stream per matrix, in tree order
  model::for_each_v4_param(
      c,
      [&](const model::V4ParamInfo& i, float* const& x) {
        const int64_t n = shape_numel(i.shape);
        if (i.role == model::V4Role::HashTable) {
          // Each token's experts: distinct, drawn from its own counters.
          const Philox rng(seed, stream++);
          const int64_t k = i.shape[1];
          uint64_t at = 0;
          for (int64_t t = 0; t < i.shape[0]; ++t)
            for (int64_t j = 0; j < k; ++j) {
              float e;
              bool taken;
              do {
                e = static_cast<float>(rng.u32(at++) % static_cast<uint32_t>(c.n_routed_experts));
                taken = std::find(x + t * k, x + t * k + j, e) != x + t * k + j;
              } while (taken);
              x[t * k + j] = e;
            }
        } else if (i.shape.size() >= 2) {
          fill_normal(x, n, std, seed, stream++);
        } else {
          // Norm scales and the mHC scales 1; the sink, the mHC biases and the routing bias 0.
          const bool one = i.name.ends_with("norm.weight") || i.name.ends_with("_scale");
          std::fill(x, x + n, one ? 1.0f : 0.0f);
        }
      },
      p.ptr);
  p.sync_tables(c);
}

void load_v4_hf_params(const std::string& dir, const model::V4Config& c, model::V4FlatParams& p) {
  // The generation loader finds and checks every tensor; each is then widened.
  const auto st = io::SafetensorsSet::open_dir(dir);
  const auto w = model::V4Weights::load(st, c);
  model::for_each_v4_param(
      c,
      [](const model::V4ParamInfo& i, const ops::WeightView& v, float* const& x) {
        if (i.role == model::V4Role::HashTable) {
          const auto* t = static_cast<const int32_t*>(v.data);
          for (int64_t k = 0; k < shape_numel(i.shape); ++k) x[k] = static_cast<float>(t[k]);
        } else {
          ops::widen_rows(x, v, 0, v.rows);
        }
      },
      w.view, p.ptr);
  p.sync_tables(c);
}

void export_v4_hf(const std::string& out_dir, const model::V4Config& c, const float* params, DType dtype,
                  const char* who) {
  DS_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
           "{}: DeepSeek-V4 weights can be written as f32, bf16 or f16, not {}", who, dtype_name(dtype));
  model::prepare_model_folder(out_dir, who);
  std::vector<std::pair<std::string, Tensor>> ts;
  int64_t off = 0;
  model::for_each_v4_param(c, [&](const model::V4ParamInfo& i) {
    const Tensor f32 = Tensor::borrow(const_cast<float*>(params) + off, i.shape, DType::F32);
    off += shape_numel(i.shape);
    if (i.role == model::V4Role::HashTable) {
      Tensor t = Tensor::empty(i.shape, DType::I32);
      for (int64_t k = 0; k < t.numel(); ++k) t.data<int32_t>()[k] = static_cast<int32_t>(f32.data<float>()[k]);
      ts.emplace_back(i.name, std::move(t));
    } else {
      ts.emplace_back(i.name,
                      i.role == model::V4Role::Vector || dtype == DType::F32 ? f32.to(DType::F32) : f32.to(dtype));
    }
  });
  io::save_safetensors((fs::path(out_dir) / "model.safetensors").string(), ts, {{"format", "pt"}});
  // Float weights: no quantization_config, and the routed experts are not packed fp4.
  auto j = c.to_hf_json();
  j.erase("expert_dtype");
  j["torch_dtype"] = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  io::write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
}

}  // namespace ds::train
