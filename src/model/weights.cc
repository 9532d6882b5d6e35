#include "model/weights.h"

#include <regex>
#include <set>

#include "core/error.h"

namespace ds::model {

namespace {

class Loader {
 public:
  Loader(const io::SafetensorsSet& st, const ModelConfig& cfg) : st_(st), cfg_(cfg) {}

  Tensor get(const std::string& name, const Shape& shape) {
    DS_CHECK(st_.contains(name), "checkpoint is missing tensor '{}' (expected shape {})", name, shape_str(shape));
    Tensor t = st_.tensor(name);
    DS_CHECK(t.shape() == shape, "tensor '{}' has shape {}, the config implies {}", name, shape_str(t.shape()),
             shape_str(shape));
    // A NaN or infinity in a weight or scale would turn every output into
    // garbage that still looks like a result: refuse it at load.
    const int64_t bad = find_non_finite(t.raw(), t.dtype(), static_cast<size_t>(t.numel()));
    DS_CHECK(bad < 0, "tensor '{}' holds a non-finite value (NaN or infinity) at element {}", name, bad);
    used_.insert(name);
    bytes_ += t.nbytes();
    return t;
  }

  std::vector<float> vec(const std::string& name, int64_t n) {
    Tensor t = get(name, {n});
    DS_CHECK(dtype_is_float(t.dtype()), "tensor '{}' has non-float dtype {}", name, dtype_name(t.dtype()));
    return t.to_vector();
  }

  Linear linear(const std::string& prefix, int64_t out, int64_t in) {
    Linear l;
    l.weight = get(prefix + ".weight", {out, in});
    const DType dt = l.weight.dtype();
    DS_CHECK(dtype_is_float(dt), "tensor '{}.weight' has non-float dtype {}", prefix, dtype_name(dt));
    l.view = {l.weight.raw(), dt, out, in, nullptr, 128, 128};
    if (dt == DType::F8E4M3 || dt == DType::F8E5M2) {
      const int64_t br = cfg_.fp8_block_rows > 0 ? cfg_.fp8_block_rows : 128;
      const int64_t bc = cfg_.fp8_block_cols > 0 ? cfg_.fp8_block_cols : 128;
      l.scale_inv = get(prefix + ".weight_scale_inv", {(out + br - 1) / br, (in + bc - 1) / bc});
      DS_CHECK(l.scale_inv.dtype() == DType::F32, "tensor '{}.weight_scale_inv' must be F32, got {}", prefix,
               dtype_name(l.scale_inv.dtype()));
      l.view.scale_inv = l.scale_inv.data<float>();
      l.view.block_rows = br;
      l.view.block_cols = bc;
    }
    return l;
  }

  Mlp mlp(const std::string& prefix, int64_t width) {
    const int64_t d = cfg_.hidden_size;
    return {linear(prefix + ".gate_proj", width, d), linear(prefix + ".up_proj", width, d),
            linear(prefix + ".down_proj", d, width)};
  }

  // Every tensor in the checkpoint must be used, or belong to a multi-token
  // prediction layer (index in [num_hidden_layers, num_hidden_layers +
  // num_nextn_predict_layers): not used for generation), or be a known extra.
  void check_all_used() const {
    const std::regex layer_re(R"(model\.layers\.(\d+)\..*)");
    const int64_t L = cfg_.num_hidden_layers, mtp = cfg_.num_nextn_predict_layers;
    for (const auto& name : st_.names()) {
      if (used_.count(name)) continue;
      std::smatch m;
      if (std::regex_match(name, m, layer_re)) {
        // At most 9 digits: any layer index the config allows fits; more is
        // an error below, never an overflow.
        const std::string digits = m[1];
        const int64_t layer = digits.size() <= 9 ? std::stoll(digits) : -1;
        DS_CHECK(layer >= 0 && layer < L + mtp,
                 "checkpoint tensor '{}' belongs to layer {}, but config.json has num_hidden_layers {} and "
                 "num_nextn_predict_layers {} (layers 0 to {}); wrong config.json?",
                 name.size() > 200 ? name.substr(0, 200) + "..." : name,
                 digits.size() <= 20 ? digits : digits.substr(0, 20) + "...", L, mtp, L + mtp - 1);
        if (layer >= L) continue;  // a multi-token prediction layer
      }
      if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // older exports carry it
      // DeepSeek-V3.2's sparse-attention indexer: it only chooses which
      // index_topk keys a query attends to, so up to index_topk tokens the
      // attention is the dense one (Transformer::step enforces that bound).
      if (cfg_.index_n_heads > 0 && name.find(".self_attn.indexer.") != std::string::npos) continue;
      DS_FAIL("checkpoint tensor '{}' is not part of a {} model with this config (wrong config.json?)", name,
              cfg_.model_type);
    }
  }

  size_t bytes() const { return bytes_; }

 private:
  const io::SafetensorsSet& st_;
  const ModelConfig& cfg_;
  std::set<std::string> used_;
  size_t bytes_ = 0;
};

}  // namespace

ModelWeights ModelWeights::load(const io::SafetensorsSet& st, const ModelConfig& cfg) {
  cfg.validate();
  Loader ld(st, cfg);
  ModelWeights w;
  const int64_t D = cfg.hidden_size, H = cfg.num_attention_heads;
  w.embed = ld.get("model.embed_tokens.weight", {cfg.vocab_size, D});
  DS_CHECK(dtype_is_float(w.embed.dtype()), "model.embed_tokens.weight must be floating point");
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    Layer L;
    L.input_norm = ld.vec(p + ".input_layernorm.weight", D);
    L.post_attention_norm = ld.vec(p + ".post_attention_layernorm.weight", D);
    Attention& a = L.attn;
    const int64_t qk = cfg.qk_head_dim();
    if (cfg.q_lora_rank > 0) {
      a.q_a = ld.linear(p + ".self_attn.q_a_proj", cfg.q_lora_rank, D);
      a.q_a_norm = ld.vec(p + ".self_attn.q_a_layernorm.weight", cfg.q_lora_rank);
      a.q_b = ld.linear(p + ".self_attn.q_b_proj", H * qk, cfg.q_lora_rank);
    } else {
      a.q = ld.linear(p + ".self_attn.q_proj", H * qk, D);
    }
    a.kv_a = ld.linear(p + ".self_attn.kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, D);
    a.kv_a_norm = ld.vec(p + ".self_attn.kv_a_layernorm.weight", cfg.kv_lora_rank);
    a.kv_b = ld.linear(p + ".self_attn.kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank);
    a.o = ld.linear(p + ".self_attn.o_proj", D, H * cfg.v_head_dim);
    L.is_moe = cfg.is_moe_layer(i);
    if (L.is_moe) {
      const int64_t E = cfg.n_routed_experts;
      L.moe.gate = ld.linear(p + ".mlp.gate", E, D);
      const std::string bias = p + ".mlp.gate.e_score_correction_bias";
      if (cfg.topk_method == TopkMethod::NoauxTc) L.moe.bias = ld.vec(bias, E);
      for (int64_t e = 0; e < E; ++e)
        L.moe.experts.push_back(ld.mlp(p + ".mlp.experts." + std::to_string(e), cfg.moe_intermediate_size));
      if (cfg.n_shared_experts > 0) {
        L.moe.has_shared = true;
        L.moe.shared = ld.mlp(p + ".mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts);
      }
    } else {
      L.mlp = ld.mlp(p + ".mlp", cfg.intermediate_size);
    }
    w.layers.push_back(std::move(L));
  }
  w.final_norm = ld.vec("model.norm.weight", D);
  if (cfg.tie_word_embeddings) {
    w.lm_head.weight = w.embed;
    w.lm_head.view = {w.embed.raw(), w.embed.dtype(), cfg.vocab_size, D, nullptr, 128, 128};
  } else {
    w.lm_head = ld.linear("lm_head", cfg.vocab_size, D);
  }
  ld.check_all_used();
  w.weight_bytes = ld.bytes();
  return w;
}

}  // namespace ds::model
