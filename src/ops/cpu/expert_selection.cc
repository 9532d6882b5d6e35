#include "ops/expert_selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace ds::ops {

namespace {

void check_config(const ExpertSelectionConfig& c, int64_t tokens) {
  DS_CHECK(tokens >= 0 && c.num_experts > 0 && c.k >= 1 && c.k <= c.num_experts,
           "expert_selection: tokens={} num_experts={} k={}", tokens, c.num_experts, c.k);
  if (c.group_score != GroupScore::None) {
    DS_CHECK(c.n_group >= 1 && c.num_experts % c.n_group == 0 && c.topk_group >= 1 && c.topk_group <= c.n_group,
             "expert_selection: n_group={} topk_group={} for {} experts", c.n_group, c.topk_group, c.num_experts);
    DS_CHECK(c.topk_group * (c.num_experts / c.n_group) >= c.k,
             "expert_selection: {} groups of {} experts cannot supply k={}", c.topk_group, c.num_experts / c.n_group,
             c.k);
    DS_CHECK(c.group_score != GroupScore::Top2Sum || c.num_experts / c.n_group >= 2,
             "expert_selection: top-2 group scores need groups of at least 2 experts");
  }
}

// Indices of the k largest values of v[0..n), descending, ties to the lower
// index. n is small (experts or groups), so a partial sort is fine.
void top_indices(int32_t* out, const float* v, int64_t n, int64_t k, std::vector<int32_t>& idx) {
  idx.resize(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = static_cast<int32_t>(i);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [v](int32_t a, int32_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + k, out);
}

// The top-k experts of one token by its biased scores, within the best
// groups when the config limits them.
void select_one(int32_t* ex, const float* s, const float* bias, const ExpertSelectionConfig& cfg,
                std::vector<float>& choice, std::vector<float>& gscore, std::vector<int32_t>& idx,
                std::vector<int32_t>& gsel) {
  const int64_t E = cfg.num_experts;
  for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + (bias ? bias[e] : 0.0f);
  if (cfg.group_score != GroupScore::None && cfg.topk_group < cfg.n_group) {
    const int64_t per = E / cfg.n_group;
    for (int64_t g = 0; g < cfg.n_group; ++g) {
      const float* c = choice.data() + g * per;
      float a = -std::numeric_limits<float>::infinity(), b = a;  // the two largest
      for (int64_t i = 0; i < per; ++i) {
        if (c[i] > a) { b = a; a = c[i]; }
        else if (c[i] > b) b = c[i];
      }
      gscore[g] = cfg.group_score == GroupScore::Top2Sum ? a + b : a;
    }
    top_indices(gsel.data(), gscore.data(), cfg.n_group, cfg.topk_group, idx);
    std::vector<bool> keep(cfg.n_group, false);
    for (int32_t g : gsel) keep[g] = true;
    for (int64_t g = 0; g < cfg.n_group; ++g)
      if (!keep[g])
        for (int64_t i = 0; i < per; ++i) choice[g * per + i] = -std::numeric_limits<float>::infinity();
  }
  top_indices(ex, choice.data(), E, cfg.k, idx);
}

}  // namespace

void expert_selection_forward(int32_t* experts, float* weights, float* scores, const float* logits,
                              const float* bias, int64_t tokens, const ExpertSelectionConfig& cfg,
                              const int32_t* fixed) {
  check_config(cfg, tokens);
  const int64_t E = cfg.num_experts, K = cfg.k;
  if (fixed)
    for (int64_t i = 0; i < tokens * K; ++i)
      DS_CHECK(fixed[i] >= 0 && fixed[i] < E, "expert_selection: fixed expert id {} outside [0, {})", fixed[i], E);
  // Parallel from a few dozen tokens: a token's scores and selection take
  // about as long as starting a thread team.
  parallel_ranges(tokens, tokens * E >= 512, [&](int64_t t0, int64_t t1) {
    std::vector<float> choice(E), gscore(cfg.n_group);
    std::vector<int32_t> idx, gsel(cfg.topk_group);
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = logits + t * E;
      float* s = scores + t * E;
      if (cfg.scoring == ExpertScoring::Sigmoid) {
        for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-l[e]));
      } else if (cfg.scoring == ExpertScoring::SqrtSoftplus) {
        // softplus without overflow: max(l, 0) + log1p(exp(-|l|)).
        for (int64_t e = 0; e < E; ++e)
          s[e] = std::sqrt(std::max(l[e], 0.0f) + std::log1p(std::exp(-std::fabs(l[e]))));
      } else {
        float m = l[0];
        for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
        double z = 0;
        for (int64_t e = 0; e < E; ++e) z += std::exp(static_cast<double>(l[e] - m));
        for (int64_t e = 0; e < E; ++e) s[e] = static_cast<float>(std::exp(static_cast<double>(l[e] - m)) / z);
      }
      int32_t* ex = experts + t * K;
      float* w = weights + t * K;
      if (fixed) {
        std::copy(fixed + t * K, fixed + (t + 1) * K, ex);
      } else {
        select_one(ex, s, bias, cfg, choice, gscore, idx, gsel);
      }
      double sum = 0;
      for (int64_t j = 0; j < K; ++j) sum += s[ex[j]];
      for (int64_t j = 0; j < K; ++j) {
        const double wj = cfg.norm_topk_prob ? s[ex[j]] / sum : s[ex[j]];
        w[j] = static_cast<float>(wj * cfg.routed_scaling_factor);
      }
    }
  });
}

void expert_selection_backward(float* dlogits, const float* dweights, const float* scores, const int32_t* experts,
                               int64_t tokens, const ExpertSelectionConfig& cfg) {
  check_config(cfg, tokens);
  const int64_t E = cfg.num_experts, K = cfg.k;
  const double scale = cfg.routed_scaling_factor;
#pragma omp parallel if (tokens * E >= 4096)
  {
    std::vector<double> ds(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const float* s = scores + t * E;
      const int32_t* ex = experts + t * K;
      const float* g = dweights + t * K;
      std::fill(ds.begin(), ds.end(), 0.0);
      if (cfg.norm_topk_prob) {
        double S = 0, gw = 0;
        for (int64_t j = 0; j < K; ++j) S += s[ex[j]];
        for (int64_t j = 0; j < K; ++j) gw += g[j] * (scale * s[ex[j]] / S);  // sum_j g_j w_j
        for (int64_t j = 0; j < K; ++j) ds[ex[j]] += (scale * g[j] - gw) / S;
      } else {
        for (int64_t j = 0; j < K; ++j) ds[ex[j]] += scale * g[j];
      }
      float* dl = dlogits + t * E;
      if (cfg.scoring == ExpertScoring::Sigmoid) {
        for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(ds[e] * s[e] * (1.0 - s[e]));
      } else if (cfg.scoring == ExpertScoring::SqrtSoftplus) {
        // d sqrt(softplus(l)) / dl = sigmoid(l) / (2 s) (s > 0 always), with
        // sigmoid(l) = 1 - exp(-softplus(l)) = 1 - exp(-s^2) from the saved scores.
        for (int64_t e = 0; e < E; ++e) {
          const double sp = static_cast<double>(s[e]) * s[e];
          dl[e] = static_cast<float>(ds[e] * -std::expm1(-sp) / (2.0 * s[e]));
        }
      } else {
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += ds[e] * s[e];
        for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(s[e] * (ds[e] - dot));
      }
    }
  }
}

void expert_load(int64_t* load, const int32_t* experts, int64_t tokens, int64_t k, int64_t num_experts) {
  std::fill(load, load + num_experts, 0);
  for (int64_t i = 0; i < tokens * k; ++i) {
    DS_CHECK(experts[i] >= 0 && experts[i] < num_experts, "expert_load: expert id {} outside [0, {})", experts[i],
             num_experts);
    ++load[experts[i]];
  }
}

void update_routing_bias(float* bias, const int64_t* load, int64_t num_experts, float rate) {
  double mean = 0;
  for (int64_t e = 0; e < num_experts; ++e) mean += static_cast<double>(load[e]);
  mean /= static_cast<double>(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    const double d = mean - static_cast<double>(load[e]);
    bias[e] += rate * static_cast<float>((d > 0) - (d < 0));
  }
}

}  // namespace ds::ops
