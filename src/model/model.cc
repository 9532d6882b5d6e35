#include "model/model.h"

#include <cmath>
#include <cstring>

#include "core/buffer.h"
#include "core/error.h"
#include "model/mhc_block.h"
#include "ops/embedding.h"
#include "ops/fp8_quant.h"
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

namespace {

// One call of loss_and_grad: its shapes and stage settings, and what the
// forward leaves for the backward (the layers' residuals, each head's loss
// state).
class LossPass {
 public:
  LossPass(const ModelConfig& cfg, const ParamsView& w, const TrainBatch& b, const LossOptions& opt,
           const RematPolicy& policy, bool with_grads)
      : cfg_(cfg),
        w_(w),
        b_(b),
        opt_(opt),
        policy_(policy),
        B_(b.batch),
        T_(b.seq),
        N_(B_ * T_),
        D_(cfg.hidden_size),
        V_(cfg.vocab_size),
        L_(cfg.num_hidden_layers),
        K_(opt.mtp_num_layers),
        M_(opt.batch_split_factor),
        s_(cfg),
        shard_(opt.whole.rows > 0),
        layout_{B_, T_, b.positions.data(), b.segment_ids.data(), b.inputs.data(), nullptr},
        mhc_(cfg.has_mhc()),
        k_streams_(cfg.mhc_expansion_rate) {
    s_.task_parallel_assignments = 0;  // training: always the row-task expert schedule
    s_.load_balance_loss_weight = opt.load_balance_loss_weight;
    s_.exchange = opt.exchange;
    s_.indexer_sparse = opt.indexer_sparse_training && cfg.index_n_heads > 0;
    // The balance loss is a mean over rows: a shard's share has the whole batch's row count.
    if (shard_) s_.load_balance_loss_weight *= static_cast<double>(B_) / static_cast<double>(opt.whole.rows);
    if (opt.stream) opt.stream->begin(L_ + K_, with_grads);
    DS_CHECK(!mhc_ || K_ == 0, "mhc_expansion_rate {} with mtp_num_layers {}: MTP is not defined for mHC models",
             k_streams_, K_);
    DS_CHECK(M_ >= 1 && B_ % M_ == 0, "batch_split_factor {} does not divide the {} rows of the batch", M_, B_);
  }

  LossTerms forward() {
    LossTerms out;
    forward_main(out);
    forward_mtp(out);
    for (double v : lb_) out.moe_lb_loss += v;
    if (!lb_.empty()) out.moe_lb_loss /= static_cast<double>(lb_.size());
    out.loss = out.lm_loss + out.mtp_loss + out.moe_lb_loss;
    for (const auto& v : saved_)
      for (const auto& sv : v) out.saved_bytes += sv.bytes();
    for (const auto& m : mtp_)
      for (const auto& sv : m.saved) out.saved_bytes += sv.bytes();
    return out;
  }

  // Adds the gradient into g, after forward(); the indexer loss, known only
  // now, joins `out`.
  void backward(ModelParams<float*>& g, LossTerms& out) {
    const double gs = opt_.grad_scale;
    // The indexer loss: factor x mean over the L layers of KL_l / (rows T),
    // rows those of the whole batch when this is a shard.
    double indexer_per_kl = 0;
    if (opt_.indexer_loss_scaling_factor > 0 && cfg_.index_n_heads > 0) {
      const double rows = shard_ ? static_cast<double>(opt_.whole.rows) : static_cast<double>(B_);
      indexer_per_kl = opt_.indexer_loss_scaling_factor / (static_cast<double>(L_) * rows * static_cast<double>(T_));
      s_.indexer_loss_weight = gs * indexer_per_kl;
    }
    const double dlb = lb_.empty() ? 0.0 : gs / static_cast<double>(lb_.size());
    // dh carries dL/dh_k from depth k+1 into depth k's backward (MTP, deepest
    // first); after the loop it holds the MTP share of dL/dh0.
    Buffer<float> dh(N_ * D_);
    std::fill(dh.begin(), dh.end(), 0.0f);
    for (int64_t k = K_ - 1; k >= 0; --k) backward_mtp(g, k, dh, dlb);
    backward_main(g, dh, dlb);
    out.indexer_loss = indexer_per_kl * indexer_kl_;
    out.loss += out.indexer_loss;
  }

 private:
  // The main model: the embedding, the layers, the final norm and the LM
  // head's loss. With mHC the layers carry k streams [N, k, D], each
  // starting as the embedding and summed before the final norm.
  void forward_main(LossTerms& out) {
    const float* embed = static_cast<const float*>(w_.embed.data);
    h_.resize(N_ * cfg_.residual_width());
    if (mhc_) {
      hsum_.resize(N_ * D_);
      ops::embedding_forward(hsum_.data(), b_.inputs.data(), embed, N_, V_, D_);
      mhc_expand(h_.data(), hsum_.data(), N_, k_streams_, D_);
    } else {
      ops::embedding_forward(h_.data(), b_.inputs.data(), embed, N_, V_, D_);
    }
    // Residuals per layer and micro-batch (the batch-split schedule's parts).
    saved_.assign(static_cast<size_t>(L_), std::vector<LayerSaved>(static_cast<size_t>(M_)));
    for (int64_t l = 0; l < L_; ++l) {
      LayerStats st;
      acquire(l, false);
      forward_layer(h_.data(), w_.layers[l], l, saved_[l], &st);
      release(l, false);
      if (cfg_.is_moe_layer(l)) {
        out.expert_load.push_back(st.load);
        lb_.push_back(st.lb_loss);
      }
    }
    if (mhc_) mhc_reduce(hsum_.data(), h_.data(), N_, k_streams_, D_);
    h_last_ = mhc_ ? hsum_.data() : h_.data();
    hn_.resize(N_ * D_);
    rstd_.resize(N_);
    ops::rmsnorm_forward(hn_.data(), rstd_.data(), h_last_, vector_data(w_.final_norm), N_, D_, eps(cfg_));
    head_loss_forward(main_, hn_.data(), w_.lm_head, b_.targets, b_.target_segment_ids, N_, D_, opt_.z_loss_multiplier);
    out.tokens = main_.weight;
    denom_ = (shard_ ? opt_.whole.targets : main_.weight) + 1e-8;
    out.lm_loss = (main_.ce_sum + main_.z_sum) / denom_;
    out.z_loss = main_.z_sum / denom_;
  }

  // The MTP depths, each on the ids, targets and mask rolled once more and
  // the previous depth's output (the main model's for the first).
  void forward_mtp(LossTerms& out) {
    // MaxText's fp8_full rule leaves the MTP block unquantized (its modules
    // sit outside decoder/.*layers.*): so does the engine, here and in the
    // backward.
    const ops::ScopedQuantization unquantized(ops::Quantization::kNone);
    mtp_.resize(static_cast<size_t>(K_));
    double mtp_ce = 0, mtp_weight = 0;
    std::vector<int32_t> ids = b_.inputs, tgt = b_.targets, tm(N_), seg = b_.segment_ids;
    for (int64_t t = 0; t < N_; ++t) tm[t] = b_.target_segment_ids[t] != 0;
    const float* prev = h_.data();
    for (int64_t k = 0; k < K_; ++k) {
      MtpDepth& m = mtp_[k];
      acquire(L_ + k, false);
      const auto& p = w_.mtp[k];
      ids = roll_in_segment(ids, seg, B_, T_);
      tgt = roll_in_segment(tgt, seg, B_, T_);
      tm = roll_in_segment(tm, seg, B_, T_);
      seg = roll(seg, B_, T_);
      m.ids = ids;
      m.targets = tgt;
      m.mask = tm;
      m.e.resize(N_ * D_);
      m.en.resize(N_ * D_);
      m.erstd.resize(N_);
      m.hn_prev.resize(N_ * D_);
      m.hrstd.resize(N_);
      ops::embedding_forward(m.e.data(), ids.data(), static_cast<const float*>(w_.embed.data), N_, V_, D_);
      ops::rmsnorm_forward(m.en.data(), m.erstd.data(), m.e.data(), vector_data(p.enorm), N_, D_, eps(cfg_));
      ops::rmsnorm_forward(m.hn_prev.data(), m.hrstd.data(), prev, vector_data(p.hnorm), N_, D_, eps(cfg_));
      m.x.resize(N_ * 2 * D_);  // [enorm(e) | hnorm(h)], embedding first
      for (int64_t t = 0; t < N_; ++t) {
        std::memcpy(&m.x[t * 2 * D_], &m.en[t * D_], D_ * sizeof(float));
        std::memcpy(&m.x[t * 2 * D_ + D_], &m.hn_prev[t * D_], D_ * sizeof(float));
      }
      m.h.resize(N_ * D_);
      ops::linear_forward(m.h.data(), m.x.data(), p.eh_proj, N_);
      LayerStats st;
      m.saved.resize(static_cast<size_t>(M_));
      forward_layer(m.h.data(), p.layer, L_ + k, m.saved, &st);
      if (cfg_.is_moe_layer(L_ + k)) {
        out.expert_load.push_back(st.load);
        lb_.push_back(st.lb_loss);
      }
      m.hn.resize(N_ * D_);
      m.hnrstd.resize(N_);
      ops::rmsnorm_forward(m.hn.data(), m.hnrstd.data(), m.h.data(), vector_data(p.head_norm), N_, D_, eps(cfg_));
      head_loss_forward(m.head, m.hn.data(), w_.lm_head, tgt, tm, N_, D_, 0.0);
      release(L_ + k, false);
      mtp_ce += m.head.ce_sum;
      mtp_weight += m.head.weight;
      prev = m.h.data();
    }
    mtp_denom_ = (shard_ ? opt_.whole.mtp_targets : mtp_weight) + 1e-8;
    if (K_ > 0) out.mtp_loss = opt_.mtp_loss_scaling_factor * mtp_ce / mtp_denom_;
  }

  // MTP depth k's backward: dh holds dL/dh_k on entry, dL/dh_{k-1} (its
  // share from this depth and those past it) on return.
  void backward_mtp(ModelParams<float*>& g, int64_t k, Buffer<float>& dh, double dlb) {
    const ops::ScopedQuantization unquantized(ops::Quantization::kNone);  // as forward_mtp
    MtpDepth& m = mtp_[k];
    acquire(L_ + k, true);
    const auto& p = w_.mtp[k];
    auto& gk = g.mtp[k];
    Buffer<float> dhk(dh.begin(), dh.end()), dhn(N_ * D_);
    head_loss_backward(dhn.data(), g.lm_head, m.head, m.hn.data(), w_.lm_head, N_, D_, 0.0,
                       opt_.grad_scale * opt_.mtp_loss_scaling_factor / mtp_denom_);
    norm_backward(dhk.data(), gk.head_norm, dhn.data(), m.h.data(), p.head_norm, m.hnrstd.data(), N_, true);
    backward_layer(dhk.data(), gk.layer, m.saved, p.layer, L_ + k, dlb);
    Buffer<float> dx(N_ * 2 * D_), den(N_ * D_), dhp(N_ * D_);
    ops::linear_backward(dx.data(), gk.eh_proj, dhk.data(), m.x.data(), p.eh_proj, N_);
    for (int64_t t = 0; t < N_; ++t) {
      std::memcpy(den.data() + t * D_, dx.data() + t * 2 * D_, D_ * sizeof(float));
      std::memcpy(dhp.data() + t * D_, dx.data() + t * 2 * D_ + D_, D_ * sizeof(float));
    }
    Buffer<float> de(N_ * D_);
    norm_backward(de.data(), gk.enorm, den.data(), m.e.data(), p.enorm, m.erstd.data(), N_);
    if (g.embed) ops::embedding_backward(g.embed, de.data(), m.ids.data(), N_, V_, D_);
    const float* prev = k == 0 ? h_.data() : mtp_[k - 1].h.data();
    norm_backward(dh.data(), gk.hnorm, dhp.data(), prev, p.hnorm, m.hrstd.data(), N_);
    release(L_ + k, true);
  }

  // The main model's backward, dh holding the MTP depths' share of dL/dh0.
  void backward_main(ModelParams<float*>& g, Buffer<float>& dh, double dlb) {
    {
      Buffer<float> dhn(N_ * D_);
      head_loss_backward(dhn.data(), g.lm_head, main_, hn_.data(), w_.lm_head, N_, D_, opt_.z_loss_multiplier,
                         opt_.grad_scale / denom_);
      norm_backward(dh.data(), g.final_norm, dhn.data(), h_last_, w_.final_norm, rstd_.data(), N_, true);
    }
    // mHC: the sum's gradient reaches every stream; the expansion's sums them back.
    Buffer<float> dstreams;
    if (mhc_) {
      dstreams.resize(N_ * cfg_.residual_width());
      mhc_expand(dstreams.data(), dh.data(), N_, k_streams_, D_);
    }
    float* dlayers = mhc_ ? dstreams.data() : dh.data();
    for (int64_t l = L_ - 1; l >= 0; --l) {
      acquire(l, true);
      backward_layer(dlayers, g.layers[l], saved_[l], w_.layers[l], l, dlb);
      release(l, true);
    }
    if (mhc_) mhc_reduce(dh.data(), dstreams.data(), N_, k_streams_, D_);
    if (g.embed) ops::embedding_backward(g.embed, dh.data(), b_.inputs.data(), N_, V_, D_);
  }

  void forward_layer(float* x, const LayerView& lw, int64_t l, std::vector<LayerSaved>& sv, LayerStats* st) {
    if (M_ == 1)
      layer_forward(x, lw, l, s_, layout_, nullptr, &sv[0], policy_, st);
    else
      layer_forward_split(x, lw, l, s_, layout_, sv, policy_, st);
  }
  void backward_layer(float* dx, LayerGrads& lg, std::vector<LayerSaved>& sv, const LayerView& lw, int64_t l,
                      double dloss_lb) {
    if (M_ == 1)
      layer_backward(dx, lg, sv[0], lw, l, s_, layout_, dloss_lb, &indexer_kl_);
    else
      layer_backward_split(dx, lg, sv, lw, l, s_, layout_, dloss_lb, &indexer_kl_);
  }
  void acquire(int64_t u, bool bwd) {
    if (opt_.stream) opt_.stream->acquire(u, bwd);
  }
  void release(int64_t u, bool bwd) {
    if (opt_.stream) opt_.stream->release(u, bwd);
  }

  const ModelConfig& cfg_;
  const ParamsView& w_;
  const TrainBatch& b_;
  const LossOptions& opt_;
  const RematPolicy& policy_;
  const int64_t B_, T_, N_, D_, V_, L_, K_;
  const int64_t M_;  // micro-batches of the batch-split schedule
  StageConfig s_;
  const bool shard_;
  const TokenLayout layout_;
  const bool mhc_;
  const int64_t k_streams_;
  // The forward's state for the backward.
  Buffer<float> h_, hsum_;                      // the layers' output [N, k, D]; with mHC their sum [N, D]
  const float* h_last_ = nullptr;               // the final norm's input [N, D]
  Buffer<float> hn_, rstd_;                     // its output
  HeadLoss main_;                               // the LM head's
  double denom_ = 0, mtp_denom_ = 0;            // the LM and MTP losses' normalizers
  std::vector<std::vector<LayerSaved>> saved_;  // per layer and micro-batch
  std::vector<MtpDepth> mtp_;
  std::vector<double> lb_;  // the MoE layers' balance losses
  double indexer_kl_ = 0;   // summed over the main layers' queries
};

}  // namespace

LossTerms loss_and_grad(const ModelConfig& cfg, const ParamsView& w, ModelParams<float*>* grads, const TrainBatch& b,
                        const LossOptions& opt, const RematPolicy& policy) {
  b.check(cfg);
  const int64_t K = opt.mtp_num_layers;
  DS_CHECK(static_cast<int64_t>(w.mtp.size()) >= K, "mtp_num_layers {} but the parameters hold {} MTP depths", K,
           w.mtp.size());
  DS_CHECK(w.embed.dtype == DType::F32 && w.lm_head.dtype == DType::F32, "training needs float32 parameters");
  LossPass pass(cfg, w, b, opt, policy, grads != nullptr);
  LossTerms out = pass.forward();
  if (grads) pass.backward(*grads, out);
  return out;
}

}  // namespace ds::model
