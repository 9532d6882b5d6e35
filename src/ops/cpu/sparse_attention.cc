// The per-query products are Highway code (compiled once per SIMD target and
// dispatched at run time, core/simd.h). A query's list is short (a window
// and a few compressed entries), so one BLAS call per product would cost more
// in call overhead than in arithmetic. Every product here is written as
// multiply-adds along one output row, in a fixed order over the summed index;
// no sum is split across lanes, so a result does not depend on the vector
// width either (a target without a fused multiply-add, such as the scalar
// fallback, rounds each product first and differs from those with one).
#include "ops/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/sparse_attention.cc"
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

// Each output element is one chain of multiply-adds in a fixed order; the
// tiles below run several independent chains at once so that the adds'
// latency overlaps (a single chain waits on its previous add at every step).

// S[h, j] = sum_c q[h, c] Kt[c, j] for h < H, j < ld: q [H, D], Kt [D, ld]
// (the keys transposed, ld a multiple of the vector length, padding
// included), S [H, ld].
void Scores(float* S, const float* q, const float* Kt, int64_t H, int64_t ld, int64_t D) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t h = 0; h < H; h += 2) {
    const float* q0 = q + h * D;
    const float* q1 = h + 1 < H ? q0 + D : q0;  // odd H: the last row twice, stored once
    for (int64_t j = 0; j < ld; j += 2 * N) {
      const bool two = j + N < ld;
      auto a00 = hn::Zero(d), a01 = hn::Zero(d), a10 = hn::Zero(d), a11 = hn::Zero(d);
      for (int64_t c = 0; c < D; ++c) {
        const auto x0 = hn::Set(d, q0[c]), x1 = hn::Set(d, q1[c]);
        const auto k0 = hn::LoadU(d, Kt + c * ld + j);
        a00 = hn::MulAdd(x0, k0, a00);
        a10 = hn::MulAdd(x1, k0, a10);
        if (two) {
          const auto k1 = hn::LoadU(d, Kt + c * ld + j + N);
          a01 = hn::MulAdd(x0, k1, a01);
          a11 = hn::MulAdd(x1, k1, a11);
        }
      }
      hn::StoreU(a00, d, S + h * ld + j);
      if (two) hn::StoreU(a01, d, S + h * ld + j + N);
      if (h + 1 < H) {
        hn::StoreU(a10, d, S + (h + 1) * ld + j);
        if (two) hn::StoreU(a11, d, S + (h + 1) * ld + j + N);
      }
    }
  }
}

// O[h, :] = sum_j P[h, j] rows[j] for h < H: P [H, ldp] (n used), rows n
// pointers to D floats, O [H, D].
void Combine(float* O, const float* P, int64_t ldp, const float* const* rows, int64_t H, int64_t n, int64_t D) {
  const DF d;
  const size_t N = hn::Lanes(d), dd = static_cast<size_t>(D);
  for (int64_t h = 0; h < H; h += 2) {
    const float* p0 = P + h * ldp;
    const float* p1 = h + 1 < H ? p0 + ldp : p0;
    size_t c = 0;
    for (; c + 2 * N <= dd; c += 2 * N) {
      auto a00 = hn::Zero(d), a01 = hn::Zero(d), a10 = hn::Zero(d), a11 = hn::Zero(d);
      for (int64_t j = 0; j < n; ++j) {
        const auto r0 = hn::LoadU(d, rows[j] + c), r1 = hn::LoadU(d, rows[j] + c + N);
        const auto x0 = hn::Set(d, p0[j]), x1 = hn::Set(d, p1[j]);
        a00 = hn::MulAdd(x0, r0, a00);
        a01 = hn::MulAdd(x0, r1, a01);
        a10 = hn::MulAdd(x1, r0, a10);
        a11 = hn::MulAdd(x1, r1, a11);
      }
      hn::StoreU(a00, d, O + h * D + static_cast<int64_t>(c));
      hn::StoreU(a01, d, O + h * D + static_cast<int64_t>(c + N));
      if (h + 1 < H) {
        hn::StoreU(a10, d, O + (h + 1) * D + static_cast<int64_t>(c));
        hn::StoreU(a11, d, O + (h + 1) * D + static_cast<int64_t>(c + N));
      }
    }
    for (; c < dd; c += N) {  // the last one or two vectors, the last maybe partial
      auto a0 = hn::Zero(d), a1 = hn::Zero(d);
      for (int64_t j = 0; j < n; ++j) {
        const auto r = LoadUpTo(d, rows[j] + c, dd - c);
        a0 = hn::MulAdd(hn::Set(d, p0[j]), r, a0);
        a1 = hn::MulAdd(hn::Set(d, p1[j]), r, a1);
      }
      StoreUpTo(d, a0, O + h * D + static_cast<int64_t>(c), dd - c);
      if (h + 1 < H) StoreUpTo(d, a1, O + (h + 1) * D + static_cast<int64_t>(c), dd - c);
    }
  }
}

// dK[j, :] = sum_h A[h, j] X[h, :] + sum_h B[h, j] Y[h, :] for j < n (the two
// sums formed apart, then added): A, B [H, ld], X, Y [H, D], dK [n, D].
void KeyGrads(float* dK, const float* A, const float* X, const float* B, const float* Y, int64_t ld, int64_t H,
              int64_t n, int64_t D) {
  const DF d;
  const size_t N = hn::Lanes(d), dd = static_cast<size_t>(D);
  for (int64_t j = 0; j < n; ++j) {
    size_t c = 0;
    for (; c + 2 * N <= dd; c += 2 * N) {
      auto a0 = hn::Zero(d), a1 = hn::Zero(d), b0 = hn::Zero(d), b1 = hn::Zero(d);
      for (int64_t h = 0; h < H; ++h) {
        const auto xa = hn::Set(d, A[h * ld + j]), xb = hn::Set(d, B[h * ld + j]);
        const float* xr = X + h * D + static_cast<int64_t>(c);
        const float* yr = Y + h * D + static_cast<int64_t>(c);
        a0 = hn::MulAdd(xa, hn::LoadU(d, xr), a0);
        a1 = hn::MulAdd(xa, hn::LoadU(d, xr + N), a1);
        b0 = hn::MulAdd(xb, hn::LoadU(d, yr), b0);
        b1 = hn::MulAdd(xb, hn::LoadU(d, yr + N), b1);
      }
      hn::StoreU(hn::Add(a0, b0), d, dK + j * D + static_cast<int64_t>(c));
      hn::StoreU(hn::Add(a1, b1), d, dK + j * D + static_cast<int64_t>(c + N));
    }
    for (; c < dd; c += N) {
      auto a = hn::Zero(d), b = hn::Zero(d);
      for (int64_t h = 0; h < H; ++h) {
        a = hn::MulAdd(hn::Set(d, A[h * ld + j]), LoadUpTo(d, X + h * D + static_cast<int64_t>(c), dd - c), a);
        b = hn::MulAdd(hn::Set(d, B[h * ld + j]), LoadUpTo(d, Y + h * D + static_cast<int64_t>(c), dd - c), b);
      }
      StoreUpTo(d, hn::Add(a, b), dK + j * D + static_cast<int64_t>(c), dd - c);
    }
  }
}

// dst[j][:] += src[j, :] for j < n, in order of j: src [n, D].
void AddRowsInto(float* const* dst, const float* src, int64_t n, int64_t D) {
  const DF d;
  for (int64_t j = 0; j < n; ++j)
    Map2(d, dst[j], dst[j], src + j * D, static_cast<size_t>(D),
         [](hn::Vec<DF> a, hn::Vec<DF> b) HWY_ATTR { return hn::Add(a, b); });
}

// Row h of S [H, ld] (n > 0 entries used) becomes the softmax of scale x
// S[h, :], the sink's logit sink[h] (sink may be null) in its denominator;
// lse[h] is the log of that denominator. The elementwise steps run in
// vectors; the maximum is exact in any order and the sum runs in double in
// the order of the entries, so no result depends on the vector width.
void SoftmaxRows(float* S, int64_t ld, int64_t H, int64_t n, float scale, const float* sink, float* lse) {
  const DF d;
  const size_t nn = static_cast<size_t>(n);
  for (int64_t h = 0; h < H; ++h) {
    float* row = S + h * ld;
    Map1(d, row, row, nn, [d, scale](VF v) HWY_ATTR { return hn::Mul(v, hn::Set(d, scale)); });
    const float mx = std::max(sink ? sink[h] : -std::numeric_limits<float>::infinity(), RowMaxSkippingNaN(d, row, nn));
    Map1(d, row, row, nn, [d, mx](VF v) HWY_ATTR { return FastExp(d, hn::Sub(v, hn::Set(d, mx))); });
    double sum = sink ? std::exp(static_cast<double>(sink[h]) - mx) : 0.0;
    for (int64_t j = 0; j < n; ++j) sum += row[j];
    const float inv = static_cast<float>(1.0 / sum);
    Map1(d, row, row, nn, [d, inv](VF v) HWY_ATTR { return hn::Mul(v, hn::Set(d, inv)); });
    lse[h] = mx + static_cast<float>(std::log(sum));
  }
}

// For j < n of each row h: P[h, j] = exp(scale P[h, j] - lse[h]) (P holds
// the scores, and becomes the probabilities) and dS[h, j] = scale P[h, j]
// (dS[h, j] - Dh[h]) (dS holds dP; scale x the scores' gradient, the factor
// both gradients below take). Elementwise.
void ProbsAndScoreGrads(float* P, float* dS, int64_t ld, int64_t H, int64_t n, float scale, const float* lse,
                        const float* Dh) {
  const DF d;
  const size_t nn = static_cast<size_t>(n);
  for (int64_t h = 0; h < H; ++h) {
    float* p = P + h * ld;
    float* ds = dS + h * ld;
    const float l = lse[h], dv = Dh[h];
    Map1(d, p, p, nn,
         [d, scale, l](VF v) HWY_ATTR { return FastExp(d, hn::Sub(hn::Mul(v, hn::Set(d, scale)), hn::Set(d, l))); });
    Map2(d, ds, p, ds, nn, [d, scale, dv](VF pv, VF g) HWY_ATTR {
      return hn::Mul(hn::Set(d, scale), hn::Mul(pv, hn::Sub(g, hn::Set(d, dv))));
    });
  }
}

// The vector length of the dispatched target, for padding.
int64_t VectorFloats() { return static_cast<int64_t>(hn::Lanes(DF())); }

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(Scores);
HWY_EXPORT(Combine);
HWY_EXPORT(KeyGrads);
HWY_EXPORT(VectorFloats);
HWY_EXPORT(AddRowsInto);
HWY_EXPORT(GatherTransposed);
HWY_EXPORT(SoftmaxRows);
HWY_EXPORT(ProbsAndScoreGrads);

namespace {

void check(const float* const* rows, const int64_t* offsets, const float* sink, const SparseMqaDims& d) {
  DS_CHECK(d.queries >= 0 && d.heads > 0 && d.dim > 0, "sparse attention: queries={} heads={} dim={}", d.queries,
           d.heads, d.dim);
  DS_CHECK(offsets[0] == 0, "sparse attention: offsets must start at 0");
  for (int64_t i = 0; i < d.queries; ++i) {
    DS_CHECK(offsets[i + 1] >= offsets[i], "sparse attention: offsets must not decrease (query {})", i);
    DS_CHECK(offsets[i + 1] > offsets[i] || sink != nullptr, "sparse attention: query {} has no key and no sink", i);
  }
  DS_CHECK(d.queries == 0 || rows != nullptr || offsets[d.queries] == 0, "sparse attention: no key rows");
}

// The keys of one query transposed into Kt [dim, ld].
void gather_transposed(std::vector<float>& Kt, const float* const* rows, int64_t n, int64_t ld, int64_t D) {
  Kt.resize(static_cast<size_t>(ld * D));
  DS_DISPATCH(GatherTransposed)(Kt.data(), rows, n, ld, ld, D);
}

// n rounded up to a whole number of vectors of `lanes`.
int64_t padded(int64_t n, int64_t lanes) { return (n + lanes - 1) / lanes * lanes; }

}  // namespace

void sparse_mqa_forward(float* out, float* lse, const float* q, const float* const* rows, const int64_t* offsets,
                        const float* sink, const SparseMqaDims& d) {
  check(rows, offsets, sink, d);
  const int64_t H = d.heads, D = d.dim;
  const int64_t lanes = DS_DISPATCH(VectorFloats)();
  parallel_ranges(d.queries, d.queries > 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> Kt, s;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = offsets[i + 1] - offsets[i];
      float* o = out + i * H * D;
      if (n == 0) {  // the sink alone: nothing to average
        std::fill(o, o + H * D, 0.0f);
        for (int64_t h = 0; h < H; ++h) lse[i * H + h] = sink[h];
        continue;
      }
      const int64_t ld = padded(n, lanes);
      gather_transposed(Kt, rows + offsets[i], n, ld, D);
      s.resize(static_cast<size_t>(H * ld));
      DS_DISPATCH(Scores)(s.data(), q + i * H * D, Kt.data(), H, ld, D);
      DS_DISPATCH(SoftmaxRows)(s.data(), ld, H, n, d.scale, sink, lse + i * H);
      DS_DISPATCH(Combine)(o, s.data(), ld, rows + offsets[i], H, n, D);
    }
  });
}

void sparse_mqa_backward(float* dq, float* const* drows, float* dsink, const float* dout, const float* out,
                         const float* lse, const float* q, const float* const* rows, const int64_t* offsets,
                         const float* sink, const SparseMqaDims& d) {
  check(rows, offsets, sink, d);
  const int64_t H = d.heads, D = d.dim;
  const int64_t lanes = DS_DISPATCH(VectorFloats)();
  // Blocks of a fixed number of queries. Inside a block each query's
  // products run on one thread (every query is independent) and leave its
  // key gradients and sink terms in scratch; the block then adds them to
  // their destinations in query order. Every sum is formed in the same order
  // whatever the thread count, and in the order of a plain loop over the
  // queries.
  constexpr int64_t kBlock = 256;
  std::vector<float> dkeys, dsinks;
  for (int64_t i0 = 0; i0 < d.queries; i0 += kBlock) {
    const int64_t i1 = std::min(d.queries, i0 + kBlock), e0 = offsets[i0], e1 = offsets[i1];
    if (drows) dkeys.resize(static_cast<size_t>((e1 - e0) * D));
    if (sink && dsink) dsinks.assign(static_cast<size_t>((i1 - i0) * H), 0.0f);
    parallel_ranges(i1 - i0, i1 - i0 > 1, [&](int64_t b, int64_t e) {
      std::vector<float> Kt, P, dS, Dh(static_cast<size_t>(H));
      for (int64_t i = i0 + b; i < i0 + e; ++i) {
        const int64_t n = offsets[i + 1] - offsets[i];
        const float* qi = q + i * H * D;
        const float* gi = dout + i * H * D;
        for (int64_t h = 0; h < H; ++h) {
          double acc = 0;
          for (int64_t c = 0; c < D; ++c) acc += static_cast<double>(gi[h * D + c]) * out[(i * H + h) * D + c];
          Dh[static_cast<size_t>(h)] = static_cast<float>(acc);
          if (sink && dsink)
            dsinks[static_cast<size_t>((i - i0) * H + h)] =
                std::exp(sink[h] - lse[i * H + h]) * Dh[static_cast<size_t>(h)];
        }
        if (n == 0) {
          std::fill(dq + i * H * D, dq + (i + 1) * H * D, 0.0f);
          continue;
        }
        const int64_t ld = padded(n, lanes);
        gather_transposed(Kt, rows + offsets[i], n, ld, D);
        P.resize(static_cast<size_t>(H * ld));
        dS.resize(static_cast<size_t>(H * ld));
        DS_DISPATCH(Scores)(P.data(), qi, Kt.data(), H, ld, D);
        DS_DISPATCH(Scores)(dS.data(), gi, Kt.data(), H, ld, D);  // dp
        DS_DISPATCH(ProbsAndScoreGrads)(P.data(), dS.data(), ld, H, n, d.scale, lse + i * H, Dh.data());
        DS_DISPATCH(Combine)(dq + i * H * D, dS.data(), ld, rows + offsets[i], H, n, D);
        if (drows)
          DS_DISPATCH(KeyGrads)(dkeys.data() + (offsets[i] - e0) * D, dS.data(), qi, P.data(), gi, ld, H, n, D);
      }
    });
    if (sink && dsink)
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t h = 0; h < H; ++h) dsink[h] -= dsinks[static_cast<size_t>((i - i0) * H + h)];
    // Keys shared by several queries (or listed twice) get their terms in
    // entry order. One thread: split by columns, two threads would share the
    // cache line at their boundary in every row.
    if (drows) DS_DISPATCH(AddRowsInto)(drows + e0, dkeys.data(), e1 - e0, D);
  }
}

}  // namespace ds::ops
#endif  // HWY_ONCE
