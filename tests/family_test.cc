// The model-family seam (model/family.h): each family's face gives what the
// functions it wraps give, bit for bit, so the trainer, checkpoints and
// export that talk to the seam alone train and write exactly what the
// families' own code would.
#include "model/family.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "model/v4_train.h"
#include "train/config.h"

namespace ds {
namespace {
namespace family_test {

namespace fs = std::filesystem;

const std::string kTiny = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/tiny.yml";
const std::string kV4Tiny = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml";

train::RunConfig run_config(const std::string& preset, std::vector<std::string> extra = {}) {
  extra.insert(extra.begin(), {"model_name=" + preset, "max_target_length=16"});
  return train::parse_run_config("", extra, "test");
}

// Two packed rows of `seq` tokens: a document break in the second row and a
// padded tail, so segments, positions and uncounted targets all matter.
model::TrainBatch packed_batch(int64_t vocab, int64_t seq) {
  model::TrainBatch b;
  b.batch = 2;
  b.seq = seq;
  uint64_t x = 99;
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t t = 0; t < seq; ++t) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      b.inputs.push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab)));
      b.targets.push_back(static_cast<int32_t>((x >> 13) % static_cast<uint64_t>(vocab)));
      const bool second = r == 1 && t >= seq / 2, pad = r == 1 && t >= seq - 2;
      b.segment_ids.push_back(pad ? 0 : second ? 2 : 1);
      b.positions.push_back(static_cast<int32_t>(pad ? 0 : second ? t - seq / 2 : t));
      b.target_segment_ids.push_back(pad || t == seq / 2 - 1 ? 0 : b.segment_ids.back());
    }
  return b;
}

std::vector<float> initialised(const model::Family& f, uint64_t seed = 3) {
  std::vector<float> p(static_cast<size_t>(f.numel()));
  f.init(p.data(), seed, 0.05f);
  return p;
}

TEST(Family, LayoutIsTheFlatOrderAndTheRecordedConfigGivesItBack) {
  for (const auto& preset : {kTiny, kV4Tiny}) {
    const auto rc = run_config(preset, {"mtp_num_layers=1"});
    const auto f = train::model_family(rc);
    int64_t n = 0;
    for (const auto& i : f->layout()) n += i.numel();
    EXPECT_EQ(n, f->numel()) << f->name();
    EXPECT_EQ(f->mtp_layers(), 1) << f->name();
    // Every routing bias belongs to a layer the loss reports loads of.
    const auto moe = f->moe_layers();
    for (const auto& i : f->layout()) {
      if (i.role == model::ParamRole::RoutingBias) {
        EXPECT_NE(std::find(moe.begin(), moe.end(), i.layer), moe.end()) << i.name;
      }
    }
    const auto back = model::family_from_hf_config(f->hf_config(), "test");
    EXPECT_EQ(back->name(), f->name());
    EXPECT_EQ(back->hf_config(), f->hf_config());
    ASSERT_EQ(back->layout().size(), f->layout().size());
    for (size_t k = 0; k < f->layout().size(); ++k) {
      EXPECT_EQ(back->layout()[k].name, f->layout()[k].name);
      EXPECT_EQ(back->layout()[k].shape, f->layout()[k].shape);
    }
  }
  EXPECT_THROW(model::family_from_hf_config(nlohmann::json{{"model_type", 3}}, "test"), Error);
}

TEST(Family, V3BoundLossIsTheStageFunctionsLoss) {
  const auto rc = run_config(kTiny, {"mtp_num_layers=1", "load_balance_loss_weight=0.01"});
  const auto f = train::model_family(rc);
  auto p = initialised(*f);
  const int64_t mtp = rc.model.num_nextn_predict_layers;
  const auto batch = packed_batch(rc.model.vocab_size, 12);
  model::LossOptions o;
  o.z_loss_multiplier = 1e-4;
  o.load_balance_loss_weight = 0.01;
  o.mtp_num_layers = mtp;
  o.grad_scale = 0.5;
  o.whole = model::loss_weights(batch, mtp);
  EXPECT_EQ(f->loss_weights(batch, true).targets, o.whole.targets);
  EXPECT_EQ(f->loss_weights(batch, true).mtp_targets, o.whole.mtp_targets);

  std::vector<float> g1(p.size(), 0.0f), g2(p.size(), 0.0f);
  const auto t1 = f->bind(p.data(), g1.data())->loss_and_grad(batch, o, rc.train.remat, true);
  auto pv = model::FlatParams::wrap(rc.model, mtp, p.data());
  auto gv = model::FlatParams::wrap(rc.model, mtp, g2.data());
  const auto t2 = model::loss_and_grad(rc.model, pv.view, &gv.ptr, batch, o, rc.train.remat);
  EXPECT_EQ(t1.loss, t2.loss);
  EXPECT_EQ(t1.mtp_loss, t2.mtp_loss);
  EXPECT_EQ(t1.moe_lb_loss, t2.moe_lb_loss);
  EXPECT_GT(t1.mtp_loss, 0.0);
  EXPECT_GT(t1.moe_lb_loss, 0.0);
  EXPECT_EQ(g1, g2);
  // Forward only, MTP off: the eval loss.
  o.mtp_num_layers = 0;
  const auto e = f->bind(p.data(), nullptr)->loss_and_grad(batch, o, rc.train.remat, false);
  EXPECT_EQ(e.mtp_loss, 0.0);
  EXPECT_EQ(e.lm_loss, t1.lm_loss);
  EXPECT_THROW(f->bind(p.data(), nullptr)->loss_and_grad(batch, o, rc.train.remat, true), Error);
}

TEST(Family, V4BoundLossIsTheV4Loss) {
  const auto rc = run_config(kV4Tiny, {"mtp_num_layers=1"});
  const auto f = train::model_family(rc);
  const model::V4Config& c = *rc.v4;
  auto p = initialised(*f);
  const auto batch = packed_batch(c.vocab_size, 12);
  model::LossOptions o;
  o.z_loss_multiplier = 1e-4;
  o.mtp_num_layers = 1;
  o.mtp_loss_scaling_factor = 0.3;
  o.grad_scale = 0.5;
  o.whole = f->loss_weights(batch, true);
  std::vector<float> g1(p.size(), 0.0f), g2(p.size(), 0.0f);
  auto bound = f->bind(p.data(), g1.data());
  bound->params_changed();
  const auto t1 = bound->loss_and_grad(batch, o, rc.train.remat, true);

  auto pv = model::V4FlatParams::over(c, p.data());
  pv.sync_tables(c);
  auto gv = model::V4FlatParams::wrap(c, g2.data());
  model::V4LossOptions o4;
  o4.z_loss_multiplier = 1e-4;
  o4.grad_scale = 0.5;
  o4.expert_load = true;
  o4.mtp = true;
  o4.mtp_loss_scaling_factor = 0.3;
  const auto w = model::v4_loss_weights(model::V4TrainBatch::from_packed(batch));
  o4.whole_targets = w.targets;
  o4.whole_mtp_targets = w.mtp_targets;
  const auto t2 = model::v4_loss_and_grad(c, pv.view, &gv.ptr, model::V4TrainBatch::from_packed(batch), o4);
  EXPECT_EQ(t1.loss, t2.loss);
  EXPECT_EQ(t1.mtp_loss, t2.mtp_loss);
  EXPECT_GT(t1.mtp_loss, 0.0);
  EXPECT_EQ(t1.expert_load, t2.expert_load);
  EXPECT_EQ(g1, g2);

  // A hash table entry that is no expert id is refused when the buffer changes.
  int64_t off = 0;
  for (const auto& i : f->layout()) {
    if (i.name.ends_with("ffn.gate.tid2eid")) {
      p[static_cast<size_t>(off)] = static_cast<float>(c.n_routed_experts);
      break;
    }
    off += i.numel();
  }
  EXPECT_THROW(bound->params_changed(), Error);
}

TEST(Family, WhatAFamilyLacksIsOneError) {
  const auto v4 = train::model_family(run_config(kV4Tiny));
  model::LossOptions o;
  o.indexer_loss_scaling_factor = 1;
  EXPECT_THROW(v4->check_loss_options(o), Error);  // its indexer is not trained
  o = {};
  o.batch_split_factor = 2;
  o.load_balance_loss_weight = 0.1;
  EXPECT_NO_THROW(v4->check_loss_options(o));
  EXPECT_NE(v4->bind_streamed(), nullptr);  // FSDP streams V4's layers too
  const auto v3 = train::model_family(run_config(kTiny));
  o = {};
  o.indexer_loss_scaling_factor = 1;
  EXPECT_THROW(v3->check_loss_options(o), Error);  // no indexer
  o = {};
  o.batch_split_factor = 2;
  o.load_balance_loss_weight = 0.1;
  EXPECT_NO_THROW(v3->check_loss_options(o));
  EXPECT_NE(v3->bind_streamed(), nullptr);
}

TEST(Family, ExportThenLoadGivesTheParametersBack) {
  const auto dir = fs::temp_directory_path() / ("family_test_" + std::to_string(::getpid()));
  for (const auto& preset : {kTiny, kV4Tiny}) {
    const auto f = train::model_family(run_config(preset, {"mtp_num_layers=1"}));
    const auto p = initialised(*f, 11);
    fs::remove_all(dir);
    f->export_hf(dir.string(), p.data(), DType::F32, "test");
    std::vector<float> back(p.size(), -1.0f);
    f->load_hf(dir.string(), back.data());
    EXPECT_EQ(back, p) << f->name();
    // The folder's config.json is the family's record of the model.
    const auto again = model::family_from_hf_config(nlohmann::json::parse(std::ifstream(dir / "config.json")),
                                                    (dir / "config.json").string());
    EXPECT_EQ(again->numel(), f->numel()) << f->name();
  }
  fs::remove_all(dir);
}

TEST(Family, InitIsTheFamilysOwnInitialisation) {
  // Matrices normal(0, std), norms 1, the routing bias 0: the trainer's
  // random start, the same for a given seed.
  for (const auto& preset : {kTiny, kV4Tiny}) {
    const auto f = train::model_family(run_config(preset));
    const auto a = initialised(*f, 5), b = initialised(*f, 5), c = initialised(*f, 6);
    EXPECT_EQ(a, b);
    EXPECT_NE(a, c);
    int64_t off = 0;
    for (const auto& i : f->layout()) {
      if (i.role == model::ParamRole::RoutingBias) {
        for (int64_t k = 0; k < i.numel(); ++k) {
          EXPECT_EQ(a[static_cast<size_t>(off + k)], 0.0f) << i.name;
        }
      }
      off += i.numel();
    }
  }
}

}  // namespace family_test
}  // namespace
}  // namespace ds

namespace ds {
namespace {
namespace family_test {

TEST(Family, MaxTextsMhcKeysOnAV3ModelSayWhatRuns) {
  // One stream is MaxText's default, the plain residual (no mHC tensors);
  // more wraps every layer's attention and FFN in an mHC module each.
  const auto plain = run_config(kTiny, {"mhc_expansion_rate=1", "sinkhorn_iterations=20"});
  EXPECT_EQ(plain.model.mhc_expansion_rate, 1);
  EXPECT_EQ(train::model_family(plain)->numel(), train::model_family(run_config(kTiny))->numel());
  const auto rc = run_config(kTiny, {"mhc_expansion_rate=4", "sinkhorn_iterations=7"});
  EXPECT_EQ(rc.model.mhc_expansion_rate, 4);
  EXPECT_EQ(rc.model.mhc_sinkhorn_iterations, 7);
  // Per layer two modules: norm [4 D], fn [24, 4 D], base [24], scale [3].
  const int64_t D = rc.model.hidden_size, L = rc.model.num_hidden_layers;
  EXPECT_EQ(train::model_family(rc)->numel() - train::model_family(plain)->numel(),
            L * 2 * (4 * D + 24 * 4 * D + 24 + 3));
  // The memory estimate counts the k streams each layer keeps, beyond the
  // parameters' and optimizer's 16 bytes per float.
  EXPECT_GT(train::training_memory_bytes(rc) - train::training_memory_bytes(plain),
            16 * (train::model_family(rc)->numel() - train::model_family(plain)->numel()));
  for (const char* bad : {"mhc_expansion_rate=0", "sinkhorn_iterations=0", "mhc_expansion_rate=-2"}) {
    try {
      run_config(kTiny, {bad});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(">= 1"), std::string::npos) << e.what();
    }
  }
  // MTP reads a single hidden state, which k streams do not define.
  try {
    run_config(kTiny, {"mhc_expansion_rate=4", "mtp_num_layers=1"});
    ADD_FAILURE() << "mHC with MTP was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MTP is not defined for mHC"), std::string::npos) << e.what();
  }
  try {
    run_config(kV4Tiny, {"mtp_num_layers=2"});
    ADD_FAILURE() << "mtp_num_layers=2 on a V4 model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most one MTP layer"), std::string::npos) << e.what();
  }
}

}  // namespace family_test
}  // namespace
}  // namespace ds
