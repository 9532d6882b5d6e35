#include "infer/batcher.h"

#include <algorithm>
#include <exception>
#include <limits>

#include "core/error.h"

namespace ds::infer {

bool Generation::take(int32_t* token) {
  if (tokens_.empty()) return false;
  *token = tokens_.front();
  tokens_.pop_front();
  return true;
}

bool Generation::next(int32_t* token) {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return !tokens_.empty() || finish_ != Finish::Running; });
  return take(token);
}

Finish Generation::finish() const {
  std::lock_guard lk(mu_);
  return finish_;
}

std::string Generation::error() const {
  std::lock_guard lk(mu_);
  return error_;
}

void Generation::push(int32_t token) {
  {
    std::lock_guard lk(mu_);
    tokens_.push_back(token);
  }
  cv_.notify_all();
}

void Generation::end(Finish f, std::string error) {
  {
    std::lock_guard lk(mu_);
    if (finish_ != Finish::Running) return;
    finish_ = f;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

Batcher::Batcher(Decoder& decoder, BatcherOptions opt)
    : decoder_(decoder), opt_(opt), vocab_(decoder.vocab_size()), max_positions_(decoder.max_positions()) {
  DS_CHECK(opt_.max_sequences >= 1 && opt_.max_sequences <= kMaxSequences, "batcher: max_sequences {} outside [1, {}]",
           opt_.max_sequences, kMaxSequences);
  DS_CHECK(opt_.max_waiting >= 0, "batcher: max_waiting must be >= 0, got {}", opt_.max_waiting);
  DS_CHECK(opt_.prefill_chunk >= 0, "batcher: prefill_chunk must be >= 0, got {}", opt_.prefill_chunk);
  DS_CHECK(opt_.sample_vocab >= 0 && opt_.sample_vocab <= vocab_, "batcher: sample_vocab {} outside [0, {}]",
           opt_.sample_vocab, vocab_);
  decoder_.start(opt_.max_sequences);
  slots_.resize(static_cast<size_t>(opt_.max_sequences));
  thread_ = std::thread([this] { loop(); });
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
  for (auto& w : waiting_) w.gen->end(Finish::Cancelled);
  waiting_.clear();
  for (auto& s : slots_)
    if (s.live) s.gen->end(Finish::Cancelled);
}

std::shared_ptr<Generation> Batcher::submit(BatchRequest r) {
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  DS_CHECK(n > 0, "the prompt is empty");
  DS_CHECK(n <= max_positions_, "the prompt has {} tokens, beyond the model's {} positions", n, max_positions_);
  for (size_t i = 0; i < r.prompt.size(); ++i)
    DS_CHECK(r.prompt[i] >= 0 && r.prompt[i] < vocab_, "prompt token {} is {}, outside the vocabulary [0, {})", i,
             r.prompt[i], vocab_);
  DS_CHECK(r.max_new_tokens >= 0, "max_new_tokens must be >= 0, got {}", r.max_new_tokens);
  check_sampler(r.sampler);
  auto gen = std::make_shared<Generation>();
  gen->prompt_tokens_ = n;
  if (r.max_new_tokens == 0) {
    gen->end(Finish::Length);
    return gen;
  }
  {
    std::lock_guard lk(mu_);
    if (stop_) throw Unavailable("the server is shutting down");
    // Free slots take requests beyond max_waiting: they wait only until the
    // next step.
    const int64_t free_slots = std::max<int64_t>(0, opt_.max_sequences - running_.load());
    if (static_cast<int64_t>(waiting_.size()) >= opt_.max_waiting + free_slots)
      throw Unavailable(fmt::format("every slot is busy and {} requests are waiting; try again later",
                                    waiting_.size()));
    waiting_.push_back({gen, std::move(r)});
  }
  cv_.notify_all();
  return gen;
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
  Slot& s = slots_[i];
  s.gen->end(f, error);
  s = Slot{};
  --running_;
  // Frees the sequence's cache now rather than at the slot's next use.
  decoder_.reset(static_cast<int64_t>(i));
}

void Batcher::loop() {
  for (;;) {
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !waiting_.empty() || running_.load() > 0; });
      if (stop_) return;
      for (size_t i = 0; i < slots_.size() && !waiting_.empty(); ++i) {
        if (slots_[i].live) continue;
        Waiting w = std::move(waiting_.front());
        waiting_.pop_front();
        if (w.gen->cancelled_) {
          w.gen->end(Finish::Cancelled);
          --i;  // the slot is still free
          continue;
        }
        Slot& s = slots_[i];
        s.gen = std::move(w.gen);
        s.req = std::move(w.req);
        s.order = admitted_++;
        s.live = true;
        ++running_;
      }
    }
    if (running_.load() > 0) run_step();
  }
}

void Batcher::run_step() {
  const size_t S = slots_.size();
  for (size_t i = 0; i < S; ++i)
    if (slots_[i].live && slots_[i].gen->cancelled_) free_slot(i, Finish::Cancelled);
  // Sequences past their prompt take their newest token; the prompts share
  // the chunk budget, the oldest request first.
  std::vector<std::vector<int32_t>> tokens(S);
  std::vector<size_t> reading;
  for (size_t i = 0; i < S; ++i) {
    const Slot& s = slots_[i];
    if (!s.live) continue;
    if (s.fed == s.req.prompt.size())
      tokens[i] = {s.last};
    else
      reading.push_back(i);
  }
  std::sort(reading.begin(), reading.end(), [&](size_t a, size_t b) { return slots_[a].order < slots_[b].order; });
  int64_t budget = opt_.prefill_chunk > 0 ? opt_.prefill_chunk : std::numeric_limits<int64_t>::max();
  for (const size_t i : reading) {
    if (budget <= 0) break;
    Slot& s = slots_[i];
    const size_t n = std::min<size_t>(s.req.prompt.size() - s.fed, static_cast<size_t>(budget));
    tokens[i].assign(s.req.prompt.begin() + static_cast<std::ptrdiff_t>(s.fed),
                     s.req.prompt.begin() + static_cast<std::ptrdiff_t>(s.fed + n));
    budget -= static_cast<int64_t>(n);
  }
  if (std::all_of(tokens.begin(), tokens.end(), [](const auto& t) { return t.empty(); })) return;

  std::vector<float> logits;
  try {
    logits = decoder_.step(tokens);
  } catch (const std::exception& e) {
    // The step's sequences are in an unknown state: each ends with the error.
    for (size_t i = 0; i < S; ++i)
      if (!tokens[i].empty()) free_slot(i, Finish::Failed, e.what());
    return;
  }
  const int64_t V = vocab_;
  const int64_t draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : V;
  int64_t row = 0;
  for (size_t i = 0; i < S; ++i) {
    if (tokens[i].empty()) continue;
    Slot& s = slots_[i];
    const float* lg = logits.data() + row++ * V;
    if (s.fed < s.req.prompt.size()) {
      s.fed += tokens[i].size();
      if (s.fed < s.req.prompt.size()) continue;  // the prompt goes on in the next step
    }
    // Sequence 0 of the request's own draws: what generate() draws for a
    // single prompt with the same seed.
    const int32_t tok = sample_token(lg, draw_vocab, s.req.sampler, 0, static_cast<uint64_t>(s.made));
    s.gen->push(tok);
    s.last = tok;
    ++s.made;
    if (opt_.eos_token_id >= 0 && tok == opt_.eos_token_id && !s.req.ignore_eos)
      free_slot(i, Finish::Eos);
    else if (s.made >= s.req.max_new_tokens || decoder_.length(static_cast<int64_t>(i)) >= max_positions_)
      free_slot(i, Finish::Length);
  }
}

}  // namespace ds::infer
