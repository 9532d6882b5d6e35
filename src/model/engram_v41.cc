#include "model/engram_v41.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"

namespace ds::model {

void v41_engram_gather(float* e, const int32_t* ids, int64_t T, int64_t C, const V41EngramTable& t) {
  const int64_t De = t.cols, groups = (De + 31) / 32;
  for (int64_t i = 0; i < T * C; ++i) {
    float* out = e + i * De;
    const int64_t id = ids[i];
    if (id < 0 || id >= t.rows) {  // DeepSeek's code masks it to a zero row
      for (int64_t j = 0; j < De; ++j) out[j] = 0.0f;
      continue;
    }
    const uint8_t* codes = t.codes + id * De;
    const uint8_t* scales = t.scales + id * groups;
    for (int64_t j = 0; j < De; ++j) out[j] = e4m3_to_f32(codes[j]) * e8m0_to_f32(scales[j / 32]);
  }
}

void v41_engram_gather(float* e, const int32_t* ids, int64_t T, int64_t C, const ops::WeightView& table) {
  if (table.dtype == DType::F8E4M3) {
    DS_CHECK(table.scale_e8m0 != nullptr, "internal: an fp8 Engram table without its e8m0 scales");
    return v41_engram_gather(
        e, ids, T, C,
        V41EngramTable{static_cast<const uint8_t*>(table.data), table.scale_e8m0, table.rows, table.cols});
  }
  const int64_t De = table.cols;
  for (int64_t i = 0; i < T * C; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= table.rows)
      std::fill(e + i * De, e + (i + 1) * De, 0.0f);
    else
      ops::widen_rows(e + i * De, table, id, id + 1);
  }
}

void v41_engram_forward(float* x, const float* e, const ops::WeightView& wkv, const float* w_qk, const V41EngramDims& d,
                        const uint8_t* image, float* alpha, float* kv_out) {
  const int64_t T = d.tokens, n = d.streams, D = d.dim;
  DS_CHECK(wkv.rows == (n + 1) * D, "internal: V4.1 Engram wkv has {} rows, {} streams of {} need {}", wkv.rows, n, D,
           (n + 1) * D);
  if (T == 0) return;
  std::vector<float> own;
  float* kv = kv_out;
  if (!kv) {
    own.resize(static_cast<size_t>(T * (n + 1) * D));
    kv = own.data();
  }
  ops::linear_forward(kv, e, wkv, T);
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(D));
  parallel_ranges(T, T * n * D >= (1 << 14), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = kv + (t * (n + 1) + n) * D;
      for (int64_t g = 0; g < n; ++g) {
        float* xg = x + (t * n + g) * D;
        const float* key = kv + (t * (n + 1) + g) * D;
        const float* w = w_qk + g * D;
        double xx = 0, kk = 0, dot = 0;
        for (int64_t j = 0; j < D; ++j) {
          xx += static_cast<double>(xg[j]) * xg[j];
          kk += static_cast<double>(key[j]) * key[j];
          dot += static_cast<double>(xg[j]) * w[j] * key[j];
        }
        const double rho =
            1.0 / std::sqrt(xx / static_cast<double>(D) + d.eps) / std::sqrt(kk / static_cast<double>(D) + d.eps);
        const float s = static_cast<float>(dot * rho * inv_sqrt_d);
        const float a = std::copysign(std::sqrt(std::max(std::fabs(s), 1e-6f)), s);
        const float gate = image && image[t] ? 0.0f : 1.0f / (1.0f + std::exp(-a));
        if (alpha) alpha[t * n + g] = gate;
        for (int64_t j = 0; j < D; ++j) xg[j] += gate * v[j];
      }
    }
  });
}

void v41_engram_backward(float* dx, float* dkv, float* dw_qk, const float* dout, const float* x, const float* kv,
                         const float* w_qk, const V41EngramDims& d, const uint8_t* image) {
  const int64_t T = d.tokens, n = d.streams, D = d.dim;
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(D));
  // dw_qk is summed over tokens: per token into rows of its own, added in
  // token order afterwards (the same result for any thread count).
  std::vector<float> dw_tok(static_cast<size_t>(T * n * D));
  parallel_ranges(T, T * n * D >= (1 << 14), [&](int64_t t0, int64_t t1) {
    std::vector<double> dalpha(static_cast<size_t>(n));
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = kv + (t * (n + 1) + n) * D;
      float* dv = dkv + (t * (n + 1) + n) * D;
      std::fill(dv, dv + D, 0.0f);
      for (int64_t g = 0; g < n; ++g) {  // dout is read whole before dx (which may alias it) changes
        const float* dg = dout + (t * n + g) * D;
        double acc = 0;
        for (int64_t j = 0; j < D; ++j) acc += static_cast<double>(dg[j]) * v[j];
        dalpha[static_cast<size_t>(g)] = acc;
      }
      for (int64_t g = 0; g < n; ++g) {
        const float* xg = x + (t * n + g) * D;
        const float* key = kv + (t * (n + 1) + g) * D;
        const float* w = w_qk + g * D;
        float* dkey = dkv + (t * (n + 1) + g) * D;
        float* dw = dw_tok.data() + (t * n + g) * D;
        double xx = 0, kk = 0, dot = 0;
        for (int64_t j = 0; j < D; ++j) {
          xx += static_cast<double>(xg[j]) * xg[j];
          kk += static_cast<double>(key[j]) * key[j];
          dot += static_cast<double>(xg[j]) * w[j] * key[j];
        }
        const double rx = 1.0 / std::sqrt(xx / static_cast<double>(D) + d.eps);
        const double rk = 1.0 / std::sqrt(kk / static_cast<double>(D) + d.eps);
        const double s = dot * rx * rk * inv_sqrt_d;
        const bool floored = std::fabs(s) <= 1e-6 || (image && image[t]);
        const double a = std::copysign(std::sqrt(std::max(std::fabs(s), 1e-6)), s);
        const double sg = 1.0 / (1.0 + std::exp(-a));
        const double alpha = image && image[t] ? 0.0 : sg;
        const float* dg = dout + (t * n + g) * D;
        for (int64_t j = 0; j < D; ++j) dv[j] += static_cast<float>(alpha * dg[j]);
        // ds = dalpha sigma' / (2 sqrt|s|); s's gradients through the dot and both norms.
        const double ds =
            floored ? 0.0 : dalpha[static_cast<size_t>(g)] * sg * (1 - sg) / (2 * std::sqrt(std::fabs(s)));
        const double c = ds * rx * rk * inv_sqrt_d;
        const double cx = ds * s * rx * rx / static_cast<double>(D), ck = ds * s * rk * rk / static_cast<double>(D);
        float* dxg = dx + (t * n + g) * D;
        for (int64_t j = 0; j < D; ++j) {
          dxg[j] += static_cast<float>(c * w[j] * key[j] - cx * xg[j]);
          dkey[j] = static_cast<float>(c * xg[j] * w[j] - ck * key[j]);
          dw[j] = static_cast<float>(c * xg[j] * key[j]);
        }
      }
    }
  });
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n * D; ++i) dw_qk[i] += dw_tok[static_cast<size_t>(t * n * D + i)];
}

}  // namespace ds::model
