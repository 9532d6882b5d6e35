// `deepseek quantize` (model/quantize.h): each recipe writes a folder whose
// matrices are blocks in the formats the recipe names (q4_k where rows are
// whole blocks of 256, q4_1 where they are not, q8_0 for what every token
// reads in q4_k_m), which loads and whose logits, prefill and decode, are
// those of its dequantized weights in float32 (random models are chaotic:
// how far the blocks move them from the source is measured on trained
// models, by perplexity, in docs/performance.md);
// overrides win over the recipe; fp8 sources and MTP layers pass through;
// bad recipes, overrides, folders and block tensors of the wrong size are
// refused with one line. MaxText's mHC and Engram on V3 (QuantizeMhcEngram),
// DeepSeek-V4 (QuantizeV4Test) and V4.1's release formats (QuantizeV41) get
// the same recipes; their tables and mixes stay as they are.
#include "model/quantize.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "infer/engine.h"
#include "infer/model.h"
#include "io/safetensors.h"
#include "model/family_kind.h"
#include "model/hf_params.h"
#include "model/init.h"
#include "model/v4_train.h"
#include "model_fixture.h"
#include "ops/linear.h"
#include "test_util.h"

namespace fs = std::filesystem;
using ds::DType;
using ds::infer::CacheKind;

namespace {
namespace quantize_test {

// Rows of 256 (the hidden size, the experts' width) and of other multiples
// of 32 (the attention's LoRA ranks and heads).
nlohmann::json wide_config() {
  auto j = ds::test::tiny_v3_config();
  j["hidden_size"] = 256;
  j["moe_intermediate_size"] = 256;
  j["intermediate_size"] = 512;
  j["kv_lora_rank"] = 64;
  j["q_lora_rank"] = 96;
  j["qk_nope_head_dim"] = 32;
  j["v_head_dim"] = 32;
  j["qk_rope_head_dim"] = 16;
  j["num_nextn_predict_layers"] = 1;
  return j;
}

std::vector<float> last_logits(const std::string& dir) {
  auto m = ds::infer::load_model(dir);
  ds::infer::KvCache cache(CacheKind::Latent, 1, m->config.num_hidden_layers);
  auto prefill = m->engine->step(cache, {{3, 14, 15, 92, 65, 35, 89, 79}}, false);
  auto decode = m->engine->step(cache, {{32}}, false);  // one decode step (the Gemv kernels)
  prefill.insert(prefill.end(), decode.begin(), decode.end());
  return prefill;
}

// The logits of a V4 or V4.1 folder (ids below the fixtures' vocabularies of
// 64 and more): a prefill of 8 tokens, then 4 decode steps; without the
// roundings' simulation (fp8 entries, fp4 index keys), which a change in the
// last bits can move by a whole rounding step.
std::vector<float> logits(const std::string& dir) {
  ds::infer::ModelOptions o;
  o.quant_sim = false;
  auto m = ds::infer::open_model(dir, o);
  m->load();
  return m->logits({3, 14, 15, 42, 55, 35, 59, 19, 32, 38, 46, 26}, 8, CacheKind::Latent, nullptr);
}

// The largest |a - b| over the largest |b|.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(double(a[i]) - b[i]));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return d / m;
}

std::string stored_dtype(const std::string& dir, const std::string& name) {
  return ds::io::SafetensorsSet::open_dir(dir).info(name).dtype_name;
}

// The format of a stored matrix [out, in]: from its bytes a row.
std::string format_of(const std::string& dir, const std::string& name, int64_t in) {
  const auto info = ds::io::SafetensorsSet::open_dir(dir).info(name);
  if (info.dtype_name != "U8") return info.dtype_name;
  const int64_t row = info.shape[1];
  return row == in / 32 * 34     ? "q8_0"
         : row == in / 256 * 144 ? "q4_k"
         : row == in / 32 * 20   ? "q4_1"
         : row == in / 256 * 210 ? "q6_k"
                                 : "?";
}

// The folder `dir` with every tensor widened to float32 (quantize with
// every tensor overridden to f32): the weights the blocks stand for.
std::string dequantized(const std::string& dir) {
  ds::model::QuantizeOptions opt;
  opt.recipe = "q8_0";
  opt.overrides = {{".*", "f32"}};
  const std::string out = dir + "-f32";
  ds::model::quantize_model(dir, out, opt);
  return out;
}

// The blocks against their dequantized weights: x as it is in every
// product (q4_k's products on 8-bit x are checked against their own
// definition in linear_blocks_test). src_ holds the source folder; quantize()
// writes one under out_.
class QuantizeBase : public ::testing::Test {
 protected:
  void SetUp() override { ds::ops::set_quantized_x(ds::ops::QuantizedX::kF32); }
  void TearDown() override { ds::ops::set_quantized_x(ds::ops::QuantizedX::kInt8); }
  std::string quantize(const std::string& recipe, std::vector<std::pair<std::string, std::string>> overrides = {},
                       const std::string& source = "") {
    const std::string out = (fs::path(out_.path()) / recipe).string();
    ds::model::QuantizeOptions opt;
    opt.recipe = recipe;
    opt.overrides = std::move(overrides);
    report_ = ds::model::quantize_model(source.empty() ? src_.path() : source, out, opt);
    return out;
  }
  ds::test::TempDir src_{"ds_quant_src"}, out_{"ds_quant_out"};
  std::vector<float> want_;
  ds::model::QuantizeReport report_;
};

class QuantizeTest : public QuantizeBase {
 protected:
  void SetUp() override {
    QuantizeBase::SetUp();
    ds::test::write_random_model(src_.path(), wide_config(), 41, {}, /*mtp=*/true);
    std::ofstream(fs::path(src_.path()) / "tokenizer.json") << "{}";
    want_ = last_logits(src_.path());
  }
};

TEST_F(QuantizeTest, RecipesWriteTheirFormatsAndLoad) {
  const std::string expert = "model.layers.1.mlp.experts.3.gate_proj.weight";
  const std::string down = "model.layers.2.mlp.experts.0.down_proj.weight";
  const std::string attn = "model.layers.1.self_attn.q_b_proj.weight";  // 96 columns
  const std::string kvb = "model.layers.1.self_attn.kv_b_proj.weight";  // 64 columns
  struct Want {
    const char* recipe;
    const char *expert, *down, *attn, *embed, *head;
  };
  for (const Want w :
       {Want{"q8_0", "q8_0", "q8_0", "q8_0", "q8_0", "q8_0"}, Want{"q4_k_m", "q4_k", "q4_k", "q8_0", "q8_0", "q8_0"},
        Want{"q4_k", "q4_k", "q4_k", "q4_1", "q4_k", "q8_0"}}) {
    const std::string dir = quantize(w.recipe);
    EXPECT_EQ(format_of(dir, expert, 256), w.expert) << w.recipe;
    EXPECT_EQ(format_of(dir, down, 256), w.down) << w.recipe;
    EXPECT_EQ(format_of(dir, attn, 96), w.attn) << w.recipe;
    EXPECT_EQ(format_of(dir, kvb, 64), std::string(w.attn) == "q4_1" ? "q4_1" : "q8_0") << w.recipe;
    EXPECT_EQ(format_of(dir, "model.embed_tokens.weight", 256), w.embed) << w.recipe;
    EXPECT_EQ(format_of(dir, "lm_head.weight", 256), w.head) << w.recipe;
    // Norms, the router and its bias stay as they were.
    EXPECT_EQ(stored_dtype(dir, "model.layers.1.mlp.gate.weight"),
              stored_dtype(src_.path(), "model.layers.1.mlp.gate.weight"));
    EXPECT_EQ(stored_dtype(dir, "model.norm.weight"), stored_dtype(src_.path(), "model.norm.weight"));
    // The MTP layer is quantized too, and the side files are copied.
    EXPECT_EQ(format_of(dir, "model.layers.3.eh_proj.weight", 512), std::string(w.recipe) == "q4_k" ? "q4_k" : "q8_0");
    EXPECT_TRUE(fs::exists(fs::path(dir) / "tokenizer.json"));
    const auto cfg = nlohmann::json::parse(std::ifstream(fs::path(dir) / "config.json"));
    EXPECT_EQ(cfg["quantization_config"]["quant_method"], "deepseek_cpp");
    EXPECT_EQ(cfg["quantization_config"]["recipe"], w.recipe);
    EXPECT_LT(report_.bytes_out, report_.bytes_in);
    // The blocks compute what their dequantized weights compute in float32
    // (only the order of summation differs), and not what the source did.
    const auto got = last_logits(dir);
    EXPECT_LT(rel_diff(got, last_logits(dequantized(dir))), 1e-4) << w.recipe;
    EXPECT_GT(rel_diff(got, want_), 1e-4) << w.recipe;
  }
}

TEST_F(QuantizeTest, OverridesComeFirst) {
  const std::string dir =
      quantize("q4_k_m", {{R"(model\.layers\.1\.mlp\.experts\.\d+\..*)", "bf16"},
                          {R"(.*\.self_attn\.o_proj\.weight)", "q4_1"},
                          {R"(model\.layers\.2\.mlp\.experts\.[0-3]\..*|.*\.q_b_proj\.weight)", "q6_k"}});
  EXPECT_EQ(format_of(dir, "model.layers.1.mlp.experts.5.up_proj.weight", 256), "BF16");
  EXPECT_EQ(format_of(dir, "model.layers.2.mlp.experts.5.up_proj.weight", 256), "q4_k");
  EXPECT_EQ(format_of(dir, "model.layers.2.mlp.experts.2.up_proj.weight", 256), "q6_k");
  EXPECT_EQ(format_of(dir, "model.layers.1.self_attn.q_b_proj.weight", 96), "q8_0");  // not blocks of 256
  EXPECT_EQ(format_of(dir, "model.layers.0.self_attn.o_proj.weight", 128), "q4_1");
  const auto cfg = nlohmann::json::parse(std::ifstream(fs::path(dir) / "config.json"));
  EXPECT_EQ(cfg["quantization_config"]["overrides"].size(), 3u);
  EXPECT_LT(rel_diff(last_logits(dir), last_logits(dequantized(dir))), 1e-4);
  // A vector cannot be blocks.
  EXPECT_THROW(quantize("q8_0", {{R"(model\.norm\.weight)", "q8_0"}}), ds::Error);
}

TEST_F(QuantizeTest, Fp8SourcesAndRequantizing) {
  ds::test::TempDir fp8("ds_quant_fp8");
  auto c = ds::model::ModelConfig::from_hf_json_text(wide_config().dump());
  ds::model::InitOptions io;
  io.dtype = DType::F8E4M3;
  io.seed = 3;
  ds::model::write_random_checkpoint(c, fp8.path(), io);
  const auto want = last_logits(fp8.path());
  ds::model::QuantizeOptions opt;
  opt.recipe = "q8_0";
  const std::string out = (fs::path(out_.path()) / "from_fp8").string();
  ds::model::quantize_model(fp8.path(), out, opt);
  EXPECT_LT(rel_diff(last_logits(out), last_logits(dequantized(out))), 1e-4);
  // Kept fp8 matrices become bf16 (their block scales have no place here).
  opt.overrides = {{R"(.*\.o_proj\.weight)", "bf16"}};
  const std::string out2 = (fs::path(out_.path()) / "from_fp8_kept").string();
  ds::model::quantize_model(fp8.path(), out2, opt);
  EXPECT_EQ(stored_dtype(out2, "model.layers.0.self_attn.o_proj.weight"), "BF16");
  // A quantized folder quantizes again.
  const std::string again = (fs::path(out_.path()) / "again").string();
  opt.overrides.clear();
  ds::model::quantize_model(out, again, opt);
  EXPECT_LT(rel_diff(last_logits(again), last_logits(dequantized(again))), 1e-4);
  EXPECT_GT(rel_diff(last_logits(again), want), 0);
}

TEST_F(QuantizeTest, BadInputsAreRefused) {
  ds::model::QuantizeOptions opt;
  opt.recipe = "q3_k";
  EXPECT_THROW(ds::model::quantize_model(src_.path(), out_.path() + "/x", opt), ds::Error);
  EXPECT_THROW(ds::model::parse_quantize_override("[unclosed=q8_0"), ds::Error);
  EXPECT_THROW(ds::model::parse_quantize_override(".*=q2_k"), ds::Error);
  EXPECT_THROW(ds::model::parse_quantize_override("no-format"), ds::Error);
  EXPECT_EQ(ds::model::parse_quantize_override("a=b=q8_0").first, "a=b");
  opt.recipe = "q8_0";
  EXPECT_THROW(ds::model::quantize_model(src_.path(), src_.path(), opt), ds::Error);  // onto itself
  EXPECT_THROW(ds::model::quantize_model(src_.path() + "/none", out_.path() + "/y", opt), ds::Error);
  // A block tensor whose rows are not the matrix's blocks, and U8 where the
  // folder does not say it is quantized.
  const std::string dir = quantize("q8_0");
  auto cfg = nlohmann::json::parse(std::ifstream(fs::path(dir) / "config.json"));
  cfg.erase("quantization_config");
  std::ofstream(fs::path(dir) / "config.json") << cfg.dump();
  EXPECT_THROW(ds::infer::load_model(dir), ds::Error);
  const ds::io::SafetensorsSet st = ds::io::SafetensorsSet::open_dir(dir);
  std::vector<ds::io::SafetensorsWriter::Entry> entries;
  for (const auto& n : st.names()) {
    auto i = st.info(n);
    if (n == "lm_head.weight") i.shape[1] -= 2;
    const uint64_t bytes = static_cast<uint64_t>(ds::shape_numel(i.shape)) * (i.dtype_name == "F32"    ? 4
                                                                              : i.dtype_name == "BF16" ? 2
                                                                                                       : 1);
    entries.push_back({n, i.dtype_name, i.shape, bytes});
  }
  const std::string bad = (fs::path(out_.path()) / "bad").string();
  fs::create_directories(bad);
  {
    ds::io::SafetensorsWriter w(bad + "/model.safetensors", entries);
    for (const auto& e : entries) {
      std::vector<uint8_t> zeros(e.bytes, 0);
      w.write(zeros.data(), zeros.size());
    }
    w.commit();
  }
  cfg["quantization_config"] = {{"quant_method", "deepseek_cpp"}, {"format_version", 1}};
  std::ofstream(fs::path(bad) / "config.json") << cfg.dump();
  try {
    ds::infer::load_model(bad);
    ADD_FAILURE() << "a block tensor of the wrong row size loaded";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("272 bytes for q8_0"), std::string::npos) << e.what();
  }
  cfg["quantization_config"]["format_version"] = 2;
  std::ofstream(fs::path(bad) / "config.json") << cfg.dump();
  EXPECT_THROW(ds::infer::load_model(bad), ds::Error);
}

// MaxText's mHC and Engram on a V3 model: the recipes quantize the
// projections (Engram's key and value included); the mHC mixes, the Engram
// table and its conv kernel stay as they are.
using QuantizeMhcEngram = QuantizeBase;

TEST_F(QuantizeMhcEngram, ProjectionsQuantizeTablesAndMixesStay) {
  auto j = wide_config();
  j["num_nextn_predict_layers"] = 0;  // an mHC model has no MTP depth
  j["mhc_expansion_rate"] = 2;
  j["engram_layers"] = {1};
  j["engram_max_ngram_size"] = 3;
  j["engram_num_heads"] = 2;
  j["engram_head_dim"] = 32;
  j["engram_vocab_bases"] = {509, 521};
  j["engram_kernel_size"] = 4;
  j["engram_compress_tokens"] = false;
  ds::test::write_random_model(src_.path(), j, 43);
  const std::string dir = quantize("q4_k_m");
  EXPECT_EQ(format_of(dir, "model.layers.1.mlp.experts.3.gate_proj.weight", 256), "q4_k");
  EXPECT_EQ(format_of(dir, "model.layers.1.engram.value_proj.weight", 128), "q8_0");
  for (const char* kept : {"model.layers.1.engram.embedding.weight", "model.layers.1.engram.short_conv.weight",
                           "model.layers.1.mhc_attention.fn"})
    EXPECT_EQ(stored_dtype(dir, kept), stored_dtype(src_.path(), kept)) << kept;
  const auto got = last_logits(dir);
  EXPECT_LT(rel_diff(got, last_logits(dequantized(dir))), 1e-4);
  EXPECT_GT(rel_diff(got, last_logits(src_.path())), 1e-4);
}

// DeepSeek-V4 (configs/v4-tiny.yml widened so that the embedding, the
// experts and the first projections have rows of 256): the same recipes over
// its upstream names. The indexer, the router, the vectors and tid2eid stay
// as they are; the logits, a prefill of 8 tokens and 4 decode steps, are
// those of the dequantized weights.
class QuantizeV4Test : public QuantizeBase {
 protected:
  void SetUp() override {
    QuantizeBase::SetUp();
    auto cfg = ds::model::v4_preset(std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml",
                                    {"base_emb_dim=256", "base_mlp_dim=256", "base_moe_mlp_dim=256"});
    ASSERT_TRUE(cfg.has_value());
    auto params = ds::model::V4FlatParams::zeros(*cfg);
    ds::model::init_v4_params(*cfg, params, 7, 0.05f);
    params.sync_tables(*cfg);
    ds::model::export_v4_hf(src_.path(), *cfg, params.data.data(), DType::BF16, "test");
    want_ = logits(src_.path());
  }
};

TEST_F(QuantizeV4Test, RecipesWriteTheirFormatsAndLoad) {
  struct Want {
    const char* recipe;
    const char *expert, *shared, *attn, *embed, *head;
  };
  for (const Want w :
       {Want{"q8_0", "q8_0", "q8_0", "q8_0", "q8_0", "q8_0"}, Want{"q4_k_m", "q4_k", "q8_0", "q8_0", "q8_0", "q8_0"},
        Want{"q4_k", "q4_k", "q4_k", "q4_k", "q4_k", "q8_0"}}) {
    const std::string dir = quantize(w.recipe);
    EXPECT_EQ(format_of(dir, "layers.1.ffn.experts.3.w1.weight", 256), w.expert) << w.recipe;
    EXPECT_EQ(format_of(dir, "layers.2.ffn.experts.0.w2.weight", 256), w.expert) << w.recipe;
    EXPECT_EQ(format_of(dir, "layers.1.ffn.shared_experts.w2.weight", 256), w.shared) << w.recipe;
    EXPECT_EQ(format_of(dir, "layers.0.attn.wq_a.weight", 256), w.attn) << w.recipe;
    EXPECT_EQ(format_of(dir, "embed.weight", 256), w.embed) << w.recipe;
    EXPECT_EQ(format_of(dir, "head.weight", 256), w.head) << w.recipe;
    // The indexer, the router, the vectors and the hash table stay as they were.
    EXPECT_EQ(stored_dtype(dir, "layers.1.attn.indexer.wq_b.weight"), "BF16");
    EXPECT_EQ(stored_dtype(dir, "layers.1.ffn.gate.weight"), "BF16");
    EXPECT_EQ(stored_dtype(dir, "layers.1.attn_norm.weight"), "F32");
    EXPECT_EQ(stored_dtype(dir, "layers.0.ffn.gate.tid2eid"), "I32");
    const auto cfg = nlohmann::json::parse(std::ifstream(fs::path(dir) / "config.json"));
    EXPECT_EQ(cfg["quantization_config"]["quant_method"], "deepseek_cpp");
    EXPECT_FALSE(cfg.contains("expert_dtype"));
    EXPECT_LT(report_.bytes_out, report_.bytes_in);
    const auto got = logits(dir);
    ASSERT_EQ(got.size(), want_.size());
    EXPECT_LT(rel_diff(got, logits(dequantized(dir))), 1e-4) << w.recipe;
    EXPECT_GT(rel_diff(got, want_), 1e-4) << w.recipe;
  }
}

TEST_F(QuantizeV4Test, BadFoldersAreRefused) {
  // A block tensor where the folder does not say it is quantized.
  const std::string dir = quantize("q8_0");
  auto cfg = nlohmann::json::parse(std::ifstream(fs::path(dir) / "config.json"));
  cfg.erase("quantization_config");
  std::ofstream(fs::path(dir) / "config.json") << cfg.dump();
  EXPECT_THROW(logits(dir), ds::Error);
  // The hash table takes no block format.
  ds::model::QuantizeOptions opt;
  opt.recipe = "q8_0";
  opt.overrides = {{R"(.*\.tid2eid)", "q8_0"}};
  EXPECT_THROW(ds::model::quantize_model(src_.path(), out_.path() + "/t", opt), ds::Error);
}

// DeepSeek-V4.1 in its release's formats (tests/data/v41: fp8 projections,
// fp4 experts, fp8 Engram tables with E8M0 scales): the Engram tables are
// written byte for byte (they stay on disk when served), the matrices as
// blocks, and the text model's config reads the new quantization_config.
using QuantizeV41 = QuantizeBase;

TEST_F(QuantizeV41, ReleaseFormatsQuantizeAndEngramTablesStay) {
  const std::string src = std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/v41/models/v41_tiny";
  const std::string dir = quantize("q4_k_m", {}, src);
  EXPECT_EQ(format_of(dir, "layers.1.ffn.experts.0.w1.weight", 64), "q4_1");  // rows of 64: not blocks of 256
  EXPECT_EQ(format_of(dir, "layers.0.engram.wkv.weight", 64), "q8_0");
  const auto a = ds::io::SafetensorsSet::open_dir(src), b = ds::io::SafetensorsSet::open_dir(dir);
  for (const char* kept : {"layers.0.engram.embed.weight", "layers.0.engram.embed.scale"}) {
    ASSERT_EQ(b.info(kept).dtype_name, a.info(kept).dtype_name) << kept;
    const auto& i = a.info(kept);
    EXPECT_TRUE(std::equal(a.bytes(kept), a.bytes(kept) + (i.end - i.begin), b.bytes(kept))) << kept;
  }
  const auto cfg = nlohmann::json::parse(std::ifstream(fs::path(dir) / "config.json"));
  EXPECT_EQ(cfg["quantization_config"]["quant_method"], "deepseek_cpp");
  EXPECT_FALSE(cfg["text_config"].contains("quantization_config"));
  const auto got = logits(dir);
  EXPECT_LT(rel_diff(got, logits(dequantized(dir))), 1e-4);
  EXPECT_GT(rel_diff(got, logits(src)), 1e-4);
}

}  // namespace quantize_test
}  // namespace
