// The families' kinds (model/family_kind.h): which family a preset, the
// keys or a config.json name, whose model keys a run takes, and `deepseek
// init`'s one path (a preset or config.json to a model folder) for every
// family.
#include "model/family_kind.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "train/config.h"

namespace ds {
namespace {
namespace family_kind_test {

namespace fs = std::filesystem;

const std::string kConfigs = std::string(DEEPSEEK_SOURCE_DIR) + "/configs/";
const std::string kTiny = kConfigs + "tiny.yml";
const std::string kV4Tiny = kConfigs + "v4-tiny.yml";

std::vector<io::YamlEntry> entries(const std::string& text) { return io::yaml_entries(text, {}, "test", "test"); }

// The message of the ds::Error that f throws ("" when none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(FamilyKind, EachKindClaimsItsDecoderBlockAndModelType) {
  const auto& kinds = model::family_kinds();
  ASSERT_EQ(kinds.size(), 2u);
  EXPECT_EQ(&model::default_family_kind(), &model::v3_kind());
  EXPECT_NE(kinds[0]->name(), kinds[1]->name());
  // decoder_block: the last one wins; the default family's is no claim of another.
  EXPECT_EQ(model::kind_of_entries(entries("decoder_block: deepseek4\n")), &model::v4_kind());
  EXPECT_EQ(model::kind_of_entries(entries("decoder_block: deepseek_v4\n")), &model::v4_kind());
  EXPECT_EQ(model::kind_of_entries(entries("decoder_block: deepseek\n")), nullptr);
  EXPECT_EQ(model::kind_of_entries(entries("base_emb_dim: 8\n")), nullptr);
  EXPECT_EQ(
      model::kind_of_entries(io::yaml_entries("decoder_block: deepseek4\n", {"decoder_block=deepseek"}, "t", "o")),
      nullptr);
  EXPECT_TRUE(model::v3_kind().claims_decoder_block("deepseek"));
  EXPECT_FALSE(model::v3_kind().claims_decoder_block("deepseek4"));
  // model_type: each generation's; anything else goes to the default, whose parser names it.
  for (const char* t : {"deepseek_v2", "deepseek_v3", "deepseek_v32"})
    EXPECT_EQ(&model::kind_of_model_type(t), &model::v3_kind()) << t;
  EXPECT_EQ(&model::kind_of_model_type("deepseek_v4"), &model::v4_kind());
  EXPECT_EQ(&model::kind_of_model_type("llama"), &model::default_family_kind());
  // Model keys: each family's own.
  EXPECT_TRUE(model::v3_kind().is_model_key("num_experts"));
  EXPECT_TRUE(model::v4_kind().is_model_key("compress_ratios"));
  EXPECT_FALSE(model::v3_kind().is_model_key("compress_ratios"));
  EXPECT_TRUE(model::v4_kind().is_model_key("routed_bias_update_rate"));
  EXPECT_TRUE(model::v4_kind().is_model_key("mtp_num_layers"));
}

// A run of `preset` with `keys`.
train::RunConfig run(const std::string& preset, std::vector<std::string> keys = {}) {
  keys.insert(keys.begin(), {"model_name=" + preset, "max_target_length=16"});
  return train::parse_run_config("", keys, "test");
}

TEST(FamilyKind, ARunsModelIsOfTheFamilyItsConfigNames) {
  const auto v3 = run(kTiny);
  EXPECT_EQ(&v3.family_kind(), &model::v3_kind());
  EXPECT_FALSE(v3.v4.has_value());
  const auto v4 = run(kV4Tiny, {"routed_bias_update_rate=0.001"});
  EXPECT_EQ(&v4.family_kind(), &model::v4_kind());
  ASSERT_TRUE(v4.v4.has_value());
  EXPECT_EQ(train::model_family(v4)->routed_bias_update_rate(), 0.001);
  // A V4 preset stays V4's whatever the keys' decoder_block says; V4's keys read it.
  const std::string e = error_of([] { run(kV4Tiny, {"decoder_block=deepseek"}); });
  EXPECT_NE(e.find("decoder_block 'deepseek' is not deepseek4"), std::string::npos) << e;
  // A default ModelSpec is the default family's.
  EXPECT_EQ(&train::RunConfig().family_kind(), &model::default_family_kind());
}

TEST(FamilyKind, AnUnknownKeyNamesTheFamilyWhoseKeysWereExpected) {
  const std::string v3 = error_of([] { train::parse_run_config("", {"model_name=" + kTiny, "mystery=1"}, "test"); });
  EXPECT_NE(v3.find("unknown key 'mystery' (neither a training key nor a DeepSeek-V2/V3 model key)"), std::string::npos)
      << v3;
  const std::string v4 = error_of([] { train::parse_run_config("", {"model_name=" + kV4Tiny, "mystery=1"}, "test"); });
  EXPECT_NE(v4.find("unknown key 'mystery' (neither a training key nor a DeepSeek-V4 model key)"), std::string::npos)
      << v4;
  // Another family's model key is not this one's.
  const std::string other = error_of([] {
    train::parse_run_config("", {"model_name=" + kTiny, "compress_ratios=[0]"}, "test");
  });
  EXPECT_NE(other.find("unknown key 'compress_ratios'"), std::string::npos) << other;
  EXPECT_NE(other.find("DeepSeek-V2/V3 model key"), std::string::npos) << other;
}

TEST(FamilyKind, InitWritesALoadableFolderForEveryFamily) {
  for (const std::string& preset : {kTiny, kV4Tiny}) {
    SCOPED_TRACE(preset);
    test::TempDir d;
    const std::string out = d / "model";
    // `deepseek init`'s path: the preset's family, its random folder.
    const auto spec = model::model_from_preset(preset, {});
    const auto family = spec.family();
    family->write_random(out, 7, 0.02f, DType::F32);
    ASSERT_TRUE(fs::is_regular_file(fs::path(out) / "config.json"));
    ASSERT_TRUE(fs::is_regular_file(fs::path(out) / "model.safetensors"));
    // Its config.json names the same family and model; the weights load.
    const auto back = model::model_from_hf_config_file((fs::path(out) / "config.json").string());
    EXPECT_EQ(&back.family_kind(), &spec.family_kind());
    const auto loaded = back.family();
    EXPECT_EQ(loaded->name(), family->name());
    std::vector<float> params(static_cast<size_t>(loaded->numel()));
    loaded->load_hf(out, params.data());
    bool nonzero = false;
    for (float x : params) nonzero |= x != 0.0f;
    EXPECT_TRUE(nonzero);
    // The same seed writes the same bytes, from the preset or from the folder's config.json.
    const std::string again = d / "again";
    loaded->write_random(again, 7, 0.02f, DType::F32);
    std::ifstream a(fs::path(out) / "model.safetensors", std::ios::binary),
        b(fs::path(again) / "model.safetensors", std::ios::binary);
    EXPECT_TRUE(std::equal(std::istreambuf_iterator<char>(a), {}, std::istreambuf_iterator<char>(b), {}));
  }
}

TEST(FamilyKind, Fp8InitIsDeepSeekV3sFormatOnly) {
  test::TempDir d;
  const auto v3 = model::model_from_preset(kTiny, {}).family();
  const auto v3_dtypes = v3->init_dtypes();
  EXPECT_NE(std::find(v3_dtypes.begin(), v3_dtypes.end(), DType::F8E4M3), v3_dtypes.end());
  v3->write_random(d / "v3", 1, 0.006f, DType::F8E4M3);
  std::ifstream config(d / "v3/config.json");
  const std::string text((std::istreambuf_iterator<char>(config)), {});
  EXPECT_NE(text.find("\"quant_method\": \"fp8\""), std::string::npos);

  const auto v4 = model::model_from_preset(kV4Tiny, {}).family();
  const auto v4_dtypes = v4->init_dtypes();
  EXPECT_EQ(std::find(v4_dtypes.begin(), v4_dtypes.end(), DType::F8E4M3), v4_dtypes.end());
  const std::string e = error_of([&] { v4->write_random(d / "v4", 1, 0.006f, DType::F8E4M3); });
  EXPECT_NE(e.find("DeepSeek-V4"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(d / "v4"));
}

TEST(FamilyKind, AHuggingFaceConfigTakesOnlyTheKeysItsFamilyAllows) {
  test::TempDir d;
  for (const std::string& preset : {kTiny, kV4Tiny}) {
    SCOPED_TRACE(preset);
    const auto family = model::model_from_preset(preset, {}).family();
    const std::string out = d / fs::path(preset).stem().string();
    family->write_random(out, 1, 0.006f, DType::BF16);
    const auto rc = train::parse_run_config(
        "", {"hf_config=" + out, "max_target_length=16", "mtp_num_layers=1", "routed_bias_update_rate=0.01"}, "test");
    EXPECT_EQ(train::model_family(rc)->mtp_layers(), 1);
    EXPECT_EQ(train::model_family(rc)->routed_bias_update_rate(), 0.01);
    const std::string e = error_of([&] {
      train::parse_run_config("", {"hf_config=" + out, "base_emb_dim=64"}, "test");
    });
    EXPECT_NE(e.find("command line: model key 'base_emb_dim' cannot change a Hugging Face config (only "
                     "mtp_num_layers and routed_bias_update_rate)"),
              std::string::npos)
        << e;
  }
}

TEST(FamilyKind, V4PresetIsNothingForAnotherFamilysPreset) {
  EXPECT_FALSE(model::v4_preset(kTiny, {}).has_value());
  const auto c = model::v4_preset(kV4Tiny, {"base_num_decoder_layers=2", "compress_ratios=[0, 4]"});
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->num_hidden_layers, 2);
  const std::string e = error_of([] { model::v4_preset(kV4Tiny, {"mystery_key=1"}); });
  EXPECT_NE(e.find("'mystery_key' is not a key of a DeepSeek-V4 model"), std::string::npos) << e;
}

}  // namespace family_kind_test
}  // namespace
}  // namespace ds
