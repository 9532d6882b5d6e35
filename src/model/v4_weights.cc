#include "model/v4_weights.h"

#include <cstring>
#include <set>

#include "core/dtype.h"
#include "core/error.h"

namespace ds::model {

namespace {

class V4Loader {
 public:
  V4Loader(const io::SafetensorsSet& st, const V4Config& cfg) : st_(st), cfg_(cfg) {}

  // The stored name of `name`: itself, or with the "model." prefix.
  std::string find(const std::string& name) const {
    if (st_.contains(name)) return name;
    if (st_.contains("model." + name)) return "model." + name;
    return "";
  }
  std::string require(const std::string& name, const Shape& shape) const {
    const std::string s = find(name);
    DS_CHECK(!s.empty(), "checkpoint is missing tensor '{}' (expected shape {})", name, shape_str(shape));
    return s;
  }
  const io::TensorInfo& info(const std::string& stored) {
    used_.insert(stored);
    const io::TensorInfo& i = st_.info(stored);
    bytes_ += i.end - i.begin;
    return i;
  }
  // A float tensor of exactly `shape`, checked for NaN and infinity.
  Tensor float_tensor(const std::string& stored, const Shape& shape) {
    const io::TensorInfo& i = info(stored);
    DS_CHECK(i.shape == shape, "tensor '{}' has shape {}, the config implies {}", stored, shape_str(i.shape),
             shape_str(shape));
    Tensor t = st_.tensor(stored);
    DS_CHECK(dtype_is_float(t.dtype()), "tensor '{}' has non-float dtype {}", stored, dtype_name(t.dtype()));
    const int64_t bad = find_non_finite(t.raw(), t.dtype(), static_cast<size_t>(t.numel()));
    DS_CHECK(bad < 0, "tensor '{}' holds a non-finite value (NaN or infinity) at element {}", stored, bad);
    return t;
  }

  // The scale of an fp8 or fp4 weight `base`.weight: `base`.scale (E8M0 or
  // float32) or `base`.weight_scale_inv, widened to float32 (fp8), or the
  // E8M0 bytes themselves (fp4, pointer into the file).
  std::string scale_name(const std::string& base) const {
    for (const char* suffix : {".scale", ".weight_scale_inv"}) {
      const std::string s = find(base + suffix);
      if (!s.empty()) return s;
    }
    DS_FAIL("checkpoint is missing the scale of '{}.weight' ('{}.scale' or '{}.weight_scale_inv')", base, base, base);
  }
  void float_scales(std::vector<float>& out, const std::string& stored, const Shape& shape) {
    const io::TensorInfo& i = info(stored);
    DS_CHECK(i.shape == shape, "scale '{}' has shape {}, expected {}", stored, shape_str(i.shape), shape_str(shape));
    const size_t n = static_cast<size_t>(shape_numel(shape));
    out.resize(n);
    if (i.dtype_name == "F8_E8M0") {
      const uint8_t* b = st_.bytes(stored);
      for (size_t k = 0; k < n; ++k) {
        DS_CHECK(b[k] != 0xFF, "scale '{}' holds the E8M0 NaN code at element {}", stored, k);
        out[k] = e8m0_to_f32(b[k]);
      }
      return;
    }
    Tensor t = float_tensor(stored, shape);
    convert(out.data(), DType::F32, t.raw(), t.dtype(), n);
    for (size_t k = 0; k < n; ++k)
      DS_CHECK(out[k] > 0, "scale '{}' holds a non-positive value {} at element {}", stored, out[k], k);
  }

  void load(const V4ParamInfo& p, V4Weight& w) {
    const std::string stored = require(p.name, p.shape);
    if (p.role == V4Role::HashTable) return load_table(p, stored, w);
    if (p.role == V4Role::Vector) {
      Tensor t = float_tensor(stored, p.shape);
      w.f32 = t.to_vector();
      w.view = {w.f32.data(), DType::F32, p.shape[0], p.shape.size() > 1 ? p.shape[1] : 1, nullptr, 128, 128};
      return;
    }
    const int64_t out = p.shape[0], in = p.shape[1];
    const std::string base = p.name.substr(0, p.name.size() - std::string(".weight").size());
    const io::TensorInfo& i = st_.info(stored);
    if (i.dtype_name == "I8" || i.dtype_name == "U8") {  // packed fp4
      DS_CHECK(p.routed_expert && cfg_.expert_dtype == "fp4",
               "tensor '{}' is packed fp4 ({}), but only routed experts of an expert_dtype fp4 model may be", stored,
               i.dtype_name);
      info(stored);
      DS_CHECK(i.shape == (Shape{out, in / 2}), "tensor '{}' has shape {}, packed fp4 of [{}, {}] is [{}, {}]", stored,
               shape_str(i.shape), out, in, out, in / 2);
      const std::string sn = scale_name(base);
      const io::TensorInfo& si = info(sn);
      DS_CHECK(si.dtype_name == "F8_E8M0" && si.shape == (Shape{out, in / 32}),
               "scale '{}' of the fp4 weight must be F8_E8M0 [{}, {}], got {} {}", sn, out, in / 32, si.dtype_name,
               shape_str(si.shape));
      w.view = {st_.bytes(stored), DType::F4E2M1, out, in, nullptr, 128, 128, st_.bytes(sn)};
      return;
    }
    Tensor t = float_tensor(stored, p.shape);
    w.view = {t.raw(), t.dtype(), out, in, nullptr, 128, 128};
    if (t.dtype() == DType::F8E4M3 || t.dtype() == DType::F8E5M2) {
      DS_CHECK(p.role == V4Role::Projection, "tensor '{}' is fp8; only projections may be", stored);
      const int64_t br = cfg_.fp8_block_rows, bc = cfg_.fp8_block_cols;
      float_scales(w.scale, scale_name(base), {(out + br - 1) / br, (in + bc - 1) / bc});
      w.view.scale_inv = w.scale.data();
      w.view.block_rows = br;
      w.view.block_cols = bc;
    } else {
      DS_CHECK(!(p.routed_expert && cfg_.expert_dtype == "fp4"),
               "tensor '{}' is {}, but config.json says the routed experts are packed fp4", stored,
               dtype_name(t.dtype()));
    }
  }

  void load_table(const V4ParamInfo& p, const std::string& stored, V4Weight& w) {
    const io::TensorInfo& i = info(stored);
    DS_CHECK(i.shape == p.shape, "tensor '{}' has shape {}, the config implies {}", stored, shape_str(i.shape),
             shape_str(p.shape));
    DS_CHECK(i.dtype_name == "I64" || i.dtype_name == "I32", "tensor '{}' must be I64 or I32, got {}", stored,
             i.dtype_name);
    const size_t n = static_cast<size_t>(shape_numel(p.shape));
    const uint8_t* b = st_.bytes(stored);
    w.ints.resize(n);
    for (size_t k = 0; k < n; ++k) {
      int64_t v;
      if (i.dtype_name == "I64") {
        std::memcpy(&v, b + 8 * k, 8);
      } else {
        int32_t v32;
        std::memcpy(&v32, b + 4 * k, 4);
        v = v32;
      }
      DS_CHECK(v >= 0 && v < cfg_.n_routed_experts, "tensor '{}' routes token {} to expert {}, outside [0, {})", stored,
               k / static_cast<size_t>(p.shape[1]), v, cfg_.n_routed_experts);
      w.ints[k] = static_cast<int32_t>(v);
    }
    w.view = {w.ints.data(), DType::I32, p.shape[0], p.shape[1], nullptr, 128, 128};
  }

  // Aliases the official converter accepts, and the MTP layers.
  void check_all_used() const {
    for (const auto& name : st_.names()) {
      if (used_.count(name)) continue;
      const std::string bare = name.rfind("model.", 0) == 0 ? name.substr(6) : name;
      if (bare.rfind("mtp.", 0) == 0 && cfg_.num_nextn_predict_layers > 0) continue;
      DS_FAIL("checkpoint tensor '{}' is not part of a deepseek_v4 model with this config (wrong config.json?)",
              name.size() > 200 ? name.substr(0, 200) + "..." : name);
    }
  }

  // Resolves gate.bias spelled e_score_correction_bias before the walk.
  void alias_bias(V4ParamInfo& p) const {
    const std::string suffix = "ffn.gate.bias";
    if (p.name.size() < suffix.size() || p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) != 0)
      return;
    if (!find(p.name).empty()) return;
    const std::string alt = p.name.substr(0, p.name.size() - 4) + "e_score_correction_bias";
    if (!find(alt).empty()) p.name = alt;
  }

  size_t bytes() const { return bytes_; }

 private:
  const io::SafetensorsSet& st_;
  const V4Config& cfg_;
  std::set<std::string> used_;
  size_t bytes_ = 0;
};

}  // namespace

V4Weights V4Weights::load(const io::SafetensorsSet& st, const V4Config& cfg) {
  cfg.validate();
  V4Loader ld(st, cfg);
  V4Weights w;
  w.tensors = make_v4_params<V4Weight>(cfg);
  for_each_v4_param(
      cfg,
      [&](const V4ParamInfo& info, V4Weight& t) {
        V4ParamInfo p = info;
        ld.alias_bias(p);
        ld.load(p, t);
      },
      w.tensors);
  ld.check_all_used();
  w.weight_bytes = ld.bytes();
  // wo_a's groups are row slices; fp8 slices must start on a scale block.
  for (auto& L : w.tensors.layers) {
    V4Weight& wa = L.attn.wo_a;
    const ops::WeightView v = wa.view;
    if ((v.dtype == DType::F8E4M3 || v.dtype == DType::F8E5M2) && cfg.o_lora_rank % v.block_rows != 0) {
      wa.f32.resize(static_cast<size_t>(v.rows * v.cols));
      ops::widen_rows(wa.f32.data(), v, 0, v.rows);
      wa.view = {wa.f32.data(), DType::F32, v.rows, v.cols, nullptr, 128, 128};
    }
  }
  w.view = make_v4_params<ops::WeightView>(cfg);
  for_each_v4_param(
      cfg, [](const V4ParamInfo&, const V4Weight& t, ops::WeightView& v) { v = t.view; }, w.tensors, w.view);
  return w;
}

}  // namespace ds::model
