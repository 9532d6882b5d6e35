// Scalar reference for ops/attention.h: the full [T, T] score matrix of each
// (batch, head), softmax over the allowed keys, and the hand-derived backward.
// Same layouts as the fast kernels: q, k [B, T, H, Dqk]; v, out [B, T, H, Dv];
// lse [B, H, T]; segment ids [B, T] (empty: one segment per sequence);
// selected [B, T, T] (empty: every key the masks allow; see ops/attention.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops/attention.h"

namespace ds::ref {

namespace detail {

// Query i may attend to key j of the same batch row.
inline bool attention_allowed(const std::vector<int32_t>& seg, const std::vector<uint8_t>& sel, int64_t b, int64_t T,
                              int64_t i, int64_t j) {
  return j <= i && (seg.empty() || seg[b * T + i] == seg[b * T + j]) && (sel.empty() || sel[(b * T + i) * T + j]);
}

// p [T, T] = softmax over the allowed keys of scale * q_i . k_j for one
// (b, h), disallowed entries 0, and lse_row [T] = log sum_j exp(s[i, j]).
template <typename T>
void attention_probs(std::vector<T>& p, std::vector<T>& lse_row, const std::vector<T>& q, const std::vector<T>& k,
                     const std::vector<int32_t>& seg, const std::vector<uint8_t>& sel, const ops::AttentionDims& d,
                     int64_t b, int64_t h, const std::vector<T>& sink = {}) {
  const int64_t S = d.seq, H = d.heads, Dk = d.qk_dim;
  p.assign(S * S, T(0));
  lse_row.assign(S, T(0));
  for (int64_t i = 0; i < S; ++i) {
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < S; ++j) {
      if (!attention_allowed(seg, sel, b, S, i, j)) continue;
      T s = 0;
      for (int64_t c = 0; c < Dk; ++c) s += q[((b * S + i) * H + h) * Dk + c] * k[((b * S + j) * H + h) * Dk + c];
      p[i * S + j] = T(d.scale) * s;
      mx = std::max(mx, p[i * S + j]);
    }
    T sum = sink.empty() ? T(0) : std::exp(sink[h] - mx);  // the sink's share of the denominator
    for (int64_t j = 0; j < S; ++j)
      if (attention_allowed(seg, sel, b, S, i, j)) sum += std::exp(p[i * S + j] - mx);
    for (int64_t j = 0; j < S; ++j)
      p[i * S + j] = attention_allowed(seg, sel, b, S, i, j) ? std::exp(p[i * S + j] - mx) / sum : T(0);
    lse_row[i] = mx + std::log(sum);
  }
}

}  // namespace detail

// out = softmax(scale q k^T, causal and same segment) v; lse = log sum exp of
// the allowed scores. Both vectors are resized.
template <typename T>
void attention_forward(std::vector<T>& out, std::vector<T>& lse, const std::vector<T>& q, const std::vector<T>& k,
                       const std::vector<T>& v, const std::vector<int32_t>& seg, const ops::AttentionDims& d,
                       const std::vector<uint8_t>& sel = {}, const std::vector<T>& sink = {}) {
  const int64_t B = d.batch, S = d.seq, H = d.heads, Dv = d.v_dim;
  out.assign(B * S * H * Dv, T(0));
  lse.assign(B * H * S, T(0));
  std::vector<T> p, lse_row;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      detail::attention_probs(p, lse_row, q, k, seg, sel, d, b, h, sink);
      for (int64_t i = 0; i < S; ++i) {
        lse[(b * H + h) * S + i] = lse_row[i];
        for (int64_t c = 0; c < Dv; ++c) {
          T o = 0;
          for (int64_t j = 0; j < S; ++j) o += p[i * S + j] * v[((b * S + j) * H + h) * Dv + c];
          out[((b * S + i) * H + h) * Dv + c] = o;
        }
      }
    }
}

// Gradients of L with dL/dout = dout, derived from the forward above:
//   dv[j] = sum_i p[i,j] dout[i]
//   dp[i,j] = dout[i] . v[j]
//   ds[i,j] = dL/ds[i,j] = p[i,j] (dp[i,j] - sum_j' p[i,j'] dp[i,j'])   (softmax Jacobian)
//   dq[i] = scale sum_j ds[i,j] k[j],  dk[j] = scale sum_i ds[i,j] q[i]
// The row term sum_j' p dp is summed here from p and dp; the fast kernel uses
// the equal dout[i] . out[i]. All three gradients are overwritten (resized).
template <typename T>
void attention_backward(std::vector<T>& dq, std::vector<T>& dk, std::vector<T>& dv, const std::vector<T>& dout,
                        const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                        const std::vector<int32_t>& seg, const ops::AttentionDims& d,
                        const std::vector<uint8_t>& sel = {}, const std::vector<T>& sink = {},
                        std::vector<T>* dsink = nullptr) {
  const int64_t B = d.batch, S = d.seq, H = d.heads, Dk = d.qk_dim, Dv = d.v_dim;
  dq.assign(B * S * H * Dk, T(0));
  dk.assign(B * S * H * Dk, T(0));
  dv.assign(B * S * H * Dv, T(0));
  if (dsink) dsink->assign(H, T(0));
  std::vector<T> p, lse_row, ds(S * S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      detail::attention_probs(p, lse_row, q, k, seg, sel, d, b, h, sink);
      auto qi = [&](int64_t i, int64_t c) { return q[((b * S + i) * H + h) * Dk + c]; };
      auto ki = [&](int64_t i, int64_t c) { return k[((b * S + i) * H + h) * Dk + c]; };
      auto vi = [&](int64_t i, int64_t c) { return v[((b * S + i) * H + h) * Dv + c]; };
      auto doi = [&](int64_t i, int64_t c) { return dout[((b * S + i) * H + h) * Dv + c]; };
      for (int64_t i = 0; i < S; ++i) {
        T row = 0;
        for (int64_t j = 0; j < S; ++j) {
          T dp = 0;
          for (int64_t c = 0; c < Dv; ++c) dp += doi(i, c) * vi(j, c);
          ds[i * S + j] = dp;
          row += p[i * S + j] * dp;
        }
        for (int64_t j = 0; j < S; ++j) ds[i * S + j] = p[i * S + j] * (ds[i * S + j] - row);
        // The sink's own probability has no value: its dp is 0.
        if (dsink && !sink.empty()) (*dsink)[h] -= std::exp(sink[h] - lse_row[i]) * row;
      }
      for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < S; ++j) {
          const T pij = p[i * S + j], dsij = T(d.scale) * ds[i * S + j];
          for (int64_t c = 0; c < Dv; ++c) dv[((b * S + j) * H + h) * Dv + c] += pij * doi(i, c);
          for (int64_t c = 0; c < Dk; ++c) {
            dq[((b * S + i) * H + h) * Dk + c] += dsij * ki(j, c);
            dk[((b * S + j) * H + h) * Dk + c] += dsij * qi(i, c);
          }
        }
    }
}

}  // namespace ds::ref
