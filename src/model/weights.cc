#include "model/weights.h"

#include <algorithm>
#include <regex>
#include <set>

#include "core/error.h"
#include "core/system.h"
#include "ops/block_quant.h"

namespace ds::model {

const float* vector_data(const ops::WeightView& v) {
  if (!v.data) return nullptr;
  DS_CHECK(v.dtype == DType::F32, "internal: a vector parameter must be a float32 view");
  return static_cast<const float*>(v.data);
}

Tensor checked_float_tensor(const io::SafetensorsSet& st, const std::string& name, const Shape& shape) {
  Tensor t = st.tensor(name);
  DS_CHECK(t.shape() == shape, "tensor '{}' has shape {}, the config implies {}", name, shape_str(t.shape()),
           shape_str(shape));
  DS_CHECK(dtype_is_float(t.dtype()), "tensor '{}' has non-float dtype {}", name, dtype_name(t.dtype()));
  // A NaN or infinity in a weight or scale would turn every output into
  // garbage that still looks like a result: refuse it at load.
  const int64_t bad = find_non_finite(t.raw(), t.dtype(), static_cast<size_t>(t.numel()));
  DS_CHECK(bad < 0, "tensor '{}' holds a non-finite value (NaN or infinity) at element {}", name, bad);
  return t;
}

ops::WeightView block_matrix_view(const io::SafetensorsSet& st, const std::string& name, int64_t out, int64_t in) {
  const io::TensorInfo& i = st.info(name);
  DS_CHECK(i.dtype_name == "U8", "internal: tensor '{}' is {}, not U8 blocks", name, i.dtype_name);
  DType t = DType::F32;
  std::string sizes;
  for (DType f : ops::kBlockFormats) {
    if (!ops::fits_block_format(f, in)) continue;
    const int64_t row = ops::block_row_bytes(f, in);
    if (i.shape == Shape{out, row}) t = f;
    sizes += fmt::format("{}{} bytes for {}", sizes.empty() ? "" : ", ", row, dtype_name(f));
  }
  DS_CHECK(t != DType::F32, "tensor '{}' has U8 shape {}: not rows of blocks of a [{}, {}] matrix ({})", name,
           shape_str(i.shape), out, in, sizes.empty() ? "its rows are not whole blocks of 32" : sizes);
  return {st.bytes(name), t, out, in, nullptr, 128, 128};
}

namespace {

class Loader {
 public:
  Loader(const io::SafetensorsSet& st, const ModelConfig& cfg, int64_t mtp_layers)
      : st_(st), cfg_(cfg), mtp_layers_(mtp_layers) {}

  // `scan`: every value is checked to be finite (an Engram table is not: it
  // stays on disk, mmapped, and only the rows a token looks up are read; a
  // bad row shows as non-finite logits, which generation refuses).
  Tensor get(const std::string& name, const Shape& shape, bool scan = true) {
    DS_CHECK(st_.contains(name), "checkpoint is missing tensor '{}' (expected shape {})", name, shape_str(shape));
    Tensor t = scan ? checked_float_tensor(st_, name, shape) : st_.tensor(name);
    if (!scan) {
      DS_CHECK(t.shape() == shape, "tensor '{}' has shape {}, the config implies {}", name, shape_str(t.shape()),
               shape_str(shape));
      DS_CHECK(dtype_is_float(t.dtype()), "tensor '{}' has non-float dtype {}", name, dtype_name(t.dtype()));
    }
    used_.insert(name);
    bytes_ += t.nbytes();
    return t;
  }

  // A matrix stored as U8 rows of q8_0, q4_k or q4_1 blocks (a `deepseek
  // quantize` folder): its format from its bytes a row.
  bool load_blocks(const ParamInfo& info, Weight& w) {
    if (!cfg_.block_quantized || info.shape.size() != 2 || !st_.contains(info.name)) return false;
    const io::TensorInfo& i = st_.info(info.name);
    if (i.dtype_name != "U8") return false;
    DS_CHECK(info.role == ParamRole::Projection || info.role == ParamRole::Embedding || info.role == ParamRole::LmHead,
             "tensor '{}' is stored as blocks; only projections, the embedding and the LM head may be", info.name);
    w.view = block_matrix_view(st_, info.name, info.shape[0], info.shape[1]);
    used_.insert(info.name);
    bytes_ += i.end - i.begin;
    return true;
  }

  void load(const ParamInfo& info, Weight& w) {
    if (load_blocks(info, w)) return;
    w.tensor = get(info.name, info.shape, info.role != ParamRole::EngramTable);
    if (info.role == ParamRole::EngramTable) advise_random_reads(w.tensor.raw(), w.tensor.nbytes());
    const DType dt = w.tensor.dtype();
    if (info.shape.size() == 1) {  // norms and the routing bias: float32 copies
      w.widened = w.tensor.to_vector();
      w.view = f32_view(w.widened.data(), info.shape[0]);
      return;
    }
    const int64_t out = info.shape[0], in = info.shape[1];
    w.view = {w.tensor.raw(), dt, out, in, nullptr, 128, 128};
    if (dt == DType::F8E4M3 || dt == DType::F8E5M2) {
      DS_CHECK(info.role == ParamRole::Projection, "tensor '{}' is fp8; only projections may be", info.name);
      const int64_t br = cfg_.fp8_block_rows > 0 ? cfg_.fp8_block_rows : 128;
      const int64_t bc = cfg_.fp8_block_cols > 0 ? cfg_.fp8_block_cols : 128;
      const std::string base = info.name.substr(0, info.name.size() - std::string(".weight").size());
      w.scale_inv = get(base + ".weight_scale_inv", {(out + br - 1) / br, (in + bc - 1) / bc});
      DS_CHECK(w.scale_inv.dtype() == DType::F32, "tensor '{}.weight_scale_inv' must be F32, got {}", base,
               dtype_name(w.scale_inv.dtype()));
      w.view.scale_inv = w.scale_inv.data<float>();
      w.view.block_rows = br;
      w.view.block_cols = bc;
    }
  }

  // Every tensor in the checkpoint must be used, or belong to a multi-token
  // prediction layer (index in [num_hidden_layers, num_hidden_layers +
  // num_nextn_predict_layers): not used for generation), or be a known extra.
  void check_all_used() const {
    const std::regex layer_re(R"(model\.layers\.(\d+)\..*)");
    const int64_t L = cfg_.num_hidden_layers, mtp = std::max(cfg_.num_nextn_predict_layers, mtp_layers_);
    for (const auto& name : st_.names()) {
      if (used_.count(name)) continue;
      std::smatch m;
      if (std::regex_match(name, m, layer_re)) {
        // At most 9 digits: any layer index the config allows fits; more is
        // an error below, never an overflow.
        const std::string digits = m[1];
        const int64_t layer = digits.size() <= 9 ? std::stoll(digits) : -1;
        DS_CHECK(
            layer >= 0 &&
                    layer<L + mtp,
                          "checkpoint tensor '{}' belongs to layer {}, but config.json has num_hidden_layers {} and "
                          "num_nextn_predict_layers {} (layers 0 to {}); wrong config.json?",
                          name.size()> 200
                ? name.substr(0, 200) + "..."
                : name,
            digits.size() <= 20 ? digits : digits.substr(0, 20) + "...", L, mtp, L + mtp - 1);
        if (layer >= L) continue;  // a multi-token prediction layer
      }
      if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // older exports carry it
      DS_FAIL("checkpoint tensor '{}' is not part of a {} model with this config (wrong config.json?)", name,
              cfg_.model_type);
    }
  }

  size_t bytes() const { return bytes_; }

 private:
  const io::SafetensorsSet& st_;
  const ModelConfig& cfg_;
  int64_t mtp_layers_;
  std::set<std::string> used_;
  size_t bytes_ = 0;
};

}  // namespace

ModelWeights ModelWeights::load(const io::SafetensorsSet& st, const ModelConfig& cfg, int64_t mtp_layers) {
  cfg.validate();
  DS_CHECK(mtp_layers >= 0, "load: mtp_layers {} must be >= 0", mtp_layers);
  Loader ld(st, cfg, mtp_layers);
  ModelWeights w;
  w.tensors = make_params<Weight>(cfg, mtp_layers);
  for_each_param(
      cfg, mtp_layers, [&](const ParamInfo& info, Weight& t) { ld.load(info, t); }, w.tensors);
  ld.check_all_used();
  w.weight_bytes = ld.bytes();
  w.view = map_params<ops::WeightView>(cfg, w.tensors, [](const ParamInfo&, const Weight& t) { return t.view; });
  return w;
}

}  // namespace ds::model
