// Undoing the last tokens of a DeepSeek-V4 step (model/v4_model.h:
// V4Model::mark and rewind, what speculative decoding's rollback runs on).
// A state that took a step of n tokens and was rewound to its first j must
// hold what a state that took only those j tokens holds: the window ring,
// both compressors' carries, the compressed entries and indexer keys (as
// codes with the roundings, as float32 rows without), the entry count and
// the length. On the fixture made by DeepSeek's own code: sliding window 8
// (steps of up to 8 tokens wrap it), ratio 4 with overlapping windows and
// the indexer, ratio 128. Steps start at every phase of the windows of 4,
// and the ratio-128 layer's first window closes inside a rewound step.
// The MTP block's state is rewound the same way after a chain of drafts.
// And on DeepSeek-V4.1's fixture (ratios 2 and 1, layers reading another
// layer's entries and index keys, Engram): its Engram history and last
// published index source are rewound as well. With DeepSeek's late
// publishing of index keys a token depends on how the tokens were split
// into steps, so there a step cannot be undone and mark() refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>

#include "core/error.h"
#include "infer/v4_engine.h"
#include "model/v4_model.h"

using namespace ds::model;

namespace {
namespace v4_rewind_test {

struct Case {
  const char* name;
  const char* dir;  // below tests/data
  bool qat, late_index_keys;
};

std::unique_ptr<ds::infer::LoadedV4Model> load(const Case& c) {
  V4Options o;
  o.qat = c.qat;
  o.late_index_keys = c.late_index_keys;
  return ds::infer::load_v4_model(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/" + c.dir, o);
}

std::vector<int32_t> tokens(int64_t n, int64_t seed, int64_t vocab) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((i * 37 + seed * 11 + 5) % vocab));
  return t;
}

// Float lists agree to rounding: the two states computed the same rows in
// steps of different lengths, and a product's last bits may depend on how
// many rows it has.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-5 * std::max(1.0f, std::fabs(want[i]))) << what << " [" << i << "]";
}

// Codes rounded from such rows: nearly all the same.
void expect_codes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
  EXPECT_LE(differ, got.size() / 100) << what;
}

void expect_same_layer(const V4LayerState& got, const V4LayerState& want, const std::string& what) {
  EXPECT_EQ(got.count, want.count) << what;
  expect_close(got.window, want.window, what + " window");
  for (const auto& [g, w, name] :
       {std::tuple{&got.carry, &want.carry, "carry"}, std::tuple{&got.index_carry, &want.index_carry, "index carry"}}) {
    EXPECT_EQ(g->start, w->start) << what << " " << name;
    expect_close(g->P, w->P, what + " " + name + " P");
    expect_close(g->Z, w->Z, what + " " + name + " Z");
    EXPECT_FALSE(g->hold) << what << " " << name;
    EXPECT_TRUE(g->held_P.empty() && g->held_Z.empty()) << what << " " << name;
  }
  expect_close(got.entries, want.entries, what + " entries");
  expect_close(got.index_keys, want.index_keys, what + " index keys");
  expect_close(got.entry_rope, want.entry_rope, what + " entry rope");
  expect_codes(got.entry_codes, want.entry_codes, what + " entry codes");
  expect_codes(got.entry_scales, want.entry_scales, what + " entry scales");
  expect_codes(got.key_codes, want.key_codes, what + " key codes");
  expect_codes(got.key_scales, want.key_scales, what + " key scales");
  expect_codes(got.entry_fp4, want.entry_fp4, what + " entry fp4");
  expect_codes(got.entry_fp4_scales, want.entry_fp4_scales, what + " entry fp4 scales");
}

void expect_same_state(const V4State& got, const V4State& want, int64_t layers, const std::string& what) {
  ASSERT_EQ(got.length, want.length) << what;
  ASSERT_EQ(got.layers.size(), want.layers.size()) << what;
  EXPECT_EQ(got.engram_history, want.engram_history) << what;
  EXPECT_EQ(got.published_keys, want.published_keys) << what;
  for (int64_t l = 0; l < layers; ++l)
    expect_same_layer(got.layers[static_cast<size_t>(l)], want.layers[static_cast<size_t>(l)],
                      what + " layer " + std::to_string(l));
}

class V4RewindTest : public ::testing::TestWithParam<Case> {};

TEST_P(V4RewindTest, ARewoundStepHoldsWhatAShorterStepLeaves) {
  auto f = load(GetParam());
  const int64_t vocab = f->config.vocab_size;
  V4Model& m = *f->model;
  const int64_t L = f->config.num_hidden_layers;
  const auto all = tokens(140, 3, vocab);
  // Prompts of 9 to 12 tokens (each phase of the windows of 4), then steps
  // of 8 (the window's length) rewound to every length; and a prompt of 122,
  // whose step of 8 closes the first window of 128 at its 7th token.
  for (const int64_t prompt : {9, 10, 11, 12, 122}) {
    V4State base = m.new_state();
    m.forward(base, all.data(), prompt, false);
    const int64_t n = 8;
    for (int64_t keep = 0; keep <= n; ++keep) {
      const std::string what = "prompt " + std::to_string(prompt) + " keep " + std::to_string(keep);
      V4State got = base;
      const V4StateMark mk = m.mark(got, 0, L, prompt, n);
      m.forward(got, all.data() + prompt, n, false);
      m.rewind(got, mk, prompt + n, prompt + keep, all.data() + prompt);
      V4State want = base;
      if (keep > 0) m.forward(want, all.data() + prompt, keep, false);
      expect_same_state(got, want, L, what);
      if (HasFailure()) return;
      // Both go on alike: the next step's logits agree.
      const auto a = m.forward(got, all.data() + prompt + keep, 3, true);
      const auto b = m.forward(want, all.data() + prompt + keep, 3, true);
      expect_close(a, b, what + " logits after");
    }
  }
}

// V4 only: V4.1's draft stages are not loaded.
class V4MtpRewindTest : public V4RewindTest {};

TEST_P(V4MtpRewindTest, TheMtpLayerForgetsAChainOfDrafts) {
  auto f = load(GetParam());
  const int64_t vocab = f->config.vocab_size;
  V4Model& m = *f->model;
  const int64_t L = f->config.num_hidden_layers, row = f->config.hc_mult * f->config.hidden_size;
  const auto all = tokens(40, 5, vocab);
  V4State st = m.new_state();
  std::vector<float> hidden;
  m.forward_keep({{&st, all.data(), 30}}, false, &hidden);
  ASSERT_EQ(static_cast<int64_t>(hidden.size()), 30 * row);
  // The MTP layer reads positions 0 .. 28 (the next token of each is known).
  std::vector<float> last;
  const auto first = m.draft({{&st, hidden.data(), all.data() + 1, 0, 29}}, &last);
  ASSERT_EQ(static_cast<int64_t>(first.size()), vocab);
  ASSERT_EQ(static_cast<int64_t>(last.size()), row);
  const V4State before = st;
  // A chain of 5 drafts at positions 29 .. 33, each from the last output.
  const V4StateMark mk = m.mark(st, L, L + 1, 29, 5);
  for (int64_t j = 0; j < 5; ++j) {
    const int32_t t = static_cast<int32_t>((j + 40) % vocab);
    const std::vector<float> h = last;
    m.draft({{&st, h.data(), &t, 29 + j, 1}}, &last);
  }
  // The chain overwrote slots of the MTP layer's window.
  EXPECT_NE(st.layers[static_cast<size_t>(L)].window, before.layers[static_cast<size_t>(L)].window);
  m.rewind(st, mk, 34, 29, nullptr);
  expect_same_state(st, before, L + 1, "after the chain");
}

TEST_P(V4RewindTest, ImpossibleRewindsAreRefused) {
  auto f = load(GetParam());
  const int64_t vocab = f->config.vocab_size;
  V4Model& m = *f->model;
  const int64_t L = f->config.num_hidden_layers, W = f->config.sliding_window;
  const auto all = tokens(20, 1, vocab);
  V4State st = m.new_state();
  m.forward(st, all.data(), 10, false);
  EXPECT_THROW(m.mark(st, 0, L, 10, W + 1), ds::Error);  // past the ring: its slots could not be put back
  EXPECT_THROW(m.mark(st, 0, L + 2, 10, 2), ds::Error);
  const V4StateMark mk = m.mark(st, 0, L, 10, 2);
  m.forward(st, all.data() + 10, 2, false);
  EXPECT_THROW(m.rewind(st, mk, 12, 9, all.data() + 10), ds::Error);   // before the step
  EXPECT_THROW(m.rewind(st, mk, 13, 11, all.data() + 10), ds::Error);  // past it
  m.rewind(st, mk, 12, 11, all.data() + 10);
  EXPECT_EQ(st.length, 11);
}

TEST(V4Rewind, LateIndexKeysAreRefused) {
  auto f = load(Case{"", "v41/models/v41_tiny", true, true});
  V4Model& m = *f->model;
  V4State st = m.new_state();
  const auto all = tokens(10, 1, f->config.vocab_size);
  m.forward(st, all.data(), 10, false);
  EXPECT_THROW(m.mark(st, 0, f->config.num_hidden_layers, 10, 2), ds::Error);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, V4RewindTest,
                         ::testing::Values(Case{"V4Codes", "v4/models/v4_tiny", true, false},
                                           Case{"V4Float32", "v4/models/v4_tiny", false, false},
                                           Case{"V41Codes", "v41/models/v41_tiny", true, false},
                                           Case{"V41Float32", "v41/models/v41_tiny", false, false}),
                         [](const auto& info) { return std::string(info.param.name); });
INSTANTIATE_TEST_SUITE_P(Fixtures, V4MtpRewindTest,
                         ::testing::Values(Case{"V4Codes", "v4/models/v4_tiny", true, false},
                                           Case{"V4Float32", "v4/models/v4_tiny", false, false}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace v4_rewind_test
}  // namespace
