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
    return v41_engram_gather(e, ids, T, C, V41EngramTable{static_cast<const uint8_t*>(table.data), table.scale_e8m0,
                                                          table.rows, table.cols});
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
                        const uint8_t* image, float* alpha) {
  const int64_t T = d.tokens, n = d.streams, D = d.dim;
  DS_CHECK(wkv.rows == (n + 1) * D, "internal: V4.1 Engram wkv has {} rows, {} streams of {} need {}", wkv.rows, n, D,
           (n + 1) * D);
  if (T == 0) return;
  std::vector<float> kv(static_cast<size_t>(T * (n + 1) * D));
  ops::linear_forward(kv.data(), e, wkv, T);
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(D));
  parallel_ranges(T, T * n * D >= (1 << 14), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = kv.data() + (t * (n + 1) + n) * D;
      for (int64_t g = 0; g < n; ++g) {
        float* xg = x + (t * n + g) * D;
        const float* key = kv.data() + (t * (n + 1) + g) * D;
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

}  // namespace ds::model
