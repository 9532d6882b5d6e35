// The batcher's cache pool and prefix caching (infer/batcher.h,
// BatcherOptions::cache_memory and prefix_cache): each turn of a chat reads
// only the tokens after what the previous turn held and makes what it makes
// with the cache off; kept prefixes are evicted least recently used; a pool
// too small for every sequence stops the youngest (which read their tokens
// again) and never holds more than its bound, each request still making
// what it makes alone; the context is what the pool holds; V4's states are
// reused whole.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "infer/batcher.h"
#include "infer/v4_engine.h"
#include "model/family_kind.h"
#include "model/hf_params.h"
#include "model/v4_train.h"
#include "model_fixture.h"
#include "test_util.h"

using ds::infer::Batcher;
using ds::infer::BatcherOptions;
using ds::infer::BatchRequest;
using ds::infer::CacheKind;

namespace {
namespace cache_pool_test {

std::vector<int32_t> drain(ds::infer::Generation& g) {
  std::vector<int32_t> out;
  int32_t t;
  while (g.next(&t)) out.push_back(t);
  return out;
}

std::vector<int32_t> tokens(int n, int seed) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + seed * 11 + 5) % 90);
  return t;
}

BatchRequest request(std::vector<int32_t> prompt, int64_t max_new, uint64_t seed = 0, float temperature = 0) {
  BatchRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  r.sampler.temperature = temperature;
  r.sampler.seed = seed;
  return r;
}

// Ten turns of a chat, each prompt the last one, its answer and new
// tokens: the answers, and the batcher's counters.
struct Chat {
  std::vector<std::vector<int32_t>> answers;
  uint64_t read = 0, hit_tokens = 0, hits = 0;
};
Chat chat(ds::infer::Decoder& d, BatcherOptions opt) {
  Batcher b(d, opt);
  Chat c;
  std::vector<int32_t> prompt = tokens(8, 1);
  for (int turn = 0; turn < 10; ++turn) {
    auto g = b.submit(request(prompt, 4));
    c.answers.push_back(drain(*g));
    prompt.insert(prompt.end(), c.answers.back().begin(), c.answers.back().end());
    const auto more = tokens(3, turn + 2);
    prompt.insert(prompt.end(), more.begin(), more.end());
  }
  c.read = b.counters().prompt_tokens.load();
  c.hit_tokens = b.counters().prefix_hit_tokens.load();
  c.hits = b.counters().prefix_hits.load();
  EXPECT_LE(b.counters().pool_peak.load(), opt.cache_memory == 0 ? SIZE_MAX : opt.cache_memory);
  return c;
}

BatcherOptions with_prefix_cache(BatcherOptions o) {
  o.cache_memory = 64 << 20;
  o.prefix_cache = true;
  return o;
}

class CachePoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ds::test::write_random_model(dir_.path(), ds::test::tiny_v3_config(), 29);
    m_ = ds::infer::load_model(dir_.path());
  }
  std::unique_ptr<ds::infer::Decoder> decoder() { return ds::infer::kv_decoder(*m_->engine, CacheKind::Latent); }
  // Bytes of a sequence of n positions (whole blocks of 64).
  size_t bytes_for(int64_t n) { return decoder()->bytes_for(n); }

  ds::test::TempDir dir_{"ds_cache_pool"};
  std::unique_ptr<ds::infer::LoadedModel> m_;
};

TEST_F(CachePoolTest, EachTurnOfAChatReadsOnlyItsNewTokens) {
  auto d = decoder();
  const Chat off = chat(*d, BatcherOptions{2, 16, 512});
  const Chat on = chat(*d, with_prefix_cache(BatcherOptions{2, 16, 512}));
  EXPECT_EQ(on.answers, off.answers);
  // Without the cache every turn reads its whole prompt: 8, 15, 22, ... 71.
  EXPECT_EQ(off.read, 10u * 8 + 7u * 45);
  EXPECT_EQ(off.hit_tokens, 0u);
  // With it the first turn reads 8 tokens; each later one the last answer's
  // final token (never read into the cache) and its 3 new ones.
  EXPECT_EQ(on.read, 8u + 9u * 4);
  EXPECT_EQ(on.read + on.hit_tokens, off.read);
  EXPECT_EQ(on.hits, 9u);
}

// With speculative decoding the MTP layer's rows and the hidden states it
// has yet to read travel with the kept cache: the turns still reuse it, and
// greedy answers are the plain loop's.
TEST(CachePoolMtp, SpeculativeTurnsReuseTheKeptCache) {
  ds::test::TempDir dir("ds_cache_pool_mtp");
  auto cfg = ds::test::tiny_v3_config();
  cfg["num_nextn_predict_layers"] = 1;
  ds::test::write_random_model(dir.path(), cfg, 31, {}, /*mtp=*/true);
  auto plain = ds::infer::load_model(dir.path());
  auto mtp = ds::infer::load_model(dir.path(), /*mtp=*/true);
  auto pd = ds::infer::kv_decoder(*plain->engine, CacheKind::Latent);
  const Chat want = chat(*pd, BatcherOptions{2, 16, 512});
  for (const int64_t k : {1, 3}) {
    auto md = ds::infer::kv_decoder(*mtp->engine, CacheKind::Latent);
    BatcherOptions opt{2, 16, 512};
    opt.draft_tokens = k;
    const Chat got = chat(*md, with_prefix_cache(opt));
    EXPECT_EQ(got.answers, want.answers) << k << " drafts";
    EXPECT_EQ(got.hits, 9u) << k << " drafts";
    EXPECT_EQ(got.read + got.hit_tokens, want.read) << k << " drafts";
    EXPECT_LT(got.read, want.read / 3) << k << " drafts";
  }
  // A pool too small for every sequence: the stopped ones read their
  // tokens again, the MTP layer's with them.
  std::vector<BatchRequest> rs;
  for (int i = 0; i < 5; ++i) rs.push_back(request(tokens(20 + 3 * i, 40 + i), 40 + i));
  std::vector<std::vector<int32_t>> alone;
  {
    Batcher b(*pd, BatcherOptions{4, 16, 512});
    for (const auto& r : rs) alone.push_back(drain(*b.submit(r)));
  }
  auto md = ds::infer::kv_decoder(*mtp->engine, CacheKind::Latent);
  BatcherOptions opt{4, 16, 16};
  opt.draft_tokens = 2;
  opt.cache_memory = 2 * md->bytes_for(64);
  opt.prefix_cache = true;
  Batcher b(*md, opt);
  std::vector<std::shared_ptr<ds::infer::Generation>> gens;
  for (const auto& r : rs) gens.push_back(b.submit(r));
  for (size_t i = 0; i < rs.size(); ++i) EXPECT_EQ(drain(*gens[i]), alone[i]) << "request " << i;
  EXPECT_GT(b.counters().preemptions.load(), 0u);
  EXPECT_LE(b.counters().pool_peak.load(), opt.cache_memory);
}

TEST_F(CachePoolTest, KeptPrefixesAreEvictedLeastRecentlyUsed) {
  // Room for 128 positions: a running sequence's block of 64 and two kept
  // prompts of 31 positions.
  BatcherOptions opt{1, 16, 512};
  opt.cache_memory = bytes_for(128);
  opt.prefix_cache = true;
  auto d = decoder();
  Batcher b(*d, opt);
  EXPECT_EQ(b.max_positions(), 128);
  std::vector<std::vector<int32_t>> prompts, outs;
  for (int k = 0; k < 4; ++k) {
    prompts.push_back(tokens(30, 10 + k));
    outs.push_back(drain(*b.submit(request(prompts.back(), 2))));
  }
  const auto& k = b.counters();
  EXPECT_EQ(k.prefix_hits.load(), 0u);
  EXPECT_EQ(k.prefix_evictions.load(), 1u);  // the first prompt's, for the fourth's block
  EXPECT_EQ(k.prefix_entries.load(), 3u);
  // The first prompt's is gone; the fourth's is there.
  auto extend = [&](int i) {
    std::vector<int32_t> p = prompts[static_cast<size_t>(i)];
    p.insert(p.end(), outs[static_cast<size_t>(i)].begin(), outs[static_cast<size_t>(i)].end());
    p.push_back(7);
    return p;
  };
  drain(*b.submit(request(extend(0), 1)));
  EXPECT_EQ(k.prefix_hits.load(), 0u);
  drain(*b.submit(request(extend(3), 1)));
  EXPECT_EQ(k.prefix_hits.load(), 1u);
  EXPECT_EQ(k.prefix_hit_tokens.load(), 31u);
  EXPECT_LE(k.pool_peak.load(), opt.cache_memory);
}

TEST_F(CachePoolTest, APoolTooSmallForEverySequenceStopsTheYoungestAndNeverGrowsPastItsBound) {
  // Four slots, room for two sequences of up to 64 positions, each
  // request running to 60-75: some must stop and read their tokens again.
  std::vector<BatchRequest> rs;
  for (int k = 0; k < 6; ++k)
    rs.push_back(request(tokens(20 + 2 * k, 30 + k), 40 + k, 5 + k, k % 2 == 1 ? 0.9f : 0.0f));
  std::vector<std::vector<int32_t>> want;
  {
    auto d = decoder();
    Batcher free_pool(*d, BatcherOptions{4, 16, 512});
    for (const auto& r : rs) want.push_back(drain(*free_pool.submit(r)));
  }
  for (const bool prefix : {false, true}) {
    BatcherOptions opt{4, 16, 16};
    opt.cache_memory = bytes_for(128);
    opt.prefix_cache = prefix;
    auto d = decoder();
    Batcher b(*d, opt);
    std::vector<std::shared_ptr<ds::infer::Generation>> gens;
    for (const auto& r : rs) gens.push_back(b.submit(r));
    for (size_t i = 0; i < rs.size(); ++i) {
      EXPECT_EQ(drain(*gens[i]), want[i]) << "request " << i << " prefix " << prefix;
      EXPECT_EQ(gens[i]->finish(), ds::infer::Finish::Length);
    }
    EXPECT_GT(b.counters().preemptions.load(), 0u);
    EXPECT_LE(b.counters().pool_peak.load(), opt.cache_memory);
    EXPECT_GT(b.counters().pool_peak.load(), bytes_for(64));
  }
}

TEST_F(CachePoolTest, TheContextIsWhatThePoolHoldsAndAPoolBelowOneTokenIsRefused) {
  auto d = decoder();
  {
    BatcherOptions opt{2, 16, 512};
    opt.cache_memory = bytes_for(64);
    Batcher b(*d, opt);
    EXPECT_EQ(b.max_positions(), 64);
    EXPECT_THROW(b.submit(request(tokens(65, 1), 1)), ds::Error);
    // A sequence stops at the pool's last position.
    auto g = b.submit(request(tokens(60, 1), 20));
    EXPECT_EQ(drain(*g).size(), 5u);
    EXPECT_EQ(g->finish(), ds::infer::Finish::Length);
  }
  BatcherOptions tiny{2, 16, 512};
  tiny.cache_memory = 100;
  EXPECT_THROW(Batcher(*d, tiny), ds::Error);
  BatcherOptions no_bound{2, 16, 512};
  no_bound.prefix_cache = true;
  EXPECT_THROW(Batcher(*d, no_bound), ds::Error);
}

// A V4 state cannot be cut: it is reused when the prompt extends all of it.
TEST(CachePoolV4, AStateIsReusedWholeByAPromptThatExtendsIt) {
  ds::test::TempDir dir("ds_cache_pool_v4");
  auto cfg = ds::model::v4_preset(std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml", {});
  ASSERT_TRUE(cfg.has_value());
  auto params = ds::model::V4FlatParams::zeros(*cfg);
  ds::model::init_v4_params(*cfg, params, 5, 0.05f);
  params.sync_tables(*cfg);
  ds::model::export_v4_hf(dir.path(), *cfg, params.data.data(), ds::DType::F32, "test");
  auto m = ds::infer::load_v4_model(dir.path());
  const auto p1 = tokens(13, 3);
  std::vector<std::vector<int32_t>> got[2];
  uint64_t hit_tokens[2] = {0, 0};
  for (const bool prefix : {false, true}) {
    ds::infer::V4Decoder d(*m->model);
    BatcherOptions opt{2, 16, 512};
    opt.cache_memory = 64 << 20;
    opt.prefix_cache = prefix;
    Batcher b(d, opt);
    auto out1 = drain(*b.submit(request(p1, 3)));
    std::vector<int32_t> p2 = p1;
    p2.insert(p2.end(), out1.begin(), out1.end());
    p2.push_back(9);
    auto out2 = drain(*b.submit(request(p2, 3)));
    // Shares only part of the state's tokens: read from the start.
    std::vector<int32_t> p3(p1.begin(), p1.begin() + 8);
    p3.push_back(4);
    auto out3 = drain(*b.submit(request(p3, 3)));
    got[prefix] = {out1, out2, out3};
    hit_tokens[prefix] = b.counters().prefix_hit_tokens.load();
  }
  EXPECT_EQ(got[1], got[0]);
  EXPECT_EQ(hit_tokens[0], 0u);
  EXPECT_EQ(hit_tokens[1], 13u + 2u);  // the first request's prompt and its answer but the last token
}

// With MTP drafts (the V4 fixture made by DeepSeek's code, mtp.0): a kept
// state carries the MTP layer's positions and the streams it has not read;
// a ten-turn chat makes what it makes without drafts and without the
// prefix cache, reuses each turn's state, and the pool stays in its bound
// (room for one sequence of 96 positions and a kept state or two: the
// chat's last prompt has 75).
TEST(CachePoolV4, WithDraftsAKeptStateCarriesTheMtpLayers) {
  auto m = ds::infer::load_v4_model(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/v4/models/v4_tiny");
  Chat want;
  for (const bool spec : {false, true})
    for (const bool prefix : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "drafts " << spec << " prefix " << prefix);
      ds::infer::V4Decoder d(*m->model, spec);
      BatcherOptions opt{2, 16, 512};
      opt.cache_memory = 2 * d.bytes_for(96);
      opt.prefix_cache = prefix;
      opt.draft_tokens = spec ? 2 : 0;
      const Chat c = chat(d, opt);
      if (!spec && !prefix) {
        want = c;
        continue;
      }
      EXPECT_EQ(c.answers, want.answers);
      if (prefix) {
        EXPECT_GT(c.hit_tokens, 0u);
      }
    }
}

}  // namespace cache_pool_test
}  // namespace
