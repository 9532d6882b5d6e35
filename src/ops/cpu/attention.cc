// Causal attention with segment ids, FlashAttention-2 style. See
// ops/attention.h for the math; the comments here are about the tiling.
//
// Forward: one work item per (batch, head, query tile). The item walks the key
// tiles left of (and on) the causal diagonal, computing S = scale Q K^T for
// the tile pair, masking, and folding the tile into a running row max m, row
// sum l and unnormalized output O:
//   m' = max(m, rowmax S),  P = exp(S - m'),  l = l exp(m - m') + rowsum P,
//   O = O exp(m - m') + P V
// and finally out = O / l, lse = m + log l. Scratch is one tile pair per
// thread; no [T, T] matrix exists. The two products are Highway register
// tiles (below), not BLAS calls: the query rows go in blocks of 4 or 8, each
// block scoring only the keys its last row may see (rounded up to 16), so a
// diagonal tile costs little more than its lower triangle, which matters for
// prompts of a few hundred tokens, where most tiles are diagonal. With MLA's
// small heads a BLAS call per tile also spent as much on its fixed costs as
// on the arithmetic: the small preset's prefill (T = 128, 6 heads, Dqk 48,
// Dv 32) ran at 68-70 GFLOP/s on 2 threads through oneDNN's sgemm and at
// 102-111 this way (bench/attention_bench, docs/performance.md).
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
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <vector>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/matmul.h"

// Target-independent definitions, seen once (this file is included again
// for every target below).
#ifndef DS_OPS_CPU_ATTENTION_ONCE
#define DS_OPS_CPU_ATTENTION_ONCE
#include "ops/cpu/attention_tiles.h"

namespace ds::ops {
namespace {

using tiles::round_up16;

// Keys of a forward tile pair that query rows [r0, r0 + rows) may see: those
// of the block's last row, diag + r0 + rows, clamped to [0, nk] (query row r
// sees the tile's keys [0, diag + r + 1)).
constexpr int64_t block_keys(int64_t r0, int64_t rows, int64_t nk, int64_t diag) {
  return std::clamp<int64_t>(diag + r0 + rows, 0, nk);
}

}  // namespace
}  // namespace ds::ops
#endif  // DS_OPS_CPU_ATTENTION_ONCE

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

// The forward's two tile products, as register tiles of up to kBlockRows
// query rows by two vectors. At most 16 lanes, so that a count of columns
// that is a multiple of 16 is a whole number of vectors on every target.
using DT = hn::CappedTag<float, 16>;
using VT = hn::Vec<DT>;

// Calls f(std::integral_constant<int, n>{}) for a run-time n in [1, Max].
template <int Max, typename F>
HWY_INLINE void WithRows(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return WithRows<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// Accumulators c<r>a (columns [0, N)) and c<r>b ([N, 2N), only with Two) are
// named variables, not an array: SVE's vectors cannot be array elements.
#define DS_ATT_ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define DS_ATT_DECLARE(r) VT c##r##a = hn::Zero(d), c##r##b = hn::Zero(d);

// c[r][:] = scale * sum_k a[r][k] b[k][:] (or, kAccumulate, c[r][:] +=
// sum_k a[r][k] b[k][:]) for r < R and the one or two vectors of columns at
// b and c: the scores (a = q, b = the keys transposed) and P V (a = P, b =
// v). The sum runs over k in order, one fused multiply-add per k.
template <int R, bool Two, bool kAccumulate>
HWY_INLINE void RowBlock(float* HWY_RESTRICT c, int64_t ldc, const float* HWY_RESTRICT a, int64_t lda,
                         const float* HWY_RESTRICT b, int64_t ldb, int64_t K, float scale) {
  static_assert(R <= 8, "eight named accumulator rows");
  const DT d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  DS_ATT_ROWS(DS_ATT_DECLARE)
#define DS_LOAD(r)                                              \
  if constexpr (kAccumulate && R > r) {                         \
    c##r##a = hn::LoadU(d, c + r * ldc);                        \
    if constexpr (Two) c##r##b = hn::LoadU(d, c + r * ldc + N); \
  }
  DS_ATT_ROWS(DS_LOAD)
#undef DS_LOAD
  for (int64_t k = 0; k < K; ++k) {
    const VT x0 = hn::LoadU(d, b + k * ldb);
    const VT x1 = Two ? hn::LoadU(d, b + k * ldb + N) : x0;
#define DS_STEP(r)                                           \
  if constexpr (R > r) {                                     \
    const VT w = hn::Set(d, a[r * lda + k]);                 \
    c##r##a = hn::MulAdd(x0, w, c##r##a);                    \
    if constexpr (Two) c##r##b = hn::MulAdd(x1, w, c##r##b); \
  }
    DS_ATT_ROWS(DS_STEP)
#undef DS_STEP
  }
  const VT sc = hn::Set(d, scale);
#define DS_STORE(r)                                                                                  \
  if constexpr (R > r) {                                                                             \
    hn::StoreU(kAccumulate ? c##r##a : hn::Mul(c##r##a, sc), d, c + r * ldc);                        \
    if constexpr (Two) hn::StoreU(kAccumulate ? c##r##b : hn::Mul(c##r##b, sc), d, c + r * ldc + N); \
  }
  DS_ATT_ROWS(DS_STORE)
#undef DS_STORE
}
#undef DS_ATT_DECLARE
#undef DS_ATT_ROWS

// Targets with 16 vector registers get 4 rows (8 accumulators; with 6 rows
// GCC spilled a key vector to the stack on AVX2, and the tile ran 10-30%
// slower), the others 8 (16 accumulators).
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3 || HWY_TARGET == HWY_SCALAR || \
    HWY_TARGET == HWY_EMU128
constexpr int kScoreRows = 4;
#else
constexpr int kScoreRows = 8;
#endif

// Scores of one tile pair: s[r][c] = scale * q[r] . k[c] for query rows r <
// nq, in blocks of kScoreRows rows, each for the keys c its last row may see
// (block_keys) rounded up to 16; kt = the keys transposed ([K][ldk], zero past
// the keys). Column blocks outside, row blocks inside, so that each column
// block of kt (K x 2 vectors) stays in L1 while every row block reads it.
void ScoreTile(float* s, int64_t lds, const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t nq, int64_t nk,
               int64_t diag, int64_t K, float scale) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DT()));
  const int64_t cols = round_up16(block_keys(0, nq, nk, diag));
  for (int64_t c = 0; c < cols; c += 2 * N) {
    for (int64_t r0 = 0; r0 < nq; r0 += kScoreRows) {
      const int64_t rows = std::min<int64_t>(kScoreRows, nq - r0);
      const int64_t n = round_up16(block_keys(r0, rows, nk, diag));
      if (c >= n) continue;
      float* sb = s + r0 * lds + c;
      const float* qb = q + r0 * ldq;
      if (c + 2 * N <= n) {
        WithRows<kScoreRows>(
            rows, [&](auto r) HWY_ATTR { RowBlock<r(), true, false>(sb, lds, qb, ldq, kt + c, ldk, K, scale); });
      } else {
        WithRows<kScoreRows>(
            rows, [&](auto r) HWY_ATTR { RowBlock<r(), false, false>(sb, lds, qb, ldq, kt + c, ldk, K, scale); });
      }
    }
  }
}

// o[r][c] += sum_j p[r][j] v[j][c] for query rows r < nq, c < cols (a
// multiple of 16), j over the keys of the row's block (block_keys); column
// blocks outside, so that each column block of v stays in L1.
void ValueTile(float* o, int64_t ldo, const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t nq, int64_t nk,
               int64_t diag, int64_t cols) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DT()));
  for (int64_t c = 0; c < cols; c += 2 * N) {
    for (int64_t r0 = 0; r0 < nq; r0 += kScoreRows) {
      const int64_t rows = std::min<int64_t>(kScoreRows, nq - r0);
      const int64_t n = block_keys(r0, rows, nk, diag);
      if (n == 0) continue;
      float* ob = o + r0 * ldo + c;
      const float* pb = p + r0 * ldp;
      if (c + 2 * N <= cols) {
        WithRows<kScoreRows>(
            rows, [&](auto r) HWY_ATTR { RowBlock<r(), true, true>(ob, ldo, pb, ldp, v + c, ldv, n, 1.0f); });
      } else {
        WithRows<kScoreRows>(
            rows, [&](auto r) HWY_ATTR { RowBlock<r(), false, true>(ob, ldo, pb, ldp, v + c, ldv, n, 1.0f); });
      }
    }
  }
}

// Folds the masked scores of rows [0, rows) of s (n columns each, a multiple
// of 16) into each row's running max m, sum l and unnormalized output o (ldo
// columns, a multiple of 16; rescaled by exp(m - m')); s becomes the rows' P,
// to be multiplied by the tile's values into o. A row's max and sum are
// reduced across the lanes by Highway's shuffles: at MLA's small head sizes
// the products per score are few, and lane-by-lane reductions cost as much as
// they do.
void FoldRows(float* s, int64_t lds, int64_t rows, int64_t n, float* m, float* l, float* o, int64_t ldo) {
  const DT d;
  const size_t N = hn::Lanes(d);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * lds;
    // The max skips NaN, as std::max(m, x) does.
    VT m0 = hn::Set(d, ninf), m1 = m0;
    size_t j = 0;
    for (; j + 2 * N <= static_cast<size_t>(n); j += 2 * N) {
      const VT v0 = hn::LoadU(d, sr + j), v1 = hn::LoadU(d, sr + j + N);
      m0 = hn::IfThenElse(hn::Gt(v0, m0), v0, m0);
      m1 = hn::IfThenElse(hn::Gt(v1, m1), v1, m1);
    }
    for (; j < static_cast<size_t>(n); j += N) {
      const VT v = hn::LoadU(d, sr + j);
      m0 = hn::IfThenElse(hn::Gt(v, m0), v, m0);
    }
    const float mnew = std::max(m[r], hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1))));
    if (mnew == ninf) {
      // Nothing allowed for this query yet: its p row is 0 (exp(-inf -
      // -inf) would be NaN), and O, l stay 0.
      std::fill(sr, sr + n, 0.0f);
      continue;
    }
    const VT sh = hn::Set(d, mnew);
    VT s0 = hn::Zero(d), s1 = s0;
    j = 0;
    for (; j + 2 * N <= static_cast<size_t>(n); j += 2 * N) {
      const VT e0 = FastExp(d, hn::Sub(hn::LoadU(d, sr + j), sh));
      const VT e1 = FastExp(d, hn::Sub(hn::LoadU(d, sr + j + N), sh));
      hn::StoreU(e0, d, sr + j);
      hn::StoreU(e1, d, sr + j + N);
      s0 = hn::Add(s0, e0);
      s1 = hn::Add(s1, e1);
    }
    for (; j < static_cast<size_t>(n); j += N) {
      const VT e = FastExp(d, hn::Sub(hn::LoadU(d, sr + j), sh));
      hn::StoreU(e, d, sr + j);
      s0 = hn::Add(s0, e);
    }
    const float sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(s0, s1)));
    if (m[r] == ninf) {  // the row's first allowed keys: O and l are 0
      l[r] = sum;
    } else {
      const float alpha = std::exp(m[r] - mnew);
      l[r] = l[r] * alpha + sum;
      if (alpha != 1.0f) {
        float* orow = o + r * ldo;
        for (size_t c = 0; c < static_cast<size_t>(ldo); c += N)
          hn::StoreU(hn::Mul(hn::LoadU(d, orow + c), hn::Set(d, alpha)), d, orow + c);
      }
    }
    m[r] = mnew;
  }
}

// kt [K, ld] (columns [0, width)) = the n <= 128 rows of k (K floats each,
// ldk apart) transposed, columns n .. width - 1 zero.
void TransposeKeys(float* kt, int64_t ld, int64_t width, const float* k, int64_t ldk, int64_t n, int64_t K) {
  const float* rows[128];
  HWY_DASSERT(n <= 128);
  for (int64_t j = 0; j < n; ++j) rows[j] = k + j * ldk;
  GatherTransposed(kt, rows, n, width, ld, K);
}

// The same from row pointers (n <= 128).
void GatherKeys(float* kt, int64_t ld, int64_t width, const float* const* rows, int64_t n, int64_t K) {
  HWY_DASSERT(n <= 128);
  GatherTransposed(kt, rows, n, width, ld, K);
}

int64_t BlockRows() { return kScoreRows; }

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

namespace detail {
float attention_exp_row(float* x, int64_t n, float shift);
int64_t set_attention_pack_budget(int64_t bytes);
}  // namespace detail

HWY_EXPORT(ExpRow);
HWY_EXPORT(SoftmaxGradRow);
HWY_EXPORT(ScoreTile);
HWY_EXPORT(ValueTile);
HWY_EXPORT(FoldRows);
HWY_EXPORT(TransposeKeys);
HWY_EXPORT(GatherKeys);
HWY_EXPORT(BlockRows);

namespace tiles {
void score_tile(float* s, int64_t lds, const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t nq,
                int64_t nk, int64_t diag, int64_t K, float scale) {
  DS_DISPATCH(ScoreTile)(s, lds, q, ldq, kt, ldk, nq, nk, diag, K, scale);
}
void fold_rows(float* s, int64_t lds, int64_t rows, int64_t n, float* m, float* l, float* o, int64_t ldo) {
  DS_DISPATCH(FoldRows)(s, lds, rows, n, m, l, o, ldo);
}
void value_tile(float* o, int64_t ldo, const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t nq, int64_t nk,
                int64_t diag, int64_t cols) {
  DS_DISPATCH(ValueTile)(o, ldo, p, ldp, v, ldv, nq, nk, diag, cols);
}
void gather_keys(float* kt, int64_t ld, int64_t width, const float* const* rows, int64_t n, int64_t K) {
  DS_DISPATCH(GatherKeys)(kt, ld, width, rows, n, K);
}
int64_t block_rows() { return DS_DISPATCH(BlockRows)(); }
}  // namespace tiles

namespace {

// Tile edges: query rows per work item and keys per step. The backward's tile
// products are small gemm calls whose fixed costs (packing, dispatch) need
// about this much work to amortize: at MLA's head sizes (Dqk 192, Dv 128),
// T = 1024, 16 heads, 2 threads, the forward (then on gemm too) ran at ~75
// GFLOP/s with 64 x 64 tiles, ~115 with 64 x 128 or 128 x 64, ~130 with
// 128 x 128, and no better with 256-row or 256-key tiles, which also leave
// fewer items to share out for short sequences.
constexpr int64_t kTileQ = 128;
constexpr int64_t kTileK = tiles::kTileK;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// The forward's per-thread scratch: s/p [TileQ, TileK], O [TileQ, Dvp] (Dv
// rounded up to 16 columns), m and l [TileQ].
struct ForwardScratch {
  float *s, *o, *m, *l;
  static int64_t floats(int64_t Dv) { return kTileQ * kTileK + kTileQ * round_up16(Dv) + 2 * kTileQ; }
  ForwardScratch(float* w, int64_t Dv) {
    s = w;
    o = s + kTileQ * kTileK;
    m = o + kTileQ * round_up16(Dv);
    l = m + kTileQ;
  }
};

// The keys and values of each (batch row, head) as the forward's kernels
// read them, made once per call (every query tile reads them again): each
// key tile transposed, [Dqk, kKeyLd] (zeros past the tile's keys), and the
// values contiguous, v [T, Dvp] (zeros past Dv). About the size of k and v.
// Rows of a transposed tile are kKeyLd = 144 floats apart, not 128 or the
// sequence's length: at such power-of-two strides the rows the score kernel
// walks down map to a few sets of the L1 cache and evict each other. So do
// a head's rows in v (H * Dv floats apart), hence the copy. A long context
// with many heads packs a group of heads at a time (packed_group), so that
// the copies stay small beside k and v.
constexpr int64_t kKeyLd = tiles::kKeyLd;

struct PackedKeys {
  int64_t T, tiles, Dqk, Dv, Dvp, s0;
  Buffer<float> kt, v;
  // k and v as [B, T, H, D]; sequence b * H + h is head h of batch row b.
  // Packs sequences [s0, s1).
  PackedKeys(int64_t T_, int64_t H, int64_t Dqk_, int64_t Dv_, const float* k, const float* v_, int64_t s0_, int64_t s1)
      : T(T_), tiles((T_ + kTileK - 1) / kTileK), Dqk(Dqk_), Dv(Dv_), Dvp(round_up16(Dv_)), s0(s0_) {
    const int64_t n_seq = s1 - s0, ld_k = H * Dqk, ld_v = H * Dv;
    kt.resize(static_cast<size_t>(n_seq * tiles * Dqk * kKeyLd));
    v.resize(static_cast<size_t>(n_seq * T * Dvp));
    parallel_ranges(n_seq * tiles, n_seq * T * (Dqk + Dv) >= (int64_t{1} << 15), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t sq = s0 + i / tiles, j0 = i % tiles * kTileK, nk = std::min(kTileK, T - j0);
        const int64_t b = sq / H, h = sq % H;
        DS_DISPATCH(TransposeKeys)
        (keys(sq, j0), kKeyLd, round_up16(nk), k + (b * T + j0) * ld_k + h * Dqk, ld_k, nk, Dqk);
        for (int64_t j = j0; j < j0 + nk; ++j) {
          float* dst = values(sq) + j * Dvp;
          std::memcpy(dst, v_ + (b * T + j) * ld_v + h * Dv, Dv * sizeof(float));
          std::fill(dst + Dv, dst + Dvp, 0.0f);
        }
      }
    });
  }
  // The transposed tile of sequence sq whose first key is j0 (a multiple of the tile).
  float* keys(int64_t sq, int64_t j0) { return kt.data() + ((sq - s0) * tiles + j0 / kTileK) * Dqk * kKeyLd; }
  float* values(int64_t sq) { return v.data() + (sq - s0) * T * Dvp; }
};

// Sequences packed at a time: at most about 64 MiB of copies (the budget),
// but at least two per thread (or all of them) so that the query tiles keep
// every thread busy.
std::atomic<int64_t> g_pack_budget{int64_t{64} << 20};

int64_t packed_group(int64_t n_seq, int64_t T, int64_t Dqk, int64_t Dv) {
  const int64_t per_seq = ((T + kTileK - 1) / kTileK * Dqk * kKeyLd + T * round_up16(Dv)) * 4;
  const int64_t fit = g_pack_budget.load() / per_seq;
  return std::clamp<int64_t>(fit, std::min<int64_t>(n_seq, 2 * omp_get_max_threads()), n_seq);
}

// One tile pair of the forward: query rows [0, nq) of a query tile against
// keys [0, nk) of a key tile. Query row r may see the tile's keys [0, diag +
// r + 1) (clamped to [0, nk]), and of those only the ones with its segment id
// (seg_q[r] == seg_k[c], with segment ids) and the selected ones
// (sel[r * ld_sel + c] != 0, with a selection).
struct ForwardPair {
  const float* q;   // query row 0 of the tile, rows ldq apart
  const float* kt;  // the key tile transposed, PackedKeys::keys (rows kKeyLd apart)
  const float* v;   // the tile's first value row in PackedKeys::v (ldv = Dvp)
  int64_t ldq;
  int64_t nq, nk, diag;
  const int32_t* seg_q = nullptr;
  const int32_t* seg_k = nullptr;
  const uint8_t* sel = nullptr;
  int64_t ld_sel = 0;
};

// Folds one tile pair into the running m, l and O of the query tile. The
// query rows go in blocks of the kernels' register tile; a block computes
// scores for the keys its last row may see (rounded up to 16), so the
// diagonal tile costs little more than its lower triangle.
void forward_pair(const ForwardScratch& w, const ForwardPair& p, int64_t Dqk, int64_t Dv, float scale) {
  const int64_t Dvp = round_up16(Dv);
  const int64_t R = DS_DISPATCH(BlockRows)();
  DS_DISPATCH(ScoreTile)(w.s, kTileK, p.q, p.ldq, p.kt, kKeyLd, p.nq, p.nk, p.diag, Dqk, scale);
  for (int64_t r0 = 0; r0 < p.nq; r0 += R) {
    const int64_t rows = std::min(R, p.nq - r0);
    const int64_t n = block_keys(r0, rows, p.nk, p.diag);
    if (n == 0) continue;
    // The block's scores reach nr, past n in whole vectors: those p are 0.
    const int64_t nr = round_up16(n);
    float* s = w.s + r0 * kTileK;
    for (int64_t r = r0; r < r0 + rows; ++r) {
      float* sr = s + (r - r0) * kTileK;
      const int64_t allowed = std::clamp<int64_t>(p.diag + r + 1, 0, n);
      if (p.seg_q)
        for (int64_t c = 0; c < allowed; ++c)
          if (p.seg_k[c] != p.seg_q[r]) sr[c] = kNegInf;
      if (p.sel)
        for (int64_t c = 0; c < allowed; ++c)
          if (!p.sel[r * p.ld_sel + c]) sr[c] = kNegInf;
      std::fill(sr + allowed, sr + nr, kNegInf);
    }
    DS_DISPATCH(FoldRows)(s, kTileK, rows, nr, w.m + r0, w.l + r0, w.o + r0 * Dvp, Dvp);
  }
  DS_DISPATCH(ValueTile)(w.o, Dvp, w.s, kTileK, p.v, Dvp, p.nq, p.nk, p.diag, Dvp);
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
// Exposed for the test that packing a few heads at a time changes no bit.
int64_t set_attention_pack_budget(int64_t bytes) { return g_pack_budget.exchange(bytes); }
}  // namespace detail

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* segment_ids, const AttentionDims& d, const uint8_t* selected, const float* sink) {
  check_dims(d, "attention_forward");
  DS_CHECK(out && lse && q && k && v, "attention_forward: null tensor pointer");
  const Geometry g(d, selected);
  if (selected) check_selection(g, segment_ids);
  const TileRanges qr = tile_ranges(segment_ids, g.B, g.T, kTileQ);
  const TileRanges kr = tile_ranges(segment_ids, g.B, g.T, kTileK);
  const int64_t Dvp = round_up16(g.Dv);
  // Sequence b * H + h of the packed keys is head h of batch row b. Items
  // (sequence, query tile) of a group, the last query tiles (the most keys)
  // first.
  const int64_t n_seq = g.B * g.H, group = packed_group(n_seq, g.T, g.Dqk, g.Dv);
  for (int64_t s0 = 0; s0 < n_seq; s0 += group) {
    const int64_t s1 = std::min(n_seq, s0 + group);
    PackedKeys pk(g.T, g.H, g.Dqk, g.Dv, k, v, s0, s1);
    run_items((s1 - s0) * g.nq_tiles, ForwardScratch::floats(g.Dv), [&](int64_t it, float* scratch) {
      const int64_t sq = s0 + it % (s1 - s0), b = sq / g.H, h = sq % g.H, qt = g.nq_tiles - 1 - it / (s1 - s0);
      const ForwardScratch w(scratch, g.Dv);
      float *o = w.o, *m = w.m, *l = w.l;
      const int64_t i0 = qt * kTileQ, nq = std::min(kTileQ, g.T - i0);
      std::fill(o, o + nq * Dvp, 0.0f);
      std::fill(m, m + nq, kNegInf);
      std::fill(l, l + nq, 0.0f);
      for (int64_t kt = 0; kt * kTileK < i0 + nq; ++kt) {
        const Pair t = tile_pair(g, segment_ids, qr, kr, b, qt, kt);
        if (t.skip) continue;
        ForwardPair p{q + g.row(b, i0, h, g.Dqk),
                      pk.keys(b * g.H + h, t.j0),
                      pk.values(b * g.H + h) + t.j0 * Dvp,
                      g.ld_qk(),
                      nq,
                      t.nk,
                      i0 - t.j0};
        if (t.segment) {
          p.seg_q = segment_ids + b * g.T + i0;
          p.seg_k = segment_ids + b * g.T + t.j0;
        }
        if (selected) {
          p.sel = selected + (b * g.T + i0) * g.T + t.j0;
          p.ld_sel = g.T;
        }
        forward_pair(w, p, g.Dqk, g.Dv, g.scale);
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
        for (int64_t c = 0; c < g.Dv; ++c) dst[c] = o[r * Dvp + c] * inv;
        lse[(b * g.H + h) * g.T + i0 + r] = lse1;
      }
    });
  }
}

void attention_forward_past(float* out, const float* q, const float* k, const float* v, int64_t past,
                            const AttentionDims& d) {
  check_dims(d, "attention_forward_past");
  DS_CHECK(out && q && k && v, "attention_forward_past: null tensor pointer");
  DS_CHECK(d.batch == 1 && past >= 0, "attention_forward_past: batch {} past {}: one sequence, past >= 0", d.batch,
           past);
  const int64_t n = d.seq, H = d.heads, Dqk = d.qk_dim, Dv = d.v_dim, nq_tiles = (n + kTileQ - 1) / kTileQ;
  const int64_t ldq = H * Dqk, ldv = H * Dv;
  const int64_t Dvp = round_up16(Dv);
  // Sequence h of the packed keys is head h. Items (head, query tile) of a
  // group of heads, the last query tiles (the most keys) first.
  const int64_t group = packed_group(H, past + n, Dqk, Dv);
  for (int64_t h0 = 0; h0 < H; h0 += group) {
    const int64_t h1 = std::min(H, h0 + group);
    PackedKeys pk(past + n, H, Dqk, Dv, k, v, h0, h1);
    run_items((h1 - h0) * nq_tiles, ForwardScratch::floats(Dv), [&](int64_t it, float* scratch) {
      const int64_t h = h0 + it % (h1 - h0), qt = nq_tiles - 1 - it / (h1 - h0);
      const ForwardScratch w(scratch, Dv);
      const int64_t i0 = qt * kTileQ, nq = std::min(kTileQ, n - i0);
      const int64_t last = past + i0 + nq - 1;  // the last key any query of the tile sees
      std::fill(w.o, w.o + nq * Dvp, 0.0f);
      std::fill(w.m, w.m + nq, kNegInf);
      std::fill(w.l, w.l + nq, 0.0f);
      for (int64_t j0 = 0; j0 <= last; j0 += kTileK) {
        const int64_t nk = std::min(kTileK, last + 1 - j0);
        // Query r is at position past + i0 + r.
        forward_pair(w, {q + i0 * ldq + h * Dqk, pk.keys(h, j0), pk.values(h) + j0 * Dvp, ldq, nq, nk, past + i0 - j0},
                     Dqk, Dv, d.scale);
      }
      for (int64_t r = 0; r < nq; ++r) {
        const float inv = 1.0f / w.l[r];  // every query sees at least its own key
        float* dst = out + (i0 + r) * ldv + h * Dv;
        for (int64_t c = 0; c < Dv; ++c) dst[c] = w.o[r * Dvp + c] * inv;
      }
    });
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const int32_t* segment_ids,
                        const AttentionDims& d, const uint8_t* selected, const float* sink, float* dsink) {
  check_dims(d, "attention_backward");
  DS_CHECK(dq && dk && dv && dout && out && lse && q && k && v, "attention_backward: null tensor pointer");
  // The forward's tiles are float32 kernels whatever gemm_dtype() is, so the
  // backward's products are float32 too: its recomputed probabilities must
  // be the forward's, normalized by the forward's lse.
  const ScopedGemmDtype f32(GemmDtype::kF32);
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
