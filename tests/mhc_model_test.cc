// MaxText's mHC (mhc_expansion_rate k > 1) in the model outside the training
// loss: generation runs the same wrapper as training (the engine's logits
// give the training forward's loss, prefill and token-by-token decoding
// agree), and an export loads back into a model with identical logits. The
// gradients themselves are checked against the float64 reference in
// train_grad_test.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <tuple>

#include "core/error.h"
#include "infer/engine.h"
#include "io/safetensors.h"
#include "model/hf_params.h"
#include "model/init.h"
#include "model/model.h"
#include "model_fixture.h"

namespace ds {
namespace {
namespace mhc_model_test {

namespace fs = std::filesystem;
using infer::CacheKind;

nlohmann::json mhc_config(int64_t k, int64_t iters) {
  auto j = test::tiny_v3_config();
  j["mhc_expansion_rate"] = k;
  j["mhc_sinkhorn_iterations"] = iters;
  return j;
}

std::string temp_dir(const char* what) {
  const auto d = fs::temp_directory_path() / (std::string("mhc_model_") + what + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d.string();
}

std::vector<int32_t> tokens(int64_t n, int64_t vocab) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((7 * i * i + 3 * i + 5) % vocab));
  return t;
}

std::vector<float> all_logits(infer::Engine& e, const model::ModelConfig& c, const std::vector<int32_t>& ids) {
  infer::KvCache cache(CacheKind::Latent, 1, c.num_hidden_layers);
  return e.step(cache, {ids}, true);
}

TEST(MhcModel, GenerationRunsTheTrainingForward) {
  const std::string dir = temp_dir("gen");
  test::write_random_model(dir, mhc_config(4, 5), 31);
  const auto m = infer::load_model(dir);
  const auto& c = m->config;
  ASSERT_EQ(c.mhc_expansion_rate, 4);
  ASSERT_EQ(c.mhc_sinkhorn_iterations, 5);
  const int64_t T = 12, V = c.vocab_size;
  const auto ids = tokens(T + 1, V);
  const std::vector<int32_t> in(ids.begin(), ids.end() - 1), target(ids.begin() + 1, ids.end());
  const auto logits = all_logits(*m->engine, c, in);

  // The engine's logits give the training forward's loss (one document).
  auto p = model::FlatParams::zeros(c, 0);
  model::load_hf_params(dir, c, 0, p);
  const double train_loss = test::one_document_train_loss(c, p.view, in, target);
  const double ce = test::mean_cross_entropy(logits, target, V);
  // float32 along two different attention paths (absorbed MLA here).
  EXPECT_NEAR(ce, train_loss, 2e-5 * train_loss);

  // Token by token through the cache: the same logits as the prefill.
  infer::KvCache cache(CacheKind::Latent, 1, c.num_hidden_layers);
  double worst = 0, scale = 0;
  for (int64_t t = 0; t < T; ++t) {
    const auto row = m->engine->step(cache, {{in[t]}}, false);
    for (int64_t v = 0; v < V; ++v) {
      worst = std::max(worst, std::fabs(double(row[v]) - logits[t * V + v]));
      scale = std::max(scale, std::fabs(double(logits[t * V + v])));
    }
  }
  EXPECT_LT(worst, 1e-5 * scale);

  // The streams matter: the same weights with the mixing's biases moved
  // give other logits (so the wrapper is not bypassed).
  for (auto& L : p.ptr.layers) L.mhc_attn.base[0] += 1.0f;
  infer::Engine moved(c, p.view);
  EXPECT_NE(all_logits(moved, c, in), logits);
  fs::remove_all(dir);
}

TEST(MhcModel, ExportThenLoadGivesIdenticalLogits) {
  auto cj = mhc_config(4, 20);
  const auto c = model::ModelConfig::from_hf_json_text(cj.dump());
  auto p = model::FlatParams::zeros(c, 0);
  model::init_params(c, 0, p, 17, 0.05f);
  // MaxText's initialisation (scales 0.01, biases 0, the norm 1), checked here.
  model::for_each_param(
      c, 0,
      [&](const model::ParamInfo& i, float* x) {
        if (i.role == model::ParamRole::MhcScale) {
          EXPECT_EQ(x[0], 0.01f) << i.name;
        }
        if (i.role == model::ParamRole::MhcBias) {
          EXPECT_EQ(x[0], 0.0f) << i.name;
        }
        if (i.role == model::ParamRole::MhcMatrix) {
          double ss = 0;
          for (int64_t k = 0; k < i.numel(); ++k) ss += double(x[k]) * x[k];
          // N(0, 1 / (k d)): the mean square is 1 / 128 within sampling error.
          EXPECT_NEAR(ss / double(i.numel()) * double(i.shape[1]), 1.0, 0.1) << i.name;
        }
      },
      p.ptr);
  // Away from the initialisation, so that every stream mixes differently.
  for (auto& L : p.ptr.layers)
    for (auto* m : {&L.mhc_attn, &L.mhc_mlp}) {
      for (int64_t r = 0; r < 24; ++r) m->base[r] = 0.3f * std::sin(1.7f * r);
      m->scale[0] = 0.9f, m->scale[1] = 0.6f, m->scale[2] = 1.3f;
    }
  const auto ids = tokens(9, c.vocab_size);
  infer::Engine direct(c, p.view);
  const auto want = all_logits(direct, c, ids);

  const std::string dir = temp_dir("export");
  model::export_hf(dir, c, 0, p, DType::F32);
  const auto back = model::ModelConfig::from_hf_json_file(dir + "/config.json");
  EXPECT_EQ(back.mhc_expansion_rate, 4);
  EXPECT_EQ(back.mhc_sinkhorn_iterations, 20);
  const auto loaded = infer::load_model(dir);
  EXPECT_EQ(all_logits(*loaded->engine, loaded->config, ids), want);
  auto q = model::FlatParams::zeros(back, 0);
  model::load_hf_params(dir, back, 0, q);
  EXPECT_EQ(q.data, p.data);
  // A bf16 export keeps the mHC tensors in float32 (they are small and feed
  // the Sinkhorn); its logits differ only by the matrices' rounding.
  const std::string dir16 = temp_dir("export16");
  model::export_hf(dir16, c, 0, p, DType::BF16);
  const auto st = io::SafetensorsSet::open_dir(dir16);
  EXPECT_EQ(st.tensor("model.layers.1.mhc_mlp.fn").dtype(), DType::F32);
  EXPECT_EQ(st.tensor("model.layers.1.mhc_mlp.scale").dtype(), DType::F32);
  EXPECT_EQ(st.tensor("model.layers.1.mlp.shared_experts.up_proj.weight").dtype(), DType::BF16);
  fs::remove_all(dir);
  fs::remove_all(dir16);
}

TEST(MhcModel, ImpossibleConfigsAreOneLineErrors) {
  for (auto [k, iters, what] : {std::tuple<int64_t, int64_t, const char*>{0, 20, "mhc_expansion_rate must be >= 1"},
                               {4, 0, "sinkhorn_iterations must be >= 1"},
                               {65, 20, "mhc_expansion_rate = 65 is above"}}) {
    try {
      model::ModelConfig::from_hf_json_text(mhc_config(k, iters).dump());
      ADD_FAILURE() << k << " streams, " << iters << " iterations accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  auto mtp = mhc_config(4, 20);
  mtp["num_nextn_predict_layers"] = 1;
  EXPECT_THROW(model::ModelConfig::from_hf_json_text(mtp.dump()), Error);
  // One stream is the plain model: no mHC tensors, no config.json keys.
  const auto one = model::ModelConfig::from_hf_json_text(mhc_config(1, 20).dump());
  for (const auto& i : model::param_infos(one)) EXPECT_EQ(i.name.find("mhc"), std::string::npos) << i.name;
  EXPECT_FALSE(model::to_hf_json(one).contains("mhc_expansion_rate"));
}

}  // namespace mhc_model_test
}  // namespace
}  // namespace ds
