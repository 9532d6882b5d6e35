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
