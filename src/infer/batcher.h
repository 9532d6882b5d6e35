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
#pragma once

#include <atomic>
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
#include "infer/sampler.h"

namespace ds::infer {

struct BatcherOptions {
  int64_t max_sequences = 8;    // slots: sequences in one step at most
  int64_t max_waiting = 256;    // requests waiting for a busy slot at most
  int64_t prefill_chunk = 512;  // prompt tokens per step over all sequences (0: no limit)
  int64_t eos_token_id = -1;    // < 0: none
  int64_t sample_vocab = 0;     // sample only ids below this (0: every id)
};

struct BatchRequest {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 16;
  SamplerConfig sampler;
  bool ignore_eos = false;  // run to max_new_tokens even past EOS (benchmarks)
};

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
  // Waits for the next token: true with *token set, false once the
  // generation has ended and every token was read (finish() says why).
  bool next(int32_t* token);
  // Asks the batcher to stop this generation; it ends as Cancelled at the
  // next step (tokens already made can still be read).
  void cancel() { cancelled_ = true; }
  Finish finish() const;
  std::string error() const;
  int64_t prompt_tokens() const { return prompt_tokens_; }

 private:
  friend class Batcher;
  void push(int32_t token);
  void end(Finish f, std::string error = {});
  bool take(int32_t* token);  // under mu_

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int32_t> tokens_;
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
  std::shared_ptr<Generation> submit(BatchRequest r);

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

 private:
  struct Slot {
    std::shared_ptr<Generation> gen;
    BatchRequest req;
    uint64_t order = 0;  // admission order: older prompts are read first
    size_t fed = 0;      // prompt tokens the decoder has
    int64_t made = 0;    // new tokens
    int32_t last = 0;    // the newest token, fed at the next step
    bool live = false;
  };
  struct Waiting {
    std::shared_ptr<Generation> gen;
    BatchRequest req;
  };
  void loop();
  void run_step();
  void free_slot(size_t i, Finish f, const std::string& error = {});

  Decoder& decoder_;
  const BatcherOptions opt_;
  const int64_t vocab_, max_positions_;
  std::vector<Slot> slots_;  // touched by the loop thread only
  uint64_t admitted_ = 0;
  std::atomic<int64_t> running_{0};

  mutable std::mutex mu_;  // guards waiting_ and stop_
  std::condition_variable cv_;
  std::deque<Waiting> waiting_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ds::infer
