// DeepSeek-V4.1 (model_type deepseek_v41) against the independent float64
// reference (tests/reference/deepseek_v41_ref.py) on the tiny folders in
// tests/data/v41/models, written by make_v41_fixtures.py:
//   v41_tiny:     the checkpoint's formats (fp8 32x32 blocks with E8M0
//                 scales, packed fp4 experts, an fp8 Engram table with an
//                 E8M0 scale per 32 columns);
//   v41_tiny_f32: the same shapes in float32.
// Both have six layers: window-only, a ratio-2 KV and index source with its
// reader, a ratio-1 KV, index and candidate source with its reader, and an
// index source restricted to the candidates; Engram before layers 0 and 2;
// lagged mHC. The logits of prompts of 1 to 40 tokens must match to 1e-5
// of the largest logit, with and without the roundings' simulation, and
// decoding a token at a time, or all prompts as one batch, must give what
// one full forward gives.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "infer/v4_engine.h"
#include "io/safetensors.h"
#include "model/v4_model.h"
#include "test_util.h"

using namespace ds::model;

namespace {
namespace v41_model_test {

std::string fixture_dir(const std::string& name) {
  return std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/v41/models/" + name;
}

struct Fixture {
  std::string dir;
  std::unique_ptr<ds::infer::LoadedV4Model> m;
  std::vector<std::vector<int32_t>> tokens;
};

std::unique_ptr<Fixture> load(const std::string& name, bool qat = true) {
  auto f = std::make_unique<Fixture>();
  f->dir = fixture_dir(name);
  f->m = ds::infer::load_v4_model(f->dir, V4Options{qat});
  std::ifstream in(f->dir + "/tokens.json");
  f->tokens = nlohmann::json::parse(in).get<std::vector<std::vector<int32_t>>>();
  return f;
}

std::vector<float> expected(const std::string& dir, const std::string& name) {
  auto e = ds::io::SafetensorsFile::open(dir + "/expected.safetensors");
  return e.tensor(name).to_vector();
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

// Every row of [rows, V] within tol (plus slack[row], when given) of want.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, int64_t V, double tol,
                  const std::string& what, const std::vector<float>& slack = {}) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t r = 0; r < want.size() / static_cast<size_t>(V); ++r) {
    double worst = 0;
    for (int64_t v = 0; v < V; ++v) worst = std::max(worst, std::fabs(double(got[r * V + v]) - want[r * V + v]));
    EXPECT_LE(worst, tol + (slack.empty() ? 0.0 : double(slack[r]))) << what << " row " << r;
  }
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

class V41Reference : public ::testing::TestWithParam<const char*> {};

TEST_P(V41Reference, FullForwardMatchesTheReference) {
  for (bool qat : {true, false}) {
    auto f = load(GetParam(), qat);
    V4Model& model = *f->m->model;
    const int64_t V = f->m->config.vocab_size;
    for (size_t s = 0; s < f->tokens.size(); ++s) {
      const auto& ids = f->tokens[s];
      const auto want = expected(f->dir, fmt::format("{}.{}", qat ? "logits" : "logits_noqat", s));
      // flip_delta: how far the reference's logits move when its roundings
      // nearest to a boundary go the other way (the simulations only).
      std::vector<float> slack;
      if (qat) slack = expected(f->dir, fmt::format("flip_delta.{}", s));
      V4State st = model.new_state();
      const auto got = model.forward(st, ids.data(), static_cast<int64_t>(ids.size()), true);
      expect_close(got, want, V, 1e-5 * max_abs(want),
                   fmt::format("{} {} seq {}", GetParam(), qat ? "qat" : "no-qat", s), slack);
      EXPECT_EQ(st.bytes(), v4_state_bytes(f->m->config, st.length, /*codes=*/qat));
    }
  }
}

// One token at a time after a prefix (the decode path: the ratio-2
// compressor's open pair, the Engram history, each layer's window ring),
// and every prompt in one batch, give the full forward's logits.
TEST_P(V41Reference, DecodeAndBatchEqualTheFullForward) {
  for (bool qat : {true, false}) {
    auto f = load(GetParam(), qat);
    V4Model& model = *f->m->model;
    const int64_t V = f->m->config.vocab_size;
    std::vector<V4State> states;
    std::vector<V4Request> batch;
    std::vector<float> all_full, all_slack;
    const double tol = qat && std::string(GetParam()) == "v41_tiny" ? 5e-5 : 1e-5;
    for (size_t s = 0; s < f->tokens.size(); ++s) states.push_back(model.new_state());
    for (size_t s = 0; s < f->tokens.size(); ++s) {
      const auto& ids = f->tokens[s];
      const int64_t T = static_cast<int64_t>(ids.size());
      V4State full_state = model.new_state();
      const auto full = model.forward(full_state, ids.data(), T, true);
      all_full.insert(all_full.end(), full.begin(), full.end());
      // With the roundings, a value within float32 sums' reach of a boundary
      // (v41_tiny's token 7 of the 40) may round either way on another
      // kernel path: as far as flip_delta says the logits then move. The
      // one-row kernels of AVX2 and the scalar path round v41_tiny's fp4
      // entries a little differently again (rows 26-32 of the 40 move by
      // 1.6e-5 of the largest logit), hence 5e-5 there.
      std::vector<float> slack;
      if (qat) slack = expected(f->dir, fmt::format("flip_delta.{}", s));
      all_slack.insert(all_slack.end(), slack.begin(), slack.end());
      batch.push_back({&states[s], ids.data(), T});
      for (int64_t prefix : {int64_t{1}, T / 2 + 1}) {
        if (prefix > T) continue;
        V4State st = model.new_state();
        auto got = model.forward(st, ids.data(), prefix, true);
        for (int64_t t = prefix; t < T; ++t) {
          const auto one = model.forward(st, ids.data() + t, 1, true);
          got.insert(got.end(), one.begin(), one.end());
        }
        expect_close(got, full, V, tol * max_abs(full),
                     fmt::format("{} {} seq {} decode after {}", GetParam(), qat ? "qat" : "no-qat", s, prefix), slack);
      }
    }
    const auto together = model.forward(batch, true);
    expect_close(together, all_full, V, tol * max_abs(all_full),
                 fmt::format("{} {} batch", GetParam(), qat ? "qat" : "no-qat"), all_slack);
  }
}

// DeepSeek's released decode (late_index_keys): at the steps where a
// ratio-2 source's pair is still open, its layer scores the keys published
// last; the reference's token-by-token decode of that code's rule, after
// the prefill it records, and it differs from the full forward.
TEST_P(V41Reference, LateIndexKeysFollowTheReleasedDecode) {
  auto f = load(GetParam(), true);
  V4Options opt;
  opt.late_index_keys = true;
  V4Model model(f->m->config, f->m->weights.view, opt);
  const int64_t V = f->m->config.vocab_size;
  auto e = ds::io::SafetensorsFile::open(f->dir + "/expected.safetensors");
  int checked = 0;
  for (size_t s = 0; s < f->tokens.size(); ++s) {
    const std::string key = fmt::format("decode_prefill.{}", s);
    if (!e.metadata().count(key)) continue;
    const int64_t P = std::stoll(e.metadata().at(key));
    const auto& ids = f->tokens[s];
    const int64_t T = static_cast<int64_t>(ids.size());
    V4State st = model.new_state();
    auto got = model.forward(st, ids.data(), P, true);
    for (int64_t t = P; t < T; ++t) {
      const auto one = model.forward(st, ids.data() + t, 1, true);
      got.insert(got.end(), one.begin(), one.end());
    }
    const auto want = e.tensor(fmt::format("decode_shipped.{}", s)).to_vector();
    const auto slack = e.tensor(fmt::format("flip_delta.{}", s)).to_vector();
    // flip_delta measures the full forward's near-boundary roundings; this
    // decode path rounds other values (v41_tiny's rows 33-39 move by up to
    // 2.3e-5 of the largest logit, v41_tiny_f32's stay within 1e-5).
    const double tol = std::string(GetParam()) == "v41_tiny" ? 5e-5 : 1e-5;
    expect_close(got, want, V, tol * max_abs(want), fmt::format("{} shipped decode seq {}", GetParam(), s), slack);
    const auto full = e.tensor(fmt::format("logits.{}", s)).to_vector();
    EXPECT_GT(max_abs_diff(want, full), 1e-2 * max_abs(full)) << "the released rule changes nothing here";
    ++checked;
  }
  EXPECT_EQ(checked, 2);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, V41Reference, ::testing::Values("v41_tiny", "v41_tiny_f32"));

// The fixture's tokenizer pairs ids 2k and 2k + 1 into Engram class k; the
// fp8 table stays in the mapped file (no copy, no widening).
TEST(V41Load, TokenClassesAndTheTableInPlace) {
  auto f = load("v41_tiny");
  const V4Config& c = f->m->config;
  ASSERT_TRUE(c.engram_token_classes);
  ASSERT_EQ(static_cast<int64_t>(c.engram_token_classes->size()), c.vocab_size);
  for (int64_t i = 0; i < c.vocab_size; ++i) EXPECT_EQ((*c.engram_token_classes)[i], i / 2) << i;
  for (int64_t l : c.engram_layers) {
    const auto& t = f->m->weights.tensors.layers[static_cast<size_t>(l)].engram.embed;
    EXPECT_TRUE(t.f32.empty());
    const std::string name = fmt::format("layers.{}.engram.embed.weight", l);
    EXPECT_EQ(t.view.data, f->m->files.bytes(name));
    EXPECT_EQ(t.view.dtype, ds::DType::F8E4M3);
    EXPECT_EQ(t.view.scale_e8m0, f->m->files.bytes(fmt::format("layers.{}.engram.embed.scale", l)));
  }
  EXPECT_EQ(c.generation, V4Generation::V41);
  EXPECT_FALSE(c.q_head_norm());
  EXPECT_TRUE(c.lagged_mhc());
}

// The official inference code's flat config.json names read as the
// released nested file does.
TEST(V41Config, FlatOfficialNamesReadAsTheReleasedFile) {
  const auto root = nlohmann::json::parse(std::ifstream(fixture_dir("v41_tiny") + "/config.json"));
  const V4Config nested = V4Config::from_v41_json(root, "config.json");
  const nlohmann::json& t = root["text_config"];
  nlohmann::json flat = {{"vocab_size", t["vocab_size"]},
                         {"dim", t["hidden_size"]},
                         {"n_layers", t["num_hidden_layers"]},
                         {"n_heads", t["num_attention_heads"]},
                         {"head_dim", t["head_dim"]},
                         {"rope_head_dim", t["qk_rope_head_dim"]},
                         {"q_lora_rank", t["q_lora_rank"]},
                         {"o_groups", t["o_groups"]},
                         {"o_lora_rank", t["o_lora_rank"]},
                         {"window_size", t["sliding_window"]},
                         {"compress_ratios", t["compress_ratios"]},
                         {"kv_source_layers", t["kv_source_layer_ids"]},
                         {"index_source_layers", t["index_source_layer_ids"]},
                         {"candidate_source_layer", t["candidate_source_layer_id"]},
                         {"candidate_topk_blocks", t["candidate_topk_blocks"]},
                         {"candidate_block_size", t["candidate_block_size"]},
                         {"index_n_heads", t["index_n_heads"]},
                         {"index_head_dim", t["index_head_dim"]},
                         {"index_topk", t["index_topk"]},
                         {"rope_theta", t["rope_theta"]},
                         {"compress_rope_theta", t["compress_rope_theta"]},
                         {"rope_factor", t["rope_scaling"]["factor"]},
                         {"original_seq_len", t["rope_scaling"]["original_max_position_embeddings"]},
                         {"beta_fast", t["rope_scaling"]["beta_fast"]},
                         {"beta_slow", t["rope_scaling"]["beta_slow"]},
                         {"max_position_embeddings", t["max_position_embeddings"]},
                         {"n_routed_experts", t["n_routed_experts"]},
                         {"n_shared_experts", t["n_shared_experts"]},
                         {"n_activated_experts", t["num_experts_per_tok"]},
                         {"moe_inter_dim", t["moe_intermediate_size"]},
                         {"score_func", t["scoring_func"]},
                         {"route_scale", t["routed_scaling_factor"]},
                         {"swiglu_limit", t["swiglu_limit"]},
                         {"hc_mult", t["hc_mult"]},
                         {"hc_sinkhorn_iters", t["hc_sinkhorn_iters"]},
                         {"hc_eps", t["hc_eps"]},
                         {"norm_eps", t["rms_norm_eps"]},
                         {"expert_dtype", "fp4"},
                         {"engram_layer_ids", t["engram_layer_ids"]},
                         {"engram_num_embeddings", t["engram_num_embeddings"]},
                         {"engram_max_ngram_size", t["engram_max_ngram_size"]},
                         {"engram_n_heads", t["engram_n_heads"]},
                         {"engram_head_dim", t["engram_head_dim"]},
                         {"engram_vocab_size", t["engram_vocab_size"]},
                         {"engram_pad_id", t["engram_pad_token_id"]},
                         {"engram_compressed_vocab_size", t["engram_compressed_vocab_size"]},
                         {"image_token_id", root["image_token_id"]}};
  ASSERT_TRUE(v41_flat_config(flat));
  const V4Config c = V4Config::from_v41_json(flat, "inference/config.json");
  EXPECT_EQ(c.to_hf_json(), nested.to_hf_json());
  EXPECT_EQ(c.fp8_block_rows, 32);
  // The written config.json reads back to the same config.
  EXPECT_EQ(V4Config::from_hf_json_text(nested.to_hf_json().dump()).to_hf_json(), nested.to_hf_json());
}

// Impossible CSA2 layouts and Engram keys: one clear error each.
TEST(V41Config, ImpossibleLayoutsAreRefused) {
  const auto root = nlohmann::json::parse(std::ifstream(fixture_dir("v41_tiny") + "/config.json"));
  auto with = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = root;
    j["text_config"][key] = value;
    return j.dump();
  };
  expect_error([&] { V4Config::from_hf_json_text(with("kv_source_layer_ids", {0, 1, 3})); }, "has compress ratio 0");
  expect_error([&] { V4Config::from_hf_json_text(with("kv_source_layer_ids", {3})); }, "no KV source layer");
  expect_error([&] { V4Config::from_hf_json_text(with("index_source_layer_ids", {3, 5})); }, "index source");
  expect_error([&] { V4Config::from_hf_json_text(with("candidate_source_layer_id", 4)); }, "not an index source");
  expect_error(
      [&] {
        V4Config::from_hf_json_text(with("compress_ratios", {0, 4, 4, 1, 1, 1}));
      },
      "not a DeepSeek-V4.1 ratio");
  expect_error([&] { V4Config::from_hf_json_text(with("engram_layer_ids", {0, 9})); }, "engram_layer_ids");
  expect_error([&] { V4Config::from_hf_json_text(with("engram_num_embeddings", {5})); }, "engram_num_embeddings");
  expect_error([&] { V4Config::from_hf_json_text(with("engram_max_ngram_size", 1)); }, "engram_max_ngram_size");
  expect_error([&] { V4Config::from_hf_json_text(with("engram_compressed_vocab_size", 1000)); },
               "engram_compressed_vocab_size");
  nlohmann::json no_text = root;
  no_text.erase("text_config");
  expect_error([&] { V4Config::from_hf_json_text(no_text.dump()); }, "text_config");
}

// A folder whose tokenizer gives another class count, or none, is refused.
TEST(V41Load, TokenizerMustMatchTheEngramClasses) {
  ds::test::TempDir tmp("ds_v41_tok");
  const std::string src = fixture_dir("v41_tiny");
  for (const char* file : {"config.json", "model.safetensors"})
    std::filesystem::copy_file(src + "/" + file, tmp.path() + "/" + file);
  expect_error([&] { ds::infer::load_v4_config(tmp.path()); }, "no tokenizer.json");
  auto root = nlohmann::json::parse(std::ifstream(src + "/config.json"));
  root["text_config"]["engram_compressed_vocab_size"] = 31;
  std::ofstream(tmp.path() + "/config.json") << root.dump();
  std::filesystem::copy_file(src + "/tokenizer.json", tmp.path() + "/tokenizer.json");
  expect_error([&] { ds::infer::load_v4_config(tmp.path()); }, "engram_compressed_vocab_size says 31");
}

}  // namespace v41_model_test
}  // namespace
