// The DSA indexer's training pieces; see ops/indexer.h. The dot products
// are gemms over blocks of queries (ops::gemm never splits a reduction);
// the rest are loops over [B, T, T] maps with each query row one OpenMP
// task, so every sum keeps one order for any thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "ops/indexer.h"
#include "ops/matmul.h"

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

void check_dims(int64_t B, int64_t T, int64_t heads, int64_t d, const char* what) {
  DS_CHECK(B >= 0 && T >= 0 && heads >= 1 && d >= 1, "{}: batch {} x {} tokens, {} heads of {}", what, B, T, heads, d);
}

}  // namespace

namespace {

// Query rows per block: the block's head-by-key dot products [rows H, T]
// stay within about 16 MiB.
int64_t query_block(int64_t heads, int64_t T) {
  return std::clamp<int64_t>((int64_t{1} << 22) / std::max<int64_t>(1, heads * T), 1, std::max<int64_t>(T, 1));
}

// f(b, t0, nt, dots) for every block of nt queries from t0 of row b, with
// dots [nt heads, T] = the block's queries (every head) times the row's
// keys, one gemm.
template <typename F>
void for_query_blocks(const float* q, const float* k, int64_t B, int64_t T, int64_t heads, int64_t d, F&& f) {
  const int64_t tq = query_block(heads, T);
  std::vector<float> dots(static_cast<size_t>(tq * heads * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 < T; t0 += tq) {
      const int64_t nt = std::min(tq, T - t0);
      gemm(false, true, nt * heads, T, d, 1.0f, q + (b * T + t0) * heads * d, d, k + b * T * d, d, 0.0f, dots.data(),
           T);
      f(b, t0, nt, dots.data());
    }
}

}  // namespace

void indexer_dense_scores(float* scores, const float* q, const float* k, const float* w, const int32_t* seg, int64_t B,
                          int64_t T, int64_t heads, int64_t d) {
  check_dims(B, T, heads, d, "indexer_dense_scores");
  const Visibility vis{seg, T};
  const float ninf = -std::numeric_limits<float>::infinity();
  for_query_blocks(q, k, B, T, heads, d, [&](int64_t b, int64_t t0, int64_t nt, const float* dots) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nt; ++r) {
      const int64_t t = t0 + r, n = b * T + t;
      float* row = scores + n * T;
      for (int64_t s = 0; s < T; ++s) {
        if (!vis(b, t, s)) {
          row[s] = ninf;
          continue;
        }
        float acc = 0;
        for (int64_t h = 0; h < heads; ++h) acc += w[n * heads + h] * std::max(0.0f, dots[(r * heads + h) * T + s]);
        row[s] = acc;
      }
    }
  });
}

void indexer_dense_scores_backward(float* dq, float* dk, float* dw, const float* dscores, const float* q,
                                   const float* k, const float* w, const int32_t* seg, int64_t B, int64_t T,
                                   int64_t heads, int64_t d) {
  check_dims(B, T, heads, d, "indexer_dense_scores_backward");
  const Visibility vis{seg, T};
  for_query_blocks(q, k, B, T, heads, d, [&](int64_t b, int64_t t0, int64_t nt, float* dots) {
  // dots -> dD[t, h, s] = dscores[t, s] w[t, h] [dot > 0] (visible s),
  // and dw[t, h] = sum_s dscores[t, s] ReLU(dot).
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nt; ++r) {
      const int64_t t = t0 + r, n = b * T + t;
      const float* g = dscores + n * T;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = dots + (r * heads + h) * T;
        const float wh = w[n * heads + h];
        double acc = 0;
        for (int64_t s = 0; s < T; ++s) {
          const bool on = x[s] > 0 && vis(b, t, s);
          if (on) acc += static_cast<double>(g[s]) * x[s];
          x[s] = on ? g[s] * wh : 0.0f;
        }
        dw[n * heads + h] = static_cast<float>(acc);
      }
    }
    // dq (rows t0..) = dD k; dk += dD^T q, the blocks summed in order.
    gemm(false, false, nt * heads, d, T, 1.0f, dots, T, k + b * T * d, d, 0.0f, dq + (b * T + t0) * heads * d, d);
    gemm(true, false, T, d, nt * heads, 1.0f, dots, T, q + (b * T + t0) * heads * d, d, t0 == 0 ? 0.0f : 1.0f,
         dk + b * T * d, d);
  });
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
  const int64_t tq = query_block(1, T), ld = heads * dk;
  std::vector<float> logits(static_cast<size_t>(tq * T));
  std::vector<double> acc(static_cast<size_t>(tq * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 < T; t0 += tq) {
      const int64_t nt = std::min(tq, T - t0);
      std::fill(acc.begin(), acc.begin() + nt * T, 0.0);
      for (int64_t h = 0; h < heads; ++h) {
        // logits [nt, T] = scale q_h k_h^T for queries t0.. of row b.
        gemm(false, true, nt, T, dk, scale, q + ((b * T + t0) * heads + h) * dk, ld, k + (b * T * heads + h) * dk, ld,
             0.0f, logits.data(), T);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < nt; ++r) {
          const int64_t t = t0 + r, n = b * T + t;
          const float* x = logits.data() + r * T;
          auto in = [&](int64_t s) { return vis(b, t, s) && (!selected || selected[n * T + s]); };
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t s = 0; s <= t; ++s)
            if (in(s)) mx = std::max(mx, static_cast<double>(x[s]));
          double z = 0;
          for (int64_t s = 0; s <= t; ++s)
            if (in(s)) z += std::exp(x[s] - mx);
          double* a = acc.data() + r * T;
          for (int64_t s = 0; s <= t; ++s)
            if (in(s)) a[s] += std::exp(x[s] - mx) / z;
        }
      }
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < nt; ++r) {
        const double* a = acc.data() + r * T;
        double l1 = 0;
        for (int64_t s = 0; s < T; ++s) l1 += a[s];
        float* out = target + (b * T + t0 + r) * T;
        for (int64_t s = 0; s < T; ++s) out[s] = l1 > 0 ? static_cast<float>(a[s] / l1) : 0.0f;
      }
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
