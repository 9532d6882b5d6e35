// The inference path's internal consistency on random tiny checkpoints:
// incremental decoding through either cache equals the full forward, the
// latent cache holds exactly the latent and the rope key, batches of prompts
// of different lengths equal separate runs, and bad checkpoints are errors.
// (Agreement with the independent reference is in reference_model_test.cc.)
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "infer/engine.h"
#include "infer/generate.h"
#include "io/safetensors.h"
#include "model/load.h"
#include "model_fixture.h"
#include "test_util.h"

namespace fs = std::filesystem;
using ds::infer::CacheKind;
using ds::infer::KvCache;

namespace {
namespace transformer_test {

class TransformerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ds_transformer_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

std::vector<int32_t> tokens(int64_t n, int64_t vocab, uint64_t seed) {
  ds::Philox r(seed);
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(r.u32(i) % vocab);
  return t;
}

std::vector<float> full_logits(ds::infer::LoadedModel& m, const std::vector<int32_t>& ids, CacheKind kind) {
  KvCache cache(kind, 1, m.config.num_hidden_layers);
  return m.engine->step(cache, {ids}, true);
}

// Different summation orders (flash tiles vs. latent-space products) in
// float32 over O(10) logits: 1e-5 of the largest logit.
constexpr double kTol = 1e-5;

TEST_F(TransformerTest, IncrementalDecodingEqualsTheFullForward) {
  for (bool qlora : {true, false}) {
    auto cfg = ds::test::tiny_v3_config();
    if (!qlora) cfg["q_lora_rank"] = nullptr;
    ds::test::write_random_model(dir_, cfg);
    auto m = ds::infer::load_model(dir_);
    auto ids = tokens(19, m->config.vocab_size, 3);
    auto full = full_logits(*m, ids, CacheKind::Latent);
    ASSERT_EQ(full.size(), ids.size() * m->config.vocab_size);
    for (CacheKind kind : {CacheKind::Latent, CacheKind::Naive}) {
      for (size_t prefix : {1u, 5u, 18u}) {
        auto inc = ds::test::incremental_logits(*m, ids, prefix, kind);
        ds::test::expect_close(inc, full, kTol, 0, kind == CacheKind::Latent ? "latent" : "naive");
      }
    }
  }
}

TEST_F(TransformerTest, LongPromptsDoNotDependOnThreadsOrTheExpertSchedule) {
  // 150 tokens: the shared expert's 150 rows are cut into several tasks and
  // every product takes the many-row kernels.
  auto cfg = ds::test::tiny_v3_config();
  cfg["max_position_embeddings"] = 256;
  ds::test::write_random_model(dir_, cfg);
  auto m = ds::infer::load_model(dir_);
  auto ids = tokens(150, m->config.vocab_size, 5);
  ds::test::expect_same_for_any_thread_count([&] { return full_logits(*m, ids, CacheKind::Latent); });
  auto rows = full_logits(*m, ids, CacheKind::Latent);
  m->engine->set_task_parallel_assignments(int64_t{1} << 20);  // the decode schedule for all of them
  ds::test::expect_close(full_logits(*m, ids, CacheKind::Latent), rows, kTol, 0, "expert schedules");
}

TEST_F(TransformerTest, SeveralTokensContinuingACacheEqualTheFullForward) {
  // A prompt prefilled in two parts (a chunked prefill): the second part's
  // queries attend to the cached first part and causally among themselves.
  ds::test::write_random_model(dir_, ds::test::tiny_v3_config());
  auto m = ds::infer::load_model(dir_);
  const int64_t V = m->config.vocab_size;
  auto ids = tokens(16, V, 8);
  for (CacheKind kind : {CacheKind::Latent, CacheKind::Naive}) {
    auto full = full_logits(*m, ids, kind);
    KvCache cache(kind, 1, m->config.num_hidden_layers);
    m->engine->step(cache, {{ids.begin(), ids.begin() + 7}}, true);
    auto rest = m->engine->step(cache, {{ids.begin() + 7, ids.end()}}, true);
    ds::test::expect_close(rest, std::vector<float>(full.begin() + 7 * V, full.end()), kTol, 0,
                           kind == CacheKind::Latent ? "latent" : "naive");
  }
}

TEST_F(TransformerTest, ManyTokensContinuingACacheEqualTheFullForward) {
  // A long prompt's later prefill chunks: 70 tokens after 30 attend over keys
  // and values expanded from the latent cache (cheaper here than the latent
  // form), 20 after 80 in the latent form; the naive cache takes the tiled
  // attention for both. Three chunks too, and any thread count.
  auto cfg = ds::test::tiny_v3_config();
  ds::test::write_random_model(dir_, cfg);
  auto m = ds::infer::load_model(dir_);
  ASSERT_TRUE(ds::infer::expand_continuation(m->config, 30, 70, true));
  ASSERT_FALSE(ds::infer::expand_continuation(m->config, 80, 20, true));
  ASSERT_FALSE(ds::infer::expand_continuation(m->config, 99, 1, true));
  ASSERT_TRUE(ds::infer::expand_continuation(m->config, 80, 20, false));
  const int64_t V = m->config.vocab_size;
  auto ids = tokens(100, V, 12);
  for (CacheKind kind : {CacheKind::Latent, CacheKind::Naive}) {
    const char* what = kind == CacheKind::Latent ? "latent" : "naive";
    auto full = full_logits(*m, ids, kind);
    for (const std::vector<size_t>& cuts : {std::vector<size_t>{30}, {80}, {20, 50}}) {
      auto run = [&] {
        KvCache cache(kind, 1, m->config.num_hidden_layers);
        std::vector<float> logits;
        size_t begin = 0;
        for (size_t i = 0; i <= cuts.size(); ++i) {
          const size_t end = i < cuts.size() ? cuts[i] : ids.size();
          auto part = m->engine->step(cache, {{ids.begin() + begin, ids.begin() + end}}, true);
          logits.insert(logits.end(), part.begin(), part.end());
          begin = end;
        }
        return logits;
      };
      ds::test::expect_close(run(), full, kTol, 0, what);
      ds::test::expect_same_for_any_thread_count(run);
    }
  }
}

TEST_F(TransformerTest, LatentCacheHoldsOnlyTheLatentAndTheRopeKey) {
  ds::test::write_random_model(dir_, ds::test::tiny_v3_config());
  auto m = ds::infer::load_model(dir_);
  const auto& c = m->config;
  KvCache cache(CacheKind::Latent, 2, c.num_hidden_layers);
  m->engine->step(cache, {tokens(7, c.vocab_size, 1), tokens(3, c.vocab_size, 2)}, false);
  m->engine->step(cache, {{5}, {}}, false);
  const size_t want =
      static_cast<size_t>(c.num_hidden_layers) * (8 + 3) * (c.kv_lora_rank + c.qk_rope_head_dim) * sizeof(float);
  EXPECT_EQ(cache.bytes(), want);
  EXPECT_EQ(cache.seqs[0].length, 8);
  EXPECT_EQ(cache.seqs[1].length, 3);
  KvCache naive(CacheKind::Naive, 1, c.num_hidden_layers);
  m->engine->step(naive, {tokens(4, c.vocab_size, 1)}, false);
  EXPECT_EQ(naive.bytes(), static_cast<size_t>(c.num_hidden_layers) * 4 * c.num_attention_heads *
                               (c.qk_head_dim() + c.v_head_dim) * sizeof(float));
}

TEST_F(TransformerTest, ABatchOfDifferentLengthsEqualsSeparateRuns) {
  ds::test::write_random_model(dir_, ds::test::tiny_v3_config());
  auto m = ds::infer::load_model(dir_);
  const int64_t V = m->config.vocab_size;
  std::vector<std::vector<int32_t>> prompts = {tokens(9, V, 11), tokens(2, V, 12), tokens(14, V, 13)};
  KvCache batch(CacheKind::Latent, 3, m->config.num_hidden_layers);
  auto last = m->engine->step(batch, prompts, false);
  ASSERT_EQ(last.size(), 3u * V);
  // One decode step for two of the three sequences.
  auto next = m->engine->step(batch, {{4}, {}, {7}}, false);
  ASSERT_EQ(next.size(), 2u * V);
  for (size_t s = 0; s < prompts.size(); ++s) {
    auto alone = full_logits(*m, prompts[s], CacheKind::Latent);
    std::vector<float> want(alone.end() - V, alone.end());
    std::vector<float> got(last.begin() + s * V, last.begin() + (s + 1) * V);
    ds::test::expect_close(got, want, kTol, 0, "prefill");
  }
  auto p0 = prompts[0];
  p0.push_back(4);
  auto alone = full_logits(*m, p0, CacheKind::Latent);
  ds::test::expect_close(std::vector<float>(next.begin(), next.begin() + V),
                         std::vector<float>(alone.end() - V, alone.end()), kTol, 0, "decode");
}

TEST_F(TransformerTest, MtpTensorsAreRecognisedAndStrayTensorsAreErrors) {
  auto cfg = ds::test::tiny_v3_config();
  cfg["num_nextn_predict_layers"] = 1;
  ds::Tensor t = ds::Tensor::zeros({32}, ds::DType::F32);
  ds::test::write_random_model(dir_, cfg, 7, {{"model.layers.3.enorm.weight", t}, {"model.layers.3.hnorm.weight", t}});
  EXPECT_NO_THROW(ds::infer::load_model(dir_));
  ds::test::write_random_model(dir_, cfg, 7, {{"model.layers.1.mystery.weight", t}});
  EXPECT_THROW(ds::infer::load_model(dir_), ds::Error);
  // A config that disagrees with the weights' shapes.
  cfg["hidden_size"] = 40;
  std::ofstream(fs::path(dir_) / "config.json") << cfg.dump();
  EXPECT_THROW(ds::infer::load_model(dir_), ds::Error);
  EXPECT_THROW(ds::infer::load_model(dir_ + "/missing"), ds::Error);
}

TEST_F(TransformerTest, OutOfVocabularyTokensAndOverlongSequencesAreErrors) {
  ds::test::write_random_model(dir_, ds::test::tiny_v3_config());
  auto m = ds::infer::load_model(dir_);
  KvCache cache(CacheKind::Latent, 1, m->config.num_hidden_layers);
  EXPECT_THROW(m->engine->step(cache, {{static_cast<int32_t>(m->config.vocab_size)}}, false), ds::Error);
  EXPECT_THROW(m->engine->step(cache, {tokens(129, m->config.vocab_size, 1)}, false), ds::Error);
}

nlohmann::json tiny_v32_config(int64_t topk) {
  auto cfg = ds::test::tiny_v3_config();
  cfg["model_type"] = "deepseek_v32";
  cfg["index_n_heads"] = 3;
  cfg["index_head_dim"] = 16;
  cfg["index_topk"] = topk;
  return cfg;
}

// Up to index_topk keys the indexer selects every key: a V3.2 model is its
// V3 model (the same tensors without the indexer's), bit for bit. Past it,
// the rows at positions >= index_topk attend to fewer keys and differ.
TEST_F(TransformerTest, V32IsDenseAttentionUpToIndexTopkAndSparseAfter) {
  const int64_t topk = 10;
  ds::test::write_random_model(dir_, tiny_v32_config(topk), 9);
  const std::string v3_dir = dir_ + "/v3";
  fs::create_directories(v3_dir);
  std::ofstream(v3_dir + "/config.json") << ds::test::tiny_v3_config().dump();
  {
    auto st = ds::io::SafetensorsFile::open(dir_ + "/model.safetensors");
    std::vector<std::pair<std::string, ds::Tensor>> kept;
    int64_t indexer = 0;
    for (const auto& info : st.tensors()) {
      const std::string& name = info.name;
      if (name.find(".self_attn.indexer.") != std::string::npos) {
        ++indexer;
        continue;
      }
      kept.emplace_back(name, st.tensor(name));
    }
    EXPECT_EQ(indexer, 3 * 5);  // every layer, the dense one too
    ds::io::save_safetensors(v3_dir + "/model.safetensors", kept);
  }
  auto v3 = ds::infer::load_model(v3_dir);
  auto v32 = ds::infer::load_model(dir_);
  const int64_t V = v3->config.vocab_size;
  auto ids = tokens(24, V, 4);
  for (CacheKind kind : {CacheKind::Latent, CacheKind::Naive}) {
    const std::vector<int32_t> head(ids.begin(), ids.begin() + topk);
    EXPECT_EQ(full_logits(*v32, head, kind), full_logits(*v3, head, kind));
    auto dense = full_logits(*v3, ids, kind), sparse = full_logits(*v32, ids, kind);
    // The first rows match to rounding (the other rows are in the same
    // products, whose blocking follows their count).
    ds::test::expect_close(std::vector<float>(sparse.begin(), sparse.begin() + topk * V),
                           std::vector<float>(dense.begin(), dense.begin() + topk * V), kTol, 0, "rows before topk");
    double diff = 0;
    for (size_t i = topk * V; i < dense.size(); ++i) diff = std::max(diff, std::fabs(double(dense[i]) - sparse[i]));
    EXPECT_GT(diff, 1e-3) << "rows past index_topk should attend to fewer keys";
  }
}

// The sparse paths against each other: the latent cache's gathered
// attention over the selected keys, the naive cache's masked dense
// attention, prefill in one step, prefill then decode, and a batch.
TEST_F(TransformerTest, V32SparseAttentionAgreesAcrossCachesStepsAndBatches) {
  ds::test::write_random_model(dir_, tiny_v32_config(6), 11);
  auto m = ds::infer::load_model(dir_);
  const int64_t V = m->config.vocab_size;
  auto ids = tokens(40, V, 6);
  auto full = full_logits(*m, ids, CacheKind::Latent);
  ds::test::expect_close(full_logits(*m, ids, CacheKind::Naive), full, kTol, 0, "naive vs latent");
  for (CacheKind kind : {CacheKind::Latent, CacheKind::Naive})
    for (size_t prefix : {size_t{1}, size_t{4}, size_t{17}})
      ds::test::expect_close(ds::test::incremental_logits(*m, ids, prefix, kind), full, kTol, 0,
                             kind == CacheKind::Latent ? "latent decode" : "naive decode");
  // A chunk that straddles index_topk after a cached prefix.
  KvCache cache(CacheKind::Latent, 2, m->config.num_hidden_layers);
  auto other = tokens(9, V, 8);
  m->engine->step(cache, {{ids.begin(), ids.begin() + 3}, other}, true);
  auto rest = m->engine->step(cache, {{ids.begin() + 3, ids.end()}, {}}, true);
  ds::test::expect_close(rest, std::vector<float>(full.begin() + 3 * V, full.end()), kTol, 0, "straddling chunk");
  // The cache: latent and rope key as float32, the indexer key as e4m3 and
  // one float32 scale per token and layer.
  const auto& c = m->config;
  EXPECT_EQ(cache.bytes(), static_cast<size_t>(c.num_hidden_layers * (40 + 9) *
                                               ((c.kv_lora_rank + c.qk_rope_head_dim) * 4 + 16 + 4)));
  EXPECT_EQ(static_cast<int64_t>(cache.bytes()),
            (40 + 9) * ds::infer::kv_cache_bytes_per_token(c, CacheKind::Latent));
}

}  // namespace transformer_test
}  // namespace
