// Speculative decoding with the MTP layer (infer/speculative.h):
//  - greedy output is the plain loop's token for token, on a tiny V3 model
//    with a random MTP layer (its drafts mostly rejected) and through an
//    oracle that makes the MTP layer's drafts right or wrong on purpose (so
//    kept drafts, two tokens a step, and dropped ones are both exercised);
//  - the acceptance rule leaves the sampling distribution unchanged: a
//    chi-square test over many draws;
//  - sampled generation is reproducible from its seed, and bad options are
//    refused;
//  - the server's batcher drafts too: each request, greedy, makes what it
//    makes alone, with drafts kept and dropped while others run beside it;
//  - on DeepSeek-V3.2 (sparse attention, an indexer in the MTP layer too)
//    and with Engram layers, whose caches the rollback must also cut; and on
//    DeepSeek-V4, whose states the rollback rewinds (model/v4_model.h).
#include "infer/speculative.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "core/rng.h"
#include "forwarding_decoder.h"
#include "infer/batcher.h"
#include "infer/engine.h"
#include "infer/v4_engine.h"
#include "model_fixture.h"

namespace fs = std::filesystem;
using ds::infer::GenerateOptions;
using ds::infer::GenerateStats;

namespace {
namespace speculative_test {

class SpeculativeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ds_spec_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    auto cfg = config();
    cfg["num_nextn_predict_layers"] = 1;
    ds::test::write_random_model(dir_, cfg, 17, {}, /*mtp=*/true);
    m_ = ds::infer::load_model(dir_, /*mtp=*/true);
    plain_ = ds::infer::load_model(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  virtual nlohmann::json config() const { return ds::test::tiny_v3_config(); }
  virtual std::unique_ptr<ds::infer::Decoder> plain_decoder() {
    return ds::infer::kv_decoder(*plain_->engine, ds::infer::CacheKind::Latent);
  }
  virtual std::unique_ptr<ds::infer::Decoder> spec_decoder(ds::infer::CacheKind kind) {
    return ds::infer::kv_decoder(*m_->engine, kind);
  }
  virtual std::vector<ds::infer::CacheKind> kinds() const {
    return {ds::infer::CacheKind::Latent, ds::infer::CacheKind::Naive};
  }
  void greedy_output_is_the_plain_loops(int64_t new_tokens);
  void the_servers_batcher_drafts_too();

  std::vector<std::vector<int32_t>> run(ds::infer::Decoder& d, GenerateOptions opt, GenerateStats* st = nullptr) {
    return ds::infer::generate(d, prompts_, opt, st);
  }

  std::string dir_;
  std::unique_ptr<ds::infer::LoadedModel> m_, plain_;
  const std::vector<std::vector<int32_t>> prompts_ = {{5, 9, 2, 33, 7, 1, 8, 60, 4, 4, 12}, {3}, {70, 71, 72, 73}};
};

// The MTP layer's drafts replaced by one-hot rows: the true greedy token
// (from a plain run) except at about a third of the token indices, where it
// is wrong.
// draft() still runs the MTP layer, so its cache stays as it would. It
// tracks the tokens each sequence was fed and finds the request by its
// prompt, so it serves generate() and the batcher's slots alike.
class SlotOracleDecoder : public ds::test::ForwardingDecoder {
 public:
  SlotOracleDecoder(ds::infer::Decoder& d, std::vector<std::vector<int32_t>> prompts,
                    std::vector<std::vector<int32_t>> want)
      : ForwardingDecoder(d), prompts_(std::move(prompts)), want_(std::move(want)) {}
  void start(int64_t n) override {
    fed_.assign(static_cast<size_t>(n), {});
    ForwardingDecoder::start(n);
  }
  void reset(int64_t s) override {
    fed_[static_cast<size_t>(s)].clear();
    ForwardingDecoder::reset(s);
  }
  void copy(int64_t from, int64_t to) override {
    fed_[static_cast<size_t>(to)] = fed_[static_cast<size_t>(from)];
    ForwardingDecoder::copy(from, to);
  }
  std::vector<float> step_keep(const std::vector<std::vector<int32_t>>& tokens, bool all) override {
    for (size_t s = 0; s < tokens.size(); ++s) fed_[s].insert(fed_[s].end(), tokens[s].begin(), tokens[s].end());
    return ForwardingDecoder::step_keep(tokens, all);
  }
  void truncate(int64_t s, int64_t length) override {
    fed_[static_cast<size_t>(s)].resize(static_cast<size_t>(length));
    ForwardingDecoder::truncate(s, length);
  }
  std::vector<float> draft(const std::vector<std::vector<int32_t>>& next) override {
    auto rows = ForwardingDecoder::draft(next);
    links_.assign(next.size(), 0);
    int64_t r = 0;
    for (size_t s = 0; s < next.size(); ++s)
      if (!next[s].empty()) rig(s, rows.data() + r++ * vocab_size());
    return rows;
  }
  // A chained draft j is the candidate for the token j after the first.
  std::vector<float> draft_more(const std::vector<int32_t>& tokens) override {
    auto rows = ForwardingDecoder::draft_more(tokens);
    int64_t r = 0;
    for (size_t s = 0; s < tokens.size(); ++s) {
      if (tokens[s] < 0) continue;
      ++links_[s];
      rig(s, rows.data() + r++ * vocab_size());
    }
    return rows;
  }

 private:
  // Makes row the oracle's: right, or wrong at about a third of the token
  // indices, in no period a chain of drafts could fall in step with.
  void rig(size_t s, float* row) {
    const int64_t V = vocab_size();
    const auto& fed = fed_[s];
    for (size_t k = 0; k < prompts_.size(); ++k) {
      const auto& p = prompts_[k];
      if (fed.size() < p.size() || !std::equal(p.begin(), p.end(), fed.begin())) continue;
      const int64_t index = static_cast<int64_t>(fed.size() - p.size()) + 1 + links_[s];
      if (index < 1 || index >= static_cast<int64_t>(want_[k].size())) break;
      std::fill(row, row + V, -10.0f);
      const int32_t right = want_[k][static_cast<size_t>(index)];
      const bool wrong = index % 5 == 0 || index % 7 == 3;
      row[wrong ? (right + 1) % V : right] = 10.0f;
      break;
    }
  }

  std::vector<std::vector<int32_t>> prompts_, want_, fed_;
  std::vector<int64_t> links_;
};

// With Engram layers: a rejected draft's rollback also drops its token and
// its convolution rows from the Engram part of the cache.
class SpeculativeEngramTest : public SpeculativeTest {
 protected:
  nlohmann::json config() const override {
    auto j = ds::test::tiny_v3_config();
    j["engram_layers"] = {0, 2};
    j["engram_num_heads"] = 2;
    j["engram_head_dim"] = 8;
    j["engram_vocab_bases"] = {40, 50};
    j["engram_kernel_size"] = 3;
    return j;
  }
};

// DeepSeek-V3.2 (sparse attention): the MTP layer has its own indexer, and a
// rejected draft's rollback also drops its indexer keys and scales; index_topk
// 4 is below every sequence's length, so the selection is sparse throughout.
class SpeculativeV32Test : public SpeculativeTest {
 protected:
  nlohmann::json config() const override {
    auto j = ds::test::tiny_v3_config();
    j["model_type"] = "deepseek_v32";
    j["index_n_heads"] = 2;
    j["index_head_dim"] = 16;
    j["index_topk"] = 4;
    return j;
  }
};

// DeepSeek-V4 (the fixture made by DeepSeek's own code, with its MTP block
// mtp.0): a rejected draft's rollback must also put back the window ring's
// slots it overwrote, cut the compressed entries and indexer keys of the
// windows it closed and rebuild the compressors' carries. Sliding window 8
// and ratios 4 (overlapping, with the indexer) and 128: prompts and drafts
// wrap the ring and close windows of 4 throughout (a window of 128 closing
// inside a rewound step: tests/v4_rewind_test.cc).
class SpeculativeV4Test : public SpeculativeTest {
 protected:
  void SetUp() override {
    v4_ = ds::infer::load_v4_model(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/v4/models/v4_tiny");
  }
  void TearDown() override {}
  std::unique_ptr<ds::infer::Decoder> plain_decoder() override {
    return std::make_unique<ds::infer::V4Decoder>(*v4_->model, false);
  }
  std::unique_ptr<ds::infer::Decoder> spec_decoder(ds::infer::CacheKind) override {
    return std::make_unique<ds::infer::V4Decoder>(*v4_->model, true);
  }
  std::vector<ds::infer::CacheKind> kinds() const override { return {ds::infer::CacheKind::Latent}; }
  std::unique_ptr<ds::infer::LoadedV4Model> v4_;
};

TEST_F(SpeculativeTest, GreedyOutputIsThePlainLoops) { greedy_output_is_the_plain_loops(24); }
TEST_F(SpeculativeV4Test, GreedyOutputIsThePlainLoops) { greedy_output_is_the_plain_loops(48); }
TEST_F(SpeculativeV32Test, GreedyOutputIsThePlainLoops) { greedy_output_is_the_plain_loops(32); }
// Long enough that the cache drops old Engram rows between rollbacks.
TEST_F(SpeculativeEngramTest, GreedyOutputIsThePlainLoops) { greedy_output_is_the_plain_loops(48); }

void SpeculativeTest::greedy_output_is_the_plain_loops(int64_t new_tokens) {
  GenerateOptions opt;
  opt.max_new_tokens = new_tokens;
  opt.prefill_chunk = 5;  // the long prompt over three steps
  auto plain = plain_decoder();
  const auto want = run(*plain, opt);
  for (const auto kind : kinds()) {
    for (const int64_t k : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << "draft tokens " << k);
      auto spec = spec_decoder(kind);
      ASSERT_TRUE(spec->can_draft());
      GenerateOptions so = opt;
      so.draft_tokens = k;
      GenerateStats st;
      EXPECT_EQ(run(*spec, so, &st), want);
      EXPECT_GT(st.drafted, 0);
      // Through the oracle: two of three drafts right, so chains are kept
      // whole, cut after their first or second link, or at their start.
      auto inner = spec_decoder(kind);
      SlotOracleDecoder oracle(*inner, prompts_, want);
      GenerateStats ost;
      EXPECT_EQ(run(oracle, so, &ost), want);
      EXPECT_GT(ost.accepted, 0);
      EXPECT_LT(ost.accepted, ost.drafted);
      ASSERT_EQ(ost.drafted_at.size(), static_cast<size_t>(k));
      // Drafts kept at every position of the chain, and the sums add up.
      int64_t drafted = 0, accepted = 0;
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_GT(ost.accepted_at[j], 0) << "position " << j;
        EXPECT_LE(ost.accepted_at[j], ost.drafted_at[j]) << "position " << j;
        drafted += ost.drafted_at[j];
        accepted += ost.accepted_at[j];
      }
      EXPECT_EQ(drafted, ost.drafted);
      EXPECT_EQ(accepted, ost.accepted);
      EXPECT_EQ(ost.generated_tokens, 3 * opt.max_new_tokens);
    }
  }
}

TEST_F(SpeculativeTest, EosAndTheLastPositionEndItAsThePlainLoop) {
  GenerateOptions opt;
  opt.max_new_tokens = 200;  // past max_position_embeddings (128)
  auto plain = plain_decoder();
  const auto want = run(*plain, opt);
  auto spec = spec_decoder(ds::infer::CacheKind::Latent);
  opt.draft_tokens = 1;
  EXPECT_EQ(run(*spec, opt), want);
  // An EOS id the model makes early in one sequence.
  GenerateOptions eo;
  eo.max_new_tokens = 30;
  eo.eos_token_id = want[1][5];
  const auto want_eos = run(*plain, eo);
  eo.draft_tokens = 1;
  EXPECT_EQ(run(*spec, eo), want_eos);
}

TEST(SpeculativeRule, KeepsTheSamplingDistribution) {
  // p the model's, q the draft's: they differ everywhere.
  const std::vector<double> p = {0.30, 0.05, 0.25, 0.10, 0.20, 0.10};
  const std::vector<double> q = {0.10, 0.30, 0.05, 0.25, 0.10, 0.20};
  const int64_t K = static_cast<int64_t>(p.size()), trials = 200000;
  std::vector<int64_t> count(K, 0);
  int64_t kept = 0;
  const ds::Philox rng(2024);
  for (int64_t t = 0; t < trials; ++t) {
    const int32_t d = ds::infer::draw_from(q, rng.uniform(3 * t));
    bool accepted = false;
    ++count[ds::infer::accept_or_resample(p, q, d, rng.uniform(3 * t + 1), rng.uniform(3 * t + 2), &accepted)];
    kept += accepted;
  }
  // Pearson's statistic against p: chi-square with K - 1 = 5 degrees of
  // freedom when the rule is right; its 0.999 quantile is 20.52. Drawing
  // from q, or keeping every draft, gives thousands here.
  double chi2 = 0;
  for (int64_t i = 0; i < K; ++i) {
    const double e = p[i] * trials;
    chi2 += (count[i] - e) * (count[i] - e) / e;
  }
  EXPECT_LT(chi2, 20.52);
  // The acceptance rate is sum_i min(p_i, q_i) = 0.5.
  EXPECT_NEAR(static_cast<double>(kept) / trials, 0.5, 0.01);
  // Greedy: one-hot rows keep the draft exactly when it is the argmax.
  bool a = false;
  EXPECT_EQ(ds::infer::accept_or_resample({0, 1, 0}, {0, 1, 0}, 1, 0.99, 0.5, &a), 1);
  EXPECT_TRUE(a);
  EXPECT_EQ(ds::infer::accept_or_resample({0, 1, 0}, {0, 0, 1}, 2, 0.0, 0.5, &a), 1);
  EXPECT_FALSE(a);
}

// A chain of two drafts, as the loops run it: d1 ~ q1, d2 ~ q2(. | d1); d1
// kept or replaced by the rule against p1; only after a kept d1 is d2 held
// against p2(. | d1), and after a replaced one the next token is plain
// sampling's. The pair of tokens a step starts with must be distributed as
// p1(x1) p2(x2 | x1): chi-square over the 16 pairs, 15 degrees of freedom,
// 0.999 quantile 37.70. A wrong chain, keeping d2 unchecked or going on
// with d2 (against p2(. | d1)) after d1 was replaced, gives more than 10^4.
TEST(SpeculativeRule, AChainKeepsTheJointDistribution) {
  const std::vector<double> p1 = {0.4, 0.3, 0.2, 0.1}, q1 = {0.1, 0.2, 0.3, 0.4};
  const std::vector<std::vector<double>> p2 = {
      {0.7, 0.1, 0.1, 0.1}, {0.1, 0.6, 0.2, 0.1}, {0.25, 0.25, 0.25, 0.25}, {0.05, 0.05, 0.1, 0.8}};
  const std::vector<std::vector<double>> q2 = {
      {0.25, 0.25, 0.25, 0.25}, {0.4, 0.1, 0.4, 0.1}, {0.1, 0.1, 0.7, 0.1}, {0.3, 0.3, 0.3, 0.1}};
  const int64_t trials = 200000;
  std::vector<int64_t> count(16, 0);
  const ds::Philox rng(77);
  for (int64_t t = 0; t < trials; ++t) {
    auto u = [&](int k) { return rng.uniform(static_cast<uint64_t>(8 * t + k)); };
    const int32_t d1 = ds::infer::draw_from(q1, u(0)), d2 = ds::infer::draw_from(q2[d1], u(1));
    bool kept = false;
    const int32_t x1 = ds::infer::accept_or_resample(p1, q1, d1, u(2), u(3), &kept);
    const int32_t x2 = kept ? ds::infer::accept_or_resample(p2[x1], q2[d1], d2, u(4), u(5), &kept)
                            : ds::infer::draw_from(p2[x1], u(6));
    ++count[static_cast<size_t>(4 * x1 + x2)];
  }
  double chi2 = 0;
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b) {
      const double e = p1[a] * p2[a][b] * trials;
      chi2 += (count[4 * a + b] - e) * (count[4 * a + b] - e) / e;
    }
  EXPECT_LT(chi2, 37.70);
}

TEST_F(SpeculativeTest, SampledRunsFollowTheirSeed) {
  GenerateOptions opt;
  opt.max_new_tokens = 16;
  opt.sampler = {0.9f, 0, 0.95f, 31};
  opt.draft_tokens = 1;
  auto a = spec_decoder(ds::infer::CacheKind::Latent);
  const auto first = run(*a, opt);
  EXPECT_EQ(run(*a, opt), first);
  GenerateOptions three = opt;
  three.draft_tokens = 3;
  const auto chained = run(*a, three);
  EXPECT_EQ(run(*a, three), chained);
  for (const auto& seq : first) {
    EXPECT_EQ(seq.size(), 16u);
    for (int32_t t : seq) EXPECT_TRUE(t >= 0 && t < 96);
  }
  opt.sampler.seed = 32;
  EXPECT_NE(run(*a, opt), first);
}

TEST_F(SpeculativeTest, ImpossibleRequestsAreRefused) {
  GenerateOptions opt;
  opt.draft_tokens = 1;
  auto plain = plain_decoder();
  EXPECT_THROW(run(*plain, opt), ds::Error);  // no MTP layer loaded
  auto spec = spec_decoder(ds::infer::CacheKind::Latent);
  opt.draft_tokens = ds::infer::kMaxDraftTokens + 1;
  EXPECT_THROW(run(*spec, opt), ds::Error);
  opt.draft_tokens = -1;
  EXPECT_THROW(run(*spec, opt), ds::Error);
  // A model folder without an MTP layer.
  char tmpl[] = "/tmp/ds_spec_none_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ds::test::write_random_model(tmpl, ds::test::tiny_v3_config(), 3);
  EXPECT_THROW(ds::infer::load_model(tmpl, true), ds::Error);
  fs::remove_all(tmpl);
}

TEST_F(SpeculativeTest, TheServersBatcherDraftsToo) { the_servers_batcher_drafts_too(); }
TEST_F(SpeculativeV32Test, TheServersBatcherDraftsToo) { the_servers_batcher_drafts_too(); }
TEST_F(SpeculativeV4Test, TheServersBatcherDraftsToo) { the_servers_batcher_drafts_too(); }

void SpeculativeTest::the_servers_batcher_drafts_too() {
  // Alone, without drafts: what each request must make.
  GenerateOptions opt;
  opt.max_new_tokens = 20;
  auto plain = plain_decoder();
  const auto want = run(*plain, opt);
  for (const int64_t k : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "draft tokens " << k);
    auto inner = spec_decoder(ds::infer::CacheKind::Latent);
    SlotOracleDecoder oracle(*inner, prompts_, want);
    // Two slots for three requests (one waits), prompts over several chunks,
    // and the last request as two choices that share its prompt.
    ds::infer::BatcherOptions bo{3, 16, 4};
    bo.draft_tokens = k;
    ds::infer::Batcher b(oracle, bo);
    std::vector<std::shared_ptr<ds::infer::Generation>> gens;
    for (size_t r = 0; r + 1 < prompts_.size(); ++r)
      gens.push_back(b.submit(ds::infer::BatchRequest{prompts_[r], opt.max_new_tokens, {}}));
    for (auto& g : b.submit_choices(ds::infer::BatchRequest{prompts_.back(), opt.max_new_tokens, {}}, 2))
      gens.push_back(g);
    for (size_t r = 0; r < gens.size(); ++r) {
      std::vector<int32_t> got;
      int32_t t;
      while (gens[r]->next(&t)) got.push_back(t);
      EXPECT_EQ(got, want[std::min(r, prompts_.size() - 1)]) << "request " << r;
    }
    const auto& c = b.counters();
    const uint64_t drafted = c.drafted.load(), accepted = c.accepted.load();
    EXPECT_GT(accepted, 0u);
    EXPECT_LT(accepted, drafted);
    uint64_t sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_GT(c.accepted_at[j].load(), 0u) << "position " << j;
      sum += c.drafted_at[j].load();
    }
    EXPECT_EQ(sum, drafted);
    EXPECT_EQ(c.drafted_at[k].load(), 0u);
  }
  // Drafting only while at most one sequence decodes: the steps where
  // several decode check nothing (the MTP layer catches up on their
  // positions later), and each request still makes what it makes alone.
  // The first request makes 20 tokens, the others 4: it decodes alone at
  // the end, and only then are drafts made.
  uint64_t drafted[2] = {0, 0};
  for (const int64_t most : {0, 1}) {
    auto inner = spec_decoder(ds::infer::CacheKind::Latent);
    SlotOracleDecoder oracle(*inner, prompts_, want);
    ds::infer::BatcherOptions bo{3, 16, 4};
    bo.draft_tokens = 2;
    bo.draft_max_sequences = most;
    ds::infer::Batcher b(oracle, bo);
    std::vector<std::shared_ptr<ds::infer::Generation>> gens;
    const int64_t made[] = {opt.max_new_tokens, 4, 4};
    for (size_t r = 0; r < prompts_.size(); ++r)
      gens.push_back(b.submit(ds::infer::BatchRequest{prompts_[r], made[r], {}}));
    for (size_t r = 0; r < gens.size(); ++r) {
      std::vector<int32_t> got;
      int32_t t;
      while (gens[r]->next(&t)) got.push_back(t);
      EXPECT_EQ(got, std::vector<int32_t>(want[r].begin(), want[r].begin() + made[r]))
          << "request " << r << " drafting while at most " << most;
    }
    drafted[most] = b.counters().drafted.load();
    EXPECT_GT(b.counters().accepted.load(), 0u) << most;
  }
  EXPECT_GT(drafted[1], 0u);
  EXPECT_LT(drafted[1] + 4, drafted[0]);  // the short requests' 3 later tokens drafted for, at least
  // A batcher whose decoder cannot draft refuses to, and so does one asked
  // for more drafts than it chains.
  ds::infer::BatcherOptions bo{3, 16, 4};
  bo.draft_tokens = 1;
  ds::infer::Decoder& no_mtp = *plain;
  EXPECT_THROW(ds::infer::Batcher(no_mtp, bo), ds::Error);
  auto spec = spec_decoder(ds::infer::CacheKind::Latent);
  bo.draft_tokens = ds::infer::kMaxDraftTokens + 1;
  EXPECT_THROW(ds::infer::Batcher(*spec, bo), ds::Error);
}

}  // namespace speculative_test
}  // namespace
