// Prefix caching's parts: the entry store (infer/prefix_cache.h) finds the
// longest prefix a decoder can restore, drops entries another stands in for
// and evicts the least recently used; the V2/V3 decoder's snapshots restore
// any prefix (latent, naive, V3.2's indexer keys, Engram near the end) and
// continue as the whole prompt read at once does; its pool accounting
// (bytes_after, bytes_for) bounds what its buffers allocate.
#include "infer/prefix_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "infer/engine.h"
#include "model_fixture.h"
#include "test_util.h"

using ds::infer::CacheKind;
using ds::infer::CacheSnapshot;
using ds::infer::PrefixCache;

namespace {
namespace prefix_cache_test {

// A snapshot of `n` positions and `bytes` bytes, and a decoder that can cut
// its snapshots anywhere (whole = false) or only restore them whole.
struct FakeSnapshot final : CacheSnapshot {
  FakeSnapshot(int64_t n, size_t b) : n_(n), b_(b) {}
  int64_t length() const override { return n_; }
  size_t bytes() const override { return b_; }
  int64_t n_;
  size_t b_;
};

class FakeDecoder : public ds::infer::Decoder {
 public:
  explicit FakeDecoder(bool whole) : whole_(whole) {}
  int64_t vocab_size() const override { return 16; }
  int64_t max_positions() const override { return 64; }
  void start(int64_t) override {}
  void reset(int64_t) override {}
  std::vector<float> step(const std::vector<std::vector<int32_t>>&) override { return {}; }
  int64_t length(int64_t) const override { return 0; }
  size_t cache_bytes() const override { return 0; }
  int64_t restorable(const CacheSnapshot& s, int64_t want) const override {
    if (whole_) return want >= s.length() ? s.length() : 0;
    return std::min(want, s.length());
  }

 private:
  bool whole_;
};

std::shared_ptr<const CacheSnapshot> snap(int64_t n) { return std::make_shared<FakeSnapshot>(n, 100 * n); }

TEST(PrefixCache, FindsTheLongestPrefixButNeverTheWholePrompt) {
  FakeDecoder d(false);
  PrefixCache pc;
  pc.insert({1, 2, 3, 4, 5}, snap(5), d);
  pc.insert({1, 2, 9}, snap(3), d);
  EXPECT_EQ(pc.entries(), 2u);
  EXPECT_EQ(pc.bytes(), 800u);
  auto m = pc.find({1, 2, 3, 4, 5, 6}, d);
  ASSERT_TRUE(m.snapshot);
  EXPECT_EQ(m.length, 5);
  EXPECT_EQ(m.snapshot->length(), 5);
  // The whole prompt is there: its last token is read all the same.
  EXPECT_EQ(pc.find({1, 2, 3, 4, 5}, d).length, 4);
  EXPECT_EQ(pc.find({1, 2, 9, 9}, d).snapshot->length(), 3);
  EXPECT_EQ(pc.find({1, 2, 9, 9}, d).length, 3);
  EXPECT_FALSE(pc.find({7, 1, 2}, d).snapshot);
  EXPECT_FALSE(pc.find({1}, d).snapshot);  // nothing may be taken from a one-token prompt
}

TEST(PrefixCache, DropsWhatAnotherEntryStandsInFor) {
  FakeDecoder d(false);
  PrefixCache pc;
  pc.insert({1, 2, 3, 4, 5}, snap(5), d);
  pc.insert({1, 2, 3}, snap(3), d);  // held by the first: not kept
  EXPECT_EQ(pc.entries(), 1u);
  pc.insert({1, 2, 3, 4, 5, 6, 7}, snap(7), d);  // holds the first: it goes
  EXPECT_EQ(pc.entries(), 1u);
  EXPECT_EQ(pc.bytes(), 700u);
  // The snapshot holds fewer positions than the tokens given: only those count.
  pc.insert({4, 4, 4, 4}, snap(2), d);
  EXPECT_EQ(pc.find({4, 4, 4, 4}, d).length, 2);

  // A decoder that restores only whole snapshots keeps both.
  FakeDecoder whole(true);
  PrefixCache pw;
  pw.insert({1, 2, 3, 4, 5}, snap(5), whole);
  pw.insert({1, 2, 3}, snap(3), whole);
  EXPECT_EQ(pw.entries(), 2u);
  EXPECT_EQ(pw.find({1, 2, 3, 4, 9}, whole).length, 3);
  EXPECT_EQ(pw.find({1, 2, 3, 4, 5, 9}, whole).length, 5);
  EXPECT_FALSE(pw.find({1, 2}, whole).snapshot);
}

TEST(PrefixCache, EvictsTheLeastRecentlyUsed) {
  FakeDecoder d(false);
  PrefixCache pc;
  pc.insert({1, 1}, snap(2), d);
  pc.insert({2, 2}, snap(2), d);
  pc.insert({3, 3}, snap(2), d);
  ASSERT_TRUE(pc.find({1, 1, 5}, d).snapshot);  // 1 is now the most recent
  ASSERT_TRUE(pc.evict());                      // 2 goes
  EXPECT_FALSE(pc.find({2, 2, 5}, d).snapshot);
  auto three = pc.find({3, 3, 5}, d);  // 3 is now the most recent, 1 the least
  EXPECT_TRUE(pc.evict(three.snapshot.get()));
  EXPECT_FALSE(pc.find({1, 1, 5}, d).snapshot);
  EXPECT_FALSE(pc.evict(three.snapshot.get()));  // only the kept one is left
  EXPECT_EQ(pc.entries(), 1u);
  EXPECT_EQ(pc.evictions(), 2u);
  EXPECT_TRUE(pc.evict());
  EXPECT_EQ(pc.bytes(), 0u);
  EXPECT_FALSE(pc.evict());
}

// The V2/V3 decoder over tiny models of each cache layout.
struct Case {
  const char* name;
  CacheKind kind;
  void (*edit)(nlohmann::json&);
};

class KvSnapshotTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    auto j = ds::test::tiny_v3_config();
    GetParam().edit(j);
    ds::test::write_random_model(dir_.path(), j, 23);
    m_ = ds::infer::load_model(dir_.path());
  }
  std::unique_ptr<ds::infer::Decoder> decoder() { return ds::infer::kv_decoder(*m_->engine, GetParam().kind); }
  ds::test::TempDir dir_{"ds_prefix"};
  std::unique_ptr<ds::infer::LoadedModel> m_;
};

std::vector<int32_t> tokens(int n, int seed) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + seed * 11 + 5) % 90);
  return t;
}

float max_abs(const std::vector<float>& a) {
  float m = 0;
  for (float x : a) m = std::max(m, std::fabs(x));
  return m;
}

TEST_P(KvSnapshotTest, ARestoredPrefixContinuesAsTheWholePromptReadAtOnce) {
  auto d = decoder();
  d->start(2);
  const auto a = tokens(60, 1);
  d->step({{a.begin(), a.begin() + 50}, {}});
  for (int i = 50; i < 60; ++i) d->step({{a[static_cast<size_t>(i)]}, {}});  // decode steps too
  ASSERT_EQ(d->length(0), 60);
  auto s = d->take_snapshot(0);
  ASSERT_TRUE(s);
  EXPECT_EQ(d->length(0), 0);  // taken out
  EXPECT_EQ(s->length(), 60);
  EXPECT_GT(s->bytes(), 0u);
  // A prompt that shares m tokens with the snapshot's.
  for (int64_t m : {1, 17, 50, 59, 60}) {
    const int64_t r = d->restorable(*s, m);
    if (r == 0) {  // Engram: the conv's rows before engram_first are gone
      EXPECT_LT(m, 40) << GetParam().name;
      continue;
    }
    ASSERT_EQ(r, m);
    std::vector<int32_t> b(a.begin(), a.begin() + m);
    const auto more = tokens(9, 2);
    b.insert(b.end(), more.begin(), more.end());
    d->reset(1);
    d->restore(1, *s, m);
    EXPECT_EQ(d->length(1), m);
    EXPECT_LE(d->sequence_bytes(1), d->bytes_for(m));
    const auto got = d->step({{}, {b.begin() + m, b.end()}});
    auto fresh = decoder();
    fresh->start(1);
    const auto want = fresh->step({b});
    ASSERT_EQ(got.size(), want.size());
    float diff = 0;
    for (size_t v = 0; v < got.size(); ++v) diff = std::max(diff, std::fabs(got[v] - want[v]));
    // Only the summation order differs (what a prompt read in two chunks gives).
    EXPECT_LE(diff, 2e-5f * std::max(1.0f, max_abs(want))) << GetParam().name << " m " << m;
  }
  EXPECT_EQ(d->restorable(*s, 0), 0);
  EXPECT_EQ(d->restorable(*s, 80), 60);
}

TEST_P(KvSnapshotTest, BytesAfterBoundsWhatAStepAllocates) {
  auto d = decoder();
  d->start(2);
  const int64_t limit = 100;
  d->limit_length(limit);
  const auto a = tokens(limit, 3);
  int64_t at = 0;
  const int64_t chunks[] = {3, 1, 1, 29, 1, 40, 2, 1, 1, 21};
  for (const int64_t n : chunks) {
    const size_t before = d->sequence_bytes(0), after = d->bytes_after(0, n);
    EXPECT_GE(after, before);
    d->step({{a.begin() + at, a.begin() + at + n}, {}});
    at += n;
    EXPECT_LE(d->sequence_bytes(0), after) << GetParam().name << " at " << at;
    EXPECT_LE(d->sequence_bytes(0), d->bytes_for(limit));
  }
  ASSERT_EQ(at, limit);
  // Whole blocks: 100 positions take two of 64, what bytes_for counts (with
  // Engram, bytes_for counts a conv row for every position; the cache keeps
  // the last few).
  if (std::string(GetParam().name) != "engram") {
    EXPECT_EQ(d->sequence_bytes(0), d->bytes_for(limit));
  }
  d->reset(0);
  EXPECT_EQ(d->sequence_bytes(0), 0u);
}

void none(nlohmann::json&) {}
void v32(nlohmann::json& j) {
  j["model_type"] = "deepseek_v32";
  j["index_n_heads"] = 2;
  j["index_head_dim"] = 16;
  j["index_topk"] = 4;
}
void engram(nlohmann::json& j) {
  j["engram_layers"] = {0, 2};
  j["engram_num_heads"] = 2;
  j["engram_head_dim"] = 8;
  j["engram_vocab_bases"] = {40, 50};
  j["engram_kernel_size"] = 3;
}

INSTANTIATE_TEST_SUITE_P(Layouts, KvSnapshotTest,
                         ::testing::Values(Case{"latent", CacheKind::Latent, none},
                                           Case{"naive", CacheKind::Naive, none}, Case{"v32", CacheKind::Latent, v32},
                                           Case{"engram", CacheKind::Latent, engram}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace prefix_cache_test
}  // namespace
