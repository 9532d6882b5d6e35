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
#include "model/stages.h"
#include "model/v4_balance.h"
#include "model/v4_model.h"
#include "model/weights.h"
#include "ops/activations.h"
#include "ops/compressor.h"
#include "ops/expert_selection.h"
#include "ops/linear.h"
#include "ops/mhc.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
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

  // dyn, the gradient of the main head's normed rows [n, d] (and the MTP
  // layer's, when it ran), the LM head's own gradient already taken -> every
  // other parameter's gradient.
  void run(const Buffer<float>& dyn, const Buffer<float>* dmtp) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult;
    // The head's saved streams are row t's for every token t, in order.
    bool every_row = static_cast<int64_t>(sv_.logit_rows.size()) == n_;
    for (int64_t t = 0; every_row && t < n_; ++t) every_row = sv_.logit_rows[static_cast<size_t>(t)] == t;
    DS_CHECK(every_row, "internal: the V4 backward needs the head's saved streams of all {} tokens in order", n_);
    Buffer<float> dX = zeros(n_ * hc * d);
    head(dX.data(), dyn.data(), sv_.head, w_.hc_head_fn, w_.hc_head_base, w_.hc_head_scale, w_.norm, g_.hc_head_fn,
         g_.hc_head_base, g_.hc_head_scale, g_.norm, n_);
    LayerStream* stream = model_.options().stream;
    const int64_t L = c_.num_hidden_layers;
    if (dmtp && !sv_.mtp.empty()) {
      if (stream) stream->acquire(L, true);
      if (!sv_.mtp[0].rows.empty()) mtp(dX, *dmtp);
      if (stream) stream->release(L, true);
    }
    for (int64_t l = L - 1; l >= 0; --l) {
      if (stream) stream->acquire(l, true);
      layer(l, dX);
      if (stream) stream->release(l, true);
    }
    // The embedding fed every stream.
    if (g_.embed)
      for (int64_t t = 0; t < n_; ++t) {
        float* row = g_.embed + static_cast<int64_t>(sv_.ids[static_cast<size_t>(t)]) * d;
        for (int64_t j = 0; j < hc; ++j) {
          const float* src = dX.data() + (t * hc + j) * d;
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
    ops::mhc_head_backward(dX, gfn, gbase, gscale, dy.data(), hs.X.data(), vector_data(fn), vector_data(base),
                           vector_data(scale), v4_mhc_dims(c_, R));
  }

  // The MTP layer: its head, its block (layer num_hidden_layers over the MTP
  // rows), the two projections and norms; dX (the main streams) and the
  // embedding (the next tokens) +=.
  void mtp(Buffer<float>& dX, const Buffer<float>& dyn) {
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
    layer(l, dXm);
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
  void layer(int64_t l, Buffer<float>& dX) {
    model_.rerun_layer(l, sv_);
    layer_backward(l, dX);
    sv_.layers[static_cast<size_t>(l)] = V4LayerSaved();
  }

  void layer_backward(int64_t l, Buffer<float>& dX) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult;
    const auto& s = sv_.layers[static_cast<size_t>(l)];
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    Buffer<float> dsub = zeros(n_ * d), dX1 = zeros(n_ * hc * d), dpost = zeros(n_ * hc), dcomb = zeros(n_ * hc * hc),
                  da(static_cast<size_t>(n_ * d));
    // The MoE sub-layer.
    ops::mhc_post_backward(dsub.data(), dX1.data(), dpost.data(), dcomb.data(), dX.data(), s.fo.data(), s.X1.data(),
                           s.fpost.data(), s.fcomb.data(), md_);
    moe(da.data(), dsub.data(), s.moe, s.f.data(), l);
    ops::rmsnorm_backward(da.data(), G.ffn_norm, da.data(), s.f0.data(), vector_data(L.ffn_norm), s.rstd_f.data(), n_,
                          d);
    ops::mhc_pre_backward(dX1.data(), G.hc_ffn_fn, G.hc_ffn_base, G.hc_ffn_scale, da.data(), dpost.data(), dcomb.data(),
                          s.X1.data(), vector_data(L.hc_ffn_fn), vector_data(L.hc_ffn_base),
                          vector_data(L.hc_ffn_scale), md_);
    // The attention sub-layer.
    for (Buffer<float>* b : {&dsub, &dpost, &dcomb, &dX}) zero(*b);
    ops::mhc_post_backward(dsub.data(), dX.data(), dpost.data(), dcomb.data(), dX1.data(), s.o.data(), s.X.data(),
                           s.post.data(), s.comb.data(), md_);
    zero(da);
    attention(da.data(), dsub.data(), s.attn, s.a.data(), l);
    ops::rmsnorm_backward(da.data(), G.attn_norm, da.data(), s.a0.data(), vector_data(L.attn_norm), s.rstd_a.data(), n_,
                          d);
    ops::mhc_pre_backward(dX.data(), G.hc_attn_fn, G.hc_attn_base, G.hc_attn_scale, da.data(), dpost.data(),
                          dcomb.data(), s.X.data(), vector_data(L.hc_attn_fn), vector_data(L.hc_attn_base),
                          vector_data(L.hc_attn_scale), md_);
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
    // The sparse attention: its keys are rows of kv or compressed entries.
    Buffer<float> dkv = zeros(n_ * D);
    const int64_t S = static_cast<int64_t>(len_.size());
    std::vector<Buffer<float>> dent(static_cast<size_t>(S));
    for (int64_t k = 0; k < S; ++k) dent[static_cast<size_t>(k)] = zeros(static_cast<int64_t>(entries(k, l).size()));
    std::vector<const float*> rows(s.key_idx.size());
    std::vector<float*> drows(s.key_idx.size());
    for (size_t j = 0; j < rows.size(); ++j) {
      const int32_t seg = s.key_seg[j];
      const int64_t idx = s.key_idx[j];
      rows[j] = seg < 0 ? s.kv.data() + idx * D : entries(seg, l).data() + idx * D;
      drows[j] = seg < 0 ? dkv.data() + idx * D : dent[static_cast<size_t>(seg)].data() + idx * D;
    }
    const ops::SparseMqaDims sd = v4_attention_dims(c_, n_);
    ops::sparse_mqa_backward(dq.data(), drows.data(), g.sink, dO.data(), s.o.data(), s.lse.data(), s.q.data(),
                             rows.data(), s.offsets.data(), vector_data(p.sink), sd);
    // q: RoPE, the weightless head norm, wq_b, q_norm, wq_a.
    const std::vector<float> ones(static_cast<size_t>(D), 1.0f);
    ops::rope_backward(dq.data() + N, dq.data() + N, pos, freqs, n_, H, R, H * D, D, ops::RopeLayout::Interleaved);
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
    if (m > 0) {
      // Every sequence's projection gradients, then the two projections'
      // backward over all rows at once.
      const auto& cp = p.compressor;
      auto& cg = g.compressor;
      need_vector_data(cp.wkv, "compressor.wkv");
      need_vector_data(cp.wgate, "compressor.wgate");
      const int64_t width = (m == 4 ? 2 : 1) * D;
      Buffer<float> dP(static_cast<size_t>(n_ * width)), dZ(dP.size());
      for (int64_t k = 0; k < S; ++k) {
        const size_t ks = static_cast<size_t>(k);
        compressor(dP.data() + first_[ks] * width, dZ.data() + first_[ks] * width, dent[ks], s.comp[ks], len_[ks], l);
      }
      ops::linear_backward(da, cg.wkv, dP.data(), a, cp.wkv, n_, true);
      ops::linear_backward(da, cg.wgate, dZ.data(), a, cp.wgate, n_, true);
    }
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
  void moe(float* dx, const float* dout, const V4MoeSaved& s, const float* x, int64_t l) {
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    const int64_t d = c_.hidden_size, E = c_.n_routed_experts, K = c_.num_experts_per_tok;
    const int64_t I = c_.moe_intermediate_size;
    const float limit = static_cast<float>(c_.swiglu_limit);
    parallel_zero(dx, n_ * d);
    // w2(silu(w1 x) * w3 x) backward: dxs (+=) from dy.
    auto swiglu = [&](float* dxs, const float* dy, const float* xs, int64_t rows, const float* gv, const float* uv,
                      const float* hv, const V4MlpParams<View>& mp, V4MlpParams<float*>& mg) {
      for (const View* v : {&mp.w1, &mp.w3, &mp.w2}) need_vector_data(*v, "an expert");
      Buffer<float> dh(static_cast<size_t>(rows * I)), dg(dh.size()), du(dh.size());
      ops::linear_backward(dh.data(), mg.w2, dy, hv, mp.w2, rows);
      ops::silu_mul_backward(dg.data(), du.data(), dh.data(), gv, uv, rows * I, limit);
      ops::linear_backward(dxs, mg.w1, dg.data(), xs, mp.w1, rows, true);
      ops::linear_backward(dxs, mg.w3, du.data(), xs, mp.w3, rows, true);
    };
    // The forward's tasks: one per expert (its weight gradients are sums over
    // its rows, so one task owns them all), the shared expert's into dx. The
    // routed experts' input gradients land in dxs, expert-major, and are
    // added to dx afterwards in expert order.
    const V4ExpertRows& er = s.rows;
    Buffer<float> dweights = zeros(n_ * K), dxs = zeros(n_ * K * d);
    if (model_.options().exchange) {
      moe_exchanged(dx, dweights, dxs, dout, s, x, l, swiglu);
    } else {
      parallel_tasks(static_cast<int64_t>(er.tasks.size()), er.as_tasks(d, I), [&](int64_t task) {
        const int64_t e = er.tasks[static_cast<size_t>(task)];
        const size_t ei = static_cast<size_t>(e);
        if (e < 0) {
          swiglu(dx, dout, x, n_, s.sg.data(), s.su.data(), s.sh.data(), L.shared, G.shared);
          return;
        }
        // The combine weights' and the rows' gradients.
        const int64_t r0 = er.first[ei], cnt = er.rows(e);
        Buffer<float> xs(static_cast<size_t>(cnt * d)), dy(xs.size());
        for (int64_t j = 0; j < cnt; ++j) {
          const int64_t asg = er.assignment[static_cast<size_t>(r0 + j)], t = asg / K;
          const float wgt = s.weights[static_cast<size_t>(asg)];
          const float* y = s.y.data() + (r0 + j) * d;
          double dot = 0;
          for (int64_t i = 0; i < d; ++i) {
            dot += static_cast<double>(dout[t * d + i]) * y[i];
            dy[static_cast<size_t>(j * d + i)] = wgt * dout[t * d + i];
            xs[static_cast<size_t>(j * d + i)] = x[t * d + i];
          }
          dweights[static_cast<size_t>(asg)] = static_cast<float>(dot);
        }
        swiglu(dxs.data() + r0 * d, dy.data(), xs.data(), cnt, s.g.data() + r0 * I, s.u.data() + r0 * I,
               s.h.data() + r0 * I, L.experts[ei], G.experts[ei]);
      });
    }
    v4_add_by_expert(dx, dxs.data(), nullptr, er, n_, K, d);
    // The router, through the combine weights (its choices are constants).
    Buffer<float> dlogits(static_cast<size_t>(n_ * E));
    ops::expert_selection_backward(dlogits.data(), dweights.data(), s.scores.data(), s.experts.data(), n_,
                                   v4_selection_config(c_));
    if (balance_ && !c_.hash_routed(l))
      v4_balance_loss_backward(dlogits.data(), s.scores.data(), s.experts.data(),
                               s.bias.empty() ? nullptr : s.bias.data(), *balance_rows_, E, K, balance_->weight,
                               balance_->dloss);
    need_vector_data(L.gate, "ffn.gate");
    ops::linear_backward(dx, G.gate, dlogits.data(), x, L.gate, n_, true);
  }

  // The routed experts' backward under expert parallelism: the output
  // rows' gradients travel to their experts' ranks (the transpose of the
  // forward's undispatch), the experts' input gradients come back; dxs
  // [n K, d] (expert-major, this rank's order) and dweights `=`, the shared
  // expert's input gradient into dx.
  template <class Swiglu>
  void moe_exchanged(float* dx, Buffer<float>& dweights, Buffer<float>& dxs, const float* dout, const V4MoeSaved& s,
                     const float* x, int64_t l, Swiglu&& swiglu) {
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    const int64_t d = c_.hidden_size, K = c_.num_experts_per_tok, I = c_.moe_intermediate_size;
    TokenExchange& ex = *model_.options().exchange;
    const V4ExpertRows& er = s.rows;
    const int64_t A = n_ * K, R = s.plan.local_rows;
    Buffer<float> dy(static_cast<size_t>(A * d));
    parallel_ranges(A, true, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t asg = er.assignment[static_cast<size_t>(r)], t = asg / K;
        const float wgt = s.weights[static_cast<size_t>(asg)];
        const float* y = s.y.data() + r * d;
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) {
          dot += static_cast<double>(dout[t * d + i]) * y[i];
          dy[static_cast<size_t>(r * d + i)] = wgt * dout[t * d + i];
        }
        dweights[static_cast<size_t>(asg)] = static_cast<float>(dot);
      }
    });
    Buffer<float> dyl(static_cast<size_t>(R * d));
    ex.dispatch_gradient(dyl.data(), dy.data(), s.plan, d);
    Buffer<float> dxl = zeros(R * d);
    const V4ExpertRows& local = s.local;
    parallel_tasks(static_cast<int64_t>(local.tasks.size()), local.as_tasks(d, I), [&](int64_t task) {
      const int64_t e = local.tasks[static_cast<size_t>(task)];
      if (e < 0) {
        swiglu(dx, dout, x, n_, s.sg.data(), s.su.data(), s.sh.data(), L.shared, G.shared);
        return;
      }
      const int64_t r0 = local.first[static_cast<size_t>(e)];
      swiglu(dxl.data() + r0 * d, dyl.data() + r0 * d, s.xl.data() + r0 * d, local.rows(e), s.g.data() + r0 * I,
             s.u.data() + r0 * I, s.h.data() + r0 * I, L.experts[static_cast<size_t>(e)],
             G.experts[static_cast<size_t>(e)]);
    });
    ex.undispatch(dxs.data(), dxl.data(), s.plan, d);
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
  int64_t n_;  // rows of the pass (the batch's tokens, or the MTP layer's rows)
  ops::MhcDims md_;
  const int32_t* pos_;  // their positions
};

}  // namespace

std::pair<bool, bool> v4_remat_keeps(const RematPolicy& p) {
  using R = Residual;
  auto all = [&](std::initializer_list<Residual> names) {
    for (Residual r : names)
      if (!p.kept(r)) return false;
    return true;
  };
  return {all({R::query_wa_proj, R::mla_q, R::kv_wa_proj, R::mla_kv, R::query_proj, R::context, R::attention_out,
               R::out_proj}),
          all({R::mlpwi_0, R::mlpwi_1, R::mlpwo, R::moe_mlpwi_0, R::moe_mlpwi_1, R::moe_mlpwo})};
}

int64_t V4FlatParams::numel(const V4Config& c) {
  int64_t n = 0;
  for_each_v4_param(c, [&](const V4ParamInfo& i) { n += shape_numel(i.shape); });
  return n;
}

V4FlatParams V4FlatParams::wrap(const V4Config& c, float* base) {
  V4FlatParams f;
  f.ptr = make_v4_params<float*>(c);
  int64_t off = 0;
  for_each_v4_param(
      c,
      [&](const V4ParamInfo& i, float*& p) {
        p = base + off;
        off += shape_numel(i.shape);
      },
      f.ptr);
  return f;
}

V4FlatParams V4FlatParams::zeros(const V4Config& c) {
  std::vector<float> data(static_cast<size_t>(numel(c)), 0.0f);
  V4FlatParams f = over(c, data.data());
  f.data = std::move(data);  // the heap block moves with it: the pointers and views stay valid
  return f;
}

V4FlatParams V4FlatParams::over(const V4Config& c, float* base) {
  V4FlatParams f = wrap(c, base);
  f.tables.resize(static_cast<size_t>(c.num_hidden_layers));
  f.view = make_v4_params<ops::WeightView>(c);
  for_each_v4_param(
      c,
      [&](const V4ParamInfo& i, float* const& p, ops::WeightView& v) {
        const int64_t rows = i.shape[0], cols = i.shape.size() > 1 ? i.shape[1] : 1;
        if (i.role == V4Role::HashTable) {
          auto& t = f.tables[static_cast<size_t>(i.layer)];
          t.assign(static_cast<size_t>(rows * cols), 0);
          v = {t.data(), DType::I32, rows, cols, nullptr, 128, 128};
        } else {
          v = {p, DType::F32, rows, cols, nullptr, 128, 128};
        }
      },
      f.ptr, f.view);
  if (c.tie_word_embeddings) f.view.head = f.view.embed;
  return f;
}

void v4_hash_table(const V4Config& c, const std::string& name, const float* f, int64_t cols,
                   std::vector<int32_t>& table) {
  for (size_t k = 0; k < table.size(); ++k) {
    const float e = f[k];
    DS_CHECK(e >= 0 && e < static_cast<float>(c.n_routed_experts) && e == std::floor(e),
             "'{}' routes token {} to {}, not an expert id in [0, {})", name, k / static_cast<size_t>(cols), e,
             c.n_routed_experts);
    table[k] = static_cast<int32_t>(e);
  }
}

void V4FlatParams::sync_tables(const V4Config& c) {
  for_each_v4_param(
      c,
      [&](const V4ParamInfo& i, float* const& p) {
        if (i.role == V4Role::HashTable) v4_hash_table(c, i.name, p, i.shape[1], tables[static_cast<size_t>(i.layer)]);
      },
      ptr);
}

std::vector<ParamInfo> v4_param_infos(const V4Config& c) {
  std::vector<ParamInfo> out;
  for_each_v4_param(c, [&](const V4ParamInfo& i) {
    // Vectors (norms, the sink, mHC mixes, position embeddings) are Norm:
    // no weight decay when 1-D.
    static const std::map<V4Role, ParamRole> role_of = {
        {V4Role::Embedding, ParamRole::Embedding}, {V4Role::Projection, ParamRole::Projection},
        {V4Role::Router, ParamRole::Router},       {V4Role::LmHead, ParamRole::LmHead},
        {V4Role::HashTable, ParamRole::Untrained}, {V4Role::Vector, ParamRole::Norm}};
    ParamRole role = role_of.at(i.role);
    if (i.name.ends_with(".ffn.gate.bias")) role = ParamRole::RoutingBias;
    if (i.name.find(".attn.indexer.") != std::string::npos) role = ParamRole::Untrained;
    out.push_back(ParamInfo{i.name, i.shape, role, i.layer});
  });
  return out;
}

V4TrainBatch V4TrainBatch::rows(int64_t batch, int64_t seq, std::vector<int32_t> inputs, std::vector<int32_t> targets) {
  DS_CHECK(batch > 0 && seq > 0 && static_cast<int64_t>(inputs.size()) == batch * seq &&
               static_cast<int64_t>(targets.size()) == batch * seq,
           "V4 training batch: {} rows of {} tokens need {} inputs and targets (got {}, {})", batch, seq, batch * seq,
           inputs.size(), targets.size());
  V4TrainBatch b;
  b.inputs = std::move(inputs);
  b.targets = std::move(targets);
  b.lengths.assign(static_cast<size_t>(batch), seq);
  return b;
}

V4TrainBatch V4TrainBatch::from_packed(const TrainBatch& p) {
  const int64_t n = p.batch * p.seq;
  DS_CHECK(p.batch > 0 && p.seq > 0 && static_cast<int64_t>(p.inputs.size()) == n &&
               static_cast<int64_t>(p.targets.size()) == n && static_cast<int64_t>(p.positions.size()) == n &&
               static_cast<int64_t>(p.segment_ids.size()) == n &&
               static_cast<int64_t>(p.target_segment_ids.size()) == n,
           "training batch of {} x {} tokens has fields of the wrong length", p.batch, p.seq);
  V4TrainBatch b;
  b.packed_rows = p.batch;
  b.counted.reserve(static_cast<size_t>(n));
  for (int64_t r = 0; r < p.batch; ++r)
    for (int64_t t = r * p.seq; t < (r + 1) * p.seq;) {
      const int32_t seg = p.segment_ids[static_cast<size_t>(t)];
      int64_t e = t + 1;
      while (e < (r + 1) * p.seq && p.segment_ids[static_cast<size_t>(e)] == seg) ++e;
      if (seg != 0) {
        // A document piece: its own sequence, which must count from 0.
        for (int64_t k = t; k < e; ++k)
          DS_CHECK(p.positions[static_cast<size_t>(k)] == k - t,
                   "row {}: segment {} has position {} at its token {}; DeepSeek-V4 trains on whole document pieces "
                   "whose positions count from 0",
                   r, seg, p.positions[static_cast<size_t>(k)], k - t);
        b.inputs.insert(b.inputs.end(), p.inputs.begin() + t, p.inputs.begin() + e);
        b.targets.insert(b.targets.end(), p.targets.begin() + t, p.targets.begin() + e);
        for (int64_t k = t; k < e; ++k) b.counted.push_back(p.target_segment_ids[static_cast<size_t>(k)] != 0);
        b.lengths.push_back(e - t);
        b.row_of.push_back(r);
      }
      t = e;
    }
  return b;
}

V4LossWeights v4_loss_weights(const V4TrainBatch& b) {
  V4LossWeights w;
  size_t at = 0;
  for (const int64_t L : b.lengths) {
    for (int64_t t = 0; t < L; ++t) {
      const bool c = b.counted.empty() || b.counted[at + static_cast<size_t>(t)];
      w.targets += c;
      w.mtp_targets += c && t >= 1;  // MTP row t - 1 predicts target t
    }
    at += static_cast<size_t>(L);
  }
  return w;
}

V4LossTerms v4_loss_and_grad(const V4Config& cfg, const V4View& w, V4Params<float*>* grads, const V4TrainBatch& b,
                             const V4LossOptions& opt) {
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
  const bool with_mtp = opt.mtp && cfg.num_nextn_predict_layers > 0;
  V4LossTerms out;
  DS_CHECK((!opt.exchange && !opt.stream) || n > 0,
           "expert parallelism or FSDP: this rank's share of the batch holds no token (only padding), and its peers "
           "wait on its collectives; use fewer ranks or longer documents");
  if (n == 0) {  // only padding: no term, no gradient, loads of zero
    if (opt.expert_load)
      out.expert_load.assign(static_cast<size_t>(cfg.num_hidden_layers + (with_mtp ? 1 : 0)),
                             std::vector<int64_t>(static_cast<size_t>(cfg.n_routed_experts), 0));
    return out;
  }
  V4Options mo;
  mo.qat = false;
  mo.exchange = opt.exchange;
  mo.stream = opt.stream;
  V4Model model(cfg, w, mo);
  // FSDP: the layers in order, the MTP block last, then (with a gradient)
  // back again.
  if (opt.stream) opt.stream->begin(cfg.num_hidden_layers + (with_mtp ? 1 : 0), grads != nullptr);
  std::vector<V4State> states;
  std::vector<V4Request> reqs;
  for (size_t k = 0; k < b.lengths.size(); ++k) states.push_back(model.new_state());
  int64_t at = 0;
  for (size_t k = 0; k < b.lengths.size(); ++k) {
    reqs.push_back({&states[k], b.inputs.data() + at, b.lengths[k]});
    at += b.lengths[k];
  }
  V4Saved saved;
  std::tie(saved.keep_attention, saved.keep_moe) = v4_remat_keeps(opt.remat);
  const bool want_saved = grads || opt.expert_load || opt.load_balance_loss_weight > 0;
  std::vector<float> mtp_hn;
  const std::vector<float> hn = model.forward_normed(reqs, want_saved ? &saved : nullptr, with_mtp ? &mtp_hn : nullptr);
  // The LM head and its loss fused, a vocabulary chunk at a time: no
  // [tokens, vocab] logits.
  const View& head = model.head_weight();
  const int64_t d = cfg.hidden_size;
  // Mean over counted targets of CE + z_loss_multiplier lse^2 (MaxText's
  // lm_loss holds the z term).
  std::vector<int64_t> rows(static_cast<size_t>(n));
  std::iota(rows.begin(), rows.end(), int64_t{0});
  const HeadLoss main = head_loss_rows(hn.data(), head, b, rows, d, opt.z_loss_multiplier);
  const double norm = opt.whole_targets > 0 ? opt.whole_targets : main.weight;
  out.tokens = static_cast<int64_t>(main.weight);
  out.lm_loss = (main.ce_sum + main.z_sum) / (norm + 1e-8);
  out.z_loss = main.z_sum / (norm + 1e-8);
  out.loss = out.lm_loss;
  // MaxText's MTP loss: factor x the mean over counted targets of the CE of
  // row t predicting target t + 1 (no z-loss); the MTP rows of each sequence
  // are its tokens but the last, in order.
  std::vector<int64_t> mrows;
  HeadLoss mtp;
  double mnorm = 0;
  if (with_mtp) {
    for (size_t k = 0, at = 0; k < b.lengths.size(); at += static_cast<size_t>(b.lengths[k]), ++k)
      for (int64_t t = 0; t + 1 < b.lengths[k]; ++t) mrows.push_back(static_cast<int64_t>(at) + t + 1);
    mtp = head_loss_rows(mtp_hn.data(), head, b, mrows, d, 0.0);
    mnorm = opt.whole_mtp_targets > 0 ? opt.whole_mtp_targets : mtp.weight;
    out.mtp_tokens = static_cast<int64_t>(mtp.weight);
    out.mtp_loss = opt.mtp_loss_scaling_factor * mtp.ce_sum / (mnorm + 1e-8);
    out.loss += out.mtp_loss;
  }
  out.saved_bytes = saved.bytes();
  // MaxText's balance loss: the mean over the score-routed layers (the MTP
  // block's included) of each one's.
  Balance bal;
  std::vector<int64_t> balance_layers;
  if (opt.load_balance_loss_weight > 0) {
    bal.weight = opt.load_balance_loss_weight;
    bal.main = balance_rows(b, false, opt.whole_rows);
    bal.mtp = balance_rows(b, true, opt.whole_rows);
    double sum = 0;
    for (size_t l = 0; l < saved.layers.size(); ++l) {
      const int64_t li = static_cast<int64_t>(l);
      if (cfg.hash_routed(li)) continue;
      const V4MoeSaved& m = saved.layers[l].moe;
      if (m.experts.empty()) continue;  // an MTP block without rows
      sum += v4_balance_loss(m.scores.data(), m.experts.data(), m.bias.empty() ? nullptr : m.bias.data(),
                             li < cfg.num_hidden_layers ? bal.main : bal.mtp, cfg.n_routed_experts,
                             cfg.num_experts_per_tok, bal.weight);
      balance_layers.push_back(li);
    }
    if (!balance_layers.empty()) out.moe_lb_loss = sum / static_cast<double>(balance_layers.size());
    out.loss += out.moe_lb_loss;
  }
  if (opt.expert_load)
    for (const auto& L : saved.layers) {
      std::vector<int64_t> load(static_cast<size_t>(cfg.n_routed_experts), 0);
      for (int32_t e : L.moe.experts) ++load[static_cast<size_t>(e)];
      out.expert_load.push_back(std::move(load));
    }
  if (grads) {
    float* dhead = cfg.tie_word_embeddings ? grads->embed : grads->head;
    Buffer<float> dyn(static_cast<size_t>(n * d)), dmtp(mrows.size() * static_cast<size_t>(d));
    head_loss_backward(dyn.data(), dhead, main, hn.data(), head, n, d, opt.z_loss_multiplier,
                       opt.grad_scale / (norm + 1e-8));
    if (!mrows.empty())
      head_loss_backward(dmtp.data(), dhead, mtp, mtp_hn.data(), head, static_cast<int64_t>(mrows.size()), d, 0.0,
                         opt.mtp_loss_scaling_factor * opt.grad_scale / (mnorm + 1e-8));
    Backward bw(cfg, w, *grads, model, saved, states, b.lengths);
    if (!balance_layers.empty()) {
      bal.dloss = opt.grad_scale / static_cast<double>(balance_layers.size());
      bw.set_balance(&bal);
    }
    bw.run(dyn, with_mtp ? &dmtp : nullptr);
  }
  return out;
}

}  // namespace ds::model
