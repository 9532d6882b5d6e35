#include "infer/batcher.h"

#include <algorithm>
#include <exception>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "infer/speculative.h"

namespace ds::infer {

void Signal::notify() {
  {
    std::lock_guard lk(mu_);
    ++events_;
  }
  cv_.notify_all();
}

uint64_t Signal::events() const {
  std::lock_guard lk(mu_);
  return events_;
}

void Signal::wait(uint64_t seen) {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return events_ > seen; });
}

bool Generation::take(int32_t* token, TokenLogprob* lp) {
  if (tokens_.empty()) return false;
  *token = tokens_.front();
  tokens_.pop_front();
  if (!logprobs_.empty()) {
    if (lp) *lp = std::move(logprobs_.front());
    logprobs_.pop_front();
  }
  return true;
}

bool Generation::next(int32_t* token, TokenLogprob* lp) {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return !tokens_.empty() || finish_ != Finish::Running; });
  return take(token, lp);
}

bool Generation::try_next(int32_t* token, TokenLogprob* lp) {
  std::lock_guard lk(mu_);
  return take(token, lp);
}

bool Generation::drained() const {
  std::lock_guard lk(mu_);
  return tokens_.empty() && finish_ != Finish::Running;
}

std::vector<TokenLogprob> Generation::prompt_logprobs() const {
  std::lock_guard lk(mu_);
  return prompt_logprobs_;
}

void Generation::set_prompt_logprobs(std::vector<TokenLogprob> lps) {
  std::lock_guard lk(mu_);
  prompt_logprobs_ = std::move(lps);
}

Finish Generation::finish() const {
  std::lock_guard lk(mu_);
  return finish_;
}

std::string Generation::error() const {
  std::lock_guard lk(mu_);
  return error_;
}

void Generation::push(int32_t token, TokenLogprob* lp) {
  {
    std::lock_guard lk(mu_);
    tokens_.push_back(token);
    if (lp) logprobs_.push_back(std::move(*lp));
  }
  cv_.notify_all();
  if (signal_) signal_->notify();
}

void Generation::end(Finish f, std::string error) {
  {
    std::lock_guard lk(mu_);
    if (finish_ != Finish::Running) return;
    finish_ = f;
    error_ = std::move(error);
  }
  cv_.notify_all();
  if (signal_) signal_->notify();
}

Batcher::Batcher(Decoder& decoder, BatcherOptions opt)
    : decoder_(decoder), opt_(opt), vocab_(decoder.vocab_size()), max_positions_(decoder.max_positions()) {
  DS_CHECK(opt_.max_sequences >= 1 && opt_.max_sequences <= kMaxSequences, "batcher: max_sequences {} outside [1, {}]",
           opt_.max_sequences, kMaxSequences);
  DS_CHECK(opt_.max_waiting >= 0, "batcher: max_waiting must be >= 0, got {}", opt_.max_waiting);
  DS_CHECK(opt_.prefill_chunk >= 0, "batcher: prefill_chunk must be >= 0, got {}", opt_.prefill_chunk);
  DS_CHECK(opt_.sample_vocab >= 0 && opt_.sample_vocab <= vocab_, "batcher: sample_vocab {} outside [0, {}]",
           opt_.sample_vocab, vocab_);
  DS_CHECK(opt_.draft_tokens >= 0 && opt_.draft_tokens <= kMaxDraftTokens,
           "batcher: {} draft tokens; speculative decoding drafts 1 to {} a step", opt_.draft_tokens, kMaxDraftTokens);
  DS_CHECK(opt_.draft_max_sequences >= 0, "batcher: draft_max_sequences must be >= 0, got {}",
           opt_.draft_max_sequences);
  DS_CHECK(opt_.draft_tokens == 0 || decoder.can_draft(),
           "batcher: speculative decoding needs the model's MTP layer, which is not loaded");
  DS_CHECK(!opt_.prefix_cache || opt_.cache_memory > 0, "batcher: prefix caching needs a cache_memory bound");
  decoder_.start(opt_.max_sequences);
  max_positions_ = pool_positions();
  decoder_.limit_length(max_positions_);
  counters_.pool_limit.store(opt_.cache_memory, std::memory_order_relaxed);
  if (opt_.prefix_cache) prefixes_ = std::make_unique<PrefixCache>();
  slots_.resize(static_cast<size_t>(opt_.max_sequences));
  // OpenMP's thread count belongs to each thread: the steps run with the
  // creating thread's (`deepseek --threads N serve`), not the default.
  const int threads = num_threads();
  thread_ = std::thread([this, threads] {
    set_num_threads(threads);
    loop();
  });
}

Batcher::~Batcher() { close(); }

void Batcher::close() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard lk(mu_);
  for (auto& w : waiting_)
    for (auto& g : w.gens) g->end(Finish::Cancelled);
  waiting_.clear();
  for (auto& s : slots_)
    if (s.live) s.gen->end(Finish::Cancelled);
}

std::shared_ptr<Generation> Batcher::submit(BatchRequest r, std::shared_ptr<Signal> signal) {
  return submit_choices(std::move(r), 1, std::move(signal))[0];
}

std::vector<std::shared_ptr<Generation>> Batcher::submit_choices(BatchRequest r, int64_t choices,
                                                                 std::shared_ptr<Signal> signal) {
  DS_CHECK(choices >= 1 && choices <= kMaxSequences, "choices must be in [1, {}], got {}", kMaxSequences, choices);
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  DS_CHECK(n > 0, "the prompt is empty");
  DS_CHECK(n <= max_positions_, "the prompt has {} tokens, beyond the model's {} positions", n, max_positions_);
  for (size_t i = 0; i < r.prompt.size(); ++i)
    DS_CHECK(r.prompt[i] >= 0 && r.prompt[i] < vocab_, "prompt token {} is {}, outside the vocabulary [0, {})", i,
             r.prompt[i], vocab_);
  DS_CHECK(r.max_new_tokens >= 0, "max_new_tokens must be >= 0, got {}", r.max_new_tokens);
  check_sampler(r.sampler);
  check_adjust(r.adjust, vocab_);
  DS_CHECK(r.top_logprobs >= 0 && r.top_logprobs <= kMaxTopLogprobs, "top_logprobs must be in [0, {}], got {}",
           kMaxTopLogprobs, r.top_logprobs);
  std::vector<std::shared_ptr<Generation>> gens;
  for (int64_t k = 0; k < choices; ++k) {
    auto gen = std::make_shared<Generation>();
    gen->prompt_tokens_ = n;
    gen->signal_ = signal;
    gen->submitted_ = std::chrono::steady_clock::now();
    if (r.max_new_tokens == 0 && !r.prompt_logprobs) gen->end(Finish::Length);
    gens.push_back(std::move(gen));
  }
  if (r.max_new_tokens == 0 && !r.prompt_logprobs) return gens;
  {
    std::lock_guard lk(mu_);
    if (stop_) throw Unavailable("the server is shutting down");
    // Free slots take requests beyond max_waiting: they wait only until the
    // next step.
    const int64_t free_slots = std::max<int64_t>(0, opt_.max_sequences - running_.load());
    if (static_cast<int64_t>(waiting_.size()) >= opt_.max_waiting + free_slots)
      throw Unavailable(
          fmt::format("every slot is busy and {} requests are waiting; try again later", waiting_.size()));
    if (choices <= opt_.max_sequences) {
      waiting_.push_back({gens, std::move(r)});
    } else {  // more choices than slots: each its own request
      for (int64_t k = 0; k < choices; ++k) {
        BatchRequest rk = r;
        rk.sampler.seed = r.sampler.seed + static_cast<uint64_t>(k);
        waiting_.push_back({{gens[static_cast<size_t>(k)]}, std::move(rk)});
      }
    }
  }
  cv_.notify_all();
  return gens;
}

bool Batcher::closed() const {
  std::lock_guard lk(mu_);
  return stop_;
}

int64_t Batcher::running() const { return running_.load(); }

int64_t Batcher::waiting() const {
  std::lock_guard lk(mu_);
  return static_cast<int64_t>(waiting_.size());
}

void Batcher::free_slot(size_t i, Finish f, const std::string& error) {
  keep_prefix(i, f);
  Slot& s = slots_[i];
  // The generation ends last, once the slot is free and counted so: a
  // reader who sees the end sees the running count without it.
  const std::shared_ptr<Generation> gen = std::move(s.gen);
  // A choice that waited for a prompt leaves its leader's list; a leader
  // that ends before its prompt is read hands the reading to its first
  // follower, whom the rest then follow.
  if (s.following) {
    auto& fs = slots_[s.leader].followers;
    fs.erase(std::remove(fs.begin(), fs.end(), i), fs.end());
  }
  if (!s.followers.empty()) {
    Slot& next = slots_[s.followers[0]];
    next.following = false;
    next.followers.assign(s.followers.begin() + 1, s.followers.end());
    for (const size_t f : next.followers) slots_[f].leader = s.followers[0];
  }
  s = Slot{};
  --running_;
  // Frees the sequence's cache now rather than at the slot's next use.
  decoder_.reset(static_cast<int64_t>(i));
  counters_.cache_bytes.store(decoder_.cache_bytes(), std::memory_order_relaxed);
  count_pool();
  gen->end(f, error);
}

void Batcher::loop() {
  for (;;) {
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !waiting_.empty() || running_.load() > 0; });
      if (stop_) return;
      admit_waiting();
    }
    if (running_.load() > 0) run_step();
  }
}

// Requests in line take free slots, a request's choices all at once (the
// first reads the prompt, the others follow it).
void Batcher::admit_waiting() {
  while (!waiting_.empty()) {
    Waiting& w = waiting_.front();
    if (std::all_of(w.gens.begin(), w.gens.end(), [](const auto& g) { return g->cancelled_.load(); })) {
      for (auto& g : w.gens) g->end(Finish::Cancelled);
      waiting_.pop_front();
      continue;
    }
    std::vector<size_t> free;
    for (size_t i = 0; i < slots_.size() && free.size() < w.gens.size(); ++i)
      if (!slots_[i].live) free.push_back(i);
    if (free.size() < w.gens.size()) return;
    for (size_t k = 0; k < free.size(); ++k) {
      Slot& s = slots_[free[k]];
      s.gen = std::move(w.gens[k]);
      s.req = w.req;
      s.req.sampler.seed = w.req.sampler.seed + static_cast<uint64_t>(k);
      admit(s);
      if (k == 0) continue;
      s.following = true;
      s.leader = free[0];
      slots_[free[0]].followers.push_back(free[k]);
    }
    waiting_.pop_front();
  }
}

void Batcher::admit(Slot& s) {
  s.order = admitted_++;
  s.live = true;
  s.prompt0 = s.req.prompt.size();
  ++running_;
  if (s.req.adjust.repetition != 1.0f)
    for (const int32_t t : s.req.prompt) s.seen[t].in_prompt = true;
  if (s.req.prompt_logprobs) {
    s.prompt_lps.reserve(s.req.prompt.size());
    s.prompt_lps.emplace_back();  // the first token: nothing predicts it
  }
}

// Each live sequence's tokens for the next step: its newest token, or the
// next chunk of its prompt (the prompts share the chunk budget, the oldest
// request first). *all_rows: some prompt chunk wants a row per token.
std::vector<std::vector<int32_t>> Batcher::plan_step(bool* all_rows) {
  const size_t S = slots_.size();
  std::vector<std::vector<int32_t>> tokens(S);
  std::vector<size_t> reading;
  for (size_t i = 0; i < S; ++i) {
    const Slot& s = slots_[i];
    if (!s.live || s.following || s.held) continue;
    if (s.fed == s.req.prompt.size())
      tokens[i] = {s.last};
    else
      reading.push_back(i);
  }
  std::sort(reading.begin(), reading.end(), [&](size_t a, size_t b) { return slots_[a].order < slots_[b].order; });
  int64_t budget = opt_.prefill_chunk > 0 ? opt_.prefill_chunk : std::numeric_limits<int64_t>::max();
  *all_rows = false;
  for (const size_t i : reading) {
    if (budget <= 0) break;
    Slot& s = slots_[i];
    const size_t n = std::min<size_t>(s.req.prompt.size() - s.fed, static_cast<size_t>(budget));
    tokens[i].assign(s.req.prompt.begin() + static_cast<std::ptrdiff_t>(s.fed),
                     s.req.prompt.begin() + static_cast<std::ptrdiff_t>(s.fed + n));
    budget -= static_cast<int64_t>(n);
    if (s.req.prompt_logprobs && !s.replaying) *all_rows = true;
  }
  return tokens;
}

void Batcher::run_step() {
  const size_t S = slots_.size();
  for (size_t i = 0; i < S; ++i)
    if (slots_[i].live && slots_[i].gen->cancelled_) free_slot(i, Finish::Cancelled);
  restore_prefixes();
  if (!fit_pool()) return;
  if (opt_.draft_tokens > 0) {
    run_speculative_step();
    return count_pool();
  }
  bool all_rows = false;
  const auto tokens = plan_step(&all_rows);
  if (std::all_of(tokens.begin(), tokens.end(), [](const auto& t) { return t.empty(); })) return;

  std::vector<float> logits;
  try {
    logits = all_rows ? decoder_.step_all(tokens) : decoder_.step(tokens);
  } catch (const std::exception& e) {
    fail_slots(tokens, e);
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  counters_.cache_bytes.store(decoder_.cache_bytes(), std::memory_order_relaxed);
  count_pool();
  int64_t row = 0;
  for (size_t i = 0; i < S; ++i) {
    if (tokens[i].empty()) continue;
    const int64_t rows = all_rows ? static_cast<int64_t>(tokens[i].size()) : 1;
    take_rows(i, logits.data() + row * vocab_, rows, tokens[i].size(), now);
    row += rows;
  }
}

// The step's sequences are in an unknown state: each ends with the error.
void Batcher::fail_slots(const std::vector<std::vector<int32_t>>& tokens, const std::exception& e) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (!tokens[i].empty() && slots_[i].live) free_slot(i, Finish::Failed, e.what());
}

// Sequence i's rows of logits from a step that gave it `fed` tokens (one
// row, or one per token).
void Batcher::take_rows(size_t i, float* lg, int64_t rows, size_t fed, std::chrono::steady_clock::time_point now) {
  Slot& s = slots_[i];
  const int64_t V = vocab_;
  const int64_t draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : V;
  const BatchRequest& q = s.req;
  if (s.fed < q.prompt.size()) {
    // Row r predicts prompt token fed + r + 1.
    if (q.prompt_logprobs && !s.replaying)
      for (int64_t r = 0; r < rows && s.fed + static_cast<size_t>(r) + 1 < q.prompt.size(); ++r)
        s.prompt_lps.push_back(
            token_logprob(lg + r * V, V, q.prompt[s.fed + static_cast<size_t>(r) + 1], q.top_logprobs, draw_vocab));
    s.fed += fed;
    counters_.prompt_tokens.fetch_add(fed, std::memory_order_relaxed);
    if (s.fed < q.prompt.size()) return;  // the prompt goes on in the next step
    if (s.replaying) {                    // read again after a stop: the next token is known
      s.replaying = false;
      return;
    }
    if (!s.followers.empty()) share_prompt(i, lg + (rows - 1) * V, now);
    if (q.prompt_logprobs) s.gen->set_prompt_logprobs(std::move(s.prompt_lps));
    if (q.max_new_tokens == 0) return free_slot(i, Finish::Length);
  }
  sample_next(i, lg + (rows - 1) * V, now);
}

// The choices that waited for slot i's prompt, now read: each takes a copy
// of its cache and draws its first token from a copy of the same row. A
// decoder that cannot copy leaves each to read the prompt itself.
void Batcher::share_prompt(size_t i, const float* row, std::chrono::steady_clock::time_point now) {
  const std::vector<size_t> fs = std::move(slots_[i].followers);
  slots_[i].followers.clear();
  std::vector<float> own;
  for (const size_t f : fs) {
    Slot& t = slots_[f];
    t.following = false;
    // A copy the pool has no room for (kept prefixes evicted first): the
    // choice reads the prompt itself when there is.
    if (opt_.cache_memory > 0) {
      const size_t need = decoder_.sequence_bytes(static_cast<int64_t>(i));
      while (pool_bytes() + need > opt_.cache_memory && prefixes_ && prefixes_->evict()) {
      }
      if (pool_bytes() + need > opt_.cache_memory) continue;
    }
    try {
      decoder_.copy(static_cast<int64_t>(i), static_cast<int64_t>(f));
    } catch (const Error&) {
      continue;  // t.fed stays 0: it reads the prompt in the next steps
    }
    t.fed = t.req.prompt.size();
    if (t.req.prompt_logprobs) t.gen->set_prompt_logprobs(slots_[i].prompt_lps);
    if (t.req.max_new_tokens == 0) {
      free_slot(f, Finish::Length);
      continue;
    }
    own.assign(row, row + vocab_);
    // Speculative decoding: the copy's MTP layer reads what the reader's
    // does, then the copy's own first token.
    const std::vector<int32_t> pending = slots_[i].pending;
    sample_next(f, own.data(), now);
    if (t.live && opt_.draft_tokens > 0) {
      t.pending = pending;
      t.pending.push_back(t.last);
    }
  }
}

// Slot i's next token from its row of logits (adjusted in place).
void Batcher::sample_next(size_t i, float* last, std::chrono::steady_clock::time_point now) {
  Slot& s = slots_[i];
  const int64_t draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : vocab_;
  const float* before = adjust_row(s, last);
  // Sequence 0 of the request's own draws: what generate() draws for a
  // single prompt with the same seed.
  emit(i, sample_token(last, draw_vocab, s.req.sampler, 0, static_cast<uint64_t>(s.made)), before, now);
}

const float* Batcher::adjust_row(Slot& s, float* row) {
  const BatchRequest& q = s.req;
  if (!q.adjust.any()) return row;
  const float* before = row;
  if (q.logprobs) {
    s.unadjusted.assign(row, row + vocab_);  // the slot's buffer, reused
    before = s.unadjusted.data();
  }
  adjust_logits(row, vocab_, q.adjust, s.seen);
  return before;
}

bool Batcher::emit(size_t i, int32_t tok, const float* before, std::chrono::steady_clock::time_point now) {
  Slot& s = slots_[i];
  const BatchRequest& q = s.req;
  const int64_t draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : vocab_;
  TokenLogprob lp;
  if (q.logprobs) lp = token_logprob(before, vocab_, tok, q.top_logprobs, draw_vocab);
  if (q.adjust.any()) ++s.seen[tok].count;
  const double since = std::chrono::duration<double>(now - (s.made == 0 ? s.gen->submitted_ : s.last_at)).count();
  (s.made == 0 ? counters_.time_to_first_token : counters_.time_per_output_token).observe(since);
  counters_.generated_tokens.fetch_add(1, std::memory_order_relaxed);
  s.last_at = now;
  s.gen->push(tok, q.logprobs ? &lp : nullptr);
  s.out.push_back(tok);
  s.last = tok;
  ++s.made;
  if (opt_.eos_token_id >= 0 && tok == opt_.eos_token_id && !q.ignore_eos) {
    free_slot(i, Finish::Eos);
    return false;
  }
  if (s.made >= q.max_new_tokens || decoder_.length(static_cast<int64_t>(i)) >= max_positions_) {
    free_slot(i, Finish::Length);
    return false;
  }
  return true;
}

}  // namespace ds::infer
