// Scalar reference for ops/latent_attention.h: expands every cached token's
// per-head key and value from the latent (no absorption) and runs plain
// causal softmax attention in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops/latent_attention.h"

namespace ds::ref {

// Same arguments as ops::latent_attention_forward, dense rows (ldq = heads *
// (nope + rope), ldc = heads * v_dim), double precision.
inline void latent_attention_forward(std::vector<double>& ctx, const std::vector<double>& q,
                                     const std::vector<double>& c_kv, const std::vector<double>& k_pe,
                                     const std::vector<double>& w_kvb, int64_t n, int64_t past,
                                     const ops::LatentAttentionDims& d) {
  const int64_t H = d.heads, nope = d.nope, rope = d.rope, vd = d.v_dim, R = d.kv_lora, T = past + n;
  const int64_t qk = nope + rope;
  // Expanded keys [T, H, qk] and values [T, H, vd].
  std::vector<double> k(T * H * qk), v(T * H * vd);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < nope + vd; ++i) {
        double s = 0;
        for (int64_t r = 0; r < R; ++r) s += c_kv[t * R + r] * w_kvb[(h * (nope + vd) + i) * R + r];
        if (i < nope)
          k[(t * H + h) * qk + i] = s;
        else
          v[(t * H + h) * vd + i - nope] = s;
      }
      for (int64_t i = 0; i < rope; ++i) k[(t * H + h) * qk + nope + i] = k_pe[t * rope + i];
    }
  ctx.assign(n * H * vd, 0.0);
  std::vector<double> s(T);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t visible = past + j + 1;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < visible; ++t) {
        double dot = 0;
        for (int64_t i = 0; i < qk; ++i) dot += q[(j * H + h) * qk + i] * k[(t * H + h) * qk + i];
        s[t] = d.scale * dot;
        mx = std::max(mx, s[t]);
      }
      double z = 0;
      for (int64_t t = 0; t < visible; ++t) z += (s[t] = std::exp(s[t] - mx));
      for (int64_t t = 0; t < visible; ++t)
        for (int64_t i = 0; i < vd; ++i) ctx[(j * H + h) * vd + i] += s[t] / z * v[(t * H + h) * vd + i];
    }
}

}  // namespace ds::ref
