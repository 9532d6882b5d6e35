// DeepSeek-V4's training loss and gradient (model/v4_train.h) against the
// float64 autograd of the independent reference (tests/reference/
// deepseek_v4_ref.py, through make_v4_train_fixtures.py): a tiny model with
// a sliding-window, a CSA, an HCA and a CSA layer, hash and score routing,
// two rows of 136 tokens (one complete HCA entry, up to 34 CSA entries of
// which the indexer keeps 4). Every parameter's gradient must match; the
// indexer's, which this loss does not train, must stay zero. Then central
// differences of the engine's own float32 loss on sampled entries, and the
// same gradients for any thread count; AdamW on these gradients lowers the
// loss.
#include "model/v4_train.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "ops/adamw.h"
#include "ops/matmul.h"
#include "test_util.h"
#include "v4_train_util.h"

using namespace ds::model;

namespace {
namespace v4_train_test {

const std::string kDir = std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/v4/train/v4_train_tiny";

std::unique_ptr<ds::test::V4TrainFixture> load() { return ds::test::load_v4_train_fixture(kDir); }
using Grads = ds::test::V4Grads;

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

TEST(V4Train, LossAndGradientsMatchTheReference) {
  auto f = load();
  auto expected = ds::io::SafetensorsFile::open(kDir + "/expected.safetensors");
  Grads g(f->cfg);
  const V4LossTerms lt = v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, f->batch);
  const double want_loss = expected.tensor("loss").to_vector()[0];
  EXPECT_NEAR(lt.loss, want_loss, 1e-5 * std::fabs(want_loss));
  EXPECT_EQ(lt.tokens, static_cast<int64_t>(f->batch.inputs.size()));
  int checked = 0;
  for (const auto& [name, got] : g.by_name) {
    const auto want = expected.tensor("grad." + name).to_vector();
    ASSERT_EQ(got.size(), want.size()) << name;
    if (name.find(".attn.indexer.") != std::string::npos) {
      EXPECT_EQ(max_abs(got), 0.0) << name << ": the indexer is not trained by this loss";
      continue;
    }
    // Relative to the tensor's largest entry: float32 sums over 272 tokens.
    ds::test::expect_close(got, ds::test::to_double(want), 0.0, 2e-4 * max_abs(want) + 1e-9, name.c_str());
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

TEST(V4Train, GradientMatchesCentralDifferencesOfTheEngine) {
  auto f = load();
  Grads g(f->cfg);
  v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, f->batch);
  // Perturb float32 copies of a few tensors: the weights are views into the
  // mapped file, so each probed tensor is copied and its view redirected.
  const std::vector<std::pair<std::string, int64_t>> probes = {{"embed.weight", 5},
                                                               {"layers.1.attn.wkv.weight", 3},
                                                               {"layers.2.attn.compressor.wgate.weight", 3},
                                                               {"layers.3.attn.attn_sink", 2},
                                                               {"layers.1.hc_attn_fn", 3},
                                                               {"layers.0.ffn.gate.weight", 3},
                                                               {"hc_head_base", 2},
                                                               {"layers.2.attn.wo_a.weight", 3},
                                                               {"layers.3.ffn.shared_experts.w2.weight", 3}};
  ds::test::expect_central_differences(f->cfg, f->weights.view, g.by_name, f->batch, probes);
}

// dtype=bfloat16: every matmul's operands rounded to bf16 (ops/matmul.h).
// On this fixture bf16 moves some tokens to other experts in layers 2 and 3
// (the expert loads differ from float32's), so its gradients are those of a
// different routing and no rounding bound holds for them; the gradient-level
// check of bf16 against float64 is train_grad_test's, on V3 fixtures whose
// routing holds. Here: the loss within train_grad_test's bound (lambda
// sqrt(n) u, lambda = 2, u = 2^-8, n = 2 (s L + 1) forward roundings with
// s = 12 products in series per V4 layer: the query's two projections, the
// K=V projection, the compressor's, scores and values, the grouped output's
// two, the mHC mixing projection, the MLP's two; L = 4; the streams
// rounded on the way into and out of each sub-layer, 2 L + 1 more; and the
// named activations rounded where they are made, about 9 a layer whose
// readers are not products) and away from
// float32's, and bits that do not depend on the thread count.
TEST(V4Train, Bf16LossStaysWithinBf16RoundingAndGradientsAreReproducible) {
  auto f = load();
  auto expected = ds::io::SafetensorsFile::open(kDir + "/expected.safetensors");
  const ds::ops::ScopedGemmDtype bf16(ds::ops::GemmDtype::kBf16);
  const auto run = [&] {
    Grads g(f->cfg);
    std::vector<float> all = {static_cast<float>(v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, f->batch).loss)};
    for (const auto& [name, v] : g.by_name) all.insert(all.end(), v.begin(), v.end());
    return all;
  };
  const std::vector<float> got = run();
  const double L = static_cast<double>(f->cfg.num_hidden_layers);
  const double n = 2.0 * (12.0 * L + 1.0) + 2.0 * L + 1.0 + 9.0 * L;
  const double want_loss = expected.tensor("loss").to_vector()[0];
  EXPECT_NEAR(got[0], want_loss, 2.0 * std::sqrt(n) * std::ldexp(1.0, -8) * std::fabs(want_loss));
  EXPECT_GT(std::fabs(got[0] - want_loss), 1e-5 * std::fabs(want_loss)) << "the loss is float32's: nothing rounded";
  ds::test::expect_same_for_any_thread_count(run);
}

TEST(V4Train, GradientsDoNotDependOnTheThreadCount) {
  auto f = load();
  ds::test::expect_same_for_any_thread_count([&] {
    Grads g(f->cfg);
    std::vector<float> all = {static_cast<float>(v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, f->batch).loss)};
    for (const auto& [name, v] : g.by_name) all.insert(all.end(), v.begin(), v.end());
    return all;
  });
}

TEST(V4Train, AdamWStepsLowerTheLoss) {
  // Float32 copies of every float weight, trained on the fixture's batch
  // with AdamW: the loss must fall well below its start (the model can
  // memorise 272 tokens), so the gradients of all stages work together.
  auto f = load();
  V4View view = f->weights.view;
  std::map<std::string, std::vector<float>> params, m, v;
  for_each_v4_param(
      f->cfg,
      [&](const V4ParamInfo& i, ds::ops::WeightView& w) {
        if (i.role == V4Role::HashTable) return;
        const auto* src = static_cast<const float*>(w.data);
        auto& p = params[i.name];
        p.assign(src, src + ds::shape_numel(i.shape));
        m[i.name].assign(p.size(), 0.0f);
        v[i.name].assign(p.size(), 0.0f);
        w.data = p.data();
      },
      view);
  ds::ops::AdamWConfig ac;
  ac.lr = 3e-3f;
  ac.weight_decay = 0.0f;
  double first = 0, last = 0;
  for (int64_t step = 1; step <= 30; ++step) {
    Grads g(f->cfg);
    last = v4_loss_and_grad(f->cfg, view, &g.tree, f->batch).loss;
    if (step == 1) first = last;
    ASSERT_TRUE(std::isfinite(last)) << "step " << step;
    for (auto& [name, p] : params)
      ds::ops::adamw_update(p.data(), m[name].data(), v[name].data(), g.by_name.at(name).data(),
                            static_cast<int64_t>(p.size()), ac, step);
  }
  EXPECT_LT(last, 0.5 * first) << "loss " << first << " -> " << last;
}

// A packed row (two document pieces and padding, as `deepseek train`'s
// loader makes them) trains each piece as its own sequence: its loss and
// gradient are the counted-target-weighted sums of the pieces' own, so no
// attention, compressor window or indexer key crosses a document, positions
// restart, padding and a document's last (uncounted) target do not count.
TEST(V4Train, PackedRowsTrainEachDocumentAsItsOwnSequence) {
  auto f = load();
  const int64_t T = 136, A = 100, Bn = 30;  // piece 1 of row 0, piece 2 from row 1, then padding
  ds::model::TrainBatch p;
  p.batch = 1;
  p.seq = T;
  for (int64_t t = 0; t < T; ++t) {
    const bool first = t < A, second = t >= A && t < A + Bn;
    const size_t src = static_cast<size_t>(first ? t : second ? T + (t - A) : 0);
    p.inputs.push_back(first || second ? f->batch.inputs[src] : 0);
    p.targets.push_back(first || second ? f->batch.targets[src] : 0);
    p.positions.push_back(static_cast<int32_t>(first ? t : second ? t - A : 0));
    p.segment_ids.push_back(first ? 1 : second ? 2 : 0);
    // A document's last target belongs to the next one: not counted.
    p.target_segment_ids.push_back(first && t < A - 1 ? 1 : second && t < A + Bn - 1 ? 2 : 0);
  }
  const V4TrainBatch packed = V4TrainBatch::from_packed(p);
  ASSERT_EQ(packed.lengths, (std::vector<int64_t>{A, Bn}));
  Grads gp(f->cfg);
  const V4LossTerms lp = v4_loss_and_grad(f->cfg, f->weights.view, &gp.tree, packed);
  EXPECT_EQ(lp.tokens, (A - 1) + (Bn - 1));
  // Each piece alone, weighed by its share of the counted targets.
  double want = 0;
  std::map<std::string, std::vector<double>> want_g;
  for (int k = 0; k < 2; ++k) {
    const int64_t first = k == 0 ? 0 : A, n = k == 0 ? A : Bn;
    V4TrainBatch one = V4TrainBatch::rows(1, n, {p.inputs.begin() + first, p.inputs.begin() + first + n},
                                          {p.targets.begin() + first, p.targets.begin() + first + n});
    one.counted.assign(static_cast<size_t>(n), 1);
    one.counted.back() = 0;
    Grads g(f->cfg);
    const double share = static_cast<double>(n - 1) / static_cast<double>(lp.tokens);
    want += share * v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, one).loss;
    for (const auto& [name, v] : g.by_name) {
      auto& w = want_g[name];
      w.resize(v.size(), 0.0);
      for (size_t i = 0; i < v.size(); ++i) w[i] += share * v[i];
    }
  }
  EXPECT_NEAR(lp.loss, want, 1e-6 * want);
  for (const auto& [name, got] : gp.by_name) {
    double scale = 0;
    for (double x : want_g[name]) scale = std::max(scale, std::fabs(x));
    // The two sides differ only by float32 rounding: the gradients of the
    // mHC scales and bases and of the sinks are sums over the tokens whose
    // terms largely cancel, and one sum over the packed row rounds
    // differently from two sums over the pieces (up to 2e-5 of the result
    // here). A document seeing another would be off by far more.
    ds::test::expect_close(got, want_g[name], 0.0, 1e-4 * scale + 1e-12, name.c_str());
  }
  // A piece whose positions do not start at 0 is refused.
  p.positions[static_cast<size_t>(A)] = 1;
  EXPECT_THROW(V4TrainBatch::from_packed(p), ds::Error);
}

// The z-loss term (z_loss_multiplier lse^2, MaxText's) and its gradient,
// against central differences of the engine's own loss.
TEST(V4Train, ZLossGradientMatchesCentralDifferences) {
  auto f = load();
  V4LossOptions o;
  o.z_loss_multiplier = 0.05;
  Grads g(f->cfg);
  const V4LossTerms lt = v4_loss_and_grad(f->cfg, f->weights.view, &g.tree, f->batch, o);
  EXPECT_GT(lt.z_loss, 0.0);
  EXPECT_NEAR(lt.lm_loss - lt.z_loss, v4_loss_and_grad(f->cfg, f->weights.view, nullptr, f->batch).loss,
              1e-6 * lt.lm_loss);
  // The head's float32 copy, probed on a few entries.
  V4View view = f->weights.view;
  const auto* src = static_cast<const float*>(view.head.data);
  std::vector<float> head(src, src + f->cfg.vocab_size * f->cfg.hidden_size);
  view.head.data = head.data();
  const auto& gh = g.by_name.at("head.weight");
  for (size_t k : {size_t{3}, size_t{517}, size_t{2049}, size_t{4000}}) {
    const float x = head[k], h = 1e-2f;
    head[k] = x + h;
    const double lp = v4_loss_and_grad(f->cfg, view, nullptr, f->batch, o).loss;
    head[k] = x - h;
    const double lm = v4_loss_and_grad(f->cfg, view, nullptr, f->batch, o).loss;
    head[k] = x;
    EXPECT_NEAR(gh[k], (lp - lm) / (2 * h), 2e-3 * std::fabs((lp - lm) / (2 * h)) + 2e-6) << k;
  }
}

TEST(V4Train, BadBatchesAreErrors) {
  auto f = load();
  V4TrainBatch b = f->batch;
  b.targets.pop_back();
  EXPECT_THROW(v4_loss_and_grad(f->cfg, f->weights.view, nullptr, b), ds::Error);
  b = f->batch;
  b.targets[0] = static_cast<int32_t>(f->cfg.vocab_size);
  EXPECT_THROW(v4_loss_and_grad(f->cfg, f->weights.view, nullptr, b), ds::Error);
}

}  // namespace v4_train_test
}  // namespace
