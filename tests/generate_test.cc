// Generation over the model: greedy decoding picks the argmax of the full
// forward's logits at every step, a batch of prompts of different lengths
// generates what each prompt generates alone, EOS and length limits stop a
// sequence, and sampling stays inside the tokenizer's ids. Also the
// checkpoint writer: config.json round-trips and written folders load.
#include "infer/generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "infer/engine.h"
#include "model/init.h"
#include "model/load.h"
#include "model_fixture.h"
#include "ops/linear.h"

namespace fs = std::filesystem;
using ds::infer::CacheKind;
using ds::infer::GenerateOptions;

namespace {
namespace generate_test {

class GenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ds_generate_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ds::test::write_random_model(dir_, ds::test::tiny_v3_config(), 21);
    m_ = ds::infer::load_model(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
  std::unique_ptr<ds::infer::LoadedModel> m_;
};

std::string source(const std::string& rel) { return std::string(DEEPSEEK_SOURCE_DIR) + "/" + rel; }

TEST_F(GenerateTest, GreedyTokensAreTheArgmaxOfTheFullForward) {
  const int64_t V = m_->config.vocab_size;
  for (CacheKind kind : {CacheKind::Latent, CacheKind::Naive}) {
    GenerateOptions opt;
    opt.max_new_tokens = 12;
    opt.cache = kind;
    std::vector<int32_t> prompt = {3, 14, 15, 92, 65};
    auto out = ds::infer::generate(*m_->engine, {prompt}, opt);
    ASSERT_EQ(out.size(), 1u);
    ASSERT_EQ(out[0].size(), 12u);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), out[0].begin(), out[0].end() - 1);
    ds::infer::KvCache cache(CacheKind::Latent, 1, m_->config.num_hidden_layers);
    auto logits = m_->engine->step(cache, {all}, true);
    for (size_t i = 0; i < out[0].size(); ++i) {
      const float* row = &logits[(prompt.size() - 1 + i) * V];
      const float best = *std::max_element(row, row + V);
      // The chosen token is the argmax up to float32 noise between the paths.
      EXPECT_GE(row[out[0][i]], best - 1e-4f * std::max(1.0f, std::fabs(best))) << "step " << i;
    }
  }
}

// Decode reading kv_b itself (bf16 here) rather than the float32 absorbed
// copy, which the CPU keeps only for small layers: the same logits up to the
// order of sums, and the same greedy tokens.
TEST_F(GenerateTest, DecodeFromKvBIsTheAbsorbedCopysUpToRounding) {
  ASSERT_EQ(m_->weights.view.layers[0].attn.kv_b.dtype, ds::DType::BF16);
  const std::vector<int32_t> ids = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26};
  GenerateOptions opt;
  opt.max_new_tokens = 16;
  const auto absorbed = ds::test::incremental_logits(*m_, ids, 4, CacheKind::Latent);
  const auto absorbed_tokens = ds::infer::generate(*m_->engine, {{3, 14, 15}}, opt);
  const size_t saved = ds::infer::detail::set_small_absorbed_bytes(0);
  const auto from_kv_b = ds::test::incremental_logits(*m_, ids, 4, CacheKind::Latent);
  const auto from_kv_b_tokens = ds::infer::generate(*m_->engine, {{3, 14, 15}}, opt);
  ds::infer::detail::set_small_absorbed_bytes(saved);
  ASSERT_EQ(absorbed.size(), from_kv_b.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < absorbed.size(); ++i) {
    worst = std::max(worst, double(std::fabs(absorbed[i] - from_kv_b[i])));
    scale = std::max(scale, double(std::fabs(absorbed[i])));
  }
  EXPECT_LE(worst, 1e-5 * std::max(1.0, scale));
  EXPECT_EQ(absorbed_tokens, from_kv_b_tokens);
}

TEST_F(GenerateTest, ABatchGeneratesWhatEachPromptGeneratesAlone) {
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  opt.sampler.temperature = 0.8f;
  opt.sampler.seed = 9;
  std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5, 6, 7}, {8}, {9, 10, 11}};
  auto together = ds::infer::generate(*m_->engine, prompts, opt);
  ds::infer::GenerateStats st;
  GenerateOptions greedy = opt;
  greedy.sampler.temperature = 0;
  ds::infer::generate(*m_->engine, prompts, greedy, &st);
  EXPECT_EQ(st.prompt_tokens, 11);
  EXPECT_EQ(st.generated_tokens, 18);
  EXPECT_EQ(st.decode_steps_tokens, 15);
  EXPECT_EQ(st.cache_bytes, static_cast<size_t>(m_->config.num_hidden_layers) * (11 + 15) *
                                (m_->config.kv_lora_rank + m_->config.qk_rope_head_dim) * sizeof(float));
  // Sampled runs repeat exactly (draws are keyed by seed, sequence, step).
  EXPECT_EQ(ds::infer::generate(*m_->engine, prompts, opt), together);
  GenerateOptions g = greedy;
  for (size_t s = 0; s < prompts.size(); ++s) {
    auto batch = ds::infer::generate(*m_->engine, prompts, g);
    auto alone = ds::infer::generate(*m_->engine, {prompts[s]}, g);
    EXPECT_EQ(batch[s], alone[0]) << "prompt " << s;
  }
}

TEST_F(GenerateTest, ChunkedPrefillGeneratesTheSameTokens) {
  // Chunks of 1, 2, 4 and 5 tokens split prompts across steps (their later
  // parts continue from the cache) and put several prompts in one step.
  std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5, 6, 7}, {8}, {9, 10, 11}};
  for (float temperature : {0.0f, 0.8f}) {
    GenerateOptions opt;
    opt.max_new_tokens = 6;
    opt.sampler.temperature = temperature;
    opt.sampler.seed = 4;
    opt.prefill_chunk = 0;
    ds::infer::GenerateStats whole, chunked;
    const auto want = ds::infer::generate(*m_->engine, prompts, opt, &whole);
    for (int64_t chunk : {1, 2, 4, 5, 11, 512}) {
      opt.prefill_chunk = chunk;
      EXPECT_EQ(ds::infer::generate(*m_->engine, prompts, opt, &chunked), want) << "chunk " << chunk;
      EXPECT_EQ(chunked.cache_bytes, whole.cache_bytes);
      EXPECT_EQ(chunked.prompt_tokens, whole.prompt_tokens);
    }
  }
  GenerateOptions bad;
  bad.prefill_chunk = -1;
  EXPECT_THROW(ds::infer::generate(*m_->engine, prompts, bad), ds::Error);
}

TEST_F(GenerateTest, EosAndLengthStopASequence) {
  GenerateOptions opt;
  opt.max_new_tokens = 5;
  auto free_run = ds::infer::generate(*m_->engine, {{4, 5, 6}}, opt);
  ASSERT_EQ(free_run[0].size(), 5u);
  opt.eos_token_id = free_run[0][2];
  auto stopped = ds::infer::generate(*m_->engine, {{4, 5, 6}}, opt);
  const auto first_eos = std::find(free_run[0].begin(), free_run[0].end(), opt.eos_token_id) - free_run[0].begin();
  EXPECT_EQ(stopped[0], std::vector<int32_t>(free_run[0].begin(), free_run[0].begin() + first_eos + 1));
  opt.max_new_tokens = 0;
  EXPECT_TRUE(ds::infer::generate(*m_->engine, {{4}}, opt)[0].empty());
  // The sequence stops at max_position_embeddings.
  opt.max_new_tokens = 1000;
  opt.eos_token_id = -1;
  std::vector<int32_t> long_prompt(m_->config.max_position_embeddings - 3, 7);
  EXPECT_EQ(ds::infer::generate(*m_->engine, {long_prompt}, opt)[0].size(), 4u);
}

TEST_F(GenerateTest, SamplingStaysInsideTheTokenizersIds) {
  GenerateOptions opt;
  opt.max_new_tokens = 40;
  opt.sampler.temperature = 5.0f;  // nearly uniform: without the limit, ids >= 10 would appear
  opt.sample_vocab = 10;
  auto out = ds::infer::generate(*m_->engine, {{1, 2}}, opt);
  for (int32_t t : out[0]) EXPECT_LT(t, 10);
  opt.sample_vocab = m_->config.vocab_size + 1;
  EXPECT_THROW(ds::infer::generate(*m_->engine, {{1}}, opt), ds::Error);
  opt.sample_vocab = 0;
  EXPECT_THROW(ds::infer::generate(*m_->engine, {{}}, opt), ds::Error);
  EXPECT_THROW(ds::infer::generate(*m_->engine, {}, opt), ds::Error);
}

void expect_same_config(const ds::model::ModelConfig& a, const ds::model::ModelConfig& b) {
  EXPECT_EQ(ds::model::to_hf_json(a).dump(), ds::model::to_hf_json(b).dump());
  EXPECT_EQ(a.softmax_scale(), b.softmax_scale());
  for (int64_t l = 0; l < a.num_hidden_layers; ++l) EXPECT_EQ(a.is_moe_layer(l), b.is_moe_layer(l));
}

TEST(CheckpointInit, ConfigJsonRoundTrips) {
  for (const char* preset : {"configs/tiny.yml", "configs/small.yml"}) {
    auto c = ds::model::ModelConfig::from_yaml_file(source(preset));
    expect_same_config(ds::model::ModelConfig::from_hf_json_text(ds::model::to_hf_json(c).dump()), c);
  }
  for (const char* fixture : {"v3_qlora_yarn", "v2_plain_softmax", "v3_fp8_sharded"}) {
    auto c = ds::model::ModelConfig::from_hf_json_file(source("tests/data/models/") + fixture + "/config.json");
    auto back = ds::model::ModelConfig::from_hf_json_text(ds::model::to_hf_json(c).dump());
    EXPECT_EQ(back.q_lora_rank, c.q_lora_rank) << fixture;
    EXPECT_EQ(back.topk_method, c.topk_method) << fixture;
    EXPECT_EQ(back.scoring_func, c.scoring_func) << fixture;
    EXPECT_EQ(back.rope_scaling.enabled, c.rope_scaling.enabled) << fixture;
    EXPECT_EQ(back.rope_scaling.beta_fast, c.rope_scaling.beta_fast) << fixture;
    expect_same_config(back, c);
  }
}

TEST(CheckpointInit, WrittenFoldersLoadAndRun) {
  char tmpl[] = "/tmp/ds_init_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  auto c = ds::model::ModelConfig::from_yaml_file(source("configs/tiny.yml"));
  for (ds::DType dt : {ds::DType::BF16, ds::DType::F32, ds::DType::F8E4M3}) {
    ds::model::InitOptions opt;
    opt.dtype = dt;
    opt.seed = 5;
    ds::model::write_random_checkpoint(c, dir, opt);
    auto m = ds::infer::load_model(dir);
    // fp8 checkpoints keep the embedding in bf16, as DeepSeek-V3's do.
    EXPECT_EQ(m->weights.view.embed.dtype, dt == ds::DType::F8E4M3 ? ds::DType::BF16 : dt);
    if (dt == ds::DType::F8E4M3) {
      EXPECT_EQ(m->config.fp8_block_rows, 128);
      const auto& o = m->weights.view.layers[0].attn.o;
      EXPECT_EQ(o.dtype, ds::DType::F8E4M3);
      EXPECT_NE(o.scale_inv, nullptr);
    }
    ds::infer::KvCache cache(CacheKind::Latent, 1, c.num_hidden_layers);
    auto logits = m->engine->step(cache, {{1, 2, 3}}, false);
    ASSERT_EQ(logits.size(), static_cast<size_t>(c.vocab_size));
    for (float v : logits) ASSERT_TRUE(std::isfinite(v));
  }
  // The fp8 checkpoint is the f32 one quantized: each weight, with its
  // block's scale, within e4m3's rounding of the f32 value.
  std::vector<std::vector<float>> o_proj;
  for (ds::DType dt : {ds::DType::F32, ds::DType::F8E4M3}) {
    ds::model::InitOptions opt;
    opt.dtype = dt;
    opt.seed = 5;
    ds::model::write_random_checkpoint(c, dir, opt);
    auto m = ds::infer::load_model(dir);
    const auto& v = m->weights.view.layers[1].attn.o;
    o_proj.emplace_back(v.rows * v.cols);
    ds::ops::widen_rows(o_proj.back().data(), v, 0, v.rows);
  }
  float amax = 0;
  for (float w : o_proj[0]) amax = std::max(amax, std::fabs(w));
  for (size_t i = 0; i < o_proj[0].size(); ++i)  // 3 mantissa bits; subnormals below 2^-6 of the block scale
    ASSERT_LE(std::fabs(o_proj[1][i] - o_proj[0][i]), std::max(std::fabs(o_proj[0][i]) / 16, amax / 448 / 1024)) << i;
  ds::model::InitOptions bad;
  bad.dtype = ds::DType::I32;
  EXPECT_THROW(ds::model::write_random_checkpoint(c, dir, bad), ds::Error);
  std::ofstream(fs::path(dir) / "model-00001-of-00002.safetensors") << "x";
  EXPECT_THROW(ds::model::write_random_checkpoint(c, dir, {}), ds::Error);
  fs::remove_all(dir);
}

}  // namespace generate_test
}  // namespace
