// DeepSeek-V4 training under MaxText's remat policies: whichever residuals
// the forward keeps, the backward recomputes the rest with the forward's own
// code, so the loss, the gradients and the expert loads are bitwise those of
// the run that keeps everything, for 1, 2 and 3 threads; and each policy
// keeps less (saved_bytes) the fewer sub-layers it keeps. The model is
// configs/v4-tiny.yml with an MTP layer, two sequences long enough for
// compressed entries in its CSA (m = 4) and HCA (m = 16) layers.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "model/v4_train.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace {

using namespace ds;

const std::string kV4Tiny = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml";

struct Result {
  double loss = 0;
  std::vector<float> grads;
  std::vector<std::vector<int64_t>> load;
  size_t saved_bytes = 0;
};

class V4Remat : public ::testing::Test {
 protected:
  void SetUp() override {
    rc_ = train::parse_run_config("", {"model_name=" + kV4Tiny, "mtp_num_layers=1"}, "test");
    const auto& c = *rc_.v4;
    params_ = model::V4FlatParams::zeros(c);
    model::init_v4_params(c, params_, 11, 0.2f);
    uint64_t x = 5;
    auto next = [&] { return static_cast<int32_t>((x = x * 6364136223846793005ULL + 1442695040888963407ULL) >> 55); };
    batch_.lengths = {41, 34};
    for (int t = 0; t < 75; ++t) {
      batch_.inputs.push_back(next());
      batch_.targets.push_back(next());
    }
  }

  Result run(const model::RematPolicy& p) {
    const auto& c = *rc_.v4;
    auto g = model::V4FlatParams::zeros(c);
    model::V4LossOptions o;
    o.remat = p;
    o.z_loss_multiplier = 1e-3;
    o.expert_load = true;
    const auto t = model::v4_loss_and_grad(c, params_.view, &g.ptr, batch_, o);
    return {t.loss, std::move(g.data), t.expert_load, t.saved_bytes};
  }

  train::RunConfig rc_;
  model::V4FlatParams params_;
  model::V4TrainBatch batch_;
};

model::RematPolicy custom(const std::vector<const char*>& names) {
  std::vector<std::pair<std::string, std::string>> kv;
  for (const char* n : names) kv.emplace_back(n, "device");
  return model::RematPolicy::from_name("custom", kv);
}

const std::vector<const char*> kAttention = {"query_wa_proj", "mla_q",         "kv_wa_proj", "mla_kv",
                                             "query_proj",    "attention_out", "context",    "out_proj"};
const std::vector<const char*> kMoe = {"mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"};

TEST_F(V4Remat, EveryPolicyGivesTheSameGradientsBitForBit) {
  std::vector<const char*> both = kAttention;
  both.insert(both.end(), kMoe.begin(), kMoe.end());
  const std::vector<std::pair<std::string, model::RematPolicy>> policies = {
      {"full", model::RematPolicy::from_name("full")},
      {"minimal", model::RematPolicy::from_name("minimal")},
      {"save_dot_except_mlp", model::RematPolicy::from_name("save_dot_except_mlp")},
      {"custom attention", custom(kAttention)},
      {"custom moe", custom(kMoe)},
      {"custom both", custom(both)}};
  test::ThreadCountGuard guard;
  omp_set_num_threads(1);
  const Result want = run(model::RematPolicy::keep_all());
  ASSERT_GT(want.grads.size(), 1000u);
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (const auto& [name, p] : policies) {
      const Result got = run(p);
      EXPECT_EQ(got.loss, want.loss) << name << ", " << threads << " threads";
      EXPECT_EQ(got.load, want.load) << name << ", " << threads << " threads";
      EXPECT_TRUE(got.grads == want.grads) << name << ", " << threads << " threads: the gradients differ";
    }
  }
}

TEST_F(V4Remat, APolicyKeepsLessTheFewerSubLayersItKeeps) {
  std::vector<const char*> both = kAttention;
  both.insert(both.end(), kMoe.begin(), kMoe.end());
  const size_t all = run(model::RematPolicy::keep_all()).saved_bytes;
  const size_t kept_both = run(custom(both)).saved_bytes;
  const size_t attention = run(custom(kAttention)).saved_bytes;
  const size_t moe = run(custom(kMoe)).saved_bytes;
  const size_t full = run(model::RematPolicy::from_name("full")).saved_bytes;
  EXPECT_EQ(kept_both, all);
  EXPECT_LT(attention, all);
  EXPECT_LT(moe, all);
  EXPECT_LT(full, attention);
  EXPECT_LT(full, moe);
  // Full remat keeps each layer's input streams and its routing, little
  // more: under a fifth of what keeping everything takes here.
  EXPECT_LT(full * 5, all) << full << " of " << all << " bytes";
}

TEST(V4RematKeeps, ASubLayerIsKeptOnlyWhenEveryOneOfItsNamesIs) {
  EXPECT_EQ(model::v4_remat_keeps(model::RematPolicy::keep_all()), std::make_pair(true, true));
  EXPECT_EQ(model::v4_remat_keeps(model::RematPolicy::from_name("full")), std::make_pair(false, false));
  EXPECT_EQ(model::v4_remat_keeps(custom(kAttention)), std::make_pair(true, false));
  EXPECT_EQ(model::v4_remat_keeps(custom(kMoe)), std::make_pair(false, true));
  std::vector<const char*> most = kAttention;
  most.pop_back();  // out_proj recomputed
  EXPECT_EQ(model::v4_remat_keeps(custom(most)), std::make_pair(false, false));
}

}  // namespace
