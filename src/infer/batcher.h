// Continuous batching: requests arrive at any time and join the running batch
// at the next step. One thread owns the Decoder and runs steps over every
// live sequence: a sequence still reading its prompt takes its next chunk of
// it (all prompts together at most prefill_chunk tokens a step, the oldest
// request first), the others one token each. A finished sequence frees its
// slot for the next request in line.
//
// A request's tokens are what generate() makes for its prompt alone with
// the same options (sampling draws are keyed by the request's seed and its
// own step, never by its slot), up to the rounding of rows that shared a
// step with other sequences (tests/batcher_test.cc checks the greedy tokens).
//
// The n choices of one request (submit_choices) read its prompt once: the
// first reads it, the others wait in their slots and copy its cache when it
// is read (Decoder::copy), each then drawing its own tokens.
//
// A request can also ask for log-probabilities (each new token's, and its
// prompt's), penalties and biases (infer/sampler.h); the batcher counts
// tokens and latencies for the server's /metrics.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "infer/generate.h"
#include "infer/metrics.h"
#include "infer/prefix_cache.h"
#include "infer/sampler.h"

namespace ds::infer {

struct BatcherOptions {
  int64_t max_sequences = 8;    // slots: sequences in one step at most
  int64_t max_waiting = 256;    // requests waiting for a busy slot at most
  int64_t prefill_chunk = 512;  // prompt tokens per step over all sequences (0: no limit)
  int64_t eos_token_id = -1;    // < 0: none
  int64_t sample_vocab = 0;     // sample only ids below this (0: every id)
  // Speculative decoding with the decoder's MTP layer (infer/speculative.h):
  // draft tokens a step (0: off; at most kMaxDraftTokens, the MTP layer
  // chained past the first).
  int64_t draft_tokens = 0;
  // Drafting only while at most this many sequences decode (0: always): a
  // step that checks drafts for many sequences reads most experts anyway,
  // so above some batch it costs more than it saves (docs/performance.md).
  // Steps above it check nothing; the MTP layer reads their positions once
  // drafting resumes.
  int64_t draft_max_sequences = 0;
  // The cache pool: the bytes every sequence's cache and the prefix cache
  // hold together at most (0: no bound). Sequences grow on demand; a step
  // that would pass the bound first evicts kept prefixes (least recently
  // used), then stops the youngest sequences, whose caches go (each reads
  // its tokens again once there is room, as vLLM's recompute preemption
  // does). The longest sequence the pool holds bounds max_positions().
  size_t cache_memory = 0;
  // Automatic prefix caching (infer/prefix_cache.h) in that pool; needs a
  // cache_memory bound. With speculative decoding a kept prefix is reused
  // past the positions its MTP layer had read (prompts that extend a
  // finished request's tokens).
  bool prefix_cache = false;
};

struct BatchRequest {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 16;
  SamplerConfig sampler;
  bool ignore_eos = false;  // run to max_new_tokens even past EOS (benchmarks)
  LogitAdjust adjust{};     // penalties and biases before sampling (none by default)
  // Log-probabilities (token_logprob: the model's log-softmax, before any
  // adjustment or temperature): of each new token with its top_logprobs
  // most likely ids, and of each prompt token after the first. Prompt ones
  // are read even with max_new_tokens 0.
  bool logprobs = false;
  int64_t top_logprobs = 0;  // <= kMaxTopLogprobs
  bool prompt_logprobs = false;
};

// Wakes one reader of many generations (the choices of one request) when
// any of them has a token or ends.
class Signal {
 public:
  void notify();
  // Events so far; wait() returns once there are more than `seen`.
  uint64_t events() const;
  void wait(uint64_t seen);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t events_ = 0;
};

// What the batcher has done, for /metrics.
struct BatcherCounters {
  std::atomic<uint64_t> prompt_tokens{0};     // read into the caches
  std::atomic<uint64_t> generated_tokens{0};  // handed out
  std::atomic<uint64_t> cache_bytes{0};       // the decoder's caches after the last step
  // From submit() to the first new token; between one new token and the next.
  metrics::Histogram time_to_first_token{metrics::latency_bounds()};
  metrics::Histogram time_per_output_token{metrics::latency_bounds()};
  // Speculative decoding: drafts checked, and kept; by position in a step's
  // chain (0: the first draft).
  std::atomic<uint64_t> drafted{0}, accepted{0};
  std::array<std::atomic<uint64_t>, kMaxDraftTokens> drafted_at{}, accepted_at{};
  // The cache pool: its bound, what it holds after the last step (sequences
  // and kept prefixes) and the most it has held; sequences stopped for room.
  std::atomic<uint64_t> pool_limit{0}, pool_bytes{0}, pool_peak{0}, preemptions{0};
  // Prefix caching: requests that looked for a prefix and their prompt
  // tokens; those that found one and the tokens they did not read;
  // prefixes kept, their bytes, and those evicted.
  std::atomic<uint64_t> prefix_queries{0}, prefix_query_tokens{0}, prefix_hits{0}, prefix_hit_tokens{0};
  std::atomic<uint64_t> prefix_entries{0}, prefix_bytes{0}, prefix_evictions{0};
};

// The cache pool's and the prefix cache's counters in Prometheus' text
// format (the server's /metrics).
void render_pool_metrics(std::string& out, const BatcherCounters& k);

// What submit() throws when it cannot take a request now: max_waiting
// requests already wait for a slot, or the batcher is closed.
class Unavailable : public Error {
 public:
  using Error::Error;
};

// Why a generation ended.
enum class Finish {
  Running,    // not yet
  Length,     // max_new_tokens made, or the model's last position reached
  Eos,        // the model made its EOS token (the last token handed out)
  Cancelled,  // cancel(), or the batcher shut down
  Failed,     // a step threw; error() says what
};

// One request's new tokens, handed from the batcher's thread to a reader.
class Generation {
 public:
  // Waits for the next token: true with *token set (and *lp, when given
  // and the request asked for logprobs), false once the generation has
  // ended and every token was read (finish() says why).
  bool next(int32_t* token, TokenLogprob* lp = nullptr);
  // The same without waiting: false when no token is ready now.
  bool try_next(int32_t* token, TokenLogprob* lp = nullptr);
  // Ended, and every token read.
  bool drained() const;
  // With prompt_logprobs, once the first next() returned: one entry per
  // prompt token (the first, which nothing predicts, holds nothing). Empty
  // when the generation failed before its prompt was read.
  std::vector<TokenLogprob> prompt_logprobs() const;
  // Asks the batcher to stop this generation; it ends as Cancelled at the
  // next step (tokens already made can still be read).
  void cancel() { cancelled_ = true; }
  Finish finish() const;
  std::string error() const;
  int64_t prompt_tokens() const { return prompt_tokens_; }

 private:
  friend class Batcher;
  void push(int32_t token, TokenLogprob* lp);
  void set_prompt_logprobs(std::vector<TokenLogprob> lps);
  void end(Finish f, std::string error = {});
  bool take(int32_t* token, TokenLogprob* lp);  // under mu_

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int32_t> tokens_;
  std::deque<TokenLogprob> logprobs_;  // one per token when the request asked
  std::vector<TokenLogprob> prompt_logprobs_;
  std::shared_ptr<Signal> signal_;
  std::chrono::steady_clock::time_point submitted_;
  Finish finish_ = Finish::Running;
  std::string error_;
  std::atomic<bool> cancelled_{false};
  int64_t prompt_tokens_ = 0;
};

class Batcher {
 public:
  // Starts the thread that runs `decoder` (which it owns from now on:
  // nothing else may call it until the batcher is destroyed).
  Batcher(Decoder& decoder, BatcherOptions opt);
  // close().
  ~Batcher();
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues a request. Checks it first (ds::Error with one line for an empty
  // or too long prompt, an id outside the vocabulary, impossible sampler
  // settings or a negative max_new_tokens; Unavailable when max_waiting
  // requests already wait, or after close()).
  // `signal` (optional) is notified at each token and at the end.
  std::shared_ptr<Generation> submit(BatchRequest r, std::shared_ptr<Signal> signal = {});
  // n choices of one request (checked as submit() checks it), choice i
  // drawing with seed + i, as n requests of their own would. When the n
  // fit in the slots they are admitted together and the prompt is read
  // once; beyond max_sequences each choice reads it.
  std::vector<std::shared_ptr<Generation>> submit_choices(BatchRequest r, int64_t n,
                                                          std::shared_ptr<Signal> signal = {});

  // Stops the steps and ends every generation still running or waiting as
  // Cancelled; later submits are refused. Idempotent.
  void close();
  // Whether close() has begun.
  bool closed() const;

  const BatcherOptions& options() const { return opt_; }
  int64_t vocab_size() const { return vocab_; }
  int64_t max_positions() const { return max_positions_; }
  // Sequences in slots and requests waiting for one, now.
  int64_t running() const;
  int64_t waiting() const;
  const BatcherCounters& counters() const { return counters_; }

 private:
  struct Slot {
    std::shared_ptr<Generation> gen;
    BatchRequest req;
    uint64_t order = 0;  // admission order: older prompts are read first
    size_t fed = 0;      // prompt tokens the decoder has
    int64_t made = 0;    // new tokens
    int32_t last = 0;    // the newest token, fed at the next step
    bool live = false;
    TokenHistory seen;                              // with penalties only
    std::vector<TokenLogprob> prompt_lps;           // with prompt_logprobs only
    std::vector<float> unadjusted;                  // the row before adjust, with logprobs and adjust only
    std::chrono::steady_clock::time_point last_at;  // the newest token's step
    // A choice waiting for another's prompt (its leader) reads nothing;
    // a leader lists the slots that wait for it.
    bool following = false;
    size_t leader = 0;
    std::vector<size_t> followers;
    // Speculative decoding: the tokens that follow the positions the MTP
    // layer has not read yet (it reads them at the next step).
    std::vector<int32_t> pending;
    // The tokens handed out; the request's own prompt length (req.prompt
    // also holds handed-out tokens while a stopped sequence reads them
    // again: `replaying`, whose end samples nothing).
    std::vector<int32_t> out;
    size_t prompt0 = 0;
    bool replaying = false;
    bool held = false;       // left out of this step for room in the pool
    bool looked_up = false;  // the prefix cache was asked
  };
  // A request's choices (one, or n that share the prompt), choice k drawing
  // with seed + k.
  struct Waiting {
    std::vector<std::shared_ptr<Generation>> gens;
    BatchRequest req;
  };
  void loop();
  void run_step();
  std::vector<std::vector<int32_t>> plan_step(bool* all_rows);
  void take_rows(size_t i, float* lg, int64_t rows, size_t fed, std::chrono::steady_clock::time_point now);
  void sample_next(size_t i, float* row, std::chrono::steady_clock::time_point now);
  // The row as the request samples from it (penalties and biases applied in
  // place); returns the model's own row, for logprobs.
  const float* adjust_row(Slot& s, float* row);
  // Hands token tok on (its logprob from `before`), counts it and ends the
  // slot at EOS or its length; false when the slot ended.
  bool emit(size_t i, int32_t tok, const float* before, std::chrono::steady_clock::time_point now);
  // A step with speculative decoding (infer/batcher_speculative.cc).
  void run_speculative_step();
  void fail_slots(const std::vector<std::vector<int32_t>>& tokens, const std::exception& e);
  void decide_drafts(size_t i, float* rows, const std::vector<int32_t>& drafts,
                     const std::vector<std::vector<double>>& q, std::chrono::steady_clock::time_point now);
  void share_prompt(size_t i, const float* row, std::chrono::steady_clock::time_point now);
  void admit_waiting();
  void admit(Slot& s);
  void free_slot(size_t i, Finish f, const std::string& error = {});
  // The cache pool (batcher_pool.cc): the longest sequence it holds; the
  // prefix lookups of slots that start reading; the slots left out of the
  // next step for room (false: nothing can run); a finished slot's cache
  // kept as a prefix; the pool's bytes now.
  int64_t pool_positions() const;
  void restore_prefixes();
  bool fit_pool();
  void keep_prefix(size_t i, Finish f);
  size_t pool_bytes() const;
  void stop_for_room(size_t i);
  void count_pool();

  Decoder& decoder_;
  const BatcherOptions opt_;
  const int64_t vocab_;
  int64_t max_positions_;
  std::unique_ptr<PrefixCache> prefixes_;
  std::vector<Slot> slots_;  // touched by the loop thread only
  uint64_t admitted_ = 0;
  std::atomic<int64_t> running_{0};
  BatcherCounters counters_;

  mutable std::mutex mu_;  // guards waiting_ and stop_
  std::condition_variable cv_;
  std::deque<Waiting> waiting_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ds::infer
