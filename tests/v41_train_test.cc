// DeepSeek-V4.1's training loss and gradient (model/v4_train.h on a
// deepseek_v41 config): against the float64 autograd of the independent
// reference (tests/reference/make_v41_train_fixtures.py: two rows of 40
// tokens through Engram on layers 0 and 2, lagged mHC over two streams, a
// ratio-2 and a ratio-1 KV source with their readers, the candidate source
// and a restricted index source), then central differences of the engine's
// own float32 loss, and AdamW steps lowering it.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "io/safetensors.h"
#include "model/v4_train.h"
#include "ops/adamw.h"
#include "test_util.h"
#include "v4_train_util.h"

using namespace ds::model;

namespace {
namespace v41_train_test {

const std::string kDir = std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/v41/train/v41_train_tiny";

std::unique_ptr<ds::test::V4TrainFixture> load() { return ds::test::load_v4_train_fixture(kDir); }
using Grads = ds::test::V4Grads;

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

TEST(V41Train, LossAndGradientsMatchTheReference) {
  auto f = load();
  auto expected = ds::io::SafetensorsFile::open(kDir + "/expected.safetensors");
  Grads g(f->cfg);
  const V4LossTerms lt = v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, f->batch);
  const double want_loss = expected.tensor("loss").to_vector()[0];
  EXPECT_NEAR(lt.loss, want_loss, 1e-5 * std::fabs(want_loss));
  int checked = 0;
  for (const auto& [name, got] : g.by_name) {
    const auto want = expected.tensor("grad." + name).to_vector();
    ASSERT_EQ(got.size(), want.size()) << name;
    if (name.find(".attn.indexer.") != std::string::npos || name.ends_with("gate.bias") ||
        name.ends_with("gate.bias_vl")) {
      EXPECT_EQ(max_abs(got), 0.0) << name << ": not trained by this loss";
      continue;
    }
    // Relative to the tensor's largest entry: float32 sums over 80 tokens.
    ds::test::expect_close(got, ds::test::to_double(want), 0.0, 2e-4 * max_abs(want) + 1e-9, name.c_str());
    if (name.find("engram.embed") != std::string::npos) {
      // Only the rows looked up: zero rows stay zero.
      for (size_t i = 0; i < want.size(); ++i) {
        if (want[i] == 0.0f) {
          EXPECT_EQ(got[i], 0.0f) << name << "[" << i << "]";
        }
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 80);
}

TEST(V41Train, GradientMatchesCentralDifferencesOfTheEngine) {
  auto f = load();
  Grads g(f->cfg);
  v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, f->batch);
  const std::vector<std::pair<std::string, int64_t>> probes = {{"embed.weight", 3},
                                                               {"layers.0.engram.embed.weight", 3},
                                                               {"layers.2.engram.wkv.weight", 3},
                                                               {"layers.0.engram.q_weight", 2},
                                                               {"layers.2.engram.k_weight", 2},
                                                               {"layers.1.attn.compressor.wgate.weight", 3},
                                                               {"layers.3.attn.compressor.wkv.weight", 3},
                                                               {"layers.4.attn.wkv.weight", 2},
                                                               {"layers.1.hc_attn_fn", 2},
                                                               {"layers.5.hc_ffn_base", 2},
                                                               {"layers.3.attn.attn_sink", 2},
                                                               {"layers.2.attn.wo_a.weight", 2},
                                                               {"norm.weight", 2}};
  ds::test::expect_central_differences(f->cfg, f->weights.view, g.by_name, f->batch, probes);
}

// AdamW on float32 copies of every weight, on the fixture's batch: the loss
// goes down (the gradients point downhill through every V4.1 piece).
TEST(V41Train, AdamWStepsLowerTheLoss) {
  auto f = load();
  V4View view = f->weights.view;
  std::map<std::string, std::vector<float>> w, m, v;
  for_each_v4_param(
      f->cfg,
      [&](const V4ParamInfo& i, ds::ops::WeightView& leaf) {
        auto& x = w[i.name];
        x.assign(static_cast<const float*>(leaf.data), static_cast<const float*>(leaf.data) + ds::shape_numel(i.shape));
        leaf.data = x.data();
        m[i.name].assign(x.size(), 0.0f);
        v[i.name].assign(x.size(), 0.0f);
      },
      view);
  const double first = v4_loss_and_grad(f->cfg, view, nullptr, f->batch).loss;
  double last = first;
  for (int step = 1; step <= 8; ++step) {
    Grads g(f->cfg);
    last = v4_loss_and_grad(f->cfg, view, &g.tree, f->batch).loss;
    for (auto& [name, x] : w) {
      ds::ops::AdamWConfig ac;
      ac.lr = 3e-3f;
      ac.weight_decay = 0.0f;
      ds::ops::adamw_update(x.data(), m.at(name).data(), v.at(name).data(), g.by_name.at(name).data(),
                            static_cast<int64_t>(x.size()), ac, step);
    }
  }
  EXPECT_LT(last, first - 0.05) << "8 AdamW steps: " << first << " -> " << last;
}

}  // namespace v41_train_test
}  // namespace
