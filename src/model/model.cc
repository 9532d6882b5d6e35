#include "model/model.h"

#include <cmath>
#include <cstring>

#include "core/buffer.h"
#include "core/error.h"
#include "model/mhc_block.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"

namespace ds::model {

int64_t FlatParams::numel(const ModelConfig& cfg, int64_t mtp_layers) {
  int64_t total = 0;
  for_each_param(cfg, mtp_layers, [&](const ParamInfo& i) { total += i.numel(); });
  return total;
}

FlatParams FlatParams::wrap(const ModelConfig& cfg, int64_t mtp_layers, float* base) {
  FlatParams f;
  f.ptr = make_params<float*>(cfg, mtp_layers);
  int64_t off = 0;
  for_each_param(
      cfg, mtp_layers,
      [&](const ParamInfo& i, float*& p) {
        p = base + off;
        off += i.numel();
      },
      f.ptr);
  if (cfg.tie_word_embeddings) f.ptr.lm_head = f.ptr.embed;
  f.view = map_params<ops::WeightView>(cfg, f.ptr, [](const ParamInfo& i, float* const& p) {
    return f32_view(p, i.shape[0], i.shape.size() > 1 ? i.shape[1] : 1);
  });
  return f;
}

FlatParams FlatParams::zeros(const ModelConfig& cfg, int64_t mtp_layers) {
  std::vector<float> data(static_cast<size_t>(numel(cfg, mtp_layers)), 0.0f);
  FlatParams f = wrap(cfg, mtp_layers, data.data());
  f.data = std::move(data);  // the heap block moves with it: the views stay valid
  return f;
}

void TrainBatch::check(const ModelConfig& cfg) const {
  const size_t n = static_cast<size_t>(batch * seq);
  DS_CHECK(batch >= 1 && seq >= 1, "batch: {} rows of {} tokens", batch, seq);
  DS_CHECK(inputs.size() == n && targets.size() == n && positions.size() == n && segment_ids.size() == n &&
               target_segment_ids.size() == n,
           "batch: every field must hold {} x {} values", batch, seq);
  for (size_t i = 0; i < n; ++i) {
    DS_CHECK(inputs[i] >= 0 && inputs[i] < cfg.vocab_size && targets[i] >= 0 && targets[i] < cfg.vocab_size,
             "batch: token id outside the vocabulary of {} at row {}, column {}", cfg.vocab_size,
             static_cast<int64_t>(i) / seq, static_cast<int64_t>(i) % seq);
    DS_CHECK(positions[i] >= 0 && positions[i] < cfg.max_position_embeddings,
             "batch: position {} outside [0, max_position_embeddings {})", positions[i], cfg.max_position_embeddings);
  }
}

namespace {

// MaxText's segment-aware left shift: x[i] takes x[i+1], or 0 where i is a
// row's last column, the segment changes, or i is padding (segment 0).
std::vector<int32_t> roll_in_segment(const std::vector<int32_t>& x, const std::vector<int32_t>& seg, int64_t B,
                                     int64_t T) {
  std::vector<int32_t> y(x.size(), 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i + 1 < T; ++i) {
      const int64_t a = b * T + i;
      if (seg[a] != 0 && seg[a] == seg[a + 1]) y[a] = x[a + 1];
    }
  return y;
}
std::vector<int32_t> roll(const std::vector<int32_t>& x, int64_t B, int64_t T) {
  std::vector<int32_t> y(x.size(), 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i + 1 < T; ++i) y[b * T + i] = x[b * T + i + 1];
  return y;
}

float eps(const ModelConfig& c) { return static_cast<float>(c.rms_norm_eps); }

// One MTP depth's forward state.
struct MtpDepth {
  std::vector<int32_t> ids, targets, mask;
  Buffer<float> e, en, erstd, hn_prev, hrstd, x;  // embedding, its norm, previous hidden's norm, eh_proj output
  std::vector<LayerSaved> saved;                  // per micro-batch
  Buffer<float> h, hn, hnrstd;                    // layer output and its shared_head.norm
  HeadLoss head;
};

}  // namespace

LossOptions::Whole loss_weights(const TrainBatch& b, int64_t mtp_layers) {
  LossOptions::Whole w;
  w.rows = b.batch;
  std::vector<int32_t> tm(b.target_segment_ids.size()), seg = b.segment_ids;
  for (size_t t = 0; t < tm.size(); ++t) {
    tm[t] = b.target_segment_ids[t] != 0;
    w.targets += tm[t];
  }
  for (int64_t k = 0; k < mtp_layers; ++k) {
    tm = roll_in_segment(tm, seg, b.batch, b.seq);
    seg = roll(seg, b.batch, b.seq);
    for (int32_t m : tm) w.mtp_targets += m != 0;
  }
  return w;
}

LossTerms loss_and_grad(const ModelConfig& cfg, const ParamsView& w, ModelParams<float*>* grads, const TrainBatch& b,
                        const LossOptions& opt, const RematPolicy& policy) {
  b.check(cfg);
  const int64_t B = b.batch, T = b.seq, N = B * T, D = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t L = cfg.num_hidden_layers, K = opt.mtp_num_layers;
  DS_CHECK(static_cast<int64_t>(w.mtp.size()) >= K, "mtp_num_layers {} but the parameters hold {} MTP depths", K,
           w.mtp.size());
  DS_CHECK(w.embed.dtype == DType::F32 && w.lm_head.dtype == DType::F32, "training needs float32 parameters");
  StageConfig s(cfg);
  s.task_parallel_assignments = 0;  // training: always the row-task expert schedule
  s.load_balance_loss_weight = opt.load_balance_loss_weight;
  s.exchange = opt.exchange;
  s.indexer_sparse = opt.indexer_sparse_training && cfg.index_n_heads > 0;
  const bool shard = opt.whole.rows > 0;
  // The balance loss is a mean over rows: a shard's share has the whole batch's row count.
  if (shard) s.load_balance_loss_weight *= static_cast<double>(B) / static_cast<double>(opt.whole.rows);
  const TokenLayout layout{B, T, b.positions.data(), b.segment_ids.data()};
  LossTerms out;
  LayerStream* const stream = opt.stream;
  auto acquire = [&](int64_t u, bool bwd) {
    if (stream) stream->acquire(u, bwd);
  };
  auto release = [&](int64_t u, bool bwd) {
    if (stream) stream->release(u, bwd);
  };
  if (stream) stream->begin(L + K, grads != nullptr);

  // Forward. With mHC the layers carry k streams [N, k, D], each starting
  // as the embedding and summed before the final norm.
  const bool mhc = cfg.has_mhc();
  const int64_t k_streams = cfg.mhc_expansion_rate;
  DS_CHECK(!mhc || K == 0, "mhc_expansion_rate {} with mtp_num_layers {}: MTP is not defined for mHC models",
           k_streams, K);
  Buffer<float> h(N * cfg.residual_width()), hsum;
  if (mhc) {
    hsum.resize(N * D);
    ops::embedding_forward(hsum.data(), b.inputs.data(), static_cast<const float*>(w.embed.data), N, V, D);
    mhc_expand(h.data(), hsum.data(), N, k_streams, D);
  } else {
    ops::embedding_forward(h.data(), b.inputs.data(), static_cast<const float*>(w.embed.data), N, V, D);
  }
  // Residuals per layer and micro-batch (the batch-split schedule's parts).
  const int64_t M = opt.batch_split_factor;
  DS_CHECK(M >= 1 && B % M == 0, "batch_split_factor {} does not divide the {} rows of the batch", M, B);
  std::vector<std::vector<LayerSaved>> saved(static_cast<size_t>(L), std::vector<LayerSaved>(static_cast<size_t>(M)));
  auto forward_layer = [&](float* x, const LayerView& lw, int64_t l, std::vector<LayerSaved>& sv, LayerStats* st) {
    if (M == 1)
      layer_forward(x, lw, l, s, layout, nullptr, &sv[0], policy, st);
    else
      layer_forward_split(x, lw, l, s, layout, sv, policy, st);
  };
  double indexer_kl = 0;  // summed over the main layers' queries
  auto backward_layer = [&](float* dx, LayerGrads& lg, std::vector<LayerSaved>& sv, const LayerView& lw, int64_t l,
                            double dloss_lb) {
    if (M == 1)
      layer_backward(dx, lg, sv[0], lw, l, s, layout, dloss_lb, &indexer_kl);
    else
      layer_backward_split(dx, lg, sv, lw, l, s, layout, dloss_lb, &indexer_kl);
  };
  std::vector<double> lb;
  for (int64_t l = 0; l < L; ++l) {
    LayerStats st;
    acquire(l, false);
    forward_layer(h.data(), w.layers[l], l, saved[l], &st);
    release(l, false);
    if (cfg.is_moe_layer(l)) {
      out.expert_load.push_back(st.load);
      lb.push_back(st.lb_loss);
    }
  }
  if (mhc) mhc_reduce(hsum.data(), h.data(), N, k_streams, D);
  const float* h_last = mhc ? hsum.data() : h.data();  // the final norm's input [N, D]
  Buffer<float> hn(N * D), rstd(N);
  ops::rmsnorm_forward(hn.data(), rstd.data(), h_last, vector_data(w.final_norm), N, D, eps(cfg));
  HeadLoss main;
  head_loss_forward(main, hn.data(), w.lm_head, b.targets, b.target_segment_ids, N, D, opt.z_loss_multiplier);
  out.tokens = main.weight;
  const double denom = (shard ? opt.whole.targets : main.weight) + 1e-8;
  out.lm_loss = (main.ce_sum + main.z_sum) / denom;
  out.z_loss = main.z_sum / denom;

  std::vector<MtpDepth> mtp(static_cast<size_t>(K));
  double mtp_ce = 0, mtp_weight = 0;
  {
    std::vector<int32_t> ids = b.inputs, tgt = b.targets, tm(N), seg = b.segment_ids;
    for (int64_t t = 0; t < N; ++t) tm[t] = b.target_segment_ids[t] != 0;
    const float* prev = h.data();
    for (int64_t k = 0; k < K; ++k) {
      MtpDepth& m = mtp[k];
      acquire(L + k, false);
      const auto& p = w.mtp[k];
      ids = roll_in_segment(ids, seg, B, T);
      tgt = roll_in_segment(tgt, seg, B, T);
      tm = roll_in_segment(tm, seg, B, T);
      seg = roll(seg, B, T);
      m.ids = ids;
      m.targets = tgt;
      m.mask = tm;
      m.e.resize(N * D);
      m.en.resize(N * D);
      m.erstd.resize(N);
      m.hn_prev.resize(N * D);
      m.hrstd.resize(N);
      ops::embedding_forward(m.e.data(), ids.data(), static_cast<const float*>(w.embed.data), N, V, D);
      ops::rmsnorm_forward(m.en.data(), m.erstd.data(), m.e.data(), vector_data(p.enorm), N, D, eps(cfg));
      ops::rmsnorm_forward(m.hn_prev.data(), m.hrstd.data(), prev, vector_data(p.hnorm), N, D, eps(cfg));
      m.x.resize(N * 2 * D);  // [enorm(e) | hnorm(h)], embedding first
      for (int64_t t = 0; t < N; ++t) {
        std::memcpy(&m.x[t * 2 * D], &m.en[t * D], D * sizeof(float));
        std::memcpy(&m.x[t * 2 * D + D], &m.hn_prev[t * D], D * sizeof(float));
      }
      m.h.resize(N * D);
      ops::linear_forward(m.h.data(), m.x.data(), p.eh_proj, N);
      LayerStats st;
      m.saved.resize(static_cast<size_t>(M));
      forward_layer(m.h.data(), p.layer, L + k, m.saved, &st);
      if (cfg.is_moe_layer(L + k)) {
        out.expert_load.push_back(st.load);
        lb.push_back(st.lb_loss);
      }
      m.hn.resize(N * D);
      m.hnrstd.resize(N);
      ops::rmsnorm_forward(m.hn.data(), m.hnrstd.data(), m.h.data(), vector_data(p.head_norm), N, D, eps(cfg));
      head_loss_forward(m.head, m.hn.data(), w.lm_head, tgt, tm, N, D, 0.0);
      release(L + k, false);
      mtp_ce += m.head.ce_sum;
      mtp_weight += m.head.weight;
      prev = m.h.data();
    }
  }
  const double mtp_denom = (shard ? opt.whole.mtp_targets : mtp_weight) + 1e-8;
  if (K > 0) out.mtp_loss = opt.mtp_loss_scaling_factor * mtp_ce / mtp_denom;
  for (double v : lb) out.moe_lb_loss += v;
  if (!lb.empty()) out.moe_lb_loss /= static_cast<double>(lb.size());
  out.loss = out.lm_loss + out.mtp_loss + out.moe_lb_loss;
  for (const auto& v : saved)
    for (const auto& sv : v) out.saved_bytes += sv.bytes();
  for (const auto& m : mtp)
    for (const auto& sv : m.saved) out.saved_bytes += sv.bytes();
  if (!grads) return out;

  // Backward.
  ModelParams<float*>& g = *grads;
  const double gs = opt.grad_scale;
  // The indexer loss: factor x mean over the L layers of KL_l / (rows T),
  // rows those of the whole batch when this is a shard.
  double indexer_per_kl = 0;
  if (opt.indexer_loss_scaling_factor > 0 && cfg.index_n_heads > 0) {
    const double rows = shard ? static_cast<double>(opt.whole.rows) : static_cast<double>(B);
    indexer_per_kl = opt.indexer_loss_scaling_factor / (static_cast<double>(L) * rows * static_cast<double>(T));
    s.indexer_loss_weight = gs * indexer_per_kl;
  }
  const double dlb = lb.empty() ? 0.0 : gs / static_cast<double>(lb.size());
  // dh carries dL/dh_k from depth k+1 into depth k's backward (MTP, deepest
  // first); after the loop it holds the MTP share of dL/dh0.
  Buffer<float> dh(N * D);
  std::fill(dh.begin(), dh.end(), 0.0f);
  for (int64_t k = K - 1; k >= 0; --k) {
    MtpDepth& m = mtp[k];
    acquire(L + k, true);
    const auto& p = w.mtp[k];
    auto& gk = g.mtp[k];
    Buffer<float> dhk(dh.begin(), dh.end()), dhn(N * D);
    head_loss_backward(dhn.data(), g.lm_head, m.head, m.hn.data(), w.lm_head, N, D, 0.0,
                       gs * opt.mtp_loss_scaling_factor / mtp_denom);
    norm_backward(dhk.data(), gk.head_norm, dhn.data(), m.h.data(), p.head_norm, m.hnrstd.data(), N, true);
    backward_layer(dhk.data(), gk.layer, m.saved, p.layer, L + k, dlb);
    Buffer<float> dx(N * 2 * D), den(N * D), dhp(N * D);
    ops::linear_backward(dx.data(), gk.eh_proj, dhk.data(), m.x.data(), p.eh_proj, N);
    for (int64_t t = 0; t < N; ++t) {
      std::memcpy(den.data() + t * D, dx.data() + t * 2 * D, D * sizeof(float));
      std::memcpy(dhp.data() + t * D, dx.data() + t * 2 * D + D, D * sizeof(float));
    }
    Buffer<float> de(N * D);
    norm_backward(de.data(), gk.enorm, den.data(), m.e.data(), p.enorm, m.erstd.data(), N);
    if (g.embed) ops::embedding_backward(g.embed, de.data(), m.ids.data(), N, V, D);
    const float* prev = k == 0 ? h.data() : mtp[k - 1].h.data();
    norm_backward(dh.data(), gk.hnorm, dhp.data(), prev, p.hnorm, m.hrstd.data(), N);
    release(L + k, true);
  }
  {
    Buffer<float> dhn(N * D);
    head_loss_backward(dhn.data(), g.lm_head, main, hn.data(), w.lm_head, N, D, opt.z_loss_multiplier, gs / denom);
    norm_backward(dh.data(), g.final_norm, dhn.data(), h_last, w.final_norm, rstd.data(), N, true);
  }
  // mHC: the sum's gradient reaches every stream; the expansion's sums them back.
  Buffer<float> dstreams;
  if (mhc) {
    dstreams.resize(N * cfg.residual_width());
    mhc_expand(dstreams.data(), dh.data(), N, k_streams, D);
  }
  float* dlayers = mhc ? dstreams.data() : dh.data();
  for (int64_t l = L - 1; l >= 0; --l) {
    acquire(l, true);
    backward_layer(dlayers, g.layers[l], saved[l], w.layers[l], l, dlb);
    release(l, true);
  }
  if (mhc) mhc_reduce(dh.data(), dstreams.data(), N, k_streams, D);
  if (g.embed) ops::embedding_backward(g.embed, dh.data(), b.inputs.data(), N, V, D);
  out.indexer_loss = indexer_per_kl * indexer_kl;
  out.loss += out.indexer_loss;
  return out;
}

}  // namespace ds::model
