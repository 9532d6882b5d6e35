// Training a DeepSeek-V3.2 (DSA) model. Dense warm-up: the indexer's KL
// loss enters the loss, its gradients reach the indexer's weights alone and
// agree with central differences of that loss, every other gradient is
// bitwise what it is without the indexer loss (the inputs are detached), and
// the remat policy and the batch-split schedule do not change them. Sparse
// stage: top-k attention equals dense when k covers the row, and otherwise
// its gradients agree with central differences. The ops are checked
// against double references in indexer_test and attention_test; a
// three-run training (dense, warm-up, sparse) is in train_cli_test.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/error.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace ds {
namespace {
namespace dsa_train_test {

const std::string kTinyDsa = "model_name: " + std::string(DEEPSEEK_SOURCE_DIR) +
                             "/configs/tiny.yml\nuse_indexer: true\nindexer_n_heads: 2\nindexer_head_dim: 16\n"
                             "indexer_topk: 4\nmax_target_length: 8\n";

// Two rows of 8 tokens, two documents each.
model::TrainBatch batch(const model::ModelConfig& cfg) {
  model::TrainBatch b;
  b.batch = 2;
  b.seq = 8;
  for (int64_t t = 0; t < 16; ++t) {
    const int32_t seg = 1 + (t % 8 >= 5);
    b.inputs.push_back(static_cast<int32_t>((37 * t + 11) % cfg.vocab_size));
    b.targets.push_back(static_cast<int32_t>((37 * t + 12) % cfg.vocab_size));
    b.positions.push_back(static_cast<int32_t>(t % 8 >= 5 ? t % 8 - 5 : t % 8));
    b.segment_ids.push_back(seg);
    b.target_segment_ids.push_back(t % 8 == 4 ? 0 : seg);
  }
  return b;
}

bool is_indexer(const std::string& name) { return name.find(".indexer.") != std::string::npos; }

TEST(DsaTrain, TheIndexerLearnsFromItsKlAloneWithExactGradients) {
  const auto rc = train::parse_run_config(kTinyDsa, {"mtp_num_layers=1"}, "test");
  const auto& cfg = rc.model;
  const int64_t mtp = cfg.num_nextn_predict_layers;
  auto p = model::FlatParams::zeros(cfg, mtp);
  train::init_params(cfg, mtp, p, 5, 0.2f);
  const model::TrainBatch b = batch(cfg);
  model::LossOptions o;
  o.mtp_num_layers = mtp;
  o.load_balance_loss_weight = 0.01;
  o.grad_scale = 0.75;  // gradient accumulation's weight applies to the indexer loss too
  const auto policy = model::RematPolicy::keep_all();
  auto g0 = model::FlatParams::zeros(cfg, mtp), g1 = model::FlatParams::zeros(cfg, mtp);
  const auto t0 = model::loss_and_grad(cfg, p.view, &g0.ptr, b, o, policy);
  o.indexer_loss_scaling_factor = 0.5;
  const auto t1 = model::loss_and_grad(cfg, p.view, &g1.ptr, b, o, policy);
  EXPECT_EQ(t0.indexer_loss, 0.0);
  EXPECT_GT(t1.indexer_loss, 0.0);
  EXPECT_EQ(t1.lm_loss, t0.lm_loss);
  EXPECT_DOUBLE_EQ(t1.loss, t0.loss + t1.indexer_loss);

  // Every gradient outside the indexers is the same as without the KL; the
  // indexers' are new. MTP's indexer stays out.
  int64_t off = 0, checked = 0;
  model::for_each_param(cfg, mtp, [&](const model::ParamInfo& i) {
    const int64_t base = off, n = i.numel();
    off += n;
    if (!i.trainable()) return;
    if (!is_indexer(i.name) || i.layer >= cfg.num_hidden_layers) {
      for (int64_t k = 0; k < n; ++k) ASSERT_EQ(g1.data[base + k], g0.data[base + k]) << i.name << " " << k;
      return;
    }
    double gmax = 0;
    int64_t best = 0;
    for (int64_t k = 0; k < n; ++k) {
      EXPECT_EQ(g0.data[base + k], 0.0f) << i.name;
      if (std::fabs(g1.data[base + k]) > gmax) gmax = std::fabs(g1.data[base + k]), best = k;
    }
    ASSERT_GT(gmax, 0.0) << i.name;
    // Central differences of the indexer loss (the only term these weights
    // move) at the largest entry and one more.
    for (int64_t k : {best, (best + n / 2) % n}) {
      float& w = p.data[base + k];
      const float saved = w, h = 1e-3f * std::max(1.0f, std::fabs(saved));
      auto loss_at = [&](float v) {
        w = v;
        auto scratch = model::FlatParams::zeros(cfg, mtp);
        return model::loss_and_grad(cfg, p.view, &scratch.ptr, b, o, policy).indexer_loss;
      };
      const double fd = 0.75 * (loss_at(saved + h) - loss_at(saved - h)) / (2.0 * h);
      w = saved;
      const double g = g1.data[base + k];
      EXPECT_NEAR(fd, g, 0.005 * gmax + 1e-7) << i.name << " entry " << k;
      ++checked;
    }
  });
  EXPECT_EQ(checked, 2 * 5 * cfg.num_hidden_layers);

  // The same gradients with every residual recomputed, and (up to the order
  // of the sums) under the batch-split schedule.
  auto g2 = model::FlatParams::zeros(cfg, mtp), g3 = model::FlatParams::zeros(cfg, mtp);
  const auto t2 = model::loss_and_grad(cfg, p.view, &g2.ptr, b, o, model::RematPolicy::from_name("full", {}));
  EXPECT_EQ(t2.indexer_loss, t1.indexer_loss);
  EXPECT_EQ(g2.data, g1.data);
  o.batch_split_factor = 2;
  const auto t3 = model::loss_and_grad(cfg, p.view, &g3.ptr, b, o, policy);
  EXPECT_NEAR(t3.indexer_loss, t1.indexer_loss, 1e-6 * t1.indexer_loss);
  double err = 0, gmax = 0;
  for (size_t k = 0; k < g1.data.size(); ++k) {
    gmax = std::max(gmax, std::fabs(double(g1.data[k])));
    err = std::max(err, std::fabs(double(g3.data[k]) - g1.data[k]));
  }
  EXPECT_LT(err, 1e-5 * gmax);
}

// The sparse stage: with index_topk at least the row length the selection
// keeps every visible key and everything is bitwise the dense run; shorter,
// the loss moves, and the gradients of the last layer's attention weights
// (which no indexer depends on, so no selection moves under them) agree with
// central differences of the loss.
TEST(DsaTrain, TheSparseStageAttendsToTheTopKeysWithExactGradients) {
  for (const char* topk : {"indexer_topk=8", "indexer_topk=3"}) {
    SCOPED_TRACE(topk);
    const auto rc = train::parse_run_config(kTinyDsa, {topk}, "test");
    const auto& cfg = rc.model;
    auto p = model::FlatParams::zeros(cfg, 0);
    train::init_params(cfg, 0, p, 6, 0.2f);
    const model::TrainBatch b = batch(cfg);
    model::LossOptions o;
    o.indexer_loss_scaling_factor = 0.5;
    const auto policy = model::RematPolicy::keep_all();
    auto gd = model::FlatParams::zeros(cfg, 0), gs = model::FlatParams::zeros(cfg, 0);
    const auto dense = model::loss_and_grad(cfg, p.view, &gd.ptr, b, o, policy);
    o.indexer_sparse_training = true;
    const auto sparse = model::loss_and_grad(cfg, p.view, &gs.ptr, b, o, policy);
    if (cfg.index_topk >= b.seq) {
      EXPECT_EQ(sparse.loss, dense.loss);
      EXPECT_EQ(gs.data, gd.data);
      continue;
    }
    EXPECT_NE(sparse.lm_loss, dense.lm_loss);
    EXPECT_GT(sparse.indexer_loss, 0.0);
    // The same under full remat (the backward recomputes the selection).
    auto gr = model::FlatParams::zeros(cfg, 0);
    EXPECT_EQ(model::loss_and_grad(cfg, p.view, &gr.ptr, b, o, model::RematPolicy::from_name("full", {})).loss,
              sparse.loss);
    EXPECT_EQ(gr.data, gs.data);
    const std::string last = "model.layers." + std::to_string(cfg.num_hidden_layers - 1) + ".self_attn.";
    int64_t off = 0, checked = 0;
    model::for_each_param(cfg, 0, [&](const model::ParamInfo& i) {
      const int64_t base = off, n = i.numel();
      off += n;
      if (i.name != last + "q_b_proj.weight" && i.name != last + "kv_b_proj.weight" && i.name != last + "o_proj.weight")
        return;
      int64_t best = 0;
      for (int64_t k = 1; k < n; ++k)
        if (std::fabs(gs.data[base + k]) > std::fabs(gs.data[base + best])) best = k;
      float& w = p.data[base + best];
      const float saved = w, h = 1e-2f * std::max(1.0f, std::fabs(saved));
      auto lm_at = [&](float v) {
        w = v;
        return model::loss_and_grad(cfg, p.view, nullptr, b, o, policy).lm_loss;
      };
      const double fd = (lm_at(saved + h) - lm_at(saved - h)) / (2.0 * h);
      w = saved;
      const double g = gs.data[base + best];
      EXPECT_NEAR(fd, g, 0.03 * std::fabs(g) + 2e-4) << i.name;
      ++checked;
    });
    EXPECT_EQ(checked, 3);
  }
}

TEST(DsaTrain, ConfigsThatWouldTrainNothingAreErrors) {
  using train::parse_run_config;
  EXPECT_NO_THROW(parse_run_config(kTinyDsa, {"indexer_loss_scaling_factor=0.01"}, "test"));
  EXPECT_NO_THROW(parse_run_config(kTinyDsa, {"indexer_sparse_training=true"}, "test"));
  // Only the indexer trainable and no indexer loss: nothing learns.
  EXPECT_THROW(parse_run_config(kTinyDsa, {"trainable_parameters_mask=['.*indexer.*']"}, "test"), Error);
  EXPECT_NO_THROW(parse_run_config(
      kTinyDsa, {"trainable_parameters_mask=['.*indexer.*']", "indexer_loss_scaling_factor=0.01"}, "test"));
  EXPECT_THROW(parse_run_config(kTinyDsa, {"indexer_loss_scaling_factor=-1"}, "test"), Error);
  // The indexer keys on a model without an indexer.
  const std::string v3 = "model_name: " + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/tiny.yml\n";
  EXPECT_THROW(parse_run_config(v3, {"indexer_loss_scaling_factor=0.01"}, "test"), Error);
  EXPECT_THROW(parse_run_config(v3, {"indexer_sparse_training=true"}, "test"), Error);
}

}  // namespace dsa_train_test
}  // namespace
}  // namespace ds
