// MLA decode attention over the latent cache; see ops/latent_attention.h.
// All heads of the sequence attend together: rows h*n + j (head h, query j)
// of one score matrix [H*n, T], computed by two gemms over c_kv and k_pe, so
// the cache is read once per step rather than once per head.
#include "ops/latent_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/buffer.h"
#include "core/error.h"
#include "ops/matmul.h"

namespace ds::ops {

void causal_softmax_rows(float* S, int64_t rows, int64_t n, int64_t past, int64_t T) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = S + r * T;
    const int64_t visible = past + r % n + 1;
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
}

void latent_attention_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                              const float* k_pe, const float* w_kvb, int64_t n, int64_t past,
                              const LatentAttentionDims& d) {
  const int64_t H = d.heads, nope = d.nope, rope = d.rope, vd = d.v_dim, kvl = d.kv_lora, T = past + n;
  DS_CHECK(n >= 1 && past >= 0 && H >= 1 && nope >= 0 && rope >= 0 && vd >= 1 && kvl >= 1,
           "latent_attention: bad sizes n={} past={} heads={} nope={} rope={} v={} kv_lora={}", n, past, H, nope, rope,
           vd, kvl);
  DS_CHECK(ldq >= H * (nope + rope) && ldc >= H * vd, "latent_attention: row strides ldq={} ldc={} too small", ldq,
           ldc);
  const int64_t R = H * n;
  Buffer<float> lat(R * kvl), qpe(R * rope), S(R * T);
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = q + h * (nope + rope);
    // q_lat = q_nope W_UK: the key up-projection folded into the query.
    gemm(false, false, n, kvl, nope, 1.0f, qh, ldq, w_kvb + h * (nope + vd) * kvl, kvl, 0.0f, &lat[h * n * kvl], kvl);
    for (int64_t j = 0; j < n && rope > 0; ++j)
      std::memcpy(qpe.data() + (h * n + j) * rope, qh + j * ldq + nope, rope * sizeof(float));
  }
  gemm(false, true, R, T, kvl, d.scale, lat.data(), kvl, c_kv, kvl, 0.0f, S.data(), T);
  gemm(false, true, R, T, rope, d.scale, qpe.data(), rope, k_pe, rope, 1.0f, S.data(), T);
  causal_softmax_rows(S.data(), R, n, past, T);
  // Attend in the latent space, then apply each head's W_UV.
  gemm(false, false, R, kvl, T, 1.0f, S.data(), T, c_kv, kvl, 0.0f, lat.data(), kvl);
  for (int64_t h = 0; h < H; ++h)
    gemm(false, true, n, vd, kvl, 1.0f, &lat[h * n * kvl], kvl, w_kvb + (h * (nope + vd) + nope) * kvl, kvl, 0.0f,
         ctx + h * vd, ldc);
}

void latent_attention_sparse_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                                     const float* k_pe, const float* w_kvb, int64_t n, const int32_t* idx, int64_t k,
                                     const LatentAttentionDims& d) {
  const int64_t H = d.heads, nope = d.nope, rope = d.rope, vd = d.v_dim, kvl = d.kv_lora;
  DS_CHECK(n >= 1 && k >= 1 && H >= 1 && nope >= 0 && rope >= 0 && vd >= 1 && kvl >= 1,
           "latent_attention_sparse: bad sizes n={} k={} heads={} nope={} rope={} v={} kv_lora={}", n, k, H, nope,
           rope, vd, kvl);
  DS_CHECK(ldq >= H * (nope + rope) && ldc >= H * vd, "latent_attention_sparse: row strides ldq={} ldc={} too small",
           ldq, ldc);
  // q_lat [H, n, kvl] for all queries at once; later the attended latents.
  Buffer<float> lat(H * n * kvl), qpe(H * rope), ck(k * kvl), pk(k * rope), S(H * k), o(H * kvl);
  for (int64_t h = 0; h < H; ++h)
    gemm(false, false, n, kvl, nope, 1.0f, q + h * (nope + rope), ldq, w_kvb + h * (nope + vd) * kvl, kvl, 0.0f,
         &lat[h * n * kvl], kvl);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t* sel = idx + j * k;
    for (int64_t i = 0; i < k; ++i) {
      std::memcpy(&ck[i * kvl], c_kv + static_cast<int64_t>(sel[i]) * kvl, kvl * sizeof(float));
      if (rope > 0) std::memcpy(&pk[i * rope], k_pe + static_cast<int64_t>(sel[i]) * rope, rope * sizeof(float));
    }
    for (int64_t h = 0; h < H && rope > 0; ++h)
      std::memcpy(&qpe[h * rope], q + j * ldq + h * (nope + rope) + nope, rope * sizeof(float));
    // Scores of every head over the selected tokens: rows h of S [H, k].
    gemm(false, true, H, k, kvl, d.scale, &lat[j * kvl], n * kvl, ck.data(), kvl, 0.0f, S.data(), k);
    if (rope > 0) gemm(false, true, H, k, rope, d.scale, qpe.data(), rope, pk.data(), rope, 1.0f, S.data(), k);
    causal_softmax_rows(S.data(), H, 1, k - 1, k);  // every selected key is visible
    gemm(false, false, H, kvl, k, 1.0f, S.data(), k, ck.data(), kvl, 0.0f, o.data(), kvl);
    for (int64_t h = 0; h < H; ++h) std::memcpy(&lat[(h * n + j) * kvl], &o[h * kvl], kvl * sizeof(float));
  }
  for (int64_t h = 0; h < H; ++h)
    gemm(false, true, n, vd, kvl, 1.0f, &lat[h * n * kvl], kvl, w_kvb + (h * (nope + vd) + nope) * kvl, kvl, 0.0f,
         ctx + h * vd, ldc);
}

}  // namespace ds::ops
