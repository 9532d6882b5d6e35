// DeepSeek-V4's parameter tree: every tensor of a V4 checkpoint under its
// upstream name (DeepSeek's own layout, as the hub folders store it), with
// its logical shape [out, in] (packed fp4 experts hold in / 2 bytes a row),
// written down once. for_each_v4_param walks one or more trees of the same
// config in a fixed order, as for_each_param does for V2/V3.
//
// The MTP layers (num_nextn_predict_layers of them, "mtp.k.*") follow the
// main model: block k is layers[num_hidden_layers + k] (a sliding-window
// layer with score routing), and mtp[k] holds what it adds around it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "model/v4_config.h"

namespace ds::model {

enum class V4Role {
  Embedding,    // embed.weight
  Projection,   // linear weights (fp8 with block scales, packed fp4 experts, or bf16)
  Router,       // ffn.gate.weight
  Vector,       // norms, biases, the sink, mHC mixes and position embeddings: float32 copies
  HashTable,    // ffn.gate.tid2eid: token id -> experts
  LmHead,       // head.weight
  EngramTable,  // engram.embed.weight (V4.1): fp8 rows with an e8m0 scale per 32 columns, or a float dtype
};

struct V4ParamInfo {
  std::string name;  // upstream tensor name
  Shape shape;       // logical [out, in] for matrices
  V4Role role;
  int64_t layer = -1;
  bool routed_expert = false;  // stored in config.expert_dtype
};

template <class T>
struct V4MlpParams {  // w2(silu(w1 x) * w3 x), with the config's SwiGLU clamp
  T w1{}, w3{}, w2{};
};

template <class T>
struct V4CompressorParams {
  T wkv{}, wgate{}, ape{}, norm{};
};

template <class T>
struct V4AttentionParams {
  T wq_a{}, q_norm{}, wq_b{}, wkv{}, kv_norm{}, wo_a{}, wo_b{}, sink{};
  V4CompressorParams<T> compressor;  // m > 0
  T index_wq_b{}, index_weights_proj{};
  V4CompressorParams<T> index_compressor;  // m == 4
  T index_wk{}, index_k_norm{};            // V4.1's KV sources: the index keys from the entries
};

// DeepSeek-V4.1's Engram (model/engram_v41.h): the table, the fused key and
// value projection, and the per-stream weights whose product is the gate's.
template <class T>
struct V4EngramParams {
  T embed{}, wkv{}, q_weight{}, k_weight{};
};

template <class T>
struct V4LayerParams {
  T attn_norm{}, ffn_norm{};
  T hc_attn_fn{}, hc_attn_base{}, hc_attn_scale{}, hc_ffn_fn{}, hc_ffn_base{}, hc_ffn_scale{};
  V4AttentionParams<T> attn;
  T gate{}, gate_bias{}, tid2eid{};  // gate_bias on score-routed layers, tid2eid on hash-routed ones
  T gate_bias_vl{};                  // V4.1: the selection bias of image tokens (text never reads it)
  V4EngramParams<T> engram;          // V4.1's Engram layers
  std::vector<V4MlpParams<T>> experts;
  V4MlpParams<T> shared;  // n_shared_experts == 1
};

// Around MTP block k: X = e_proj(rmsnorm(embed(next token); enorm)) +
// h_proj(rmsnorm(main streams; hnorm)); logits = head(rmsnorm(hc_head(block(X)); norm)).
template <class T>
struct V4MtpParams {
  T e_proj{}, h_proj{}, enorm{}, hnorm{}, norm{}, hc_head_fn{}, hc_head_base{}, hc_head_scale{};
};

template <class T>
struct V4Params {
  T embed{};
  std::vector<V4LayerParams<T>> layers;  // the main layers, then the MTP blocks
  T norm{}, head{}, hc_head_fn{}, hc_head_base{}, hc_head_scale{};
  std::vector<V4MtpParams<T>> mtp;
};

template <class T>
V4Params<T> make_v4_params(const V4Config& c) {
  V4Params<T> p;
  p.layers.resize(static_cast<size_t>(c.num_hidden_layers + c.num_nextn_predict_layers));
  for (auto& L : p.layers) L.experts.resize(static_cast<size_t>(c.n_routed_experts));
  p.mtp.resize(static_cast<size_t>(c.num_nextn_predict_layers));
  return p;
}

namespace detail {

template <class F, class... C>
void visit_v4_compressor(const std::string& p, int64_t layer, int64_t d, int64_t Dc, int64_t m, F& f, C&... c) {
  const int64_t width = (m == 4 ? 2 : 1) * Dc;
  f(V4ParamInfo{p + "wkv.weight", {width, d}, V4Role::Projection, layer}, c.wkv...);
  f(V4ParamInfo{p + "wgate.weight", {width, d}, V4Role::Projection, layer}, c.wgate...);
  f(V4ParamInfo{p + "ape", {m, width}, V4Role::Vector, layer}, c.ape...);
  f(V4ParamInfo{p + "norm.weight", {Dc}, V4Role::Vector, layer}, c.norm...);
}

template <class F, class... Mlp>
void visit_v4_mlp(const std::string& p, int64_t layer, int64_t d, int64_t I, bool routed, F& f, Mlp&... m) {
  f(V4ParamInfo{p + "w1.weight", {I, d}, V4Role::Projection, layer, routed}, m.w1...);
  f(V4ParamInfo{p + "w3.weight", {I, d}, V4Role::Projection, layer, routed}, m.w3...);
  f(V4ParamInfo{p + "w2.weight", {d, I}, V4Role::Projection, layer, routed}, m.w2...);
}

template <class F, class... Layer>
void visit_v4_layer(const V4Config& c, int64_t l, const std::string& p, F& f, Layer&... L) {
  const int64_t d = c.hidden_size, n = c.hc_mult, H = c.num_attention_heads, D = c.head_dim;
  const int64_t mix = (2 + n) * n, m = c.compress_ratio(l);
  auto info = [&](const std::string& suffix, Shape shape, V4Role role) {
    return V4ParamInfo{p + suffix, std::move(shape), role, l};
  };
  f(info("attn_norm.weight", {d}, V4Role::Vector), L.attn_norm...);
  f(info("ffn_norm.weight", {d}, V4Role::Vector), L.ffn_norm...);
  if (const int64_t e = c.engram_slot(l); e >= 0) {
    const int64_t De = c.engram_head_dim;
    f(info("engram.embed.weight", {c.engram_num_embeddings[static_cast<size_t>(e)], De}, V4Role::EngramTable),
      L.engram.embed...);
    f(info("engram.wkv.weight", {(n + 1) * d, c.engram_columns() * De}, V4Role::Projection), L.engram.wkv...);
    f(info("engram.q_weight", {n, d}, V4Role::Vector), L.engram.q_weight...);
    f(info("engram.k_weight", {n, d}, V4Role::Vector), L.engram.k_weight...);
  }
  f(info("hc_attn_fn", {mix, n * d}, V4Role::Vector), L.hc_attn_fn...);
  f(info("hc_attn_base", {mix}, V4Role::Vector), L.hc_attn_base...);
  f(info("hc_attn_scale", {3}, V4Role::Vector), L.hc_attn_scale...);
  f(info("hc_ffn_fn", {mix, n * d}, V4Role::Vector), L.hc_ffn_fn...);
  f(info("hc_ffn_base", {mix}, V4Role::Vector), L.hc_ffn_base...);
  f(info("hc_ffn_scale", {3}, V4Role::Vector), L.hc_ffn_scale...);
  f(info("attn.wq_a.weight", {c.q_lora_rank, d}, V4Role::Projection), L.attn.wq_a...);
  f(info("attn.q_norm.weight", {c.q_lora_rank}, V4Role::Vector), L.attn.q_norm...);
  f(info("attn.wq_b.weight", {H * D, c.q_lora_rank}, V4Role::Projection), L.attn.wq_b...);
  f(info("attn.wkv.weight", {D, d}, V4Role::Projection), L.attn.wkv...);
  f(info("attn.kv_norm.weight", {D}, V4Role::Vector), L.attn.kv_norm...);
  f(info("attn.wo_a.weight", {c.o_groups * c.o_lora_rank, H * D / c.o_groups}, V4Role::Projection), L.attn.wo_a...);
  f(info("attn.wo_b.weight", {d, c.o_groups * c.o_lora_rank}, V4Role::Projection), L.attn.wo_b...);
  f(info("attn.attn_sink", {H}, V4Role::Vector), L.attn.sink...);
  if (c.v41()) {
    const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
    if (c.owns_compressor(l)) {  // no position embedding; the gate pools pairs only
      f(info("attn.compressor.wkv.weight", {D, d}, V4Role::Projection), L.attn.compressor.wkv...);
      if (m == 2) f(info("attn.compressor.wgate.weight", {D, d}, V4Role::Projection), L.attn.compressor.wgate...);
      f(info("attn.compressor.norm.weight", {D}, V4Role::Vector), L.attn.compressor.norm...);
      f(info("attn.indexer.wk.weight", {Di, D}, V4Role::Projection), L.attn.index_wk...);
      f(info("attn.indexer.k_norm.weight", {Di}, V4Role::Vector), L.attn.index_k_norm...);
    }
    if (c.owns_indexer(l)) {
      f(info("attn.indexer.wq_b.weight", {Hi * Di, c.q_lora_rank}, V4Role::Projection), L.attn.index_wq_b...);
      f(info("attn.indexer.weights_proj.weight", {Hi, d}, V4Role::Projection), L.attn.index_weights_proj...);
    }
  } else if (m > 0) {
    visit_v4_compressor(p + "attn.compressor.", l, d, D, m, f, L.attn.compressor...);
  }
  if (!c.v41() && m == 4) {
    const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
    f(info("attn.indexer.wq_b.weight", {Hi * Di, c.q_lora_rank}, V4Role::Projection), L.attn.index_wq_b...);
    f(info("attn.indexer.weights_proj.weight", {Hi, d}, V4Role::Projection), L.attn.index_weights_proj...);
    visit_v4_compressor(p + "attn.indexer.compressor.", l, d, Di, 4, f, L.attn.index_compressor...);
  }
  const int64_t E = c.n_routed_experts;
  DS_CHECK(((static_cast<int64_t>(L.experts.size()) == E) && ...), "V4 parameter tree of layer {} lacks experts", l);
  f(info("ffn.gate.weight", {E, d}, V4Role::Router), L.gate...);
  if (c.hash_routed(l))
    f(info("ffn.gate.tid2eid", {c.vocab_size, c.num_experts_per_tok}, V4Role::HashTable), L.tid2eid...);
  else
    f(info("ffn.gate.bias", {E}, V4Role::Vector), L.gate_bias...);
  if (c.v41()) f(info("ffn.gate.bias_vl", {E}, V4Role::Vector), L.gate_bias_vl...);
  for (int64_t e = 0; e < E; ++e)
    visit_v4_mlp(p + "ffn.experts." + std::to_string(e) + ".", l, d, c.moe_intermediate_size, true, f,
                 L.experts[static_cast<size_t>(e)]...);
  if (c.n_shared_experts > 0)
    visit_v4_mlp(p + "ffn.shared_experts.", l, d, c.moe_intermediate_size, false, f, L.shared...);
}

}  // namespace detail

// f(const V4ParamInfo&, leaf of trees[0], ...) for every tensor: embed, the
// layers, norm, the mHC head, head (skipped when tied), then each MTP layer.
template <class F, class... Tree>
void for_each_v4_param(const V4Config& c, F&& f, Tree&&... trees) {
  const int64_t M = c.num_nextn_predict_layers;
  DS_CHECK(((static_cast<int64_t>(trees.layers.size()) == c.num_hidden_layers + M &&
             static_cast<int64_t>(trees.mtp.size()) == M) &&
            ...),
           "V4 parameter tree does not match the config");
  const int64_t d = c.hidden_size, n = c.hc_mult;
  f(V4ParamInfo{"embed.weight", {c.vocab_size, d}, V4Role::Embedding}, trees.embed...);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    detail::visit_v4_layer(c, l, "layers." + std::to_string(l) + ".", f, trees.layers[static_cast<size_t>(l)]...);
  f(V4ParamInfo{"norm.weight", {d}, V4Role::Vector}, trees.norm...);
  if (!c.lagged_mhc()) {  // V4.1 collapses the streams with the last layer's mix
    f(V4ParamInfo{"hc_head_fn", {n, n * d}, V4Role::Vector}, trees.hc_head_fn...);
    f(V4ParamInfo{"hc_head_base", {n}, V4Role::Vector}, trees.hc_head_base...);
    f(V4ParamInfo{"hc_head_scale", {1}, V4Role::Vector}, trees.hc_head_scale...);
  }
  if (!c.tie_word_embeddings) f(V4ParamInfo{"head.weight", {c.vocab_size, d}, V4Role::LmHead}, trees.head...);
  for (int64_t k = 0; k < M; ++k) {
    const std::string p = "mtp." + std::to_string(k) + ".";
    const int64_t l = c.num_hidden_layers + k;
    [[maybe_unused]] const size_t ks = static_cast<size_t>(k);  // unused when no tree is walked
    f(V4ParamInfo{p + "e_proj.weight", {d, d}, V4Role::Projection, l}, trees.mtp[ks].e_proj...);
    f(V4ParamInfo{p + "h_proj.weight", {d, d}, V4Role::Projection, l}, trees.mtp[ks].h_proj...);
    f(V4ParamInfo{p + "enorm.weight", {d}, V4Role::Vector, l}, trees.mtp[ks].enorm...);
    f(V4ParamInfo{p + "hnorm.weight", {d}, V4Role::Vector, l}, trees.mtp[ks].hnorm...);
    detail::visit_v4_layer(c, l, p, f, trees.layers[static_cast<size_t>(l)]...);
    f(V4ParamInfo{p + "norm.weight", {d}, V4Role::Vector, l}, trees.mtp[ks].norm...);
    f(V4ParamInfo{p + "hc_head_fn", {n, n * d}, V4Role::Vector, l}, trees.mtp[ks].hc_head_fn...);
    f(V4ParamInfo{p + "hc_head_base", {n}, V4Role::Vector, l}, trees.mtp[ks].hc_head_base...);
    f(V4ParamInfo{p + "hc_head_scale", {1}, V4Role::Vector, l}, trees.mtp[ks].hc_head_scale...);
  }
}

}  // namespace ds::model
