// GGUF export (model/gguf_export.h) of a tiny DeepSeek-V3 folder, read back
// with io::gguf::Reader and checked against what llama.cpp's deepseek2
// loader reads (tools' convert_hf_to_gguf.py writes the same): every key with
// its exact type, the exact set of tensor names and ggml shapes, and the
// values: kv_b_proj split per head into attn_k_b (transposed) and attn_v_b,
// experts stacked with the expert slowest, norms, biases and the router in
// F32, bf16 as rounded, q8_0 blocks as ggml's reference quantizer makes
// them. That llama.cpp itself loads the file and generates the same greedy
// tokens is bench/llamacpp_compare.sh's check (it needs llama.cpp built).
#include "model/gguf_export.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/dtype.h"
#include "core/error.h"
#include "infer/engine.h"
#include "infer/model.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "model/gguf_import.h"
#include "model/load.h"
#include "model/quantize.h"
#include "model_fixture.h"
#include "ops/block_quant.h"

namespace {
namespace gguf_export_test {

namespace fs = std::filesystem;
namespace gguf = ds::io::gguf;
using json = nlohmann::json;

class GgufExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ds_gguf_export_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    cfg_ = ds::test::tiny_v3_config();
    cfg_["vocab_size"] = 300;
    cfg_["bos_token_id"] = 285;
    cfg_["eos_token_id"] = 286;
    ds::test::write_random_model(dir_ + "/hf", cfg_, 5);
    // The tiny test tokenizer with DeepSeek-V3's pre-tokenizer.
    json t = json::parse(std::ifstream(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/tokenizer/tiny/tokenizer.json"));
    t["pre_tokenizer"] = v3_pre();
    std::ofstream(dir_ + "/hf/tokenizer.json") << t.dump();
    tok_ = t;
  }
  void TearDown() override { fs::remove_all(dir_); }

  static json v3_pre() {
    auto split = [](const std::string& re) {
      return json{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", "Isolated"}, {"invert", false}};
    };
    return {{"type", "Sequence"},
            {"pretokenizers",
             {split("\\p{N}{1,3}"), split("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"),
              split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
                    "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
  }
  // dir_/wide: rows of 256 where the blocks need them (hidden, experts),
  // 96 and 64 columns elsewhere.
  void write_wide() {
    auto wide = cfg_;
    wide["hidden_size"] = 256;
    wide["moe_intermediate_size"] = 256;
    wide["intermediate_size"] = 512;
    wide["kv_lora_rank"] = 64;
    wide["q_lora_rank"] = 96;
    ds::test::write_random_model(dir_ + "/wide", wide, 9);
    std::ofstream(dir_ + "/wide/tokenizer.json") << tok_.dump();
  }
  gguf::Reader exported(const std::string& type) {
    const std::string out = dir_ + "/m-" + type + ".gguf";
    ds::model::export_gguf(dir_ + "/hf", out, type);
    return gguf::Reader::open(out);
  }
  std::vector<float> hf(const std::string& name) const {
    return ds::io::SafetensorsSet::open_dir(dir_ + "/hf").tensor(name).to_vector();
  }
  static std::vector<float> f32(const gguf::Reader& r, const std::string& name) {
    const auto* t = r.tensor(name);
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    EXPECT_EQ(t->type, gguf::TensorType::F32) << name;
    const auto d = r.data(*t);
    std::vector<float> v(d.size() / 4);
    std::memcpy(v.data(), d.data(), d.size());
    return v;
  }

  std::string dir_;
  json cfg_, tok_;
};

TEST_F(GgufExportTest, KeysAreLlamaCppsWithTheirTypes) {
  const auto r = exported("f32");
  auto u32 = [&](const std::string& k) {
    const auto* v = r.find(k);
    EXPECT_NE(v, nullptr) << k;
    if (!v) return uint64_t{0};
    EXPECT_EQ(v->type, gguf::ValueType::UInt32) << k;
    return std::get<uint64_t>(v->scalar);
  };
  auto f32v = [&](const std::string& k) {
    const auto* v = r.find(k);
    EXPECT_NE(v, nullptr) << k;
    if (!v) return 0.0;
    EXPECT_EQ(v->type, gguf::ValueType::Float32) << k;
    return std::get<double>(v->scalar);
  };
  EXPECT_EQ(std::get<std::string>(r.find("general.architecture")->scalar), "deepseek2");
  EXPECT_EQ(u32("general.file_type"), 0u);
  EXPECT_EQ(u32("deepseek2.block_count"), 3u);  // the MTP layer is left out
  EXPECT_EQ(u32("deepseek2.context_length"), 128u);
  EXPECT_EQ(u32("deepseek2.embedding_length"), 32u);
  EXPECT_EQ(u32("deepseek2.feed_forward_length"), 48u);
  EXPECT_EQ(u32("deepseek2.attention.head_count"), 4u);
  EXPECT_EQ(u32("deepseek2.attention.head_count_kv"), 1u);
  EXPECT_EQ(u32("deepseek2.attention.q_lora_rank"), 24u);
  EXPECT_EQ(u32("deepseek2.attention.kv_lora_rank"), 16u);
  EXPECT_EQ(u32("deepseek2.attention.key_length"), 16u + 8u);
  EXPECT_EQ(u32("deepseek2.attention.value_length"), 16u);
  EXPECT_EQ(u32("deepseek2.attention.key_length_mla"), 12u + 8u);
  EXPECT_EQ(u32("deepseek2.attention.value_length_mla"), 12u);
  EXPECT_EQ(u32("deepseek2.rope.dimension_count"), 8u);
  EXPECT_EQ(u32("deepseek2.leading_dense_block_count"), 1u);
  EXPECT_EQ(u32("deepseek2.expert_feed_forward_length"), 16u);
  EXPECT_EQ(u32("deepseek2.expert_count"), 8u);
  EXPECT_EQ(u32("deepseek2.expert_used_count"), 2u);
  EXPECT_EQ(u32("deepseek2.expert_shared_count"), 1u);
  EXPECT_EQ(u32("deepseek2.expert_gating_func"), 2u);  // sigmoid
  EXPECT_EQ(u32("deepseek2.expert_group_count"), 4u);
  EXPECT_EQ(u32("deepseek2.expert_group_used_count"), 2u);
  EXPECT_FLOAT_EQ(f32v("deepseek2.expert_weights_scale"), 2.5);
  EXPECT_TRUE(std::get<bool>(r.find("deepseek2.expert_weights_norm")->scalar));
  EXPECT_FLOAT_EQ(f32v("deepseek2.attention.layer_norm_rms_epsilon"), 1e-6);
  EXPECT_FLOAT_EQ(f32v("deepseek2.rope.freq_base"), 10000);
  EXPECT_EQ(std::get<std::string>(r.find("deepseek2.rope.scaling.type")->scalar), "yarn");
  EXPECT_FLOAT_EQ(f32v("deepseek2.rope.scaling.factor"), 4);
  EXPECT_EQ(u32("deepseek2.rope.scaling.original_context_length"), 16u);
  EXPECT_FLOAT_EQ(f32v("deepseek2.rope.scaling.yarn_log_multiplier"), 0.1);  // 0.1 x mscale_all_dim
  // The tokenizer: every id's token, its kind, the merges, the special ids.
  EXPECT_EQ(std::get<std::string>(r.find("tokenizer.ggml.model")->scalar), "gpt2");
  EXPECT_EQ(std::get<std::string>(r.find("tokenizer.ggml.pre")->scalar), "deepseek-v3");
  const auto* tokens = r.find("tokenizer.ggml.tokens");
  const auto* types = r.find("tokenizer.ggml.token_type");
  ASSERT_EQ(tokens->array.size(), 300u);
  ASSERT_EQ(types->array_type, gguf::ValueType::Int32);
  // Added tokens are CONTROL (special) or USER_DEFINED, whether or not the
  // BPE vocabulary has them too; the rest NORMAL.
  std::map<size_t, int64_t> added;
  for (const auto& a : tok_["added_tokens"]) added[a["id"].get<size_t>()] = a.value("special", false) ? 3 : 4;
  for (const auto& [text, id] : tok_["model"]["vocab"].items()) {
    const size_t i = id.get<size_t>();
    if (!added.count(i)) {
      EXPECT_EQ(std::get<std::string>(tokens->array[i]), text);
    }
    EXPECT_EQ(std::get<int64_t>(types->array[i]), added.count(i) ? added[i] : 1) << text;
  }
  for (const auto& a : tok_["added_tokens"])
    EXPECT_EQ(std::get<std::string>(tokens->array[a["id"].get<size_t>()]), a["content"].get<std::string>());
  EXPECT_EQ(std::get<std::string>(tokens->array[299]), "[PAD299]");
  EXPECT_EQ(std::get<int64_t>(types->array[299]), 5);
  EXPECT_EQ(r.find("tokenizer.ggml.merges")->array.size(), tok_["model"]["merges"].size());
  EXPECT_EQ(u32("tokenizer.ggml.bos_token_id"), 285u);
  EXPECT_EQ(u32("tokenizer.ggml.eos_token_id"), 286u);
  EXPECT_TRUE(std::get<bool>(r.find("tokenizer.ggml.add_bos_token")->scalar));
}

TEST_F(GgufExportTest, TensorsAreDeepseek2sNamesShapesAndValues) {
  const auto r = exported("f32");
  // The loader's list, from the config (ggml shapes, fastest first).
  const int64_t E = 32, V = 300, H = 4, QL = 24, KVL = 16, R = 8, NOPE = 12, VD = 12, F = 48, FE = 16, X = 8;
  std::map<std::string, std::vector<int64_t>> want = {
      {"token_embd.weight", {E, V}}, {"output_norm.weight", {E}}, {"output.weight", {E, V}}};
  for (int l = 0; l < 3; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    want[b + "attn_norm.weight"] = {E};
    want[b + "ffn_norm.weight"] = {E};
    want[b + "attn_q_a.weight"] = {E, QL};
    want[b + "attn_q_a_norm.weight"] = {QL};
    want[b + "attn_q_b.weight"] = {QL, H * (NOPE + R)};
    want[b + "attn_kv_a_mqa.weight"] = {E, KVL + R};
    want[b + "attn_kv_a_norm.weight"] = {KVL};
    want[b + "attn_k_b.weight"] = {NOPE, KVL, H};
    want[b + "attn_v_b.weight"] = {KVL, VD, H};
    want[b + "attn_output.weight"] = {H * VD, E};
    if (l == 0) {
      want[b + "ffn_gate.weight"] = {E, F};
      want[b + "ffn_up.weight"] = {E, F};
      want[b + "ffn_down.weight"] = {F, E};
    } else {
      want[b + "ffn_gate_inp.weight"] = {E, X};
      want[b + "exp_probs_b.bias"] = {X};
      want[b + "ffn_gate_exps.weight"] = {E, FE, X};
      want[b + "ffn_up_exps.weight"] = {E, FE, X};
      want[b + "ffn_down_exps.weight"] = {FE, E, X};
      want[b + "ffn_gate_shexp.weight"] = {E, FE};
      want[b + "ffn_up_shexp.weight"] = {E, FE};
      want[b + "ffn_down_shexp.weight"] = {FE, E};
    }
  }
  ASSERT_EQ(r.tensors().size(), want.size());
  for (const auto& t : r.tensors()) {
    ASSERT_TRUE(want.count(t.name)) << t.name;
    EXPECT_EQ(t.ne, want[t.name]) << t.name;
  }
  EXPECT_EQ(f32(r, "token_embd.weight"), hf("model.embed_tokens.weight"));
  EXPECT_EQ(f32(r, "blk.1.exp_probs_b.bias"), hf("model.layers.1.mlp.gate.e_score_correction_bias"));
  // attn_k_b[d, c, h] = kv_b[h (nope + v) + d, c]; attn_v_b[c, j, h] = kv_b[h (nope + v) + nope + j, c].
  const auto kvb = hf("model.layers.2.self_attn.kv_b_proj.weight");
  const auto kb = f32(r, "blk.2.attn_k_b.weight"), vb = f32(r, "blk.2.attn_v_b.weight");
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < KVL; ++c) {
      for (int64_t d = 0; d < NOPE; ++d)
        ASSERT_EQ(kb[(h * KVL + c) * NOPE + d], kvb[(h * (NOPE + VD) + d) * KVL + c]) << h << " " << c << " " << d;
      for (int64_t j = 0; j < VD; ++j)
        ASSERT_EQ(vb[(h * VD + j) * KVL + c], kvb[(h * (NOPE + VD) + NOPE + j) * KVL + c]) << h << " " << c << " " << j;
    }
  // Expert x's down_proj [E, FE] is slab x of ffn_down_exps.
  const auto down = f32(r, "blk.1.ffn_down_exps.weight");
  for (int64_t x = 0; x < X; ++x) {
    const auto one = hf("model.layers.1.mlp.experts." + std::to_string(x) + ".down_proj.weight");
    ASSERT_TRUE(std::equal(one.begin(), one.end(), down.begin() + x * E * FE)) << "expert " << x;
  }
}

TEST_F(GgufExportTest, Bf16AndQ8_0KeepNormsInF32AndQuantizeAsGgml) {
  const auto b = exported("bf16");
  EXPECT_EQ(b.tensor("blk.1.attn_norm.weight")->type, gguf::TensorType::F32);
  EXPECT_EQ(b.tensor("blk.1.ffn_gate_inp.weight")->type, gguf::TensorType::F32);
  EXPECT_EQ(b.tensor("blk.1.exp_probs_b.bias")->type, gguf::TensorType::F32);
  const auto* q = b.tensor("blk.1.attn_q_b.weight");
  ASSERT_EQ(q->type, gguf::TensorType::BF16);
  const auto want = hf("model.layers.1.self_attn.q_b_proj.weight");
  const auto d = b.data(*q);
  for (size_t i = 0; i < want.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, d.data() + 2 * i, 2);
    ASSERT_EQ(h, ds::f32_to_bf16(want[i])) << i;
  }
  const auto r = exported("q8_0");
  EXPECT_EQ(std::get<uint64_t>(r.find("general.file_type")->scalar), 7u);
  // attn_k_b rows are 12 wide: not blocks of 32, so f16 as the converter writes them.
  EXPECT_EQ(r.tensor("blk.1.attn_k_b.weight")->type, gguf::TensorType::F16);
  const auto* e = r.tensor("token_embd.weight");
  ASSERT_EQ(e->type, gguf::TensorType::Q8_0);
  const auto x = hf("model.embed_tokens.weight");
  const auto bytes = r.data(*e);
  ASSERT_EQ(bytes.size(), x.size() / 32 * 34);
  for (size_t blk = 0; blk < x.size() / 32; ++blk) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * blk + i]));
    uint16_t dh;
    std::memcpy(&dh, bytes.data() + 34 * blk, 2);
    ASSERT_EQ(dh, ds::f32_to_f16(amax / 127)) << blk;
    const float scale = ds::f16_to_f32(dh);
    for (int i = 0; i < 32; ++i) {
      const auto q8 = static_cast<int8_t>(bytes[34 * blk + 2 + i]);
      // ggml's reference: id = 1 / d with the unrounded d = amax / 127.
      const float d = amax / 127, id = d != 0 ? 1 / d : 0;
      ASSERT_EQ(q8, static_cast<int8_t>(std::roundf(x[32 * blk + i] * id))) << blk << " " << i;
      ASSERT_LE(std::fabs(q8 * scale - x[32 * blk + i]), scale * 0.5f + 1e-3f * amax) << blk << " " << i;
    }
  }
}

TEST_F(GgufExportTest, WhatDeepseek2CannotHoldIsRefused) {
  EXPECT_THROW(ds::model::export_gguf(dir_ + "/hf", dir_ + "/x.gguf", "q3_k"), ds::Error);
  // A tokenizer llama.cpp would split differently.
  json t = tok_;
  t["pre_tokenizer"] = {{"type", "Whitespace"}};
  std::ofstream(dir_ + "/hf/tokenizer.json") << t.dump();
  EXPECT_THROW(ds::model::export_gguf(dir_ + "/hf", dir_ + "/x.gguf", "f32"), ds::Error);
  std::ofstream(dir_ + "/hf/tokenizer.json") << tok_.dump();
  // DeepSeek-V3.2 (its indexer has no deepseek2 tensors).
  auto v32 = cfg_;
  v32["model_type"] = "deepseek_v32";
  v32["index_n_heads"] = 2;
  v32["index_head_dim"] = 16;
  v32["index_topk"] = 4;
  ds::test::write_random_model(dir_ + "/v32", v32, 5);
  std::ofstream(dir_ + "/v32/tokenizer.json") << tok_.dump();
  EXPECT_THROW(ds::model::export_gguf(dir_ + "/v32", dir_ + "/x.gguf", "f32"), ds::Error);
  // 26 layers with q-LoRA: llama.cpp would read it as V2-Lite, without q-LoRA.
  auto lite = cfg_;
  lite["num_hidden_layers"] = 26;
  ds::test::write_random_model(dir_ + "/lite", lite, 5);
  std::ofstream(dir_ + "/lite/tokenizer.json") << tok_.dump();
  EXPECT_THROW(ds::model::export_gguf(dir_ + "/lite", dir_ + "/x.gguf", "f32"), ds::Error);
  EXPECT_FALSE(fs::exists(dir_ + "/x.gguf"));
}

// The way back (model/gguf_import.h): an f32 file gives the folder's
// weights exactly, config and tokenizer included; a q8_0 one within its
// rounding; a .gguf path names a model for every command (infer::
// model_folder), with the folder's logits.
TEST_F(GgufExportTest, ImportIsTheInverseOfExport) {
  exported("f32");
  ASSERT_TRUE(ds::model::is_gguf_file(dir_ + "/m-f32.gguf"));
  EXPECT_FALSE(ds::model::is_gguf_file(dir_ + "/hf/config.json"));
  ds::model::import_gguf(dir_ + "/m-f32.gguf", dir_ + "/back");
  const auto a = ds::io::SafetensorsSet::open_dir(dir_ + "/hf"), b = ds::io::SafetensorsSet::open_dir(dir_ + "/back");
  EXPECT_EQ(a.names(), b.names());
  for (const auto& n : a.names()) {
    ASSERT_TRUE(b.contains(n)) << n;
    EXPECT_EQ(a.tensor(n).shape(), b.tensor(n).shape()) << n;
    EXPECT_EQ(a.tensor(n).to_vector(), b.tensor(n).to_vector()) << n;
  }
  const auto ca = ds::model::load_config(dir_ + "/hf"), cb = ds::model::load_config(dir_ + "/back");
  EXPECT_EQ(cb.hidden_size, ca.hidden_size);
  EXPECT_EQ(cb.q_lora_rank, ca.q_lora_rank);
  EXPECT_EQ(cb.qk_nope_head_dim, ca.qk_nope_head_dim);
  EXPECT_EQ(cb.v_head_dim, ca.v_head_dim);
  EXPECT_EQ(cb.n_group, ca.n_group);
  EXPECT_EQ(cb.topk_group, ca.topk_group);
  EXPECT_EQ(cb.first_k_dense_replace, ca.first_k_dense_replace);
  EXPECT_DOUBLE_EQ(cb.routed_scaling_factor, ca.routed_scaling_factor);
  EXPECT_NEAR(cb.softmax_scale(), ca.softmax_scale(), 1e-7);
  EXPECT_EQ(cb.rope_scaling.original_max_position_embeddings, ca.rope_scaling.original_max_position_embeddings);
  EXPECT_EQ(cb.bos_token_id, 285);
  EXPECT_EQ(cb.eos_token_id, 286);
  // The tokenizer splits text as the folder's does.
  const auto ta = ds::io::Tokenizer::from_file(dir_ + "/hf/tokenizer.json");
  const auto tb = ds::io::Tokenizer::from_file(dir_ + "/back/tokenizer.json");
  for (const std::string text : {"the hello world", "aaaa <sep>x 123 4567", "héllo\n\n  x<｜end▁of▁sentence｜>"})
    EXPECT_EQ(tb.encode(text, true), ta.encode(text, true)) << text;
  // A .gguf path as --model: the same logits as the folder.
  const std::string folder = ds::infer::model_folder(dir_ + "/m-f32.gguf");
  EXPECT_EQ(ds::infer::model_folder(dir_ + "/m-f32.gguf"), folder);  // read once
  const auto mg = ds::infer::open_model(folder), mh = ds::infer::open_model(dir_ + "/hf");
  mg->load();
  mh->load();
  const std::vector<int32_t> ids = {5, 9, 2, 33, 7, 1, 8, 60};
  const auto lg = mg->logits(ids, 0, ds::infer::CacheKind::Latent, nullptr);
  const auto lh = mh->logits(ids, 0, ds::infer::CacheKind::Latent, nullptr);
  ASSERT_EQ(lg.size(), lh.size());
  for (size_t i = 0; i < lg.size(); ++i) ASSERT_NEAR(lg[i], lh[i], 1e-4 * (1 + std::fabs(lh[i]))) << i;
}

// q4_k_m: the stacked experts in Q4_K (Q4_1 where rows are not whole blocks
// of 256), the rest Q8_0, made by this engine's quantizer; read back, the
// blocks are kept as they are (U8 rows, the bytes `deepseek quantize`
// writes for the same weights), and the folder runs.
TEST_F(GgufExportTest, Q4KMBlocksGoBothWaysAsTheyAre) {
  write_wide();
  ds::model::export_gguf(dir_ + "/wide", dir_ + "/w.gguf", "q4_k_m");
  const auto r = gguf::Reader::open(dir_ + "/w.gguf");
  EXPECT_EQ(r.tensor("blk.1.ffn_gate_exps.weight")->type, gguf::TensorType::Q4_K);
  EXPECT_EQ(r.tensor("blk.1.ffn_down_exps.weight")->type, gguf::TensorType::Q4_K);
  EXPECT_EQ(r.tensor("blk.1.attn_q_b.weight")->type, gguf::TensorType::Q8_0);
  EXPECT_EQ(r.tensor("blk.1.attn_kv_a_mqa.weight")->type, gguf::TensorType::Q8_0);
  EXPECT_EQ(r.tensor("blk.1.attn_output.weight")->type, gguf::TensorType::F16);  // 48 columns: not blocks of 32
  EXPECT_EQ(r.tensor("blk.1.ffn_norm.weight")->type, gguf::TensorType::F32);
  EXPECT_EQ(std::get<uint64_t>(r.find("general.file_type")->scalar), 15u);  // MOSTLY_Q4_K_M
  ds::model::import_gguf(dir_ + "/w.gguf", dir_ + "/back");
  ds::model::QuantizeOptions q;
  ds::model::quantize_model(dir_ + "/wide", dir_ + "/quantized", q);
  const auto back = ds::io::SafetensorsSet::open_dir(dir_ + "/back");
  const auto quant = ds::io::SafetensorsSet::open_dir(dir_ + "/quantized");
  for (const char* name :
       {"model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.2.mlp.experts.7.down_proj.weight",
        "model.layers.1.self_attn.q_b_proj.weight", "model.embed_tokens.weight"}) {
    const auto& i = back.info(name);
    ASSERT_EQ(i.dtype_name, "U8") << name;
    ASSERT_EQ(i.shape, quant.info(name).shape) << name;
    EXPECT_EQ(std::memcmp(back.bytes(name), quant.bytes(name), i.end - i.begin), 0) << name;
  }
  auto m = ds::infer::load_model(dir_ + "/back");
  EXPECT_EQ(m->weights.view.layers[1].moe.experts[3].up.dtype, ds::DType::Q4_K);
  ds::infer::KvCache cache(ds::infer::CacheKind::Latent, 1, m->config.num_hidden_layers);
  for (float v : m->engine->step(cache, {{1, 2, 3, 4}}, false)) ASSERT_TRUE(std::isfinite(v));
}

// q6_k (llama.cpp's MOSTLY_Q6_K; publishers' Q4_K_M files hold some Q6_K
// matrices): matrices whose rows are whole blocks of 256 in Q6_K, the rest
// Q8_0 or F16. Read back, the Q6_K blocks are kept as they are (U8 rows,
// not widened to float32), the linear layers compute on them, and the
// logits follow the file's own values.
TEST_F(GgufExportTest, Q6KBlocksAreKeptOnImport) {
  write_wide();
  ds::model::export_gguf(dir_ + "/wide", dir_ + "/w6.gguf", "q6_k");
  const auto r = gguf::Reader::open(dir_ + "/w6.gguf");
  EXPECT_EQ(r.tensor("blk.1.ffn_gate_exps.weight")->type, gguf::TensorType::Q6_K);
  EXPECT_EQ(r.tensor("blk.1.attn_q_a.weight")->type, gguf::TensorType::Q6_K);
  EXPECT_EQ(r.tensor("blk.1.attn_q_b.weight")->type, gguf::TensorType::Q8_0);  // 96 columns
  EXPECT_EQ(std::get<uint64_t>(r.find("general.file_type")->scalar), 18u);
  ds::model::import_gguf(dir_ + "/w6.gguf", dir_ + "/back6");
  const auto back = ds::io::SafetensorsSet::open_dir(dir_ + "/back6");
  const auto& i = back.info("model.layers.1.mlp.experts.3.up_proj.weight");
  ASSERT_EQ(i.dtype_name, "U8");
  EXPECT_EQ(i.shape, (ds::Shape{256, 210}));
  auto m = ds::infer::load_model(dir_ + "/back6");
  EXPECT_EQ(m->weights.view.layers[1].moe.experts[3].up.dtype, ds::DType::Q6_K);
  // The kept blocks hold the model's values (6-bit: relative error a few
  // percent; blocks read from the wrong place would be uncorrelated), and
  // the model runs on them.
  const auto orig = ds::io::SafetensorsSet::open_dir(dir_ + "/wide");
  const auto want = orig.tensor("model.layers.1.mlp.experts.3.up_proj.weight").to_vector();
  std::vector<float> got(want.size());
  ds::ops::dequantize_blocks(ds::DType::Q6_K, back.bytes("model.layers.1.mlp.experts.3.up_proj.weight"),
                             static_cast<int64_t>(want.size()), got.data());
  double e = 0, s = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    e += (got[k] - want[k]) * double(got[k] - want[k]);
    s += want[k] * double(want[k]);
  }
  EXPECT_LT(std::sqrt(e / s), 0.04);
  ds::infer::KvCache cache(ds::infer::CacheKind::Latent, 1, m->config.num_hidden_layers);
  for (float v : m->engine->step(cache, {{1, 2, 3, 4}}, false)) ASSERT_TRUE(std::isfinite(v));
}

TEST_F(GgufExportTest, ImportReadsQuantizedFilesAndRefusesOthers) {
  exported("q8_0");
  ds::model::import_gguf(dir_ + "/m-q8_0.gguf", dir_ + "/q8");
  const auto a = ds::io::SafetensorsSet::open_dir(dir_ + "/hf"), b = ds::io::SafetensorsSet::open_dir(dir_ + "/q8");
  const auto x = a.tensor("model.layers.1.self_attn.q_b_proj.weight").to_vector();
  const auto y = b.tensor("model.layers.1.self_attn.q_b_proj.weight").to_vector();
  ASSERT_EQ(x.size(), y.size());
  for (size_t blk = 0; blk < x.size() / 32; ++blk) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * blk + i]));
    for (int i = 0; i < 32; ++i) ASSERT_LE(std::fabs(y[32 * blk + i] - x[32 * blk + i]), amax / 254 * 1.01f + 1e-6f);
  }
  // Another architecture, a missing key, a folder that is not empty.
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::str("llama"));
  w.write(dir_ + "/llama.gguf");
  EXPECT_THROW(ds::model::import_gguf(dir_ + "/llama.gguf", dir_ + "/l"), ds::Error);
  gguf::Writer w2;
  w2.set("general.architecture", gguf::Value::str("deepseek2"));
  w2.write(dir_ + "/bare.gguf");
  EXPECT_THROW(ds::model::import_gguf(dir_ + "/bare.gguf", dir_ + "/b"), ds::Error);
  EXPECT_THROW(ds::infer::open_model(ds::infer::model_folder(dir_ + "/bare.gguf")), ds::Error);
}

}  // namespace gguf_export_test
}  // namespace
