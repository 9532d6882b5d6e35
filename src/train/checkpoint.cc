#include "train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/text_input.h"
#include "model/init.h"
#include "model/weights.h"
#include "ops/linear.h"

namespace ds::train {

namespace fs = std::filesystem;

namespace {

// 2: each file's checksum in state.json and its role in its metadata; 1:
// neither (still read, with a warning).
constexpr int kFormat = 2;

// Parameters and first moments beyond this magnitude cannot come from
// training: their squares (norms, second moments) overflow float32.
constexpr float kMaxMagnitude = 0x1p64f;

const char* const kRoles[3][2] = {
    {"params.safetensors", "params"}, {"adam_m.safetensors", "adam_m"}, {"adam_v.safetensors", "adam_v"}};

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

// Every value of a tensor read from a checkpoint file: finite, parameters
// and first moments below kMaxMagnitude, second moments >= 0.
void check_values(const fs::path& file, const std::string& role, const std::string& name, const float* x, int64_t n) {
  const bool second = role == "adam_v";
  for (int64_t e = 0; e < n; ++e) {
    const float v = x[e];
    if (second ? (v >= 0 && std::isfinite(v)) : std::fabs(v) < kMaxMagnitude) continue;
    DS_FAIL("'{}': tensor '{}' element {} is {}: {}", file.string(), name, e, v,
            second ? "a second moment must be finite and >= 0"
                   : "not a value training produces (non-finite, or its square overflows float32)");
  }
}

// Copies the float32 tensors of `file` into the layout at base, checking
// names, shapes, the file's role (when it records one; `need_role`: it must)
// and the values.
void read_tree(const fs::path& file, const std::string& role, bool need_role,
               const std::vector<model::ParamInfo>& layout, float* base) {
  DS_CHECK(fs::is_regular_file(file), "checkpoint file '{}' is missing", file.string());
  const auto st = io::SafetensorsFile::open(file.string());
  const auto& meta = st.metadata();
  const auto r = meta.find("role");
  DS_CHECK(r != meta.end() || !need_role, "'{}' does not record its role (params, adam_m or adam_v)", file.string());
  DS_CHECK(r == meta.end() || r->second == role, "'{}' holds {}, not {}: files swapped?", file.string(), r->second,
           role);
  int64_t off = 0;
  for (const auto& i : layout) {
    DS_CHECK(st.contains(i.name), "'{}' lacks tensor '{}'", file.string(), i.name);
    const Tensor t = st.tensor(i.name);
    DS_CHECK(t.shape() == i.shape && t.dtype() == DType::F32, "'{}': tensor '{}' is {} {}, expected F32 {}",
             file.string(), i.name, dtype_name(t.dtype()), shape_str(t.shape()), shape_str(i.shape));
    const Tensor c = t.contiguous();
    check_values(file, role, i.name, c.data<float>(), i.numel());
    std::copy_n(c.data<float>(), i.numel(), base + off);
    off += i.numel();
  }
  DS_CHECK(layout.size() == st.tensors().size(), "'{}' holds {} tensors, the model has {}: another model's checkpoint?",
           file.string(), st.tensors().size(), layout.size());
}

// The file's size and checksum against those state.json recorded.
void verify_file(const fs::path& dir, const std::string& name, const nlohmann::json& files) {
  const fs::path file = dir / name;
  DS_CHECK(files.contains(name), "checkpoint '{}' is corrupt: state.json records no checksum for {}", dir.string(),
           name);
  std::error_code ec;
  DS_CHECK(fs::is_regular_file(file, ec), "checkpoint file '{}' is missing", file.string());
  const auto size = static_cast<int64_t>(fs::file_size(file, ec));
  try {
    const auto want = files.at(name).at("bytes").get<int64_t>();
    DS_CHECK(size == want, "checkpoint '{}' is corrupt: {} has {} bytes, state.json recorded {}", dir.string(), name,
             size, want);
    const std::string sum = file_crc32(file.string()), rec = files.at(name).at("crc32").get<std::string>();
    DS_CHECK(sum == rec, "checkpoint '{}' is corrupt: {} has CRC-32 {}, state.json recorded {}", dir.string(), name,
             sum, rec);
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("checkpoint '{}' is corrupt: state.json's entry for {}: {}", dir.string(), name, e.what());
  }
}

// The first float of a V2/V3 tree laid out by FlatParams (zeros or wrap).
float* tree_base(const model::ModelConfig& cfg, int64_t mtp, const model::FlatParams& p) {
  float* base = nullptr;
  model::for_each_param(
      cfg, mtp, [&](const model::ParamInfo&, float* const& x) { base = base ? base : x; }, p.ptr);
  return base;
}

}  // namespace

std::string file_crc32(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "cannot open '{}'", path);
  std::vector<unsigned char> buf(size_t{4} << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      DS_CHECK(n == 0, "reading '{}' failed", path);
      break;
    }
    crc = crc32(crc, buf.data(), static_cast<uInt>(n));
  }
  return fmt::format("{:08x}", static_cast<uint32_t>(crc));
}

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
  // Each file records its role; state.json (written last) its size and checksum.
  nlohmann::json files = nlohmann::json::object();
  const float* trees[3] = {params, adam_m, adam_v};
  for (int k = 0; k < 3; ++k) {
    if (!trees[k]) continue;
    const fs::path file = tmp / kRoles[k][0];
    io::save_safetensors(file.string(), named(layout, trees[k]), {{"format", "pt"}, {"role", kRoles[k][1]}});
    files[kRoles[k][0]] = {{"bytes", static_cast<int64_t>(fs::file_size(file))}, {"crc32", file_crc32(file.string())}};
  }
  nlohmann::json j = {{"format", kFormat},
                      {"step", state.step},
                      {"data_state", state.data_state},
                      {"consecutive_skipped", state.consecutive_skipped},
                      {"mtp_layers", mtp},
                      {"has_optimizer", adam_m != nullptr},
                      {"model_config", state.model_config},
                      {"run_config", state.run_config},
                      {"tokenizer", state.tokenizer},
                      {"files", files}};
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
    // A step_N without state.json is not complete (an older build's prune
    // killed midway).
    if (!fs::is_regular_file(e.path() / "state.json", ec)) continue;
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
  // Renamed first (atomic), so a kill leaves a .tmp folder, never a partial step_N.
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
    const fs::path step = fs::path(checkpoints_dir) / ("step_" + std::to_string(steps[i]));
    const fs::path gone = step.string() + ".pruned.tmp";
    fs::remove_all(gone, ec);
    fs::rename(step, gone, ec);
    if (!ec) fs::remove_all(gone, ec);
  }
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
    const int format = j.at("format").get<int>();
    DS_CHECK(format == 1 || format == kFormat, "checkpoint '{}' has format {}, this build reads 1 and {}", dir, format,
             kFormat);
    DS_CHECK(format == 1 || j.contains("files"), "checkpoint '{}' is corrupt: state.json records no checksums", dir);
    CheckpointState s;
    s.step = j.at("step").get<int64_t>();
    s.data_state = j.at("data_state");
    s.consecutive_skipped = j.at("consecutive_skipped").get<int64_t>();
    s.model_config = j.at("model_config");
    s.run_config = j.value("run_config", nlohmann::json::object());
    s.tokenizer = j.value("tokenizer", std::string());
    if (j.contains("files")) {
      s.files = j.at("files");
      DS_CHECK(s.files.is_object(), "checkpoint '{}' is corrupt: state.json's files is not an object", dir);
    }
    DS_CHECK(s.step >= 0, "checkpoint '{}': negative step", dir);
    // The folder's step_N (as the trainer names it) must agree with state.json.
    fs::path folder = fs::path(dir).lexically_normal();
    if (folder.filename().empty()) folder = folder.parent_path();
    const std::string n = folder.filename().string();
    if (n.starts_with("step_") && n.size() > 5 && n.size() <= 5 + 18 &&
        std::all_of(n.begin() + 5, n.end(), [](char c) { return c >= '0' && c <= '9'; }))
      DS_CHECK(std::stoll(n.substr(5)) == s.step, "checkpoint '{}' is corrupt: state.json says step {}, the folder {}",
               dir, s.step, n);
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
  const bool checked = !s.files.is_null();
  if (!checked)
    fmt::print(stderr, "warning: checkpoint '{}' was written before checksums: its files cannot be verified\n", dir);
  float* trees[3] = {params, adam_m, adam_v};
  for (int k = 0; k < 3; ++k)
    if (trees[k] && checked) verify_file(d, kRoles[k][0], s.files);
  try {
    for (int k = 0; k < 3; ++k)
      if (trees[k]) read_tree(d / kRoles[k][0], kRoles[k][1], checked, layout, trees[k]);
  } catch (const Error& e) {
    DS_FAIL("checkpoint '{}' is corrupt or from another model: {}", dir, e.what());
  }
  return s;
}

}  // namespace ds::train
