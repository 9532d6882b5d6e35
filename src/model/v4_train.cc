#include "model/v4_train.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
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

std::vector<float> zeros(int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.0f); }

class Backward {
 public:
  Backward(const V4Config& c, const V4View& w, V4Params<float*>& g, const V4Model& model, const V4Saved& sv,
           std::vector<V4State>& states, int64_t batch, int64_t seq)
      : c_(c),
        w_(w),
        g_(g),
        model_(model),
        sv_(sv),
        states_(states),
        B_(batch),
        T_(seq),
        n_(batch * seq),
        md_(v4_mhc_dims(c, batch * seq)) {}

  // dlogits [n, V] -> every parameter's gradient.
  void run(const std::vector<float>& dlogits) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult;
    const View& head = c_.tie_word_embeddings ? w_.embed : w_.head;
    float* dhead = c_.tie_word_embeddings ? g_.embed : g_.head;
    need_vector_data(head, "head");
    std::vector<float> dy(static_cast<size_t>(n_ * d)), dX = zeros(n_ * hc * d);
    ops::linear_backward(dy.data(), dhead, dlogits.data(), sv_.yn.data(), head, n_);
    ops::rmsnorm_backward(dy.data(), g_.norm, dy.data(), sv_.y.data(), vector_data(w_.norm), sv_.rstd_y.data(), n_, d);
    ops::mhc_head_backward(dX.data(), g_.hc_head_fn, g_.hc_head_base, g_.hc_head_scale, dy.data(), sv_.X.data(),
                           vector_data(w_.hc_head_fn), vector_data(w_.hc_head_base), vector_data(w_.hc_head_scale),
                           md_);
    for (int64_t l = c_.num_hidden_layers - 1; l >= 0; --l) layer(l, dX);
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
  // dX holds dL/d(layer output) on entry, dL/d(layer input) on return.
  void layer(int64_t l, std::vector<float>& dX) {
    const int64_t d = c_.hidden_size, hc = c_.hc_mult;
    const auto& s = sv_.layers[static_cast<size_t>(l)];
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    std::vector<float> dsub = zeros(n_ * d), dX1 = zeros(n_ * hc * d), dpost = zeros(n_ * hc),
                       dcomb = zeros(n_ * hc * hc), da(static_cast<size_t>(n_ * d));
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
    std::fill(dsub.begin(), dsub.end(), 0.0f);
    std::fill(dpost.begin(), dpost.end(), 0.0f);
    std::fill(dcomb.begin(), dcomb.end(), 0.0f);
    std::fill(dX.begin(), dX.end(), 0.0f);
    ops::mhc_post_backward(dsub.data(), dX.data(), dpost.data(), dcomb.data(), dX1.data(), s.o.data(), s.X.data(),
                           s.post.data(), s.comb.data(), md_);
    std::fill(da.begin(), da.end(), 0.0f);
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
    const int64_t d = c_.hidden_size, H = c_.num_attention_heads, D = c_.head_dim, R = c_.qk_rope_head_dim;
    const int64_t N = D - R, Lq = c_.q_lora_rank, G = c_.o_groups, r = c_.o_lora_rank, gw = H * D / G;
    const int64_t m = c_.compress_ratio(l);
    const float* freqs = model_.rope_frequencies(l);
    const int32_t* pos = sv_.pos.data();
    for (const View* v : {&p.wq_a, &p.wq_b, &p.wkv, &p.wo_a, &p.wo_b}) need_vector_data(*v, "an attention projection");
    // out = wo_b z;  z_g = wo_a_g o2_g
    std::vector<float> dz(static_cast<size_t>(n_ * G * r)), dq(static_cast<size_t>(n_ * H * D));
    ops::linear_backward(dz.data(), g.wo_b, dout, s.z.data(), p.wo_b, n_);
    for (int64_t k = 0; k < G; ++k)
      ops::linear_backward(dq.data() + k * gw, g.wo_a ? g.wo_a + k * r * gw : nullptr, dz.data() + k * r,
                           s.o2.data() + k * gw, ops::row_slice(p.wo_a, k * r, (k + 1) * r), n_, H * D, G * r);
    // o2 = o rotated by -t: do = do2 rotated by +t.
    ops::rope_forward(dq.data() + N, dq.data() + N, pos, freqs, n_, H, R, H * D, D, ops::RopeLayout::Interleaved);
    std::vector<float> dO = dq;  // d(attention output)
    // The sparse attention: its keys are rows of kv or compressed entries.
    std::vector<float> dkv = zeros(n_ * D);
    std::vector<std::vector<float>> dent(static_cast<size_t>(B_));
    for (int64_t k = 0; k < B_; ++k) dent[static_cast<size_t>(k)] = zeros(static_cast<int64_t>(entries(k, l).size()));
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
    std::vector<float> dqr(static_cast<size_t>(n_ * Lq));
    ops::linear_backward(dqr.data(), g.wq_b, dq.data(), s.qr.data(), p.wq_b, n_);
    ops::rmsnorm_backward(dqr.data(), g.q_norm, dqr.data(), s.qr_lin.data(), vector_data(p.q_norm), s.rstd_qr.data(),
                          n_, Lq);
    ops::linear_backward(da, g.wq_a, dqr.data(), a, p.wq_a, n_, true);
    // The K=V latent: RoPE, kv_norm, wkv.
    ops::rope_backward(dkv.data() + N, dkv.data() + N, pos, freqs, n_, 1, R, D, D, ops::RopeLayout::Interleaved);
    ops::rmsnorm_backward(dkv.data(), g.kv_norm, dkv.data(), s.kv_lin.data(), vector_data(p.kv_norm), s.rstd_kv.data(),
                          n_, D);
    ops::linear_backward(da, g.wkv, dkv.data(), a, p.wkv, n_, true);
    if (m > 0)
      for (int64_t k = 0; k < B_; ++k)
        compressor(da + k * T_ * d, dent[static_cast<size_t>(k)], s.comp[static_cast<size_t>(k)], a + k * T_ * d, l);
  }

  // One sequence's compressed entries' gradient dE [entries, D] (consumed)
  // back through RoPE at b m, the norm, the pooling, the position
  // embedding and the two projections; da (that sequence's rows) +=.
  void compressor(float* da, std::vector<float>& dE, const V4CompressorSaved& cs, const float* a, int64_t l) {
    const auto& p = w_.layers[static_cast<size_t>(l)].attn.compressor;
    auto& g = g_.layers[static_cast<size_t>(l)].attn.compressor;
    const int64_t D = c_.head_dim, R = c_.qk_rope_head_dim, m = c_.compress_ratio(l);
    const int64_t nb = static_cast<int64_t>(dE.size()) / D;
    const ops::CompressorDims dims{T_, D, m, m == 4};
    const int64_t width = dims.width();
    need_vector_data(p.wkv, "compressor.wkv");
    need_vector_data(p.wgate, "compressor.wgate");
    if (nb > 0) {
      std::vector<int32_t> epos(static_cast<size_t>(nb));
      for (int64_t b = 0; b < nb; ++b) epos[static_cast<size_t>(b)] = static_cast<int32_t>(b * m);
      ops::rope_backward(dE.data() + D - R, dE.data() + D - R, epos.data(), model_.rope_frequencies(l), nb, 1, R, D, D,
                         ops::RopeLayout::Interleaved);
      ops::rmsnorm_backward(dE.data(), g.norm, dE.data(), cs.pooled.data(), vector_data(p.norm), cs.rstd.data(), nb, D);
    }
    std::vector<float> dP = zeros(T_ * width), dZ = zeros(T_ * width);
    ops::compressor_pool_backward(dP.data(), dZ.data(), dE.data(), cs.P.data(), cs.Z.data(), dims);
    if (g.ape)
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t i = 0; i < width; ++i) g.ape[(t % m) * width + i] += dZ[static_cast<size_t>(t * width + i)];
    ops::linear_backward(da, g.wkv, dP.data(), a, p.wkv, T_, true);
    ops::linear_backward(da, g.wgate, dZ.data(), a, p.wgate, T_, true);
  }

  // dx [n, d] `=` from the MoE's output gradient dout.
  void moe(float* dx, const float* dout, const V4MoeSaved& s, const float* x, int64_t l) {
    const auto& L = w_.layers[static_cast<size_t>(l)];
    auto& G = g_.layers[static_cast<size_t>(l)];
    const int64_t d = c_.hidden_size, E = c_.n_routed_experts, K = c_.num_experts_per_tok;
    const int64_t I = c_.moe_intermediate_size;
    const float limit = static_cast<float>(c_.swiglu_limit);
    std::fill(dx, dx + n_ * d, 0.0f);
    // w2(silu(w1 x) * w3 x) backward: dxs (+=) from dy.
    auto swiglu = [&](float* dxs, const float* dy, const float* xs, int64_t rows, const std::vector<float>& gv,
                      const std::vector<float>& uv, const std::vector<float>& hv, const V4MlpParams<View>& mp,
                      V4MlpParams<float*>& mg) {
      for (const View* v : {&mp.w1, &mp.w3, &mp.w2}) need_vector_data(*v, "an expert");
      std::vector<float> dh(static_cast<size_t>(rows * I)), dg(dh.size()), du(dh.size());
      ops::linear_backward(dh.data(), mg.w2, dy, hv.data(), mp.w2, rows);
      ops::silu_mul_backward(dg.data(), du.data(), dh.data(), gv.data(), uv.data(), rows * I, limit);
      ops::linear_backward(dxs, mg.w1, dg.data(), xs, mp.w1, rows, true);
      ops::linear_backward(dxs, mg.w3, du.data(), xs, mp.w3, rows, true);
    };
    if (c_.n_shared_experts > 0) swiglu(dx, dout, x, n_, s.sg, s.su, s.sh, L.shared, G.shared);
    // Routed experts: the combine weights' and the rows' gradients.
    std::vector<float> dweights = zeros(n_ * K), xs, dy, dxs;
    for (int64_t e = 0; e < E; ++e) {
      const auto& list = s.rows[static_cast<size_t>(e)];
      if (list.empty()) continue;
      const int64_t cnt = static_cast<int64_t>(list.size());
      const std::vector<float>& y = s.y[static_cast<size_t>(e)];
      xs.resize(static_cast<size_t>(cnt * d));
      dy.resize(xs.size());
      dxs.assign(xs.size(), 0.0f);
      for (int64_t j = 0; j < cnt; ++j) {
        const int64_t asg = list[static_cast<size_t>(j)], t = asg / K;
        const float wgt = s.weights[static_cast<size_t>(asg)];
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) {
          dot += static_cast<double>(dout[t * d + i]) * y[static_cast<size_t>(j * d + i)];
          dy[static_cast<size_t>(j * d + i)] = wgt * dout[t * d + i];
          xs[static_cast<size_t>(j * d + i)] = x[t * d + i];
        }
        dweights[static_cast<size_t>(asg)] = static_cast<float>(dot);
      }
      const size_t ei = static_cast<size_t>(e);
      swiglu(dxs.data(), dy.data(), xs.data(), cnt, s.g[ei], s.u[ei], s.h[ei], L.experts[ei], G.experts[ei]);
      for (int64_t j = 0; j < cnt; ++j) {
        const int64_t t = list[static_cast<size_t>(j)] / K;
        for (int64_t i = 0; i < d; ++i) dx[t * d + i] += dxs[static_cast<size_t>(j * d + i)];
      }
    }
    // The router, through the combine weights (its choices are constants).
    std::vector<float> dlogits(static_cast<size_t>(n_ * E));
    ops::expert_selection_backward(dlogits.data(), dweights.data(), s.scores.data(), s.experts.data(), n_,
                                   v4_selection_config(c_));
    need_vector_data(L.gate, "ffn.gate");
    ops::linear_backward(dx, G.gate, dlogits.data(), x, L.gate, n_, true);
  }

  const std::vector<float>& entries(int64_t seq, int64_t l) const {
    return states_[static_cast<size_t>(seq)].layers[static_cast<size_t>(l)].entries;
  }

  const V4Config& c_;
  const V4View& w_;
  V4Params<float*>& g_;
  const V4Model& model_;
  const V4Saved& sv_;
  std::vector<V4State>& states_;
  int64_t B_, T_, n_;
  ops::MhcDims md_;
};

}  // namespace

V4LossTerms v4_loss_and_grad(const V4Config& cfg, const V4View& w, V4Params<float*>* grads, const V4TrainBatch& b) {
  const int64_t B = b.batch, T = b.seq, V = cfg.vocab_size;
  DS_CHECK(B > 0 && T > 0 && static_cast<int64_t>(b.inputs.size()) == B * T &&
               static_cast<int64_t>(b.targets.size()) == B * T,
           "V4 training batch: {} rows of {} tokens need {} inputs and targets (got {}, {})", B, T, B * T,
           b.inputs.size(), b.targets.size());
  for (int32_t t : b.targets) DS_CHECK(t >= 0 && t < V, "target {} is outside the vocabulary of {}", t, V);
  V4Model model(cfg, w, V4Options{false});
  std::vector<V4State> states;
  std::vector<V4Request> reqs;
  for (int64_t r = 0; r < B; ++r) states.push_back(model.new_state());
  for (int64_t r = 0; r < B; ++r) reqs.push_back({&states[static_cast<size_t>(r)], b.inputs.data() + r * T, T});
  V4Saved saved;
  std::vector<float> logits = model.forward(reqs, true, grads ? &saved : nullptr);
  // Mean cross-entropy; logits become dloss/dlogits in place.
  const int64_t n = B * T;
  double loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    float* z = logits.data() + i * V;
    const float mx = *std::max_element(z, z + V);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(z[v]) - mx);
    const double lse = mx + std::log(sum);
    const int32_t target = b.targets[static_cast<size_t>(i)];
    loss += lse - z[target];
    for (int64_t v = 0; v < V; ++v) z[v] = static_cast<float>(std::exp(z[v] - lse) / static_cast<double>(n));
    z[target] -= static_cast<float>(1.0 / static_cast<double>(n));
  }
  V4LossTerms out;
  out.loss = loss / static_cast<double>(n);
  out.tokens = n;
  if (grads) Backward(cfg, w, *grads, model, saved, states, B, T).run(logits);
  return out;
}

}  // namespace ds::model
