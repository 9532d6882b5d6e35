#include "model/stages.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/activations.h"
#include "ops/cross_entropy.h"
#include "ops/fp8_quant.h"
#include "ops/indexer.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/routing.h"

namespace ds::model {

const EngramLayerHash& StageConfig::engram_table(int64_t layer) const {
  const auto& ls = cfg->engram_layers;
  const auto it = std::find(ls.begin(), ls.end(), layer);
  DS_CHECK(it != ls.end() && engram_tables.size() == ls.size(), "internal: layer {} has no Engram tables", layer);
  return engram_tables[static_cast<size_t>(it - ls.begin())];
}

StageConfig::StageConfig(const ModelConfig& c) : cfg(&c) {
  ops::RopeConfig rc;
  rc.dim = c.qk_rope_head_dim;
  rc.theta = c.rope_theta;
  if (c.rope_scaling.enabled) {
    rc.factor = c.rope_scaling.factor;
    rc.original_max_position = c.rope_scaling.original_max_position_embeddings;
    rc.beta_fast = c.rope_scaling.beta_fast;
    rc.beta_slow = c.rope_scaling.beta_slow;
  }
  rope_freqs.resize(static_cast<size_t>(c.qk_rope_head_dim / 2));
  ops::rope_frequencies(rope_freqs.data(), rc);
  softmax_scale = static_cast<float>(c.softmax_scale());
  if (c.has_engram()) {
    DS_CHECK(!c.engram_compress_tokens || c.engram_token_classes,
             "engram_compress_tokens: the token classes were not read from a tokenizer (internal: no "
             "attach_engram_classes)");
    engram_tables = engram_hash_tables(c.engram_hash_spec());
    engram = engram_dims(c);
  }
  selection.num_experts = c.n_routed_experts;
  selection.k = c.num_experts_per_tok;
  selection.n_group = c.n_group;
  selection.topk_group = c.topk_group;
  selection.scoring =
      c.scoring_func == ScoringFunc::Sigmoid ? ops::ExpertScoring::Sigmoid : ops::ExpertScoring::Softmax;
  selection.group_score = c.topk_method == TopkMethod::NoauxTc              ? ops::GroupScore::Top2Sum
                          : c.topk_method == TopkMethod::GroupLimitedGreedy ? ops::GroupScore::Max
                                                                            : ops::GroupScore::None;
  selection.norm_topk_prob = c.norm_topk_prob;
  selection.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
}

namespace {

float eps_of(const StageConfig& s) { return static_cast<float>(s.cfg->rms_norm_eps); }

void add_into(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace

bool bf16_activations() { return ops::gemm_dtype() == ops::GemmDtype::kBf16; }

void to_activation_dtype(float* x, int64_t n) {
  if (bf16_activations() && n > 0) round_to_bf16(x, static_cast<size_t>(n));
}

void norm_backward(float* dx, float* dw, const float* dy, const float* x, const ops::WeightView& w, const float* rstd,
                   int64_t rows, bool accumulate_dx) {
  const int64_t dim = w.rows;
  Buffer<float> scratch, dn;
  if (!dw) scratch.assign(static_cast<size_t>(dim), 0.0f);
  if (accumulate_dx) dn.resize(rows * dim);
  float* out = accumulate_dx ? dn.data() : dx;
  ops::rmsnorm_backward(out, dw ? dw : scratch.data(), dy, x, vector_data(w), rstd, rows, dim);
  if (accumulate_dx) add_into(dx, dn.data(), rows * dim);
}

// ---------------------------------------------------------------- LM head

void head_loss_forward(HeadLoss& hl, const float* hn, const ops::WeightView& head, const std::vector<int32_t>& targets,
                       const std::vector<int32_t>& mask, int64_t N, int64_t D, double zm) {
  hl.targets.resize(N);
  for (int64_t t = 0; t < N; ++t) hl.targets[t] = mask[t] != 0 ? targets[t] : -1;
  hl.loss.resize(N);
  hl.lse.resize(N);
  // A stored (bf16, fp8) head, as when evaluating a loaded checkpoint, is
  // widened once; training's master weights are float32 already.
  Buffer<float> wide;
  if (head.dtype != DType::F32) {
    wide.resize(static_cast<size_t>(head.rows * D));
    ops::widen_rows(wide.data(), head, 0, head.rows);
  }
  ops::lm_head_cross_entropy_forward(hl.loss.data(), hl.lse.data(), hn,
                                     wide.empty() ? static_cast<const float*>(head.data) : wide.data(),
                                     hl.targets.data(), N, D, head.rows);
  for (int64_t t = 0; t < N; ++t) {
    if (hl.targets[t] < 0) continue;
    const double l = hl.lse[t];
    hl.ce_sum += hl.loss[t];
    hl.z_sum += zm * l * l;
    hl.weight += 1;
  }
}

void head_loss_backward(float* dhn, float* dhead, const HeadLoss& hl, const float* hn, const ops::WeightView& head,
                        int64_t N, int64_t D, double zm, double scale) {
  DS_CHECK(head.dtype == DType::F32, "training needs a float32 LM head (it is {})", dtype_name(head.dtype));
  // d/dz (lse - z_t + zm lse^2) = (1 + a)(softmax - onehot) + a onehot, a = 2 zm lse.
  Buffer<float> dloss(N);
  std::vector<double> extra(N, 0.0);
  for (int64_t t = 0; t < N; ++t) {
    if (hl.targets[t] < 0) {
      dloss[t] = 0.0f;
      continue;
    }
    const double a = 2.0 * zm * hl.lse[t];
    dloss[t] = static_cast<float>(scale * (1.0 + a));
    extra[t] = scale * a;
  }
  const float* W = static_cast<const float*>(head.data);
  ops::lm_head_cross_entropy_backward(dhn, dhead, dloss.data(), hn, W, hl.targets.data(), hl.lse.data(), N, D,
                                      head.rows);
  if (zm == 0) return;
  for (int64_t t = 0; t < N; ++t) {
    if (hl.targets[t] < 0 || extra[t] == 0) continue;
    const float a = static_cast<float>(extra[t]);
    const float* w = W + static_cast<int64_t>(hl.targets[t]) * D;
    for (int64_t d = 0; d < D; ++d) dhn[t * D + d] += a * w[d];
    if (dhead) {
      float* dw = dhead + static_cast<int64_t>(hl.targets[t]) * D;
      for (int64_t d = 0; d < D; ++d) dw[d] += a * hn[t * D + d];
    }
  }
}

// ---------------------------------------------------------------- MLA

void query_projection_forward(const QueryOut& out, const float* x, const AttentionParams<ops::WeightView>& p,
                              const StageConfig& s, const int32_t* positions, int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t H = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, qk = nope + rope;
  if (c.q_lora_rank > 0) {
    if (out.latent) {
      ops::linear_forward(out.query_wa_proj, x, p.q_a, N);
      to_activation_dtype(out.query_wa_proj, N * c.q_lora_rank);
      ops::rmsnorm_forward(out.mla_q, out.q_rstd, out.query_wa_proj, vector_data(p.q_a_norm), N, c.q_lora_rank,
                           eps_of(s));
      to_activation_dtype(out.mla_q, N * c.q_lora_rank);
    }
    if (!out.query) return;
    ops::linear_forward(out.query_proj, out.mla_q, p.q_b, N);
  } else {
    if (!out.query) return;
    ops::linear_forward(out.query_proj, x, p.q, N);
  }
  ops::rope_forward(out.query_proj + nope, out.query_proj + nope, positions, s.rope_freqs.data(), N, H, rope, H * qk,
                    qk, ops::RopeLayout::Interleaved);
  to_activation_dtype(out.query_proj, N * H * qk);
}

void query_projection_backward(float* dx, AttentionParams<float*>& g, float* dq, const float* query_wa_proj,
                               const float* mla_q, const float* q_rstd, const float* x,
                               const AttentionParams<ops::WeightView>& p, const StageConfig& s,
                               const int32_t* positions, int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t H = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, qk = nope + rope;
  ops::rope_backward(dq + nope, dq + nope, positions, s.rope_freqs.data(), N, H, rope, H * qk, qk,
                     ops::RopeLayout::Interleaved);
  if (c.q_lora_rank > 0) {
    const int64_t R = c.q_lora_rank;
    Buffer<float> dmla(N * R), dqa(N * R);
    ops::linear_backward(dmla.data(), g.q_b, dq, mla_q, p.q_b, N);
    norm_backward(dqa.data(), g.q_a_norm, dmla.data(), query_wa_proj, p.q_a_norm, q_rstd, N);
    ops::linear_backward(dx, g.q_a, dqa.data(), x, p.q_a, N, true);
  } else {
    ops::linear_backward(dx, g.q, dq, x, p.q, N, true);
  }
}

void kv_projection_forward(const KvOut& out, const float* x, const AttentionParams<ops::WeightView>& p,
                           const StageConfig& s, const int32_t* positions, int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t kvl = c.kv_lora_rank, rope = c.qk_rope_head_dim, W = kvl + rope;
  if (out.project) {
    ops::linear_forward(out.kv_wa_proj, x, p.kv_a, N);
    to_activation_dtype(out.kv_wa_proj, N * W);
  }
  parallel_ranges(N, N * W >= (int64_t{1} << 14), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(out.mla_kv + t * kvl, out.kv_wa_proj + t * W, kvl * sizeof(float));
      std::memcpy(out.k_pe + t * rope, out.kv_wa_proj + t * W + kvl, rope * sizeof(float));
    }
  });
  ops::rmsnorm_forward(out.mla_kv, out.kv_rstd, out.mla_kv, vector_data(p.kv_a_norm), N, kvl, eps_of(s));
  to_activation_dtype(out.mla_kv, N * kvl);
  ops::rope_forward(out.k_pe, out.k_pe, positions, s.rope_freqs.data(), N, 1, rope, rope, rope,
                    ops::RopeLayout::Interleaved);
  to_activation_dtype(out.k_pe, N * rope);  // key_proj's rope part
}

void kv_projection_backward(float* dx, AttentionParams<float*>& g, float* d_mla_kv, float* dk_pe,
                            const float* kv_wa_proj, const float* kv_rstd, const float* x,
                            const AttentionParams<ops::WeightView>& p, const StageConfig& s, const int32_t* positions,
                            int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t kvl = c.kv_lora_rank, rope = c.qk_rope_head_dim, W = kvl + rope;
  Buffer<float> latent(N * kvl), dlatent(N * kvl), dkva(N * W);
  for (int64_t t = 0; t < N; ++t) std::memcpy(&latent[t * kvl], kv_wa_proj + t * W, kvl * sizeof(float));
  norm_backward(dlatent.data(), g.kv_a_norm, d_mla_kv, latent.data(), p.kv_a_norm, kv_rstd, N);
  ops::rope_backward(dk_pe, dk_pe, positions, s.rope_freqs.data(), N, 1, rope, rope, rope,
                     ops::RopeLayout::Interleaved);
  for (int64_t t = 0; t < N; ++t) {
    std::memcpy(dkva.data() + t * W, dlatent.data() + t * kvl, kvl * sizeof(float));
    std::memcpy(dkva.data() + t * W + kvl, dk_pe + t * rope, rope * sizeof(float));
  }
  ops::linear_backward(dx, g.kv_a, dkva.data(), x, p.kv_a, N, true);
}

void get_key_value_forward(float* key, float* value, const float* mla_kv, const float* k_pe,
                           const AttentionParams<ops::WeightView>& p, const StageConfig& s, int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t H = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, qk = nope + rope;
  const int64_t vd = c.v_head_dim;
  Buffer<float> kv(N * H * (nope + vd));
  ops::linear_forward(kv.data(), mla_kv, p.kv_b, N);
  to_activation_dtype(kv.data(), N * H * (nope + vd));  // key_proj and value_proj
  parallel_ranges(N, N * H * (qk + vd) >= (int64_t{1} << 14), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* src = &kv[(t * H + h) * (nope + vd)];
        float* k = key + (t * H + h) * qk;
        std::memcpy(k, src, nope * sizeof(float));
        std::memcpy(k + nope, k_pe + t * rope, rope * sizeof(float));
        std::memcpy(value + (t * H + h) * vd, src + nope, vd * sizeof(float));
      }
  });
}

void get_key_value_backward(float* d_mla_kv, float* dk_pe, AttentionParams<float*>& g, const float* dkey,
                            const float* dvalue, const float* mla_kv, const AttentionParams<ops::WeightView>& p,
                            const StageConfig& s, int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t H = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, qk = nope + rope;
  const int64_t vd = c.v_head_dim;
  Buffer<float> dkv(N * H * (nope + vd));
  for (int64_t t = 0; t < N; ++t) {
    float* dpe = dk_pe + t * rope;
    std::fill(dpe, dpe + rope, 0.0f);
    for (int64_t h = 0; h < H; ++h) {
      float* dst = &dkv[(t * H + h) * (nope + vd)];
      const float* dk = dkey + (t * H + h) * qk;
      std::memcpy(dst, dk, nope * sizeof(float));
      std::memcpy(dst + nope, dvalue + (t * H + h) * vd, vd * sizeof(float));
      for (int64_t i = 0; i < rope; ++i) dpe[i] += dk[nope + i];  // k_pe is shared by all heads
    }
  }
  ops::linear_backward(d_mla_kv, g.kv_b, dkv.data(), mla_kv, p.kv_b, N);
}

void out_projection_forward(float* out, const float* attention_out, const AttentionParams<ops::WeightView>& p,
                            int64_t N) {
  ops::linear_forward(out, attention_out, p.o, N);
  to_activation_dtype(out, N * p.o.rows);
}

void out_projection_backward(float* d_attention_out, AttentionParams<float*>& g, const float* dout,
                             const float* attention_out, const AttentionParams<ops::WeightView>& p, int64_t N) {
  ops::linear_backward(d_attention_out, g.o, dout, attention_out, p.o, N);
}

// ---------------------------------------------------------------- DSA indexer

void indexer_forward(const IndexerOut& out, const float* x, const float* mla_q, const IndexerParams<ops::WeightView>& p,
                     const StageConfig& s, const int32_t* positions, int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim, rope = c.qk_rope_head_dim;
  DS_CHECK(Hi > 0, "indexer_forward: the model has no indexer");
  Buffer<float> k(N * Di);
  ops::linear_forward(k.data(), x, p.wk, N);
  ops::layer_norm_rows(k.data(), k.data(), vector_data(p.k_norm), vector_data(p.k_norm_bias), N, Di, 1e-6f);
  ops::rope_forward(k.data(), k.data(), positions, s.rope_freqs.data(), N, 1, rope, Di, Di, ops::RopeLayout::HalfSplit);
  ops::hadamard_rows(k.data(), N, Di);
  ops::fp8_quantize_rows(out.key_codes, out.key_scales, k.data(), N, Di, c.index_scale_ue8m0);
  if (!out.query) return;
  ops::linear_forward(out.query, mla_q, p.wq_b, N);
  ops::rope_forward(out.query, out.query, positions, s.rope_freqs.data(), N, Hi, rope, Hi * Di, Di,
                    ops::RopeLayout::HalfSplit);
  ops::hadamard_rows(out.query, N * Hi, Di);
  Buffer<uint8_t> codes(N * Hi * Di);
  Buffer<float> scales(N * Hi * ops::indexer_scale_blocks(Di));
  ops::fp8_quantize_rows(codes.data(), scales.data(), out.query, N * Hi, Di, c.index_scale_ue8m0);
  ops::fp8_dequantize_rows(out.query, codes.data(), scales.data(), N * Hi, Di);
  ops::linear_forward(out.head_weights, x, p.weights_proj, N);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Hi * Di)));
  for (int64_t i = 0; i < N * Hi; ++i) out.head_weights[i] *= scale;
}

void indexer_train_forward(IndexerActs& a, const float* x, const float* mla_q, const IndexerParams<ops::WeightView>& p,
                           const StageConfig& s, const int32_t* positions, int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim, rope = c.qk_rope_head_dim;
  DS_CHECK(Hi > 0, "indexer_train_forward: the model has no indexer");
  a.k_lin.resize(N * Di);
  a.k.resize(N * Di);
  a.q.resize(N * Hi * Di);
  a.w.resize(N * Hi);
  ops::linear_forward(a.k_lin.data(), x, p.wk, N);
  ops::layer_norm_rows(a.k.data(), a.k_lin.data(), vector_data(p.k_norm), vector_data(p.k_norm_bias), N, Di, 1e-6f);
  ops::rope_forward(a.k.data(), a.k.data(), positions, s.rope_freqs.data(), N, 1, rope, Di, Di,
                    ops::RopeLayout::HalfSplit);
  ops::linear_forward(a.q.data(), mla_q, p.wq_b, N);
  ops::rope_forward(a.q.data(), a.q.data(), positions, s.rope_freqs.data(), N, Hi, rope, Hi * Di, Di,
                    ops::RopeLayout::HalfSplit);
  ops::linear_forward(a.w.data(), x, p.weights_proj, N);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Hi * Di)));
  for (int64_t i = 0; i < N * Hi; ++i) a.w[i] *= scale;
}

void indexer_train_backward(IndexerParams<float*>& g, const float* dq, const float* dk, const float* dw,
                            const IndexerActs& a, const float* x, const float* mla_q,
                            const IndexerParams<ops::WeightView>& p, const StageConfig& s, const int32_t* positions,
                            int64_t N) {
  const ModelConfig& c = *s.cfg;
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim, rope = c.qk_rope_head_dim;
  // Head weights.
  Buffer<float> t(N * Hi);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Hi * Di)));
  for (int64_t i = 0; i < N * Hi; ++i) t[i] = dw[i] * scale;
  ops::linear_backward(nullptr, g.weights_proj, t.data(), x, p.weights_proj, N);
  // Queries: through RoPE into wq_b.
  // (RoPE rotates the first `rope` dims of a head; the rest pass unchanged.)
  Buffer<float> dql(N * Hi * Di);
  std::memcpy(dql.data(), dq, static_cast<size_t>(N * Hi * Di) * sizeof(float));
  ops::rope_backward(dql.data(), dql.data(), positions, s.rope_freqs.data(), N, Hi, rope, Hi * Di, Di,
                     ops::RopeLayout::HalfSplit);
  ops::linear_backward(nullptr, g.wq_b, dql.data(), mla_q, p.wq_b, N);
  // The key: through RoPE, the LayerNorm (its scale and bias) into wk.
  Buffer<float> dkn(N * Di), dkl(N * Di);
  std::memcpy(dkn.data(), dk, static_cast<size_t>(N * Di) * sizeof(float));
  ops::rope_backward(dkn.data(), dkn.data(), positions, s.rope_freqs.data(), N, 1, rope, Di, Di,
                     ops::RopeLayout::HalfSplit);
  ops::layer_norm_backward(dkl.data(), g.k_norm, g.k_norm_bias, dkn.data(), a.k_lin.data(), vector_data(p.k_norm), N,
                           Di, 1e-6f);
  ops::linear_backward(nullptr, g.wk, dkl.data(), x, p.wk, N);
}

// ---------------------------------------------------------------- MLP

void mlp_forward(float* out, float* g, float* u, const float* x, const MlpParams<ops::WeightView>& p, int64_t N,
                 float swiglu_limit) {
  const int64_t I = p.gate.rows;
  // Without a place for the residual, the activation overwrites the gate's output.
  Buffer<float> gs, us, as;
  const bool keep_g = g != nullptr;
  if (!g) g = (gs.resize(N * I), gs.data());
  if (!u) u = (us.resize(N * I), us.data());
  ops::linear_forward_pair(g, p.gate, u, p.up, x, N);
  to_activation_dtype(g, N * I);
  to_activation_dtype(u, N * I);
  float* a = keep_g ? (as.resize(N * I), as.data()) : g;
  ops::silu_mul_forward(a, g, u, N * I, swiglu_limit);
  ops::linear_forward(out, a, p.down, N);
  to_activation_dtype(out, N * p.down.rows);
}

void mlp_backward(float* dx, MlpParams<float*>& gr, const float* dout, const float* g, const float* u, const float* x,
                  const MlpParams<ops::WeightView>& p, int64_t N, bool accumulate_dx, float swiglu_limit) {
  const int64_t I = p.gate.rows;
  Buffer<float> a(N * I), da(N * I), dg(N * I), du(N * I);
  ops::silu_mul_forward(a.data(), g, u, N * I, swiglu_limit);
  ops::linear_backward(da.data(), gr.down, dout, a.data(), p.down, N);
  ops::silu_mul_backward(dg.data(), du.data(), da.data(), g, u, N * I, swiglu_limit);
  ops::linear_backward(dx, gr.gate, dg.data(), x, p.gate, N, accumulate_dx);
  ops::linear_backward(dx, gr.up, du.data(), x, p.up, N, true);
}

// ---------------------------------------------------------------- MoE

void expert_selection_forward(Routing& r, const float* x, const MoeParams<ops::WeightView>& p, const StageConfig& s,
                              int64_t N) {
  const int64_t E = s.selection.num_experts, K = s.selection.k, n = N * K;
  r.tokens = N;
  r.k = K;
  r.logits.resize(N * E);
  r.scores.resize(N * E);
  r.experts.resize(n);
  r.weights.resize(n);
  {
    // The router's logits stay float32 whatever the run's dtype and
    // quantization: rounding its operands to bf16 would move a score by
    // about 2^-9 and flip the choice between experts whose scores are that
    // close (MaxText's fp8_full quantizes the gate too).
    const ops::ScopedFloat32Products f32;
    ops::linear_forward(r.logits.data(), x, p.router, N);
  }
  ops::expert_selection_forward(r.experts.data(), r.weights.data(), r.scores.data(), r.logits.data(),
                                vector_data(p.bias), N, s.selection);
  route(r, E);
}

void route(Routing& r, int64_t E) {
  // Dropless, sorted by expert (stable: ties keep assignment order).
  const int64_t n = r.tokens * r.k;
  r.order.resize(n);
  r.inverse.resize(n);
  r.sizes.assign(static_cast<size_t>(E), 0);
  ops::route_indices(r.order.data(), r.inverse.data(), r.sizes.data(), r.experts.data(), n, E);
}

void expert_selection_backward(float* dx, MoeParams<float*>& g, const float* dweights, float* dscores_extra,
                               const Routing& r, const float* x, const MoeParams<ops::WeightView>& p,
                               const StageConfig& s) {
  const int64_t N = r.tokens, E = s.selection.num_experts;
  Buffer<float> dlogits(N * E);
  ops::expert_selection_backward(dlogits.data(), dweights, r.scores.data(), r.experts.data(), N, s.selection);
  if (dscores_extra) {
    // A loss on the scores themselves (the balance loss): through the score function.
    Buffer<float> d(N * E);
    if (s.selection.scoring == ops::ExpertScoring::Sigmoid)
      ops::sigmoid_backward(d.data(), dscores_extra, r.scores.data(), N * E);
    else
      ops::softmax_backward(d.data(), dscores_extra, r.scores.data(), N, E);
    add_into(dlogits.data(), d.data(), N * E);
  }
  const ops::ScopedFloat32Products f32;  // as in the forward
  ops::linear_backward(dx, g.router, dlogits.data(), x, p.router, N, true);
}

namespace {

// Few tokens (decode): each expert's product is too small to split over
// the threads by itself, and one thread team per product costs more than the
// product. All the active experts' gate/up products become tasks of one
// parallel loop, their down products tasks of a second, each matrix cut in
// two row halves so the threads stay busy. Each product is computed whole by
// one thread, so the result does not depend on the thread count.
void experts_as_tasks(const ExpertOut& o, const float* xs, const float* x, const Routing& r,
                      const MoeParams<ops::WeightView>& m, int64_t D) {
  struct Job {
    const MlpParams<ops::WeightView>* mlp;
    const float* in;
    float* out;
    int64_t rows;
    float *g, *u;
    Buffer<float> gs, us;
  };
  std::vector<Job> jobs;
  int64_t off = 0, wi = 0;
  for (size_t e = 0; e < r.sizes.size(); ++e) {
    if (r.sizes[e] > 0)
      jobs.push_back({&m.experts[e], xs + off * D, o.ys + off * D, r.sizes[e], nullptr, nullptr, {}, {}});
    off += r.sizes[e];
  }
  const bool shared = m.shared.gate.data != nullptr;
  if (shared) jobs.push_back({&m.shared, x, o.shared_out, r.tokens, o.shared_mlpwi_0, o.shared_mlpwi_1, {}, {}});
  for (auto& j : jobs) {
    const int64_t I = j.mlp->gate.rows;
    if (j.mlp != &m.shared && o.moe_mlpwi_0) {
      j.g = o.moe_mlpwi_0 + wi * I;
      j.u = o.moe_mlpwi_1 + wi * I;
      wi += j.rows;
    }
    if (!j.g) j.g = (j.gs.resize(j.rows * I), j.gs.data());
    if (!j.u) j.u = (j.us.resize(j.rows * I), j.us.data());
  }
  // Split points on a 128-row boundary keep fp8 scale blocks whole.
  auto half = [](const ops::WeightView& w) {
    const int64_t step = w.scale_inv ? w.block_rows : 16;
    return (w.rows / 2) / step * step;
  };
  auto run_part = [](float* y, const float* in, const ops::WeightView& w, int64_t M, int64_t split, int part) {
    if (part == 1 && split == 0) return;  // too small to cut: part 0 does it all
    const int64_t r0 = part == 0 ? 0 : split, r1 = part == 0 && split > 0 ? split : w.rows;
    ops::linear_forward(y + r0, in, ops::row_slice(w, r0, r1), M, w.cols, w.rows);
  };
  const int64_t J = static_cast<int64_t>(jobs.size());
  std::vector<Buffer<float>> acts(jobs.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < J * 4; ++t) {
    Job& j = jobs[t / 4];
    const bool up = (t / 2) % 2, part = t % 2;
    const ops::WeightView& w = up ? j.mlp->up : j.mlp->gate;
    run_part(up ? j.u : j.g, j.in, w, j.rows, half(w), part);
  }
  for (int64_t i = 0; i < J; ++i) {
    const int64_t n = jobs[i].rows * jobs[i].mlp->gate.rows;
    to_activation_dtype(jobs[i].g, n);
    to_activation_dtype(jobs[i].u, n);
    acts[i].resize(n);
    ops::silu_mul_forward(acts[i].data(), jobs[i].g, jobs[i].u, n);
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < J * 2; ++t) {
    Job& j = jobs[t / 2];
    const ops::WeightView& w = j.mlp->down;
    run_part(j.out, acts[t / 2].data(), w, j.rows, half(w), t % 2);
  }
  for (const Job& j : jobs) to_activation_dtype(j.out, j.rows * D);
  if (!shared) std::fill(o.shared_out, o.shared_out + r.tokens * D, 0.0f);
}

// More tokens (prefill, training): each expert's rows, cut in chunks of at
// most kExpertTaskRows, are tasks of one parallel loop, each a whole MLP on
// one thread (largest first, taken dynamically). Threading every product of
// every expert instead costs a thread team, a packing of x and an uneven
// split per product, and at 32 rows per expert those dominated. A row's
// result does not depend on which thread computes it.
constexpr int64_t kExpertTaskRows = 128;

struct ExpertTask {
  const MlpParams<ops::WeightView>* mlp;
  int64_t expert;  // -1: shared
  int64_t row0;    // first row (of xs, or of x for the shared experts)
  int64_t rows;
};

std::vector<ExpertTask> expert_tasks(const Routing& r, const std::vector<int32_t>& sizes, bool shared,
                                     const MoeParams<ops::WeightView>& m) {
  std::vector<ExpertTask> tasks;
  auto add = [&](const MlpParams<ops::WeightView>* mlp, int64_t e, int64_t row0, int64_t n) {
    for (int64_t i = 0; i < n; i += kExpertTaskRows)
      tasks.push_back({mlp, e, row0 + i, std::min(kExpertTaskRows, n - i)});
  };
  if (shared) add(&m.shared, -1, 0, r.tokens);
  int64_t off = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    add(&m.experts[e], static_cast<int64_t>(e), off, sizes[e]);
    off += sizes[e];
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const ExpertTask& a, const ExpertTask& b) { return a.rows > b.rows; });
  return tasks;
}

void experts_in_row_tasks(const ExpertOut& o, const float* xs, const float* x, const Routing& r,
                          const std::vector<int32_t>& sizes, const MoeParams<ops::WeightView>& m, int64_t D) {
  const bool shared = m.shared.gate.data != nullptr;
  const auto tasks = expert_tasks(r, sizes, shared, m);
  const int64_t T = static_cast<int64_t>(tasks.size());
  parallel_tasks(T, true, [&](int64_t t) {
    const ExpertTask& k = tasks[static_cast<size_t>(t)];
    const int64_t I = k.mlp->gate.rows;
    if (k.expert < 0) {
      mlp_forward(o.shared_out + k.row0 * D, o.shared_mlpwi_0 ? o.shared_mlpwi_0 + k.row0 * I : nullptr,
                  o.shared_mlpwi_1 ? o.shared_mlpwi_1 + k.row0 * I : nullptr, x + k.row0 * D, *k.mlp, k.rows);
    } else {
      mlp_forward(o.ys + k.row0 * D, o.moe_mlpwi_0 ? o.moe_mlpwi_0 + k.row0 * I : nullptr,
                  o.moe_mlpwi_1 ? o.moe_mlpwi_1 + k.row0 * I : nullptr, xs + k.row0 * D, *k.mlp, k.rows);
    }
  });
  if (!shared) std::fill(o.shared_out, o.shared_out + r.tokens * D, 0.0f);
}

}  // namespace

void experts_forward(const ExpertOut& out, const float* xs, const float* x, const Routing& r,
                     const MoeParams<ops::WeightView>& p, const StageConfig& s, const std::vector<int32_t>* sizes) {
  const int64_t D = s.cfg->hidden_size;
  if (!sizes && r.tokens * r.k <= s.task_parallel_assignments)
    experts_as_tasks(out, xs, x, r, p, D);
  else
    experts_in_row_tasks(out, xs, x, r, sizes ? *sizes : r.sizes, p, D);
}

void experts_backward(float* dxs, float* dx, MoeParams<float*>& g, const float* dys, const float* dshared,
                      const float* moe_mlpwi_0, const float* moe_mlpwi_1, const float* shared_mlpwi_0,
                      const float* shared_mlpwi_1, const float* xs, const float* x, const Routing& r,
                      const MoeParams<ops::WeightView>& p, const StageConfig& s, const std::vector<int32_t>* sizes_in) {
  const int64_t D = s.cfg->hidden_size, I = s.cfg->moe_intermediate_size;
  const std::vector<int32_t>& sizes = sizes_in ? *sizes_in : r.sizes;
  // One task per expert (its weight gradients are sums over its rows, so a
  // task must own all of them to keep the sum's order fixed); the shared
  // experts' rows are summed in one task too.
  const bool shared = p.shared.gate.data != nullptr;
  struct Task {
    int64_t expert, row0, rows;
  };
  std::vector<Task> tasks;
  if (shared) tasks.push_back({-1, 0, r.tokens});
  int64_t off = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    if (sizes[e] > 0) tasks.push_back({static_cast<int64_t>(e), off, sizes[e]});
    off += sizes[e];
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.rows > b.rows; });
  Buffer<float> dshared_x;
  if (shared) dshared_x.resize(r.tokens * D);
  const int64_t T = static_cast<int64_t>(tasks.size());
  parallel_tasks(T, true, [&](int64_t t) {
    const Task& k = tasks[static_cast<size_t>(t)];
    if (k.expert < 0) {
      mlp_backward(dshared_x.data(), g.shared, dshared, shared_mlpwi_0, shared_mlpwi_1, x, p.shared, r.tokens, false);
    } else {
      mlp_backward(dxs + k.row0 * D, g.experts[k.expert], dys + k.row0 * D, moe_mlpwi_0 + k.row0 * I,
                   moe_mlpwi_1 + k.row0 * I, xs + k.row0 * D, p.experts[k.expert], k.rows, false);
    }
  });
  // Rows of experts nobody chose do not exist (n = sum of sizes), so dxs is complete.
  if (shared) add_into(dx, dshared_x.data(), r.tokens * D);
}

void combine_forward(float* out, const float* ys, const Routing& r, int64_t D, CombineOrder order) {
  const int64_t N = r.tokens, K = r.k;
  parallel_ranges(N, N * K * D >= (int64_t{1} << 16), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> rows(static_cast<size_t>(K));
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * D;
      if (order == CombineOrder::Assignments) {
        for (int64_t j = 0; j < K; ++j) {
          const float wj = r.weights[t * K + j];
          const float* y = ys + r.inverse[t * K + j] * D;
          for (int64_t d = 0; d < D; ++d) o[d] += wj * y[d];
        }
        continue;
      }
      // Sorted rows are expert-major: ascending rows are the experts' order.
      for (int64_t j = 0; j < K; ++j) rows[static_cast<size_t>(j)] = r.inverse[t * K + j];
      std::sort(rows.begin(), rows.end());
      for (const int64_t row : rows) {
        const float wj = r.weights[r.order[row]];
        const float* y = ys + row * D;
        for (int64_t d = 0; d < D; ++d) o[d] += wj * y[d];
      }
    }
  });
}

void combine_backward(float* dweights, float* dys, const float* dout, const float* ys, const Routing& r, int64_t D) {
  const int64_t N = r.tokens, K = r.k;
  parallel_ranges(N, N * K * D >= (int64_t{1} << 16), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const float wj = r.weights[t * K + j];
        const int64_t row = r.inverse[t * K + j];
        const float* y = ys + row * D;
        const float* d = dout + t * D;
        float* dy = dys + row * D;
        double dot = 0;
        for (int64_t i = 0; i < D; ++i) {
          dot += static_cast<double>(d[i]) * y[i];
          dy[i] = wj * d[i];
        }
        dweights[t * K + j] = static_cast<float>(dot);
      }
  });
}

}  // namespace ds::model
