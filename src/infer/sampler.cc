#include "infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace ds::infer {

void check_sampler(const SamplerConfig& c) {
  DS_CHECK(std::isfinite(c.temperature) && c.temperature >= 0.0f, "temperature must be >= 0, got {}", c.temperature);
  DS_CHECK(c.top_k >= 0, "top-k must be >= 0, got {}", c.top_k);
  DS_CHECK(c.top_p > 0.0f && c.top_p <= 1.0f, "top-p must be in (0, 1], got {}", c.top_p);
}

int32_t sample_token(const float* logits, int64_t vocab, const SamplerConfig& c, uint64_t sequence, uint64_t step) {
  DS_CHECK(vocab > 0, "sampling from an empty vocabulary");
  if (c.temperature <= 0.0f) {
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  // Candidates sorted by logit (descending, ties to the lower id), cut to top-k.
  std::vector<int32_t> idx(vocab);
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t k = c.top_k > 0 ? std::min<int64_t>(c.top_k, vocab) : vocab;
  auto cmp = [logits](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), cmp);
  idx.resize(k);
  std::vector<double> p(k);
  const double mx = logits[idx[0]];
  double z = 0;
  for (int64_t i = 0; i < k; ++i) z += p[i] = std::exp((logits[idx[i]] - mx) / c.temperature);
  // Nucleus: the smallest prefix whose probability reaches top_p.
  int64_t keep = k;
  if (c.top_p < 1.0f) {
    double cum = 0;
    for (int64_t i = 0; i < k; ++i) {
      cum += p[i] / z;
      if (cum >= c.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double zk = 0;
  for (int64_t i = 0; i < keep; ++i) zk += p[i];
  const double u = Philox(c.seed, sequence).uniform(step) * zk;
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (u < acc) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace ds::infer
