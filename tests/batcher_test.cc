// Continuous batching: requests submitted together, more than there are
// slots, and prompts split over steps each make what generate() makes for
// their prompt alone (greedy and sampled, V3 and V4); EOS, length, cancel,
// a failing step and shutdown end a generation with the right reason;
// impossible requests are refused with one line; the choices of one
// request read its prompt once and each makes what its seed makes alone.
#include "infer/batcher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/parallel.h"
#include "forwarding_decoder.h"
#include "infer/v4_engine.h"
#include "model/v4_train.h"
#include "model_fixture.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace fs = std::filesystem;
using ds::infer::Batcher;
using ds::infer::BatcherOptions;
using ds::infer::BatchRequest;
using ds::infer::Finish;
using ds::infer::GenerateOptions;

namespace {
namespace batcher_test {

std::string temp_dir(const char* name) {
  std::string tmpl = std::string("/tmp/ds_") + name + "_XXXXXX";
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

// Every token of a generation, to its end.
std::vector<int32_t> drain(ds::infer::Generation& g) {
  std::vector<int32_t> out;
  int32_t t;
  while (g.next(&t)) out.push_back(t);
  return out;
}

// Requests of different lengths, budgets and samplers: more than `slots`.
std::vector<BatchRequest> mixed_requests() {
  std::vector<BatchRequest> rs;
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 2, 3, 4, 5, 6, 7}, {8}, {9, 10, 11}, {12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22}, {5, 5}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    BatchRequest r;
    r.prompt = prompts[i];
    r.max_new_tokens = 3 + static_cast<int64_t>(i) * 2;
    if (i % 2 == 1) r.sampler = {0.8f, 0, 0.95f, 100 + i};
    rs.push_back(r);
  }
  return rs;
}

// What generate() makes for a request's prompt alone.
std::vector<int32_t> alone(ds::infer::Decoder& d, const BatchRequest& r, int64_t eos = -1) {
  GenerateOptions opt;
  opt.max_new_tokens = r.max_new_tokens;
  opt.sampler = r.sampler;
  opt.eos_token_id = eos;
  return ds::infer::generate(d, {r.prompt}, opt)[0];
}

// Submits every request at once and checks each against generate() alone
// on the reference decoder.
void expect_each_as_alone(ds::infer::Decoder& served, ds::infer::Decoder& reference, BatcherOptions opt) {
  const auto rs = mixed_requests();
  std::vector<std::vector<int32_t>> want;
  for (const auto& r : rs) want.push_back(alone(reference, r));
  Batcher b(served, opt);
  std::vector<std::shared_ptr<ds::infer::Generation>> gens;
  for (const auto& r : rs) gens.push_back(b.submit(r));
  for (size_t i = 0; i < rs.size(); ++i) {
    EXPECT_EQ(drain(*gens[i]), want[i]) << "request " << i << ", " << opt.max_sequences << " slots, chunk "
                                        << opt.prefill_chunk;
    EXPECT_EQ(gens[i]->finish(), Finish::Length);
    EXPECT_EQ(gens[i]->prompt_tokens(), static_cast<int64_t>(rs[i].prompt.size()));
  }
}

// A request's choices submitted together: each makes what generate() makes
// alone with its seed (seed + k); returns the prompt tokens the batcher read.
uint64_t expect_choices_as_alone(ds::infer::Decoder& served, ds::infer::Decoder& reference, BatcherOptions opt,
                                 int64_t n) {
  BatchRequest r;
  r.prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  r.max_new_tokens = 5;
  r.sampler = {0.8f, 0, 0.95f, 40};
  r.logprobs = true;
  r.prompt_logprobs = true;
  Batcher b(served, opt);
  auto gens = b.submit_choices(r, n);
  EXPECT_EQ(gens.size(), static_cast<size_t>(n));
  std::vector<std::vector<int32_t>> got;
  for (auto& g : gens) got.push_back(drain(*g));
  for (int64_t k = 0; k < n; ++k) {
    BatchRequest rk = r;
    rk.sampler.seed = r.sampler.seed + static_cast<uint64_t>(k);
    EXPECT_EQ(got[static_cast<size_t>(k)], alone(reference, rk)) << "choice " << k << " of " << n;
    // Every choice has the prompt's log-probabilities, the same ones.
    const auto lps = gens[static_cast<size_t>(k)]->prompt_logprobs();
    const auto first = gens[0]->prompt_logprobs();
    EXPECT_EQ(lps.size(), r.prompt.size());
    // (Bit for bit when they share it; reading it in steps shared with other
    // sequences rounds differently.)
    for (size_t i = 1; i < lps.size() && i < first.size(); ++i) {
      if (n <= opt.max_sequences)
        EXPECT_EQ(lps[i].logprob, first[i].logprob);
      else
        EXPECT_NEAR(lps[i].logprob, first[i].logprob, 1e-5);
    }
  }
  return b.counters().prompt_tokens.load();
}

class BatcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_dir("batcher");
    ds::test::write_random_model(dir_, ds::test::tiny_v3_config(), 21);
    m_ = ds::infer::load_model(dir_);
    m_ref_ = ds::infer::load_model(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // The decoder the batcher runs, and one for generate() alone on a model of
  // its own: an engine serves one thread at a time, and the test thread
  // runs the reference while the batcher's thread runs its steps.
  std::unique_ptr<ds::infer::Decoder> decoder() {
    return ds::infer::kv_decoder(*m_->engine, ds::infer::CacheKind::Latent);
  }
  std::unique_ptr<ds::infer::Decoder> reference_decoder() {
    return ds::infer::kv_decoder(*m_ref_->engine, ds::infer::CacheKind::Latent);
  }
  std::string dir_;
  std::unique_ptr<ds::infer::LoadedModel> m_, m_ref_;
};

TEST_F(BatcherTest, EachRequestMakesWhatItsPromptMakesAlone) {
  auto served = decoder(), reference = reference_decoder();
  // Two slots for five requests (slots are freed and reused), one slot, and
  // prompts cut into chunks of 2 and 5 tokens shared among the sequences.
  for (const auto& [slots, chunk] :
       std::vector<std::pair<int64_t, int64_t>>{{2, 512}, {8, 512}, {1, 0}, {3, 2}, {4, 5}})
    expect_each_as_alone(*served, *reference, BatcherOptions{slots, 256, chunk});
}

TEST_F(BatcherTest, NaiveCacheToo) {
  auto served = ds::infer::kv_decoder(*m_->engine, ds::infer::CacheKind::Naive), reference = reference_decoder();
  expect_each_as_alone(*served, *reference, BatcherOptions{2, 256, 4});
}

TEST_F(BatcherTest, RequestsArrivingWhileOthersRun) {
  auto served = decoder(), reference = reference_decoder();
  const auto rs = mixed_requests();
  Batcher b(*served, BatcherOptions{3, 256, 4});
  // Each request is submitted after the previous one has made a token, so
  // new prompts join a batch that is decoding.
  std::vector<std::shared_ptr<ds::infer::Generation>> gens;
  std::vector<std::vector<int32_t>> got(rs.size());
  for (size_t i = 0; i < rs.size(); ++i) {
    gens.push_back(b.submit(rs[i]));
    int32_t t;
    ASSERT_TRUE(gens[i]->next(&t));
    got[i].push_back(t);
  }
  for (size_t i = 0; i < rs.size(); ++i) {
    for (int32_t t : drain(*gens[i])) got[i].push_back(t);
    EXPECT_EQ(got[i], alone(*reference, rs[i])) << "request " << i;
  }
}

TEST_F(BatcherTest, EosAndLengthEndAGeneration) {
  auto served = decoder(), reference = reference_decoder();
  BatchRequest r;
  r.prompt = {3, 1, 4, 1, 5};
  r.max_new_tokens = 6;
  const auto want = alone(*reference, r);
  ASSERT_EQ(want.size(), 6u);
  {
    // EOS: the model's third token.
    Batcher b(*served, BatcherOptions{2, 256, 512, want[2]});
    auto g = b.submit(r);
    const auto got = drain(*g);
    EXPECT_EQ(got, std::vector<int32_t>(
                       want.begin(), want.begin() + (std::find(want.begin(), want.end(), want[2]) - want.begin() + 1)));
    EXPECT_EQ(g->finish(), Finish::Eos);
    // ignore_eos: the same tokens as without an EOS id, to max_new_tokens.
    BatchRequest past = r;
    past.ignore_eos = true;
    auto all = b.submit(past);
    EXPECT_EQ(drain(*all), want);
    EXPECT_EQ(all->finish(), Finish::Length);
  }
  Batcher b(*served, BatcherOptions{2});
  auto none = b.submit({{1, 2}, 0, {}});
  EXPECT_TRUE(drain(*none).empty());
  EXPECT_EQ(none->finish(), Finish::Length);
  // The model's last position ends a generation as length would.
  const int64_t P = served->max_positions();
  BatchRequest edge;
  edge.prompt.assign(static_cast<size_t>(P - 2), 7);
  edge.max_new_tokens = 100;
  auto g = b.submit(edge);
  EXPECT_EQ(drain(*g).size(), 3u);  // positions P-2 and P-1 are fed: three tokens are made
  EXPECT_EQ(g->finish(), Finish::Length);
}

// A decoder whose steps after the first `free_steps` wait until open() is
// called: a test acts while a generation is certainly still running.
class GateDecoder : public ds::test::ForwardingDecoder {
 public:
  explicit GateDecoder(ds::infer::Decoder& d, int free_steps = 0) : ForwardingDecoder(d), free_(free_steps) {}
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override {
    {
      std::unique_lock lk(mu_);
      entered_ = true;
      cv_.notify_all();
      if (free_ > 0)
        --free_;
      else
        cv_.wait(lk, [&] { return open_; });
    }
    return ForwardingDecoder::step(tokens);
  }
  // Waits until a step has begun.
  void wait_entered() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return entered_; });
  }
  void open() {
    {
      std::lock_guard lk(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int free_;
  bool open_ = false, entered_ = false;
};

TEST_F(BatcherTest, CancelEndsOneGenerationAndFreesItsSlot) {
  auto inner = decoder(), reference = reference_decoder();
  GateDecoder served(*inner, 1);  // the prefill runs; the next step waits
  Batcher b(served, BatcherOptions{1});
  BatchRequest longer{{1, 2, 3}, 100, {}};
  auto g = b.submit(longer);
  // Waits behind the one slot.
  BatchRequest next{{4, 5}, 4, {}};
  auto queued = b.submit(next);
  auto never = b.submit(next);
  never->cancel();
  int32_t t;
  ASSERT_TRUE(g->next(&t));
  g->cancel();
  served.open();
  // The step under way when cancel() came still hands out its token.
  const auto rest = drain(*g);
  EXPECT_LE(rest.size(), 1u);
  EXPECT_EQ(g->finish(), Finish::Cancelled);
  EXPECT_EQ(drain(*queued), alone(*reference, next));
  EXPECT_TRUE(drain(*never).empty());
  EXPECT_EQ(never->finish(), Finish::Cancelled);
}

TEST_F(BatcherTest, ChoicesReadThePromptOnce) {
  auto served = decoder(), reference = reference_decoder();
  // A prefill chunk of 4: the 11-token prompt takes three steps.
  EXPECT_EQ(expect_choices_as_alone(*served, *reference, BatcherOptions{4, 256, 4}, 3), 11u);
  // More choices than slots: each reads the prompt itself.
  auto served2 = decoder();
  EXPECT_EQ(expect_choices_as_alone(*served2, *reference, BatcherOptions{2, 256, 4}, 3), 33u);
}

TEST_F(BatcherTest, AChoiceLeftWithoutItsReaderReadsThePromptItself) {
  auto inner = decoder(), reference = reference_decoder();
  GateDecoder served(*inner);  // the first step waits
  Batcher b(served, BatcherOptions{4, 256, 4});
  BatchRequest r;
  r.prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  r.max_new_tokens = 4;
  r.sampler = {0.8f, 0, 0.95f, 7};
  auto gens = b.submit_choices(r, 3);
  // The reader of the prompt is cancelled while its first chunk runs; the
  // next choice reads the prompt, the last follows it.
  served.wait_entered();
  gens[0]->cancel();
  served.open();
  EXPECT_TRUE(drain(*gens[0]).empty());
  EXPECT_EQ(gens[0]->finish(), Finish::Cancelled);
  for (int k = 1; k < 3; ++k) {
    BatchRequest rk = r;
    rk.sampler.seed = 7 + static_cast<uint64_t>(k);
    EXPECT_EQ(drain(*gens[static_cast<size_t>(k)]), alone(*reference, rk)) << "choice " << k;
    EXPECT_EQ(gens[static_cast<size_t>(k)]->finish(), Finish::Length);
  }
  EXPECT_EQ(b.counters().prompt_tokens.load(), 4u + 11u);  // the cancelled chunk, then the prompt once
}

// Records the OpenMP thread count each step runs with.
class ThreadCountDecoder : public ds::test::ForwardingDecoder {
 public:
  using ForwardingDecoder::ForwardingDecoder;
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override {
    seen = ds::num_threads();
    return ForwardingDecoder::step(tokens);
  }
  std::atomic<int> seen{0};
};

TEST_F(BatcherTest, StepsRunWithTheCreatingThreadsThreadCount) {
  // `deepseek --threads N serve` sets N on the main thread; the batcher's
  // own thread would otherwise run with OpenMP's default.
  ds::test::ThreadCountGuard guard;
  for (int n : {1, 2}) {
    ds::set_num_threads(n);
    auto inner = decoder();
    ThreadCountDecoder served(*inner);
    {
      Batcher b(served, BatcherOptions{2});
      drain(*b.submit(BatchRequest{{1, 2, 3}, 3, {}}));
    }
    EXPECT_EQ(served.seen.load(), n);
  }
}

TEST_F(BatcherTest, ShutdownCancelsWhatIsLeft) {
  auto inner = decoder();
  GateDecoder served(*inner, 1);
  std::shared_ptr<ds::infer::Generation> running, queued;
  {
    Batcher b(served, BatcherOptions{1});
    running = b.submit({{1, 2, 3}, 100, {}});
    queued = b.submit({{1, 2, 3}, 100, {}});
    int32_t t;
    ASSERT_TRUE(running->next(&t));
    // The second step waits at the gate until the batcher is closing.
    std::thread opener([&] {
      while (!b.closed()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      served.open();
    });
    b.close();
    opener.join();
  }
  drain(*running);
  EXPECT_EQ(running->finish(), Finish::Cancelled);
  EXPECT_TRUE(drain(*queued).empty());
  EXPECT_EQ(queued->finish(), Finish::Cancelled);
}

// A decoder whose step fails once, on the n-th call.
class FailingDecoder : public ds::test::ForwardingDecoder {
 public:
  FailingDecoder(ds::infer::Decoder& d, int fail_at) : ForwardingDecoder(d), fail_at_(fail_at) {}
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override {
    if (++calls_ == fail_at_) throw ds::Error("out of memory for the cache");
    return ForwardingDecoder::step(tokens);
  }

 private:
  int fail_at_, calls_ = 0;
};

TEST_F(BatcherTest, AFailedStepEndsItsSequencesAndServingGoesOn) {
  auto inner = decoder(), reference = reference_decoder();
  FailingDecoder served(*inner, 3);
  Batcher b(served, BatcherOptions{2});
  auto g = b.submit({{1, 2, 3}, 10, {}});
  drain(*g);
  EXPECT_EQ(g->finish(), Finish::Failed);
  EXPECT_EQ(g->error(), "out of memory for the cache");
  BatchRequest r{{6, 7}, 5, {}};
  auto after = b.submit(r);
  EXPECT_EQ(drain(*after), alone(*reference, r));
  EXPECT_EQ(after->finish(), Finish::Length);
}

TEST_F(BatcherTest, ImpossibleRequestsAreRefused) {
  auto inner = decoder();
  GateDecoder served(*inner);
  Batcher b(served, BatcherOptions{1, 0});
  const int64_t V = served.vocab_size(), P = served.max_positions();
  auto refused = [&](BatchRequest r, const std::string& says) {
    try {
      b.submit(std::move(r));
      ADD_FAILURE() << "accepted; expected: " << says;
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{}, 4, {}}, "the prompt is empty");
  refused({std::vector<int32_t>(static_cast<size_t>(P + 1), 1), 4, {}}, "beyond the model's");
  refused({{1, static_cast<int32_t>(V)}, 4, {}}, "prompt token 1 is");
  refused({{1, -3}, 4, {}}, "outside the vocabulary");
  refused({{1}, -1, {}}, "max_new_tokens must be >= 0");
  refused({{1}, 4, {-1.0f, 0, 1.0f, 0}}, "temperature");
  refused({{1}, 4, {1.0f, 0, 0.0f, 0}}, "top-p");
  // One slot and max_waiting 0: the first request takes the slot (its
  // steps wait at the gate), the second finds it busy.
  auto first = b.submit({{1}, 4, {}});
  EXPECT_THROW(b.submit({{1}, 4, {}}), ds::infer::Unavailable);
  served.open();
  EXPECT_EQ(drain(*first).size(), 4u);
  b.close();
  EXPECT_THROW(b.submit({{1}, 4, {}}), ds::infer::Unavailable);
  EXPECT_THROW(Batcher(*inner, BatcherOptions{0}), ds::Error);
  EXPECT_THROW(Batcher(*inner, BatcherOptions{2, 1, -1}), ds::Error);
}

TEST(BatcherV4, EachRequestMakesWhatItsPromptMakesAlone) {
  const std::string dir = temp_dir("batcher_v4");
  auto cfg = ds::model::v4_preset(std::string(DEEPSEEK_SOURCE_DIR) + "/configs/v4-tiny.yml", {});
  ASSERT_TRUE(cfg.has_value());
  auto params = ds::model::V4FlatParams::zeros(*cfg);
  ds::model::init_v4_params(*cfg, params, 5, 0.05f);
  params.sync_tables(*cfg);
  ds::model::export_v4_hf(dir, *cfg, params.data.data(), ds::DType::F32, "test");
  auto m = ds::infer::load_v4_model(dir);
  ds::infer::V4Decoder served(*m->model), reference(*m->model);
  // Chunks of 5 cut prompts across steps; two slots are reused.
  expect_each_as_alone(served, reference, BatcherOptions{2, 256, 5});
  // Choices share the prompt's state (V4Decoder::copy).
  ds::infer::V4Decoder served2(*m->model);
  EXPECT_EQ(expect_choices_as_alone(served2, reference, BatcherOptions{3, 256, 5}, 3), 11u);
  fs::remove_all(dir);
}

}  // namespace batcher_test
}  // namespace
