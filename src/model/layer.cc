#include "model/layer.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/stage_times.h"
#include "model/mhc_block.h"
#include "model/staged.h"
#include "ops/attention.h"
#include "ops/fp8_quant.h"
#include "ops/indexer.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/routing.h"

namespace ds::model {

using R = Residual;

std::array<Buffer<float>*, LayerSaved::kHeld> LayerSaved::held_buffers() {
  return {&query_wa_proj, &mla_q,   &query_proj, &kv_wa_proj, &mla_kv,      &key_proj,    &value_proj, &attention_out,
          &out_proj,      &mlpwi_0, &mlpwi_1,    &mlpwo,      &moe_mlpwi_0, &moe_mlpwi_1, &moe_mlpwo};
}

void LayerSaved::hold_bf16() { ds::hold_bf16(held_buffers(), held_); }

void LayerSaved::widen() { ds::widen(held_buffers(), held_); }

size_t LayerSaved::bytes() const {
  size_t n = decoder_layer_input.bytes();
  for (const HeldFloats& h : held_) n += h.bytes();
  for (const Buffer<float>* b :
       {&query_wa_proj, &mla_q, &q_rstd, &query_proj, &kv_wa_proj, &mla_kv, &kv_rstd, &k_pe, &key_proj, &value_proj,
        &attention_out, &lse, &out_proj, &mlpwi_0, &mlpwi_1, &mlpwo, &moe_mlpwi_0, &moe_mlpwi_1, &moe_mlpwo})
    n += b->size() * sizeof(float);
  return n;
}

namespace {

// The balance loss's per-row statistics: f[e] = top-k hits of row b / T, and
// p(t) = softmax over experts of scores[t] + bias (MaxText's form).
void hits(std::vector<double>& f, const Routing& r, int64_t b, int64_t T) {
  std::fill(f.begin(), f.end(), 0.0);
  for (int64_t t = b * T; t < (b + 1) * T; ++t)
    for (int64_t j = 0; j < r.k; ++j) f[r.experts[t * r.k + j]] += 1.0 / T;
}
void probs(std::vector<double>& p, const Routing& r, const float* bias, int64_t t) {
  const int64_t E = static_cast<int64_t>(p.size());
  double mx = -INFINITY, z = 0;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double(r.scores[t * E + e]) + (bias ? bias[e] : 0.0));
  for (int64_t e = 0; e < E; ++e) z += (p[e] = std::exp(double(r.scores[t * E + e]) + (bias ? bias[e] : 0.0) - mx));
  for (int64_t e = 0; e < E; ++e) p[e] /= z;
}

}  // namespace

double balance_loss(const Routing& r, const float* bias, int64_t B, int64_t T, double w) {
  // loss = w * E^2 * mean_{b,e}(f * P), P[b,e] = mean over the row of p.
  const int64_t E = static_cast<int64_t>(r.sizes.size());
  double total = 0;
  std::vector<double> f(E), P(E), p(E);
  for (int64_t b = 0; b < B; ++b) {
    hits(f, r, b, T);
    std::fill(P.begin(), P.end(), 0.0);
    for (int64_t t = b * T; t < (b + 1) * T; ++t) {
      probs(p, r, bias, t);
      for (int64_t e = 0; e < E; ++e) P[e] += p[e] / T;
    }
    for (int64_t e = 0; e < E; ++e) total += f[e] * P[e];
  }
  return w * double(E) / double(B) * total;
}

namespace {

// d(balance loss)/d(scores) [N, E] scaled by dloss (the bias is a constant).
void balance_loss_backward(float* dscores, const Routing& r, const float* bias, int64_t B, int64_t T, double w,
                           double dloss) {
  const int64_t E = static_cast<int64_t>(r.sizes.size());
  // dL/dp_e = c f_e with c = dloss w E / (B T); then the softmax backward.
  const double c = dloss * w * double(E) / double(B) / double(T);
  std::vector<double> f(E), p(E);
  for (int64_t b = 0; b < B; ++b) {
    hits(f, r, b, T);
    for (int64_t t = b * T; t < (b + 1) * T; ++t) {
      probs(p, r, bias, t);
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += c * f[e] * p[e];
      for (int64_t e = 0; e < E; ++e) dscores[t * E + e] = static_cast<float>(p[e] * (c * f[e] - dot));
    }
  }
}

void norm_rows(float* y, float* rstd, const float* x, const ops::WeightView& w, int64_t N, const StageConfig& s) {
  ops::rmsnorm_forward(y, rstd, x, vector_data(w), N, w.rows, static_cast<float>(s.cfg->rms_norm_eps));
}

// The unnamed intermediates of a layer, always recomputed.
struct Scratch {
  Buffer<float> x, rstd1, h1, m, rstd2;  // attention input (normed h), h + out_proj, FFN input, norms' rstd
  // mHC (k > 1 streams): h1 is the streams after the attention [N, k, D];
  // each sub-layer's mixing, and the FFN's output (its post reads it).
  MhcState mhc_attn, mhc_mlp;
  Buffer<float> ffn_out;
  Routing routing;
  Buffer<float> xs;  // MoE: routed rows of m, sorted by expert
  // Expert parallelism: the exchange plan and the rows this rank's experts
  // compute (every rank's, sorted by expert).
  ExchangePlan plan;
  Buffer<float> xs_local;
  // DSA in training (the sparse stage, or the indexer loss): the indexer's
  // activations, its scores [B, T, T] and (sparse stage) the selected keys.
  IndexerActs indexer;
  Buffer<float> indexer_scores;
  Buffer<uint8_t> selected;
};

// Whether training runs layer `layer`'s indexer (a DSA main-decoder layer
// with the sparse stage or the indexer loss on).
bool trains_indexer(const StageConfig& s, int64_t layer) {
  return s.cfg->index_n_heads > 0 && layer < s.cfg->num_hidden_layers &&
         (s.indexer_sparse || s.indexer_loss_weight > 0);
}

// The indexer's activations and scores over the layout (and, in the sparse
// stage, its top-k keys), from the normed input and the q latent. The
// indexer runs in float32 whatever the run's dtype and quantization:
// MaxText keeps DeepSeek-V3.2's indexer weights projection in float32 for
// its precision (and its einsums outside fp8_full's rule), and the whole
// indexer (its projections, scores and KL loss) stays there with it here.
void run_indexer(Scratch& X, const float* mla_q, const IndexerParams<ops::WeightView>& p, const StageConfig& s,
                 const TokenLayout& layout) {
  const ops::ScopedFloat32Products f32;
  const ModelConfig& c = *s.cfg;
  const int64_t B = layout.batch, T = layout.seq, N = layout.tokens();
  indexer_train_forward(X.indexer, X.x.data(), mla_q, p, s, layout.positions, N);
  X.indexer_scores.resize(B * T * T);
  ops::indexer_dense_scores(X.indexer_scores.data(), X.indexer.q.data(), X.indexer.k.data(), X.indexer.w.data(),
                            layout.segment_ids, B, T, c.index_n_heads, c.index_head_dim);
  if (s.indexer_sparse) {
    X.selected.resize(B * T * T);
    ops::indexer_select(X.selected.data(), X.indexer_scores.data(), B, T, c.index_topk);
  }
}

bool need(const Buffer<float>& b) { return b.empty(); }

// The residual around the sub-layers: h itself, or with mHC (model/mhc_block.h)
// its k streams, which the sub-layers read through each module's pre mix.
// The attention's input (before its norm): h, or the pre mix of h.
const float* attention_input(Scratch& X, const float* h, const LayerView& p, const ModelConfig& c, int64_t N) {
  if (!c.has_mhc()) return h;
  StageTimer t(Stage::kNorm);
  mhc_block_pre(X.mhc_attn, h, p.mhc_attn, c, N);
  return X.mhc_attn.a.data();
}
// X.h1 = h + out_proj (with mHC: the post mix of h and out_proj); returns the
// FFN's input (before its norm): h1, or the pre mix of h1.
const float* after_attention(Scratch& X, const float* h, const float* out_proj, const LayerView& p,
                             const ModelConfig& c, int64_t N) {
  X.h1.resize(N * c.residual_width());
  if (!c.has_mhc()) {
    parallel_add(X.h1.data(), h, out_proj, N * c.hidden_size);
    return X.h1.data();
  }
  StageTimer t(Stage::kNorm);
  mhc_block_post(X.h1.data(), out_proj, h, X.mhc_attn, c, N);
  mhc_block_pre(X.mhc_mlp, X.h1.data(), p.mhc_mlp, c, N);
  return X.mhc_mlp.a.data();
}
// The layer's output h2 = h1 + the FFN's output (with mHC: their post mix).
// h_out may be the layer's input, never X.h1.
void after_ffn(float* h_out, const Scratch& X, const ModelConfig& c, int64_t N) {
  if (!c.has_mhc()) {
    parallel_add(h_out, X.h1.data(), X.ffn_out.data(), N * c.hidden_size);
    return;
  }
  StageTimer t(Stage::kNorm);
  mhc_block_post(h_out, X.ffn_out.data(), X.h1.data(), X.mhc_mlp, c, N);
}

// MLA's projections of the normed input X.x, those missing: the query
// (through the q latent with q-LoRA), and the kv latent with its RoPE part.
void mla_projections(LayerSaved& S, const Scratch& X, const AttentionParams<ops::WeightView>& a, const StageConfig& s,
                     const TokenLayout& layout) {
  const ModelConfig& c = *s.cfg;
  const int64_t N = layout.tokens(), H = c.num_attention_heads;
  const int64_t qk = c.qk_head_dim(), kvl = c.kv_lora_rank, rope = c.qk_rope_head_dim;
  const bool q_latent = c.q_lora_rank > 0 && (need(S.query_wa_proj) || need(S.mla_q) || need(S.q_rstd));
  if (q_latent || need(S.query_proj)) {
    if (q_latent) {
      S.query_wa_proj.resize(N * c.q_lora_rank);
      S.mla_q.resize(N * c.q_lora_rank);
      S.q_rstd.resize(N);
    }
    const bool q = need(S.query_proj);
    if (q) S.query_proj.resize(N * H * qk);
    QueryOut o{S.query_proj.data(), S.query_wa_proj.data(), S.mla_q.data(), S.q_rstd.data(), q_latent, q};
    StageTimer t(Stage::kQueryProj);
    query_projection_forward(o, X.x.data(), a, s, layout.positions, N);
  }
  if (need(S.kv_wa_proj) || need(S.mla_kv) || need(S.kv_rstd) || need(S.k_pe)) {
    const bool project = need(S.kv_wa_proj);
    S.kv_wa_proj.resize(N * (kvl + rope));
    S.mla_kv.resize(N * kvl);
    S.kv_rstd.resize(N);
    S.k_pe.resize(N * rope);
    StageTimer t(Stage::kKvProj);
    kv_projection_forward({S.kv_wa_proj.data(), S.mla_kv.data(), S.kv_rstd.data(), S.k_pe.data(), project}, X.x.data(),
                          a, s, layout.positions, N);
  }
}

// The attention's output and out_proj, those missing: in generation through
// the KV cache, in training over the layout (DSA's sparse stage: over the
// indexer's top-k keys).
void mla_attention(LayerSaved& S, Scratch& X, const AttentionParams<ops::WeightView>& a, int64_t layer,
                   const StageConfig& s, const TokenLayout& layout, KvAttention* kv, bool forward) {
  const ModelConfig& c = *s.cfg;
  const int64_t N = layout.tokens(), D = c.hidden_size, H = c.num_attention_heads;
  const int64_t qk = c.qk_head_dim(), vd = c.v_head_dim;
  const bool attention_missing = need(S.attention_out) || (!kv && need(S.lse));
  // Training a DSA layer: the indexer runs before the attention (the sparse
  // stage masks it with the top-k; a backward also needs the scores for the
  // indexer loss).
  if (!kv && trains_indexer(s, layer) && (s.indexer_sparse || !forward))
    run_indexer(X, S.mla_q.data(), a.indexer, s, layout);
  const uint8_t* selected = X.selected.empty() ? nullptr : X.selected.data();
  if (StageTimer t(Stage::kAttention); kv) {
    if (attention_missing) {
      S.attention_out.resize(N * H * vd);
      const AttentionInputs in{S.query_proj.data(), S.mla_kv.data(), S.k_pe.data(), X.x.data(),
                               c.q_lora_rank > 0 ? S.mla_q.data() : nullptr};
      kv->attend(S.attention_out.data(), layer, in, a, s);
      to_activation_dtype(S.attention_out.data(), N * H * vd);
    }
  } else {
    if ((need(S.key_proj) || need(S.value_proj))) {
      S.key_proj.resize(N * H * qk);
      S.value_proj.resize(N * H * vd);
      get_key_value_forward(S.key_proj.data(), S.value_proj.data(), S.mla_kv.data(), S.k_pe.data(), a, s, N);
    }
    if (attention_missing) {
      S.attention_out.resize(N * H * vd);
      S.lse.resize(N * H);
      ops::AttentionDims d{layout.batch, layout.seq, H, qk, vd, s.softmax_scale};
      ops::attention_forward(S.attention_out.data(), S.lse.data(), S.query_proj.data(), S.key_proj.data(),
                             S.value_proj.data(), layout.segment_ids, d, selected);
      to_activation_dtype(S.attention_out.data(), N * H * vd);
    }
  }
  if (need(S.out_proj)) {
    S.out_proj.resize(N * D);
    StageTimer t(Stage::kOutProj);
    out_projection_forward(S.out_proj.data(), S.attention_out.data(), a, N);
  }
}

// What a layer's FFN computes.
struct FfnWork {
  bool output;         // its output, into X.ffn_out
  bool shared;         // a dense MLP, or shared experts
  bool dense_missing;  // and their mlpwi_0 / mlpwi_1 are missing
  bool residuals;      // keep the residuals (generation keeps none)
};

// The dense MLP's output, or on a recompute its missing residuals.
void dense_mlp(LayerSaved& S, Scratch& X, const MlpParams<ops::WeightView>& mlp, int64_t N, const FfnWork& f) {
  StageTimer t(Stage::kDenseMlp);
  if (f.output) {
    mlp_forward(X.ffn_out.data(), f.residuals ? S.mlpwi_0.data() : nullptr, f.residuals ? S.mlpwi_1.data() : nullptr,
                X.m.data(), mlp, N);
  } else if (f.dense_missing) {
    ops::linear_forward(S.mlpwi_0.data(), X.m.data(), mlp.gate, N);
    ops::linear_forward(S.mlpwi_1.data(), X.m.data(), mlp.up, N);
    to_activation_dtype(S.mlpwi_0.data(), static_cast<int64_t>(S.mlpwi_0.size()));
    to_activation_dtype(S.mlpwi_1.data(), static_cast<int64_t>(S.mlpwi_1.size()));
  }
}

// The MoE FFN: the routing, then the routed experts and the shared ones;
// its output, or on a recompute the missing residuals, and the load and
// balance loss when asked. A Staged coroutine: with expert parallelism it
// pauses while the rows travel to their experts' ranks and back.
Staged moe_ffn(LayerSaved& S, Scratch& X, const MoeParams<ops::WeightView>& moe, const StageConfig& s,
               const TokenLayout& layout, FfnWork f, std::vector<int64_t>* load, double* lb_loss) {
  const ModelConfig& c = *s.cfg;
  const int64_t N = layout.tokens(), D = c.hidden_size;
  Routing& r = X.routing;
  StageTimer routing(Stage::kRouting);
  expert_selection_forward(r, X.m.data(), moe, s, N);
  const int64_t n = N * r.k, Ie = c.moe_intermediate_size;
  X.xs.resize(n * D);
  ops::route_forward(X.xs.data(), X.m.data(), r.order.data(), N, r.k, D);
  routing.stop();
  // Expert parallelism: the rows travel to their experts' ranks (and, in a
  // backward, again, since the plan and these rows are scratch).
  TokenExchange* ex = s.exchange;
  int64_t n_here = n;
  if (ex) {
    ex->plan(X.plan, r.sizes);
    n_here = X.plan.local_rows;
    X.xs_local.resize(n_here * D);
    auto moved = ex->start_dispatch(X.xs_local.data(), X.xs.data(), X.plan, D, false);
    co_await Pending{&moved};
  }
  const bool experts_missing = need(S.moe_mlpwi_0) || need(S.moe_mlpwi_1) || need(S.moe_mlpwo);
  if (f.output || experts_missing || f.dense_missing) {
    // Generation keeps no residuals: the experts' intermediates stay in per-task scratch.
    const bool residuals = f.residuals, shared = f.shared;
    if (residuals) {
      S.moe_mlpwi_0.resize(n_here * Ie);
      S.moe_mlpwi_1.resize(n_here * Ie);
    }
    S.moe_mlpwo.resize(n * D);
    Buffer<float> shared_out(N * D), ys_here;
    if (ex) ys_here.resize(n_here * D);
    ExpertOut o{ex ? ys_here.data() : S.moe_mlpwo.data(),         shared_out.data(),
                residuals ? S.moe_mlpwi_0.data() : nullptr,       residuals ? S.moe_mlpwi_1.data() : nullptr,
                shared && residuals ? S.mlpwi_0.data() : nullptr, shared && residuals ? S.mlpwi_1.data() : nullptr};
    {
      StageTimer t(Stage::kExperts);
      experts_forward(o, ex ? X.xs_local.data() : X.xs.data(), X.m.data(), r, moe, s,
                      ex ? &X.plan.local_sizes : nullptr);
    }
    if (ex) {
      auto back = ex->start_undispatch(S.moe_mlpwo.data(), ys_here.data(), X.plan, D);
      co_await Pending{&back};
    }
    if (f.output) {
      StageTimer t(Stage::kCombine);
      X.ffn_out.swap(shared_out);  // the shared experts' output, plus the routed ones'
      combine_forward(X.ffn_out.data(), S.moe_mlpwo.data(), r, D);
    }
  }
  if (load) load->assign(r.sizes.begin(), r.sizes.end());
  if (lb_loss && s.load_balance_loss_weight > 0)
    *lb_loss = balance_loss(r, vector_data(moe.bias), layout.batch, layout.seq, s.load_balance_loss_weight);
}

// Computes every residual of `S` that is empty (all of them on a forward)
// plus the scratch. With h_out, also the layer output h2 (forward); h_out
// may be h, which is last read when h1 is formed. The
// residuals that only a forward needs (out_proj after h1 exists, mlpwo) are
// skipped on a recompute.
// A Staged coroutine: it pauses at the expert exchange while its rows travel.
Staged run_layer(LayerSaved& S, Scratch& X, float* h_out, const float* h, const LayerView& p, int64_t layer,
                 const StageConfig& s, const TokenLayout& layout, KvAttention* kv, std::vector<int64_t>* load,
                 double* lb_loss, bool residuals) {
  const ModelConfig& c = *s.cfg;
  const int64_t N = layout.tokens(), D = c.hidden_size;
  const bool forward = h_out != nullptr;
  // With mHC the sub-layers read the pre mix of the k streams, and the
  // backward needs the FFN's output too (its post's gradient reads it).
  const bool ffn_output = forward || c.has_mhc();
  const float* attn_in = attention_input(X, h, p, c, N);
  X.x.resize(N * D);
  X.rstd1.resize(N);
  {
    StageTimer t(Stage::kNorm);
    norm_rows(X.x.data(), X.rstd1.data(), attn_in, p.input_norm, N, s);
  }

  // MLA
  mla_projections(S, X, p.attn, s, layout);
  mla_attention(S, X, p.attn, layer, s, layout, kv, forward);
  const float* ffn_in = after_attention(X, h, S.out_proj.data(), p, c, N);
  X.m.resize(N * D);
  X.rstd2.resize(N);
  {
    StageTimer t(Stage::kNorm);
    norm_rows(X.m.data(), X.rstd2.data(), ffn_in, p.post_attention_norm, N, s);
  }

  // FFN
  if (ffn_output) X.ffn_out.resize(N * D);
  const bool moe = c.is_moe_layer(layer);
  const bool shared = !moe || c.n_shared_experts > 0;
  const int64_t I = !moe ? c.intermediate_size : c.moe_intermediate_size * c.n_shared_experts;
  // Dense MLP or shared experts: mlpwi_0 / mlpwi_1 (mlpwo only feeds the output).
  const bool dense_missing = shared && (need(S.mlpwi_0) || need(S.mlpwi_1));
  if (shared && dense_missing && residuals) {
    S.mlpwi_0.resize(N * I);
    S.mlpwi_1.resize(N * I);
  }
  const FfnWork f{ffn_output, shared, dense_missing, residuals};
  if (!moe)
    dense_mlp(S, X, p.mlp, N, f);
  else
    co_await moe_ffn(S, X, p.moe, s, layout, f, load, lb_loss);
  if (forward) after_ffn(h_out, X, c, N);
  co_return;
}

// Engram before a layer's attention: the rows' hash ids and sequences.
struct EngramRun {
  std::vector<int32_t> ids;  // [N, C]
  std::vector<EngramSegment> segs;
  EngramActs acts;
};

void engram_prepare(EngramRun& e, int64_t layer, const StageConfig& s, const TokenLayout& layout, KvAttention* kv) {
  const ModelConfig& c = *s.cfg;
  const int64_t N = layout.tokens(), C = c.engram_columns();
  DS_CHECK(layout.ids, "internal: Engram layer {} without the token ids", layer);
  const EngramLayerHash& t = s.engram_table(layer);
  // With engram_compress_tokens the hashes read token classes.
  const std::vector<int32_t>* classes = c.engram_token_classes.get();
  auto cls = [&](int32_t tok) { return classes ? (*classes)[static_cast<size_t>(tok)] : tok; };
  const auto pad = cls(static_cast<int32_t>(c.engram_pad_id));
  std::vector<int32_t> mapped;
  const int32_t* tokens = layout.ids;
  if (classes) {
    mapped.resize(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) mapped[i] = cls(layout.ids[i]);
    tokens = mapped.data();
  }
  e.ids.resize(static_cast<size_t>(N * C));
  e.segs.clear();
  if (layout.sequences) {
    const auto& seqs = *layout.sequences;
    const int64_t back = c.engram_max_ngram_size - 1;
    std::vector<int32_t> hist(static_cast<size_t>(back));
    for (size_t i = 0; i < seqs.size(); ++i) {
      const SequenceRows& q = seqs[i];
      if (q.history)
        for (int64_t j = 0; j < back; ++j) hist[j] = cls(q.history[j]);
      engram_hash_ids(e.ids.data() + q.row0 * C, tokens + q.row0, 1, q.count, q.history ? hist.data() : nullptr, pad,
                      t, c.engram_max_ngram_size, c.engram_num_heads);
      e.segs.push_back({q.row0, q.count, kv ? kv->engram_history(layer, static_cast<int64_t>(i)) : nullptr});
    }
  } else {
    engram_hash_ids(e.ids.data(), tokens, layout.batch, layout.seq, nullptr, pad, t, c.engram_max_ngram_size,
                    c.engram_num_heads);
    for (int64_t b = 0; b < layout.batch; ++b) e.segs.push_back({b * layout.seq, layout.seq, nullptr});
  }
}

// h += Engram's output (layers in engram_layers); generation keeps the
// conv's input rows of the new tokens in its cache.
void engram_step(float* h, const LayerView& p, int64_t layer, const StageConfig& s, const TokenLayout& layout,
                 KvAttention* kv) {
  if (!s.cfg->has_engram(layer)) return;
  StageTimer t(Stage::kEngram);
  EngramRun e;
  engram_prepare(e, layer, s, layout, kv);
  engram_forward(h, e.ids.data(), p.engram, s.engram, e.segs, layout.tokens(), kv ? &e.acts : nullptr);
  if (kv)
    for (size_t i = 0; i < e.segs.size(); ++i)
      kv->engram_keep(layer, static_cast<int64_t>(i), e.acts.n.data() + e.segs[i].row0 * s.engram.width(),
                      e.segs[i].count);
}

// Frees what the policy does not keep.
void drop(LayerSaved& S, const RematPolicy& keep) {
  auto drop_unless = [](Buffer<float>& b, bool kept) {
    if (!kept) Buffer<float>().swap(b);
  };
  if (!keep.kept(R::decoder_layer_input)) S.decoder_layer_input.clear();
  drop_unless(S.query_wa_proj, keep.kept(R::query_wa_proj));
  drop_unless(S.mla_q, keep.kept(R::mla_q));
  drop_unless(S.q_rstd, keep.kept(R::mla_q));
  drop_unless(S.query_proj, keep.kept(R::query_proj));
  drop_unless(S.kv_wa_proj, keep.kept(R::kv_wa_proj));
  drop_unless(S.mla_kv, keep.kept(R::mla_kv));
  drop_unless(S.kv_rstd, keep.kept(R::mla_kv));
  drop_unless(S.k_pe, false);  // unnamed: from kv_wa_proj
  drop_unless(S.key_proj, keep.kept(R::key_proj));
  drop_unless(S.value_proj, keep.kept(R::value_proj));
  drop_unless(S.attention_out, keep.kept(R::attention_out) || keep.kept(R::context));
  drop_unless(S.lse, keep.kept(R::context));
  drop_unless(S.out_proj, keep.kept(R::out_proj));
  drop_unless(S.mlpwi_0, keep.kept(R::mlpwi_0));
  drop_unless(S.mlpwi_1, keep.kept(R::mlpwi_1));
  drop_unless(S.mlpwo, keep.kept(R::mlpwo));
  drop_unless(S.moe_mlpwi_0, keep.kept(R::moe_mlpwi_0) || keep.kept(R::mlpwi_0));
  drop_unless(S.moe_mlpwi_1, keep.kept(R::moe_mlpwi_1));
  drop_unless(S.moe_mlpwo, keep.kept(R::moe_mlpwo) || keep.kept(R::mlpwo));
}

}  // namespace

double saved_bytes_per_token(const ModelConfig& c, int64_t mtp_layers, const RematPolicy& keep, bool bf16) {
  const double held = bf16 ? 2.0 : 4.0, H = static_cast<double>(c.num_attention_heads);
  const double qk = static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim),
               vd = static_cast<double>(c.v_head_dim);
  const double D = static_cast<double>(c.hidden_size), kvl = static_cast<double>(c.kv_lora_rank);
  const double ql = static_cast<double>(c.q_lora_rank), rope = static_cast<double>(c.qk_rope_head_dim);
  // Values of each kept name, as drop() keeps them, and their float32 extras.
  auto k = [&](Residual r) { return keep.kept(r) ? 1.0 : 0.0; };
  const double attn =
      held * (k(R::query_wa_proj) * ql + k(R::mla_q) * ql + k(R::query_proj) * H * qk +
              k(R::kv_wa_proj) * (kvl + rope) + k(R::mla_kv) * kvl + k(R::key_proj) * H * qk +
              k(R::value_proj) * H * vd + std::max(k(R::attention_out), k(R::context)) * H * vd + k(R::out_proj) * D) +
      4.0 * ((ql > 0 ? k(R::mla_q) : 0.0) + k(R::mla_kv) + k(R::context) * H);
  double total = 0;
  for (int64_t l = 0; l < c.num_hidden_layers + mtp_layers; ++l) {
    double mlp = 0;
    if (c.is_moe_layer(l)) {
      const double I = static_cast<double>(c.moe_intermediate_size), K = static_cast<double>(c.num_experts_per_tok);
      const double shared = static_cast<double>(c.n_shared_experts) * I;
      mlp = shared * (k(R::mlpwi_0) + k(R::mlpwi_1)) +
            K * I * (std::max(k(R::moe_mlpwi_0), k(R::mlpwi_0)) + k(R::moe_mlpwi_1)) +
            K * D * std::max(k(R::moe_mlpwo), k(R::mlpwo));
    } else {
      const double I = static_cast<double>(c.intermediate_size);
      mlp = I * (k(R::mlpwi_0) + k(R::mlpwi_1));  // the products' output (mlpwo) is not kept
    }
    total += held * (k(R::decoder_layer_input) * static_cast<double>(c.residual_width()) + mlp) + attn;
  }
  return total;
}

void layer_forward(float* h, const LayerView& p, int64_t layer, const StageConfig& s, const TokenLayout& layout,
                   KvAttention* kv, LayerSaved* saved, const RematPolicy& keep, LayerStats* stats) {
  const int64_t N = layout.tokens(), W = s.cfg->residual_width();
  LayerSaved local;
  LayerSaved& S = saved ? *saved : local;
  S = LayerSaved{};
  const bool bf16 = bf16_activations();
  if (bf16) round_to_bf16(h, static_cast<size_t>(N * W));
  if (saved) S.decoder_layer_input.keep(h, N * W, bf16);  // before Engram: its backward recomputes it
  engram_step(h, p, layer, s, layout, kv);
  Scratch X;
  // In place: run_layer reads h only before it writes the output.
  run_staged(run_layer(S, X, h, h, p, layer, s, layout, kv, stats ? &stats->load : nullptr,
                       stats ? &stats->lb_loss : nullptr, saved != nullptr));
  if (bf16) round_to_bf16(h, static_cast<size_t>(N * W));
  if (saved) drop(S, keep);
  if (saved && bf16) S.hold_bf16();
}

namespace {

// Rows [i B/M, (i + 1) B/M) of a layout.
std::vector<TokenLayout> split_layout(const TokenLayout& layout, int64_t M) {
  DS_CHECK(M >= 1 && layout.batch % M == 0, "batch_split_factor {} does not divide the {} rows of a batch", M,
           layout.batch);
  std::vector<TokenLayout> parts;
  const int64_t b = layout.batch / M, n = b * layout.seq;
  for (int64_t i = 0; i < M; ++i)
    parts.push_back({b, layout.seq, layout.positions ? layout.positions + i * n : nullptr,
                     layout.segment_ids ? layout.segment_ids + i * n : nullptr, layout.ids ? layout.ids + i * n : nullptr,
                     nullptr});
  return parts;
}

}  // namespace

void layer_forward_split(float* h, const LayerView& p, int64_t layer, const StageConfig& s, const TokenLayout& layout,
                         std::vector<LayerSaved>& saved, const RematPolicy& keep, LayerStats* stats) {
  const int64_t M = static_cast<int64_t>(saved.size()), W = s.cfg->residual_width();
  const auto parts = split_layout(layout, M);
  const int64_t n = parts[0].tokens();
  std::vector<Scratch> X(static_cast<size_t>(M));
  std::vector<LayerStats> st(static_cast<size_t>(M));
  std::vector<Staged> tasks;
  const bool bf16 = bf16_activations();
  if (bf16) round_to_bf16(h, static_cast<size_t>(M * n * W));
  for (int64_t i = 0; i < M; ++i) {
    float* hi = h + i * n * W;
    saved[i] = LayerSaved{};
    saved[i].decoder_layer_input.keep(hi, n * W, bf16);
    engram_step(hi, p, layer, s, parts[i], nullptr);
    tasks.push_back(
        run_layer(saved[i], X[i], hi, hi, p, layer, s, parts[i], nullptr, &st[i].load, &st[i].lb_loss, true));
  }
  run_interleaved(tasks, layer, false);
  if (bf16) round_to_bf16(h, static_cast<size_t>(M * n * W));
  for (auto& S : saved) {
    drop(S, keep);
    if (bf16) S.hold_bf16();
  }
  if (stats) {
    // Loads add up; the balance loss is a mean over rows, so over the parts too.
    *stats = LayerStats{};
    for (const auto& x : st) {
      if (stats->load.empty()) stats->load.assign(x.load.size(), 0);
      for (size_t e = 0; e < x.load.size(); ++e) stats->load[e] += x.load[e];
      stats->lb_loss += x.lb_loss / static_cast<double>(M);
    }
  }
}

namespace {

// The DSA indexer's loss over `layout`, from the scores run_layer left in X
// and the attention's distribution over the keys (from the recomputed
// query_proj and key_proj; in the sparse stage both over the selected keys
// only), all detached: the sum over the queries of the KL; its gradient,
// times s.indexer_loss_weight, added into the indexer's weights.
double indexer_loss_backward(IndexerParams<float*>& g, const LayerSaved& S, const Scratch& X,
                             const IndexerParams<ops::WeightView>& p, const StageConfig& s, const TokenLayout& layout) {
  const ops::ScopedFloat32Products f32;  // see run_indexer
  const ModelConfig& c = *s.cfg;
  const int64_t B = layout.batch, T = layout.seq, N = layout.tokens();
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim, H = c.num_attention_heads;
  const uint8_t* selected = X.selected.empty() ? nullptr : X.selected.data();
  const IndexerActs& a = X.indexer;
  Buffer<float> target(B * T * T), dscores(B * T * T);
  ops::attention_key_distribution(target.data(), S.query_proj.data(), S.key_proj.data(), layout.segment_ids, selected,
                                  B, T, H, c.qk_head_dim(), s.softmax_scale);
  const double kl =
      ops::indexer_kl(dscores.data(), X.indexer_scores.data(), target.data(), selected, B, T, s.indexer_loss_weight);
  Buffer<float> dq(N * Hi * Di), dk(N * Di), dw(N * Hi);
  ops::indexer_dense_scores_backward(dq.data(), dk.data(), dw.data(), dscores.data(), a.q.data(), a.k.data(),
                                     a.w.data(), layout.segment_ids, B, T, Hi, Di);
  indexer_train_backward(g, dq.data(), dk.data(), dw.data(), a, X.x.data(), S.mla_q.data(), p, s, layout.positions, N);
  return kl;
}

Staged layer_backward_task(float* dh, LayerGrads& g, LayerSaved& S, const LayerView& p, int64_t layer,
                           const StageConfig& s, const TokenLayout& layout, double dloss_lb, double* indexer_loss) {
  const ModelConfig& c = *s.cfg;
  const int64_t N = layout.tokens(), D = c.hidden_size, H = c.num_attention_heads;
  const int64_t qk = c.qk_head_dim(), vd = c.v_head_dim, kvl = c.kv_lora_rank, rope = c.qk_rope_head_dim;
  DS_CHECK(static_cast<int64_t>(S.decoder_layer_input.size()) == N * c.residual_width(),
           "internal: layer {} backward without its decoder_layer_input", layer);
  S.widen();
  Buffer<float> h_wide;  // the layer input widened from bf16
  const float* const h_in = S.decoder_layer_input.values(h_wide);
  const float* h = h_in;
  // Engram: the sub-layers read its output h + o, recomputed here.
  EngramRun engram;
  Buffer<float> h_engram;
  const bool has_engram = c.has_engram(layer);
  if (has_engram) {
    h_engram.assign(h, h + N * c.residual_width());
    engram_prepare(engram, layer, s, layout, nullptr);
    engram_forward(h_engram.data(), engram.ids.data(), p.engram, s.engram, engram.segs, N, &engram.acts);
    h = h_engram.data();
  }
  Scratch X;
  co_await run_layer(S, X, nullptr, h, p, layer, s, layout, nullptr, nullptr, nullptr, true);
  if (s.indexer_loss_weight > 0 && trains_indexer(s, layer)) {
    const double kl = indexer_loss_backward(g.attn.indexer, S, X, p.attn.indexer, s, layout);
    if (indexer_loss) *indexer_loss += kl;
  }

  // FFN: dh holds dL/dh2 = dL/d(ffn_out) = the residual's share of dL/dh1.
  // With mHC, dh is dL/d(streams out) [N, k, D]: the post's backward gives
  // dL/d(ffn_out) and the direct share of dL/dh1 (dh1, finished by the pre's).
  const bool mhc = c.has_mhc();
  Buffer<float> dffn_mhc, dh1;
  MhcGrad mix_attn, mix_mlp;
  if (mhc) {
    dffn_mhc.resize(N * D);
    dh1.resize(N * c.residual_width());
    std::fill(dh1.begin(), dh1.end(), 0.0f);
    mhc_block_post_backward(dffn_mhc.data(), dh1.data(), mix_mlp, dh, X.ffn_out.data(), X.h1.data(), X.mhc_mlp, c, N);
  }
  const float* dffn = mhc ? dffn_mhc.data() : dh;
  Buffer<float> dm(N * D);
  const bool moe = c.is_moe_layer(layer);
  if (!moe) {
    mlp_backward(dm.data(), g.mlp, dffn, S.mlpwi_0.data(), S.mlpwi_1.data(), X.m.data(), p.mlp, N, false);
  } else {
    const Routing& r = X.routing;
    const int64_t n = N * r.k, E = c.n_routed_experts;
    Buffer<float> dweights(n), dys(n * D), dxs(n * D);
    combine_backward(dweights.data(), dys.data(), dffn, S.moe_mlpwo.data(), r, D);
    std::fill(dm.begin(), dm.end(), 0.0f);
    const bool shared = c.n_shared_experts > 0;
    if (TokenExchange* ex = s.exchange) {
      // The expert compute's backward runs where its forward ran: dys goes
      // to the experts' ranks, dxs comes back.
      const int64_t nl = X.plan.local_rows;
      Buffer<float> dys_here(nl * D), dxs_here(nl * D);
      auto moved = ex->start_dispatch(dys_here.data(), dys.data(), X.plan, D, true);
      co_await Pending{&moved};
      experts_backward(dxs_here.data(), dm.data(), g.moe, dys_here.data(), shared ? dffn : nullptr,
                       S.moe_mlpwi_0.data(), S.moe_mlpwi_1.data(), shared ? S.mlpwi_0.data() : nullptr,
                       shared ? S.mlpwi_1.data() : nullptr, X.xs_local.data(), X.m.data(), r, p.moe, s,
                       &X.plan.local_sizes);
      auto back = ex->start_undispatch(dxs.data(), dxs_here.data(), X.plan, D);
      co_await Pending{&back};
    } else {
      experts_backward(dxs.data(), dm.data(), g.moe, dys.data(), shared ? dffn : nullptr, S.moe_mlpwi_0.data(),
                       S.moe_mlpwi_1.data(), shared ? S.mlpwi_0.data() : nullptr, shared ? S.mlpwi_1.data() : nullptr,
                       X.xs.data(), X.m.data(), r, p.moe, s);
    }
    Buffer<float> dm_routed(N * D);
    ops::route_backward(dm_routed.data(), dxs.data(), r.inverse.data(), N, r.k, D);
    for (int64_t i = 0; i < N * D; ++i) dm[i] += dm_routed[i];
    Buffer<float> dscores;
    if (s.load_balance_loss_weight > 0 && dloss_lb != 0) {
      dscores.resize(N * E);
      balance_loss_backward(dscores.data(), r, vector_data(p.moe.bias), layout.batch, layout.seq,
                            s.load_balance_loss_weight, dloss_lb);
    }
    expert_selection_backward(dm.data(), g.moe, dweights.data(), dscores.empty() ? nullptr : dscores.data(), r,
                              X.m.data(), p.moe, s);
  }
  Buffer<float> dattn_mhc;
  if (mhc) {
    // dh1 += mhc_pre'(norm'(dm)); then the attention's post: dL/d(out_proj),
    // and dh = its direct share of dL/dh.
    Buffer<float> da(N * D);
    norm_backward(da.data(), g.post_attention_norm, dm.data(), X.mhc_mlp.a.data(), p.post_attention_norm,
                  X.rstd2.data(), N);
    mhc_block_pre_backward(dh1.data(), g.mhc_mlp, da.data(), mix_mlp, X.h1.data(), X.mhc_mlp, p.mhc_mlp, c, N);
    dattn_mhc.resize(N * D);
    std::fill(dh, dh + N * c.residual_width(), 0.0f);
    mhc_block_post_backward(dattn_mhc.data(), dh, mix_attn, dh1.data(), S.out_proj.data(), h, X.mhc_attn, c, N);
  } else {
    // Post-attention norm: dh1 = dh2 + norm'(dm).
    norm_backward(dh, g.post_attention_norm, dm.data(), X.h1.data(), p.post_attention_norm, X.rstd2.data(), N, true);
  }
  // MLA: dh1 (with mHC, the post's gradient) is dL/d(out_proj).
  const float* dattn = mhc ? dattn_mhc.data() : dh;
  const auto& a = p.attn;
  Buffer<float> dctx(N * H * vd), dq(N * H * qk), dk(N * H * qk), dv(N * H * vd);
  out_projection_backward(dctx.data(), g.attn, dattn, S.attention_out.data(), a, N);
  ops::AttentionDims d{layout.batch, layout.seq, H, qk, vd, s.softmax_scale};
  ops::attention_backward(dq.data(), dk.data(), dv.data(), dctx.data(), S.attention_out.data(), S.lse.data(),
                          S.query_proj.data(), S.key_proj.data(), S.value_proj.data(), layout.segment_ids, d,
                          X.selected.empty() ? nullptr : X.selected.data());
  Buffer<float> dmla_kv(N * kvl), dk_pe(N * rope), dx(N * D);
  get_key_value_backward(dmla_kv.data(), dk_pe.data(), g.attn, dk.data(), dv.data(), S.mla_kv.data(), a, s, N);
  std::fill(dx.begin(), dx.end(), 0.0f);
  kv_projection_backward(dx.data(), g.attn, dmla_kv.data(), dk_pe.data(), S.kv_wa_proj.data(), S.kv_rstd.data(),
                         X.x.data(), a, s, layout.positions, N);
  query_projection_backward(dx.data(), g.attn, dq.data(), S.query_wa_proj.data(), S.mla_q.data(), S.q_rstd.data(),
                            X.x.data(), a, s, layout.positions, N);
  if (mhc) {
    // dh += mhc_pre'(norm'(dx)).
    Buffer<float> da(N * D);
    norm_backward(da.data(), g.input_norm, dx.data(), X.mhc_attn.a.data(), p.input_norm, X.rstd1.data(), N);
    mhc_block_pre_backward(dh, g.mhc_attn, da.data(), mix_attn, h, X.mhc_attn, p.mhc_attn, c, N);
  } else {
    // Input norm: dh = dh1 + norm'(dx).
    norm_backward(dh, g.input_norm, dx.data(), h, p.input_norm, X.rstd1.data(), N, true);
  }
  if (has_engram)  // dh, dL/d(h + o), gains Engram's share of dL/dh
    engram_backward(dh, g.engram, dh, h_in, engram.ids.data(), engram.acts, p.engram, s.engram, engram.segs, N);
  S = LayerSaved{};  // this layer is done: its memory goes back before the next one's backward
  co_return;
}

}  // namespace

void layer_backward(float* dh, LayerGrads& g, LayerSaved& S, const LayerView& p, int64_t layer, const StageConfig& s,
                    const TokenLayout& layout, double dloss_lb, double* indexer_loss) {
  run_staged(layer_backward_task(dh, g, S, p, layer, s, layout, dloss_lb, indexer_loss));
}

void layer_backward_split(float* dh, LayerGrads& g, std::vector<LayerSaved>& saved, const LayerView& p, int64_t layer,
                          const StageConfig& s, const TokenLayout& layout, double dloss_lb, double* indexer_loss) {
  const int64_t M = static_cast<int64_t>(saved.size()), W = s.cfg->residual_width();
  const auto parts = split_layout(layout, M);
  const int64_t n = parts[0].tokens();
  std::vector<Staged> tasks;
  for (int64_t i = 0; i < M; ++i)
    tasks.push_back(layer_backward_task(dh + i * n * W, g, saved[i], p, layer, s, parts[i],
                                        dloss_lb / static_cast<double>(M), indexer_loss));
  run_interleaved(tasks, layer, true);
}

}  // namespace ds::model
