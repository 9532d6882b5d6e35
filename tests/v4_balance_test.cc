// MaxText's load-balance loss on DeepSeek-V4's score-routed layers
// (model/v4_balance.h): its value against a direct evaluation of MaxText's
// formula on the forward's own routing (per packed row: f = top-k hits / T,
// P = mean softmax of the biased scores, weight E^2 mean_{b,e} f P; the
// hash-routed layer left out; the mean over layers), and its gradient
// against central differences of the engine's loss in the router weights
// of a score-routed main layer and of the MTP block; a data-parallel
// shard's share (whole_rows) is its rows' part of the whole.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "model/v4_model.h"
#include "model/v4_train.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace {
namespace v4_balance_test {

using namespace ds;

struct Case {
  train::RunConfig rc;
  model::V4FlatParams p;
  model::V4TrainBatch b;
};

Case make_case() {
  Case s;
  s.rc = train::parse_run_config(
      "", {"model_name=" + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml", "mtp_num_layers=1"}, "test");
  const auto& c = *s.rc.v4;
  s.p = model::V4FlatParams::zeros(c);
  model::init_v4_params(c, s.p, 21, 0.3f);
  // Give the selection biases values, as the balancing rule would.
  int64_t off = 0;
  for (const auto& i : model::v4_param_infos(c)) {
    if (i.role == model::ParamRole::RoutingBias)
      for (int64_t k = 0; k < i.numel(); ++k)
        s.p.data[static_cast<size_t>(off + k)] = 0.05f * static_cast<float>(k % 3);
    off += i.numel();
  }
  uint64_t x = 3;
  auto next = [&] { return static_cast<int32_t>((x = x * 6364136223846793005ULL + 1442695040888963407ULL) >> 55); };
  // Three pieces from two packed rows: row 0 holds two documents.
  s.b.lengths = {12, 17, 25};
  s.b.row_of = {0, 0, 1};
  for (int t = 0; t < 54; ++t) {
    s.b.inputs.push_back(next());
    s.b.targets.push_back(next());
  }
  return s;
}

// MaxText's formula on one layer's routing, tokens grouped by row.
double maxtext_lb(const std::vector<float>& scores, const std::vector<int32_t>& experts, const float* bias,
                  const std::vector<int64_t>& row_of, int64_t rows, int64_t E, int64_t K, double w) {
  double sum = 0;
  for (int64_t b = 0; b < rows; ++b) {
    std::vector<double> f(E, 0.0), P(E, 0.0);
    double T = 0;
    for (size_t t = 0; t < row_of.size(); ++t) {
      if (row_of[t] != b) continue;
      T += 1;
      for (int64_t j = 0; j < K; ++j) f[experts[t * K + j]] += 1;
      double z = 0;
      std::vector<double> p(E);
      for (int64_t e = 0; e < E; ++e) z += p[e] = std::exp(double(scores[t * E + e]) + bias[e]);
      for (int64_t e = 0; e < E; ++e) P[e] += p[e] / z;
    }
    for (int64_t e = 0; e < E; ++e) sum += (f[e] / T) * (P[e] / T);
  }
  return w * double(E * E) * sum / double(rows * E);
}

TEST(V4Balance, ValueIsMaxTextsFormulaOnTheScoreRoutedLayers) {
  Case s = make_case();
  const auto& c = *s.rc.v4;
  const double w = 0.3;
  model::V4LossOptions o;
  o.load_balance_loss_weight = w;
  const auto t = model::v4_loss_and_grad(c, s.p.view, nullptr, s.b, o);
  model::V4LossOptions plain;
  const auto t0 = model::v4_loss_and_grad(c, s.p.view, nullptr, s.b, plain);
  EXPECT_EQ(t0.moe_lb_loss, 0.0);
  EXPECT_NEAR(t.loss, t0.loss + t.moe_lb_loss, 1e-12);
  // The forward's routing, kept.
  model::V4Model m(c, s.p.view, model::V4Options{false});
  std::vector<model::V4State> st = {m.new_state(), m.new_state(), m.new_state()};
  model::V4Saved saved;
  std::vector<float> mtp;
  m.forward(
      {{&st[0], s.b.inputs.data(), 12}, {&st[1], s.b.inputs.data() + 12, 17}, {&st[2], s.b.inputs.data() + 29, 25}},
      true, &saved, &mtp);
  std::vector<int64_t> main_rows, mtp_rows;
  for (size_t k = 0; k < 3; ++k)
    for (int64_t i = 0; i < s.b.lengths[k]; ++i) {
      main_rows.push_back(s.b.row_of[k]);
      if (i + 1 < s.b.lengths[k]) mtp_rows.push_back(s.b.row_of[k]);
    }
  double sum = 0;
  int layers = 0;
  for (int64_t l = 0; l <= c.num_hidden_layers; ++l) {
    if (c.hash_routed(l)) continue;
    const auto& moe = saved.layers[static_cast<size_t>(l)].moe;
    const float* bias = static_cast<const float*>(s.p.view.layers[static_cast<size_t>(l)].gate_bias.data);
    const std::vector<float> scores(moe.r.scores.begin(), moe.r.scores.end());
    const std::vector<int32_t> experts(moe.r.experts.begin(), moe.r.experts.end());
    sum += maxtext_lb(scores, experts, bias, l < c.num_hidden_layers ? main_rows : mtp_rows, 2, c.n_routed_experts,
                      c.num_experts_per_tok, w);
    ++layers;
  }
  ASSERT_EQ(layers, 4);  // layers 1-3 and the MTP block; layer 0 is hash-routed
  EXPECT_NEAR(t.moe_lb_loss, sum / layers, 1e-9 * sum);
  // A shard's share: the same rows counted as 2 of a batch of 5.
  o.whole_rows = 5;
  EXPECT_NEAR(model::v4_loss_and_grad(c, s.p.view, nullptr, s.b, o).moe_lb_loss, t.moe_lb_loss * 2 / 5,
              1e-12 * t.moe_lb_loss);
}

TEST(V4Balance, GradientMatchesCentralDifferences) {
  Case s = make_case();
  const auto& c = *s.rc.v4;
  model::V4LossOptions o;
  o.load_balance_loss_weight = 0.5;
  o.grad_scale = 1.0;
  // The balance loss alone moves the router: compare the gradients with and
  // without it against the differences of the loss with and without it.
  auto g = model::V4FlatParams::zeros(c), g0 = model::V4FlatParams::zeros(c);
  model::v4_loss_and_grad(c, s.p.view, &g.ptr, s.b, o);
  model::V4LossOptions plain;
  model::v4_loss_and_grad(c, s.p.view, &g0.ptr, s.b, plain);
  std::map<std::string, std::pair<int64_t, int64_t>> at;
  int64_t off = 0;
  for (const auto& i : model::v4_param_infos(c)) {
    at[i.name] = {off, i.numel()};
    off += i.numel();
  }
  int checked = 0, moved = 0;
  for (const char* name :
       {"layers.1.ffn.gate.weight", "layers.3.ffn.gate.weight", "mtp.0.ffn.gate.weight", "layers.0.ffn.gate.weight"}) {
    ASSERT_TRUE(at.count(name)) << name;
    const auto [base, size] = at[name];
    for (int64_t k : {int64_t{1}, size / 3, size / 2 + 5, size - 2}) {
      const size_t i = static_cast<size_t>(base + k);
      float& w = s.p.data[i];
      const float w0 = w, h = 1e-2f;
      auto lb = [&] {
        return model::v4_loss_and_grad(c, s.p.view, nullptr, s.b, o).loss -
               model::v4_loss_and_grad(c, s.p.view, nullptr, s.b, plain).loss;
      };
      w = w0 + h;
      const double lp = lb();
      w = w0 - h;
      const double lm = lb();
      w = w0;
      const double fd = (lp - lm) / (2.0 * h), an = double(g.data[i]) - double(g0.data[i]);
      EXPECT_NEAR(an, fd, 3e-2 * std::fabs(fd) + 2e-6) << name << "[" << k << "]";
      moved += std::fabs(an) > 1e-6;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 16);
  EXPECT_GE(moved, 10);  // the hash-routed layer 0 gets none of it
}

}  // namespace v4_balance_test
}  // namespace

namespace {
namespace v4_balance_test {

// Data parallelism's shares: two halves of a packed batch (documents and
// padding), each weighed as a share of the whole, sum to the whole batch's
// loss and gradient.
TEST(V4Balance, ShardsOfAPackedBatchSumToTheWhole) {
  Case s = make_case();
  const auto& c = *s.rc.v4;
  model::TrainBatch whole;
  whole.batch = 4;
  whole.seq = 16;
  uint64_t x = 77;
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t t = 0; t < 16; ++t) {
      // Row r: documents of 5 + r and 6 tokens, then padding.
      const int64_t a = 5 + r, seg = t < a ? 1 : t < a + 6 ? 2 : 0;
      whole.inputs.push_back(static_cast<int32_t>((x = x * 6364136223846793005ULL + 1) >> 55));
      whole.targets.push_back(static_cast<int32_t>((x = x * 6364136223846793005ULL + 1) >> 55));
      whole.segment_ids.push_back(static_cast<int32_t>(seg));
      whole.target_segment_ids.push_back(static_cast<int32_t>(seg));
      whole.positions.push_back(static_cast<int32_t>(seg == 1 ? t : seg == 2 ? t - a : 0));
    }
  model::V4LossOptions o;
  o.load_balance_loss_weight = 0.2;
  o.mtp_loss_scaling_factor = 0.3;
  auto g = model::V4FlatParams::zeros(c);
  const auto all = model::v4_loss_and_grad(c, s.p.view, &g.ptr, model::V4TrainBatch::from_packed(whole), o);
  const auto w = model::v4_loss_weights(model::V4TrainBatch::from_packed(whole));
  o.whole_targets = w.targets;
  o.whole_mtp_targets = w.mtp_targets;
  o.whole_rows = 4;
  auto gs = model::V4FlatParams::zeros(c);
  double loss = 0, lb = 0;
  for (int64_t half = 0; half < 2; ++half) {
    model::TrainBatch part;
    part.batch = 2;
    part.seq = 16;
    auto take = [&](auto& dst, const auto& src) { dst.assign(src.begin() + half * 32, src.begin() + half * 32 + 32); };
    take(part.inputs, whole.inputs);
    take(part.targets, whole.targets);
    take(part.segment_ids, whole.segment_ids);
    take(part.target_segment_ids, whole.target_segment_ids);
    take(part.positions, whole.positions);
    const auto t = model::v4_loss_and_grad(c, s.p.view, &gs.ptr, model::V4TrainBatch::from_packed(part), o);
    loss += t.loss;
    lb += t.moe_lb_loss;
  }
  EXPECT_NEAR(lb, all.moe_lb_loss, 1e-7 * all.moe_lb_loss);  // float32 scores from products of other row counts
  EXPECT_NEAR(loss, all.loss, 1e-6 * all.loss);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < g.data.size(); ++i) {
    worst = std::max(worst, std::fabs(double(g.data[i]) - double(gs.data[i])));
    scale = std::max(scale, std::fabs(double(g.data[i])));
  }
  EXPECT_LT(worst, 1e-5 * scale);
}

}  // namespace v4_balance_test
}  // namespace
