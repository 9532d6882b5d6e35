// `deepseek train` on DeepSeek-V4 models: the MaxText keys of a V4 preset
// (configs/v4-tiny.yml) and the errors for what the V4 trainer does not
// offer, the config's round trip through config.json, the parameter layout
// and its roles (what AdamW may touch), resume bit for bit, gradient
// accumulation against one big batch, the aux-loss-free bias update on the
// score-routed layers only (the hash table and the indexer never move), and
// the export read back by the inference loader with the trained loss.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/v4_model.h"
#include "model/v4_train.h"
#include "model/v4_weights.h"
#include "ops/expert_selection.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/data.h"
#include "train/trainer.h"
#include "train_util.h"

namespace {
namespace v4_trainer_test {

using namespace ds;
namespace fs = std::filesystem;

const std::string kV4Tiny = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml";

std::vector<std::string> base(const fs::path& out) {
  return {"model_name=" + kV4Tiny,   "base_output_directory=" + out.string(),
          "per_device_batch_size=2", "max_target_length=40",
          "dataset_type=synthetic",  "synthetic_task=copy",
          "learning_rate=3e-3",      "log_period=1000"};
}

train::RunConfig run_config(const fs::path& out, const std::vector<std::string>& extra) {
  auto o = base(out);
  o.insert(o.end(), extra.begin(), extra.end());
  return train::parse_run_config("", o, "test");
}

std::vector<nlohmann::json> metrics(const fs::path& run) { return test::run_metrics(run); }

std::map<std::string, std::vector<float>> tensors(const fs::path& file) {
  std::map<std::string, std::vector<float>> out;
  const auto st = io::SafetensorsSet::open_files({file.string()});
  for (const auto& n : st.names()) out[n] = st.tensor(n).to_vector();
  return out;
}

TEST(V4TrainConfig, MaxTextKeysSetTheModel) {
  const auto rc = train::parse_run_config("",
                                          {"model_name=" + kV4Tiny, "max_target_length=64", "mhc_expansion_rate=4",
                                           "sinkhorn_iterations=7", "routed_bias_update_rate=1e-3", "mtp_num_layers=0"},
                                          "test");
  ASSERT_TRUE(rc.v4.has_value());
  const auto& c = *rc.v4;
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.hc_mult, 4);  // the override wins over the preset's 2
  EXPECT_EQ(c.hc_sinkhorn_iters, 7);
  EXPECT_EQ(c.num_hash_layers, 1);
  EXPECT_EQ(c.compress_ratios, (std::vector<int64_t>{0, 4, 16, 4}));
  EXPECT_EQ(c.sliding_window, 16);
  EXPECT_EQ(c.index_topk, 8);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.swiglu_limit, 10.0);
  EXPECT_TRUE(c.rope_scaling.enabled);
  EXPECT_EQ(c.rope_scaling.factor, 16.0);
  EXPECT_EQ(c.compress_rope_theta, 160000.0);
  EXPECT_EQ(rc.v4_routed_bias_update_rate, 1e-3);
  EXPECT_EQ(rc.train.data.vocab_size, 512);
  // config.json and back: the same config.
  const auto back = model::V4Config::from_hf_json_text(c.to_hf_json().dump(), "round trip");
  EXPECT_EQ(back.to_hf_json(), c.to_hf_json());
  // rope_type default: MaxText's plain RoPE on the compressed layers too.
  const auto plain = train::parse_run_config("", {"model_name=" + kV4Tiny, "rope_type=default"}, "test");
  EXPECT_FALSE(plain.v4->rope_scaling.enabled);
}

TEST(V4TrainConfig, WhatTheV4TrainerLacksIsOneClearError) {
  const std::string m = "model_name=" + kV4Tiny;
  for (const auto& o : std::vector<std::vector<std::string>>{
           {m, "mtp_num_layers=2"},                // V4 has one MTP layer
           {m, "indexer_loss_scaling_factor=1"},   // the indexer is not trained
           {m, "base_num_kv_heads=2"},             // one shared K=V head
           {m, "first_num_dense_layers=1"},        // a V3 key on a V4 model
           {m, "mlp_activations=[gelu, linear]"},  // only SwiGLU
           {m, "base_mlp_dim=64"},                 // no dense MLP to size
           {m, "rope_type=llama3"},
           {"decoder_block=deepseek4", "base_emb_dim=64"},  // the rest of the model missing
       })
    EXPECT_THROW(train::parse_run_config("", o, "test"), Error) << o.back();
  try {
    train::parse_run_config("", {"decoder_block=deepseek4", "base_emb_dim=64"}, "test");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs key 'base_num_query_heads'"), std::string::npos) << e.what();
  }
}

TEST(V4TrainLayout, RolesKeepTheTableTheIndexerAndTheBiasAwayFromAdamW) {
  const auto c = *train::parse_run_config("", {"model_name=" + kV4Tiny}, "test").v4;
  const auto infos = model::v4_param_infos(c);
  int64_t total = 0, tables = 0, indexer = 0, biases = 0, decayed = 0;
  for (const auto& i : infos) {
    total += i.numel();
    if (i.name.ends_with("tid2eid")) {
      EXPECT_EQ(i.role, model::ParamRole::Untrained) << i.name;
      ++tables;
    }
    if (i.name.find(".attn.indexer.") != std::string::npos) {
      EXPECT_FALSE(i.trainable()) << i.name;
      ++indexer;
    }
    if (i.name.ends_with("ffn.gate.bias")) {
      EXPECT_EQ(i.role, model::ParamRole::RoutingBias) << i.name;
      ++biases;
    }
    decayed += i.is_matrix() && i.trainable();
  }
  EXPECT_EQ(total, model::V4FlatParams::numel(c));
  EXPECT_EQ(tables, 1);       // first_num_hash_layers: 1
  EXPECT_EQ(biases, 3);       // the score-routed layers
  EXPECT_EQ(indexer, 2 * 6);  // two CSA layers: wq_b, weights_proj and the indexer's compressor (4)
  EXPECT_GT(decayed, 50);
}

// The MTP layer's loss and gradient (v4-tiny with mtp_num_layers=1, random
// weights): the loss is the CE of row t's MTP logits against token t + 2,
// computed here from the forward's MTP logits; the gradient of every kind
// of tensor it reaches (its projections, norms, head and block, the trunk,
// the embedding) matches central differences of the engine's own loss.
TEST(V4Mtp, LossAndGradientMatchCentralDifferences) {
  const auto rc = train::parse_run_config("", {"model_name=" + kV4Tiny, "mtp_num_layers=1"}, "test");
  const auto& c = *rc.v4;
  ASSERT_EQ(c.num_nextn_predict_layers, 1);
  auto p = model::V4FlatParams::zeros(c);
  model::init_v4_params(c, p, 7, 0.2f);
  // Two sequences (lengths 30 and 21), every target counted but one.
  std::vector<int32_t> ids;
  uint64_t x = 99;
  for (int t = 0; t < 53; ++t) ids.push_back(static_cast<int32_t>((x = x * 6364136223846793005ULL + 1) >> 55));
  model::V4TrainBatch b;
  b.lengths = {30, 21};
  b.inputs.assign(ids.begin(), ids.begin() + 30);
  b.inputs.insert(b.inputs.end(), ids.begin() + 31, ids.begin() + 52);
  b.targets.assign(ids.begin() + 1, ids.begin() + 31);
  b.targets.insert(b.targets.end(), ids.begin() + 32, ids.begin() + 53);
  b.counted.assign(51, 1);
  b.counted[40] = 0;
  model::V4LossOptions o;
  o.mtp_loss_scaling_factor = 1.0;
  auto g = model::V4FlatParams::zeros(c);
  const auto t = model::v4_loss_and_grad(c, p.view, &g.ptr, b, o);
  EXPECT_EQ(t.mtp_tokens, 29 + 20 - 1);
  // The MTP loss from the forward's MTP logits.
  {
    model::V4Model m(c, p.view, model::V4Options{false});
    std::vector<model::V4State> st = {m.new_state(), m.new_state()};
    std::vector<float> ml;
    m.forward({{&st[0], b.inputs.data(), 30}, {&st[1], b.inputs.data() + 30, 21}}, true, nullptr, &ml);
    ASSERT_EQ(ml.size(), static_cast<size_t>(49 * c.vocab_size));
    double ce = 0;
    int counted = 0;
    for (int r = 0; r < 49; ++r) {
      const int i = r < 29 ? r + 1 : 30 + (r - 29) + 1;  // row t of a sequence predicts its target t + 1
      if (!b.counted[static_cast<size_t>(i)]) continue;
      const float* z = ml.data() + static_cast<int64_t>(r) * c.vocab_size;
      double mx = z[0], sum = 0;
      for (int64_t v = 0; v < c.vocab_size; ++v) mx = std::max(mx, static_cast<double>(z[v]));
      for (int64_t v = 0; v < c.vocab_size; ++v) sum += std::exp(z[v] - mx);
      ce += mx + std::log(sum) - z[b.targets[static_cast<size_t>(i)]];
      ++counted;
    }
    EXPECT_NEAR(t.mtp_loss, ce / counted, 1e-9 * ce);
  }
  EXPECT_NEAR(t.loss, t.lm_loss + t.mtp_loss, 1e-12);
  // Central differences on a few entries of each kind.
  const auto infos = model::v4_param_infos(c);
  std::map<std::string, int64_t> offset, numel;
  int64_t off = 0;
  for (const auto& i : infos) {
    offset[i.name] = off;
    numel[i.name] = i.numel();
    off += i.numel();
  }
  int checked = 0;
  for (const char* name :
       {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.norm.weight",
        "mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.attn.wq_a.weight", "mtp.0.attn.attn_sink", "mtp.0.hc_ffn_fn",
        "mtp.0.ffn.shared_experts.w2.weight", "mtp.0.ffn.gate.weight", "layers.3.attn.wkv.weight",
        "layers.2.hc_attn_base", "embed.weight"}) {
    ASSERT_TRUE(offset.count(name)) << name;
    const int64_t at = offset[name], size = numel[name];
    for (int64_t k : {int64_t{0}, size / 2, size - 1}) {
      float& w = p.data[static_cast<size_t>(at + k)];
      const float w0 = w, h = 1e-2f;
      w = w0 + h;
      const double lp = model::v4_loss_and_grad(c, p.view, nullptr, b, o).loss;
      w = w0 - h;
      const double lm = model::v4_loss_and_grad(c, p.view, nullptr, b, o).loss;
      w = w0;
      const double fd = (lp - lm) / (2.0 * h), an = g.data[static_cast<size_t>(at + k)];
      EXPECT_NEAR(an, fd, 2e-2 * std::fabs(fd) + 2e-5) << name << "[" << k << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 45);
  // The MTP loss reaches the trunk: without it a main layer's gradient differs.
  o.mtp = false;
  auto g0 = model::V4FlatParams::zeros(c);
  model::v4_loss_and_grad(c, p.view, &g0.ptr, b, o);
  const int64_t wkv = offset["layers.3.attn.wkv.weight"];
  EXPECT_NE(g0.data[static_cast<size_t>(wkv)], g.data[static_cast<size_t>(wkv)]);
  EXPECT_EQ(g0.data[static_cast<size_t>(offset["mtp.0.e_proj.weight"])], 0.0f);
}

// Stopping at a checkpoint and resuming gives the uninterrupted run's losses
// bit for bit (gradient accumulation, z-loss, the MTP layer and bias updates on).
TEST(V4Training, ResumeIsBitwiseIdentical) {
  const test::TempDir tmp("ds_v4_trainer_resume");
  const fs::path dir = tmp.path();
  const std::vector<std::string> common = {
      "learning_rate_schedule_steps=8", "routed_bias_update_rate=1e-3", "z_loss_multiplier=1e-4",
      "gradient_accumulation_steps=2",  "checkpoint_period=4",          "mtp_num_layers=1"};
  auto full = common, part = common, rest = common;
  full.insert(full.end(), {"run_name=full", "steps=8"});
  part.insert(part.end(), {"run_name=part", "steps=4"});
  rest.insert(rest.end(), {"run_name=part", "steps=8", "resume=true"});
  train::train(run_config(dir, full));
  train::train(run_config(dir, part));
  const auto s = train::train(run_config(dir, rest));
  EXPECT_EQ(s.start_step, 4);
  EXPECT_EQ(s.end_step, 8);
  const auto a = metrics(dir / "full"), b = metrics(dir / "part");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()) << "step " << i;
    EXPECT_GT(a[i]["z_loss"].get<double>(), 0.0);
    EXPECT_GT(a[i]["mtp_loss"].get<double>(), 0.0);
    ASSERT_EQ(a[i]["expert_load"].size(), 5u);  // every layer and the MTP block report their experts' load
  }
  EXPECT_NE(a[0]["loss"], a[7]["loss"]);
  const auto pa = tensors(dir / "full/checkpoints/step_8/params.safetensors");
  const auto pb = tensors(dir / "part/checkpoints/step_8/params.safetensors");
  EXPECT_EQ(pa, pb);
}

// Two micro-batches of 2 rows give the gradient of one batch of 4 (the
// same rows, from json datasets).
TEST(V4Training, GradientAccumulationEqualsOneBigBatch) {
  const test::TempDir tmp("ds_v4_trainer_accum");
  const fs::path dir = tmp.path();
  const auto big = test::json_dataset(dir, 2, 4, 40, 512, 0);
  const auto halves = test::json_halves(big);  // the same rows, two per micro-batch
  const std::vector<std::string> c = {"steps=2", "gradient_clipping_threshold=0", "dataset_type=json",
                                      "enable_checkpointing=false", "warmup_steps_fraction=0"};
  auto one = c, two = c;
  one.insert(one.end(), {"run_name=one", "per_device_batch_size=4", "dataset_path=" + big.string()});
  two.insert(two.end(), {"run_name=two", "per_device_batch_size=2", "gradient_accumulation_steps=2",
                         "dataset_path=" + halves.string()});
  train::train(run_config(dir, one));
  train::train(run_config(dir, two));
  const auto ma = metrics(dir / "one"), mb = metrics(dir / "two");
  ASSERT_EQ(ma.size(), 2u);
  ASSERT_EQ(mb.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(ma[i]["loss"].get<double>(), mb[i]["loss"].get<double>(), 1e-5) << i;
    EXPECT_NEAR(ma[i]["raw_grad_norm"].get<double>(), mb[i]["raw_grad_norm"].get<double>(),
                1e-4 * ma[i]["raw_grad_norm"].get<double>())
        << i;
  }
  EXPECT_NE(ma[0]["loss"], ma[1]["loss"]);  // it trained
}

// The bias update alone (learning rate 0): every score-routed layer's bias
// moves by exactly rate x sign(mean load - load) per expert, summed over the
// micro-batches; the hash-routed layer has none; the table and the indexer
// stay put even under weight decay with a learning rate.
TEST(V4Training, BiasUpdateOnScoreRoutedLayersOnly) {
  const test::TempDir tmp("ds_v4_trainer_bias");
  const fs::path dir = tmp.path();
  const double rate = 1e-3;
  train::train(run_config(dir, {"run_name=b", "steps=1", "learning_rate=0", "warmup_steps_fraction=0",
                                "routed_bias_update_rate=1e-3", "checkpoint_period=1"}));
  const auto p0 = [&] {
    // The initial parameters: the same seed, no step.
    auto rc = run_config(dir, {"run_name=init", "steps=1", "learning_rate=0"});
    auto p = model::V4FlatParams::zeros(*rc.v4);
    model::init_v4_params(*rc.v4, p, rc.train.init_weights_seed, static_cast<float>(rc.train.init_weights_std));
    return p;
  }();
  const auto p1 = tensors(dir / "b/checkpoints/step_1/params.safetensors");
  // The loads of the step's batch under the initial parameters, and the
  // sign rule on them.
  const auto rc = run_config(dir, {});
  const auto& c = *rc.v4;
  const auto batch = model::V4TrainBatch::from_packed(train::open_dataset(rc.train.data)->next());
  const auto loads = model::v4_loss_and_grad(c, p0.view, nullptr, batch, {0.0, 1.0, true}).expert_load;
  ASSERT_EQ(loads.size(), 4u);
  int64_t off = 0;
  int moved = 0;
  for (const auto& i : model::v4_param_infos(c)) {
    const float* before = p0.data.data() + off;
    off += i.numel();
    const auto& after = p1.at(i.name);
    if (i.role != model::ParamRole::RoutingBias) {
      for (int64_t k = 0; k < i.numel(); ++k) ASSERT_EQ(after[k], before[k]) << i.name << " moved at lr 0";
      continue;
    }
    const auto& load = loads[static_cast<size_t>(i.layer)];
    std::vector<float> delta(load.size(), 0.0f);
    ops::update_routing_bias(delta.data(), load.data(), static_cast<int64_t>(load.size()), static_cast<float>(rate));
    bool any = false;
    for (int64_t k = 0; k < i.numel(); ++k) {
      EXPECT_EQ(after[k], before[k] + delta[k]) << i.name << "[" << k << "]";
      any |= delta[k] != 0.0f;
    }
    EXPECT_TRUE(any) << i.name;
    ++moved;
  }
  EXPECT_EQ(moved, 3);
  // With a learning rate and weight decay: the table and the indexer keep their values.
  train::train(run_config(dir, {"run_name=d", "steps=2", "adam_weight_decay=0.5", "checkpoint_period=2"}));
  const auto p2 = tensors(dir / "d/checkpoints/step_2/params.safetensors");
  off = 0;
  for (const auto& i : model::v4_param_infos(c)) {
    const float* before = p0.data.data() + off;
    off += i.numel();
    if (i.role != model::ParamRole::Untrained) continue;
    const auto& after = p2.at(i.name);
    for (int64_t k = 0; k < i.numel(); ++k) ASSERT_EQ(after[k], before[k]) << i.name;
  }
}

// The export, read by the generation loader, gives the loss the trainer's
// own forward gives on the checkpoint's parameters.
TEST(V4Training, ExportLoadsWithTheTrainedWeights) {
  const test::TempDir tmp("ds_v4_trainer_export");
  const fs::path dir = tmp.path();
  train::train(run_config(dir, {"run_name=e", "steps=3", "checkpoint_period=3"}));
  const auto ck = (dir / "e/checkpoints/step_3").string();
  const auto st = train::read_checkpoint_state(ck);
  const auto c = model::V4Config::from_hf_json_text(st.model_config.dump(), "state");
  auto params = model::V4FlatParams::zeros(c);
  train::load_checkpoint(ck, model::v4_param_infos(c), params.data.data(), nullptr, nullptr);
  params.sync_tables(c);
  model::export_v4_hf((dir / "hf").string(), c, params.data.data(), DType::F32);
  const auto c2 = model::V4Config::from_hf_json_file((dir / "hf/config.json").string());
  const auto files = io::SafetensorsSet::open_dir((dir / "hf").string());
  const auto w = model::V4Weights::load(files, c2);
  // A packed batch of the synthetic copy task.
  train::DataConfig dc;
  dc.dataset_type = "synthetic";
  dc.synthetic_task = "copy";
  dc.batch = 2;
  dc.seq = 40;
  dc.vocab_size = c.vocab_size;
  const auto b = model::V4TrainBatch::from_packed(train::open_dataset(dc)->next());
  const double want = model::v4_loss_and_grad(c, params.view, nullptr, b).loss;
  const double got = model::v4_loss_and_grad(c2, w.view, nullptr, b).loss;
  EXPECT_EQ(got, want);
  // bf16: the same model up to the rounding of its matrices.
  model::export_v4_hf((dir / "hf16").string(), c, params.data.data(), DType::BF16);
  const auto f16 = io::SafetensorsSet::open_dir((dir / "hf16").string());
  const auto w16 = model::V4Weights::load(f16, model::V4Config::from_hf_json_file((dir / "hf16/config.json").string()));
  EXPECT_NEAR(model::v4_loss_and_grad(c2, w16.view, nullptr, b).loss, want, 1e-2 * want);
}

}  // namespace v4_trainer_test
}  // namespace
