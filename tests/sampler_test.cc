// Sampling: greedy is the argmax; temperature draws follow softmax(l / T);
// top-k and top-p cut the support exactly; draws are reproducible by seed.
#include "infer/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/error.h"

using ds::infer::sample_token;
using ds::infer::SamplerConfig;

TEST(Sampler, GreedyIsTheArgmaxWithTiesToTheLowerId) {
  std::vector<float> l = {0.1f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(sample_token(l.data(), 4, {}, 0, 0), 1);
}

TEST(Sampler, TemperatureDrawsFollowTheSoftmax) {
  std::vector<float> l = {1.0f, 0.0f, -1.0f, 0.5f};
  SamplerConfig c{0.7f, 0, 1.0f, 42};
  const int n = 40000;
  std::vector<int> count(4, 0);
  for (int i = 0; i < n; ++i) ++count[sample_token(l.data(), 4, c, 0, i)];
  double z = 0;
  for (float v : l) z += std::exp(v / 0.7);
  for (int i = 0; i < 4; ++i) {
    const double p = std::exp(l[i] / 0.7) / z;
    // Binomial standard deviation sqrt(n p (1-p)); 5 sigma keeps this test
    // from failing by chance while catching a wrong temperature.
    EXPECT_NEAR(count[i], n * p, 5 * std::sqrt(n * p * (1 - p))) << i;
  }
}

TEST(Sampler, TopKAndTopPCutTheSupport) {
  std::vector<float> l = {3.0f, 2.9f, 2.8f, 0.0f, -5.0f};
  SamplerConfig k2{1.0f, 2, 1.0f, 1};
  SamplerConfig p{1.0f, 0, 0.5f, 1};  // p(0) ~ 0.36, p(0)+p(1) ~ 0.69 >= 0.5
  std::map<int, int> seen_k, seen_p;
  for (int i = 0; i < 2000; ++i) {
    ++seen_k[sample_token(l.data(), 5, k2, 3, i)];
    ++seen_p[sample_token(l.data(), 5, p, 3, i)];
  }
  EXPECT_EQ(seen_k.size(), 2u);
  EXPECT_TRUE(seen_k.count(0) && seen_k.count(1));
  EXPECT_EQ(seen_p.size(), 2u);
  EXPECT_TRUE(seen_p.count(0) && seen_p.count(1));
}

TEST(Sampler, ReproducibleBySeedSequenceAndStep) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[i] = std::sin(i * 0.7f);
  SamplerConfig c{1.0f, 0, 1.0f, 9};
  std::vector<int> a, b, other;
  for (int i = 0; i < 100; ++i) {
    a.push_back(sample_token(l.data(), 50, c, 2, i));
    b.push_back(sample_token(l.data(), 50, c, 2, i));
    other.push_back(sample_token(l.data(), 50, SamplerConfig{1.0f, 0, 1.0f, 10}, 2, i));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
}

TEST(Sampler, ImpossibleSettingsAreErrors) {
  EXPECT_THROW(ds::infer::check_sampler({-1.0f, 0, 1.0f, 0}), ds::Error);
  EXPECT_THROW(ds::infer::check_sampler({1.0f, -1, 1.0f, 0}), ds::Error);
  EXPECT_THROW(ds::infer::check_sampler({1.0f, 0, 0.0f, 0}), ds::Error);
  EXPECT_THROW(ds::infer::check_sampler({1.0f, 0, 1.5f, 0}), ds::Error);
  EXPECT_NO_THROW(ds::infer::check_sampler({0.0f, 5, 0.9f, 0}));
}

TEST(Sampler, PenaltiesAndBiasesTouchOnlyTheirIds) {
  using ds::infer::LogitAdjust;
  using ds::infer::TokenHistory;
  std::vector<float> l = {2.0f, -1.0f, 0.5f, 3.0f, 1.0f};
  TokenHistory seen;
  seen[0] = {2, false};  // made twice
  seen[1] = {0, true};   // in the prompt only
  seen[2] = {1, true};   // both
  LogitAdjust a;
  a.presence = 0.5f;
  a.frequency = 0.25f;
  a.repetition = 2.0f;
  a.bias = {{3, -10.0f}, {4, 1.5f}};
  ds::infer::adjust_logits(l.data(), 5, a, seen);
  EXPECT_FLOAT_EQ(l[0], 2.0f / 2 - 2 * 0.25f - 0.5f);  // repetition divides a positive logit
  EXPECT_FLOAT_EQ(l[1], -1.0f * 2);                    // ... multiplies a negative one; the prompt has no count
  EXPECT_FLOAT_EQ(l[2], 0.5f / 2 - 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(l[3], 3.0f - 10.0f);
  EXPECT_FLOAT_EQ(l[4], 1.0f + 1.5f);
  // Nothing asked: nothing changes.
  std::vector<float> m = {1.0f, 2.0f};
  ds::infer::adjust_logits(m.data(), 2, LogitAdjust{}, seen);
  EXPECT_EQ(m, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_THROW(ds::infer::check_adjust(LogitAdjust{2.5f, 0, 1, {}}, 5), ds::Error);
  EXPECT_THROW(ds::infer::check_adjust(LogitAdjust{0, 0, 0.0f, {}}, 5), ds::Error);
  EXPECT_THROW(ds::infer::check_adjust(LogitAdjust{0, 0, 1, {{5, 1.0f}}}, 5), ds::Error);
  EXPECT_THROW(ds::infer::check_adjust(LogitAdjust{0, 0, 1, {{1, 101.0f}}}, 5), ds::Error);
}

TEST(Sampler, LogprobsAreTheLogSoftmaxWithTheMostLikelyFirst) {
  std::vector<float> l = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f, 10.0f};
  double z = 0;
  for (float v : l) z += std::exp(v);
  const auto lp = ds::infer::token_logprob(l.data(), 6, 2, 3, 5);  // the top among ids below 5
  EXPECT_NEAR(lp.logprob, -2.0 - std::log(z), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // a tie goes to the lower id
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_EQ(lp.top[2].first, 0);
  EXPECT_NEAR(lp.top[2].second, 1.0 - std::log(z), 1e-6);
  EXPECT_TRUE(ds::infer::token_logprob(l.data(), 6, 5, 0, 6).top.empty());
  EXPECT_EQ(ds::infer::token_logprob(l.data(), 6, 5, 20, 6).top.size(), 6u);
}
