// Cross-entropy, plain and fused with the LM head (math: ops/cross_entropy.h).
//
// The fused kernels work on [token block x vocab chunk] tiles. For each token
// block, in order, the vocabulary chunks are shared between threads; each
// chunk's logits come from one single-threaded gemm into the thread's tile.
//
// Forward: each chunk leaves, per row, its maximum m_c and s_c = sum exp(l - m_c);
// the row's lse = m + log sum_c s_c exp(m_c - m) (m = max_c m_c) is then
// combined in chunk order. This is the online log-sum-exp, split so that the
// chunks can be computed in parallel and still combined in a fixed order.
//
// Backward: dlogits for a tile is rebuilt from the tile's logits and the saved
// lse, then used twice:
//   dW[chunk] += dlogits^T h[block]: chunk c of dW belongs to the thread holding
//     chunk c, and token blocks come in order, so dW's sums have a fixed order;
//   dh[block] += dlogits W[chunk]: computed into the thread's own buffer and
//     added into dh in chunk order (an ordered section; the add is cheap next
//     to the gemms).
// So both gradients are bitwise the same for any thread count, the backward
// costs three products (recompute, dW, dh), and the scratch is one tile plus one
// [token block, D] buffer per thread.
//
// exp is a vectorized Cephes-style expf (range reduction by ln 2 and a
// minimax polynomial, ~1 ulp; ops/cpu/fast_exp-inl.h): libm's expf works one element
// at a time, and the fused loss evaluates N V exponentials in each direction.
// The row kernels are Highway code, compiled once per SIMD target and
// dispatched at run time (core/simd.h).
#include "ops/cross_entropy.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/matmul.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/cross_entropy.cc"
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
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// max of x[0..n), n >= 1 (NaN is skipped here; SumExp propagates it).
float RowMax(const float* x, int64_t n) { return RowMaxSkippingNaN(DF(), x, static_cast<size_t>(n)); }

// sum_j exp(x_j - shift) over x[0..n), accumulated in float lanes (the terms
// are in [0, 1]) and returned in double.
double SumExp(const float* x, float shift, int64_t n) {
  return ExpShiftedSum<false>(DF(), nullptr, x, static_cast<size_t>(n), shift);
}

// y_j = exp(x_j - shift) * scale; y may equal x.
void ScaledSoftmax(float* y, const float* x, float shift, float scale, int64_t n) {
  const DF d;
  Map1(d, y, x, static_cast<size_t>(n), [d, shift, scale](VF v) HWY_ATTR {
    return hn::Mul(FastExp(d, hn::Sub(v, hn::Set(d, shift))), hn::Set(d, scale));
  });
}

void AddInto(float* y, const float* x, int64_t n) {
  Map2(DF(), y, y, x, static_cast<size_t>(n), [](VF a, VF b) HWY_ATTR { return hn::Add(a, b); });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(RowMax);
HWY_EXPORT(SumExp);
HWY_EXPORT(ScaledSoftmax);
HWY_EXPORT(AddInto);

namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 15;

float row_max(const float* x, int64_t n) { return DS_DISPATCH(RowMax)(x, n); }
double sum_exp(const float* x, float shift, int64_t n) { return DS_DISPATCH(SumExp)(x, shift, n); }
void scaled_softmax(float* y, const float* x, float shift, float scale, int64_t n) {
  DS_DISPATCH(ScaledSoftmax)(y, x, shift, scale, n);
}
void add_into(float* y, const float* x, int64_t n) { DS_DISPATCH(AddInto)(y, x, n); }

// Rejects targets >= V (negative ones mean "ignore").
void check_targets(const int32_t* targets, int64_t N, int64_t V, const char* what) {
  for (int64_t t = 0; t < N; ++t)
    DS_CHECK(targets[t] < V, "{}: target {} of token {} is not below the vocabulary size {}", what, targets[t], t, V);
}

void check_sizes(int64_t N, int64_t D, int64_t V, const CrossEntropyChunks& c, const char* what) {
  DS_CHECK(N >= 0 && D >= 1 && V >= 1, "{}: N={} D={} V={}", what, N, D, V);
  DS_CHECK(c.token_block >= 1 && c.vocab_chunk >= 1, "{}: token_block={} vocab_chunk={} must be positive", what,
           c.token_block, c.vocab_chunk);
}

// Columns per vocabulary chunk: at most c.vocab_chunk, and few enough that
// the vocabulary makes kMinChunks chunks for the threads to share (a
// vocabulary within one chunk would run on one thread), but not below
// kMinChunkCols columns, where the products get thin. V alone decides, so the
// chunks, and with them the order of every sum, are the same for any thread
// count.
constexpr int64_t kMinChunks = 16, kMinChunkCols = 128;
int64_t vocab_chunk_cols(int64_t V, const CrossEntropyChunks& c) {
  const int64_t split = std::max(kMinChunkCols, (V + kMinChunks - 1) / kMinChunks);
  return std::min({c.vocab_chunk, (split + 15) / 16 * 16, V});
}

// Per-thread scratch of the fused kernels.
struct Tile {
  std::vector<float> logits;  // [token_block, vocab_chunk], row stride = the chunk's width
  std::vector<float> dh;      // [token_block, D] (backward only)
};

// logits[r, v] = h[t0 + r] . W[v0 + v] for the tile's rows and columns.
void tile_logits(float* logits, const GemmOperand& h, const GemmOperand& w, int64_t t0, int64_t rows, int64_t v0,
                 int64_t cols, int64_t D) {
  gemm(false, true, rows, cols, D, 1.0f, h + t0 * D, D, w + v0 * D, D, 0.0f, logits, cols);
}

}  // namespace

void cross_entropy_forward(float* loss, float* lse, const float* logits, const int32_t* targets, int64_t N, int64_t V) {
  DS_CHECK(N >= 0 && V >= 1, "cross_entropy_forward: N={} V={}", N, V);
  check_targets(targets, N, V, "cross_entropy_forward");
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t t = 0; t < N; ++t) {
    const float* l = logits + t * V;  // [V]
    const float m = row_max(l, V);
    const float s = static_cast<float>(m + std::log(sum_exp(l, m, V)));
    lse[t] = s;
    loss[t] = targets[t] < 0 ? 0.0f : s - l[targets[t]];
  }
}

void cross_entropy_backward(float* dlogits, const float* dloss, const float* logits, const int32_t* targets,
                            const float* lse, int64_t N, int64_t V) {
  DS_CHECK(N >= 0 && V >= 1, "cross_entropy_backward: N={} V={}", N, V);
  check_targets(targets, N, V, "cross_entropy_backward");
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t t = 0; t < N; ++t) {
    float* d = dlogits + t * V;  // [V]
    if (targets[t] < 0) {
      std::fill(d, d + V, 0.0f);
      continue;
    }
    scaled_softmax(d, logits + t * V, lse[t], dloss[t], V);
    d[targets[t]] -= dloss[t];
  }
}

void lm_head_cross_entropy_forward(float* loss, float* lse, const float* h, const float* w, const int32_t* targets,
                                   int64_t N, int64_t D, int64_t V, CrossEntropyChunks chunks) {
  check_sizes(N, D, V, chunks, "lm_head_cross_entropy_forward");
  check_targets(targets, N, V, "lm_head_cross_entropy_forward");
  const int64_t TB = std::min(chunks.token_block, std::max<int64_t>(N, 1));
  const int64_t VC = vocab_chunk_cols(V, chunks);
  const int64_t nc = (V + VC - 1) / VC;
  // Per row of the current block and per chunk: the chunk's max and sum of exp.
  std::vector<float> cmax(TB * nc);  // [TB, nc]
  std::vector<double> csum(TB * nc);
  std::vector<float> tlogit(TB);  // the target's logit, from whichever chunk holds it
  // Converted once for gemm_dtype(), not once per tile.
  const PreparedOperand hp(h, N * D), wp(w, V * D);
#pragma omp parallel
  {
    Tile tile;
    tile.logits.resize(TB * VC);
    for (int64_t t0 = 0; t0 < N; t0 += TB) {
      const int64_t rows = std::min(TB, N - t0);
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t v0 = c * VC, cols = std::min(VC, V - v0);
        float* l = tile.logits.data();  // [rows, cols]
        tile_logits(l, hp.operand(), wp.operand(), t0, rows, v0, cols, D);
        for (int64_t r = 0; r < rows; ++r) {
          const float* lr = l + r * cols;
          const float m = row_max(lr, cols);
          cmax[r * nc + c] = m;
          csum[r * nc + c] = sum_exp(lr, m, cols);
          const int64_t tg = targets[t0 + r];
          if (tg >= v0 && tg < v0 + cols) tlogit[r] = lr[tg - v0];
        }
      }  // implicit barrier: every chunk of this block is done
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        float m = cmax[r * nc];
        for (int64_t c = 1; c < nc; ++c) m = std::max(m, cmax[r * nc + c]);
        double s = 0;
        for (int64_t c = 0; c < nc; ++c) s += csum[r * nc + c] * std::exp(static_cast<double>(cmax[r * nc + c]) - m);
        const float v = static_cast<float>(m + std::log(s));
        lse[t0 + r] = v;
        loss[t0 + r] = targets[t0 + r] < 0 ? 0.0f : v - tlogit[r];
      }  // implicit barrier before the next block reuses cmax / csum
    }
  }
}

void lm_head_cross_entropy_backward(float* dh, float* dw, const float* dloss, const float* h, const float* w,
                                    const int32_t* targets, const float* lse, int64_t N, int64_t D, int64_t V,
                                    CrossEntropyChunks chunks) {
  check_sizes(N, D, V, chunks, "lm_head_cross_entropy_backward");
  check_targets(targets, N, V, "lm_head_cross_entropy_backward");
  if (!dh && !dw) return;
  const int64_t TB = std::min(chunks.token_block, std::max<int64_t>(N, 1));
  const int64_t VC = vocab_chunk_cols(V, chunks);
  const int64_t nc = (V + VC - 1) / VC;
  const PreparedOperand hp(h, N * D), wp(w, V * D);  // converted once (see the forward)
#pragma omp parallel
  {
    Tile tile;
    tile.logits.resize(TB * VC);
    if (dh) tile.dh.resize(TB * D);
    for (int64_t t0 = 0; t0 < N; t0 += TB) {
      const int64_t rows = std::min(TB, N - t0);
#pragma omp for ordered schedule(dynamic, 1)
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t v0 = c * VC, cols = std::min(VC, V - v0);
        float* l = tile.logits.data();  // [rows, cols], turned into dlogits in place
        tile_logits(l, hp.operand(), wp.operand(), t0, rows, v0, cols, D);
        for (int64_t r = 0; r < rows; ++r) {
          float* lr = l + r * cols;
          const int64_t t = t0 + r, tg = targets[t];
          if (tg < 0) {
            std::fill(lr, lr + cols, 0.0f);
            continue;
          }
          scaled_softmax(lr, lr, lse[t], dloss[t], cols);
          if (tg >= v0 && tg < v0 + cols) lr[tg - v0] -= dloss[t];
        }
        // dW[v0 : v0 + cols] [cols, D] += dlogits^T [cols, rows] h[t0 : t0 + rows] [rows, D].
        if (dw) gemm(true, false, cols, D, rows, 1.0f, l, cols, hp.operand() + t0 * D, D, 1.0f, dw + v0 * D, D);
        // This chunk's share of dh[block] [rows, D] = dlogits [rows, cols] W[v0 : v0 + cols] [cols, D].
        if (dh) gemm(false, false, rows, D, cols, 1.0f, l, cols, wp.operand() + v0 * D, D, 0.0f, tile.dh.data(), D);
#pragma omp ordered
        if (dh) {
          float* dst = dh + t0 * D;
          if (c == 0)
            std::copy(tile.dh.begin(), tile.dh.begin() + rows * D, dst);
          else
            add_into(dst, tile.dh.data(), rows * D);
        }
      }
    }
  }
}

}  // namespace ds::ops
#endif  // HWY_ONCE
