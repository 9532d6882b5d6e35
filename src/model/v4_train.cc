#include "model/v4_train.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/engram_v41.h"
#include "model/stages.h"
#include "model/v4_balance.h"
#include "model/v4_model.h"
#include "model/weights.h"
#include "ops/activations.h"
#include "ops/compressor.h"
#include "ops/expert_selection.h"
#include "ops/fp8_quant.h"
#include "ops/linear.h"
#include "ops/mhc.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/routing.h"
#include "ops/sparse_attention.h"

namespace ds::model {

namespace {

using View = ops::WeightView;

void need_vector_data(const View& v, const char* what) {
  DS_CHECK(v.dtype == DType::F32, "V4 training needs float32 weights ({} is {})", what, dtype_name(v.dtype));
}

// n zeros, written by every thread when n is large.
Buffer<float> zeros(int64_t n) {
  Buffer<float> b(static_cast<size_t>(n));
  parallel_zero(b.data(), n);
  return b;
}
void zero(Buffer<float>& b) { parallel_zero(b.data(), static_cast<int64_t>(b.size())); }

// The fused head loss (model/stages.h) of the normed rows hn [R, d]: row r
// predicts target rows[r] of b, and counts where b counts that target.
HeadLoss head_loss_rows(const float* hn, const View& head, const V4TrainBatch& b, const std::vector<int64_t>& rows,
                        int64_t d, double zm) {
  const int64_t R = static_cast<int64_t>(rows.size());
  std::vector<int32_t> tgt(static_cast<size_t>(R)), mask(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const size_t i = static_cast<size_t>(rows[static_cast<size_t>(r)]);
    tgt[static_cast<size_t>(r)] = b.targets[i];
    mask[static_cast<size_t>(r)] = b.counted.empty() || b.counted[i];
  }
  HeadLoss hl;
  head_loss_forward(hl, hn, head, tgt, mask, R, d, zm);
  return hl;
}

// The balance loss of a step: its weight, the rows of the main pass's and
// the MTP pass's tokens, and dloss/dlayer (the loss is the mean over the
// score-routed layers).
struct Balance {
  double weight = 0, dloss = 0;
  V4BalanceRows main, mtp;
};

// The packed rows of a pass's tokens: every token of sequence k (the main
// pass), or all but its last (the MTP pass), in row b.row_of[k] (its own
// row when the batch has none).
V4BalanceRows balance_rows(const V4TrainBatch& b, bool mtp, int64_t whole_rows) {
  V4BalanceRows r;
  int64_t rows = 0;
  for (size_t k = 0; k < b.lengths.size(); ++k) {
    const int64_t row = b.row_of.empty() ? static_cast<int64_t>(k) : b.row_of[k];
    rows = std::max(rows, row + 1);
    for (int64_t t = 0; t < b.lengths[k] - (mtp ? 1 : 0); ++t) r.row_of.push_back(row);
  }
  r.whole_rows = whole_rows > 0 ? whole_rows : std::max(rows, b.packed_rows);
  return r;
}

class Backward {
 public:
  // Sequence k holds rows [first[k], first[k] + lengths[k]) of the batch.
  Backward(const V4Config& c, const V4View& w, V4Params<float*>& g, V4Model& model, V4Saved& sv,
           std::vector<V4State>& states, const std::vector<int64_t>& lengths)
      : c_(c),
        w_(w),
        g_(g),
        model_(model),
        sv_(sv),
        states_(states),
        len_(lengths),
        n_(static_cast<int64_t>(sv.ids.size())),
        md_(v4_mhc_dims(c, n_)),
        pos_(sv.pos.data()) {
    int64_t at = 0;
    for (int64_t L : len_) {
      first_.push_back(at);
      at += L;
    }
  }

  // The balance loss's gradient too (its rows and dloss per layer).
  void set_balance(const Balance* b) {
    balance_ = b;
    balance_rows_ = &b->main;
  }

  // The backward of a pass, in the steps backward_passes (below) runs: the
  // gradient dyn of the main head's normed rows [n, d] (the LM head's own
  // gradient already taken) into the last layer's streams; the MTP layer's
  // from the gradient of its normed rows (when it ran); each layer, last to
  // first; the embedding.
  void head_grad(const Buffer<float>& dyn) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult;
    // The head's saved streams are row t's for every token t, in order.
    bool every_row = static_cast<int64_t>(sv_.logit_rows.size()) == n_;
    for (int64_t t = 0; every_row && t < n_; ++t) every_row = sv_.logit_rows[static_cast<size_t>(t)] == t;
    DS_CHECK(every_row, "internal: the V4 backward needs the head's saved streams of all {} tokens in order", n_);
    dX_ = zeros(n_ * hc * d);
    head(dX_.data(), dyn.data(), sv_.head, w_.hc_head_fn, w_.hc_head_base, w_.hc_head_scale, w_.norm, g_.hc_head_fn,
         g_.hc_head_base, g_.hc_head_scale, g_.norm, n_);
  }
  bool runs_mtp() const { return !sv_.mtp.empty(); }
  Staged mtp_grad(const Buffer<float>& dmtp) {
    if (!sv_.mtp[0].rows.empty()) co_await mtp(dX_, dmtp);
  }
  // Layer l's backward on the main streams' gradient dX_.
  Staged layer(int64_t l) { return layer_on(l, dX_); }
  // The embedding fed every stream.
  void embed_grad() {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult;
    if (g_.embed)
      for (int64_t t = 0; t < n_; ++t) {
        float* row = g_.embed + static_cast<int64_t>(sv_.ids[static_cast<size_t>(t)]) * d;
        for (int64_t j = 0; j < hc; ++j) {
          const float* src = dX_.data() + (t * hc + j) * d;
          for (int64_t i = 0; i < d; ++i) row[i] += src[i];
        }
      }
  }

 private:
  // dX (`=`, [R, hc, d]) and the gradients of rmsnorm(mhc_head(X))'s
  // parameters from dyn [R, d].
  void head(float* dX, const float* dyn, const V4HeadSaved& hs, const View& fn, const View& base, const View& scale,
            const View& norm, float* gfn, float* gbase, float* gscale, float* gnorm, int64_t R) {
    const int64_t d = c_.hidden_size;
    Buffer<float> dy(static_cast<size_t>(R * d));
    ops::rmsnorm_backward(dy.data(), gnorm, dyn, hs.y.data(), vector_data(norm), hs.rstd_y.data(), R, d);
    if (!hs.pre.empty()) {  // V4.1: the last layer's FFN mix collapsed the streams
      dpin_ = zeros(R * c_.hc_mult);
      ops::mhc_collapse_backward(dX, dpin_.data(), dy.data(), hs.X.data(), hs.pre.data(), R, c_.hc_mult, d);
      return;
    }
    ops::mhc_head_backward(dX, gfn, gbase, gscale, dy.data(), hs.X.data(), vector_data(fn), vector_data(base),
                           vector_data(scale), v4_mhc_dims(c_, R));
  }

  // The MTP layer: its head, its block (layer num_hidden_layers over the MTP
  // rows), the two projections and norms; dX (the main streams) and the
  // embedding (the next tokens) +=.
  Staged mtp(Buffer<float>& dX, const Buffer<float>& dyn) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult, l = c_.num_hidden_layers;
    const V4MtpSaved& ms = sv_.mtp[0];
    const auto& M = w_.mtp[0];
    auto& G = g_.mtp[0];
    const int64_t R = static_cast<int64_t>(ms.rows.size());
    Buffer<float> dXm = zeros(R * hc * d);  // the head adds into it
    head(dXm.data(), dyn.data(), ms.head, M.hc_head_fn, M.hc_head_base, M.hc_head_scale, M.norm, G.hc_head_fn,
         G.hc_head_base, G.hc_head_scale, G.norm, R);
    const int64_t n0 = n_;
    const ops::MhcDims md0 = md_;
    const int32_t* pos0 = pos_;
    n_ = R;
    balance_rows_ = balance_ ? &balance_->mtp : nullptr;
    md_ = v4_mhc_dims(c_, R);
    pos_ = ms.pos.data();
    co_await layer_on(l, dXm);
    n_ = n0;
    balance_rows_ = balance_ ? &balance_->main : nullptr;
    md_ = md0;
    pos_ = pos0;
    // Xm = h_proj(h) + e_proj(e) copied into every stream.
    need_vector_data(M.h_proj, "mtp.h_proj");
    need_vector_data(M.e_proj, "mtp.e_proj");
    Buffer<float> dh(static_cast<size_t>(R * hc * d)), de(static_cast<size_t>(R * d)), dpe = zeros(R * d);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < hc; ++j)
        for (int64_t i = 0; i < d; ++i)
          dpe[static_cast<size_t>(r * d + i)] += dXm[static_cast<size_t>((r * hc + j) * d + i)];
    ops::linear_backward(dh.data(), G.h_proj, dXm.data(), ms.h.data(), M.h_proj, R * hc);
    ops::linear_backward(de.data(), G.e_proj, dpe.data(), ms.e.data(), M.e_proj, R);
    ops::rmsnorm_backward(dh.data(), G.hnorm, dh.data(), ms.h0.data(), vector_data(M.hnorm), ms.rstd_h.data(), R * hc,
                          d);
    ops::rmsnorm_backward(de.data(), G.enorm, de.data(), ms.e0.data(), vector_data(M.enorm), ms.rstd_e.data(), R, d);
    for (int64_t r = 0; r < R; ++r) {
      float* dst = dX.data() + ms.rows[static_cast<size_t>(r)] * hc * d;
      const float* src = dh.data() + r * hc * d;
      for (int64_t i = 0; i < hc * d; ++i) dst[i] += src[i];
      if (g_.embed) {
        float* row = g_.embed + static_cast<int64_t>(ms.ids[static_cast<size_t>(r)]) * d;
        for (int64_t i = 0; i < d; ++i) row[i] += de[static_cast<size_t>(r * d + i)];
      }
    }
  }

  // dX holds dL/d(layer output) on entry, dL/d(layer input) on return.
  // What the remat policy dropped is recomputed first, and the layer's
  // residuals are freed after.
  Staged layer_on(int64_t l, Buffer<float>& dX) {
    co_await model_.rerun_layer(l, sv_);
    co_await layer_backward(l, dX);
    sv_.layers[static_cast<size_t>(l)] = V4LayerSaved();
  }
  Staged layer_backward(int64_t l, Buffer<float>& dX) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult;
    const auto& s = sv_.layers[static_cast<size_t>(l)];
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    Buffer<float> dsub = zeros(n_ * d), dX1 = zeros(n_ * hc * d), dpost = zeros(n_ * hc), dcomb = zeros(n_ * hc * hc),
                  da(static_cast<size_t>(n_ * d));
    // V4.1's lagged mHC: a sub-layer's input is collapsed with the pre of
    // the one before (its gradient goes there), its own pre collapses the
    // next's (whose gradient dpin_ brings).
    const bool lagged = c_.lagged_mhc();
    Buffer<float> dpa = zeros(lagged ? n_ * hc : 0);
    // The streams in (X) and between the sub-layers (X1), widened when held in bf16.
    Buffer<float> wide_x, wide_x1;
    const float* X = s.X.values(wide_x);
    const float* X1 = s.X1.values(wide_x1);
    // The MoE sub-layer.
    ops::mhc_post_backward(dsub.data(), dX1.data(), dpost.data(), dcomb.data(), dX.data(), s.fo.data(), X1,
                           s.fpost.data(), s.fcomb.data(), md_);
    co_await moe(da.data(), dsub.data(), s.moe, s.f.data(), l);
    ops::rmsnorm_backward(da.data(), G.ffn_norm, da.data(), s.f0.data(), vector_data(L.ffn_norm), s.rstd_f.data(), n_,
                          d);
    if (lagged) ops::mhc_collapse_backward(dX1.data(), dpa.data(), da.data(), X1, s.f_pin.data(), n_, hc, d);
    ops::mhc_pre_backward(dX1.data(), G.hc_ffn_fn, G.hc_ffn_base, G.hc_ffn_scale, lagged ? nullptr : da.data(),
                          dpost.data(), dcomb.data(), X1, vector_data(L.hc_ffn_fn), vector_data(L.hc_ffn_base),
                          vector_data(L.hc_ffn_scale), md_, lagged ? dpin_.data() : nullptr);
    // The attention sub-layer.
    for (Buffer<float>* b : {&dsub, &dpost, &dcomb, &dX}) zero(*b);
    ops::mhc_post_backward(dsub.data(), dX.data(), dpost.data(), dcomb.data(), dX1.data(), s.o.data(), X, s.post.data(),
                           s.comb.data(), md_);
    zero(da);
    attention(da.data(), dsub.data(), s.attn, s.a.data(), l);
    ops::rmsnorm_backward(da.data(), G.attn_norm, da.data(), s.a0.data(), vector_data(L.attn_norm), s.rstd_a.data(), n_,
                          d);
    if (lagged) ops::mhc_collapse_backward(dX.data(), dpin_.data(), da.data(), X, s.a_pin.data(), n_, hc, d);
    ops::mhc_pre_backward(dX.data(), G.hc_attn_fn, G.hc_attn_base, G.hc_attn_scale, lagged ? nullptr : da.data(),
                          dpost.data(), dcomb.data(), X, vector_data(L.hc_attn_fn), vector_data(L.hc_attn_base),
                          vector_data(L.hc_attn_scale), md_, lagged ? dpa.data() : nullptr);
    if (c_.engram_slot(l) >= 0) engram(dX, s, l);
  }

  // V4.1's Engram before layer l: dX, the gradient of the updated streams,
  // becomes that of the streams before it; the table rows looked up, wkv
  // and the folded q/k weights get theirs.
  void engram(Buffer<float>& dX, const V4LayerSaved& s, int64_t l) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult, C = c_.engram_columns(), De = c_.engram_head_dim;
    const auto& p = w_.layers[static_cast<size_t>(l)].engram;
    auto& g = g_.layers[static_cast<size_t>(l)].engram;
    const float* q = vector_data(p.q_weight);
    const float* k = vector_data(p.k_weight);
    std::vector<float> wqk(static_cast<size_t>(hc * d)), dwqk(wqk.size(), 0.0f);
    for (size_t i = 0; i < wqk.size(); ++i) wqk[i] = q[i] * k[i];
    Buffer<float> dkv(static_cast<size_t>(n_ * (hc + 1) * d)), de(static_cast<size_t>(n_ * C * De));
    v41_engram_backward(dX.data(), dkv.data(), dwqk.data(), dX.data(), s.eX.data(), s.e_kv.data(), wqk.data(),
                        {n_, hc, d, static_cast<float>(c_.rms_norm_eps)});
    for (size_t i = 0; i < wqk.size(); ++i) {
      if (g.q_weight) g.q_weight[i] += dwqk[i] * k[i];
      if (g.k_weight) g.k_weight[i] += dwqk[i] * q[i];
    }
    need_vector_data(p.wkv, "engram.wkv");
    ops::linear_backward(de.data(), g.wkv, dkv.data(), s.e_rows.data(), p.wkv, n_);
    if (!g.embed) return;
    // Only the rows looked up get a gradient.
    const auto& ids = sv_.engram[static_cast<size_t>(c_.engram_slot(l))];
    for (int64_t i = 0; i < n_ * C; ++i) {
      const int64_t id = ids[static_cast<size_t>(i)];
      if (id < 0 || id >= p.embed.rows) continue;
      float* row = g.embed + id * De;
      const float* src = de.data() + i * De;
      for (int64_t j = 0; j < De; ++j) row[j] += src[j];
    }
  }

  // da += the attention's input gradient, given dout [n, d].
  void attention(float* da, const float* dout, const V4AttentionSaved& s, const float* a, int64_t l) {
    const auto& p = w_.layers[static_cast<size_t>(l)].attn;
    auto& g = g_.layers[static_cast<size_t>(l)].attn;
    const int64_t H = c_.num_attention_heads, D = c_.head_dim, R = c_.qk_rope_head_dim;
    const int64_t N = D - R, Lq = c_.q_lora_rank, G = c_.o_groups, r = c_.o_lora_rank, gw = H * D / G;
    const int64_t m = c_.compress_ratio(l);
    const float* freqs = model_.rope_frequencies(l);
    const int32_t* pos = pos_;
    for (const View* v : {&p.wq_a, &p.wq_b, &p.wkv, &p.wo_a, &p.wo_b}) need_vector_data(*v, "an attention projection");
    // out = wo_b z;  z_g = wo_a_g o2_g
    Buffer<float> dz(static_cast<size_t>(n_ * G * r)), dO(static_cast<size_t>(n_ * H * D));  // dO: d(attention output)
    ops::linear_backward(dz.data(), g.wo_b, dout, s.z.data(), p.wo_b, n_);
    for (int64_t k = 0; k < G; ++k)
      ops::linear_backward(dO.data() + k * gw, g.wo_a ? g.wo_a + k * r * gw : nullptr, dz.data() + k * r,
                           s.o2.data() + k * gw, ops::row_slice(p.wo_a, k * r, (k + 1) * r), n_, H * D, G * r);
    // o2 = o rotated by -t: do = do2 rotated by +t.
    ops::rope_forward(dO.data() + N, dO.data() + N, pos, freqs, n_, H, R, H * D, D, ops::RopeLayout::Interleaved);
    Buffer<float> dq(dO.size());  // written whole by the attention's backward
    // The sparse attention: its keys are rows of kv or compressed entries
    // (V4.1: its KV source's, whose gradient gathers every reader's until
    // the source's own backward).
    Buffer<float> dkv = zeros(n_ * D);
    const int64_t S = static_cast<int64_t>(len_.size()), src = c_.kv_source_of(l);
    std::vector<Buffer<float>> none(static_cast<size_t>(S));
    std::vector<Buffer<float>>& dent = m > 0 ? dent_[src] : none;
    if (dent.empty()) {
      dent.resize(static_cast<size_t>(S));
      for (int64_t k = 0; k < S; ++k)
        dent[static_cast<size_t>(k)] = zeros(static_cast<int64_t>(entries(k, src).size()));
    }
    std::vector<const float*> rows(s.key_idx.size());
    std::vector<float*> drows(s.key_idx.size());
    for (size_t j = 0; j < rows.size(); ++j) {
      const int32_t seg = s.key_seg[j];
      const int64_t idx = s.key_idx[j];
      rows[j] = seg < 0 ? s.kv.data() + idx * D : entries(seg, src).data() + idx * D;
      drows[j] = seg < 0 ? dkv.data() + idx * D : dent[static_cast<size_t>(seg)].data() + idx * D;
    }
    const ops::SparseMqaDims sd = v4_attention_dims(c_, n_);
    ops::sparse_mqa_backward(dq.data(), drows.data(), g.sink, dO.data(), s.o.data(), s.lse.data(), s.q.data(),
                             rows.data(), s.offsets.data(), vector_data(p.sink), sd);
    // q: RoPE, the weightless head norm, wq_b, q_norm, wq_a.
    const std::vector<float> ones(static_cast<size_t>(D), 1.0f);
    ops::rope_backward(dq.data() + N, dq.data() + N, pos, freqs, n_, H, R, H * D, D, ops::RopeLayout::Interleaved);
    if (c_.q_head_norm())
      ops::rmsnorm_backward(dq.data(), nullptr, dq.data(), s.q_lin.data(), ones.data(), s.rstd_q.data(), n_ * H, D);
    Buffer<float> dqr(static_cast<size_t>(n_ * Lq));
    ops::linear_backward(dqr.data(), g.wq_b, dq.data(), s.qr.data(), p.wq_b, n_);
    ops::rmsnorm_backward(dqr.data(), g.q_norm, dqr.data(), s.qr_lin.data(), vector_data(p.q_norm), s.rstd_qr.data(),
                          n_, Lq);
    ops::linear_backward(da, g.wq_a, dqr.data(), a, p.wq_a, n_, true);
    // The K=V latent: RoPE, kv_norm, wkv.
    ops::rope_backward(dkv.data() + N, dkv.data() + N, pos, freqs, n_, 1, R, D, D, ops::RopeLayout::Interleaved);
    ops::rmsnorm_backward(dkv.data(), g.kv_norm, dkv.data(), s.kv_lin.data(), vector_data(p.kv_norm), s.rstd_kv.data(),
                          n_, D);
    ops::linear_backward(da, g.wkv, dkv.data(), a, p.wkv, n_, true);
    if (c_.owns_compressor(l)) {
      // Every sequence's projection gradients, then the two projections'
      // backward over all rows at once (V4.1's ratio-1 compressor has no gate).
      const auto& cp = p.compressor;
      auto& cg = g.compressor;
      const bool gated = cp.wgate.data != nullptr;
      need_vector_data(cp.wkv, "compressor.wkv");
      if (gated) need_vector_data(cp.wgate, "compressor.wgate");
      const int64_t width = (m == 4 ? 2 : 1) * D;
      Buffer<float> dP(static_cast<size_t>(n_ * width)), dZ(dP.size());
      for (int64_t k = 0; k < S; ++k) {
        const size_t ks = static_cast<size_t>(k);
        compressor(dP.data() + first_[ks] * width, dZ.data() + first_[ks] * width, dent[ks], s.comp[ks], len_[ks], l);
      }
      ops::linear_backward(da, cg.wkv, dP.data(), a, cp.wkv, n_, true);
      if (gated) ops::linear_backward(da, cg.wgate, dZ.data(), a, cp.wgate, n_, true);
    }
    if (c_.owns_compressor(l)) dent_.erase(src);
  }

  // One sequence's compressed entries' gradient dE [entries, D] (consumed)
  // back through RoPE at b m, the norm, the pooling and the position
  // embedding to its rows' projections: dP, dZ [T, width] (`=`).
  void compressor(float* dP, float* dZ, Buffer<float>& dE, const V4CompressorSaved& cs, int64_t T, int64_t l) {
    const auto& p = w_.layers[static_cast<size_t>(l)].attn.compressor;
    auto& g = g_.layers[static_cast<size_t>(l)].attn.compressor;
    const int64_t D = c_.head_dim, R = c_.qk_rope_head_dim, m = c_.compress_ratio(l);
    const int64_t nb = static_cast<int64_t>(dE.size()) / D;
    const ops::CompressorDims dims{T, D, m, m == 4};
    const int64_t width = dims.width();
    if (nb > 0) {
      std::vector<int32_t> epos(static_cast<size_t>(nb));
      for (int64_t b = 0; b < nb; ++b) epos[static_cast<size_t>(b)] = static_cast<int32_t>(b * m);
      ops::rope_backward(dE.data() + D - R, dE.data() + D - R, epos.data(), model_.rope_frequencies(l), nb, 1, R, D, D,
                         ops::RopeLayout::Interleaved);
      ops::rmsnorm_backward(dE.data(), g.norm, dE.data(), cs.pooled.data(), vector_data(p.norm), cs.rstd.data(), nb, D);
    }
    parallel_zero(dP, T * width);
    parallel_zero(dZ, T * width);
    ops::compressor_pool_backward(dP, dZ, dE.data(), cs.P.data(), cs.Z.data(), dims);
    if (g.ape)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < width; ++i) g.ape[(t % m) * width + i] += dZ[t * width + i];
  }

  // dx [n, d] `=` from the MoE's output gradient dout.
  // w2(silu(w1 x) * w3 x) backward (model/stages.h's MLP with the clamp):
  // dxs (+=) from dy; the activation is recomputed from g and u.
  void swiglu(float* dxs, const float* dy, const float* xs, int64_t rows, const float* gv, const float* uv,
              const V4MlpParams<View>& mp, V4MlpParams<float*>& mg) const {
    for (const View* v : {&mp.w1, &mp.w3, &mp.w2}) need_vector_data(*v, "an expert");
    MlpParams<float*> g = as_mlp(mg);
    mlp_backward(dxs, g, dy, gv, uv, xs, as_mlp(mp), rows, true, static_cast<float>(c_.swiglu_limit));
  }

  Staged moe(float* dx, const float* dout, const V4MoeSaved& s, const float* x, int64_t l) {
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    const int64_t d = c_.hidden_size, E = c_.n_routed_experts, K = c_.num_experts_per_tok;
    const int64_t I = c_.moe_intermediate_size;
    const Routing& r = s.r;
    parallel_zero(dx, n_ * d);
    // The combine's backward: the combine weights' and the routed rows'
    // gradients (expert-major).
    Buffer<float> dweights(static_cast<size_t>(n_ * K)), dys(static_cast<size_t>(n_ * K * d)), dxs = zeros(n_ * K * d);
    combine_backward(dweights.data(), dys.data(), dout, s.y.data(), r, d);
    // The forward's tasks: one per expert (its weight gradients are sums over
    // its rows, so one task owns them all), the shared expert's into dx. The
    // routed experts' input gradients land in dxs, expert-major, and are
    // added to dx afterwards (route's backward).
    if (model_.options().exchange) {
      co_await moe_exchanged(dx, dxs, dys, dout, s, x, l);
    } else {
      const V4ExpertTasks& et = s.tasks;
      parallel_tasks(static_cast<int64_t>(et.tasks.size()), et.as_tasks(d, I), [&](int64_t task) {
        const int64_t e = et.tasks[static_cast<size_t>(task)];
        const size_t ei = static_cast<size_t>(e);
        if (e < 0) {
          swiglu(dx, dout, x, n_, s.sg.data(), s.su.data(), L.shared, G.shared);
          return;
        }
        const int64_t r0 = et.first[ei], cnt = et.rows(e);
        Buffer<float> xs(static_cast<size_t>(cnt * d));
        for (int64_t j = 0; j < cnt; ++j) {
          const int64_t t = r.order[r0 + j] / K;
          std::copy(x + t * d, x + (t + 1) * d, xs.begin() + j * d);
        }
        swiglu(dxs.data() + r0 * d, dys.data() + r0 * d, xs.data(), cnt, s.g.data() + r0 * I, s.u.data() + r0 * I,
               L.experts[ei], G.experts[ei]);
      });
    }
    Buffer<float> drouted(static_cast<size_t>(n_ * d));
    ops::route_backward(drouted.data(), dxs.data(), r.inverse.data(), n_, K, d);
    for (int64_t i = 0; i < n_ * d; ++i) dx[i] += drouted[static_cast<size_t>(i)];
    // The router, through the combine weights (its choices are constants).
    Buffer<float> dlogits(static_cast<size_t>(n_ * E));
    ops::expert_selection_backward(dlogits.data(), dweights.data(), r.scores.data(), r.experts.data(), n_,
                                   v4_selection_config(c_));
    if (balance_ && !c_.hash_routed(l))
      v4_balance_loss_backward(dlogits.data(), r.scores.data(), r.experts.data(),
                               s.bias.empty() ? nullptr : s.bias.data(), *balance_rows_, E, K, balance_->weight,
                               balance_->dloss);
    need_vector_data(L.gate, "ffn.gate");
    const ops::ScopedFloat32Products f32;  // as in the forward
    ops::linear_backward(dx, G.gate, dlogits.data(), x, L.gate, n_, true);
  }

  // The routed experts' backward under expert parallelism: the output
  // rows' gradients dys travel to their experts' ranks (the transpose of the
  // forward's undispatch), the experts' input gradients come back into dxs
  // [n K, d] (expert-major, this rank's order); the shared expert's input
  // gradient goes into dx.
  Staged moe_exchanged(float* dx, Buffer<float>& dxs, const Buffer<float>& dys, const float* dout, const V4MoeSaved& s,
                       const float* x, int64_t l) {
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    const int64_t d = c_.hidden_size, I = c_.moe_intermediate_size;
    TokenExchange& ex = *model_.options().exchange;
    const int64_t R = s.plan.local_rows;
    Buffer<float> dyl(static_cast<size_t>(R * d));
    {
      auto moved = ex.start_dispatch(dyl.data(), dys.data(), s.plan, d, true);
      co_await Pending{&moved};
    }
    Buffer<float> dxl = zeros(R * d);
    const V4ExpertTasks& local = s.local;
    parallel_tasks(static_cast<int64_t>(local.tasks.size()), local.as_tasks(d, I), [&](int64_t task) {
      const int64_t e = local.tasks[static_cast<size_t>(task)];
      if (e < 0) {
        swiglu(dx, dout, x, n_, s.sg.data(), s.su.data(), L.shared, G.shared);
        return;
      }
      const int64_t r0 = local.first[static_cast<size_t>(e)];
      swiglu(dxl.data() + r0 * d, dyl.data() + r0 * d, s.xl.data() + r0 * d, local.rows(e), s.g.data() + r0 * I,
             s.u.data() + r0 * I, L.experts[static_cast<size_t>(e)], G.experts[static_cast<size_t>(e)]);
    });
    auto back = ex.start_undispatch(dxs.data(), dxl.data(), s.plan, d);
    co_await Pending{&back};
  }

  const std::vector<float>& entries(int64_t seq, int64_t l) const {
    return states_[static_cast<size_t>(seq)].layers[static_cast<size_t>(l)].entries;
  }

  const V4Config& c_;
  const V4View& w_;
  V4Params<float*>& g_;
  const Balance* balance_ = nullptr;
  const V4BalanceRows* balance_rows_ = nullptr;  // the pass's (main or MTP)
  V4Model& model_;
  V4Saved& sv_;
  std::vector<V4State>& states_;
  const std::vector<int64_t>& len_;
  std::vector<int64_t> first_;
  Buffer<float> dX_;  // the main streams' gradient, from the head down
  // V4.1: the gradient of the pre weights the next sub-layer's input was
  // collapsed with [n, hc], and each KV source's entries' gradients [seq]
  // gathered from its readers.
  Buffer<float> dpin_;
  std::map<int64_t, std::vector<Buffer<float>>> dent_;
  int64_t n_;         // rows of the pass (the batch's tokens, or the MTP layer's rows)
  ops::MhcDims md_;
  const int32_t* pos_;  // their positions
};

}  // namespace

namespace {

// The batch-split schedule's parts of a batch: its packed rows (each
// sequence its own row when it has none) cut into M runs of equal count,
// each part's rows numbered from 0.
std::vector<V4TrainBatch> split_rows(const V4TrainBatch& b, int64_t M) {
  const size_t S = b.lengths.size();
  auto row = [&](size_t k) { return b.row_of.empty() ? static_cast<int64_t>(k) : b.row_of[k]; };
  int64_t P = b.packed_rows;
  for (size_t k = 0; k < S; ++k) P = std::max(P, row(k) + 1);
  DS_CHECK(M >= 1 && P % M == 0, "batch_split_factor {} does not divide the {} rows of this rank's batch", M, P);
  const int64_t per = P / M;
  std::vector<V4TrainBatch> parts(static_cast<size_t>(M));
  for (auto& p : parts) p.packed_rows = b.packed_rows > 0 || !b.row_of.empty() ? per : 0;
  int64_t at = 0;
  for (size_t k = 0; k < S; at += b.lengths[k], ++k) {
    V4TrainBatch& p = parts[static_cast<size_t>(row(k) / per)];
    const auto from = static_cast<std::ptrdiff_t>(at), to = static_cast<std::ptrdiff_t>(at + b.lengths[k]);
    p.inputs.insert(p.inputs.end(), b.inputs.begin() + from, b.inputs.begin() + to);
    p.targets.insert(p.targets.end(), b.targets.begin() + from, b.targets.begin() + to);
    if (!b.counted.empty()) p.counted.insert(p.counted.end(), b.counted.begin() + from, b.counted.begin() + to);
    p.lengths.push_back(b.lengths[k]);
    if (!b.row_of.empty()) p.row_of.push_back(row(k) % per);
  }
  return parts;
}

// One part's pass: its sequences' states, what its forward kept, its
// heads' normed rows and losses.
struct V4Pass {
  const V4TrainBatch* b = nullptr;
  int64_t n = 0;
  std::vector<V4State> states;
  V4Saved saved;
  std::vector<float> hn, mtp_hn;
  std::vector<int64_t> mrows;  // the MTP rows' targets
  HeadLoss main, mtp;
  Balance bal;
};

// The MTP rows of each sequence are its tokens but the last, in order,
// predicting target t + 1.
std::vector<int64_t> mtp_rows(const V4TrainBatch& b) {
  std::vector<int64_t> mrows;
  for (size_t k = 0, at = 0; k < b.lengths.size(); at += static_cast<size_t>(b.lengths[k]), ++k)
    for (int64_t t = 0; t + 1 < b.lengths[k]; ++t) mrows.push_back(static_cast<int64_t>(at) + t + 1);
  return mrows;
}

// The backward of every pass, a layer at a time, each layer's passes
// interleaved at their expert exchanges (the MTP block first, then the
// layers last to first); dyn and dmtp are each pass's head-input gradients.
void backward_passes(std::vector<Backward>& bws, const std::vector<Buffer<float>>& dyn,
                     const std::vector<Buffer<float>>& dmtp, bool with_mtp, LayerStream* stream, int64_t L) {
  const size_t P = bws.size();
  for (size_t i = 0; i < P; ++i) bws[i].head_grad(dyn[i]);
  if (with_mtp && bws[0].runs_mtp()) {
    if (stream) stream->acquire(L, true);
    std::vector<Staged> tasks;
    for (size_t i = 0; i < P; ++i) tasks.push_back(bws[i].mtp_grad(dmtp[i]));
    run_interleaved(tasks, L, true);
    if (stream) stream->release(L, true);
  }
  for (int64_t l = L - 1; l >= 0; --l) {
    if (stream) stream->acquire(l, true);
    std::vector<Staged> tasks;
    for (size_t i = 0; i < P; ++i) tasks.push_back(bws[i].layer(l));
    run_interleaved(tasks, l, true);
    if (stream) stream->release(l, true);
  }
  for (Backward& bw : bws) bw.embed_grad();
}

// MaxText's balance loss: the mean over the score-routed layers (the MTP
// block's included) of each one's, summed over the passes; the layers it
// counted.
double balance_loss(const V4Config& cfg, std::vector<V4Pass>& passes, std::vector<int64_t>& layers) {
  double sum = 0;
  for (size_t l = 0; l < passes[0].saved.layers.size(); ++l) {
    const int64_t li = static_cast<int64_t>(l);
    if (cfg.hash_routed(li)) continue;
    double layer = 0;
    bool any = false;
    for (V4Pass& p : passes) {
      const V4MoeSaved& m = p.saved.layers[l].moe;
      if (m.r.experts.empty()) continue;  // an MTP block without rows
      layer += v4_balance_loss(m.r.scores.data(), m.r.experts.data(), m.bias.empty() ? nullptr : m.bias.data(),
                               li < cfg.num_hidden_layers ? p.bal.main : p.bal.mtp, cfg.n_routed_experts,
                               cfg.num_experts_per_tok, p.bal.weight);
      any = true;
    }
    if (!any) continue;
    sum += layer;
    layers.push_back(li);
  }
  return layers.empty() ? 0.0 : sum / static_cast<double>(layers.size());
}

void check_batch(const V4Config& cfg, const V4TrainBatch& b) {
  const int64_t n = static_cast<int64_t>(b.inputs.size()), V = cfg.vocab_size;
  int64_t total = 0;
  for (int64_t L : b.lengths) {
    DS_CHECK(L > 0, "V4 training batch: a sequence of {} tokens", L);
    total += L;
  }
  DS_CHECK(total == n && static_cast<int64_t>(b.targets.size()) == n &&
               (b.counted.empty() || static_cast<int64_t>(b.counted.size()) == n),
           "V4 training batch: sequences of {} tokens in all, {} inputs, {} targets, {} counted flags", total, n,
           b.targets.size(), b.counted.size());
  for (int32_t t : b.targets) DS_CHECK(t >= 0 && t < V, "target {} is outside the vocabulary of {}", t, V);
}

}  // namespace

V4LossTerms v4_loss_and_grad(const V4Config& cfg, const V4View& w, V4Params<float*>* grads, const V4TrainBatch& b,
                             const V4LossOptions& opt) {
  check_batch(cfg, b);
  const int64_t n = static_cast<int64_t>(b.inputs.size()), L = cfg.num_hidden_layers;
  const bool with_mtp = opt.mtp && cfg.num_nextn_predict_layers > 0;
  const bool collective = opt.exchange || opt.stream;
  V4LossTerms out;
  DS_CHECK(!collective || n > 0,
           "expert parallelism or FSDP: this rank's share of the batch holds no token (only padding), and its peers "
           "wait on its collectives; use fewer ranks or longer documents");
  if (n == 0) {  // only padding: no term, no gradient, loads of zero
    if (opt.expert_load)
      out.expert_load.assign(static_cast<size_t>(L + (with_mtp ? 1 : 0)),
                             std::vector<int64_t>(static_cast<size_t>(cfg.n_routed_experts), 0));
    return out;
  }
  // The passes: the whole batch, or the batch-split schedule's parts.
  std::vector<V4TrainBatch> split;
  if (opt.batch_split > 1) split = split_rows(b, opt.batch_split);
  std::vector<V4Pass> passes;
  auto add_pass = [&](const V4TrainBatch* pb) {
    passes.emplace_back();
    passes.back().b = pb;
  };
  if (split.empty()) add_pass(&b);
  for (size_t i = 0; i < split.size(); ++i) {
    DS_CHECK(!collective || !split[i].inputs.empty(),
             "batch split: part {} of {} of this rank's batch holds no token (only padding), and its peers wait on "
             "its collectives; use a smaller batch_split_factor or longer documents",
             i, split.size());
    if (!split[i].inputs.empty()) add_pass(&split[i]);
  }
  V4Options mo;
  mo.qat = false;
  mo.exchange = opt.exchange;
  mo.stream = opt.stream;
  V4Model model(cfg, w, mo);
  // FSDP: the layers in order, the MTP block last, then (with a gradient)
  // back again.
  if (opt.stream) opt.stream->begin(L + (with_mtp ? 1 : 0), grads != nullptr);
  const bool want_saved = grads || opt.expert_load || opt.load_balance_loss_weight > 0;
  std::vector<std::vector<V4Request>> reqs;
  std::vector<V4Saved*> saved;
  for (V4Pass& p : passes) {
    p.n = static_cast<int64_t>(p.b->inputs.size());
    for (size_t k = 0; k < p.b->lengths.size(); ++k) p.states.push_back(model.new_state());
    reqs.emplace_back();
    int64_t at = 0;
    for (size_t k = 0; k < p.b->lengths.size(); ++k) {
      reqs.back().push_back({&p.states[k], p.b->inputs.data() + at, p.b->lengths[k]});
      at += p.b->lengths[k];
    }
    p.saved.keep = opt.remat;
    saved.push_back(want_saved ? &p.saved : nullptr);
  }
  std::vector<std::vector<float>> mtp_hn;
  auto hn = model.forward_normed_parts(reqs, saved, with_mtp ? &mtp_hn : nullptr);
  // The LM head and its loss fused, a vocabulary chunk at a time: no
  // [tokens, vocab] logits. Mean over counted targets of CE +
  // z_loss_multiplier lse^2 (MaxText's lm_loss holds the z term); MaxText's
  // MTP loss: factor x the mean over counted targets of the CE of row t
  // predicting target t + 1 (no z-loss).
  const View& head = model.head_weight();
  const int64_t d = cfg.hidden_size;
  double ce = 0, z = 0, weight = 0, mce = 0, mweight = 0;
  for (size_t i = 0; i < passes.size(); ++i) {
    V4Pass& p = passes[i];
    p.hn = std::move(hn[i]);
    std::vector<int64_t> rows(static_cast<size_t>(p.n));
    std::iota(rows.begin(), rows.end(), int64_t{0});
    p.main = head_loss_rows(p.hn.data(), head, *p.b, rows, d, opt.z_loss_multiplier);
    ce += p.main.ce_sum, z += p.main.z_sum, weight += p.main.weight;
    if (!with_mtp) continue;
    p.mtp_hn = std::move(mtp_hn[i]);
    p.mrows = mtp_rows(*p.b);
    p.mtp = head_loss_rows(p.mtp_hn.data(), head, *p.b, p.mrows, d, 0.0);
    mce += p.mtp.ce_sum, mweight += p.mtp.weight;
  }
  const double norm = opt.whole_targets > 0 ? opt.whole_targets : weight;
  out.tokens = static_cast<int64_t>(weight);
  out.lm_loss = (ce + z) / (norm + 1e-8);
  out.z_loss = z / (norm + 1e-8);
  out.loss = out.lm_loss;
  const double mnorm = opt.whole_mtp_targets > 0 ? opt.whole_mtp_targets : mweight;
  if (with_mtp) {
    out.mtp_tokens = static_cast<int64_t>(mweight);
    out.mtp_loss = opt.mtp_loss_scaling_factor * mce / (mnorm + 1e-8);
    out.loss += out.mtp_loss;
  }
  for (const V4Pass& p : passes) out.saved_bytes += p.saved.bytes();
  std::vector<int64_t> balance_layers;
  if (opt.load_balance_loss_weight > 0) {
    const int64_t whole_rows = balance_rows(b, false, opt.whole_rows).whole_rows;
    for (V4Pass& p : passes) {
      p.bal.weight = opt.load_balance_loss_weight;
      p.bal.main = balance_rows(*p.b, false, whole_rows);
      p.bal.mtp = balance_rows(*p.b, true, whole_rows);
    }
    out.moe_lb_loss = balance_loss(cfg, passes, balance_layers);
    out.loss += out.moe_lb_loss;
  }
  if (opt.expert_load)
    for (size_t l = 0; l < passes[0].saved.layers.size(); ++l) {
      std::vector<int64_t> load(static_cast<size_t>(cfg.n_routed_experts), 0);
      for (const V4Pass& p : passes)
        for (int32_t e : p.saved.layers[l].moe.r.experts) ++load[static_cast<size_t>(e)];
      out.expert_load.push_back(std::move(load));
    }
  if (!grads) return out;
  float* dhead = cfg.tie_word_embeddings ? grads->embed : grads->head;
  std::vector<Buffer<float>> dyn, dmtp;
  std::vector<Backward> bws;
  bws.reserve(passes.size());
  for (V4Pass& p : passes) {
    dyn.emplace_back(static_cast<size_t>(p.n * d));
    dmtp.emplace_back(p.mrows.size() * static_cast<size_t>(d));
    head_loss_backward(dyn.back().data(), dhead, p.main, p.hn.data(), head, p.n, d, opt.z_loss_multiplier,
                       opt.grad_scale / (norm + 1e-8));
    if (!p.mrows.empty())
      head_loss_backward(dmtp.back().data(), dhead, p.mtp, p.mtp_hn.data(), head, static_cast<int64_t>(p.mrows.size()),
                         d, 0.0, opt.mtp_loss_scaling_factor * opt.grad_scale / (mnorm + 1e-8));
    bws.emplace_back(cfg, w, *grads, model, p.saved, p.states, p.b->lengths);
    if (!balance_layers.empty()) {
      p.bal.dloss = opt.grad_scale / static_cast<double>(balance_layers.size());
      bws.back().set_balance(&p.bal);
    }
  }
  backward_passes(bws, dyn, dmtp, with_mtp, opt.stream, L);
  return out;
}

}  // namespace ds::model
