#include "model/init.h"

#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "core/rng.h"
#include "core/system.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/params.h"
#include "ops/linear.h"

namespace ds::model {

nlohmann::json to_hf_json(const ModelConfig& c, int64_t mtp_layers) {
  nlohmann::json j;
  const bool v2 = c.model_type == "deepseek_v2";
  j["architectures"] = {v2                               ? "DeepseekV2ForCausalLM"
                        : c.model_type == "deepseek_v32" ? "DeepseekV32ForCausalLM"
                                                         : "DeepseekV3ForCausalLM"};
  j["model_type"] = c.model_type;
  j["hidden_act"] = "silu";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_attention_heads;
  j["q_lora_rank"] = c.q_lora_rank > 0 ? nlohmann::json(c.q_lora_rank) : nlohmann::json(nullptr);
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  j["rope_theta"] = c.rope_theta;
  j["max_position_embeddings"] = c.max_position_embeddings;
  if (c.rope_scaling.enabled) {
    const auto& r = c.rope_scaling;
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", r.factor},
                         {"original_max_position_embeddings", r.original_max_position_embeddings},
                         {"beta_fast", r.beta_fast},
                         {"beta_slow", r.beta_slow},
                         {"mscale", r.mscale},
                         {"mscale_all_dim", r.mscale_all_dim}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["n_routed_experts"] = c.n_routed_experts;
  j["n_shared_experts"] = c.n_shared_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["n_group"] = c.n_group;
  j["topk_group"] = c.topk_group;
  j["topk_method"] = c.topk_method == TopkMethod::NoauxTc              ? "noaux_tc"
                     : c.topk_method == TopkMethod::GroupLimitedGreedy ? "group_limited_greedy"
                                                                       : "greedy";
  j["scoring_func"] = c.scoring_func == ScoringFunc::Sigmoid ? "sigmoid" : "softmax";
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["first_k_dense_replace"] = c.first_k_dense_replace;
  j["moe_layer_freq"] = c.moe_layer_freq;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["num_nextn_predict_layers"] = mtp_layers;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  if (c.model_type == "deepseek_v32") {
    j["index_n_heads"] = c.index_n_heads;
    j["index_head_dim"] = c.index_head_dim;
    j["index_topk"] = c.index_topk;
    if (c.index_scale_ue8m0) j["scale_fmt"] = "ue8m0";
  }
  if (c.has_mhc()) {
    j["mhc_expansion_rate"] = c.mhc_expansion_rate;
    j["mhc_sinkhorn_iterations"] = c.mhc_sinkhorn_iterations;
  }
  if (c.has_engram()) {
    j["engram_layers"] = c.engram_layers;
    j["engram_max_ngram_size"] = c.engram_max_ngram_size;
    j["engram_num_heads"] = c.engram_num_heads;
    j["engram_head_dim"] = c.engram_head_dim;
    j["engram_vocab_bases"] = c.engram_vocab_bases;
    j["engram_kernel_size"] = c.engram_kernel_size;
    j["engram_seed"] = c.engram_seed;
    j["engram_pad_id"] = c.engram_pad_id;
    j["engram_compress_tokens"] = c.engram_compress_tokens;
  }
  if (c.fp8_block_rows > 0)
    j["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"weight_block_size", {c.fp8_block_rows, c.fp8_block_cols}}};
  j["torch_dtype"] = "bfloat16";
  return j;
}

float engram_table_std(const ParamInfo& t) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(t.shape[1])));
}

float mhc_fn_std(const ParamInfo& fn) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(fn.shape[1]))); }

void prepare_model_folder(const std::string& dir, const char* who) {
  namespace fs = std::filesystem;
  io::check_output_folder(dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  DS_CHECK(!ec && fs::is_directory(dir), "{}: cannot create the folder '{}': {}", who, dir, ec.message());
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    DS_CHECK(
        name == "model.safetensors" || !(name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")),
        "{}: '{}' already holds another checkpoint ('{}'); choose an empty folder", who, dir, name);
  }
}

void write_random_checkpoint(const ModelConfig& cfg, const std::string& dir, const InitOptions& opt) {
  cfg.validate();
  const bool fp8 = opt.dtype == DType::F8E4M3;
  DS_CHECK(opt.dtype == DType::BF16 || opt.dtype == DType::F32 || opt.dtype == DType::F16 || fp8,
           "init: weights can be written as bf16, f16, f32 or fp8 (e4m3), not {}", dtype_name(opt.dtype));
  ModelConfig c = cfg;  // its quantization_config describes what is written here
  c.fp8_block_rows = c.fp8_block_cols = fp8 ? 128 : 0;
  DS_CHECK(opt.init_std > 0.0f, "init: init_std must be positive, got {}", opt.init_std);
  // The tensors are built in memory before they are written.
  int64_t bytes = 0;
  DS_CHECK(!__builtin_mul_overflow(c.parameter_count(), static_cast<int64_t>(dtype_size(opt.dtype)), &bytes),
           "init: the model's size overflows");
  check_fits_in_memory(bytes, "init: building this model");
  prepare_model_folder(dir, "init");
  namespace fs = std::filesystem;

  std::vector<std::pair<std::string, Tensor>> ts;
  uint64_t stream = 0;  // one Philox stream per tensor: the same seed gives the same weights
  // fp8 as DeepSeek-V3 ships it: projections and MLP matrices in e4m3 with
  // a float32 weight_scale_inv per 128 x 128 block; the embedding, the
  // router, the LM head and the norms in bf16.
  const DType plain = fp8 ? DType::BF16 : opt.dtype;
  auto matrix = [&](const std::string& name, Shape shape, bool quantize = true) {
    Tensor t = Tensor::empty(shape, DType::F32);
    fill_normal(t.data<float>(), t.numel(), opt.init_std, opt.seed, stream++);
    if (fp8 && quantize) {
      const int64_t rows = shape[0], cols = shape[1], b = c.fp8_block_rows;
      Tensor q = Tensor::empty(shape, DType::F8E4M3);
      Tensor scale = Tensor::empty({(rows + b - 1) / b, (cols + b - 1) / b}, DType::F32);
      ops::quantize_fp8_blocks(static_cast<uint8_t*>(q.raw()), scale.data<float>(), t.data<float>(), rows, cols, b, b);
      ts.emplace_back(name, q);
      ts.emplace_back(name + "_scale_inv", scale);
      return;
    }
    ts.emplace_back(name, plain == DType::F32 ? t : t.to(plain));
  };
  auto ones = [&](const std::string& name, int64_t n) {
    Tensor t = Tensor::empty({n}, DType::F32);
    for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = 1.0f;
    ts.emplace_back(name, plain == DType::F32 ? t : t.to(plain));
  };
  // Every tensor of the parameter tree, in its order (one stream each),
  // with the MTP layers the config names.
  for_each_param(c, c.num_nextn_predict_layers, [&](const ParamInfo& info) {
    switch (info.role) {
      case ParamRole::Norm:
        ones(info.name, info.shape[0]);
        break;
      case ParamRole::RoutingBias:
        ts.emplace_back(info.name, Tensor::zeros(info.shape, DType::F32));
        break;
      case ParamRole::Bias:
      case ParamRole::EngramConv: {
        Tensor z = Tensor::zeros(info.shape, DType::F32);
        ts.emplace_back(info.name, plain == DType::F32 ? z : z.to(plain));
        break;
      }
      case ParamRole::EngramTable: {
        Tensor t = Tensor::empty(info.shape, DType::F32);
        fill_normal(t.data<float>(), t.numel(), engram_table_std(info), opt.seed, stream++);
        ts.emplace_back(info.name, plain == DType::F32 ? t : t.to(plain));
        break;
      }
      case ParamRole::NormBias: {
        Tensor z = Tensor::zeros(info.shape, DType::F32);
        ts.emplace_back(info.name, plain == DType::F32 ? z : z.to(plain));
        break;
      }
      // mHC: float32 whatever the matrices' dtype (small; the Sinkhorn's logits).
      case ParamRole::MhcBias:
        ts.emplace_back(info.name, Tensor::zeros(info.shape, DType::F32));
        break;
      case ParamRole::MhcScale: {
        Tensor t = Tensor::empty(info.shape, DType::F32);
        std::fill(t.data<float>(), t.data<float>() + t.numel(), kMhcScaleInit);
        ts.emplace_back(info.name, t);
        break;
      }
      case ParamRole::MhcMatrix: {
        Tensor t = Tensor::empty(info.shape, DType::F32);
        fill_normal(t.data<float>(), t.numel(), mhc_fn_std(info), opt.seed, stream++);
        ts.emplace_back(info.name, t);
        break;
      }
      default:
        matrix(info.name, info.shape, info.role == ParamRole::Projection);
    }
  });
  // Weights first: a folder whose config.json is new always has its weights.
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), ts, {{"format", "pt"}});
  io::write_file_atomic((fs::path(dir) / "config.json").string(),
                        to_hf_json(c, c.num_nextn_predict_layers).dump(2) + "\n");
}

}  // namespace ds::model
