// infer::perplexity against a plain restatement of llama-perplexity's loop
// (tools/perplexity/perplexity.cpp: chunks of n_ctx from the start, the
// chunk's first token set to BOS for the forward only, logits of positions
// first = n_ctx / 2 .. n_ctx - 2 scoring the next token, the error
// sqrt((mean(v^2) - mean(v)^2) / (n - 1)) * ppl), over logits that depend on
// the whole chunk so that a wrong chunking, position or BOS shows.
#include "infer/perplexity.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "infer/model.h"
#include "io/safetensors.h"

namespace {
namespace perplexity_test {

using ds::infer::PerplexityOptions;

constexpr int64_t kVocab = 11;

// Logits of a chunk: row t depends on every token up to t (a causal
// "model") and on the chunk's first token.
std::vector<float> fake_logits(const std::vector<int32_t>& chunk) {
  const int64_t T = static_cast<int64_t>(chunk.size());
  std::vector<float> out(static_cast<size_t>(T * kVocab));
  double acc = 0;
  for (int64_t t = 0; t < T; ++t) {
    acc = 0.7 * acc + chunk[t] + 0.1 * t;
    for (int64_t v = 0; v < kVocab; ++v)
      out[static_cast<size_t>(t * kVocab + v)] = static_cast<float>(std::sin(acc * (v + 1)) * 3 + 0.05 * chunk[0]);
  }
  return out;
}

std::vector<int32_t> stream(int64_t n) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 7 + i / 3) % kVocab);
  return ids;
}

// llama-perplexity's loop, written out on its own.
struct Want {
  double ppl, err;
  int64_t count;
};
Want by_hand(const std::vector<int32_t>& ids, int64_t ctx, int64_t chunks, int bos) {
  double nll = 0, nll2 = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < chunks; ++i) {
    std::vector<int32_t> c(ids.begin() + i * ctx, ids.begin() + (i + 1) * ctx);
    if (bos >= 0) c[0] = bos;
    const auto lg = fake_logits(c);
    for (int64_t j = ctx / 2; j < ctx - 1; ++j) {
      const float* row = &lg[j * kVocab];
      double mx = -1e300, sum = 0;
      for (int64_t v = 0; v < kVocab; ++v) mx = std::max<double>(mx, row[v]);
      for (int64_t v = 0; v < kVocab; ++v) sum += std::exp(row[v] - mx);
      const double x = -(row[ids[i * ctx + j + 1]] - mx - std::log(sum));
      nll += x;
      nll2 += x * x;
      ++count;
    }
  }
  nll /= count;
  nll2 = nll2 / count - nll * nll;
  const double ppl = std::exp(nll);
  return {ppl, std::sqrt(nll2 / (count - 1)) * ppl, count};
}

TEST(Perplexity, IsLlamaPerplexitysLoop) {
  const auto ids = stream(103);  // 3 chunks of 32 and 7 tokens left out
  for (int bos : {-1, 9}) {
    PerplexityOptions o;
    o.ctx = 32;
    if (bos >= 0) o.bos = bos;
    std::vector<double> running;
    const auto r = ds::infer::perplexity(ids, o, kVocab, fake_logits, [&](int64_t i, double p) {
      EXPECT_EQ(i, static_cast<int64_t>(running.size()) + 1);
      running.push_back(p);
    });
    const Want w = by_hand(ids, 32, 3, bos);
    EXPECT_EQ(r.chunks, 3);
    EXPECT_EQ(r.scored, w.count);
    EXPECT_EQ(r.scored, 3 * (32 - 16 - 1));
    EXPECT_NEAR(r.ppl, w.ppl, 1e-9 * w.ppl);
    EXPECT_NEAR(r.ppl_error, w.err, 1e-9 * w.err);
    ASSERT_EQ(running.size(), 3u);
    EXPECT_DOUBLE_EQ(running.back(), r.ppl);
    EXPECT_NEAR(running[0], by_hand(ids, 32, 1, bos).ppl, 1e-9 * running[0]);
  }
  // The BOS changes what the chunk's forward sees.
  PerplexityOptions with;
  with.ctx = 32;
  with.bos = 9;
  PerplexityOptions without = with;
  without.bos.reset();
  EXPECT_NE(ds::infer::perplexity(ids, with, kVocab, fake_logits).ppl,
            ds::infer::perplexity(ids, without, kVocab, fake_logits).ppl);
}

TEST(Perplexity, ChunksCapAndRefusals) {
  const auto ids = stream(200);
  PerplexityOptions o;
  o.ctx = 40;
  o.chunks = 2;
  const auto r = ds::infer::perplexity(ids, o, kVocab, fake_logits);
  EXPECT_EQ(r.chunks, 2);
  EXPECT_NEAR(r.ppl, by_hand(ids, 40, 2, -1).ppl, 1e-9 * r.ppl);
  o.chunks = -1;
  EXPECT_EQ(ds::infer::perplexity(ids, o, kVocab, fake_logits).chunks, 5);
  // llama-perplexity's minimum: two chunks of data.
  o.ctx = 101;
  EXPECT_THROW(ds::infer::perplexity(ids, o, kVocab, fake_logits), ds::Error);
  o.ctx = 3;
  EXPECT_THROW(ds::infer::perplexity(ids, o, kVocab, fake_logits), ds::Error);
  o.ctx = 40;
  o.chunks = 0;
  EXPECT_THROW(ds::infer::perplexity(ids, o, kVocab, fake_logits), ds::Error);
  // Logits of the wrong shape.
  o.chunks = -1;
  EXPECT_THROW(ds::infer::perplexity(ids, o, kVocab, [](const std::vector<int32_t>&) { return std::vector<float>(3); }),
               ds::Error);
}

TEST(Perplexity, TokenNllIsStableFarFromZero) {
  const std::vector<float> row = {1000.0f, 999.0f, -1000.0f};
  EXPECT_NEAR(ds::infer::token_nll(row.data(), 3, 0), std::log1p(std::exp(-1.0)), 1e-12);
  EXPECT_NEAR(ds::infer::token_nll(row.data(), 3, 2), 2000.0 + std::log1p(std::exp(-1.0)), 1e-9);
}

// The model path end to end: the first chunk of a fixture's 20 tokens,
// run by the engine (`deepseek perplexity`'s logits), against the same
// chunk scored on the float64 reference's logits of the whole sequence
// (tests/reference: rows 0..ctx-1 of a causal model are the chunk's).
TEST(Perplexity, EngineMatchesTheFloat64Reference) {
  const std::string dir = std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/models/v3_qlora_yarn";
  const auto tokens = nlohmann::json::parse(std::ifstream(dir + "/tokens.json"))[2].get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 20u);
  const std::vector<float> ref =
      ds::io::SafetensorsFile::open(dir + "/expected.safetensors").tensor("logits.2").to_vector();
  const auto m = ds::infer::open_model(dir, {});
  m->load();
  const int64_t V = m->vocab_size();
  PerplexityOptions o;
  o.ctx = 10;
  o.chunks = 1;
  const auto engine = ds::infer::perplexity(tokens, o, V, [&](const std::vector<int32_t>& chunk) {
    return m->logits(chunk, 0, ds::infer::CacheKind::Latent, nullptr);
  });
  const auto want = ds::infer::perplexity(tokens, o, V, [&](const std::vector<int32_t>& chunk) {
    EXPECT_EQ(chunk, std::vector<int32_t>(tokens.begin(), tokens.begin() + 10));
    return std::vector<float>(ref.begin(), ref.begin() + 10 * V);
  });
  EXPECT_EQ(engine.scored, 4);
  EXPECT_NEAR(engine.mean_nll, want.mean_nll, 1e-5);
  EXPECT_GT(engine.ppl, 1.0);
}

}  // namespace perplexity_test
}  // namespace
