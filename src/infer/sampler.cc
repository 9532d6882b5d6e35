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

namespace {

int32_t argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int32_t>(best);
}

// The ids a draw can take (sorted by logit, descending, ties to the lower
// id; cut to top-k and to the nucleus) and their unnormalised weights.
struct Candidates {
  std::vector<int32_t> idx;
  std::vector<double> p;
  double z = 0;  // sum of p
};
Candidates candidates(const float* logits, int64_t vocab, const SamplerConfig& c) {
  Candidates out;
  std::vector<int32_t>& idx = out.idx;
  idx.resize(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t k = c.top_k > 0 ? std::min<int64_t>(c.top_k, vocab) : vocab;
  auto cmp = [logits](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), cmp);
  idx.resize(static_cast<size_t>(k));
  std::vector<double>& p = out.p;
  p.resize(static_cast<size_t>(k));
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
  idx.resize(static_cast<size_t>(keep));
  p.resize(static_cast<size_t>(keep));
  for (int64_t i = 0; i < keep; ++i) out.z += p[i];
  return out;
}

}  // namespace

int32_t sample_token(const float* logits, int64_t vocab, const SamplerConfig& c, uint64_t sequence, uint64_t step) {
  DS_CHECK(vocab > 0, "sampling from an empty vocabulary");
  if (c.temperature <= 0.0f) return argmax(logits, vocab);
  const Candidates k = candidates(logits, vocab, c);
  const double u = Philox(c.seed, sequence).uniform(step) * k.z;
  double acc = 0;
  for (size_t i = 0; i < k.idx.size(); ++i) {
    acc += k.p[i];
    if (u < acc) return k.idx[i];
  }
  return k.idx.back();
}

std::vector<double> sampling_probs(const float* logits, int64_t vocab, const SamplerConfig& c) {
  DS_CHECK(vocab > 0, "sampling from an empty vocabulary");
  std::vector<double> out(static_cast<size_t>(vocab), 0.0);
  if (c.temperature <= 0.0f) {
    out[static_cast<size_t>(argmax(logits, vocab))] = 1.0;
    return out;
  }
  const Candidates k = candidates(logits, vocab, c);
  for (size_t i = 0; i < k.idx.size(); ++i) out[static_cast<size_t>(k.idx[i])] = k.p[i] / k.z;
  return out;
}

int32_t draw_from(const std::vector<double>& probs, double u) {
  double total = 0;
  for (double p : probs) total += p;
  DS_CHECK(total > 0, "drawing from a distribution with no mass");
  const double x = u * total;
  double acc = 0;
  int32_t last = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) continue;
    acc += probs[i];
    last = static_cast<int32_t>(i);
    if (x < acc) return last;
  }
  return last;
}

void check_adjust(const LogitAdjust& a, int64_t vocab) {
  DS_CHECK(a.presence >= -2.0f && a.presence <= 2.0f, "presence penalty must be in [-2, 2], got {}", a.presence);
  DS_CHECK(a.frequency >= -2.0f && a.frequency <= 2.0f, "frequency penalty must be in [-2, 2], got {}", a.frequency);
  DS_CHECK(std::isfinite(a.repetition) && a.repetition > 0.0f, "repetition penalty must be > 0, got {}", a.repetition);
  for (const auto& [id, b] : a.bias) {
    DS_CHECK(id >= 0 && id < vocab, "logit bias on token {}, outside the vocabulary [0, {})", id, vocab);
    DS_CHECK(b >= -100.0f && b <= 100.0f, "logit bias {} on token {} outside [-100, 100]", b, id);
  }
}

void adjust_logits(float* logits, int64_t vocab, const LogitAdjust& a, const TokenHistory& seen) {
  const bool counts = a.presence != 0.0f || a.frequency != 0.0f;
  if (a.repetition != 1.0f || counts) {
    for (const auto& [id, s] : seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = logits[id];
      if (a.repetition != 1.0f) l = l > 0.0f ? l / a.repetition : l * a.repetition;
      if (counts && s.count > 0) l -= static_cast<float>(s.count) * a.frequency + a.presence;
    }
  }
  for (const auto& [id, b] : a.bias)
    if (id >= 0 && id < vocab) logits[id] += b;
}

TokenLogprob token_logprob(const float* logits, int64_t vocab, int32_t id, int64_t top, int64_t top_vocab) {
  DS_CHECK(vocab > 0 && id >= 0 && id < vocab, "log-probability of token {} outside the vocabulary [0, {})", id, vocab);
  float mx = logits[0];
  for (int64_t i = 1; i < vocab; ++i) mx = std::max(mx, logits[i]);
  double z = 0;
  for (int64_t i = 0; i < vocab; ++i) z += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(z);
  TokenLogprob out;
  out.logprob = static_cast<float>(logits[id] - lse);
  top = std::clamp<int64_t>(top, 0, kMaxTopLogprobs);
  top_vocab = std::min(top_vocab, vocab);
  if (top == 0 || top_vocab <= 0) return out;
  // The best `top` ids so far, most likely first (a short insertion list).
  std::pair<int32_t, float> best[kMaxTopLogprobs];
  int64_t n = 0;
  for (int64_t i = 0; i < top_vocab; ++i) {
    const float l = logits[i];
    if (n == top && !(l > best[n - 1].second)) continue;
    int64_t j = n < top ? n++ : n - 1;
    while (j > 0 && l > best[j - 1].second) {
      best[j] = best[j - 1];
      --j;
    }
    best[j] = {static_cast<int32_t>(i), l};
  }
  for (int64_t i = 0; i < n; ++i) out.top.emplace_back(best[i].first, static_cast<float>(best[i].second - lse));
  return out;
}

}  // namespace ds::infer
