#include "infer/engine.h"

#include <algorithm>
#include <cstring>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/layer.h"
#include "model/load.h"
#include "ops/attention.h"
#include "ops/latent_attention.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"

namespace ds::infer {

namespace {

// The packed new tokens of one step.
struct Batch {
  int64_t n = 0;
  std::vector<int32_t> token, pos;  // [n]; pos: absolute position within its sequence
  struct Seq {
    int64_t index, row0, count, past;  // sequence, first packed row, new tokens, cached before
  };
  std::vector<Seq> seqs;  // sequences with new tokens
};

}  // namespace

// The layer's attention for generation: appends the new tokens to the cache,
// then fresh sequences attend over their own expanded keys (tiled causal
// attention), sequences that continue a cache over all their cached tokens
// (latent: absorbed, one pass over c_kv for all heads; naive: per head).
class CacheAttention : public model::KvAttention {
 public:
  CacheAttention(Engine& e, KvCache& cache, const Batch& b) : e_(e), cache_(cache), b_(b) {}

  void attend(float* ctx, int64_t layer, const float* q, const float* ckv, const float* kpe,
              const model::AttentionParams<ops::WeightView>& a, const model::StageConfig& s) override {
    const model::ModelConfig& c = e_.cfg_;
    const int64_t N = b_.n, H = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
    const int64_t qk = nope + rope, vd = c.v_head_dim, kvl = c.kv_lora_rank;
    const bool latent = cache_.kind == CacheKind::Latent;
    bool any_fresh = false;
    for (const auto& sq : b_.seqs) any_fresh |= sq.past == 0;
    // The expanded keys/values of the new tokens: needed by the naive cache
    // and by the flash path of a fresh sequence.
    Buffer<float> kfull, vfull;
    if (!latent || any_fresh) {
      kfull.resize(N * H * qk);
      vfull.resize(N * H * vd);
      model::get_key_value_forward(kfull.data(), vfull.data(), ckv, kpe, a, s, N);
    }
    std::vector<const Batch::Seq*> cont;  // sequences that continue a cache
    for (const auto& sq : b_.seqs) {
      SequenceCache& sc = cache_.seqs[sq.index];
      const int64_t r0 = sq.row0, n = sq.count;
      if (latent) {
        sc.c_kv[layer].insert(sc.c_kv[layer].end(), ckv + r0 * kvl, ckv + (r0 + n) * kvl);
        sc.k_pe[layer].insert(sc.k_pe[layer].end(), kpe + r0 * rope, kpe + (r0 + n) * rope);
      } else {
        sc.k[layer].insert(sc.k[layer].end(), kfull.data() + r0 * H * qk, kfull.data() + (r0 + n) * H * qk);
        sc.v[layer].insert(sc.v[layer].end(), vfull.data() + r0 * H * vd, vfull.data() + (r0 + n) * H * vd);
      }
      if (sq.past == 0) {
        Buffer<float> lse(H * n);
        ops::AttentionDims d{1, n, H, qk, vd, s.softmax_scale};
        ops::attention_forward(ctx + r0 * H * vd, lse.data(), q + r0 * H * qk, kfull.data() + r0 * H * qk,
                               vfull.data() + r0 * H * vd, nullptr, d);
        continue;
      }
      cont.push_back(&sq);
    }
    if (cont.empty()) return;
    // kv_b widened to float32 for the absorbed path (per head, rows
    // [nope | v] x kvl), made on a layer's first decode step and kept: it is
    // a small share of a layer (DeepSeek-V3: 64 MiB as float32 next to about
    // 11 GiB of fp8 expert weights per layer), and widening it again on every
    // step cost more than the attention itself.
    std::vector<float>& wkvb = e_.absorbed_kv_b_[layer];
    if (latent && wkvb.empty()) {
      wkvb.resize(static_cast<size_t>(a.kv_b.rows * kvl));
      ops::widen_rows(wkvb.data(), a.kv_b, 0, a.kv_b.rows);
    }
    // Latent: one task per sequence (all heads at once); naive: one task per
    // (sequence, head). All tasks of the batch run in one thread team.
    int64_t work = 0;
    for (const auto* sq : cont) work += sq->count * (sq->past + sq->count) * H * (kvl + rope);
    const int64_t C = static_cast<int64_t>(cont.size()), heads_per_task = latent ? H : 1;
    const ops::LatentAttentionDims ld{H, nope, rope, vd, kvl, s.softmax_scale};
    parallel_ranges(C * H / heads_per_task, work >= (int64_t{1} << 17), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const Batch::Seq& sq = *cont[i * heads_per_task / H];
        SequenceCache& sc = cache_.seqs[sq.index];
        const int64_t r0 = sq.row0, n = sq.count, P = sq.past, T = P + n;
        if (latent) {
          ops::latent_attention_forward(ctx + r0 * H * vd, H * vd, q + r0 * H * qk, H * qk, sc.c_kv[layer].data(),
                                        sc.k_pe[layer].data(), wkvb.data(), n, P, ld);
          continue;
        }
        // Naive: scores of head h against its expanded keys, causal softmax.
        const int64_t h = i % H;
        Buffer<float> S(n * T);
        ops::gemm(false, true, n, T, qk, s.softmax_scale, q + (r0 * H + h) * qk, H * qk, sc.k[layer].data() + h * qk,
                  H * qk, 0.0f, S.data(), T);
        ops::causal_softmax_rows(S.data(), n, n, P, T);
        ops::gemm(false, false, n, vd, T, 1.0f, S.data(), T, sc.v[layer].data() + h * vd, H * vd, 0.0f,
                  ctx + (r0 * H + h) * vd, H * vd);
      }
    });
  }

 private:
  Engine& e_;
  KvCache& cache_;
  const Batch& b_;
};

Engine::Engine(const model::ModelConfig& cfg, const model::ParamsView& w) : cfg_(cfg), w_(w), stages_(cfg) {
  absorbed_kv_b_.resize(static_cast<size_t>(cfg.num_hidden_layers));
}

std::vector<float> Engine::step(KvCache& cache, const std::vector<std::vector<int32_t>>& tokens, bool all_logits) {
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
  Buffer<float> h(N * D);
  const ops::WeightView& emb = w_.embed;
  const size_t es = dtype_size(emb.dtype);
  for (int64_t t = 0; t < N; ++t)
    convert(&h[t * D], DType::F32, static_cast<const char*>(emb.data) + b.token[t] * D * es, emb.dtype, D);

  CacheAttention attention(*this, cache, b);
  const model::TokenLayout layout{1, N, b.pos.data(), nullptr};
  for (size_t l = 0; l < w_.layers.size(); ++l)
    model::layer_forward(h.data(), w_.layers[l], static_cast<int64_t>(l), stages_, layout, &attention, nullptr, {});
  for (const auto& s : b.seqs) cache.seqs[s.index].length += s.count;

  // Final norm and head on the rows that need logits.
  std::vector<int64_t> rows;
  if (all_logits) {
    for (int64_t t = 0; t < N; ++t) rows.push_back(t);
  } else {
    for (const auto& s : b.seqs) rows.push_back(s.row0 + s.count - 1);
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  Buffer<float> hr(R * D), rstd(R);
  for (int64_t i = 0; i < R; ++i) std::memcpy(&hr[i * D], &h[rows[i] * D], D * sizeof(float));
  ops::rmsnorm_forward(hr.data(), rstd.data(), hr.data(), model::vector_data(w_.final_norm), R, D,
                       static_cast<float>(cfg_.rms_norm_eps));
  std::vector<float> logits(R * V);
  ops::linear_forward(logits.data(), hr.data(), w_.lm_head, R);
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

std::unique_ptr<LoadedModel> load_model(const std::string& dir) {
  auto m = std::make_unique<LoadedModel>();
  m->config = model::load_config(dir);
  m->files = io::SafetensorsSet::open_dir(dir);
  m->weights = model::ModelWeights::load(m->files, m->config);
  m->engine = std::make_unique<Engine>(m->config, m->weights.view);
  return m;
}

}  // namespace ds::infer
