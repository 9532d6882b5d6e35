#include "model/v4_balance.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace ds::model {

namespace {

// Per row: its token count, and f (hits / T_b).
struct RowStats {
  std::vector<int64_t> count;
  std::vector<double> f;  // [rows, E]
};

RowStats row_stats(const int32_t* experts, const V4BalanceRows& rows, int64_t E, int64_t K) {
  int64_t B = 0;
  for (int64_t r : rows.row_of) B = std::max(B, r + 1);
  DS_CHECK(rows.whole_rows >= B, "internal: balance loss over {} rows of a batch of {}", B, rows.whole_rows);
  RowStats s;
  s.count.assign(static_cast<size_t>(B), 0);
  s.f.assign(static_cast<size_t>(B * E), 0.0);
  const int64_t N = static_cast<int64_t>(rows.row_of.size());
  for (int64_t t = 0; t < N; ++t) {
    const int64_t b = rows.row_of[static_cast<size_t>(t)];
    ++s.count[static_cast<size_t>(b)];
    for (int64_t j = 0; j < K; ++j) s.f[static_cast<size_t>(b * E + experts[t * K + j])] += 1.0;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t e = 0; e < E; ++e)
      if (s.count[static_cast<size_t>(b)] > 0)
        s.f[static_cast<size_t>(b * E + e)] /= static_cast<double>(s.count[static_cast<size_t>(b)]);
  return s;
}

// p = softmax(scores[t] + bias).
void probs(std::vector<double>& p, const float* scores, const float* bias, int64_t t, int64_t E) {
  double mx = -INFINITY, z = 0;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double(scores[t * E + e]) + (bias ? bias[e] : 0.0));
  for (int64_t e = 0; e < E; ++e)
    z += (p[static_cast<size_t>(e)] = std::exp(double(scores[t * E + e]) + (bias ? bias[e] : 0.0) - mx));
  for (double& v : p) v /= z;
}

}  // namespace

double v4_balance_loss(const float* scores, const int32_t* experts, const float* bias, const V4BalanceRows& rows,
                       int64_t E, int64_t K, double weight) {
  const RowStats s = row_stats(experts, rows, E, K);
  const int64_t N = static_cast<int64_t>(rows.row_of.size());
  std::vector<double> p(static_cast<size_t>(E));
  double total = 0;
  for (int64_t t = 0; t < N; ++t) {
    const int64_t b = rows.row_of[static_cast<size_t>(t)];
    probs(p, scores, bias, t, E);
    const double inv = 1.0 / static_cast<double>(s.count[static_cast<size_t>(b)]);
    for (int64_t e = 0; e < E; ++e) total += s.f[static_cast<size_t>(b * E + e)] * p[static_cast<size_t>(e)] * inv;
  }
  return weight * static_cast<double>(E) / static_cast<double>(rows.whole_rows) * total;
}

void v4_balance_loss_backward(float* dlogits, const float* scores, const int32_t* experts, const float* bias,
                              const V4BalanceRows& rows, int64_t E, int64_t K, double weight, double dloss) {
  const RowStats s = row_stats(experts, rows, E, K);
  const int64_t N = static_cast<int64_t>(rows.row_of.size());
  std::vector<double> p(static_cast<size_t>(E));
  for (int64_t t = 0; t < N; ++t) {
    const int64_t b = rows.row_of[static_cast<size_t>(t)];
    // dL/dp_e = c f_e, then the softmax's backward to the scores (the bias
    // is a constant), then s = sqrt(softplus(l)): ds/dl = sigmoid(l) / 2s
    // = (1 - exp(-s^2)) / 2s, which tends to s/2 as s -> 0.
    const double c = dloss * weight * static_cast<double>(E) / static_cast<double>(rows.whole_rows) /
                     static_cast<double>(s.count[static_cast<size_t>(b)]);
    probs(p, scores, bias, t, E);
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += c * s.f[static_cast<size_t>(b * E + e)] * p[static_cast<size_t>(e)];
    for (int64_t e = 0; e < E; ++e) {
      const double ds = p[static_cast<size_t>(e)] * (c * s.f[static_cast<size_t>(b * E + e)] - dot);
      const double sc = scores[t * E + e];
      const double dsdl = sc > 1e-6 ? -std::expm1(-sc * sc) / (2.0 * sc) : sc / 2.0;
      dlogits[t * E + e] += static_cast<float>(ds * dsdl);
    }
  }
}

}  // namespace ds::model
