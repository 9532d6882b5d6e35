// The activation estimate a training run is refused by
// (train::training_memory_bytes, from model::Family::saved_bytes_per_token)
// against what a training step's forward really keeps for its backward
// (LossTerms::saved_bytes), for every family, several remat policies, and
// both dtypes: never below it (the refusal must not let a run through that
// cannot fit), and close to it (it must not refuse runs that fit).
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/text_input.h"
#include "model/family.h"
#include "model/model.h"
#include "ops/matmul.h"
#include "train/config.h"

namespace ds {
namespace {
namespace saved_bytes_test {

const std::string kSrc = DEEPSEEK_SOURCE_DIR;

struct Case {
  std::string name;
  std::vector<std::string> keys;
  std::string file;  // a run configuration the keys override (empty: none)
};

// configs/v41-tiny.json with the test tokenizer's count of Engram token
// classes (`deepseek init --tokenizer` writes it so).
std::string v41_config() {
  nlohmann::json j = nlohmann::json::parse(io::read_file(kSrc + "/configs/v41-tiny.json", "config"));
  j["text_config"]["engram_compressed_vocab_size"] = 255;
  const std::string path = testing::TempDir() + "saved_bytes_v41.json";
  std::ofstream(path) << j.dump();
  return path;
}

std::vector<Case> cases() {
  return {
      {"V3", {"model_name=" + kSrc + "/configs/tiny.yml", "mtp_num_layers=1"}, ""},
      {"V3, two dense layers", {"model_name=" + kSrc + "/configs/tiny.yml", "first_num_dense_layers=2"}, ""},
      {"V3.2 (DSA)", {"model_name=" + kSrc + "/configs/tiny.yml", "use_indexer=true", "indexer_topk=4"}, ""},
      {"V3 mHC + Engram",
       {"tokenizer_path=" + kSrc + "/tests/data/tokenizer/tiny/tokenizer.json", "per_device_batch_size=2"},
       kSrc + "/configs/train-tiny-engram.yml"},
      {"V4", {"model_name=" + kSrc + "/configs/v4-tiny.yml"}, ""},
      {"V4.1",
       {"model_name=", "hf_config=" + v41_config(), "mtp_num_layers=0",
        "tokenizer_path=" + kSrc + "/tests/data/tokenizer/tiny/tokenizer.json"},
       ""},
  };
}

// Two rows of `seq` tokens below the vocabulary.
model::TrainBatch batch(int64_t vocab, int64_t seq) {
  model::TrainBatch b;
  b.batch = 2;
  b.seq = seq;
  uint64_t x = 7;
  for (int64_t i = 0; i < 2 * seq; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    b.inputs.push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab)));
    b.targets.push_back(static_cast<int32_t>((x >> 13) % static_cast<uint64_t>(vocab)));
    b.segment_ids.push_back(1);
    b.positions.push_back(static_cast<int32_t>(i % seq));
    b.target_segment_ids.push_back(1);
  }
  return b;
}

TEST(SavedBytes, TheEstimateIsAtOrAboveWhatAStepKeepsAndClose) {
  constexpr int64_t kSeq = 16;
  double worst = 1.0;
  for (const Case& c : cases()) {
    for (const char* policy : {"full", "minimal", "save_dot_except_mlp", "save_qkv_proj", "none"}) {
      for (const bool bf16 : {false, true}) {
        std::vector<std::string> keys = c.keys;
        keys.push_back(std::string("remat_policy=") + policy);
        keys.push_back(std::string("dtype=") + (bf16 ? "bfloat16" : "float32"));
        keys.push_back("max_target_length=" + std::to_string(kSeq));
        const train::RunConfig rc =
            c.file.empty() ? train::parse_run_config("", keys, "test") : train::load_run_config(c.file, keys);
        const auto f = train::model_family(rc);
        std::vector<float> p(static_cast<size_t>(f->numel())), g(p.size(), 0.0f);
        f->init(p.data(), 5, 0.05f);
        const model::TrainBatch b = batch(f->vocab_size(), kSeq);
        model::LossOptions o;
        o.mtp_num_layers = f->mtp_layers();
        o.whole = f->loss_weights(b, o.mtp_num_layers > 0);
        const ops::ScopedGemmDtype dtype(bf16 ? ops::GemmDtype::kBf16 : ops::GemmDtype::kF32);
        const model::LossTerms t = f->bind(p.data(), g.data())->loss_and_grad(b, o, rc.train.remat, true);
        const double measured = static_cast<double>(t.saved_bytes) / static_cast<double>(b.batch * b.seq);
        const double estimate = f->saved_bytes_per_token(rc.train.remat, bf16, kSeq);
        const std::string what = c.name + ", " + policy + (bf16 ? ", bf16" : ", float32");
        ASSERT_GT(measured, 0.0) << what;
        EXPECT_GE(estimate, measured) << what;
        EXPECT_LE(estimate, 1.25 * measured) << what;
        worst = std::max(worst, estimate / measured);
        std::printf("%-40s kept %8.0f bytes a token, estimated %8.0f (%.3f)\n", what.c_str(), measured, estimate,
                    estimate / measured);
      }
    }
  }
  std::printf("largest estimate / kept: %.3f\n", worst);
}

// The run's estimate is the parameters' state, the logits and the family's.
TEST(SavedBytes, TheTrainingEstimateAddsTheFamilysActivations) {
  for (const char* policy : {"full", "minimal"}) {
    const train::RunConfig rc =
        train::parse_run_config("",
                                {"model_name=" + kSrc + "/configs/v4-tiny.yml", "max_target_length=32",
                                 "per_device_batch_size=3", std::string("remat_policy=") + policy},
                                "test");
    const auto f = train::model_family(rc);
    const double tokens = 3.0 * 32.0;
    const double want =
        16.0 * static_cast<double>(f->numel()) +
        tokens * (8.0 * static_cast<double>(f->vocab_size()) + f->saved_bytes_per_token(rc.train.remat, false, 32));
    EXPECT_NEAR(static_cast<double>(train::training_memory_bytes(rc)), want, 1.0) << policy;
  }
}

}  // namespace saved_bytes_test
}  // namespace
}  // namespace ds
