// The batcher's step with speculative decoding (BatcherOptions::draft_tokens,
// infer/speculative.h): the MTP layer first reads every slot's positions
// since the last step and drafts the token after next for each decoding
// slot; one step of the model then reads the prompt chunks and each
// decoding slot's [newest token, draft]; the speculative-sampling rule keeps
// or replaces each draft (the request's penalties and biases apply to both
// rows, as plain sampling would apply them), and a rejected draft's row is
// dropped from the cache. Greedy requests make what they make without it.
#include <algorithm>
#include <chrono>
#include <exception>
#include <vector>

#include "core/rng.h"
#include "infer/batcher.h"
#include "infer/speculative.h"

namespace ds::infer {

namespace {

// A request's uniform draws for speculative decoding: a stream of their
// own beside sample_token's, four counters per token index.
constexpr uint64_t kStreamSalt = 0x9e3779b97f4a7c15ULL;
enum : uint64_t { kDraft = 0, kAccept = 1, kResample = 2, kBonus = 3 };
double draw_u(const SamplerConfig& c, int64_t index, uint64_t what) {
  return Philox(c.seed ^ kStreamSalt, 0).uniform(4 * static_cast<uint64_t>(index) + what);
}

}  // namespace

void Batcher::run_speculative_step() {
  const size_t S = slots_.size();
  const int64_t V = vocab_, draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : V;
  // The MTP layer reads each slot's new positions; decoding slots draft.
  std::vector<std::vector<int32_t>> next(S);
  for (size_t i = 0; i < S; ++i)
    if (slots_[i].live && !slots_[i].following) next[i] = std::move(slots_[i].pending);
  std::vector<int32_t> draft(S, -1);
  std::vector<std::vector<double>> q(S);
  if (std::any_of(next.begin(), next.end(), [](const auto& n) { return !n.empty(); })) {
    std::vector<float> dl;
    try {
      dl = decoder_.draft(next);
    } catch (const std::exception& e) {
      return fail_slots(next, e);
    }
    int64_t r = 0;
    for (size_t i = 0; i < S; ++i) {
      if (next[i].empty()) continue;
      float* row = dl.data() + r++ * V;
      Slot& s = slots_[i];
      // Still reading its prompt, no room for two positions, or one token left.
      if (s.fed < s.req.prompt.size() || decoder_.length(static_cast<int64_t>(i)) + 2 > max_positions_ ||
          s.made + 1 >= s.req.max_new_tokens)
        continue;
      adjust_row(s, row);
      q[i] = sampling_probs(row, draw_vocab, s.req.sampler);
      draft[i] = s.req.sampler.temperature <= 0.0f ? sample_token(row, draw_vocab, s.req.sampler, 0, 0)
                                                   : draw_from(q[i], draw_u(s.req.sampler, s.made, kDraft));
    }
  }
  bool all_rows = false;
  auto tokens = plan_step(&all_rows);
  for (size_t i = 0; i < S; ++i)
    if (draft[i] >= 0) tokens[i].push_back(draft[i]);
  if (std::all_of(tokens.begin(), tokens.end(), [](const auto& t) { return t.empty(); })) return;
  std::vector<float> logits;
  try {
    logits = decoder_.step_keep(tokens, /*all_logits=*/true);
  } catch (const std::exception& e) {
    return fail_slots(tokens, e);
  }
  const auto now = std::chrono::steady_clock::now();
  counters_.cache_bytes.store(decoder_.cache_bytes(), std::memory_order_relaxed);
  int64_t row = 0;
  for (size_t i = 0; i < S; ++i) {
    const size_t n = tokens[i].size();
    if (n == 0) continue;
    float* lg = logits.data() + row * V;
    row += static_cast<int64_t>(n);
    Slot& s = slots_[i];
    if (s.fed < s.req.prompt.size()) {
      // A prompt chunk: the MTP layer reads its positions at the next step,
      // the last prompt position once the first token is known.
      const auto& p = s.req.prompt;
      for (size_t k = s.fed; k < s.fed + n && k + 1 < p.size(); ++k) s.pending.push_back(p[k + 1]);
      take_rows(i, lg, static_cast<int64_t>(n), n, now);
      if (s.live && s.fed == p.size() && s.made > 0) s.pending.push_back(s.last);
    } else if (draft[i] < 0) {
      sample_next(i, lg, now);
      if (s.live) s.pending = {s.last};
    } else {
      decide_draft(i, lg, draft[i], q[i], now);
    }
  }
}

// Slot i's rows for [newest token, draft]: the draft kept (then the next
// token from the second row) or replaced.
void Batcher::decide_draft(size_t i, float* rows, int32_t draft, const std::vector<double>& q,
                           std::chrono::steady_clock::time_point now) {
  Slot& s = slots_[i];
  const SamplerConfig& c = s.req.sampler;
  const int64_t draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : vocab_;
  counters_.drafted.fetch_add(1, std::memory_order_relaxed);
  const float* before = adjust_row(s, rows);
  bool kept = false;
  const int32_t tok = accept_or_resample(sampling_probs(rows, draw_vocab, c), q, draft, draw_u(c, s.made, kAccept),
                                         draw_u(c, s.made, kResample), &kept);
  if (kept)
    counters_.accepted.fetch_add(1, std::memory_order_relaxed);
  else
    decoder_.truncate(static_cast<int64_t>(i), decoder_.length(static_cast<int64_t>(i)) - 1);
  if (!emit(i, tok, before, now)) return;
  if (!kept) {
    s.pending = {tok};
    return;
  }
  float* second = rows + vocab_;
  const float* before2 = adjust_row(s, second);
  const int32_t bonus = c.temperature <= 0.0f
                            ? sample_token(second, draw_vocab, c, 0, 0)
                            : draw_from(sampling_probs(second, draw_vocab, c), draw_u(c, s.made, kBonus));
  if (emit(i, bonus, before2, now)) s.pending = {tok, bonus};
}

}  // namespace ds::infer
