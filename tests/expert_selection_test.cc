// DeepSeekMoE expert selection: selection rules (bias, groups, ties), weights,
// and the gradient to the gate logits against finite differences.
#include "ops/expert_selection.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "ops/reference/expert_selection.h"
#include "test_util.h"

using ds::ops::ExpertScoring;
using ds::ops::ExpertSelectionConfig;
using ds::ops::GroupScore;

namespace {
namespace expert_selection_test {

ExpertSelectionConfig v3_like() {
  return {16, 4, 4, 2, ExpertScoring::Sigmoid, GroupScore::Top2Sum, true, 2.5f};
}
ExpertSelectionConfig v2_like() {
  return {16, 3, 4, 2, ExpertScoring::Softmax, GroupScore::Max, false, 1.0f};
}

struct Selected {
  std::vector<int32_t> experts;
  std::vector<float> weights, scores;
};

Selected select_experts(const std::vector<float>& logits, const std::vector<float>* bias, int64_t T, const ExpertSelectionConfig& c) {
  Selected r{std::vector<int32_t>(T * c.k), std::vector<float>(T * c.k), std::vector<float>(T * c.num_experts)};
  ds::ops::expert_selection_forward(r.experts.data(), r.weights.data(), r.scores.data(), logits.data(),
                                    bias ? bias->data() : nullptr, T, c);
  return r;
}

TEST(ExpertSelection, MatchesReferenceForEveryMethod) {
  const int64_t T = 37;
  auto bias = ds::test::randn(16, 3, 0.3f);
  for (auto c : {v3_like(), v2_like(),
                 ExpertSelectionConfig{16, 2, 1, 1, ExpertScoring::Softmax, GroupScore::None, true, 1.0f},
                 ExpertSelectionConfig{8, 1, 4, 1, ExpertScoring::Sigmoid, GroupScore::Top2Sum, true, 1.5f}}) {
    for (const std::vector<float>* b : {static_cast<const std::vector<float>*>(nullptr),
                                        static_cast<const std::vector<float>*>(&bias)}) {
      std::vector<float> bb;
      if (b) bb.assign(b->begin(), b->begin() + c.num_experts);
      auto logits = ds::test::randn(T * c.num_experts, 4);
      Selected r = select_experts(logits, b ? &bb : nullptr, T, c);
      auto want = ds::ref::expert_selection<double>(ds::test::to_double(logits), b ? &bb : nullptr, T, c);
      EXPECT_EQ(r.experts, want.experts);
      // float32 sigmoid/softmax and a sum of k terms: a few ulps.
      ds::test::expect_close(r.weights, want.weights, 1e-6, 0, "weights");
    }
  }
}

TEST(ExpertSelection, V4SqrtSoftplusAndHashRouting) {
  // DeepSeek-V4: flat top-k of sqrt(softplus(l)) + bias, weights renormalized
  // and scaled; hash-routed layers take their experts from a table instead
  // (bias ignored), with the same weights rule.
  const int64_t T = 23;
  const ExpertSelectionConfig c{16, 6, 1, 1, ExpertScoring::SqrtSoftplus, GroupScore::None, true, 1.5f};
  auto logits = ds::test::randn(T * 16, 51, 3.0f);
  auto bias = ds::test::randn(16, 52, 0.2f);
  Selected r = select_experts(logits, &bias, T, c);
  auto want = ds::ref::expert_selection<double>(ds::test::to_double(logits), &bias, T, c);
  EXPECT_EQ(r.experts, want.experts);
  ds::test::expect_close(r.weights, want.weights, 1e-6, 0, "weights");
  for (int64_t i = 0; i < T * 16; ++i)
    EXPECT_NEAR(r.scores[i], std::sqrt(std::log1p(std::exp(static_cast<double>(logits[i])))), 1e-6);
  std::vector<int32_t> table(T * 6);
  for (int64_t i = 0; i < T * 6; ++i) table[i] = static_cast<int32_t>((i * 7 + i / 6) % 16);
  Selected h{std::vector<int32_t>(T * 6), std::vector<float>(T * 6), std::vector<float>(T * 16)};
  ds::ops::expert_selection_forward(h.experts.data(), h.weights.data(), h.scores.data(), logits.data(), bias.data(), T,
                                    c, table.data());
  EXPECT_EQ(h.experts, table);
  auto hw = ds::ref::expert_selection<double>(ds::test::to_double(logits), nullptr, T, c, &table);
  ds::test::expect_close(h.weights, hw.weights, 1e-6, 0, "hash weights");
  table[5] = 16;  // an id outside the experts
  EXPECT_THROW(ds::ops::expert_selection_forward(h.experts.data(), h.weights.data(), h.scores.data(), logits.data(),
                                                 nullptr, T, c, table.data()),
               ds::Error);
}

TEST(ExpertSelection, GroupsAreScoredByTheirTopTwoBiasedScores) {
  // 4 groups of 2 experts; keep 1 group, k = 2. Group 0 holds the single best
  // expert but a weak partner; group 1 holds two strong ones and must win.
  ExpertSelectionConfig c{8, 2, 4, 1, ExpertScoring::Sigmoid, GroupScore::Top2Sum, true, 1.0f};
  std::vector<float> logits = {4.0f, -4.0f, 2.0f, 2.0f, -3.0f, -3.0f, -3.0f, -3.0f};
  Selected r = select_experts(logits, nullptr, 1, c);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{2, 3}));  // tie broken to the lower index first
  EXPECT_NEAR(r.weights[0], 0.5f, 1e-7);
  // With Max group scores (V2 style) the single best expert's group wins.
  c.group_score = GroupScore::Max;
  EXPECT_EQ(select_experts(logits, nullptr, 1, c).experts, (std::vector<int32_t>{0, 1}));
}

TEST(ExpertSelection, BiasChoosesButWeightsUseUnbiasedScores) {
  ExpertSelectionConfig c{4, 1, 1, 1, ExpertScoring::Sigmoid, GroupScore::None, false, 2.0f};
  std::vector<float> logits = {1.0f, 0.0f, 0.0f, 0.0f};
  std::vector<float> bias = {0.0f, 0.0f, 0.0f, 1.0f};
  Selected r = select_experts(logits, &bias, 1, c);
  EXPECT_EQ(r.experts[0], 3);
  EXPECT_NEAR(r.weights[0], 2.0f * 0.5f, 1e-7);  // sigmoid(0) * scale, bias not included
}

TEST(ExpertSelection, BackwardMatchesFiniteDifferences) {
  const int64_t T = 5;
  for (auto c : {v3_like(), v2_like(),
                 ExpertSelectionConfig{6, 2, 1, 1, ExpertScoring::Softmax, GroupScore::None, true, 1.0f},
                 ExpertSelectionConfig{8, 3, 1, 1, ExpertScoring::SqrtSoftplus, GroupScore::None, true, 1.5f}}) {
    auto logits = ds::test::randn(T * c.num_experts, 7);
    auto bias = ds::test::randn(c.num_experts, 8, 0.2f);
    Selected r = select_experts(logits, &bias, T, c);
    auto gw = ds::test::to_double(ds::test::randn(T * c.k, 9));
    // The objective sum(gw * weights) with the selection held fixed: indices
    // carry no gradient.
    auto f = [&](const std::vector<double>& l) {
      auto s = ds::ref::expert_selection<double>(l, &bias, T, c, &r.experts);
      return ds::test::weighted_sum(s.weights, gw);
    };
    auto num = ds::test::numeric_grad(f, ds::test::to_double(logits));
    std::vector<float> gwf(gw.begin(), gw.end()), dl(T * c.num_experts);
    ds::ops::expert_selection_backward(dl.data(), gwf.data(), r.scores.data(), r.experts.data(), T, c);
    // Finite differences with h = 1e-6 in double: ~1e-9 error; the kernel's
    // float32 scores add ~1e-6 relative.
    ds::test::expect_close(dl, num, 1e-5, 1e-7, "dlogits");
    // Unchosen experts get gradient only through the softmax normaliser.
    if (c.scoring != ExpertScoring::Softmax) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < c.num_experts; ++e) {
          bool chosen = false;
          for (int64_t j = 0; j < c.k; ++j) chosen |= r.experts[t * c.k + j] == e;
          if (!chosen) {
            EXPECT_EQ(dl[t * c.num_experts + e], 0.0f);
          }
        }
      }
    }
  }
}

TEST(ExpertSelection, LoadAndBiasUpdate) {
  std::vector<int32_t> experts = {0, 1, 0, 2, 0, 1};  // 3 tokens, k = 2
  std::vector<int64_t> load(4);
  ds::ops::expert_load(load.data(), experts.data(), 3, 2, 4);
  EXPECT_EQ(load, (std::vector<int64_t>{3, 2, 1, 0}));
  std::vector<float> bias(4, 0.0f);
  ds::ops::update_routing_bias(bias.data(), load.data(), 4, 0.01f);  // mean load 1.5
  EXPECT_EQ(bias, (std::vector<float>{-0.01f, -0.01f, 0.01f, 0.01f}));
  experts[0] = 4;
  EXPECT_THROW(ds::ops::expert_load(load.data(), experts.data(), 3, 2, 4), ds::Error);
}

TEST(ExpertSelection, ImpossibleConfigsAreErrors) {
  std::vector<float> l(16);
  std::vector<int32_t> e(16);
  std::vector<float> w(16), s(16);
  auto bad = [&](ExpertSelectionConfig c) {
    EXPECT_THROW(ds::ops::expert_selection_forward(e.data(), w.data(), s.data(), l.data(), nullptr, 1, c), ds::Error);
  };
  bad({16, 17, 1, 1, ExpertScoring::Sigmoid, GroupScore::None, true, 1});     // k > E
  bad({16, 2, 5, 1, ExpertScoring::Sigmoid, GroupScore::Top2Sum, true, 1});   // groups do not divide
  bad({16, 8, 4, 1, ExpertScoring::Sigmoid, GroupScore::Top2Sum, true, 1});   // one group of 4 < k
  bad({16, 1, 16, 2, ExpertScoring::Sigmoid, GroupScore::Top2Sum, true, 1});  // groups of one, top-2
}

}  // namespace expert_selection_test
}  // namespace
