#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/activations.h"
#include "ops/attention.h"
#include "ops/expert_selection.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/routing.h"

namespace ds::model {

struct Transformer::Batch {
  int64_t n = 0;               // packed new tokens
  std::vector<int32_t> token;  // [n]
  std::vector<int32_t> pos;    // [n] absolute position within its sequence
  struct Seq {
    int64_t index, row0, count, past;  // sequence, first packed row, new tokens, cached before
  };
  std::vector<Seq> seqs;  // sequences with new tokens
};

Transformer::Transformer(const ModelConfig& cfg, const ModelWeights& w) : cfg_(cfg), w_(w) {
  ops::RopeConfig rc;
  rc.dim = cfg.qk_rope_head_dim;
  rc.theta = cfg.rope_theta;
  if (cfg.rope_scaling.enabled) {
    rc.factor = cfg.rope_scaling.factor;
    rc.original_max_position = cfg.rope_scaling.original_max_position_embeddings;
    rc.beta_fast = cfg.rope_scaling.beta_fast;
    rc.beta_slow = cfg.rope_scaling.beta_slow;
  }
  rope_freqs_.resize(cfg.qk_rope_head_dim / 2);
  ops::rope_frequencies(rope_freqs_.data(), rc);
  softmax_scale_ = static_cast<float>(cfg.softmax_scale());
  absorbed_kv_b_.resize(static_cast<size_t>(cfg.num_hidden_layers));
}

static void rmsnorm_rows(float* y, const float* x, const std::vector<float>& w, int64_t rows, double eps) {
  Buffer<float> rstd(rows);
  ops::rmsnorm_forward(y, rstd.data(), x, w.data(), rows, static_cast<int64_t>(w.size()), static_cast<float>(eps));
}

void Transformer::mlp(float* out, const float* x, const Mlp& m, int64_t rows) const {
  const int64_t I = m.gate.out();
  Buffer<float> g(rows * I), u(rows * I);
  ops::linear_forward(g.data(), x, m.gate.view, rows);
  ops::linear_forward(u.data(), x, m.up.view, rows);
  ops::silu_mul_forward(g.data(), g.data(), u.data(), rows * I);
  ops::linear_forward(out, g.data(), m.down.view, rows);
}

// Few tokens (decode): each expert's product is too small to split over
// the threads by itself, and one thread team per product costs more than the
// product. All the active experts' gate/up products become tasks of one
// parallel loop, their down products tasks of a second, each matrix cut in
// two row halves so the threads stay busy. Each product is computed whole by
// one thread, so the result does not depend on the thread count.
void Transformer::experts_as_tasks(float* shared_out, float* ys, const float* x, const float* xs,
                                   const std::vector<int32_t>& sizes, const Moe& m, int64_t rows) const {
  const int64_t D = cfg_.hidden_size;
  struct Job {
    const Mlp* mlp;
    const float* in;
    float* out;
    int64_t rows;
    Buffer<float> g, u;
  };
  std::vector<Job> jobs;
  int64_t off = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    if (sizes[e] > 0) jobs.push_back({&m.experts[e], xs + off * D, ys + off * D, sizes[e], {}, {}});
    off += sizes[e];
  }
  if (m.has_shared) jobs.push_back({&m.shared, x, shared_out, rows, {}, {}});
  for (auto& j : jobs) {
    j.g.resize(j.rows * j.mlp->gate.out());
    j.u.resize(j.rows * j.mlp->up.out());
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
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < J * 4; ++t) {
    Job& j = jobs[t / 4];
    const bool up = (t / 2) % 2, part = t % 2;
    const ops::WeightView& w = up ? j.mlp->up.view : j.mlp->gate.view;
    run_part(up ? j.u.data() : j.g.data(), j.in, w, j.rows, half(w), part);
  }
  for (auto& j : jobs) ops::silu_mul_forward(j.g.data(), j.g.data(), j.u.data(), static_cast<int64_t>(j.g.size()));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < J * 2; ++t) {
    Job& j = jobs[t / 2];
    const ops::WeightView& w = j.mlp->down.view;
    run_part(j.out, j.g.data(), w, j.rows, half(w), t % 2);
  }
  if (!m.has_shared) std::fill(shared_out, shared_out + rows * D, 0.0f);
}

// More tokens (prefill): each expert's rows, cut in chunks of at most
// kExpertTaskRows, are tasks of one parallel loop, each a whole MLP on one
// thread (largest first, taken dynamically). Threading every product of
// every expert instead costs a thread team, a packing of x and an uneven
// split per product, and at 32 rows per expert those dominated. A row's
// result does not depend on which thread computes it.
constexpr int64_t kExpertTaskRows = 128;

void Transformer::experts_in_row_tasks(float* shared_out, float* ys, const float* x, const float* xs,
                                       const std::vector<int32_t>& sizes, const Moe& m, int64_t rows) const {
  const int64_t D = cfg_.hidden_size;
  struct Task {
    const Mlp* mlp;
    const float* in;
    float* out;
    int64_t rows;
  };
  std::vector<Task> tasks;
  auto add = [&](const Mlp* mlp, const float* in, float* out, int64_t n) {
    for (int64_t r = 0; r < n; r += kExpertTaskRows)
      tasks.push_back({mlp, in + r * D, out + r * D, std::min(kExpertTaskRows, n - r)});
  };
  if (m.has_shared) add(&m.shared, x, shared_out, rows);
  int64_t off = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    add(&m.experts[e], xs + off * D, ys + off * D, sizes[e]);
    off += sizes[e];
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.rows > b.rows; });
  const int64_t T = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) if (T > 1 && !omp_in_parallel())
  for (int64_t t = 0; t < T; ++t) mlp(tasks[t].out, tasks[t].in, *tasks[t].mlp, tasks[t].rows);
  if (!m.has_shared) std::fill(shared_out, shared_out + rows * D, 0.0f);
}

void Transformer::moe(float* out, const float* x, const Moe& m, int64_t rows) const {
  const int64_t D = cfg_.hidden_size, E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  // Router in float32 over the (possibly bf16) gate weight.
  Buffer<float> logits(rows * E), scores(rows * E), weights(rows * K);
  Buffer<int32_t> experts(rows * K);
  ops::linear_forward(logits.data(), x, m.gate.view, rows);
  ops::ExpertSelectionConfig sc;
  sc.num_experts = E;
  sc.k = K;
  sc.n_group = cfg_.n_group;
  sc.topk_group = cfg_.topk_group;
  sc.scoring = cfg_.scoring_func == ScoringFunc::Sigmoid ? ops::ExpertScoring::Sigmoid : ops::ExpertScoring::Softmax;
  sc.group_score = cfg_.topk_method == TopkMethod::NoauxTc              ? ops::GroupScore::Top2Sum
                   : cfg_.topk_method == TopkMethod::GroupLimitedGreedy ? ops::GroupScore::Max
                                                                        : ops::GroupScore::None;
  sc.norm_topk_prob = cfg_.norm_topk_prob;
  sc.routed_scaling_factor = static_cast<float>(cfg_.routed_scaling_factor);
  ops::expert_selection_forward(experts.data(), weights.data(), scores.data(), logits.data(),
                                m.bias.empty() ? nullptr : m.bias.data(), rows, sc);
  // Dropless dispatch: sort assignments by expert, run each expert on its
  // contiguous rows, then combine in assignment order (deterministic).
  const int64_t n = rows * K;
  Buffer<int32_t> order(n), inverse(n);
  std::vector<int32_t> sizes(E);
  ops::route_indices(order.data(), inverse.data(), sizes.data(), experts.data(), n, E);
  Buffer<float> xs(n * D), ys(n * D);
  ops::route_forward(xs.data(), x, order.data(), rows, K, D);
  if (n <= task_parallel_assignments_) {
    experts_as_tasks(out, ys.data(), x, xs.data(), sizes, m, rows);
  } else {
    experts_in_row_tasks(out, ys.data(), x, xs.data(), sizes, m, rows);
  }
  parallel_ranges(rows, rows * K * D >= (int64_t{1} << 16), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const float wj = weights[t * K + j];
        const float* y = ys.data() + inverse[t * K + j] * D;
        float* o = out + t * D;
        for (int64_t d = 0; d < D; ++d) o[d] += wj * y[d];
      }
  });
}

void Transformer::attention(float* out, const float* x, const Layer& L, int64_t layer, const Batch& b,
                            infer::KvCache& cache) {
  const Attention& a = L.attn;
  const int64_t N = b.n, H = cfg_.num_attention_heads, nope = cfg_.qk_nope_head_dim, rope = cfg_.qk_rope_head_dim;
  const int64_t qk = nope + rope, vd = cfg_.v_head_dim, kvl = cfg_.kv_lora_rank;
  // Queries [N, H, qk].
  Buffer<float> q(N * H * qk);
  if (cfg_.q_lora_rank > 0) {
    Buffer<float> qa(N * cfg_.q_lora_rank);
    ops::linear_forward(qa.data(), x, a.q_a.view, N);
    rmsnorm_rows(qa.data(), qa.data(), a.q_a_norm, N, cfg_.rms_norm_eps);
    ops::linear_forward(q.data(), qa.data(), a.q_b.view, N);
  } else {
    ops::linear_forward(q.data(), x, a.q.view, N);
  }
  ops::rope_forward(q.data() + nope, q.data() + nope, b.pos.data(), rope_freqs_.data(), N, H, rope, H * qk, qk,
                    ops::RopeLayout::Interleaved);
  // Latent and shared rope key: kv_a gives [N, kvl + rope].
  Buffer<float> kva(N * (kvl + rope)), ckv(N * kvl), kpe(N * rope);
  ops::linear_forward(kva.data(), x, a.kv_a.view, N);
  for (int64_t t = 0; t < N; ++t) {
    std::memcpy(&ckv[t * kvl], &kva[t * (kvl + rope)], kvl * sizeof(float));
    std::memcpy(&kpe[t * rope], &kva[t * (kvl + rope) + kvl], rope * sizeof(float));
  }
  rmsnorm_rows(ckv.data(), ckv.data(), a.kv_a_norm, N, cfg_.rms_norm_eps);
  ops::rope_forward(kpe.data(), kpe.data(), b.pos.data(), rope_freqs_.data(), N, 1, rope, rope, rope,
                    ops::RopeLayout::Interleaved);

  Buffer<float> ctx(N * H * vd);  // attention output [N, H, v]
  const bool latent = cache.kind == infer::CacheKind::Latent;
  // The expanded keys/values of the new tokens: needed by the naive cache and
  // by the flash path of a fresh sequence.
  bool any_fresh = false;
  for (const auto& s : b.seqs) any_fresh |= s.past == 0;
  Buffer<float> kv, kfull, vfull;
  if (!latent || any_fresh) {
    kv.resize(N * H * (nope + vd));
    ops::linear_forward(kv.data(), ckv.data(), a.kv_b.view, N);
    kfull.resize(N * H * qk);
    vfull.resize(N * H * vd);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* src = &kv[(t * H + h) * (nope + vd)];
        float* k = &kfull[(t * H + h) * qk];
        std::memcpy(k, src, nope * sizeof(float));
        std::memcpy(k + nope, &kpe[t * rope], rope * sizeof(float));
        std::memcpy(&vfull[(t * H + h) * vd], src + nope, vd * sizeof(float));
      }
  }
  // kv_b widened to float32 for the absorbed path (per head, rows
  // [nope | v] x kvl), made on a layer's first decode step and kept: it is a
  // small share of a layer (DeepSeek-V3: 64 MiB as float32 next to about
  // 11 GiB of fp8 expert weights per layer), and
  // widening it again on every step cost more than the attention itself.
  std::vector<float>& wkvb = absorbed_kv_b_[layer];
  std::vector<const Batch::Seq*> cont;  // sequences that continue a cache
  for (const auto& s : b.seqs) {
    infer::SequenceCache& sc = cache.seqs[s.index];
    const int64_t r0 = s.row0, n = s.count;
    if (latent) {
      sc.c_kv[layer].insert(sc.c_kv[layer].end(), ckv.begin() + r0 * kvl, ckv.begin() + (r0 + n) * kvl);
      sc.k_pe[layer].insert(sc.k_pe[layer].end(), kpe.begin() + r0 * rope, kpe.begin() + (r0 + n) * rope);
    } else {
      sc.k[layer].insert(sc.k[layer].end(), kfull.begin() + r0 * H * qk, kfull.begin() + (r0 + n) * H * qk);
      sc.v[layer].insert(sc.v[layer].end(), vfull.begin() + r0 * H * vd, vfull.begin() + (r0 + n) * H * vd);
    }
    if (s.past == 0) {
      // A fresh sequence: tiled causal attention over its own tokens.
      Buffer<float> lse(H * n);
      ops::AttentionDims d{1, n, H, qk, vd, softmax_scale_};
      ops::attention_forward(&ctx[r0 * H * vd], lse.data(), &q[r0 * H * qk], &kfull[r0 * H * qk], &vfull[r0 * H * vd],
                             nullptr, d);
      continue;
    }
    cont.push_back(&s);
  }
  if (cont.empty()) {
    ops::linear_forward(out, ctx.data(), a.o.view, N);
    return;
  }
  if (latent && wkvb.empty()) {
    wkvb.resize(static_cast<size_t>(a.kv_b.out() * kvl));
    ops::widen_rows(wkvb.data(), a.kv_b.view, 0, a.kv_b.out());
  }
  // Sequences with a cache: queries at positions P..P+n-1 over T cached keys,
  // query j seeing keys <= P+j. The latent cache is shared by all heads, so
  // each sequence's heads attend together (H*n rows of scores from one pass
  // over c_kv); the naive cache has keys per head, so there each (sequence,
  // head) pair is a task. All tasks of the batch run in one thread team.
  int64_t work = 0;
  for (const auto* s : cont) work += s->count * (s->past + s->count) * H * (kvl + rope);
  const int64_t C = static_cast<int64_t>(cont.size()), heads_per_task = latent ? H : 1;
  // Softmax of rows r of S [rows, T] in place; row r is query r % n.
  auto softmax_rows = [](float* S, int64_t rows, int64_t n, int64_t P, int64_t T) {
    for (int64_t r = 0; r < rows; ++r) {
      float* row = &S[r * T];
      const int64_t visible = P + r % n + 1;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < visible; ++t) mx = std::max(mx, row[t]);
      double z = 0;
      for (int64_t t = 0; t < visible; ++t) {
        row[t] = std::exp(row[t] - mx);
        z += row[t];
      }
      const float inv = static_cast<float>(1.0 / z);
      for (int64_t t = 0; t < visible; ++t) row[t] *= inv;
      for (int64_t t = visible; t < T; ++t) row[t] = 0.0f;
    }
  };
  parallel_ranges(C * H / heads_per_task, work >= (int64_t{1} << 17), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Batch::Seq& s = *cont[i * heads_per_task / H];
      infer::SequenceCache& sc = cache.seqs[s.index];
      const int64_t r0 = s.row0, n = s.count, P = s.past, T = P + n;
      if (!latent) {
        const int64_t h = i % H;
        const float* qh = &q[(r0 * H + h) * qk];  // rows strided by H*qk
        Buffer<float> S(n * T);
        ops::gemm(false, true, n, T, qk, softmax_scale_, qh, H * qk, sc.k[layer].data() + h * qk, H * qk, 0.0f,
                  S.data(), T);
        softmax_rows(S.data(), n, n, P, T);
        ops::gemm(false, false, n, vd, T, 1.0f, S.data(), T, sc.v[layer].data() + h * vd, H * vd, 0.0f,
                  &ctx[(r0 * H + h) * vd], H * vd);
        continue;
      }
      // Rows h*n + j: head h, query j.
      const int64_t R = H * n;
      Buffer<float> lat(R * kvl), qpe(R * rope), S(R * T);
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = &q[(r0 * H + h) * qk];
        // q_abs = q_nope W_UK: the key up-projection folded into the query.
        ops::gemm(false, false, n, kvl, nope, 1.0f, qh, H * qk, &wkvb[h * (nope + vd) * kvl], kvl, 0.0f,
                  &lat[h * n * kvl], kvl);
        for (int64_t j = 0; j < n; ++j)
          std::memcpy(&qpe[(h * n + j) * rope], qh + j * H * qk + nope, rope * sizeof(float));
      }
      const float* ckv_l = sc.c_kv[layer].data();
      ops::gemm(false, true, R, T, kvl, softmax_scale_, lat.data(), kvl, ckv_l, kvl, 0.0f, S.data(), T);
      ops::gemm(false, true, R, T, rope, softmax_scale_, qpe.data(), rope, sc.k_pe[layer].data(), rope, 1.0f, S.data(),
                T);
      softmax_rows(S.data(), R, n, P, T);
      // Attend in the latent space, then apply each head's W_UV.
      ops::gemm(false, false, R, kvl, T, 1.0f, S.data(), T, ckv_l, kvl, 0.0f, lat.data(), kvl);
      for (int64_t h = 0; h < H; ++h)
        ops::gemm(false, true, n, vd, kvl, 1.0f, &lat[h * n * kvl], kvl, &wkvb[(h * (nope + vd) + nope) * kvl], kvl,
                  0.0f, &ctx[(r0 * H + h) * vd], H * vd);
    }
  });
  ops::linear_forward(out, ctx.data(), a.o.view, N);
}

std::vector<float> Transformer::step(infer::KvCache& cache, const std::vector<std::vector<int32_t>>& tokens,
                                     bool all_logits) {
  DS_CHECK(tokens.size() == cache.seqs.size(), "step: {} token lists for a cache of {} sequences", tokens.size(),
           cache.seqs.size());
  const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size;
  Batch b;
  for (size_t s = 0; s < tokens.size(); ++s) {
    if (tokens[s].empty()) continue;
    const int64_t past = cache.seqs[s].length, n = static_cast<int64_t>(tokens[s].size());
    DS_CHECK(past + n <= cfg_.max_position_embeddings,
             "sequence {} would reach {} tokens, beyond max_position_embeddings {}", s, past + n,
             cfg_.max_position_embeddings);
    DS_CHECK(cfg_.index_topk == 0 || past + n <= cfg_.index_topk,
             "sequence {} would reach {} tokens; DeepSeek-V3.2 sparse attention beyond index_topk {} keys is not "
             "supported yet (up to that length it equals dense attention)",
             s, past + n, cfg_.index_topk);
    b.seqs.push_back({static_cast<int64_t>(s), b.n, n, past});
    for (int64_t i = 0; i < n; ++i) {
      const int32_t t = tokens[s][i];
      DS_CHECK(t >= 0 && t < V, "token id {} outside the vocabulary of {}", t, V);
      b.token.push_back(t);
      b.pos.push_back(static_cast<int32_t>(past + i));
    }
    b.n += n;
  }
  if (b.n == 0) return {};
  const int64_t N = b.n;
  Buffer<float> h(N * D), x(N * D), y(N * D);
  const size_t es = dtype_size(w_.embed.dtype());
  const char* emb = static_cast<const char*>(w_.embed.raw());
  for (int64_t t = 0; t < N; ++t) convert(&h[t * D], DType::F32, emb + b.token[t] * D * es, w_.embed.dtype(), D);

  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const Layer& L = w_.layers[l];
    rmsnorm_rows(x.data(), h.data(), L.input_norm, N, cfg_.rms_norm_eps);
    attention(y.data(), x.data(), L, static_cast<int64_t>(l), b, cache);
    for (int64_t i = 0; i < N * D; ++i) h[i] += y[i];
    rmsnorm_rows(x.data(), h.data(), L.post_attention_norm, N, cfg_.rms_norm_eps);
    if (L.is_moe)
      moe(y.data(), x.data(), L.moe, N);
    else
      mlp(y.data(), x.data(), L.mlp, N);
    for (int64_t i = 0; i < N * D; ++i) h[i] += y[i];
  }
  for (const auto& s : b.seqs) cache.seqs[s.index].length += s.count;

  // Final norm and head on the rows that need logits.
  std::vector<int64_t> rows;
  if (all_logits) {
    for (int64_t t = 0; t < N; ++t) rows.push_back(t);
  } else {
    for (const auto& s : b.seqs) rows.push_back(s.row0 + s.count - 1);
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  Buffer<float> hr(R * D);
  for (int64_t i = 0; i < R; ++i) std::memcpy(&hr[i * D], &h[rows[i] * D], D * sizeof(float));
  rmsnorm_rows(hr.data(), hr.data(), w_.final_norm, R, cfg_.rms_norm_eps);
  std::vector<float> logits(R * V);
  ops::linear_forward(logits.data(), hr.data(), w_.lm_head.view, R);
  // Non-finite logits mean a broken checkpoint or an overflow: never pass
  // them on as a result (a sampler would draw garbage from them).
  for (int64_t i = 0; i < R * V; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &logits[i], sizeof bits);
    DS_CHECK((bits & 0x7f800000u) != 0x7f800000u,
             "the model produced a non-finite logit ({}) for token id {} at position {}: the weights or the "
             "activations overflowed",
             logits[i], i % V, b.pos[rows[i / V]]);
  }
  return logits;
}

}  // namespace ds::model
