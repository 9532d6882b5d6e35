#include "model/v4_weights.h"

#include <cstring>
#include <map>
#include <set>

#include "core/dtype.h"
#include "core/error.h"
#include "core/system.h"
#include "model/weights.h"

namespace ds::model {

namespace {

class V4Loader {
 public:
  V4Loader(const io::SafetensorsSet& st, const V4Config& cfg) : st_(st), cfg_(cfg) {}

  // The stored name of `name`: itself, with the "model." prefix, or
  // Hugging Face's.
  std::string find(const std::string& name) const {
    if (st_.contains(name)) return name;
    if (st_.contains("model." + name)) return "model." + name;
    const std::string hf = v4_hf_name(name);
    if (!hf.empty() && st_.contains(hf)) return hf;
    return "";
  }
  std::string require(const std::string& name, const Shape& shape) const {
    const std::string s = find(name);
    DS_CHECK(!s.empty(), "checkpoint is missing tensor '{}' (expected shape {})", name, shape_str(shape));
    return s;
  }
  const io::TensorInfo& info(const std::string& stored) {
    const io::TensorInfo& i = st_.info(stored);
    if (used_.insert(stored).second) bytes_ += i.end - i.begin;
    return i;
  }
  // A float tensor of exactly `shape`, checked for NaN and infinity.
  Tensor float_tensor(const std::string& stored, const Shape& shape) {
    info(stored);
    return checked_float_tensor(st_, stored, shape);
  }

  // The scale of an fp8 or fp4 weight stored as `base`.weight: `base`.scale
  // (E8M0 or float32) or `base`.weight_scale_inv, widened to float32 (fp8),
  // or the E8M0 bytes themselves (fp4, pointer into the file).
  std::string scale_name(const std::string& stored) const {
    const std::string base = stored.substr(0, stored.size() - std::string(".weight").size());
    for (const char* suffix : {".scale", ".weight_scale_inv"})
      if (st_.contains(base + suffix)) return base + suffix;
    DS_FAIL("checkpoint is missing the scale of '{}' ('{}.scale' or '{}.weight_scale_inv')", stored, base, base);
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
    if (p.routed_expert && find(p.name).empty() && load_fused_expert(p, w)) return;
    const std::string stored = require(p.name, p.shape);
    if (p.role == V4Role::HashTable) return load_table(p, stored, w);
    if (p.role == V4Role::EngramTable) return load_engram_table(p, stored, w);
    if (p.role == V4Role::Vector) {
      Tensor t = float_tensor(stored, p.shape);
      w.f32 = t.to_vector();
      w.view = {w.f32.data(), DType::F32, p.shape[0], p.shape.size() > 1 ? p.shape[1] : 1, nullptr, 128, 128};
      return;
    }
    const int64_t out = p.shape[0], in = p.shape[1];
    const io::TensorInfo& i = st_.info(stored);
    if (cfg_.block_quantized && i.dtype_name == "U8") {  // a `deepseek quantize` folder's blocks
      DS_CHECK(p.role == V4Role::Projection || p.role == V4Role::Embedding || p.role == V4Role::LmHead,
               "tensor '{}' is stored as blocks; only projections, the embedding and the head may be", stored);
      info(stored);
      w.view = block_matrix_view(st_, stored, out, in);
      return;
    }
    if (i.dtype_name == "I8" || i.dtype_name == "U8") {  // packed fp4
      DS_CHECK(p.routed_expert && cfg_.expert_dtype == "fp4",
               "tensor '{}' is packed fp4 ({}), but only routed experts of an expert_dtype fp4 model may be", stored,
               i.dtype_name);
      info(stored);
      DS_CHECK(i.shape == (Shape{out, in / 2}), "tensor '{}' has shape {}, packed fp4 of [{}, {}] is [{}, {}]", stored,
               shape_str(i.shape), out, in, out, in / 2);
      const std::string sn = scale_name(stored);
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
      float_scales(w.scale, scale_name(stored), {(out + br - 1) / br, (in + bc - 1) / bc});
      w.view.scale_inv = w.scale.data();
      w.view.block_rows = br;
      w.view.block_cols = bc;
    } else {
      DS_CHECK(!(p.routed_expert && cfg_.expert_dtype == "fp4"),
               "tensor '{}' is {}, but config.json says the routed experts are packed fp4", stored,
               dtype_name(t.dtype()));
    }
  }

  // Hugging Face's fused experts: layers.L.mlp.experts.gate_up_proj [E, 2I,
  // d] (gate rows, then up rows, per expert) and down_proj [E, d, I], float
  // dtypes only. False when the checkpoint has no such tensor.
  bool load_fused_expert(const V4ParamInfo& p, V4Weight& w) {
    const std::string pre = "layers." + std::to_string(p.layer) + ".ffn.experts.";
    if (p.name.rfind(pre, 0) != 0) return false;
    const size_t dot = p.name.find('.', pre.size());
    const int64_t e = std::stoll(p.name.substr(pre.size(), dot - pre.size()));
    const std::string which = p.name.substr(dot + 1);  // w1.weight, w3.weight, w2.weight
    const bool down = which == "w2.weight";
    const std::string stored =
        "model.layers." + std::to_string(p.layer) + ".mlp.experts." + (down ? "down_proj" : "gate_up_proj");
    if (!st_.contains(stored)) return false;
    const int64_t E = cfg_.n_routed_experts, I = cfg_.moe_intermediate_size, d = cfg_.hidden_size;
    const Shape shape = down ? Shape{E, d, I} : Shape{E, 2 * I, d};
    auto it = fused_.find(stored);
    if (it == fused_.end()) it = fused_.emplace(stored, float_tensor(stored, shape)).first;  // checked once
    const Tensor& t = it->second;
    DS_CHECK(t.dtype() != DType::F8E4M3 && t.dtype() != DType::F8E5M2,
             "tensor '{}': fused fp8 experts are not supported (use the upstream per-expert layout)", stored);
    const int64_t rows = down ? d : I, cols = down ? I : d;
    const int64_t first = down ? e * d : e * 2 * I + (which == "w3.weight" ? I : 0);
    const auto* base =
        static_cast<const uint8_t*>(t.raw()) + first * cols * static_cast<int64_t>(dtype_size(t.dtype()));
    w.view = {base, t.dtype(), rows, cols, nullptr, 128, 128};
    return true;
  }

  // V4.1's Engram table stays where the file is mapped: e4m3 codes with
  // their e8m0 scale bytes (one per 32 columns of a row), or a float dtype.
  // It is never scanned (only the rows a token looks up are read; a bad row
  // shows as non-finite logits, which generation refuses) and the kernel is
  // told the reads are random.
  void load_engram_table(const V4ParamInfo& p, const std::string& stored, V4Weight& w) {
    const io::TensorInfo& i = info(stored);
    const int64_t rows = p.shape[0], cols = p.shape[1];
    DS_CHECK(i.shape == p.shape, "tensor '{}' has shape {}, the config implies {}", stored, shape_str(i.shape),
             shape_str(p.shape));
    Tensor t = st_.tensor(stored);
    DS_CHECK(dtype_is_float(t.dtype()), "tensor '{}' has non-float dtype {}", stored, dtype_name(t.dtype()));
    advise_random_reads(t.raw(), t.nbytes());
    w.view = {t.raw(), t.dtype(), rows, cols, nullptr, 128, 128};
    if (t.dtype() == DType::F8E5M2) DS_FAIL("tensor '{}': an Engram table is e4m3 (got e5m2)", stored);
    if (t.dtype() != DType::F8E4M3) return;
    const std::string sn = scale_name(stored);
    const io::TensorInfo& si = info(sn);
    const int64_t groups = (cols + 31) / 32;
    DS_CHECK(si.dtype_name == "F8_E8M0" && si.shape == (Shape{rows, groups}),
             "scale '{}' of the Engram table must be F8_E8M0 [{}, {}], got {} {}", sn, rows, groups, si.dtype_name,
             shape_str(si.shape));
    advise_random_reads(st_.bytes(sn), static_cast<size_t>(rows * groups));
    w.view.scale_e8m0 = st_.bytes(sn);
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

  // Aliases the official converter accepts; the MTP layers' copies of the
  // embedding and head (DeepSeek's converter skips them too), and the MTP
  // layers themselves when the config does not load them.
  void check_all_used() const {
    for (const auto& name : st_.names()) {
      if (used_.count(name)) continue;
      const std::string bare = name.rfind("model.", 0) == 0 ? name.substr(6) : name;
      // V4.1's DSpark draft stages and vision tower are not part of the text model.
      if (cfg_.v41() &&
          (bare.rfind("mtp.", 0) == 0 || bare.rfind("vision.", 0) == 0 || bare.rfind("aligner.", 0) == 0 ||
           bare.rfind("image_start", 0) == 0 || bare.rfind("image_end", 0) == 0 || bare.rfind("image_newline", 0) == 0))
        continue;
      if (bare.rfind("mtp.", 0) == 0 && (bare.find("emb") != std::string::npos || bare.ends_with("head.weight") ||
                                         cfg_.num_nextn_predict_layers == 0))
        continue;
      DS_FAIL("checkpoint tensor '{}' is not part of a {} model with this config (wrong config.json?)",
              name.size() > 200 ? name.substr(0, 200) + "..." : name, cfg_.v41() ? "deepseek_v41" : "deepseek_v4");
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
  std::map<std::string, Tensor> fused_;  // Hugging Face's fused expert tensors, by name
  size_t bytes_ = 0;
};

}  // namespace

std::string v4_hf_name(const std::string& name) {
  static const std::vector<std::pair<std::string, std::string>> global = {
      {"embed.weight", "model.embed_tokens.weight"}, {"head.weight", "lm_head.weight"},
      {"norm.weight", "model.norm.weight"},          {"hc_head_fn", "model.hc_head.hc_fn"},
      {"hc_head_base", "model.hc_head.hc_base"},     {"hc_head_scale", "model.hc_head.hc_scale"}};
  for (const auto& [up, hf] : global)
    if (name == up) return hf;
  if (name.rfind("layers.", 0) != 0) return "";
  const size_t dot = name.find('.', 7);
  if (dot == std::string::npos) return "";
  const std::string layer = name.substr(0, dot + 1), rest = name.substr(dot + 1);
  // Longest upstream prefix first; a trailing '.' marks a prefix, else the
  // whole rest must match.
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"hc_attn_fn", "attn_hc.fn"},
      {"hc_attn_base", "attn_hc.base"},
      {"hc_attn_scale", "attn_hc.scale"},
      {"hc_ffn_fn", "ffn_hc.fn"},
      {"hc_ffn_base", "ffn_hc.base"},
      {"hc_ffn_scale", "ffn_hc.scale"},
      {"attn.attn_sink", "self_attn.sinks"},
      {"attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"},
      {"attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"},
      {"attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"},
      {"attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"},
      {"attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."},
      {"attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.weights_proj.weight"},
      {"attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"},
      {"attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"},
      {"attn.compressor.ape", "self_attn.compressor.position_bias"},
      {"attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"},
      {"attn.wq_a.", "self_attn.q_a_proj."},
      {"attn.wq_b.", "self_attn.q_b_proj."},
      {"attn.wkv.", "self_attn.kv_proj."},
      {"attn.wo_a.", "self_attn.o_a_proj."},
      {"attn.wo_b.", "self_attn.o_b_proj."},
      {"attn.q_norm.weight", "self_attn.q_a_norm.weight"},
      {"attn.kv_norm.weight", "self_attn.kv_norm.weight"},
      {"ffn.gate.weight", "mlp.gate.weight"},
      {"ffn.gate.bias", "mlp.gate.e_score_correction_bias"},
      {"ffn.gate.tid2eid", "mlp.gate.tid2eid"},
      {"ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."},
      {"ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."},
      {"ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."},
  };
  for (const auto& [up, hf] : table) {
    if (up.back() == '.' ? rest.rfind(up, 0) == 0 : rest == up) return "model." + layer + hf + rest.substr(up.size());
  }
  return "";
}

int64_t v4_stored_mtp_layers(const io::SafetensorsSet& st, const V4Config& cfg) {
  int64_t k = 0;
  while (k < cfg.num_nextn_predict_layers && (st.contains("mtp." + std::to_string(k) + ".e_proj.weight") ||
                                              st.contains("model.mtp." + std::to_string(k) + ".e_proj.weight")))
    ++k;
  return k;
}

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
