#include "infer/engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <limits>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/stage_times.h"
#include "model/layer.h"
#include "model/load.h"
#include "model/mhc_block.h"
#include "ops/attention.h"
#include "ops/backend.h"
#include "ops/indexer.h"
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

// The absorbed copy's bytes (ops::absorb_kv_b), and the size up to which
// the CPU keeps one rather than reading kv_b itself. Measured with
// `attention_bench --benchmark_filter=latent_cold` (weights from memory,
// Zen 5, 2 threads, one sequence; medians of 6 interleaved runs): 8 heads
// of kv_lora 256 (1 MiB a layer as float32) 67.4 us absorbed against 73.9
// us from a bf16 kv_b; DeepSeek-V2-Lite's 16 heads (8 MiB) 451 us against
// 419 (bf16) and 390 (e4m3); DeepSeek-V3's 128 heads (64 MiB) 3.34 ms
// against 2.77 and 2.30.
std::atomic<size_t> g_small_absorbed_bytes{size_t{4} << 20};

}  // namespace

size_t detail::set_small_absorbed_bytes(size_t bytes) { return g_small_absorbed_bytes.exchange(bytes); }

// The layer's attention for generation: appends the new tokens to the cache,
// then fresh sequences attend over their own expanded keys (tiled causal
// attention), sequences that continue a cache over all their cached tokens
// (latent: absorbed, one pass over c_kv for all heads; naive: per head).
// Many new tokens continuing a cache (a long prompt's later prefill chunks)
// take the tiled attention too, over keys and values expanded from the
// latent cache when that costs fewer multiply-adds than the absorbed form
// (see expand_continuation).
//
// DeepSeek-V3.2 (DSA): a query at position p >= index_topk sees more keys
// than the indexer keeps, so it attends only to the index_topk keys the
// indexer scores highest; queries before that see all their keys, which is
// what the indexer would select, and take the dense paths above. The
// indexer's fp8 keys of every token go into the cache beside the latent.
class CacheAttention : public model::KvAttention {
 public:
  CacheAttention(Engine& e, KvCache& cache, const Batch& b) : e_(e), cache_(cache), b_(b) {}

  // Engram: the last history() conv input rows of a sequence (zeros before
  // its start), and the new tokens' rows appended.
  const float* engram_history(int64_t layer, int64_t i) override {
    const SequenceCache& sc = cache_.seqs[static_cast<size_t>(b_.seqs[static_cast<size_t>(i)].index)];
    const auto& rows = sc.engram[static_cast<size_t>(layer)];
    if (rows.empty()) return nullptr;
    const model::EngramDims& d = e_.stages_.engram;
    const int64_t W = d.width(), have = static_cast<int64_t>(rows.size()) / W, n = std::min(have, d.history());
    history_.emplace_back(static_cast<size_t>(d.history() * W), 0.0f);
    std::copy(rows.end() - n * W, rows.end(), history_.back().end() - n * W);
    return history_.back().data();
  }
  void engram_keep(int64_t layer, int64_t i, const float* rows, int64_t count) override {
    SequenceCache& sc = cache_.seqs[static_cast<size_t>(b_.seqs[static_cast<size_t>(i)].index)];
    auto& kept = sc.engram[static_cast<size_t>(layer)];
    kept.insert(kept.end(), rows, rows + count * e_.stages_.engram.width());
  }

  void attend(float* ctx, int64_t layer, const model::AttentionInputs& in,
              const model::AttentionParams<ops::WeightView>& a, const model::StageConfig& s) override {
    Call call = prepare(ctx, layer, in, a, s);
    const std::vector<Item> items = append_and_attend_tiled(call);
    if (items.empty()) return;
    // The CPU reads the absorptions from a narrow kv_b itself, in its dtype
    // (ops/latent_attention.h), where the float32 copy would be large: a
    // decode step at batch 1 reads each byte once either way, and the copy
    // is 2x (bf16) to 4x (fp8) kv_b's bytes (DeepSeek-V3: 64 MiB a layer,
    // 3.9 GiB over its 61 layers and the MTP layer). A small copy stays (it is read faster than kv_b is
    // widened), as do float32 weights and a device backend's: the absorbed
    // copy (ops::absorb_kv_b), made on a layer's first use and kept.
    std::vector<float>& absorbed = e_.absorbed_kv_b_[layer];
    ops::LatentAttentionDims ld{call.H, call.nope, call.rope, call.vd, call.kvl, s.softmax_scale};
    const bool from_kv_b = ops::active_backend().device == Device::CPU && ops::reads_kv_b(a.kv_b, ld) &&
                           ops::absorbed_kv_b_bytes(ld) > g_small_absorbed_bytes.load(std::memory_order_relaxed);
    if (from_kv_b) ld.kv_b = &a.kv_b;
    if (call.latent && !from_kv_b && absorbed.empty()) absorbed = ops::absorb_kv_b(a.kv_b, ld);
    int64_t work = 0;
    for (const auto& it : items)
      work += it.n * (it.sparse ? call.topk * call.H * (call.kvl + call.rope) + (it.past + it.n) * call.Hi * call.Di
                                : (it.past + it.n) * call.H * (call.kvl + call.rope));
    const bool parallel = work >= (int64_t{1} << 17);
    // The indexer's scores of a sparse item [n, T]. With fewer items than
    // threads (decode), they are computed first, split over chunks of keys,
    // so a long context keeps every thread busy; else inside the item's task.
    // Both give the same bits (chunks start on the scorer's key tiles).
    std::vector<Buffer<float>> scores(items.size());
    const bool split_scores = static_cast<int64_t>(items.size()) < num_threads();
    if (split_scores) score_in_chunks(call, items, scores, parallel);
    std::vector<Buffer<int32_t>> selected(items.size());
    const bool select = std::any_of(items.begin(), items.end(), [](const Item& it) { return it.sparse; });
    if (!call.latent || select) select_and_attend_naive(call, items, scores, split_scores, parallel, selected);
    if (!call.latent) return;
    attend_latent(call, items, selected, from_kv_b ? nullptr : absorbed.data(), ld);
  }

 private:
  // One call of attend: the layer's shapes and inputs, and what the new
  // tokens give (their expanded keys and values, the indexer's keys and
  // queries).
  struct Call {
    Call(float* ctx, int64_t layer, const model::AttentionInputs& in, const model::AttentionParams<ops::WeightView>& a,
         const model::StageConfig& s, const model::ModelConfig& c, int64_t N, bool latent, bool dsa)
        : ctx(ctx),
          layer(layer),
          in(in),
          a(a),
          s(s),
          N(N),
          H(c.num_attention_heads),
          nope(c.qk_nope_head_dim),
          rope(c.qk_rope_head_dim),
          qk(nope + rope),
          vd(c.v_head_dim),
          kvl(c.kv_lora_rank),
          q(in.query_proj),
          latent(latent),
          dsa(dsa),
          topk(dsa ? c.index_topk : std::numeric_limits<int64_t>::max()),
          Hi(c.index_n_heads),
          Di(c.index_head_dim),
          nb(dsa ? ops::indexer_scale_blocks(Di) : 0) {}
    float* ctx;
    int64_t layer;
    const model::AttentionInputs& in;
    const model::AttentionParams<ops::WeightView>& a;
    const model::StageConfig& s;
    int64_t N, H, nope, rope, qk, vd, kvl;
    const float* q;
    bool latent, dsa;
    int64_t topk, Hi, Di, nb;
    Buffer<float> kfull, vfull;
    Buffer<uint8_t> ikey;
    Buffer<float> iscale, iq, iw;
  };
  // Work on the cache: rows [r0, r0 + n) of one sequence (past: tokens
  // before r0), dense or sparse.
  struct Item {
    const Batch::Seq* seq;
    int64_t r0, n, past;
    bool sparse;
  };

  Call prepare(float* ctx, int64_t layer, const model::AttentionInputs& in,
               const model::AttentionParams<ops::WeightView>& a, const model::StageConfig& s) const {
    const int64_t N = b_.n;
    Call call(ctx, layer, in, a, s, e_.cfg_, N, cache_.kind == CacheKind::Latent,
              e_.cfg_.index_n_heads > 0 && !e_.dense_attention_);
    bool any_fresh = false, any_sparse = false;
    for (const auto& sq : b_.seqs) {
      any_fresh |= sq.past == 0;
      any_sparse |= sq.past + sq.count > call.topk;
    }
    // The expanded keys/values of the new tokens: needed by the naive cache
    // and by the flash path of a fresh sequence.
    if (!call.latent || any_fresh) {
      call.kfull.resize(N * call.H * call.qk);
      call.vfull.resize(N * call.H * call.vd);
      model::get_key_value_forward(call.kfull.data(), call.vfull.data(), in.mla_kv, in.k_pe, a, s, N);
    }
    // The indexer: keys of every new token, queries when some row selects.
    if (call.dsa) {
      call.ikey.resize(N * call.Di);
      call.iscale.resize(N * call.nb);
      if (any_sparse) {
        call.iq.resize(N * call.Hi * call.Di);
        call.iw.resize(N * call.Hi);
      }
      model::indexer_forward({call.ikey.data(), call.iscale.data(), any_sparse ? call.iq.data() : nullptr,
                              any_sparse ? call.iw.data() : nullptr},
                             in.x, in.mla_q, a.indexer, s, b_.pos.data(), N);
    }
    return call;
  }

  // Appends each sequence's new tokens to the cache, attends the rows that
  // take the tiled attention (fresh sequences, long continuations), and
  // returns the rest as work on the cache.
  std::vector<Item> append_and_attend_tiled(const Call& call) {
    const int64_t layer = call.layer, H = call.H, qk = call.qk, vd = call.vd, kvl = call.kvl, rope = call.rope,
                  Di = call.Di, nb = call.nb;
    const model::AttentionInputs& in = call.in;
    std::vector<Item> items;
    constexpr int64_t kSparseRows = 16;  // rows per sparse task: fixed, whatever the thread count
    for (const auto& sq : b_.seqs) {
      SequenceCache& sc = cache_.seqs[sq.index];
      const int64_t r0 = sq.row0, n = sq.count;
      if (call.latent) {
        sc.c_kv[layer].insert(sc.c_kv[layer].end(), in.mla_kv + r0 * kvl, in.mla_kv + (r0 + n) * kvl);
        sc.k_pe[layer].insert(sc.k_pe[layer].end(), in.k_pe + r0 * rope, in.k_pe + (r0 + n) * rope);
      } else {
        sc.k[layer].insert(sc.k[layer].end(), call.kfull.data() + r0 * H * qk, call.kfull.data() + (r0 + n) * H * qk);
        sc.v[layer].insert(sc.v[layer].end(), call.vfull.data() + r0 * H * vd, call.vfull.data() + (r0 + n) * H * vd);
      }
      if (call.dsa) {
        sc.index_k[layer].insert(sc.index_k[layer].end(), call.ikey.data() + r0 * Di, call.ikey.data() + (r0 + n) * Di);
        sc.index_scale[layer].insert(sc.index_scale[layer].end(), call.iscale.data() + r0 * nb,
                                     call.iscale.data() + (r0 + n) * nb);
      }
      // Rows at positions < topk attend densely.
      const int64_t dense = std::clamp(call.topk - sq.past, int64_t{0}, n);
      if (dense > 0 && sq.past == 0) {
        Buffer<float> lse(H * dense);
        ops::AttentionDims d{1, dense, H, qk, vd, call.s.softmax_scale};
        ops::attention_forward(call.ctx + r0 * H * vd, lse.data(), call.q + r0 * H * qk,
                               call.kfull.data() + r0 * H * qk, call.vfull.data() + r0 * H * vd, nullptr, d);
      } else if (dense > 0 && expand_continuation(e_.cfg_, sq.past, dense, call.latent)) {
        attend_expanded(call, sc, r0, dense, sq.past);
      } else if (dense > 0) {
        items.push_back({&sq, r0, dense, sq.past, false});
      }
      for (int64_t j = dense; j < n; j += kSparseRows)
        items.push_back({&sq, r0 + j, std::min(kSparseRows, n - j), sq.past + j, true});
    }
    return items;
  }

  // Rows [r0, r0 + n) of a continuation, tiled over all their keys: the
  // naive cache's, or those expanded from the latent cache.
  static void attend_expanded(const Call& call, const SequenceCache& sc, int64_t r0, int64_t n, int64_t past) {
    const int64_t layer = call.layer, H = call.H, qk = call.qk, vd = call.vd;
    const int64_t T = past + n;  // the keys the rows see
    Buffer<float> kx, vx;
    const float* kall = call.latent ? nullptr : sc.k[layer].data();
    const float* vall = call.latent ? nullptr : sc.v[layer].data();
    if (call.latent) {
      kx.resize(T * H * qk);
      vx.resize(T * H * vd);
      model::get_key_value_forward(kx.data(), vx.data(), sc.c_kv[layer].data(), sc.k_pe[layer].data(), call.a, call.s,
                                   T);
      kall = kx.data();
      vall = vx.data();
    }
    ops::attention_forward_past(call.ctx + r0 * H * vd, call.q + r0 * H * qk, kall, vall, past,
                                ops::AttentionDims{1, n, H, qk, vd, call.s.softmax_scale});
  }

  // The indexer's scores of keys [s0, s0 + m) for a sparse item's rows, into
  // `scores` [n, T].
  void score_keys(const Call& call, const Item& it, Buffer<float>& scores, int64_t s0, int64_t m) const {
    const SequenceCache& sc = cache_.seqs[it.seq->index];
    const int64_t T = it.past + it.n, Hi = call.Hi, Di = call.Di;
    ops::indexer_scores(scores.data() + s0, T, call.iq.data() + it.r0 * Hi * Di, call.iw.data() + it.r0 * Hi, it.n, Hi,
                        Di, sc.index_k[call.layer].data() + s0 * Di, sc.index_scale[call.layer].data() + s0 * call.nb,
                        m);
  }

  // Every sparse item's scores, the threads splitting them by chunks of keys.
  void score_in_chunks(const Call& call, const std::vector<Item>& items, std::vector<Buffer<float>>& scores,
                       bool parallel) const {
    constexpr int64_t kKeyChunk = 1024;               // a multiple of the scorer's key tile
    std::vector<std::pair<int64_t, int64_t>> chunks;  // (item, first key)
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].sparse) continue;
      const int64_t T = items[i].past + items[i].n;
      scores[i].resize(items[i].n * T);
      for (int64_t s0 = 0; s0 < T; s0 += kKeyChunk) chunks.emplace_back(static_cast<int64_t>(i), s0);
    }
    parallel_ranges(static_cast<int64_t>(chunks.size()), parallel, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const auto [i, s0] = chunks[c];
        score_keys(call, items[i], scores[i], s0, std::min(kKeyChunk, items[i].past + items[i].n - s0));
      }
    });
  }

  // Each sparse item's selected keys into `selected` (scoring them first
  // unless split_scores did), and with the naive cache each item's
  // attention.
  void select_and_attend_naive(const Call& call, const std::vector<Item>& items, std::vector<Buffer<float>>& scores,
                               bool split_scores, bool parallel, std::vector<Buffer<int32_t>>& selected) const {
    // Threads take contiguous ranges of tasks; a prefill's later rows see
    // more keys, so the tasks run in the order first, last, second, ...
    // which gives every range a like share of the work. With the latent
    // cache a task only selects a sparse item's keys; the attention of
    // every item then runs in one call (attend_latent).
    std::vector<int64_t> order;
    for (int64_t a = 0, b = static_cast<int64_t>(items.size()) - 1; a <= b; ++a, --b) {
      order.push_back(a);
      if (a < b) order.push_back(b);
    }
    const int64_t topk = call.topk;
    parallel_ranges(static_cast<int64_t>(items.size()), parallel, [&](int64_t i0, int64_t i1) {
      for (int64_t task = i0; task < i1; ++task) {
        const int64_t i = order[task];
        const Item& it = items[i];
        const int64_t n = it.n, P = it.past, T = P + n;  // T: keys the item's last row sees
        Buffer<int32_t>& sel = selected[i];
        if (it.sparse) {
          // The indexer's choice for each row: the topk best of its keys.
          if (!split_scores) {
            scores[i].resize(n * T);
            score_keys(call, it, scores[i], 0, T);
          }
          const Buffer<float>& score = scores[i];
          sel.resize(n * topk);
          for (int64_t j = 0; j < n; ++j)  // a sparse row sees more than topk keys: exactly topk are chosen
            ops::topk_indices(sel.data() + j * topk, score.data() + j * T, P + j + 1, topk);
          scores[i] = Buffer<float>();
        }
        if (!call.latent) attend_naive(call, it, cache_.seqs[it.seq->index], sel);
      }
    });
  }

  // Naive: per head, scores against the expanded keys, the causal softmax
  // (over the selected keys only when sparse), then the values.
  static void attend_naive(const Call& call, const Item& it, const SequenceCache& sc, const Buffer<int32_t>& sel) {
    const int64_t layer = call.layer, H = call.H, qk = call.qk, vd = call.vd;
    const int64_t n = it.n, P = it.past, T = P + n;
    float* out = call.ctx + it.r0 * H * vd;
    const float* qi = call.q + it.r0 * H * qk;
    Buffer<float> S(n * T);
    for (int64_t h = 0; h < H; ++h) {
      ops::gemm(false, true, n, T, qk, call.s.softmax_scale, qi + h * qk, H * qk, sc.k[layer].data() + h * qk, H * qk,
                0.0f, S.data(), T);
      if (it.sparse) mask_unselected(S.data(), n, T, sel.data(), call.topk);
      ops::causal_softmax_rows(S.data(), n, n, P, T);
      ops::gemm(false, false, n, vd, T, 1.0f, S.data(), T, sc.v[layer].data() + h * vd, H * vd, 0.0f, out + h * vd,
                H * vd);
    }
  }

  // Every latent item at once: a dense item is one sequence's rows, each
  // row of a sparse item a query of its own over its topk keys.
  void attend_latent(const Call& call, const std::vector<Item>& items, const std::vector<Buffer<int32_t>>& selected,
                     const float* absorbed, const ops::LatentAttentionDims& ld) const {
    const int64_t H = call.H, qk = call.qk, vd = call.vd, topk = call.topk;
    std::vector<ops::LatentQueries> queries;
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      const SequenceCache& sc = cache_.seqs[it.seq->index];
      ops::LatentQueries lq;
      lq.c_kv = sc.c_kv[call.layer].data();
      lq.k_pe = sc.k_pe[call.layer].data();
      for (int64_t j = 0; j < (it.sparse ? it.n : 1); ++j) {
        lq.q = call.q + (it.r0 + j) * H * qk;
        lq.ctx = call.ctx + (it.r0 + j) * H * vd;
        if (it.sparse) {
          lq.past = topk - 1;
          lq.keys = selected[i].data() + j * topk;
        } else {
          lq.n = it.n;
          lq.past = it.past;
        }
        queries.push_back(lq);
      }
    }
    ops::latent_attention_forward(queries.data(), static_cast<int64_t>(queries.size()), H * qk, H * vd, absorbed, ld);
  }

  // Scores of keys a row did not select become -inf (rows of S [n, T]).
  static void mask_unselected(float* S, int64_t n, int64_t T, const int32_t* sel, int64_t k) {
    std::vector<char> keep(static_cast<size_t>(T));
    for (int64_t j = 0; j < n; ++j) {
      std::fill(keep.begin(), keep.end(), 0);
      for (int64_t i = 0; i < k; ++i) keep[sel[j * k + i]] = 1;
      for (int64_t t = 0; t < T; ++t)
        if (!keep[t]) S[j * T + t] = -std::numeric_limits<float>::infinity();
    }
  }

  Engine& e_;
  KvCache& cache_;
  const Batch& b_;
  std::deque<std::vector<float>> history_;  // Engram's history rows handed out this step
};

// Multiply-adds of each form, over the T = past + n keys (causal: query j
// sees past + j + 1 of them):
//   absorbed: H n kvl (nope + v)  + H pairs (2 kvl + rope)
//   expanded: T kvl H (nope + v)  + H pairs (nope + rope + v)
// with the naive cache already expanded (no first term). Few queries
// (decode) stay absorbed: reading the latent once is what makes decode fast.
bool expand_continuation(const model::ModelConfig& c, int64_t past, int64_t n, bool latent) {
  constexpr int64_t kMinRows = 16;
  if (n < kMinRows) return false;
  if (!latent) return true;
  const double H = static_cast<double>(c.num_attention_heads), kvl = static_cast<double>(c.kv_lora_rank);
  const double nope = static_cast<double>(c.qk_nope_head_dim), rope = static_cast<double>(c.qk_rope_head_dim);
  const double vd = static_cast<double>(c.v_head_dim), N = static_cast<double>(n);
  const double T = static_cast<double>(past) + N, pairs = N * (static_cast<double>(past) + (N + 1) / 2);
  const double absorbed = H * N * kvl * (nope + vd) + H * pairs * (2 * kvl + rope);
  const double expanded = T * kvl * H * (nope + vd) + H * pairs * (nope + rope + vd);
  return expanded < absorbed;
}

Engine::Engine(const model::ModelConfig& cfg, const model::ParamsView& w) : cfg_(cfg), w_(w), stages_(cfg) {
  absorbed_kv_b_.resize(static_cast<size_t>(cfg.num_hidden_layers) + w.mtp.size());
}

namespace {

// The new tokens of each sequence packed in order, sequence s's at
// positions past(s, n), ... (past checks the sequence and returns its start).
template <class Past>
Batch pack(const std::vector<std::vector<int32_t>>& tokens, int64_t V, Past past) {
  Batch b;
  for (size_t s = 0; s < tokens.size(); ++s) {
    if (tokens[s].empty()) continue;
    const int64_t n = static_cast<int64_t>(tokens[s].size()), p = past(s, n);
    b.seqs.push_back({static_cast<int64_t>(s), b.n, n, p});
    for (int64_t i = 0; i < n; ++i) {
      const int32_t t = tokens[s][i];
      DS_CHECK(t >= 0 && t < V, "token id {} outside the vocabulary of {}", t, V);
      b.token.push_back(t);
      b.pos.push_back(static_cast<int32_t>(p + i));
    }
    b.n += n;
  }
  return b;
}

// Rows of the embedding as float32 [n, D].
void embed_rows(float* out, const ops::WeightView& emb, const int32_t* tokens, int64_t n, int64_t D) {
  for (int64_t t = 0; t < n; ++t) ops::widen_rows(out + t * D, emb, tokens[t], tokens[t] + 1);
}

}  // namespace

void Engine::trim_engram_rows(SequenceCache& sc) const {
  // The conv reads history() rows back; kEngramSlack more allow a draft's
  // rollback. Dropped once twice that many are kept (amortised).
  constexpr int64_t kEngramSlack = 16;
  const int64_t keep = stages_.engram.history() + kEngramSlack, kept = sc.length - sc.engram_first;
  if (kept <= 2 * keep) return;
  const int64_t drop = kept - keep, W = stages_.engram.width();
  for (auto& rows : sc.engram)
    if (!rows.empty()) rows.erase(rows.begin(), rows.begin() + drop * W);
  sc.engram_first += drop;
}

std::vector<float> Engine::step(KvCache& cache, const std::vector<std::vector<int32_t>>& tokens, bool all_logits,
                                std::vector<float>* hidden) {
  DS_CHECK(tokens.size() == cache.seqs.size(), "step: {} token lists for a cache of {} sequences", tokens.size(),
           cache.seqs.size());
  const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size;
  const Batch b = pack(tokens, V, [&](size_t s, int64_t n) {
    const int64_t past = cache.seqs[s].length;
    DS_CHECK(past + n <= cfg_.max_position_embeddings,
             "sequence {} would reach {} tokens, beyond max_position_embeddings {}", s, past + n,
             cfg_.max_position_embeddings);
    return past;
  });
  if (b.n == 0) return {};
  const int64_t N = b.n;
  // With mHC (k > 1) the layers carry k streams per token, each starting as
  // the embedding; their sum goes to the final norm.
  const int64_t k = cfg_.mhc_expansion_rate;
  Buffer<float> h(N * D);
  embed_rows(h.data(), w_.embed, b.token.data(), N, D);
  Buffer<float> streams;
  if (k > 1) {
    streams.resize(N * k * D);
    model::mhc_expand(streams.data(), h.data(), N, k, D);
  }

  CacheAttention attention(*this, cache, b);
  // Engram: each sequence's rows and its last N - 1 tokens before them.
  std::vector<model::SequenceRows> seq_rows;
  std::vector<std::vector<int32_t>> histories;
  if (cfg_.has_engram()) {
    const int64_t back = cfg_.engram_max_ngram_size - 1;
    histories.reserve(b.seqs.size());  // the rows point into them
    for (const auto& q : b.seqs) {
      const auto& past = cache.seqs[static_cast<size_t>(q.index)].tokens;
      const int64_t have = static_cast<int64_t>(past.size());
      if (have == 0) {
        seq_rows.push_back({q.row0, q.count, nullptr});
        continue;
      }
      std::vector<int32_t> h(static_cast<size_t>(back), static_cast<int32_t>(cfg_.engram_pad_id));
      for (int64_t j = 0; j < std::min(have, back); ++j) h[back - 1 - j] = past[have - 1 - j];
      histories.push_back(std::move(h));
      seq_rows.push_back({q.row0, q.count, histories.back().data()});
    }
  }
  const model::TokenLayout layout{1, N, b.pos.data(), nullptr, b.token.data(),
                                  cfg_.has_engram() ? &seq_rows : nullptr};
  const bool decode =
      std::all_of(b.seqs.begin(), b.seqs.end(), [](const Batch::Seq& q) { return q.count == 1 && q.past > 0; });
  const StagePhase phase(decode ? Phase::kDecode : Phase::kPrefill);
  for (size_t l = 0; l < w_.layers.size(); ++l)
    model::layer_forward(k > 1 ? streams.data() : h.data(), w_.layers[l], static_cast<int64_t>(l), stages_, layout,
                         &attention, nullptr, {});
  if (k > 1) model::mhc_reduce(h.data(), streams.data(), N, k, D);
  for (const auto& s : b.seqs) {
    SequenceCache& sc = cache.seqs[s.index];
    sc.length += s.count;
    if (cfg_.has_engram()) {
      sc.tokens.insert(sc.tokens.end(), b.token.begin() + s.row0, b.token.begin() + s.row0 + s.count);
      trim_engram_rows(sc);
    }
  }
  if (hidden) hidden->assign(h.begin(), h.end());

  // Final norm and head on the rows that need logits.
  std::vector<int64_t> rows;
  if (all_logits) {
    for (int64_t t = 0; t < N; ++t) rows.push_back(t);
  } else {
    for (const auto& s : b.seqs) rows.push_back(s.row0 + s.count - 1);
  }
  return head(h.data(), rows, w_.final_norm, b.pos.data());
}

std::vector<float> Engine::head(const float* h, const std::vector<int64_t>& rows, const ops::WeightView& norm,
                                const int32_t* positions) const {
  const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size, R = static_cast<int64_t>(rows.size());
  Buffer<float> hr(R * D), rstd(R);
  for (int64_t i = 0; i < R; ++i) std::memcpy(&hr[i * D], h + rows[i] * D, D * sizeof(float));
  ops::rmsnorm_forward(hr.data(), rstd.data(), hr.data(), model::vector_data(norm), R, D,
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
             logits[i], i % V, positions[rows[i / V]]);
  }
  return logits;
}

std::vector<float> Engine::mtp_step(KvCache& cache, const std::vector<std::vector<int32_t>>& next,
                                    const std::vector<const float*>& hidden, int64_t ahead,
                                    std::vector<float>* out_hidden) {
  DS_CHECK(has_mtp(), "this model's MTP layer is not loaded");
  DS_CHECK(next.size() == cache.seqs.size() && hidden.size() == next.size(),
           "mtp_step: {} token lists and {} hidden states for a cache of {} sequences", next.size(), hidden.size(),
           cache.seqs.size());
  const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  const Batch b = pack(next, V, [&](size_t s, int64_t n) {
    const SequenceCache& sc = cache.seqs[s];
    DS_CHECK(static_cast<int64_t>(sc.c_kv.size()) > L, "mtp_step: a cache without the MTP layer's");
    DS_CHECK(sc.draft_length + n <= sc.length + ahead,
             "mtp_step: sequence {} has {} positions, {} drafted from, {} more asked ({} ahead allowed)", s, sc.length,
             sc.draft_length, n, ahead);
    return sc.draft_length;
  });
  if (b.n == 0) return {};
  const int64_t N = b.n;
  const auto& p = w_.mtp[0];
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  // [enorm(embedding of the next token) | hnorm(main hidden state)] through eh_proj.
  Buffer<float> e(N * D), hm(N * D), rstd(N), x(N * 2 * D), h(N * D);
  embed_rows(e.data(), w_.embed, b.token.data(), N, D);
  for (const auto& sq : b.seqs) std::memcpy(hm.data() + sq.row0 * D, hidden[sq.index], sq.count * D * sizeof(float));
  ops::rmsnorm_forward(e.data(), rstd.data(), e.data(), model::vector_data(p.enorm), N, D, eps);
  ops::rmsnorm_forward(hm.data(), rstd.data(), hm.data(), model::vector_data(p.hnorm), N, D, eps);
  for (int64_t t = 0; t < N; ++t) {
    std::memcpy(&x[t * 2 * D], &e[t * D], D * sizeof(float));
    std::memcpy(&x[t * 2 * D + D], &hm[t * D], D * sizeof(float));
  }
  ops::linear_forward(h.data(), x.data(), p.eh_proj, N);
  CacheAttention attention(*this, cache, b);
  const model::TokenLayout layout{1, N, b.pos.data(), nullptr};
  model::layer_forward(h.data(), p.layer, L, stages_, layout, &attention, nullptr, {});
  std::vector<int64_t> rows;
  for (const auto& sq : b.seqs) {
    cache.seqs[sq.index].draft_length += sq.count;
    rows.push_back(sq.row0 + sq.count - 1);
  }
  if (out_hidden) {
    out_hidden->resize(rows.size() * static_cast<size_t>(D));
    for (size_t r = 0; r < rows.size(); ++r)
      std::memcpy(out_hidden->data() + r * D, h.data() + rows[r] * D, D * sizeof(float));
  }
  return head(h.data(), rows, p.head_norm, b.pos.data());
}

std::unique_ptr<LoadedModel> load_model(const std::string& dir, bool mtp) {
  auto m = std::make_unique<LoadedModel>();
  m->config = model::load_config(dir);
  DS_CHECK(!mtp || m->config.num_nextn_predict_layers > 0,
           "{}: speculative decoding with the MTP layer needs one, and this model has none (num_nextn_predict_layers "
           "0)",
           dir);
  DS_CHECK(!mtp || m->config.mhc_expansion_rate <= 1, "{}: an mHC model has no MTP layer", dir);
  m->files = io::SafetensorsSet::open_dir(dir);
  m->weights = model::ModelWeights::load(m->files, m->config, mtp ? 1 : 0);
  m->engine = std::make_unique<Engine>(m->config, m->weights.view);
  return m;
}

}  // namespace ds::infer
