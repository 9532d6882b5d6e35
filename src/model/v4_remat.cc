// What a V4 training forward keeps (model/v4_model.h's V4Saved): its bytes,
// what a remat policy drops after each layer, and the rerun that rebuilds it
// in the backward.
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/error.h"
#include "model/v4_model.h"

namespace ds::model {

namespace {

template <class T>
size_t vec_bytes(const T& v) {
  return v.size() * sizeof(v[0]);
}

}  // namespace

std::array<Buffer<float>*, V4LayerSaved::kHeld> V4LayerSaved::held_buffers() {
  return {&attn.qr_lin, &attn.qr, &attn.q_lin, &attn.q, &attn.kv_lin, &attn.kv, &attn.o, &attn.o2,
          &attn.z,      &o,       &moe.g,      &moe.u,  &moe.y,       &moe.sg,  &moe.su};
}

void V4LayerSaved::hold_bf16() { ds::hold_bf16(held_buffers(), held_); }

void V4LayerSaved::widen() { ds::widen(held_buffers(), held_); }

size_t V4LayerSaved::bytes() const {
  size_t b = X.bytes() + X1.bytes();
  for (const HeldFloats& h : held_) b += h.bytes();
  for (const Buffer<float>* v : {&a0,           &rstd_a,       &a,          &post,        &comb,    &o,
                                 &f0,           &rstd_f,       &f,          &fpost,       &fcomb,   &fo,
                                 &a_pin,        &f_pin,        &eX,         &e_rows,      &e_kv,    &attn.qr_lin,
                                 &attn.qr,      &attn.rstd_qr, &attn.q_lin, &attn.rstd_q, &attn.q,  &attn.kv_lin,
                                 &attn.rstd_kv, &attn.kv,      &attn.o,     &attn.lse,    &attn.o2, &attn.z,
                                 &moe.g,        &moe.u,        &moe.y,      &moe.sg,      &moe.su})
    b += vec_bytes(*v);
  for (const V4CompressorSaved& c : attn.comp)
    b += vec_bytes(c.P) + vec_bytes(c.Z) + vec_bytes(c.pooled) + vec_bytes(c.rstd);
  b += vec_bytes(attn.key_seg) + vec_bytes(attn.key_idx) + vec_bytes(attn.offsets);
  b += vec_bytes(moe.r.experts) + vec_bytes(moe.r.weights) + vec_bytes(moe.r.scores);
  b += vec_bytes(moe.r.order) + vec_bytes(moe.r.inverse) + vec_bytes(moe.r.sizes) + vec_bytes(moe.bias);
  return b;
}

size_t V4Saved::bytes() const {
  size_t b = vec_bytes(ids) + vec_bytes(pos) + vec_bytes(head.X) + vec_bytes(head.y) + vec_bytes(head.rstd_y);
  for (const V4LayerSaved& l : layers) b += l.bytes();
  for (const V4MtpSaved& m : mtp)
    for (const std::vector<float>* v :
         {&m.e0, &m.rstd_e, &m.e, &m.h0, &m.rstd_h, &m.h, &m.head.X, &m.head.y, &m.head.rstd_y})
      b += vec_bytes(*v);
  return b;
}

double v4_saved_bytes_per_token(const V4Config& c, const RematPolicy& keep, bool bf16, int64_t seq) {
  using R = Residual;
  const double held = bf16 ? 2.0 : 4.0, f32 = 4.0, i32 = 4.0, i64 = 8.0;
  const double hc = static_cast<double>(c.hc_mult), d = static_cast<double>(c.hidden_size);
  const double H = static_cast<double>(c.num_attention_heads), D = static_cast<double>(c.head_dim);
  const double ql = static_cast<double>(c.q_lora_rank), Gr = static_cast<double>(c.o_groups * c.o_lora_rank);
  const double K = static_cast<double>(c.num_experts_per_tok), E = static_cast<double>(c.n_routed_experts);
  const double I = static_cast<double>(c.moe_intermediate_size), S = static_cast<double>(c.n_shared_experts) * I;
  auto k = [&](R r) { return keep.kept(r) || c.v41() ? 1.0 : 0.0; };  // V4.1 keeps its attention whole
  auto km = [&](R r) { return keep.kept(r) ? 1.0 : 0.0; };
  const bool attn_whole = k(R::query_wa_proj) + k(R::mla_q) + k(R::query_proj) + k(R::kv_wa_proj) + k(R::kv_proj) +
                              k(R::context) + k(R::attention_out) + k(R::out_proj) ==
                          8;
  const double attn_named =
      held * (k(R::query_wa_proj) * ql + k(R::mla_q) * ql + k(R::query_proj) * 2 * H * D + k(R::kv_wa_proj) * D +
              k(R::kv_proj) * D + k(R::context) * H * D + k(R::attention_out) * H * D + k(R::out_proj) * d) +
      f32 * (k(R::mla_q) + k(R::query_proj) * H + k(R::kv_proj) + k(R::context) * H);
  const double g = std::max(km(R::moe_mlpwi_0), km(R::mlpwi_0)), y = std::max(km(R::moe_mlpwo), km(R::mlpwo));
  const bool moe_whole = g + km(R::moe_mlpwi_1) + y + km(R::mlpwi_0) + km(R::mlpwi_1) == 5;
  const double moe_named =
      held * (K * I * (g + km(R::moe_mlpwi_1)) + K * d * y + S * (km(R::mlpwi_0) + km(R::mlpwi_1)));
  // The routing's choices and scores always stay; the rest with the MoE's unnamed residuals.
  const double routing = K * i32 + E * f32 + (moe_whole ? K * (f32 + 2 * i32) : 0.0);
  const double mix = f32 * (3 * d + 1 + hc + hc * hc);  // a sub-layer's input and norm rows, its mHC post and comb
  const double window = static_cast<double>(std::min(c.sliding_window, seq));
  double total = 0;
  for (int64_t l = 0; l < c.num_hidden_layers + c.num_nextn_predict_layers; ++l) {
    double b = held * hc * d * km(R::decoder_layer_input) + attn_named + moe_named + routing;
    if (c.v41()) b += 2 * f32 * hc;  // the weights that collapsed each sub-layer's input
    if (c.v41() && c.engram_slot(l) >= 0)
      b += f32 * (hc * d + static_cast<double>(c.engram_columns() * c.engram_head_dim) + (hc + 1) * d);
    if (attn_whole) {
      const int64_t m = c.compress_ratio(l);
      // Each query's keys (a sequence index and an entry each): the window,
      // and the top-k (CSA) or every complete window (HCA) of the entries.
      const double entries = m == 0                ? 0.0
                             : c.sparse_entries(l) ? static_cast<double>(std::min(c.index_topk, seq / m))
                                                   : static_cast<double>(seq / m);
      const double cw = m == 0 ? 0.0 : (m == 4 ? 2 : 1) * D;
      b += held * (hc * d + Gr) + mix + f32 * 2 * cw + (m == 0 ? 0.0 : f32 * (D + 1) / static_cast<double>(m)) +
           (window + entries) * (i32 + i64) + i64;
    }
    if (moe_whole) b += mix;
    total += b;
  }
  // The batch's ids and positions; per layer the routing bias and sizes
  // [E], once a batch (of at least seq tokens).
  total += 2 * i32 + static_cast<double>(c.num_hidden_layers + c.num_nextn_predict_layers) * 2 * E * f32 /
                         static_cast<double>(std::max<int64_t>(seq, 1));
  // The head's streams and norm of every row; the MTP block's next-token
  // embeddings and main streams, before and after their norms, and its head.
  const double head = f32 * (hc * d + d + 1);
  return total + head + (c.num_nextn_predict_layers > 0 ? f32 * (2 * d + 1 + 2 * hc * d + 1) + head : 0.0);
}

void V4Model::drop(V4LayerSaved& ls, const V4Saved& saved) const {
  using R = Residual;
  const RematPolicy& keep = saved.keep;
  // Frees b unless kept; true when that dropped something.
  auto drop_unless = [](Buffer<float>& b, bool kept) {
    if (kept || b.empty()) return false;
    b = Buffer<float>();
    return true;
  };
  V4AttentionSaved& A = ls.attn;
  bool lost = false;
  for (auto [b, name] : {std::pair{&A.qr_lin, R::query_wa_proj},
                         {&A.qr, R::mla_q},
                         {&A.rstd_qr, R::mla_q},
                         {&A.q_lin, R::query_proj},
                         {&A.rstd_q, R::query_proj},
                         {&A.q, R::query_proj},
                         {&A.kv_lin, R::kv_wa_proj},
                         {&A.kv, R::kv_proj},
                         {&A.rstd_kv, R::kv_proj},
                         {&A.o, R::context},
                         {&A.lse, R::context},
                         {&A.o2, R::attention_out},
                         {&ls.o, R::out_proj}})
    lost |= drop_unless(*b, keep.kept(name) || cfg_.v41());  // V4.1's readers take their choice from other layers
  // A sub-layer that lost a residual is rerun: its unnamed ones go too,
  // and the attention's output streams X1 (the rerun rebuilds them).
  if (lost) {
    for (Buffer<float>* b : {&ls.a0, &ls.rstd_a, &ls.a, &ls.post, &ls.comb, &A.z}) *b = Buffer<float>();
    ls.X1.clear();
    A.comp = {};
    A.key_seg = {};
    A.key_idx = {};
    A.offsets = {};
  }
  // The MoE (MaxText's sparse expert path: routed w1 x under moe_mlpwi_0 or
  // mlpwi_0, w3 x under moe_mlpwi_1 alone, the outputs under moe_mlpwo or
  // mlpwo; the shared expert's under mlpwi_0 / mlpwi_1). Its routing's
  // choices and scores always stay (the expert loads and the balance loss
  // read them).
  V4MoeSaved& M = ls.moe;
  bool moe_lost = false;
  moe_lost |= drop_unless(M.g, keep.kept(R::moe_mlpwi_0) || keep.kept(R::mlpwi_0));
  moe_lost |= drop_unless(M.u, keep.kept(R::moe_mlpwi_1));
  moe_lost |= drop_unless(M.y, keep.kept(R::moe_mlpwo) || keep.kept(R::mlpwo));
  moe_lost |= drop_unless(M.sg, keep.kept(R::mlpwi_0));
  moe_lost |= drop_unless(M.su, keep.kept(R::mlpwi_1));
  if (moe_lost) {
    for (Buffer<float>* b : {&ls.f0, &ls.rstd_f, &ls.f, &ls.fpost, &ls.fcomb, &ls.fo}) *b = Buffer<float>();
    V4MoeSaved kept;
    kept.r.tokens = M.r.tokens;
    kept.r.k = M.r.k;
    kept.r.experts = std::move(M.r.experts);
    kept.r.scores = std::move(M.r.scores);
    kept.bias = std::move(M.bias);
    for (auto [to, from] :
         {std::pair{&kept.g, &M.g}, {&kept.u, &M.u}, {&kept.y, &M.y}, {&kept.sg, &M.sg}, {&kept.su, &M.su}})
      *to = std::move(*from);
    M = std::move(kept);
  }
  if (bf16_activations()) ls.hold_bf16();
}

Staged V4Model::rerun_layer(int64_t l, V4Saved& saved) {
  const int64_t L = cfg_.num_hidden_layers;
  DS_CHECK(l >= 0 && l < static_cast<int64_t>(saved.layers.size()), "internal: rerun of layer {} of {}", l,
           saved.layers.size());
  V4LayerSaved& ls = saved.layers[static_cast<size_t>(l)];
  ls.widen();  // the residuals held in bf16, for the reruns and the backward
  if (ls.has_attention() && ls.has_moe()) co_return;
  DS_CHECK(!ls.X.empty() && (!ls.has_attention() || !ls.X1.empty()),
           "internal: layer {} kept no input streams to recompute from", l);
  const bool mtp = l == L;
  DS_CHECK(!mtp || !saved.mtp.empty(), "internal: the MTP block's rerun without its rows");
  const std::vector<Segment>& segs = mtp ? saved.mtp[0].segs : saved.segs;
  const int32_t* ids = mtp ? saved.mtp[0].ids.data() : saved.ids.data();
  const int32_t* pos = mtp ? saved.mtp[0].pos.data() : saved.pos.data();
  const int64_t n = static_cast<int64_t>(mtp ? saved.mtp[0].ids.size() : saved.ids.size());
  Buffer<float> X, X2(static_cast<size_t>(ls.X.size())), wide;
  if (!ls.has_attention()) {
    // The attention again from the layer's input, each stage computing what
    // the policy dropped; its compressed entries too, so each sequence's
    // state of this layer starts afresh.
    for (const Segment& g : segs) g.state->layers[static_cast<size_t>(l)] = V4LayerState();
    const float* x = ls.X.values(wide);
    X.assign(x, x + ls.X.size());
    co_await sublayer(X, X2, l, false, segs, ids, pos, n, &ls);
  } else {
    const float* x = ls.X1.values(wide);
    X.assign(x, x + ls.X1.size());
  }
  if (!ls.has_moe()) {
    // The MoE's expert products are recomputed together.
    V4LayerSaved fresh;
    V4PassContext cx;  // V4.1: the FFN input's collapse weights, as the forward had them
    cx.pin.assign(ls.f_pin.begin(), ls.f_pin.end());
    co_await sublayer(X, X2, l, true, segs, ids, pos, n, &fresh, cfg_.lagged_mhc() ? &cx : nullptr);
    ls.X1 = std::move(fresh.X1), ls.f0 = std::move(fresh.f0), ls.rstd_f = std::move(fresh.rstd_f);
    ls.f = std::move(fresh.f), ls.fpost = std::move(fresh.fpost), ls.fcomb = std::move(fresh.fcomb);
    ls.fo = std::move(fresh.fo), ls.moe = std::move(fresh.moe);
  } else if (ls.X1.empty()) {
    ls.X1.take(std::move(X), bf16_activations());
  }
}

}  // namespace ds::model
