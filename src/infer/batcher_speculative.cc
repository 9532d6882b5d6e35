// The batcher's step with speculative decoding (BatcherOptions::draft_tokens,
// infer/speculative.h): the MTP layer first reads every slot's positions
// since the last step and drafts a chain of up to K tokens for each
// decoding slot; one step of the model then reads the prompt chunks and
// each decoding slot's [newest token, drafts]; the speculative-sampling
// rule keeps drafts in order up to the first it replaces (the request's
// penalties and biases apply to every row, as plain sampling would apply
// them, each after the tokens before it), and the replaced drafts' rows are
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
  const int64_t V = vocab_, K = opt_.draft_tokens, draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : V;
  // The MTP layer reads each slot's new positions; decoding slots draft a
  // chain of up to K tokens; unless more sequences decode than drafting
  // pays for: then their positions wait in pending.
  int64_t decoding = 0;
  for (const Slot& s : slots_) decoding += s.live && !s.following && !s.held && s.fed >= s.req.prompt.size() ? 1 : 0;
  const bool drafting = opt_.draft_max_sequences == 0 || decoding <= opt_.draft_max_sequences;
  std::vector<std::vector<int32_t>> next(S);
  for (size_t i = 0; i < S && drafting; ++i)
    if (slots_[i].live && !slots_[i].following && !slots_[i].held) next[i] = std::move(slots_[i].pending);
  std::vector<std::vector<int32_t>> drafts(S);
  std::vector<std::vector<std::vector<double>>> q(S);
  std::vector<int64_t> want(S, 0);
  auto take = [&](size_t i, float* row) {
    Slot& s = slots_[i];
    const int64_t index = s.made + static_cast<int64_t>(drafts[i].size());
    adjust_row(s, row);
    q[i].push_back(sampling_probs(row, draw_vocab, s.req.sampler));
    drafts[i].push_back(s.req.sampler.temperature <= 0.0f
                            ? sample_token(row, draw_vocab, s.req.sampler, 0, 0)
                            : draw_from(q[i].back(), draw_u(s.req.sampler, index, kDraft)));
  };
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
      if (s.fed < s.req.prompt.size()) continue;  // still reading its prompt
      // Room for the drafts' positions, and no draft past the last token.
      want[i] = std::min(
          {K, max_positions_ - decoder_.length(static_cast<int64_t>(i)) - 1, s.req.max_new_tokens - s.made - 1});
      if (want[i] > 0) take(i, row);
    }
    std::vector<std::vector<int32_t>> chained(S);
    try {
      for (int64_t j = 1; j < K; ++j) {
        std::vector<int32_t> link(S, -1);
        for (size_t i = 0; i < S; ++i) {
          if (want[i] <= j) continue;
          link[i] = drafts[i].back();
          chained[i] = {link[i]};
        }
        if (std::all_of(link.begin(), link.end(), [](int32_t t) { return t < 0; })) break;
        auto rows = decoder_.draft_more(link);
        int64_t rr = 0;
        for (size_t i = 0; i < S; ++i)
          if (link[i] >= 0) take(i, rows.data() + rr++ * V);
      }
      decoder_.drop_links();
    } catch (const std::exception& e) {
      return fail_slots(chained, e);
    }
  }
  bool all_rows = false;
  auto tokens = plan_step(&all_rows);
  for (size_t i = 0; i < S; ++i) tokens[i].insert(tokens[i].end(), drafts[i].begin(), drafts[i].end());
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
    } else if (drafts[i].empty()) {
      sample_next(i, lg, now);
      if (s.live) {
        if (!drafting)
          s.pending.push_back(s.last);  // read when drafting resumes
        else
          s.pending = {s.last};
      }
    } else {
      decide_drafts(i, lg, drafts[i], q[i], now);
    }
  }
}

// Slot i's rows for [newest token, d1 .. dk]: drafts kept in order up to the
// first the rule replaces (the replaced one's and later rows leave the
// cache), or all kept and the next token from the last row.
void Batcher::decide_drafts(size_t i, float* rows, const std::vector<int32_t>& drafts,
                            const std::vector<std::vector<double>>& q, std::chrono::steady_clock::time_point now) {
  Slot& s = slots_[i];
  const SamplerConfig& c = s.req.sampler;
  const int64_t draw_vocab = opt_.sample_vocab > 0 ? opt_.sample_vocab : vocab_;
  const size_t k = drafts.size();
  counters_.drafted.fetch_add(k, std::memory_order_relaxed);
  for (size_t j = 0; j < k; ++j) counters_.drafted_at[j].fetch_add(1, std::memory_order_relaxed);
  std::vector<int32_t> made;
  for (size_t j = 0; j < k; ++j) {
    float* row = rows + static_cast<int64_t>(j) * vocab_;
    const float* before = adjust_row(s, row);
    bool kept = false;
    const int32_t tok = accept_or_resample(sampling_probs(row, draw_vocab, c), q[j], drafts[j],
                                           draw_u(c, s.made, kAccept), draw_u(c, s.made, kResample), &kept);
    if (kept) {
      counters_.accepted.fetch_add(1, std::memory_order_relaxed);
      counters_.accepted_at[j].fetch_add(1, std::memory_order_relaxed);
    } else {
      // Drafts j .. k - 1 go.
      decoder_.truncate(static_cast<int64_t>(i),
                        decoder_.length(static_cast<int64_t>(i)) - static_cast<int64_t>(k - j));
    }
    made.push_back(tok);
    if (!emit(i, tok, before, now)) return;
    if (!kept) {
      s.pending = std::move(made);
      return;
    }
  }
  float* last = rows + static_cast<int64_t>(k) * vocab_;
  const float* before = adjust_row(s, last);
  const int32_t bonus = c.temperature <= 0.0f
                            ? sample_token(last, draw_vocab, c, 0, 0)
                            : draw_from(sampling_probs(last, draw_vocab, c), draw_u(c, s.made, kBonus));
  made.push_back(bonus);
  if (emit(i, bonus, before, now)) s.pending = std::move(made);
}

}  // namespace ds::infer
