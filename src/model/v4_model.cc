#include "model/v4_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "core/buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/system.h"
#include "model/engram_v41.h"
#include "model/model.h"
#include "model/weights.h"
#include "ops/activations.h"
#include "ops/compressor.h"
#include "ops/expert_selection.h"
#include "ops/indexer.h"
#include "ops/matmul.h"
#include "ops/mhc.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/sparse_attention.h"

namespace ds::model {

namespace {

std::vector<float> frequencies(const V4Config& c, double theta, bool yarn) {
  ops::RopeConfig rc;
  rc.dim = c.qk_rope_head_dim;
  rc.theta = theta;
  if (yarn && c.rope_scaling.enabled) {
    rc.factor = c.rope_scaling.factor;
    rc.original_max_position = c.rope_scaling.original_max_position_embeddings;
    rc.beta_fast = c.rope_scaling.beta_fast;
    rc.beta_slow = c.rope_scaling.beta_slow;
  }
  std::vector<float> f(static_cast<size_t>(c.qk_rope_head_dim / 2));
  ops::rope_frequencies(f.data(), rc);
  return f;
}

}  // namespace

ops::MhcDims v4_mhc_dims(const V4Config& c, int64_t tokens) {
  ops::MhcDims md;
  md.tokens = tokens;
  md.streams = c.hc_mult;
  md.dim = c.hidden_size;
  md.sinkhorn_iters = c.hc_sinkhorn_iters;
  md.eps = static_cast<float>(c.hc_eps);
  md.norm_eps = static_cast<float>(c.rms_norm_eps);
  return md;
}

ops::SparseMqaDims v4_attention_dims(const V4Config& c, int64_t queries) {
  ops::SparseMqaDims sd;
  sd.queries = queries;
  sd.heads = c.num_attention_heads;
  sd.dim = c.head_dim;
  sd.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  return sd;
}

ops::ExpertSelectionConfig v4_selection_config(const V4Config& c) {
  ops::ExpertSelectionConfig sc;
  sc.num_experts = c.n_routed_experts;
  sc.k = c.num_experts_per_tok;
  sc.group_score = ops::GroupScore::None;
  sc.scoring = c.scoring_func == V4Scoring::SqrtSoftplus ? ops::ExpertScoring::SqrtSoftplus
               : c.scoring_func == V4Scoring::Sigmoid    ? ops::ExpertScoring::Sigmoid
                                                         : ops::ExpertScoring::Softmax;
  sc.norm_topk_prob = c.scoring_func != V4Scoring::Softmax;
  sc.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
  return sc;
}

size_t V4LayerState::bytes() const {
  return (window.size() + carry.P.size() + carry.Z.size() + entries.size() + index_carry.P.size() +
          index_carry.Z.size() + index_keys.size() + entry_rope.size() + carry.held_P.size() + carry.held_Z.size() +
          index_carry.held_P.size() + index_carry.held_Z.size()) *
             sizeof(float) +
         entry_codes.size() + entry_scales.size() + key_codes.size() + key_scales.size() + entry_fp4.size() +
         entry_fp4_scales.size();
}

size_t V4State::bytes() const {
  size_t b = 0;
  for (const auto& l : layers) b += l.bytes();
  return b;
}

size_t v4_state_bytes(const V4Config& c, int64_t main_tokens, bool codes, int64_t mtp_tokens) {
  if (main_tokens <= 0) return 0;
  size_t bytes = 0;
  const int64_t R = c.qk_rope_head_dim, N = c.nope_dim(), Di = c.index_head_dim;
  int64_t tokens = main_tokens;
  auto carry = [&](int64_t ratio, int64_t dim) {
    const int64_t width = (ratio == 4 ? 2 : 1) * dim;
    bytes += static_cast<size_t>(2 * (tokens - v4_carry_start(tokens, ratio)) * width) * sizeof(float);
  };
  const int64_t layers = c.num_hidden_layers + (mtp_tokens > 0 ? c.num_nextn_predict_layers : 0);
  for (int64_t l = 0; l < layers; ++l) {
    if (l >= c.num_hidden_layers) tokens = mtp_tokens;
    bytes += static_cast<size_t>(c.sliding_window * c.head_dim) * sizeof(float);
    const int64_t m = c.compress_ratio(l);
    if (!c.owns_compressor(l)) continue;
    const int64_t count = tokens / m;
    carry(m, c.head_dim);
    if (c.v41()) {  // entries and index keys as fp4 codes, or float32
      const int64_t D = c.head_dim;
      bytes += static_cast<size_t>(
          count * (codes ? D / 2 + D / kV41EntryFp4Block + Di / 2 + Di / kV4IndexFp4Block : (D + Di) * 4));
      continue;
    }
    bytes += static_cast<size_t>(count * (codes ? N + N / kV4LatentFp8Block + R * 4 : c.head_dim * 4));
    if (m != 4) continue;
    carry(4, Di);
    bytes += static_cast<size_t>(count * (codes ? Di / 2 + Di / kV4IndexFp4Block : Di * 4));
  }
  return bytes;
}

V4Model::V4Model(const V4Config& cfg, const V4View& w, V4Options opt)
    : cfg_(cfg),
      w_(w),
      opt_(opt),
      freqs_window_(frequencies(cfg, cfg.rope_theta, false)),
      freqs_compressed_(
          frequencies(cfg, cfg.compress_rope_theta > 1 ? cfg.compress_rope_theta : cfg.rope_theta, true)) {
  cfg_.validate();
  DS_CHECK(static_cast<int64_t>(w.layers.size()) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers &&
               static_cast<int64_t>(w.mtp.size()) == cfg.num_nextn_predict_layers,
           "V4 weights do not match the config");
  if (cfg_.engram_layers.empty()) return;
  DS_CHECK(cfg_.engram_token_classes && static_cast<int64_t>(cfg_.engram_token_classes->size()) == cfg_.vocab_size,
           "a DeepSeek-V4.1 model with Engram layers needs its tokenizer's token classes (tokenizer.json in the "
           "model folder)");
  engram_hash_ = engram_hash_tables(cfg_.engram_hash_spec());
  engram_pad_ = (*cfg_.engram_token_classes)[static_cast<size_t>(cfg_.engram_pad_id)];
}

V4State V4Model::new_state() const {
  V4State s;
  s.layers.resize(static_cast<size_t>(cfg_.num_hidden_layers + cfg_.num_nextn_predict_layers));
  if (!cfg_.engram_layers.empty())
    s.engram_history.assign(static_cast<size_t>(cfg_.engram_max_ngram_size - 1), engram_pad_);
  return s;
}

void V4Model::engram_ids(V4PassContext& cx, const std::vector<Segment>& segs, const int32_t* ids, int64_t n) const {
  const int64_t C = cfg_.engram_columns(), N = cfg_.engram_max_ngram_size;
  const auto& classes = *cfg_.engram_token_classes;
  cx.engram.assign(engram_hash_.size(), std::vector<int32_t>(static_cast<size_t>(n * C)));
  std::vector<int32_t> c;
  for (const Segment& g : segs) {
    DS_CHECK(static_cast<int64_t>(g.state->engram_history.size()) == N - 1,
             "internal: a sequence's Engram history holds {} tokens", g.state->engram_history.size());
    c.resize(static_cast<size_t>(g.n));
    for (int64_t i = 0; i < g.n; ++i) c[static_cast<size_t>(i)] = classes[static_cast<size_t>(ids[g.row + i])];
    for (size_t e = 0; e < engram_hash_.size(); ++e)
      engram_hash_ids(cx.engram[e].data() + g.row * C, c.data(), 1, g.n, g.state->engram_history.data(), engram_pad_,
                      engram_hash_[e], N, cfg_.engram_heads);
  }
}

void V4Model::advance_engram_history(const std::vector<Segment>& segs) const {
  if (cfg_.engram_layers.empty()) return;
  const auto& classes = *cfg_.engram_token_classes;
  for (const Segment& g : segs) {
    auto& h = g.state->engram_history;
    for (int64_t i = 0; i < g.n; ++i) {
      h.erase(h.begin());
      h.push_back(classes[static_cast<size_t>(g.ids[i])]);
    }
  }
}

void V4Model::engram(float* X, int64_t l, int64_t n, const V4PassContext& cx, V4LayerSaved* ls) const {
  const int64_t e = cfg_.engram_slot(l), C = cfg_.engram_columns(), De = cfg_.engram_head_dim;
  const auto& p = w_.layers[static_cast<size_t>(l)].engram;
  std::vector<float> rows(static_cast<size_t>(n * C * De));
  const ops::WeightView& t = p.embed;
  const bool fp8 = t.dtype == DType::F8E4M3;
  const int32_t* ids = cx.engram[static_cast<size_t>(e)].data();
  if (opt_.release_engram_pages && n * C > 1) {
    // The table stays on disk: its rows' pages (codes and scales) are read
    // ahead together before the gather faults on them one by one.
    const size_t row = static_cast<size_t>(t.cols) * (fp8 ? 1 : dtype_size(t.dtype));
    const size_t srow = static_cast<size_t>((t.cols + 31) / 32);
    std::vector<std::pair<const void*, size_t>> ranges;
    for (int64_t i = 0; i < n * C; ++i) {
      if (ids[i] < 0 || ids[i] >= t.rows) continue;
      ranges.emplace_back(static_cast<const char*>(t.data) + static_cast<size_t>(ids[i]) * row, row);
      if (fp8) ranges.emplace_back(t.scale_e8m0 + static_cast<size_t>(ids[i]) * srow, srow);
    }
    prefetch_pages(std::move(ranges));
  }
  v41_engram_gather(rows.data(), ids, n, C, t);
  // The rows read leave this process's mapping again: the table's use does
  // not grow the resident memory (the page cache keeps the hot rows).
  if (opt_.release_engram_pages) {
    release_file_pages(t.data, static_cast<size_t>(t.rows * t.cols) * (fp8 ? 1 : dtype_size(t.dtype)));
    if (fp8) release_file_pages(t.scale_e8m0, static_cast<size_t>(t.rows * ((t.cols + 31) / 32)));
  }
  const int64_t hc = cfg_.hc_mult, d = cfg_.hidden_size;
  float* kv = nullptr;
  if (ls) {  // training: the streams before, the rows and their projection
    ls->eX = Buffer<float>(static_cast<size_t>(n * hc * d));
    std::copy(X, X + n * hc * d, ls->eX.begin());
    ls->e_kv = Buffer<float>(static_cast<size_t>(n * (hc + 1) * d));
    kv = ls->e_kv.data();
  }
  // q_weight * k_weight, folded here: under FSDP the weights are there only
  // while the layer is.
  const float* q = vector_data(p.q_weight);
  const float* k = vector_data(p.k_weight);
  std::vector<float> wqk(static_cast<size_t>(hc * d));
  for (size_t i = 0; i < wqk.size(); ++i) wqk[i] = q[i] * k[i];
  v41_engram_forward(X, rows.data(), p.wkv, wqk.data(), {n, hc, d, static_cast<float>(cfg_.rms_norm_eps)}, nullptr,
                     nullptr, kv);
  if (ls) {
    ls->e_rows = Buffer<float>(rows.size());
    std::copy(rows.begin(), rows.end(), ls->e_rows.begin());
  }
}

std::vector<float> V4Model::forward(V4State& st, const int32_t* ids, int64_t n, bool all_logits) {
  std::vector<V4Request> one = {{&st, ids, n}};
  return forward(one, all_logits);
}

std::vector<float> V4Model::forward(const std::vector<V4Request>& batch, bool all_logits) {
  return forward(batch, all_logits, nullptr);
}

Staged V4Model::layer_forward(Buffer<float>& X, Buffer<float>& X2, int64_t l, const std::vector<Segment>& segs,
                              const int32_t* ids, const int32_t* pos, int64_t n, V4LayerSaved* ls, V4PassContext* cx) {
  DS_CHECK(cx || !cfg_.v41(), "internal: a DeepSeek-V4.1 layer without its pass context");
  if (cfg_.engram_slot(l) >= 0) engram(X.data(), l, n, *cx, ls);
  co_await sublayer(X, X2, l, false, segs, ids, pos, n, ls, cx);
  co_await sublayer(X, X2, l, true, segs, ids, pos, n, ls, cx);
}

Staged V4Model::sublayer(Buffer<float>& X, Buffer<float>& X2, int64_t l, bool ffn, const std::vector<Segment>& segs,
                         const int32_t* ids, const int32_t* pos, int64_t n, V4LayerSaved* ls, V4PassContext* cx) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const auto& L = w_.layers[static_cast<size_t>(l)];
  const ops::MhcDims md = v4_mhc_dims(cfg_, n);
  const size_t nd = static_cast<size_t>(n * d), nh = static_cast<size_t>(n * hc);
  // x0 = mhc_pre(X), x = rmsnorm(x0), y = f(x), X = mhc_post(y, X). Training
  // keeps x0 and x apart and moves every buffer into ls (the input streams
  // once mhc_post has read them); inference normalises in place. A remat
  // rerun of the attention passes the residuals ls kept (the stages skip
  // them), its output y among them when out_proj was kept.
  const bool have_y = !ffn && ls && !ls->o.empty();
  // dtype=bfloat16: the streams in and out of a sub-layer rounded to bf16.
  const bool bf16 = bf16_activations();
  if (bf16) round_to_bf16(X.data(), X.size());
  Buffer<float> x0(nd), x, y, rstd(static_cast<size_t>(n)), post(nh), comb(nh * static_cast<size_t>(hc));
  if (!have_y) y.resize(nd);
  const auto& fn = ffn ? L.hc_ffn_fn : L.hc_attn_fn;
  const auto& base = ffn ? L.hc_ffn_base : L.hc_attn_base;
  const auto& scale = ffn ? L.hc_ffn_scale : L.hc_attn_scale;
  const auto& norm = ffn ? L.ffn_norm : L.attn_norm;
  if (cfg_.lagged_mhc()) {
    // V4.1: the input is collapsed with the previous sub-layer's pre; this
    // one's pre collapses the next.
    std::vector<float> pre(nh);
    ops::mhc_pre_forward(nullptr, post.data(), comb.data(), X.data(), vector_data(fn), vector_data(base),
                         vector_data(scale), md, pre.data());
    ops::mhc_collapse(x0.data(), X.data(), cx->pin.data(), n, hc, d);
    if (ls) {
      Buffer<float>& kept = ffn ? ls->f_pin : ls->a_pin;
      kept = Buffer<float>(nh);
      std::copy(cx->pin.begin(), cx->pin.end(), kept.begin());
    }
    cx->pin = std::move(pre);
  } else {
    ops::mhc_pre_forward(x0.data(), post.data(), comb.data(), X.data(), vector_data(fn), vector_data(base),
                         vector_data(scale), md);
  }
  if (ls) {
    x.resize(nd);
    ops::rmsnorm_forward(x.data(), rstd.data(), x0.data(), vector_data(norm), n, d, eps);
  } else {
    ops::rmsnorm_forward(x0.data(), rstd.data(), x0.data(), vector_data(norm), n, d, eps);
  }
  const float* a = ls ? x.data() : x0.data();
  if (ffn)
    co_await moe(y.data(), a, ids, l, n, ls ? &ls->moe : nullptr);
  else
    attention(have_y ? nullptr : y.data(), a, l, segs, pos, n, ls ? &ls->attn : nullptr, cx);
  X2.resize(X.size());
  ops::mhc_post_forward(X2.data(), have_y ? ls->o.data() : y.data(), X.data(), post.data(), comb.data(), md);
  std::swap(X, X2);
  if (bf16) round_to_bf16(X.data(), X.size());
  if (!ls) co_return;
  if (ffn) {
    ls->X1.take(std::move(X2), bf16), ls->f0 = std::move(x0), ls->rstd_f = std::move(rstd), ls->f = std::move(x);
    ls->fpost = std::move(post), ls->fcomb = std::move(comb), ls->fo = std::move(y);
  } else {
    ls->X.take(std::move(X2), bf16), ls->a0 = std::move(x0), ls->rstd_a = std::move(rstd), ls->a = std::move(x);
    ls->post = std::move(post), ls->comb = std::move(comb);
    if (!have_y) ls->o = std::move(y);
  }
  X2 = Buffer<float>(X.size());
}

std::vector<float> V4Model::head_forward(const float* Xr, int64_t R, const ops::WeightView& fn,
                                         const ops::WeightView& base, const ops::WeightView& scale,
                                         const ops::WeightView& norm, V4HeadSaved* sv, bool logits, const float* pre) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, V = cfg_.vocab_size;
  Buffer<float> y(static_cast<size_t>(R * d)), rstd(static_cast<size_t>(R));
  if (pre) {
    ops::mhc_collapse(y.data(), Xr, pre, R, hc, d);
    if (sv) sv->pre.assign(pre, pre + R * hc);
  } else
    ops::mhc_head_forward(y.data(), Xr, vector_data(fn), vector_data(base), vector_data(scale), v4_mhc_dims(cfg_, R));
  if (sv) {
    sv->X.assign(Xr, Xr + R * hc * d);
    sv->y.assign(y.begin(), y.end());
  }
  ops::rmsnorm_forward(y.data(), rstd.data(), y.data(), vector_data(norm), R, d, static_cast<float>(cfg_.rms_norm_eps));
  if (sv) sv->rstd_y.assign(rstd.begin(), rstd.end());
  if (!logits) return std::vector<float>(y.begin(), y.end());
  std::vector<float> out(static_cast<size_t>(R * V));
  ops::linear_forward(out.data(), y.data(), head_weight(), R);
  return out;
}

std::vector<float> V4Model::forward(const std::vector<V4Request>& batch, bool all_logits, V4Saved* saved,
                                    std::vector<float>* mtp_logits) {
  return run(batch, all_logits, saved, mtp_logits, true);
}

std::vector<float> V4Model::forward_normed(const std::vector<V4Request>& batch, V4Saved* saved,
                                           std::vector<float>* mtp_normed) {
  return run(batch, true, saved, mtp_normed, false);
}

std::vector<float> V4Model::run(const std::vector<V4Request>& batch, bool all_logits, V4Saved* saved,
                                std::vector<float>* mtp_out, bool logits) {
  std::vector<Pass> passes;
  passes.push_back(begin_pass(batch, saved, mtp_out != nullptr));
  std::vector<std::vector<float>> mtp;
  auto out = run_passes(passes, all_logits, {saved}, mtp_out ? &mtp : nullptr, logits);
  if (mtp_out) *mtp_out = std::move(mtp[0]);
  return std::move(out[0]);
}

std::vector<std::vector<float>> V4Model::forward_normed_parts(const std::vector<std::vector<V4Request>>& parts,
                                                              const std::vector<V4Saved*>& saved,
                                                              std::vector<std::vector<float>>* mtp_normed) {
  DS_CHECK(!parts.empty() && saved.size() == parts.size(), "V4 forward: {} parts with {} saved records", parts.size(),
           saved.size());
  std::vector<Pass> passes;
  for (size_t i = 0; i < parts.size(); ++i) passes.push_back(begin_pass(parts[i], saved[i], mtp_normed != nullptr));
  return run_passes(passes, true, saved, mtp_normed, false);
}

V4Model::Pass V4Model::begin_pass(const std::vector<V4Request>& batch, V4Saved* saved, bool mtp) const {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  Pass p;
  int64_t& n = p.n;
  for (const V4Request& r : batch) {
    if (r.n == 0) continue;
    DS_CHECK(r.state != nullptr && r.n > 0, "V4 forward: a request without a state or with a negative count");
    DS_CHECK(static_cast<int64_t>(r.state->layers.size()) == L + cfg_.num_nextn_predict_layers,
             "V4 forward: state of another model");
    DS_CHECK(r.state->length + r.n <= cfg_.max_position_embeddings,
             "V4 forward: {} tokens exceed max_position_embeddings {}", r.state->length + r.n,
             cfg_.max_position_embeddings);
    DS_CHECK(!mtp || r.state->length == 0, "V4 forward: the MTP logits need whole sequences (fresh states)");
    for (const Segment& g : p.segs) DS_CHECK(g.state != r.state, "V4 forward: one sequence twice in a batch");
    for (int64_t i = 0; i < r.n; ++i)
      DS_CHECK(r.ids[i] >= 0 && r.ids[i] < V, "token id {} is outside the vocabulary of {}", r.ids[i], V);
    p.segs.push_back({r.state, r.ids, r.state->length, r.n, n});
    n += r.n;
  }
  DS_CHECK(n >= 1, "V4 forward: no tokens");
  DS_CHECK(!mtp || cfg_.num_nextn_predict_layers == 1, "V4 forward: the MTP logits need one MTP layer ({})",
           cfg_.num_nextn_predict_layers);
  p.ids.resize(static_cast<size_t>(n));
  p.pos.resize(static_cast<size_t>(n));
  for (const Segment& g : p.segs) {
    std::copy(g.ids, g.ids + g.n, p.ids.begin() + g.row);
    for (int64_t i = 0; i < g.n; ++i) p.pos[static_cast<size_t>(g.row + i)] = static_cast<int32_t>(g.start + i);
  }
  if (saved) {
    saved->ids = p.ids;
    saved->pos = p.pos;
    saved->layers.assign(static_cast<size_t>(L + (mtp ? 1 : 0)), {});
    saved->mtp.clear();
    saved->segs = p.segs;
  }
  if (cfg_.lagged_mhc()) {  // the first layer's input is stream 0
    p.cx.pin.assign(static_cast<size_t>(n * hc), 0.0f);
    for (int64_t i = 0; i < n; ++i) p.cx.pin[static_cast<size_t>(i * hc)] = 1.0f;
  }
  if (!cfg_.engram_layers.empty()) {
    engram_ids(p.cx, p.segs, p.ids.data(), n);
    if (saved) saved->engram = p.cx.engram;
  }
  // Embedding, copied into every stream.
  p.X = Buffer<float>(static_cast<size_t>(n * hc * d));
  p.X2 = Buffer<float>(static_cast<size_t>(n * hc * d));
  for (int64_t i = 0; i < n; ++i) {
    float* row = p.X.data() + i * hc * d;
    ops::widen_rows(row, w_.embed, p.ids[static_cast<size_t>(i)], p.ids[static_cast<size_t>(i)] + 1);
    for (int64_t j = 1; j < hc; ++j) std::copy(row, row + d, row + j * d);
  }
  return p;
}

std::vector<std::vector<float>> V4Model::run_passes(std::vector<Pass>& passes, bool all_logits,
                                                    const std::vector<V4Saved*>& saved,
                                                    std::vector<std::vector<float>>* mtp_out, bool logits) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, L = cfg_.num_hidden_layers;
  const size_t P = passes.size();
  for (int64_t l = 0; l < L; ++l) {
    if (opt_.stream) opt_.stream->acquire(l, false);
    std::vector<Staged> tasks;
    for (size_t i = 0; i < P; ++i) {
      Pass& p = passes[i];
      V4LayerSaved* ls = saved[i] ? &saved[i]->layers[static_cast<size_t>(l)] : nullptr;
      tasks.push_back(layer_forward(p.X, p.X2, l, p.segs, p.ids.data(), p.pos.data(), p.n, ls, &p.cx));
    }
    run_interleaved(tasks, l, false);
    if (opt_.stream) opt_.stream->release(l, false);
    for (size_t i = 0; i < P; ++i)
      if (saved[i]) drop(saved[i]->layers[static_cast<size_t>(l)], *saved[i]);
  }
  for (Pass& p : passes) {
    advance_engram_history(p.segs);
    for (const Segment& g : p.segs) g.state->length += g.n;
  }

  if (mtp_out) {
    mtp_out->assign(P, {});
    if (opt_.stream) opt_.stream->acquire(L, false);
    std::vector<Staged> tasks;
    for (size_t i = 0; i < P; ++i)
      tasks.push_back(mtp_forward((*mtp_out)[i], passes[i].X.data(), passes[i].segs, passes[i].ids, saved[i], logits));
    run_interleaved(tasks, L, false);
    if (opt_.stream) opt_.stream->release(L, false);
  }

  // Logits: every row, or each sequence's last.
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < P; ++i) {
    const Pass& p = passes[i];
    std::vector<int64_t> rows;
    for (const Segment& g : p.segs)
      for (int64_t t = all_logits ? 0 : g.n - 1; t < g.n; ++t) rows.push_back(g.row + t);
    const int64_t R = static_cast<int64_t>(rows.size());
    Buffer<float> Xr(static_cast<size_t>(R * hc * d));
    std::vector<float> pre;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = rows[static_cast<size_t>(r)];
      std::copy(p.X.begin() + row * hc * d, p.X.begin() + (row + 1) * hc * d, Xr.begin() + r * hc * d);
      if (cfg_.lagged_mhc()) pre.insert(pre.end(), p.cx.pin.begin() + row * hc, p.cx.pin.begin() + (row + 1) * hc);
    }
    if (saved[i]) saved[i]->logit_rows = rows;
    out.push_back(head_forward(Xr.data(), R, w_.hc_head_fn, w_.hc_head_base, w_.hc_head_scale, w_.norm,
                               saved[i] ? &saved[i]->head : nullptr, logits, pre.empty() ? nullptr : pre.data()));
  }
  return out;
}

Staged V4Model::mtp_forward(std::vector<float>& out, const float* X, const std::vector<Segment>& segs,
                            const std::vector<int32_t>& ids, V4Saved* saved, bool logits) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult;
  const auto& M = w_.mtp[0];
  // Row t of a sequence: its main streams at token t and the embedding of token t + 1.
  std::vector<Segment> msegs;
  std::vector<int64_t> rows;
  std::vector<int32_t> next, pos;
  for (const Segment& g : segs) {
    if (g.n < 2) continue;
    msegs.push_back({g.state, g.ids + 1, 0, g.n - 1, static_cast<int64_t>(rows.size())});
    for (int64_t t = 0; t + 1 < g.n; ++t) {
      rows.push_back(g.row + t);
      next.push_back(ids[static_cast<size_t>(g.row + t + 1)]);
      pos.push_back(static_cast<int32_t>(t));
    }
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  V4MtpSaved* ms = nullptr;
  if (saved) {
    saved->mtp.emplace_back();
    ms = &saved->mtp.back();
    ms->segs = msegs;
    ms->rows = rows;
    ms->ids = next;
    ms->pos = pos;
  }
  if (R == 0) {
    out.clear();
    co_return;
  }
  Buffer<float> h(static_cast<size_t>(R * hc * d)), Xm;
  for (int64_t r = 0; r < R; ++r)
    std::copy(X + rows[static_cast<size_t>(r)] * hc * d, X + (rows[static_cast<size_t>(r)] + 1) * hc * d,
              h.data() + r * hc * d);
  co_await mtp_layer(Xm, h, next, pos, msegs, ms, saved);
  out = head_forward(Xm.data(), R, M.hc_head_fn, M.hc_head_base, M.hc_head_scale, M.norm, ms ? &ms->head : nullptr,
                     logits);
}

Staged V4Model::mtp_layer(Buffer<float>& Xm, Buffer<float>& h, const std::vector<int32_t>& next,
                          const std::vector<int32_t>& pos, const std::vector<Segment>& msegs, V4MtpSaved* ms,
                          V4Saved* saved) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, l = cfg_.num_hidden_layers;
  const int64_t R = static_cast<int64_t>(next.size());
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const auto& M = w_.mtp[0];
  Buffer<float> e(static_cast<size_t>(R * d)), re(static_cast<size_t>(R)), rh(static_cast<size_t>(R * hc));
  for (int64_t r = 0; r < R; ++r)
    ops::widen_rows(e.data() + r * d, w_.embed, next[static_cast<size_t>(r)], next[static_cast<size_t>(r)] + 1);
  if (ms) {
    ms->e0.assign(e.begin(), e.end());
    ms->h0.assign(h.begin(), h.end());
  }
  ops::rmsnorm_forward(e.data(), re.data(), e.data(), vector_data(M.enorm), R, d, eps);
  ops::rmsnorm_forward(h.data(), rh.data(), h.data(), vector_data(M.hnorm), R * hc, d, eps);
  if (ms) {
    ms->rstd_e.assign(re.begin(), re.end());
    ms->e.assign(e.begin(), e.end());
    ms->rstd_h.assign(rh.begin(), rh.end());
    ms->h.assign(h.begin(), h.end());
  }
  Xm = Buffer<float>(static_cast<size_t>(R * hc * d));
  Buffer<float> Xm2(static_cast<size_t>(R * hc * d)), pe(static_cast<size_t>(R * d));
  ops::linear_forward(Xm.data(), h.data(), M.h_proj, R * hc);
  ops::linear_forward(pe.data(), e.data(), M.e_proj, R);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < hc; ++j)
      for (int64_t i = 0; i < d; ++i) Xm[(r * hc + j) * d + i] += pe[r * d + i];
  V4LayerSaved* ls = saved ? &saved->layers[static_cast<size_t>(l)] : nullptr;
  co_await layer_forward(Xm, Xm2, l, msegs, next.data(), pos.data(), R, ls);
  if (ls) drop(*ls, *saved);
}

}  // namespace ds::model
