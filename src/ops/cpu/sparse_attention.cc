#include "ops/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/matmul.h"

namespace ds::ops {

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

// The keys of one query, gathered [n, dim].
void gather(std::vector<float>& K, const float* const* rows, int64_t n, int64_t D) {
  K.resize(static_cast<size_t>(n * D));
  for (int64_t j = 0; j < n; ++j) std::memcpy(K.data() + j * D, rows[j], static_cast<size_t>(D) * sizeof(float));
}

}  // namespace

void sparse_mqa_forward(float* out, float* lse, const float* q, const float* const* rows, const int64_t* offsets,
                        const float* sink, const SparseMqaDims& d) {
  check(rows, offsets, sink, d);
  const int64_t H = d.heads, D = d.dim;
  parallel_ranges(d.queries, d.queries > 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> K, s;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = offsets[i + 1] - offsets[i];
      float* o = out + i * H * D;
      if (n == 0) {  // the sink alone: nothing to average
        std::fill(o, o + H * D, 0.0f);
        for (int64_t h = 0; h < H; ++h) lse[i * H + h] = sink[h];
        continue;
      }
      gather(K, rows + offsets[i], n, D);
      s.resize(static_cast<size_t>(H * n));
      gemm(false, true, H, n, D, d.scale, q + i * H * D, D, K.data(), D, 0.0f, s.data(), n);
      for (int64_t h = 0; h < H; ++h) {
        float* row = s.data() + h * n;
        float mx = sink ? sink[h] : -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
        double sum = sink ? std::exp(static_cast<double>(sink[h]) - mx) : 0.0;
        for (int64_t j = 0; j < n; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t j = 0; j < n; ++j) row[j] *= inv;
        lse[i * H + h] = mx + static_cast<float>(std::log(sum));
      }
      gemm(false, false, H, D, n, 1.0f, s.data(), n, K.data(), D, 0.0f, o, D);
    }
  });
}

void sparse_mqa_backward(float* dq, float* const* drows, float* dsink, const float* dout, const float* out,
                         const float* lse, const float* q, const float* const* rows, const int64_t* offsets,
                         const float* sink, const SparseMqaDims& d) {
  check(rows, offsets, sink, d);
  const int64_t H = d.heads, D = d.dim;
  std::vector<float> K, P, dP, dK, Dh(static_cast<size_t>(H));
  // Query by query in order: the key gradients of queries that share keys
  // add up in one fixed order; each query's products use every thread.
  for (int64_t i = 0; i < d.queries; ++i) {
    const int64_t n = offsets[i + 1] - offsets[i];
    const float* qi = q + i * H * D;
    const float* gi = dout + i * H * D;
    for (int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (int64_t c = 0; c < D; ++c) acc += static_cast<double>(gi[h * D + c]) * out[(i * H + h) * D + c];
      Dh[static_cast<size_t>(h)] = static_cast<float>(acc);
      if (sink && dsink) dsink[h] -= std::exp(sink[h] - lse[i * H + h]) * Dh[static_cast<size_t>(h)];
    }
    if (n == 0) {
      std::fill(dq + i * H * D, dq + (i + 1) * H * D, 0.0f);
      continue;
    }
    gather(K, rows + offsets[i], n, D);
    P.resize(static_cast<size_t>(H * n));
    dP.resize(static_cast<size_t>(H * n));
    gemm(false, true, H, n, D, d.scale, qi, D, K.data(), D, 0.0f, P.data(), n);
    gemm(false, true, H, n, D, 1.0f, gi, D, K.data(), D, 0.0f, dP.data(), n);
    for (int64_t h = 0; h < H; ++h) {
      const float l = lse[i * H + h], Dv = Dh[static_cast<size_t>(h)];
      for (int64_t j = 0; j < n; ++j) {
        const int64_t k = h * n + j;
        P[k] = std::exp(P[k] - l);
        dP[k] = P[k] * (dP[k] - Dv);  // ds
      }
    }
    gemm(false, false, H, D, n, d.scale, dP.data(), n, K.data(), D, 0.0f, dq + i * H * D, D);
    if (!drows) continue;
    dK.resize(static_cast<size_t>(n * D));
    gemm(true, false, n, D, H, d.scale, dP.data(), n, qi, D, 0.0f, dK.data(), D);
    gemm(true, false, n, D, H, 1.0f, P.data(), n, gi, D, 1.0f, dK.data(), D);
    for (int64_t j = 0; j < n; ++j) {
      float* dst = drows[offsets[i] + j];
      const float* src = dK.data() + j * D;
      for (int64_t c = 0; c < D; ++c) dst[c] += src[c];
    }
  }
}

}  // namespace ds::ops
