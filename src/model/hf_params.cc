#include "model/hf_params.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/engram_v41.h"
#include "model/init.h"
#include "model/v4_weights.h"
#include "model/weights.h"
#include "ops/linear.h"

namespace ds::model {

namespace fs = std::filesystem;

void load_hf_params(const std::string& dir, const ModelConfig& cfg, int64_t mtp, FlatParams& params) {
  // The generation loader finds and checks every tensor (names, shapes, fp8
  // block scales, non-finite values); each is then widened to float32.
  const auto st = io::SafetensorsSet::open_dir(dir);
  const auto w = ModelWeights::load(st, cfg, mtp);
  for_each_param(
      cfg, mtp, [](const ParamInfo&, const ops::WeightView& v, float*& x) { ops::widen_rows(x, v, 0, v.rows); }, w.view,
      params.ptr);
}

void export_hf(const std::string& out_dir, const ModelConfig& cfg, int64_t mtp, const FlatParams& params, DType dtype) {
  DS_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
           "export: weights can be written as f32, bf16 or f16, not {}", dtype_name(dtype));
  prepare_model_folder(out_dir, "export");
  std::vector<std::pair<std::string, Tensor>> ts;
  auto put = [&](const std::string& name, const Tensor& f32, bool vector) {
    ts.emplace_back(name, vector || dtype == DType::F32 ? f32.to(DType::F32) : f32.to(dtype));
  };
  for_each_param(
      cfg, mtp,
      [&](const ParamInfo& i, float* const& x) {
        // mHC's fn stays float32 too: it is small, and the Sinkhorn's logits are its products.
        put(i.name, Tensor::borrow(x, i.shape, DType::F32), i.shape.size() == 1 || i.role == ParamRole::MhcMatrix);
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
  auto j = to_hf_json(cfg, mtp);
  j["torch_dtype"] = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  io::write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
}

void init_params(const ModelConfig& cfg, int64_t mtp, FlatParams& params, uint64_t seed, float std) {
  uint64_t stream = 0;  // one Philox stream per matrix, as write_random_checkpoint
  for_each_param(
      cfg, mtp,
      [&](const ParamInfo& i, float*& x) {
        switch (i.role) {
          case ParamRole::Norm:
            std::fill(x, x + i.numel(), 1.0f);
            break;
          case ParamRole::RoutingBias:
          case ParamRole::NormBias:
          case ParamRole::MhcBias:
          case ParamRole::Bias:
          case ParamRole::EngramConv:  // MaxText's: Engram's output is its gated value at first
            std::fill(x, x + i.numel(), 0.0f);
            break;
          case ParamRole::EngramTable:  // MaxText's embedding init, N(0, 1 / D_head), whatever `std` is
            fill_normal(x, i.numel(), engram_table_std(i), seed, stream++);
            break;
          case ParamRole::MhcScale:
            std::fill(x, x + i.numel(), kMhcScaleInit);
            break;
          case ParamRole::MhcMatrix:  // MaxText's fan-in normal, N(0, 1 / (k d)), whatever `std` is
            fill_normal(x, i.numel(), mhc_fn_std(i), seed, stream++);
            break;
          default:
            fill_normal(x, i.numel(), std, seed, stream++);
        }
      },
      params.ptr);
}

void init_v4_params(const V4Config& c, V4FlatParams& p, uint64_t seed, float std) {
  uint64_t stream = 0;  // one Philox stream per matrix, in tree order
  for_each_v4_param(
      c,
      [&](const V4ParamInfo& i, float* const& x) {
        const int64_t n = shape_numel(i.shape);
        if (i.role == V4Role::HashTable) {
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
        } else if (i.name.ends_with("engram.q_weight") || i.name.ends_with("engram.k_weight")) {
          // V4.1's folded gate weights: the plain normalised dot at first.
          std::fill(x, x + n, 1.0f);
        } else if (i.role == V4Role::EngramTable) {  // N(0, 1 / head dim), as MaxText starts its Engram tables
          fill_normal(x, n, 1.0f / std::sqrt(static_cast<float>(i.shape[1])), seed, stream++);
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

void load_v4_hf_params(const std::string& dir, const V4Config& c, V4FlatParams& p) {
  // The generation loader finds and checks every tensor; each is then widened.
  const auto st = io::SafetensorsSet::open_dir(dir);
  const auto w = V4Weights::load(st, c);
  for_each_v4_param(
      c,
      [](const V4ParamInfo& i, const ops::WeightView& v, float* const& x) {
        if (i.role == V4Role::EngramTable) {  // V4.1's: fp8 rows with e8m0 scales, or floats
          std::vector<int32_t> ids;
          for (int64_t r0 = 0; r0 < v.rows; r0 += 4096) {
            const int64_t r1 = std::min(v.rows, r0 + 4096);
            ids.resize(static_cast<size_t>(r1 - r0));
            std::iota(ids.begin(), ids.end(), static_cast<int32_t>(r0));
            v41_engram_gather(x + r0 * v.cols, ids.data(), r1 - r0, 1, v);
          }
        } else if (i.role == V4Role::HashTable) {
          const auto* t = static_cast<const int32_t*>(v.data);
          for (int64_t k = 0; k < shape_numel(i.shape); ++k) x[k] = static_cast<float>(t[k]);
        } else {
          ops::widen_rows(x, v, 0, v.rows);
        }
      },
      w.view, p.ptr);
  p.sync_tables(c);
}

void export_v4_hf(const std::string& out_dir, const V4Config& c, const float* params, DType dtype, const char* who) {
  DS_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
           "{}: DeepSeek-V4 weights can be written as f32, bf16 or f16, not {}", who, dtype_name(dtype));
  prepare_model_folder(out_dir, who);
  std::vector<std::pair<std::string, Tensor>> ts;
  int64_t off = 0;
  for_each_v4_param(c, [&](const V4ParamInfo& i) {
    const Tensor f32 = Tensor::borrow(const_cast<float*>(params) + off, i.shape, DType::F32);
    off += shape_numel(i.shape);
    if (i.role == V4Role::HashTable) {
      Tensor t = Tensor::empty(i.shape, DType::I32);
      for (int64_t k = 0; k < t.numel(); ++k) t.data<int32_t>()[k] = static_cast<int32_t>(f32.data<float>()[k]);
      ts.emplace_back(i.name, std::move(t));
    } else {
      ts.emplace_back(i.name, i.role == V4Role::Vector || dtype == DType::F32 ? f32.to(DType::F32) : f32.to(dtype));
    }
  });
  io::save_safetensors((fs::path(out_dir) / "model.safetensors").string(), ts, {{"format", "pt"}});
  // Float weights: no quantization_config, and the routed experts are not packed fp4.
  auto j = c.to_hf_json();
  j.erase("expert_dtype");
  if (j.contains("text_config")) j["text_config"].erase("expert_dtype");  // V4.1 nests the text model
  j["torch_dtype"] = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  io::write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
}

}  // namespace ds::model
