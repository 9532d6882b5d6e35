// Engram layers (MaxText's engram_* keys) in the model outside the training
// loss: generation runs the training forward (the engine's logits give its
// loss), decoding token by token through the cache, several sequences in one
// step, matches the prefill, an export loads back with identical logits,
// and impossible configs are one-line errors. The gradients are checked
// against the float64 reference in train_grad_test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "core/error.h"
#include "infer/engine.h"
#include "model/hf_params.h"
#include "model/init.h"
#include "model/model.h"
#include "model/stages.h"
#include "model_fixture.h"

namespace ds {
namespace {
namespace engram_model_test {

namespace fs = std::filesystem;
using infer::CacheKind;

nlohmann::json engram_config(int64_t streams) {
  auto j = test::tiny_v3_config();
  j["mhc_expansion_rate"] = streams;
  j["engram_layers"] = {0, 2};
  j["engram_max_ngram_size"] = 3;
  j["engram_num_heads"] = 2;
  j["engram_head_dim"] = 8;
  j["engram_vocab_bases"] = {40, 50};
  j["engram_kernel_size"] = 3;
  j["engram_seed"] = 3;
  j["engram_pad_id"] = 0;
  return j;
}

std::string temp_dir(const char* what) {
  const auto d = fs::temp_directory_path() / (std::string("engram_model_") + what + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d.string();
}

std::vector<int32_t> tokens(int64_t n, int64_t vocab, int64_t salt = 0) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((7 * i * i + 3 * i + 5 + salt) % vocab));
  return t;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

// Streams, and whether the hashes read token classes (the tiny tokenizer's).
class EngramModel : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(EngramModel, GenerationRunsTheTrainingForwardAndDecodingMatchesThePrefill) {
  const auto [streams, classes] = GetParam();
  const std::string dir = temp_dir("gen");
  auto cj = engram_config(streams);
  cj["engram_compress_tokens"] = classes;
  test::write_random_model(dir, cj, 41);
  if (classes)
    fs::copy_file(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/tokenizer/tiny/tokenizer.json",
                  dir + "/tokenizer.json");
  const auto m = infer::load_model(dir);
  const auto& c = m->config;
  ASSERT_TRUE(c.has_engram(0) && !c.has_engram(1) && c.has_engram(2));
  if (classes) {
    // The tiny tokenizer's first 96 ids fall into fewer classes; V' is their count.
    ASSERT_TRUE(c.engram_token_classes);
    const auto& t = *c.engram_token_classes;
    EXPECT_LT(c.engram_class_count, 96);
    EXPECT_EQ(*std::max_element(t.begin(), t.end()) + 1, c.engram_class_count);
    // The multipliers are drawn for V' (MaxText's bound floor((2^31 - 1) / V') / 2).
    const model::StageConfig st(c);
    auto spec = c.engram_hash_spec();
    EXPECT_EQ(spec.compressed_vocab, c.engram_class_count);
    spec.compressed_vocab = c.vocab_size;
    EXPECT_NE(st.engram_tables[0].multipliers, model::engram_hash_tables(spec)[0].multipliers);
  }
  // Long enough that the cache drops old Engram rows (it keeps the conv's
  // look-back, (3 - 1) x 3 rows, plus 16, up to twice that).
  const int64_t T = 60, V = c.vocab_size;
  const auto ids = tokens(T + 1, V);
  const std::vector<int32_t> in(ids.begin(), ids.end() - 1), target(ids.begin() + 1, ids.end());
  infer::KvCache prefill(CacheKind::Latent, 1, c.num_hidden_layers);
  const auto logits = m->engine->step(prefill, {in}, true);

  // The engine's logits give the training forward's loss (one document).
  auto p = model::FlatParams::zeros(c, 0);
  model::load_hf_params(dir, c, 0, p);
  const double train_loss = test::one_document_train_loss(c, p.view, in, target);
  const double ce = test::mean_cross_entropy(logits, target, V);
  EXPECT_NEAR(ce, train_loss, 2e-5 * train_loss);

  // A prefix, then one token a step; and a second, different sequence in
  // the same steps (its rows packed after the first's).
  const auto other = tokens(T, V, 11);
  infer::KvCache both(CacheKind::Latent, 1, c.num_hidden_layers);
  infer::KvCache alone(CacheKind::Latent, 1, c.num_hidden_layers);
  const auto other_logits = m->engine->step(alone, {other}, true);
  both.seqs.resize(2, infer::SequenceCache(c.num_hidden_layers));
  const int64_t P = 5;
  auto first = m->engine->step(both, {{in.begin(), in.begin() + P}, {other.begin(), other.begin() + P}}, true);
  double worst = 0;
  for (int64_t i = 0; i < P * V; ++i) {
    worst = std::max(worst, std::fabs(double(first[i]) - logits[i]));
    worst = std::max(worst, std::fabs(double(first[P * V + i]) - other_logits[i]));
  }
  for (int64_t t = P; t < T; ++t) {
    const auto rows = m->engine->step(both, {{in[t]}, {other[t]}}, true);
    for (int64_t v = 0; v < V; ++v) {
      worst = std::max(worst, std::fabs(double(rows[v]) - logits[t * V + v]));
      worst = std::max(worst, std::fabs(double(rows[V + v]) - other_logits[t * V + v]));
    }
  }
  EXPECT_LT(worst, 1e-5 * max_abs(logits));
  const int64_t W = c.residual_width();
  for (const auto& sc : both.seqs) {
    EXPECT_GT(sc.engram_first, 0);
    EXPECT_LE(static_cast<int64_t>(sc.engram[2].size()), 2 * (6 + 16) * W);
    EXPECT_EQ(static_cast<int64_t>(sc.engram[2].size()), (sc.length - sc.engram_first) * W);
    EXPECT_TRUE(sc.engram[1].empty());  // layer 1 has no Engram
  }

  // Engram matters: another table gives other logits.
  for (int64_t i = 0; i < 16; ++i) p.ptr.layers[2].engram.table[i] += 1.0f;
  infer::Engine moved(c, p.view);
  infer::KvCache again(CacheKind::Latent, 1, c.num_hidden_layers);
  EXPECT_NE(moved.step(again, {in}, true), logits);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Streams, EngramModel,
                         ::testing::Values(std::tuple<int64_t, bool>{1, false}, std::tuple<int64_t, bool>{2, false},
                                           std::tuple<int64_t, bool>{2, true}));

TEST(EngramModelInit, ANonFiniteTableRowFailsGenerationNotLoading) {
  // A NaN in the first row of layer 0's table (bf16 0x7fc0): the table is not
  // scanned at load, so the folder loads; a token whose n-grams read that row
  // gives non-finite logits, which generation refuses with one error.
  const std::string dir = temp_dir("nan");
  test::write_random_model(dir, engram_config(2), 5);
  const std::string file = dir + "/model.safetensors";
  uint64_t header = 0;
  {
    std::ifstream in(file, std::ios::binary);
    in.read(reinterpret_cast<char*>(&header), 8);
    std::string text(header, '\0');
    in.read(text.data(), static_cast<std::streamsize>(header));
    const auto j = nlohmann::json::parse(text);
    const uint64_t begin = j["model.layers.0.engram.embedding.weight"]["data_offsets"][0];
    std::fstream io(file, std::ios::binary | std::ios::in | std::ios::out);
    io.seekp(static_cast<std::streamoff>(8 + header + begin));
    const uint16_t nan = 0x7fc0;
    for (int i = 0; i < 8; ++i) io.write(reinterpret_cast<const char*>(&nan), 2);
  }
  const auto m = infer::load_model(dir);
  // Row 0 is column 0's first row: some token's 2-gram hashes there.
  const auto t = model::engram_hash_tables(m->config.engram_hash_spec())[0];
  int32_t hit = -1;
  for (int32_t a = 0; a < 96 && hit < 0; ++a) {
    std::vector<int32_t> ids(2 * 4);
    const std::vector<int32_t> two = {a, a};
    model::engram_hash_ids(ids.data(), two.data(), 1, 2, nullptr, 0, t, 3, 2);
    if (ids[4] == 0) hit = a;
  }
  if (hit < 0) GTEST_SKIP() << "no token pair of this vocabulary hashes to row 0";
  infer::KvCache cache(CacheKind::Latent, 1, m->config.num_hidden_layers);
  try {
    m->engine->step(cache, {{hit, hit}}, true);
    ADD_FAILURE() << "non-finite logits were returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(EngramModelInit, TokenClassesNeedTheTokenizer) {
  const std::string dir = temp_dir("classes");
  auto cj = engram_config(2);
  cj["engram_compress_tokens"] = true;
  test::write_random_model(dir, cj, 3);
  try {
    infer::load_model(dir);
    ADD_FAILURE() << "a folder without tokenizer.json loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("engram_compress_tokens"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(EngramModelInit, MaxTextInitialisationAndExportRoundTrip) {
  const auto c = model::ModelConfig::from_hf_json_text(engram_config(2).dump());
  auto p = model::FlatParams::zeros(c, 0);
  model::init_params(c, 0, p, 17, 0.05f);
  model::for_each_param(
      c, 0,
      [&](const model::ParamInfo& i, float* x) {
        if (i.role == model::ParamRole::EngramConv || i.role == model::ParamRole::Bias) {
          for (int64_t k = 0; k < i.numel(); ++k) EXPECT_EQ(x[k], 0.0f) << i.name;
        }
        if (i.role == model::ParamRole::EngramTable) {
          double ss = 0;
          for (int64_t k = 0; k < i.numel(); ++k) ss += double(x[k]) * x[k];
          EXPECT_NEAR(ss / double(i.numel()) * double(i.shape[1]), 1.0, 0.1) << i.name;  // N(0, 1 / D_head)
        }
      },
      p.ptr);
  // Layer 0's primes: 41, 43 (2-grams), 53, 59 (3-grams); layer 2 continues.
  EXPECT_EQ(c.engram_table_rows(0), 41 + 43 + 53 + 59);
  EXPECT_EQ(c.engram_table_rows(2), 47 + 61 + 67 + 71);
  for (auto& L : p.ptr.layers)
    if (L.engram.conv)
      for (int64_t k = 0; k < 3 * 64; ++k) L.engram.conv[k] = 0.2f * std::sin(0.7f * k);
  const auto ids = tokens(9, c.vocab_size);
  infer::Engine direct(c, p.view);
  infer::KvCache c1(CacheKind::Latent, 1, c.num_hidden_layers);
  const auto want = direct.step(c1, {ids}, true);
  const std::string dir = temp_dir("export");
  model::export_hf(dir, c, 0, p, DType::F32);
  const auto loaded = infer::load_model(dir);
  EXPECT_EQ(loaded->config.engram_layers, c.engram_layers);
  EXPECT_EQ(loaded->config.engram_vocab_bases, c.engram_vocab_bases);
  infer::KvCache c2(CacheKind::Latent, 1, c.num_hidden_layers);
  EXPECT_EQ(loaded->engine->step(c2, {ids}, true), want);
  fs::remove_all(dir);
}

TEST(EngramModelInit, ImpossibleConfigsAreOneLineErrors) {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, const char*>> cases = {
      {[](nlohmann::json& j) { j["engram_layers"] = {3}; }, "engram_layers lists layer 3"},
      {[](nlohmann::json& j) {
         j["engram_layers"] = {1, 1};
       },
       "twice"},
      {[](nlohmann::json& j) { j["engram_vocab_bases"] = {40}; }, "engram_vocab_bases needs 2 entries"},
      {[](nlohmann::json& j) { j["engram_head_dim"] = 0; }, "engram_head_dim must be in"},
      {[](nlohmann::json& j) { j["engram_max_ngram_size"] = 1; }, "engram_max_ngram_size must be in"},
      {[](nlohmann::json& j) { j["engram_pad_id"] = 96; }, "engram_pad_id 96 outside"},
      {[](nlohmann::json& j) {
         j["engram_vocab_bases"] = {40, -2};
       },
       "engram_vocab_bases entry -2"},
      {[](nlohmann::json& j) {
         j["engram_max_ngram_size"] = 5;
         j["engram_num_heads"] = 200;
         j["engram_vocab_bases"] = {40, 40, 40, 40};
       },
       "hash columns"},
      {[](nlohmann::json& j) {
         j["engram_vocab_bases"] = {1 << 30, 40};
       },
       "table would have 2147483742 rows"},
      {[](nlohmann::json& j) {
         j["engram_vocab_bases"] = {1 << 26, 40};
         j["engram_num_heads"] = 64;
         j["engram_head_dim"] = 4096;
       },
       "would exceed the supported size"},
  };
  for (const auto& [edit, what] : cases) {
    auto j = engram_config(2);
    edit(j);
    try {
      model::ModelConfig::from_hf_json_text(j.dump());
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

}  // namespace engram_model_test
}  // namespace
}  // namespace ds
