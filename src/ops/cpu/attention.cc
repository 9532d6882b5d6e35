// Causal attention with segment ids, FlashAttention-2 style. See
// ops/attention.h for the math; the comments here are about the tiling.
//
// Forward: one work item per (batch, head, query tile). The item walks the key
// tiles left of (and on) the causal diagonal, computing S = scale Q K^T for
// the tile pair with one gemm, masking, and folding the tile into a running
// row max m, row sum l and unnormalized output O:
//   m' = max(m, rowmax S),  P = exp(S - m'),  l = l exp(m - m') + rowsum P,
//   O = O exp(m - m') + P V                                  (second gemm)
// and finally out = O / l, lse = m + log l. Scratch is one tile pair per
// thread; no [T, T] matrix exists.
//
// Backward recomputes P = exp(S - lse) tile by tile, with D = dout . out per
// row computed up front:
//   dP = dO V^T,  dS = P (dP - D),  dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K.
// dK and dV are sums over query tiles, dQ a sum over key tiles. Rather than
// adding into shared rows from several threads (atomics, or partials whose
// summation order would depend on the schedule) the backward runs as two
// passes whose items each own their output rows: pass 1, one item per
// (batch, head, key tile), sums dK and dV over the query tiles in order;
// pass 2, one item per (batch, head, query tile), sums dQ over the key tiles in
// order. S, P and dP are computed twice, which costs 1.4x the products of a
// single pass at MLA's head sizes, but every output element is the same
// sequence of single-threaded operations whatever the thread count, so the
// gradients are bitwise reproducible.
//
// Tiles whose keys all lie right of the diagonal are never visited. With
// segment ids, a tile pair whose query and key segment-id ranges [min, max]
// are disjoint is skipped (in packed sequences, where ids do not decrease,
// this skips everything outside the documents the query tile touches); a
// pair whose ids are all one value needs no segment mask. Neither shortcut
// assumes the ids are sorted: any id layout gives the exact result.
#include "ops/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <vector>

#include "core/error.h"
#include "ops/matmul.h"

// The row kernels below are Highway code, compiled once per SIMD target and
// dispatched at run time (core/simd.h); the tiling after them is plain C++.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/attention.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

#include "ops/cpu/fast_exp-inl.h"
#include "ops/cpu/lanes-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
// Internal linkage, so that same-named kernels of other files do not collide.
namespace {
namespace hn = hwy::HWY_NAMESPACE;

// Largest of x[0, n), skipping NaN, as std::max would.
float RowMax(const float* x, int64_t n) {
  return RowMaxSkippingNaN(hn::ScalableTag<float>(), x, static_cast<size_t>(n));
}

// x[j] = exp(x[j] - shift) for j < n, returning the sum of the new x in a
// fixed order (per lane, then the lanes in order).
float ExpRow(float* x, int64_t n, float shift) {
  return static_cast<float>(ExpShiftedSum<true>(hn::ScalableTag<float>(), x, x, static_cast<size_t>(n), shift));
}

// ds[j] = p[j] (ds[j] - d) for j < n: dP becomes dS in place.
void SoftmaxGradRow(float* ds, const float* p, int64_t n, float d) {
  const hn::ScalableTag<float> df;
  using V = hn::Vec<decltype(df)>;
  Map2(df, ds, ds, p, static_cast<size_t>(n),
       [df, d](V g, V pr) HWY_ATTR { return hn::Mul(pr, hn::Sub(g, hn::Set(df, d))); });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

namespace detail {
float attention_exp_row(float* x, int64_t n, float shift);
}  // namespace detail

HWY_EXPORT(RowMax);
HWY_EXPORT(ExpRow);
HWY_EXPORT(SoftmaxGradRow);

namespace {

// Tile edges: query rows per work item and keys per step. The tile products
// are small gemm calls whose fixed costs (packing, dispatch) need about this
// much work to amortize: forward at MLA's head sizes (Dqk 192, Dv 128),
// T = 1024, 16 heads, 2 threads ran at ~75 GFLOP/s with 64 x 64 tiles,
// ~115 with 64 x 128 or 128 x 64, ~130 with 128 x 128, and no better with
// 256-row or 256-key tiles, which also waste more work on the half-masked
// diagonal tiles and leave fewer items to share out for short sequences.
constexpr int64_t kTileQ = 128;
constexpr int64_t kTileK = 128;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float row_max(const float* x, int64_t n) { return DS_DISPATCH(RowMax)(x, n); }
float exp_row(float* x, int64_t n, float shift) { return DS_DISPATCH(ExpRow)(x, n, shift); }
void softmax_grad_row(float* ds, const float* p, int64_t n, float d) { DS_DISPATCH(SoftmaxGradRow)(ds, p, n, d); }

// Sizes, strides and tile counts shared by the passes. Rows of one head are
// H * D floats apart in q, k, v, out and their gradients.
struct Geometry {
  int64_t B, T, H, Dqk, Dv;
  float scale;
  int64_t nq_tiles, nk_tiles;
  const uint8_t* selected;  // [B, T, T] or null

  Geometry(const AttentionDims& d, const uint8_t* sel)
      : B(d.batch),
        T(d.seq),
        H(d.heads),
        Dqk(d.qk_dim),
        Dv(d.v_dim),
        scale(d.scale),
        nq_tiles((d.seq + kTileQ - 1) / kTileQ),
        nk_tiles((d.seq + kTileK - 1) / kTileK),
        selected(sel) {}
  int64_t ld_qk() const { return H * Dqk; }
  int64_t ld_v() const { return H * Dv; }
  // Offset of row (b, t) of head h in a [B, T, H, D] tensor.
  int64_t row(int64_t b, int64_t t, int64_t h, int64_t D) const { return ((b * T + t) * H + h) * D; }
};

// Segment-id range [lo, hi] of every tile of `tile` positions, per batch row:
// index b * ntiles + tile. Empty without segment ids.
struct TileRanges {
  std::vector<int32_t> lo, hi;
};

TileRanges tile_ranges(const int32_t* seg, int64_t B, int64_t T, int64_t tile) {
  TileRanges r;
  if (!seg) return r;
  const int64_t n = (T + tile - 1) / tile;
  r.lo.resize(B * n);
  r.hi.resize(B * n);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t) {
      const int32_t* s = seg + b * T + t * tile;
      const auto [lo, hi] = std::minmax_element(s, s + std::min(tile, T - t * tile));
      r.lo[b * n + t] = *lo;
      r.hi[b * n + t] = *hi;
    }
  return r;
}

// One tile pair: queries [i0, i0 + nq), keys [j0, j0 + nk) of batch row b.
struct Pair {
  int64_t i0, nq, j0, nk;
  bool skip;     // no query may attend to any key of the tile
  bool causal;   // some keys lie right of some queries' diagonal
  bool segment;  // the ids are not all one value: compare them per element
};

Pair tile_pair(const Geometry& g, const int32_t* seg, const TileRanges& qr, const TileRanges& kr, int64_t b, int64_t qt,
               int64_t kt) {
  Pair p;
  p.i0 = qt * kTileQ;
  p.nq = std::min(kTileQ, g.T - p.i0);
  p.j0 = kt * kTileK;
  p.nk = std::min(kTileK, g.T - p.j0);
  p.skip = p.j0 > p.i0 + p.nq - 1;
  p.causal = p.j0 + p.nk - 1 > p.i0;
  p.segment = false;
  if (seg && !p.skip) {
    const int32_t qlo = qr.lo[b * g.nq_tiles + qt], qhi = qr.hi[b * g.nq_tiles + qt];
    const int32_t klo = kr.lo[b * g.nk_tiles + kt], khi = kr.hi[b * g.nk_tiles + kt];
    p.skip = khi < qlo || klo > qhi;
    p.segment = !(qlo == qhi && klo == khi && qlo == klo);
  }
  return p;
}

// Sets the scores s [nq, nk] of disallowed (query, key) pairs to -inf.
void apply_mask(float* s, const Pair& p, const int32_t* seg_b) {
  for (int64_t r = 0; r < p.nq; ++r) {
    const int64_t i = p.i0 + r;
    float* sr = s + r * p.nk;
    // Keys [j0, j0 + allowed) are at or left of the diagonal.
    const int64_t allowed = p.causal ? std::clamp<int64_t>(i - p.j0 + 1, 0, p.nk) : p.nk;
    if (p.segment) {
      const int32_t id = seg_b[i];
      for (int64_t c = 0; c < allowed; ++c)
        if (seg_b[p.j0 + c] != id) sr[c] = kNegInf;
    }
    for (int64_t c = allowed; c < p.nk; ++c) sr[c] = kNegInf;
  }
}

// s [nq, nk] = scale Q K^T for the pair, masked.
void scores(float* s, const Pair& p, const float* q, const float* k, const int32_t* seg, const Geometry& g, int64_t b,
            int64_t h) {
  gemm(false, true, p.nq, p.nk, g.Dqk, g.scale, q + g.row(b, p.i0, h, g.Dqk), g.ld_qk(), k + g.row(b, p.j0, h, g.Dqk),
       g.ld_qk(), 0.0f, s, p.nk);
  if (p.causal || p.segment) apply_mask(s, p, seg ? seg + b * g.T : nullptr);
  if (g.selected)
    for (int64_t r = 0; r < p.nq; ++r) {
      const uint8_t* sel = g.selected + (b * g.T + p.i0 + r) * g.T + p.j0;
      float* sr = s + r * p.nk;
      for (int64_t c = 0; c < p.nk; ++c)
        if (!sel[c]) sr[c] = kNegInf;
    }
}

// Runs body(item, scratch) for items [0, n) over the threads, each item on one
// thread with its gemm calls single-threaded, giving each thread its own
// scratch of `per_thread` floats. Items are taken dynamically (each item's
// result does not depend on which thread runs it). An exception must not
// leave the parallel region, so the first one is carried out of it.
template <typename Body>
void run_items(int64_t n, int64_t per_thread, Body body) {
  const int threads = static_cast<int>(std::clamp<int64_t>(n, 1, omp_get_max_threads()));
  std::vector<float> scratch(static_cast<size_t>(threads * per_thread));
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t it = 0; it < n; ++it) {
    try {
      body(it, scratch.data() + omp_get_thread_num() * per_thread);
    } catch (...) {
#pragma omp critical(attention_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

void check_dims(const AttentionDims& d, const char* what) {
  DS_CHECK(d.batch > 0 && d.seq > 0 && d.heads > 0 && d.qk_dim > 0 && d.v_dim > 0,
           "{}: sizes must be positive, got batch={} seq={} heads={} qk_dim={} v_dim={}", what, d.batch, d.seq, d.heads,
           d.qk_dim, d.v_dim);
  DS_CHECK(std::isfinite(d.scale), "{}: softmax scale must be finite, got {}", what, d.scale);
}

// Every query keeps at least one key it may attend to.
void check_selection(const Geometry& g, const int32_t* seg) {
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t i = 0; i < g.T; ++i) {
      const uint8_t* row = g.selected + (b * g.T + i) * g.T;
      bool any = false;
      for (int64_t j = 0; j <= i && !any; ++j) any = row[j] && (!seg || seg[b * g.T + j] == seg[b * g.T + i]);
      DS_CHECK(any, "attention_forward: query {} of row {} has no selected key it may attend to", i, b);
    }
}

// Folds masked scores s [nq, nk] of one key tile into the running row max m,
// row sum l and unnormalized output o [nq, Dv] (rescaled by exp(m - m')); s
// becomes the tile's P, to be multiplied by the tile's values into o.
void fold_scores(float* s, int64_t nq, int64_t nk, float* m, float* l, float* o, int64_t Dv) {
  for (int64_t r = 0; r < nq; ++r) {
    float* sr = s + r * nk;
    const float mnew = std::max(m[r], row_max(sr, nk));
    if (mnew == kNegInf) {
      // Nothing allowed for this query yet: its p row is 0 (exp(-inf -
      // -inf) would be NaN), and O, l stay 0.
      std::fill(sr, sr + nk, 0.0f);
      continue;
    }
    const float alpha = std::exp(m[r] - mnew);  // 0 on the first allowed tile
    l[r] = l[r] * alpha + exp_row(sr, nk, mnew);
    m[r] = mnew;
    if (alpha != 1.0f)
      for (int64_t c = 0; c < Dv; ++c) o[r * Dv + c] *= alpha;
  }
}

// Work item it of n_tiles per (b, h), ordered so that the tiles with the most
// work (the last query tiles, the first key tiles) are handed out first.
struct ItemIndex {
  int64_t b, h, tile;
};
ItemIndex item_index(int64_t it, const Geometry& g, int64_t n_tiles, bool last_first) {
  const int64_t bh = it % (g.B * g.H), t = it / (g.B * g.H);
  return {bh / g.H, bh % g.H, last_first ? n_tiles - 1 - t : t};
}

// Backward of the pair (S and dS for one query tile against one key tile):
// s becomes P = exp(S - lse), dp becomes dS = P (dO V^T - D).
void pair_grads(float* s, float* dp, const Pair& p, const float* dout, const float* lse, const float* dd,
                const float* q, const float* k, const float* v, const int32_t* seg, const Geometry& g, int64_t b,
                int64_t h) {
  scores(s, p, q, k, seg, g, b, h);
  const float* lse_bh = lse + (b * g.H + h) * g.T + p.i0;
  const float* d_bh = dd + (b * g.H + h) * g.T + p.i0;
  // Masked scores are -inf and give p = 0; lse is finite for every query.
  for (int64_t r = 0; r < p.nq; ++r) exp_row(s + r * p.nk, p.nk, lse_bh[r]);
  gemm(false, true, p.nq, p.nk, g.Dv, 1.0f, dout + g.row(b, p.i0, h, g.Dv), g.ld_v(), v + g.row(b, p.j0, h, g.Dv),
       g.ld_v(), 0.0f, dp, p.nk);
  for (int64_t r = 0; r < p.nq; ++r) softmax_grad_row(dp + r * p.nk, s + r * p.nk, p.nk, d_bh[r]);
}

}  // namespace

namespace detail {
// Exposed for the accuracy test of the vectorized exp against std::exp.
float attention_exp_row(float* x, int64_t n, float shift) { return exp_row(x, n, shift); }
}  // namespace detail

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* segment_ids, const AttentionDims& d, const uint8_t* selected, const float* sink) {
  check_dims(d, "attention_forward");
  DS_CHECK(out && lse && q && k && v, "attention_forward: null tensor pointer");
  const Geometry g(d, selected);
  if (selected) check_selection(g, segment_ids);
  const TileRanges qr = tile_ranges(segment_ids, g.B, g.T, kTileQ);
  const TileRanges kr = tile_ranges(segment_ids, g.B, g.T, kTileK);
  // Scratch: s/p [TileQ, TileK], O [TileQ, Dv], m and l [TileQ].
  const int64_t per_thread = kTileQ * kTileK + kTileQ * g.Dv + 2 * kTileQ;
  run_items(g.B * g.H * g.nq_tiles, per_thread, [&](int64_t it, float* w) {
    const auto [b, h, qt] = item_index(it, g, g.nq_tiles, true);
    float* s = w;
    float* o = s + kTileQ * kTileK;
    float* m = o + kTileQ * g.Dv;
    float* l = m + kTileQ;
    const int64_t i0 = qt * kTileQ, nq = std::min(kTileQ, g.T - i0);
    std::fill(o, o + nq * g.Dv, 0.0f);
    std::fill(m, m + nq, kNegInf);
    std::fill(l, l + nq, 0.0f);
    for (int64_t kt = 0; kt * kTileK < i0 + nq; ++kt) {
      const Pair p = tile_pair(g, segment_ids, qr, kr, b, qt, kt);
      if (p.skip) continue;
      scores(s, p, q, k, segment_ids, g, b, h);
      fold_scores(s, nq, p.nk, m, l, o, g.Dv);
      gemm(false, false, nq, g.Dv, p.nk, 1.0f, s, p.nk, v + g.row(b, p.j0, h, g.Dv), g.ld_v(), 1.0f, o, g.Dv);
    }
    // Every query attends to a key (itself, or a selected one), so l is
    // about 1 or more here (NaN inputs give NaN, never a division by 0).
    // With a sink its exp joins the denominator: lse' = logaddexp(lse,
    // sink), and out shrinks by exp(lse - lse').
    for (int64_t r = 0; r < nq; ++r) {
      const float lse0 = m[r] + std::log(l[r]);
      float lse1 = lse0, inv = 1.0f / l[r];
      if (sink) {
        const float hi = std::max(lse0, sink[h]), lo = std::min(lse0, sink[h]);
        lse1 = hi + std::log1p(std::exp(lo - hi));
        inv *= std::exp(lse0 - lse1);
      }
      float* dst = out + g.row(b, i0 + r, h, g.Dv);
      for (int64_t c = 0; c < g.Dv; ++c) dst[c] = o[r * g.Dv + c] * inv;
      lse[(b * g.H + h) * g.T + i0 + r] = lse1;
    }
  });
}

void attention_forward_past(float* out, const float* q, const float* k, const float* v, int64_t past,
                            const AttentionDims& d) {
  check_dims(d, "attention_forward_past");
  DS_CHECK(out && q && k && v, "attention_forward_past: null tensor pointer");
  DS_CHECK(d.batch == 1 && past >= 0, "attention_forward_past: batch {} past {}: one sequence, past >= 0", d.batch,
           past);
  const int64_t n = d.seq, H = d.heads, Dqk = d.qk_dim, Dv = d.v_dim, nq_tiles = (n + kTileQ - 1) / kTileQ;
  const int64_t ldq = H * Dqk, ldv = H * Dv;
  const int64_t per_thread = kTileQ * kTileK + kTileQ * Dv + 2 * kTileQ;
  // Items (head, query tile), the last query tiles (the most keys) first.
  run_items(H * nq_tiles, per_thread, [&](int64_t it, float* w) {
    const int64_t h = it % H, qt = nq_tiles - 1 - it / H;
    float* s = w;
    float* o = s + kTileQ * kTileK;
    float* m = o + kTileQ * Dv;
    float* l = m + kTileQ;
    const int64_t i0 = qt * kTileQ, nq = std::min(kTileQ, n - i0);
    const int64_t last = past + i0 + nq - 1;  // the last key any query of the tile sees
    std::fill(o, o + nq * Dv, 0.0f);
    std::fill(m, m + nq, kNegInf);
    std::fill(l, l + nq, 0.0f);
    for (int64_t j0 = 0; j0 <= last; j0 += kTileK) {
      const int64_t nk = std::min(kTileK, last + 1 - j0);
      gemm(false, true, nq, nk, Dqk, d.scale, q + i0 * ldq + h * Dqk, ldq, k + j0 * ldq + h * Dqk, ldq, 0.0f, s, nk);
      for (int64_t r = 0; r < nq; ++r) {
        // Keys [j0, j0 + allowed) are at or left of query r's position.
        const int64_t allowed = std::clamp<int64_t>(past + i0 + r - j0 + 1, 0, nk);
        std::fill(s + r * nk + allowed, s + (r + 1) * nk, kNegInf);
      }
      fold_scores(s, nq, nk, m, l, o, Dv);
      gemm(false, false, nq, Dv, nk, 1.0f, s, nk, v + j0 * ldv + h * Dv, ldv, 1.0f, o, Dv);
    }
    for (int64_t r = 0; r < nq; ++r) {
      const float inv = 1.0f / l[r];  // every query sees at least its own key
      float* dst = out + (i0 + r) * ldv + h * Dv;
      for (int64_t c = 0; c < Dv; ++c) dst[c] = o[r * Dv + c] * inv;
    }
  });
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const int32_t* segment_ids,
                        const AttentionDims& d, const uint8_t* selected, const float* sink, float* dsink) {
  check_dims(d, "attention_backward");
  DS_CHECK(dq && dk && dv && dout && out && lse && q && k && v, "attention_backward: null tensor pointer");
  const Geometry g(d, selected);
  const TileRanges qr = tile_ranges(segment_ids, g.B, g.T, kTileQ);
  const TileRanges kr = tile_ranges(segment_ids, g.B, g.T, kTileK);

  // D [B, H, T] = dout . out per row, summed in double: it is subtracted from
  // dP, whose terms are of the same size, so its rounding shows in dS.
  std::vector<float> dd(g.B * g.H * g.T);
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < g.B * g.T; ++bt)
    for (int64_t h = 0; h < g.H; ++h) {
      const int64_t b = bt / g.T, t = bt % g.T;
      const float* a = dout + g.row(b, t, h, g.Dv);
      const float* o = out + g.row(b, t, h, g.Dv);
      double acc = 0;
      for (int64_t c = 0; c < g.Dv; ++c) acc += static_cast<double>(a[c]) * o[c];
      dd[(b * g.H + h) * g.T + t] = static_cast<float>(acc);
    }
  // The sink's logit: dsink[h] = -sum over rows and queries of p_sink D, with
  // p_sink = exp(sink - lse); summed in a fixed order per head.
  if (sink && dsink)
    for (int64_t h = 0; h < g.H; ++h) {
      double acc = 0;
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t t = 0; t < g.T; ++t) {
          const int64_t i = (b * g.H + h) * g.T + t;
          acc -= std::exp(static_cast<double>(sink[h]) - lse[i]) * dd[i];
        }
      dsink[h] += static_cast<float>(acc);
    }

  const int64_t pair_floats = 2 * kTileQ * kTileK;
  // Pass 1: dK and dV of one key tile, summed over the query tiles in order.
  run_items(g.B * g.H * g.nk_tiles, pair_floats + kTileK * (g.Dqk + g.Dv), [&](int64_t it, float* w) {
    const auto [b, h, kt] = item_index(it, g, g.nk_tiles, false);
    float* s = w;
    float* dp = s + kTileQ * kTileK;
    float* dk_acc = dp + kTileQ * kTileK;
    float* dv_acc = dk_acc + kTileK * g.Dqk;
    const int64_t j0 = kt * kTileK, nk = std::min(kTileK, g.T - j0);
    std::fill(dk_acc, dk_acc + nk * g.Dqk, 0.0f);
    std::fill(dv_acc, dv_acc + nk * g.Dv, 0.0f);
    for (int64_t qt = j0 / kTileQ; qt < g.nq_tiles; ++qt) {
      const Pair p = tile_pair(g, segment_ids, qr, kr, b, qt, kt);
      if (p.skip) continue;
      pair_grads(s, dp, p, dout, lse, dd.data(), q, k, v, segment_ids, g, b, h);
      gemm(true, false, nk, g.Dv, p.nq, 1.0f, s, nk, dout + g.row(b, p.i0, h, g.Dv), g.ld_v(), 1.0f, dv_acc, g.Dv);
      gemm(true, false, nk, g.Dqk, p.nq, g.scale, dp, nk, q + g.row(b, p.i0, h, g.Dqk), g.ld_qk(), 1.0f, dk_acc, g.Dqk);
    }
    for (int64_t r = 0; r < nk; ++r) {
      std::memcpy(dk + g.row(b, j0 + r, h, g.Dqk), dk_acc + r * g.Dqk, g.Dqk * sizeof(float));
      std::memcpy(dv + g.row(b, j0 + r, h, g.Dv), dv_acc + r * g.Dv, g.Dv * sizeof(float));
    }
  });

  // Pass 2: dQ of one query tile, summed over the key tiles in order.
  run_items(g.B * g.H * g.nq_tiles, pair_floats + kTileQ * g.Dqk, [&](int64_t it, float* w) {
    const auto [b, h, qt] = item_index(it, g, g.nq_tiles, true);
    float* s = w;
    float* dp = s + kTileQ * kTileK;
    float* dq_acc = dp + kTileQ * kTileK;
    const int64_t i0 = qt * kTileQ, nq = std::min(kTileQ, g.T - i0);
    std::fill(dq_acc, dq_acc + nq * g.Dqk, 0.0f);
    for (int64_t kt = 0; kt * kTileK < i0 + nq; ++kt) {
      const Pair p = tile_pair(g, segment_ids, qr, kr, b, qt, kt);
      if (p.skip) continue;
      pair_grads(s, dp, p, dout, lse, dd.data(), q, k, v, segment_ids, g, b, h);
      gemm(false, false, nq, g.Dqk, p.nk, g.scale, dp, p.nk, k + g.row(b, p.j0, h, g.Dqk), g.ld_qk(), 1.0f, dq_acc,
           g.Dqk);
    }
    for (int64_t r = 0; r < nq; ++r)
      std::memcpy(dq + g.row(b, i0 + r, h, g.Dqk), dq_acc + r * g.Dqk, g.Dqk * sizeof(float));
  });
}

}  // namespace ds::ops
#endif  // HWY_ONCE
