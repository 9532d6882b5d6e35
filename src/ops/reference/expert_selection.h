// Scalar reference for ops/expert_selection.h, written the way DeepSeek's
// inference code reads: full sorts, explicit masks, templated on the scalar.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "ops/expert_selection.h"

namespace ds::ref {

template <typename T>
struct Selection {
  std::vector<int32_t> experts;  // [T, k]
  std::vector<T> weights;        // [T, k]
};

// Indices sorted by value descending, ties to the lower index (stable sort).
template <typename T>
std::vector<int32_t> argsort_desc(const std::vector<T>& v) {
  std::vector<int32_t> i(v.size());
  std::iota(i.begin(), i.end(), 0);
  std::stable_sort(i.begin(), i.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
  return i;
}

template <typename T>
std::vector<T> expert_scores(const std::vector<T>& l, ops::ExpertScoring scoring) {
  std::vector<T> s(l.size());
  if (scoring == ops::ExpertScoring::Sigmoid) {
    for (size_t e = 0; e < l.size(); ++e) s[e] = T(1) / (T(1) + std::exp(-l[e]));
  } else if (scoring == ops::ExpertScoring::SqrtSoftplus) {
    for (size_t e = 0; e < l.size(); ++e) s[e] = std::sqrt(std::log(T(1) + std::exp(l[e])));
  } else {
    T m = *std::max_element(l.begin(), l.end()), z = 0;
    for (size_t e = 0; e < l.size(); ++e) z += std::exp(l[e] - m);
    for (size_t e = 0; e < l.size(); ++e) s[e] = std::exp(l[e] - m) / z;
  }
  return s;
}

// Selects with fixed `forced` experts when given (for finite differences that
// must not change the selection), otherwise by the rules of the header.
template <typename T>
Selection<T> expert_selection(const std::vector<T>& logits, const std::vector<float>* bias, int64_t tokens,
                              const ops::ExpertSelectionConfig& c, const std::vector<int32_t>* forced = nullptr) {
  const int64_t E = c.num_experts, K = c.k;
  Selection<T> out;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<T> l(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    std::vector<T> s = expert_scores(l, c.scoring);
    std::vector<int32_t> chosen;
    if (forced) {
      chosen.assign(forced->begin() + t * K, forced->begin() + (t + 1) * K);
    } else {
      std::vector<T> choice(E);
      for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + (bias ? T((*bias)[e]) : T(0));
      if (c.group_score != ops::GroupScore::None) {
        const int64_t per = E / c.n_group;
        std::vector<T> gs(c.n_group);
        for (int64_t g = 0; g < c.n_group; ++g) {
          std::vector<T> member(choice.begin() + g * per, choice.begin() + (g + 1) * per);
          std::sort(member.begin(), member.end(), std::greater<T>());
          gs[g] = c.group_score == ops::GroupScore::Top2Sum ? member[0] + member[1] : member[0];
        }
        auto order = argsort_desc(gs);
        for (int64_t r = c.topk_group; r < c.n_group; ++r)
          for (int64_t i = 0; i < per; ++i) choice[order[r] * per + i] = -std::numeric_limits<T>::infinity();
      }
      auto order = argsort_desc(choice);
      chosen.assign(order.begin(), order.begin() + K);
    }
    T sum = 0;
    for (int32_t e : chosen) sum += s[e];
    for (int32_t e : chosen) {
      out.experts.push_back(e);
      out.weights.push_back((c.norm_topk_prob ? s[e] / sum : s[e]) * T(c.routed_scaling_factor));
    }
  }
  return out;
}

}  // namespace ds::ref
