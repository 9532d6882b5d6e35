// The parameter tree: every tensor of a DeepSeek model, with its Hugging Face
// name and shape, written down once.
//
// ModelParams<T> holds one T per tensor (T is the leaf: a loaded checkpoint
// tensor, a float32 buffer pointer, a view, ...). for_each_param walks one or
// more trees of the same config in one fixed order and hands the visitor the
// tensor's ParamInfo and the matching leaf of every tree, as gemma.cpp's
// ForEachTensor does. Loading, random init, test fixtures, master weights,
// gradients, optimizer moments and checkpoints are all such walks.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "model/config.h"

namespace ds::model {

enum class ParamRole {
  Embedding,    // model.embed_tokens
  Projection,   // attention projections, MLP and expert matrices, MTP eh_proj
  Router,       // mlp.gate.weight
  RoutingBias,  // mlp.gate.e_score_correction_bias: moved by the balancing rule, never by gradients
  Norm,         // RMSNorm (and LayerNorm) scales
  NormBias,     // LayerNorm bias (the DeepSeek-V3.2 indexer's k_norm)
  IndexerHeadWeights,  // the V3.2 indexer's weights_proj: per-head weights, never fp8
  LmHead,       // lm_head
  MhcMatrix,    // mHC fn: the pre / post / res projections of the normed streams
  MhcBias,      // mHC base: the mixes' biases (start at 0)
  MhcScale,     // mHC scale: one factor per mix kind (start at 0.01)
  EngramTable,  // Engram's n-gram embedding table: N(0, 1 / D_head), its gradient only at the rows looked up
  EngramConv,   // Engram's depthwise conv kernel (starts at 0)
  Bias,         // a linear layer's bias (Engram's key and value projections; start at 0)
  Untrained,    // held fixed by the trainer: DeepSeek-V4's token -> experts table (hash routing), and its
                // lightning indexer, which no loss of this trainer trains
};

struct ParamInfo {
  std::string name;  // Hugging Face tensor name
  Shape shape;
  ParamRole role;
  int64_t layer = -1;  // decoder layer index (MTP layers continue after the last), -1 for none
  // A matrix: weight decay applies (never to norm scales or the bias).
  bool is_matrix() const { return shape.size() >= 2; }
  // Receives gradients and optimizer updates.
  bool trainable() const { return role != ParamRole::RoutingBias && role != ParamRole::Untrained; }
  int64_t numel() const { return shape_numel(shape); }
};

template <class T>
struct MlpParams {  // down(silu(gate(x)) * up(x))
  T gate{}, up{}, down{};
};

// DeepSeek-V3.2's lightning indexer (index_n_heads > 0), under
// self_attn.indexer: wq_b [Hi*Di, q_lora], wk [Di, D], k_norm weight and bias
// [Di], weights_proj [Hi, D].
template <class T>
struct IndexerParams {
  T wq_b{}, wk{}, k_norm{}, k_norm_bias{}, weights_proj{};
};

template <class T>
struct AttentionParams {       // MLA
  T q_a{}, q_a_norm{}, q_b{};  // q_lora_rank > 0
  T q{};                       // q_lora_rank == 0
  T kv_a{}, kv_a_norm{}, kv_b{}, o{};
  IndexerParams<T> indexer;
};

template <class T>
struct MoeParams {
  T router{}, bias{};  // bias: noaux_tc only
  std::vector<MlpParams<T>> experts;
  MlpParams<T> shared;  // n_shared_experts > 0 (one MLP of n_shared * moe_intermediate_size)
};

// MaxText's mHC module around one sub-layer (mhc_expansion_rate k > 1), for
// d = hidden_size: the RMSNorm scale of the flattened streams [k d], fn
// [(2 + k) k, k d] (rows: k pre, k post, k x k res mixes, row-major), base
// [(2 + k) k] and scale [3] (pre, post, res).
template <class T>
struct MhcParams {
  T norm{}, fn{}, base{}, scale{};
};

// Engram (model/engram.h) before the attention of the layers in
// engram_layers, for G = mhc_expansion_rate streams of D, C hash columns of
// D_head: the input norm [D] (engram_layernorm), the table [rows, D_head],
// key_proj [G D, C D_head] and its bias [G D], value_proj [D, C D_head] and
// its bias [D], the per-stream norms q_norm, k_norm, short_conv.norm [G D]
// and the conv kernel [K, G D].
template <class T>
struct EngramParams {
  T norm{}, table{}, key{}, key_bias{}, value{}, value_bias{}, q_norm{}, k_norm{}, conv_norm{}, conv{};
};

template <class T>
struct LayerParams {
  T input_norm{}, post_attention_norm{};
  AttentionParams<T> attn;
  MlpParams<T> mlp;  // dense layers
  MoeParams<T> moe;  // MoE layers
  MhcParams<T> mhc_attn, mhc_mlp;  // mhc_expansion_rate > 1
  EngramParams<T> engram;          // layers in engram_layers
};

// A multi-token prediction depth, as Hugging Face checkpoints store it under
// model.layers.{num_hidden_layers + k}: the embedding and LM head are the
// main model's (the checkpoint's embed_tokens / shared_head.head copies are
// not separate parameters), shared_head.norm is its own.
template <class T>
struct MtpParams {
  T enorm{}, hnorm{}, eh_proj{}, head_norm{};
  LayerParams<T> layer;
};

template <class T>
struct ModelParams {
  T embed{};
  std::vector<LayerParams<T>> layers;
  T final_norm{}, lm_head{};  // lm_head: the embedding's leaf when tie_word_embeddings
  std::vector<MtpParams<T>> mtp;
};

// A tree shaped for `cfg` with `mtp_layers` MTP depths; leaves value-initialised.
template <class T>
ModelParams<T> make_params(const ModelConfig& cfg, int64_t mtp_layers = 0) {
  ModelParams<T> p;
  auto shape_layer = [&](LayerParams<T>& L, int64_t l) {
    if (cfg.is_moe_layer(l)) L.moe.experts.resize(static_cast<size_t>(cfg.n_routed_experts));
  };
  p.layers.resize(static_cast<size_t>(cfg.num_hidden_layers));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) shape_layer(p.layers[l], l);
  p.mtp.resize(static_cast<size_t>(mtp_layers));
  for (int64_t k = 0; k < mtp_layers; ++k) shape_layer(p.mtp[k].layer, cfg.num_hidden_layers + k);
  return p;
}

namespace detail {

template <class F, class... Mlp>
void visit_mlp(const std::string& p, int64_t layer, int64_t D, int64_t width, F& f, Mlp&... m) {
  f(ParamInfo{p + ".gate_proj.weight", {width, D}, ParamRole::Projection, layer}, m.gate...);
  f(ParamInfo{p + ".up_proj.weight", {width, D}, ParamRole::Projection, layer}, m.up...);
  f(ParamInfo{p + ".down_proj.weight", {D, width}, ParamRole::Projection, layer}, m.down...);
}

template <class F, class... Mhc>
void visit_mhc(const std::string& p, int64_t layer, const ModelConfig& c, F& f, Mhc&... m) {
  const int64_t k = c.mhc_expansion_rate, kd = c.residual_width(), mixes = (2 + k) * k;
  f(ParamInfo{p + ".norm.weight", {kd}, ParamRole::Norm, layer}, m.norm...);
  f(ParamInfo{p + ".fn", {mixes, kd}, ParamRole::MhcMatrix, layer}, m.fn...);
  f(ParamInfo{p + ".base", {mixes}, ParamRole::MhcBias, layer}, m.base...);
  f(ParamInfo{p + ".scale", {3}, ParamRole::MhcScale, layer}, m.scale...);
}

template <class F, class... Layer>
void visit_layer(const ModelConfig& c, int64_t l, F& f, Layer&... L) {
  const std::string p = "model.layers." + std::to_string(l);
  const int64_t D = c.hidden_size, H = c.num_attention_heads, qk = c.qk_head_dim();
  auto info = [&](const char* suffix, Shape shape, ParamRole role) {
    return ParamInfo{p + suffix, std::move(shape), role, l};
  };
  f(info(".input_layernorm.weight", {D}, ParamRole::Norm), L.input_norm...);
  f(info(".post_attention_layernorm.weight", {D}, ParamRole::Norm), L.post_attention_norm...);
  if (c.q_lora_rank > 0) {
    f(info(".self_attn.q_a_proj.weight", {c.q_lora_rank, D}, ParamRole::Projection), L.attn.q_a...);
    f(info(".self_attn.q_a_layernorm.weight", {c.q_lora_rank}, ParamRole::Norm), L.attn.q_a_norm...);
    f(info(".self_attn.q_b_proj.weight", {H * qk, c.q_lora_rank}, ParamRole::Projection), L.attn.q_b...);
  } else {
    f(info(".self_attn.q_proj.weight", {H * qk, D}, ParamRole::Projection), L.attn.q...);
  }
  f(info(".self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, D}, ParamRole::Projection),
    L.attn.kv_a...);
  f(info(".self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, ParamRole::Norm), L.attn.kv_a_norm...);
  f(info(".self_attn.kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
         ParamRole::Projection),
    L.attn.kv_b...);
  f(info(".self_attn.o_proj.weight", {D, H * c.v_head_dim}, ParamRole::Projection), L.attn.o...);
  if (c.index_n_heads > 0) {
    const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
    f(info(".self_attn.indexer.wq_b.weight", {Hi * Di, c.q_lora_rank}, ParamRole::Projection), L.attn.indexer.wq_b...);
    f(info(".self_attn.indexer.wk.weight", {Di, D}, ParamRole::Projection), L.attn.indexer.wk...);
    f(info(".self_attn.indexer.k_norm.weight", {Di}, ParamRole::Norm), L.attn.indexer.k_norm...);
    f(info(".self_attn.indexer.k_norm.bias", {Di}, ParamRole::NormBias), L.attn.indexer.k_norm_bias...);
    f(info(".self_attn.indexer.weights_proj.weight", {Hi, D}, ParamRole::IndexerHeadWeights),
      L.attn.indexer.weights_proj...);
  }
  if (c.is_moe_layer(l)) {
    const int64_t E = c.n_routed_experts;
    DS_CHECK(((static_cast<int64_t>(L.moe.experts.size()) == E) && ...),
             "parameter tree of layer {} does not hold {} experts", l, E);
    f(info(".mlp.gate.weight", {E, D}, ParamRole::Router), L.moe.router...);
    if (c.topk_method == TopkMethod::NoauxTc)
      f(info(".mlp.gate.e_score_correction_bias", {E}, ParamRole::RoutingBias), L.moe.bias...);
    for (int64_t e = 0; e < E; ++e)
      visit_mlp(p + ".mlp.experts." + std::to_string(e), l, D, c.moe_intermediate_size, f, L.moe.experts[e]...);
    if (c.n_shared_experts > 0)
      visit_mlp(p + ".mlp.shared_experts", l, D, c.moe_intermediate_size * c.n_shared_experts, f, L.moe.shared...);
  } else {
    visit_mlp(p + ".mlp", l, D, c.intermediate_size, f, L.mlp...);
  }
  if (c.has_mhc()) {
    visit_mhc(p + ".mhc_attention", l, c, f, L.mhc_attn...);
    visit_mhc(p + ".mhc_mlp", l, c, f, L.mhc_mlp...);
  }
  if (c.has_engram(l)) {
    const int64_t GD = c.residual_width(), in = c.engram_columns() * c.engram_head_dim;
    f(info(".engram_layernorm.weight", {D}, ParamRole::Norm), L.engram.norm...);
    f(info(".engram.embedding.weight", {c.engram_table_rows(l), c.engram_head_dim}, ParamRole::EngramTable),
      L.engram.table...);
    f(info(".engram.key_proj.weight", {GD, in}, ParamRole::Projection), L.engram.key...);
    f(info(".engram.key_proj.bias", {GD}, ParamRole::Bias), L.engram.key_bias...);
    f(info(".engram.value_proj.weight", {D, in}, ParamRole::Projection), L.engram.value...);
    f(info(".engram.value_proj.bias", {D}, ParamRole::Bias), L.engram.value_bias...);
    f(info(".engram.q_norm.weight", {GD}, ParamRole::Norm), L.engram.q_norm...);
    f(info(".engram.k_norm.weight", {GD}, ParamRole::Norm), L.engram.k_norm...);
    f(info(".engram.short_conv.norm.weight", {GD}, ParamRole::Norm), L.engram.conv_norm...);
    f(info(".engram.short_conv.weight", {c.engram_kernel_size, GD}, ParamRole::EngramConv), L.engram.conv...);
  }
}

}  // namespace detail

// Calls f(const ParamInfo&, leaf of trees[0], leaf of trees[1], ...) for every
// tensor, in checkpoint order: embedding, layers (MTP depths last), final
// norm, LM head (skipped when tied to the embedding). The trees must come
// from make_params with this config; with no tree it walks the names alone.
template <class F, class... Tree>
void for_each_param(const ModelConfig& c, int64_t mtp_layers, F&& f, Tree&&... trees) {
  DS_CHECK(((static_cast<int64_t>(trees.layers.size()) == c.num_hidden_layers &&
             static_cast<int64_t>(trees.mtp.size()) == mtp_layers) &&
            ...),
           "parameter tree does not match the config ({} layers, {} MTP depths)", c.num_hidden_layers, mtp_layers);
  const int64_t D = c.hidden_size, L = c.num_hidden_layers;
  f(ParamInfo{"model.embed_tokens.weight", {c.vocab_size, D}, ParamRole::Embedding}, trees.embed...);
  for (int64_t l = 0; l < L; ++l) detail::visit_layer(c, l, f, trees.layers[l]...);
  for (int64_t k = 0; k < mtp_layers; ++k) {
    const int64_t l = L + k;
    const std::string p = "model.layers." + std::to_string(l);
    f(ParamInfo{p + ".enorm.weight", {D}, ParamRole::Norm, l}, trees.mtp[k].enorm...);
    f(ParamInfo{p + ".hnorm.weight", {D}, ParamRole::Norm, l}, trees.mtp[k].hnorm...);
    f(ParamInfo{p + ".eh_proj.weight", {D, 2 * D}, ParamRole::Projection, l}, trees.mtp[k].eh_proj...);
    detail::visit_layer(c, l, f, trees.mtp[k].layer...);
    f(ParamInfo{p + ".shared_head.norm.weight", {D}, ParamRole::Norm, l}, trees.mtp[k].head_norm...);
  }
  f(ParamInfo{"model.norm.weight", {D}, ParamRole::Norm}, trees.final_norm...);
  if (!c.tie_word_embeddings) f(ParamInfo{"lm_head.weight", {c.vocab_size, D}, ParamRole::LmHead}, trees.lm_head...);
}

// A tree of U made leaf by leaf from `src`: out = fn(info, src leaf). A tied
// LM head shares the embedding's new leaf.
template <class U, class T, class Fn>
ModelParams<U> map_params(const ModelConfig& c, const ModelParams<T>& src, Fn&& fn) {
  const auto mtp = static_cast<int64_t>(src.mtp.size());
  ModelParams<U> out = make_params<U>(c, mtp);
  for_each_param(
      c, mtp, [&](const ParamInfo& i, const T& s, U& d) { d = fn(i, s); }, src, out);
  if (c.tie_word_embeddings) out.lm_head = out.embed;
  return out;
}

// The tree's names in walk order (with shapes and roles).
inline std::vector<ParamInfo> param_infos(const ModelConfig& c, int64_t mtp_layers = 0) {
  std::vector<ParamInfo> v;
  for_each_param(c, mtp_layers, [&](const ParamInfo& i) { v.push_back(i); });
  return v;
}

}  // namespace ds::model
