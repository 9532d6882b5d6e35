// Crafted and broken input against the library: sizes are bounded with
// checked arithmetic, integers must be integers, a checkpoint must hold
// exactly the layers its config names and only finite numbers, outputs never
// replace what is not a plain file, and a request is checked whole before
// any weight is read. Each case must end in a ds::Error naming the problem.
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"
#include "core/system.h"
#include "core/tensor.h"
#include "infer/generate.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/text_input.h"
#include "io/token_lists.h"
#include "io/token_shards.h"
#include "io/tokenizer.h"
#include "model/config.h"
#include "model/init.h"
#include "model/load.h"
#include "model_fixture.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/run_lock.h"
#include "train/trainer.h"

namespace ds {
namespace {
namespace hardening_test {

namespace fs = std::filesystem;
using nlohmann::json;

// Runs f, which must throw ds::Error whose text contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

model::ModelConfig parse(const json& j) { return model::ModelConfig::from_hf_json_text(j.dump()); }

struct TempDir : test::TempDir {
  TempDir() : test::TempDir("ds_hardening") {}
};

// ---- sizes ----

TEST(Hardening, HugeSizesAreRejectedNamingTheKey) {
  auto j = test::tiny_v3_config();
  j["num_attention_heads"] = 2305843009213693956;
  j["num_key_value_heads"] = 2305843009213693956;
  expect_error([&] { parse(j); }, "num_attention_heads = 2305843009213693956 is above the supported limit");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "kv_lora_rank",
                          "qk_nope_head_dim", "v_head_dim", "max_position_embeddings", "n_routed_experts"}) {
    auto k = test::tiny_v3_config();
    k[key] = int64_t{1} << 62;
    expect_error([&] { parse(k); }, std::string(key) + " = 4611686018427387904 is above");
  }
}

TEST(Hardening, ProductsOfBoundedSizesAreChecked) {
  // Each size within its bound, their product far beyond any machine: the
  // parameter count (checked arithmetic) refuses it.
  auto j = test::tiny_v3_config();
  j["n_routed_experts"] = 65536;
  j["n_group"] = 1;
  j["topk_group"] = 1;
  j["moe_intermediate_size"] = 1 << 20;
  j["hidden_size"] = 1 << 17;
  j["num_hidden_layers"] = 4096;
  expect_error([&] { parse(j); }, "parameters, above the supported limit");
  // YAML presets and --set overrides go through the same checks.
  expect_error([] { model::ModelConfig::from_yaml_text("vocab_size: 4611686018427387904", {}, "preset"); },
               "vocab_size = 4611686018427387904 is above");
}

TEST(Hardening, ShapeProductsDoNotOverflow) {
  expect_error([] { shape_numel({int64_t{1} << 40, int64_t{1} << 40}); }, "more elements than fit in 64 bits");
  expect_error([] { shape_numel({4, -2}); }, "negative dimension");
  EXPECT_EQ(shape_numel({3, 5, 7}), 105);
}

TEST(Hardening, IntegersMustBeIntegers) {
  for (const json& bad : {json(64.9), json(64.0), json("64"), json(true), json(uint64_t{1} << 63)}) {
    auto j = test::tiny_v3_config();
    j["hidden_size"] = bad;
    expect_error([&] { parse(j); }, "key 'hidden_size' must be an integer");
  }
  auto j = test::tiny_v3_config();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128.5, 128}}};
  expect_error([&] { parse(j); }, "weight_block_size");
  // A float key accepts integers (rope_theta 10000 in the fixture) and YAML
  // NaN/inf are refused.
  expect_error([] { model::ModelConfig::from_yaml_text("rope_max_timescale: .nan", {}, "preset"); },
               "rope_theta = nan is not a finite number");
  expect_error([] { model::ModelConfig::from_yaml_text("base_emb_dim: 64.9", {}, "preset"); }, "base_emb_dim");
}

TEST(Hardening, LongValuesInErrorsAreShortened) {
  auto j = test::tiny_v3_config();
  j["hidden_size"] = std::string(400, '7');
  try {
    parse(j);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_LT(std::strlen(e.what()), 300u) << e.what();
  }
}

// ---- checkpoints ----

// Writes `bytes` over element `index` of tensor `name` in a model folder's
// model.safetensors, in place.
void poke(const std::string& dir, const std::string& name, int64_t index, const void* bytes, size_t n) {
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  uint64_t header = 0, begin = 0;
  {
    const auto f = io::SafetensorsFile::open(path);
    begin = f.info(name).begin;
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(&header), 8);
  }
  std::fstream io(path, std::ios::binary | std::ios::in | std::ios::out);
  io.seekp(static_cast<std::streamoff>(8 + header + begin + index * n));
  io.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
  ASSERT_TRUE(io.good());
}

TEST(Hardening, LayerSetMustMatchTheConfig) {
  TempDir d;
  auto j = test::tiny_v3_config();
  test::write_random_model(d.path(), j);
  ASSERT_NO_THROW(infer::load_model(d.path()));
  // Fewer layers in config.json than in the checkpoint.
  j["num_hidden_layers"] = 2;
  std::ofstream(d / "config.json") << j.dump();
  expect_error([&] { infer::load_model(d.path()); }, "belongs to layer 2, but config.json has num_hidden_layers 2");
  // The same tensors are a multi-token prediction layer when the config says so.
  j["num_nextn_predict_layers"] = 1;
  std::ofstream(d / "config.json") << j.dump();
  EXPECT_NO_THROW(infer::load_model(d.path()));
}

TEST(Hardening, StrayAndHugeLayerIndicesAreErrors) {
  for (const std::string name : {"model.layers.7.foo.weight", "model.layers.99999999999999999999999.x"}) {
    TempDir d;
    Tensor t = Tensor::zeros({2}, DType::F32);
    test::write_random_model(d.path(), test::tiny_v3_config(), 7, {{name, t}});
    expect_error([&] { infer::load_model(d.path()); }, "belongs to layer");
  }
}

TEST(Hardening, NonFiniteWeightsAreRefusedAtLoad) {
  const uint16_t bf16_nan = 0x7fc1, bf16_inf = 0x7f80;
  for (const uint16_t bits : {bf16_nan, bf16_inf}) {
    TempDir d;
    test::write_random_model(d.path(), test::tiny_v3_config());
    poke(d.path(), "model.layers.1.mlp.experts.3.up_proj.weight", 17, &bits, 2);
    expect_error([&] { infer::load_model(d.path()); },
                 "tensor 'model.layers.1.mlp.experts.3.up_proj.weight' holds a non-finite value");
  }
}

TEST(Hardening, NonFiniteFp8WeightsAndScalesAreRefusedAtLoad) {
  const auto cfg = model::ModelConfig::from_hf_json_text(test::tiny_v3_config().dump());
  model::InitOptions opt;
  opt.dtype = DType::F8E4M3;
  {
    TempDir d;
    model::write_random_checkpoint(cfg, d.path(), opt);
    ASSERT_NO_THROW(infer::load_model(d.path()));
    const float inf = std::numeric_limits<float>::infinity();
    poke(d.path(), "model.layers.0.self_attn.o_proj.weight_scale_inv", 0, &inf, 4);
    expect_error([&] { infer::load_model(d.path()); }, "o_proj.weight_scale_inv' holds a non-finite value");
  }
  {
    TempDir d;
    model::write_random_checkpoint(cfg, d.path(), opt);
    const uint8_t e4m3_nan = 0xff;
    poke(d.path(), "model.layers.2.self_attn.kv_b_proj.weight", 5, &e4m3_nan, 1);
    expect_error([&] { infer::load_model(d.path()); },
                 "kv_b_proj.weight' holds a non-finite value (NaN or infinity) at element 5");
  }
}

TEST(Hardening, FindNonFiniteCoversEveryFloatDtype) {
  std::vector<float> f(10000, 1.0f);
  EXPECT_EQ(find_non_finite(f.data(), DType::F32, f.size()), -1);
  f[9001] = std::nanf("");
  EXPECT_EQ(find_non_finite(f.data(), DType::F32, f.size()), 9001);
  std::vector<uint16_t> h(5000, f32_to_f16(2.0f));
  h[4999] = f32_to_f16(std::numeric_limits<float>::infinity());
  EXPECT_EQ(find_non_finite(h.data(), DType::F16, h.size()), 4999);
  std::vector<uint8_t> e(300, f32_to_e5m2(1.0f));
  EXPECT_EQ(find_non_finite(e.data(), DType::F8E5M2, e.size()), -1);
  e[7] = f32_to_e5m2(std::numeric_limits<float>::infinity());
  EXPECT_EQ(find_non_finite(e.data(), DType::F8E5M2, e.size()), 7);
  std::vector<uint8_t> q(300, f32_to_e4m3(448.0f));  // the largest finite e4m3 is not NaN
  EXPECT_EQ(find_non_finite(q.data(), DType::F8E4M3, q.size()), -1);
  q[299] = 0x7f;
  EXPECT_EQ(find_non_finite(q.data(), DType::F8E4M3, q.size()), 299);
}

TEST(Hardening, NonFiniteLogitsAreAnErrorNotAResult) {
  // Finite weights whose logits overflow float32: the head's rows at the
  // largest bf16 magnitude.
  TempDir d;
  test::write_random_model(d.path(), test::tiny_v3_config());
  const uint16_t big = 0x7f7f;  // 3.39e38
  for (int64_t i = 0; i < 32; ++i) poke(d.path(), "lm_head.weight", 5 * 32 + i, &big, 2);
  auto m = infer::load_model(d.path());
  infer::KvCache cache(infer::CacheKind::Latent, 1, m->config.num_hidden_layers);
  expect_error([&] { m->engine->step(cache, {{1, 2, 3}}, true); }, "non-finite logit");
}

// ---- requests ----

TEST(Hardening, GenerateRequestsAreCheckedBeforeTheModel) {
  auto cfg = model::ModelConfig::from_hf_json_text(test::tiny_v3_config().dump());
  infer::GenerateOptions opt;
  opt.max_new_tokens = 4;
  EXPECT_NO_THROW(infer::check_generate_request(cfg, {5, 7}, opt));
  expect_error([&] { infer::check_generate_request(cfg, {129}, opt); }, "beyond max_position_embeddings 128");
  expect_error([&] { infer::check_generate_request(cfg, {0}, opt); }, "sequence 0 is empty");
  auto bad = opt;
  bad.sampler.top_p = 0.0f;
  expect_error([&] { infer::check_generate_request(cfg, {5}, bad); }, "top-p");
  bad = opt;
  bad.sampler.temperature = std::nanf("");
  expect_error([&] { infer::check_generate_request(cfg, {5}, bad); }, "temperature");
  // A KV cache larger than the machine (the max_position_embeddings bound
  // is lifted for this check).
  cfg.max_position_embeddings = int64_t{1} << 24;
  opt.cache = infer::CacheKind::Naive;
  const int64_t per_token = infer::kv_cache_bytes_per_token(cfg, infer::CacheKind::Naive);
  const int64_t tokens = physical_memory_bytes() / per_token / 60000 + 2;
  expect_error([&] { infer::check_generate_request(cfg, std::vector<int64_t>(60000, tokens), opt); }, "GiB");
  // DeepSeek-V3.2: sequences past index_topk are sparse attention, not
  // refused; the cache grows by the indexer's fp8 key and its scale.
  opt.cache = infer::CacheKind::Latent;
  cfg.max_position_embeddings = 64;
  const int64_t dense = infer::kv_cache_bytes_per_token(cfg, infer::CacheKind::Latent);
  cfg.index_n_heads = 2;
  cfg.index_head_dim = 16;
  cfg.index_topk = 8;
  cfg.q_lora_rank = cfg.q_lora_rank > 0 ? cfg.q_lora_rank : 16;
  opt.max_new_tokens = 40;
  EXPECT_NO_THROW(infer::check_generate_request(cfg, {20}, opt));
  EXPECT_EQ(infer::kv_cache_bytes_per_token(cfg, infer::CacheKind::Latent), dense + cfg.num_hidden_layers * (16 + 4));
}

TEST(Hardening, TokenListsAreCheckedAgainstTheVocabulary) {
  EXPECT_EQ(io::parse_token_lists("[[1, 2], [3]]", 4, "t").size(), 2u);
  expect_error([] { io::parse_token_lists("[[1, 4]]", 4, "t"); }, "holds 4, which is not a token id in [0, 4)");
  expect_error([] { io::parse_token_lists("[[1.5]]", 4, "t"); }, "not a token id");
  expect_error([] { io::parse_token_lists("[[-1]]", 4, "t"); }, "not a token id");
  expect_error([] { io::parse_token_lists("[[18446744073709551615]]", 4, "t"); }, "not a token id");
  expect_error([] { io::parse_token_lists("[[]]", 4, "t"); }, "non-empty");
  expect_error([] { io::parse_token_lists("[]", 4, "t"); }, "non-empty");
  expect_error([] { io::parse_token_lists("[[1]", 4, "t"); }, "not valid JSON");
}

TEST(Hardening, TokenizerTypeFieldsMustBeStrings) {
  // Found by tokenizer_json_fuzz: a non-string "type" escaped as a JSON
  // library exception instead of a ds::Error.
  std::ifstream in(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/tokenizer/tiny/tokenizer.json");
  const json base = json::parse(in);
  ASSERT_NO_THROW(io::Tokenizer::from_json(base.dump()));
  for (const char* key : {"pre_tokenizer", "decoder"})
    for (const json& bad : {json(5), json::array(), json::object()}) {
      json j = base;
      j[key]["type"] = bad;
      expect_error([&] { io::Tokenizer::from_json(j.dump()); }, "\"type\" must be a string");
    }
}

TEST(Hardening, RunConfigsEndInAnErrorNamingTheProblem) {
  // Found by train_config_fuzz: each of these escaped as a YAML or JSON
  // library exception, undefined behaviour or an endless read.
  const std::string dir = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/";
  auto parse = [&](const std::string& text, std::vector<std::string> overrides = {}) {
    train::parse_run_config(text, overrides, dir + "run.yml");  // presets are found next to it
  };
  // A non-scalar key, in the file or in a V4 value; a list as a remat setting.
  expect_error([&] { parse("[1]: 2\n"); }, "every key must be a name");
  expect_error([&] { parse("decoder_block: deepseek4\nbase_emb_dim: {[1]: 2}\n"); },
               "key 'base_emb_dim': a mapping's keys must be names");
  expect_error([&] { parse("model_name: tiny\nquery_proj: [1]\n"); },
               "remat name 'query_proj' takes remat, device or offload");
  // Numbers beyond int64 or double where DeepSeek-V4's keys take them.
  expect_error([&] { parse("decoder_block: deepseek4\nbase_emb_dim: 99999999999999999999\n"); },
               "key 'base_emb_dim': the number 99999999999999999999 is out of range");
  expect_error([&] { parse("model_name: v4-tiny\nrope_factor: 1e400\n"); },
               "key 'rope_factor': the number 1e400 is out of range");
  // A batch size beyond int64 was converted before it was checked.
  for (const char* v : {".inf", "1e19", "-.inf", ".nan", "2.5", "0"})
    expect_error([&] { parse(std::string("model_name: tiny\nper_device_batch_size: ") + v + "\n"); },
                 "must be a whole number >= 1");
  EXPECT_EQ(train::parse_run_config("model_name: tiny\nmax_target_length: 64\nper_device_batch_size: 3\n", {},
                                    dir + "run.yml")
                .train.per_device_batch_size,
            3);
  // Invalid UTF-8, in the file or an override: the config is written out as JSON.
  expect_error([&] { parse("model_name: tiny\ntokenizer_path: a\xff\n"); }, "is not valid UTF-8");
  expect_error([&] { parse("model_name: v4-tiny\nmlp_activations: a\xff\n"); }, "is not valid UTF-8");
  expect_error([&] { parse("model_name: tiny\n", {"tokenizer_path=a\xff"}); }, "is not valid UTF-8");
  // A device as the Hugging Face config: read until memory ran out.
  expect_error([&] { parse("hf_config: /dev/zero\n"); }, "'/dev/zero' is not a regular file");
  expect_error([] { io::read_file("/dev/null", "input"); }, "'/dev/null' is not a regular file");
  // A FIFO is refused before it is opened (opening one waits for a writer).
  TempDir d;
  ASSERT_EQ(mkfifo((d / "fifo").c_str(), 0600), 0);
  expect_error([&] { io::read_file(d / "fifo", "input"); }, "is not a regular file");
  expect_error([&] { io::read_file(d.path(), "input"); }, "is a folder, not a file");
  expect_error([&] { io::read_file(d / "missing", "input"); }, "cannot open input");
}

TEST(Hardening, TokenCorpusMetaFieldsMustBeStrings) {
  // Found by token_meta_fuzz: a non-string "format" or "token_dtype" escaped
  // as a JSON library exception.
  for (const char* text : {R"({"format": 1})", R"({"format": {"type": "x"}})",
                           R"({"format": "deepseek.cpp token shards", "version": 1, "token_dtype": 1})"}) {
    const json j = json::parse(text);
    try {
      io::TokenCorpusMeta::from_json(j, "meta.json");
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("meta.json"), std::string::npos) << e.what();
    }
  }
}

// ---- outputs ----

TEST(Hardening, OutputPathsNeverReplaceSpecialFiles) {
  TempDir d;
  // A plain file, or none yet: itself.
  EXPECT_EQ(io::resolve_output_path(d / "new.bin"), d / "new.bin");
  // A symlink: its target is written, the link stays.
  std::ofstream(d / "target") << "old";
  fs::create_symlink(d / "target", d / "link");
  EXPECT_EQ(io::resolve_output_path(d / "link"), d / "target");
  io::write_file_atomic(d / "link", "new");
  EXPECT_TRUE(fs::is_symlink(d / "link"));
  std::ifstream in(d / "target");
  std::string text;
  in >> text;
  EXPECT_EQ(text, "new");
  // A relative symlink resolves against its own folder.
  fs::create_directory(d / "sub");
  fs::create_symlink("../target", d / "sub/rel");
  EXPECT_EQ(fs::weakly_canonical(io::resolve_output_path(d / "sub/rel")), fs::weakly_canonical(d / "target"));
  // Not a regular file: refused, left as it was.
  ASSERT_EQ(mkfifo((d / "fifo").c_str(), 0600), 0);
  expect_error([&] { io::write_file_atomic(d / "fifo", "x"); }, "is not a regular file");
  EXPECT_TRUE(fs::is_fifo(d / "fifo"));
  fs::create_symlink(d / "fifo", d / "fifolink");
  expect_error([&] { io::resolve_output_path(d / "fifolink"); }, "is not a regular file");
  expect_error([&] { io::resolve_output_path(d / "sub"); }, "is not a regular file");
  expect_error([] { io::resolve_output_path("/dev/null"); }, "is not a regular file");
  expect_error([&] { io::resolve_output_path(d / "missing/out.bin"); }, "does not exist");
  // A loop of links ends in an error, not a hang.
  fs::create_symlink(d / "loop_b", d / "loop_a");
  fs::create_symlink(d / "loop_a", d / "loop_b");
  expect_error([&] { io::resolve_output_path(d / "loop_a"); }, "too many levels");
  // Output folders.
  EXPECT_NO_THROW(io::check_output_folder(d / "a/b/c"));
  expect_error([&] { io::check_output_folder(d / "target"); }, "is not a folder");
  expect_error([&] { io::check_output_folder(d / "target/x"); }, "is not a folder");
}

// ---- training: checkpoints and run folders ----

// A tiny synthetic run into `out` (its checkpoints after every step).
train::RunConfig tiny_run(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> o = {"model_name=" + std::string(DEEPSEEK_SOURCE_DIR) + "/configs/tiny.yml",
                                "base_output_directory=" + out,
                                "run_name=r",
                                "per_device_batch_size=1",
                                "max_target_length=8",
                                "dataset_type=synthetic",
                                "checkpoint_period=1",
                                "log_period=1000"};
  o.insert(o.end(), extra.begin(), extra.end());
  return train::parse_run_config("", o, "test");
}

// Rewrites one safetensors file of a checkpoint with f applied to its first
// tensor (its metadata kept); with `fix`, state.json's checksum follows, so
// only the value checks can see the change.
template <typename F>
void tamper(const fs::path& ck, const std::string& file, F&& f, bool fix = true) {
  const auto st = io::SafetensorsFile::open((ck / file).string());
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const auto& i : st.tensors()) ts.emplace_back(i.name, st.tensor(i.name).to(DType::F32));
  f(ts.front().second.data<float>());
  const auto meta = st.metadata();
  io::save_safetensors((ck / file).string(), ts, meta);
  if (!fix) return;
  json j = json::parse(io::read_file((ck / "state.json").string(), "state"));
  j["files"][file] = {{"bytes", static_cast<int64_t>(fs::file_size(ck / file))},
                      {"crc32", train::file_crc32((ck / file).string())}};
  std::ofstream(ck / "state.json") << j.dump();
}

TEST(Hardening, CorruptCheckpointsAreRefused) {
  TempDir d;
  const auto rc = tiny_run(d.path(), {"steps=2"});
  train::train(rc);
  const fs::path good = fs::path(d.path()) / "r/checkpoints/step_2", ck = fs::path(d.path()) / "x/step_2";
  auto p = model::FlatParams::zeros(rc.model, 0), m = model::FlatParams::zeros(rc.model, 0),
       v = model::FlatParams::zeros(rc.model, 0);
  auto load = [&] { train::load_checkpoint(ck.string(), rc.model, 0, p, &m, &v); };
  auto fresh = [&] {
    fs::remove_all(ck.parent_path());
    fs::create_directories(ck.parent_path());
    fs::copy(good, ck);
  };
  fresh();
  EXPECT_NO_THROW(load());
  // One flipped data byte: the checksum.
  {
    std::fstream f(ck / "adam_m.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x55');
  }
  expect_error(load, "adam_m.safetensors has CRC-32");
  // Values training never writes, checksums recomputed.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const auto& [file, value, needle] : std::vector<std::tuple<std::string, float, std::string>>{
           {"params.safetensors", nan, "is nan"},
           {"params.safetensors", 8.5e37f, "overflows"},
           {"adam_m.safetensors", -INFINITY, "is -inf"},
           {"adam_v.safetensors", -1.0f, "must be finite and >= 0"},
           {"adam_v.safetensors", nan, "must be finite"}}) {
    fresh();
    tamper(ck, file, [&](float* x) { x[1] = value; });
    expect_error(load, needle);
  }
  // params and adam_m swapped (their checksums too): the roles.
  fresh();
  fs::rename(ck / "params.safetensors", ck / "t");
  fs::rename(ck / "adam_m.safetensors", ck / "params.safetensors");
  fs::rename(ck / "t", ck / "adam_m.safetensors");
  {
    json j = json::parse(io::read_file((ck / "state.json").string(), "state"));
    std::swap(j["files"]["params.safetensors"], j["files"]["adam_m.safetensors"]);
    std::ofstream(ck / "state.json") << j.dump();
  }
  expect_error(load, "holds adam_m, not params: files swapped?");
  // state.json's step against the folder's name.
  fresh();
  {
    json j = json::parse(io::read_file((ck / "state.json").string(), "state"));
    j["step"] = 3;
    std::ofstream(ck / "state.json") << j.dump();
  }
  expect_error(load, "state.json says step 3, the folder step_2");
  // A resume from such a checkpoint stops with the error; export (params
  // alone) refuses NaN weights.
  fresh();
  tamper(good, "params.safetensors", [&](float* x) { x[0] = nan; });
  expect_error([&] { train::train(tiny_run(d.path(), {"steps=3", "resume=true"})); }, "is nan");
  expect_error([&] { train::load_checkpoint(good.string(), rc.model, 0, p, nullptr, nullptr); }, "is nan");
  // A checkpoint from before checksums (format 1, no roles recorded) still
  // loads, with a warning; its values are still checked.
  {
    json j = json::parse(io::read_file((ck / "state.json").string(), "state"));
    j["format"] = 1;
    j.erase("files");
    std::ofstream(ck / "state.json") << j.dump();
  }
  EXPECT_NO_THROW(load());
  tamper(
      ck, "adam_v.safetensors", [&](float* x) { x[0] = -2.0f; }, false);
  expect_error(load, "must be finite and >= 0");
}

TEST(Hardening, PruningNeverLeavesAPartialCheckpoint) {
  TempDir d;
  train::train(tiny_run(d.path(), {"steps=3", "max_num_checkpoints_to_keep=2"}));
  const fs::path cks = fs::path(d.path()) / "r/checkpoints";
  EXPECT_EQ(train::list_checkpoints(cks.string()), (std::vector<int64_t>{2, 3}));
  // What a kill during an older build's prune left: a step_N without its
  // state.json. It is not a checkpoint; a resume starts from step_3.
  fs::create_directories(cks / "step_4");
  std::ofstream(cks / "step_4" / "params.safetensors") << "x";
  EXPECT_EQ(train::list_checkpoints(cks.string()), (std::vector<int64_t>{2, 3}));
  // A prune killed after its rename leaves a .tmp folder, ignored and removed next time.
  fs::create_directories(cks / "step_1.pruned.tmp");
  std::ofstream(cks / "step_1.pruned.tmp" / "state.json") << "{}";
  EXPECT_EQ(train::list_checkpoints(cks.string()), (std::vector<int64_t>{2, 3}));
  const auto s = train::train(tiny_run(d.path(), {"steps=4", "resume=true", "max_num_checkpoints_to_keep=2"}));
  EXPECT_EQ(s.start_step, 3);
  EXPECT_EQ(train::list_checkpoints(cks.string()), (std::vector<int64_t>{3, 4}));
  EXPECT_FALSE(fs::exists(cks / "step_1.pruned.tmp"));
  EXPECT_FALSE(fs::exists(cks / "step_2"));
}

TEST(Hardening, OneTrainerPerRunFolder) {
  TempDir d;
  train::train(tiny_run(d.path(), {"steps=1"}));
  {
    // Another trainer holds the folder: refused at once, naming it.
    train::RunLock held((fs::path(d.path()) / "r").string());
    expect_error(
        [&] {
          train::train(tiny_run(d.path(), {"steps=2", "resume=true"}));
        },
        fmt::format("is in use by another trainer (pid {} on host", ::getpid()));
  }
  // Free again once it is gone; the metrics hold each step once.
  EXPECT_EQ(train::train(tiny_run(d.path(), {"steps=2", "resume=true"})).end_step, 2);
  std::ifstream in(fs::path(d.path()) / "r/metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) ++lines;
  EXPECT_EQ(lines, 2);
}

TEST(Hardening, RunFolderOutputsMustBeRegularFiles) {
  TempDir d;
  fs::create_directories(fs::path(d.path()) / "r");
  // A FIFO as metrics.jsonl hung the run reading it.
  ASSERT_EQ(mkfifo((fs::path(d.path()) / "r/metrics.jsonl").c_str(), 0600), 0);
  expect_error([&] { train::train(tiny_run(d.path(), {"steps=1"})); },
               "metrics.jsonl' exists and is not a regular file");
  fs::remove(fs::path(d.path()) / "r/metrics.jsonl");
  fs::create_directories(fs::path(d.path()) / "r/loss.svg");
  expect_error([&] { train::train(tiny_run(d.path(), {"steps=1"})); }, "loss.svg' exists and is not a regular file");
  EXPECT_FALSE(fs::exists(fs::path(d.path()) / "r/checkpoints/step_1"));
}

}  // namespace hardening_test
}  // namespace
}  // namespace ds
