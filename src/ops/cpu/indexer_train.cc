// The DSA indexer's training pieces; see ops/indexer.h. Plain loops over
// [B, T, T] maps, each query (or key) row one OpenMP task, so the sums keep
// one order for any thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "ops/indexer.h"

namespace ds::ops {

namespace {

constexpr double kKlEps = 1e-8;

struct Visibility {
  const int32_t* seg;
  int64_t T;
  bool operator()(int64_t b, int64_t t, int64_t s) const {
    return s <= t && (!seg || seg[b * T + s] == seg[b * T + t]);
  }
};

float dot(const float* a, const float* b, int64_t d) {
  float acc = 0;
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

void check_dims(int64_t B, int64_t T, int64_t heads, int64_t d, const char* what) {
  DS_CHECK(B >= 0 && T >= 0 && heads >= 1 && d >= 1, "{}: batch {} x {} tokens, {} heads of {}", what, B, T, heads, d);
}

}  // namespace

void layer_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w, int64_t rows,
                         int64_t d, float eps) {
  std::vector<double> gw(static_cast<size_t>(d), 0.0), gb(static_cast<size_t>(d), 0.0);
  std::vector<double> xhat(static_cast<size_t>(d));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const float* g = dy + r * d;
    double mean = 0;
    for (int64_t j = 0; j < d; ++j) mean += xr[j];
    mean /= static_cast<double>(d);
    double var = 0;
    for (int64_t j = 0; j < d; ++j) var += (xr[j] - mean) * (xr[j] - mean);
    var /= static_cast<double>(d);
    const double rstd = 1.0 / std::sqrt(var + eps);
    double m1 = 0, m2 = 0;  // means of dxhat and dxhat * xhat
    for (int64_t j = 0; j < d; ++j) {
      xhat[j] = (xr[j] - mean) * rstd;
      const double dxh = static_cast<double>(g[j]) * w[j];
      m1 += dxh;
      m2 += dxh * xhat[j];
      gw[j] += static_cast<double>(g[j]) * xhat[j];
      gb[j] += g[j];
    }
    m1 /= static_cast<double>(d);
    m2 /= static_cast<double>(d);
    if (dx)
      for (int64_t j = 0; j < d; ++j)
        dx[r * d + j] = static_cast<float>(rstd * (static_cast<double>(g[j]) * w[j] - m1 - xhat[j] * m2));
  }
  for (int64_t j = 0; j < d; ++j) {
    if (dw) dw[j] += static_cast<float>(gw[j]);
    if (db) db[j] += static_cast<float>(gb[j]);
  }
}

void indexer_dense_scores(float* scores, const float* q, const float* k, const float* w, const int32_t* seg, int64_t B,
                          int64_t T, int64_t heads, int64_t d) {
  check_dims(B, T, heads, d, "indexer_dense_scores");
  const Visibility vis{seg, T};
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * T; ++n) {
    const int64_t b = n / T, t = n % T;
    float* row = scores + n * T;
    for (int64_t s = 0; s < T; ++s) {
      if (!vis(b, t, s)) {
        row[s] = ninf;
        continue;
      }
      const float* ks = k + (b * T + s) * d;
      float acc = 0;
      for (int64_t h = 0; h < heads; ++h) acc += w[n * heads + h] * std::max(0.0f, dot(q + (n * heads + h) * d, ks, d));
      row[s] = acc;
    }
  }
}

void indexer_dense_scores_backward(float* dq, float* dk, float* dw, const float* dscores, const float* q,
                                   const float* k, const float* w, const int32_t* seg, int64_t B, int64_t T,
                                   int64_t heads, int64_t d) {
  check_dims(B, T, heads, d, "indexer_dense_scores_backward");
  const Visibility vis{seg, T};
  // Queries: dq and dw of token t from its row of dscores.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * T; ++n) {
    const int64_t b = n / T, t = n % T;
    float* dqn = dq + n * heads * d;
    std::fill(dqn, dqn + heads * d, 0.0f);
    std::fill(dw + n * heads, dw + (n + 1) * heads, 0.0f);
    for (int64_t s = 0; s <= t; ++s) {
      const float g = dscores[n * T + s];
      if (g == 0.0f || !vis(b, t, s)) continue;
      const float* ks = k + (b * T + s) * d;
      for (int64_t h = 0; h < heads; ++h) {
        const float x = dot(q + (n * heads + h) * d, ks, d);
        if (x <= 0) continue;
        dw[n * heads + h] += g * x;
        const float c = g * w[n * heads + h];
        for (int64_t i = 0; i < d; ++i) dqn[h * d + i] += c * ks[i];
      }
    }
  }
  // Keys: dk of token s from its column (every later query of its segment).
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < B * T; ++m) {
    const int64_t b = m / T, s = m % T;
    float* dks = dk + m * d;
    std::fill(dks, dks + d, 0.0f);
    for (int64_t t = s; t < T; ++t) {
      const int64_t n = b * T + t;
      const float g = dscores[n * T + s];
      if (g == 0.0f || !vis(b, t, s)) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q + (n * heads + h) * d;
        if (dot(qh, k + m * d, d) <= 0) continue;
        const float c = g * w[n * heads + h];
        for (int64_t i = 0; i < d; ++i) dks[i] += c * qh[i];
      }
    }
  }
}

void indexer_select(uint8_t* selected, const float* scores, int64_t B, int64_t T, int64_t k) {
  DS_CHECK(k >= 1, "indexer_select: top-{} keys", k);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * T; ++n) {
    const float* row = scores + n * T;
    uint8_t* out = selected + n * T;
    std::fill(out, out + T, uint8_t{0});
    // The visible keys in order (their scores are finite), compacted.
    std::vector<float> vals;
    std::vector<int32_t> at, picked(static_cast<size_t>(std::min(k, T)));
    for (int64_t s = 0; s < T; ++s)
      if (row[s] != -std::numeric_limits<float>::infinity()) {
        vals.push_back(row[s]);
        at.push_back(static_cast<int32_t>(s));
      }
    const int64_t m = topk_indices(picked.data(), vals.data(), static_cast<int64_t>(vals.size()), k);
    for (int64_t i = 0; i < m; ++i) out[at[picked[i]]] = 1;
  }
}

void attention_key_distribution(float* target, const float* q, const float* k, const int32_t* seg,
                                const uint8_t* selected, int64_t B, int64_t T, int64_t heads, int64_t dk, float scale) {
  check_dims(B, T, heads, dk, "attention_key_distribution");
  const Visibility vis{seg, T};
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * T; ++n) {
    const int64_t b = n / T, t = n % T;
    float* out = target + n * T;
    std::vector<double> acc(static_cast<size_t>(T), 0.0), logit(static_cast<size_t>(T));
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + (n * heads + h) * dk;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t s = 0; s <= t; ++s) {
        if (!vis(b, t, s) || (selected && !selected[n * T + s])) continue;
        logit[s] = static_cast<double>(scale) * dot(qh, k + ((b * T + s) * heads + h) * dk, dk);
        mx = std::max(mx, logit[s]);
      }
      double z = 0;
      for (int64_t s = 0; s <= t; ++s)
        if (vis(b, t, s) && (!selected || selected[n * T + s])) z += std::exp(logit[s] - mx);
      for (int64_t s = 0; s <= t; ++s)
        if (vis(b, t, s) && (!selected || selected[n * T + s])) acc[s] += std::exp(logit[s] - mx) / z;
    }
    double l1 = 0;
    for (int64_t s = 0; s < T; ++s) l1 += acc[s];
    for (int64_t s = 0; s < T; ++s) out[s] = l1 > 0 ? static_cast<float>(acc[s] / l1) : 0.0f;
  }
}

double indexer_kl(float* dscores, const float* scores, const float* target, const uint8_t* selected, int64_t B,
                  int64_t T, double dloss) {
  std::vector<double> per(static_cast<size_t>(B * T), 0.0);
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * T; ++n) {
    const float* row = scores + n * T;
    const float* tg = target + n * T;
    float* d = dscores + n * T;
    auto in = [&](int64_t s) { return row[s] != ninf && (!selected || selected[n * T + s]); };
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t s = 0; s < T; ++s)
      if (in(s)) mx = std::max(mx, static_cast<double>(row[s]));
    double z = 0;
    for (int64_t s = 0; s < T; ++s)
      if (in(s)) z += std::exp(row[s] - mx);
    // pred, the loss, and g = dL/dpred = -target / (pred + eps).
    std::vector<double> pred(static_cast<size_t>(T), 0.0);
    double loss = 0, pg = 0;
    for (int64_t s = 0; s < T; ++s) {
      if (!in(s)) continue;
      pred[s] = std::exp(row[s] - mx) / z;
      loss += tg[s] * (std::log(tg[s] + kKlEps) - std::log(pred[s] + kKlEps));
      pg += pred[s] * (-tg[s] / (pred[s] + kKlEps));
    }
    for (int64_t s = 0; s < T; ++s)
      d[s] = in(s) ? static_cast<float>(dloss * pred[s] * (-tg[s] / (pred[s] + kKlEps) - pg)) : 0.0f;
    per[n] = loss;
  }
  double sum = 0;
  for (double v : per) sum += v;
  return sum;
}

}  // namespace ds::ops
