// DeepSeek-V4 training under MaxText's remat policies: whichever residuals
// the forward keeps, the backward recomputes the rest with the forward's own
// code, so the loss, the gradients and the expert loads are bitwise those of
// the run that keeps everything, for 1, 2 and 3 threads; and each residual
// name keeps its own bytes (saved_bytes). The model is
// configs/v4-tiny.yml with an MTP layer, two sequences long enough for
// compressed entries in its CSA (m = 4) and HCA (m = 16) layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "model/v4_train.h"
#include "ops/matmul.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace {
namespace v4_remat_test {

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

// The names V4's attention and MoE residuals go by (model/v4_model.h).
const std::vector<const char*> kAttention = {"query_wa_proj", "mla_q",         "kv_wa_proj", "kv_proj",
                                             "query_proj",    "attention_out", "context",    "out_proj"};
const std::vector<const char*> kMoe = {"mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"};
const std::vector<const char*> kPolicies = {"full",
                                            "none",
                                            "minimal",
                                            "minimal_with_context",
                                            "save_dot_with_context_except_mlp",
                                            "save_dot_except_mlpwi",
                                            "save_dot_except_mlp",
                                            "save_qkv_proj",
                                            "save_out_proj"};

// MaxText's policies and the sub-layers' sets; with singles, each name alone too.
std::vector<std::pair<std::string, model::RematPolicy>> policies(bool singles) {
  std::vector<std::pair<std::string, model::RematPolicy>> v;
  for (const char* p : kPolicies) v.emplace_back(p, model::RematPolicy::from_name(p));
  std::vector<const char*> both = kAttention;
  both.insert(both.end(), kMoe.begin(), kMoe.end());
  v.emplace_back("custom attention", custom(kAttention));
  v.emplace_back("custom moe", custom(kMoe));
  v.emplace_back("custom both", custom(both));
  for (int i = 0; singles && i < model::kResidualCount; ++i) {
    const char* name = model::residual_name(static_cast<model::Residual>(i));
    v.emplace_back(std::string("custom ") + name, custom({name}));
  }
  return v;
}

TEST_F(V4Remat, EveryPolicyGivesTheSameGradientsBitForBit) {
  test::ThreadCountGuard guard;
  omp_set_num_threads(1);
  const Result want = run(model::RematPolicy::keep_all());
  ASSERT_GT(want.grads.size(), 1000u);
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    // Each name alone at one thread.
    for (const auto& [name, p] : policies(threads == 1)) {
      const Result got = run(p);
      EXPECT_EQ(got.loss, want.loss) << name << ", " << threads << " threads";
      EXPECT_EQ(got.load, want.load) << name << ", " << threads << " threads";
      EXPECT_TRUE(got.grads == want.grads) << name << ", " << threads << " threads: the gradients differ";
    }
  }
}

// dtype=bfloat16 rounds the streams in and out of every sub-layer and the
// named residuals where they are made, so they are held in bf16 and the
// reruns start from the same values: the policies agree bit for bit there
// too, full remat holds half the bytes of its streams, and keeping
// everything holds well under float32's bytes (the unnamed residuals
// around the sub-layers, the norms' statistics and the routing stay
// float32).
TEST_F(V4Remat, Bf16HoldsTheStreamsInBf16AndEveryPolicyAgrees) {
  const size_t full_f32 = run(model::RematPolicy::from_name("full")).saved_bytes;
  const size_t all_f32 = run(model::RematPolicy::keep_all()).saved_bytes;
  const ops::ScopedGemmDtype bf16(ops::GemmDtype::kBf16);
  const Result want = run(model::RematPolicy::keep_all());
  for (const char* p : {"full", "none", "minimal", "save_qkv_proj"}) {
    const Result got = run(model::RematPolicy::from_name(p));
    EXPECT_EQ(got.loss, want.loss) << p;
    EXPECT_EQ(got.load, want.load) << p;
    EXPECT_TRUE(got.grads == want.grads) << p << ": the gradients differ";
  }
  for (const auto& names : {kAttention, kMoe}) {
    const Result got = run(custom(names));
    EXPECT_TRUE(got.grads == want.grads) << names[0] << "...: the gradients differ";
  }
  // Full remat keeps each layer's input streams [n, hc, d] (the MTP
  // block's, of fewer rows, too): 2 bytes a value instead of 4.
  const auto& c = *rc_.v4;
  const size_t layer = static_cast<size_t>(batch_.inputs.size()) * static_cast<size_t>(c.hc_mult * c.hidden_size) * 2;
  const size_t full = run(model::RematPolicy::from_name("full")).saved_bytes;
  EXPECT_GE(full_f32 - full, static_cast<size_t>(c.num_hidden_layers) * layer);
  EXPECT_LT(full_f32 - full, static_cast<size_t>(c.num_hidden_layers + 1) * layer);
  EXPECT_LT(static_cast<double>(want.saved_bytes), 0.8 * static_cast<double>(all_f32));
  std::printf("every residual kept: %zu bytes in bf16, %zu in float32\n", want.saved_bytes, all_f32);
}

TEST_F(V4Remat, EachNameKeepsItsOwnBytes) {
  std::vector<const char*> both = kAttention;
  both.insert(both.end(), kMoe.begin(), kMoe.end());
  const size_t all = run(model::RematPolicy::keep_all()).saved_bytes;
  const size_t full = run(model::RematPolicy::from_name("full")).saved_bytes;
  EXPECT_EQ(run(custom(both)).saved_bytes, all);
  // Full remat keeps each layer's input streams and its routing, little
  // more: under a fifth of what keeping everything takes here.
  EXPECT_LT(full * 5, all) << full << " of " << all << " bytes";
  // Each name alone keeps more than full (decoder_layer_input, which full
  // keeps, and key_proj / value_proj / mla_kv, which V4 does not make,
  // excepted) and less than everything; a sub-layer's names together keep
  // more than any one of them.
  const size_t attention = run(custom(kAttention)).saved_bytes;
  const size_t moe = run(custom(kMoe)).saved_bytes;
  EXPECT_LT(attention, all);
  EXPECT_LT(moe, all);
  for (int i = 0; i < model::kResidualCount; ++i) {
    const auto r = static_cast<model::Residual>(i);
    const char* name = model::residual_name(r);
    const size_t b = run(custom({name})).saved_bytes;
    const bool none = r == model::Residual::decoder_layer_input || r == model::Residual::key_proj ||
                      r == model::Residual::value_proj || r == model::Residual::mla_kv;
    if (none) {
      EXPECT_EQ(b, full) << name;
      continue;
    }
    EXPECT_GT(b, full) << name;
    EXPECT_LT(b, std::find(kMoe.begin(), kMoe.end(), std::string(name)) != kMoe.end() ? moe : attention) << name;
  }
  // MaxText's policies: minimal keeps the queries, the K=V latent, the
  // attention's output projection and the MLPs' products; with context
  // also the attention kernel's output and log-sum-exp.
  const size_t minimal = run(model::RematPolicy::from_name("minimal")).saved_bytes;
  const size_t with_context = run(model::RematPolicy::from_name("minimal_with_context")).saved_bytes;
  const size_t qkv = run(model::RematPolicy::from_name("save_qkv_proj")).saved_bytes;
  EXPECT_LT(full, qkv);
  EXPECT_LT(qkv, minimal);
  EXPECT_LT(minimal, with_context);
  EXPECT_LT(with_context, all);
}

}  // namespace v4_remat_test
}  // namespace
