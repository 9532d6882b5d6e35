#include "infer/speculative.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/rng.h"
#include "infer/sampler.h"

namespace ds::infer {

int32_t accept_or_resample(const std::vector<double>& p, const std::vector<double>& q, int32_t draft, double u_accept,
                           double u_resample, bool* accepted) {
  const double pd = p[static_cast<size_t>(draft)], qd = q[static_cast<size_t>(draft)];
  // u < min(1, p(d) / q(d)), with q(d) > 0 since d was drawn from q.
  *accepted = qd > 0 && u_accept * qd < pd;
  if (*accepted) return draft;
  std::vector<double> rest(p.size());
  double total = 0;
  for (size_t i = 0; i < p.size(); ++i) total += rest[i] = std::max(0.0, p[i] - q[i]);
  // p <= q everywhere means p == q, where nothing is rejected but rounding.
  return draw_from(total > 0 ? rest : p, u_resample);
}

namespace {

// The uniform draws of speculative decoding for sequence s: a stream of
// their own beside sample_token's, four counters per token index.
struct Draws {
  Philox rng;
  float u(int64_t token_index, int64_t what) const {
    return rng.uniform(static_cast<uint64_t>(4 * token_index + what));
  }
};
enum : int64_t { kDraft = 0, kAccept = 1, kResample = 2, kBonus = 3 };
constexpr uint64_t kStreamSalt = 0x9e3779b97f4a7c15ULL;

}  // namespace

std::vector<std::vector<int32_t>> generate_speculative(Decoder& model, const std::vector<std::vector<int32_t>>& prompts,
                                                       const GenerateOptions& opt, GenerateStats* stats) {
  DS_CHECK(model.can_draft(), "speculative decoding needs the model's MTP layer, which is not loaded");
  DS_CHECK(opt.draft_tokens == 1,
           "speculative decoding drafts one token a step (the MTP layer's one depth); {} draft tokens are not "
           "supported",
           opt.draft_tokens);
  const int64_t V = model.vocab_size(), S = static_cast<int64_t>(prompts.size());
  const int64_t draw_vocab = opt.sample_vocab > 0 ? opt.sample_vocab : V;
  const bool greedy = opt.sampler.temperature <= 0.0f;
  model.start(S);
  std::vector<std::vector<int32_t>> out(S);
  std::vector<bool> done(S, opt.max_new_tokens == 0);
  GenerateStats st;
  for (const auto& p : prompts) st.prompt_tokens += static_cast<int64_t>(p.size());
  using clock = std::chrono::steady_clock;
  // next[s]: the tokens that follow sequence s's kept positions, which the
  // MTP layer reads at the next draft().
  std::vector<std::vector<int32_t>> next(S);
  std::vector<Draws> draws;
  for (int64_t s = 0; s < S; ++s) draws.push_back({Philox(opt.sampler.seed ^ kStreamSalt, static_cast<uint64_t>(s))});
  auto push = [&](int64_t s, int32_t tok) {
    out[s].push_back(tok);
    ++st.generated_tokens;
    if (opt.on_token) opt.on_token(s, tok);
    if ((opt.eos_token_id >= 0 && tok == opt.eos_token_id) ||
        static_cast<int64_t>(out[s].size()) >= opt.max_new_tokens || model.length(s) >= model.max_positions())
      done[s] = true;
    return !done[s];
  };
  auto draw = [&](const float* row, int64_t s, int64_t index, int64_t what) {
    return greedy ? sample_token(row, draw_vocab, opt.sampler, 0, 0)
                  : draw_from(sampling_probs(row, draw_vocab, opt.sampler), draws[s].u(index, what));
  };
  if (opt.max_new_tokens == 0) {
    if (stats) *stats = st;
    return out;
  }

  // The prompts, in steps of at most prefill_chunk tokens; the MTP layer
  // reads each step's positions whose next token is the prompt's.
  auto t0 = clock::now();
  std::vector<float> first(static_cast<size_t>(S * V));
  std::vector<size_t> fed(S, 0);
  for (int64_t lead = 0; lead < S;) {
    const auto part = prefill_part(prompts, fed, lead, opt.prefill_chunk);
    const auto lg = model.step_keep(part, false);
    int64_t row = 0;
    for (int64_t s = lead; s < S; ++s) {
      if (part[s].empty()) continue;
      const auto& p = prompts[s];
      const size_t end = fed[s] + part[s].size();
      for (size_t i = fed[s]; i < end && i + 1 < p.size(); ++i) next[s].push_back(p[i + 1]);
      fed[s] = end;
      if (fed[s] == p.size()) std::copy(lg.begin() + row * V, lg.begin() + (row + 1) * V, first.begin() + s * V);
      ++row;
    }
    model.draft(next);
    for (auto& n : next) n.clear();
    while (lead < S && fed[lead] == prompts[lead].size()) ++lead;
  }
  st.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  for (int64_t s = 0; s < S; ++s) {
    // The first token as the plain loop draws it.
    const int32_t tok = sample_token(&first[s * V], draw_vocab, opt.sampler, static_cast<uint64_t>(s), 0);
    next[s] = {tok};
    push(s, tok);
  }

  // Each step: the MTP layer drafts from the newest kept positions, the
  // model checks [newest token, draft] and the rule keeps or replaces it.
  auto t1 = clock::now();
  for (;;) {
    std::vector<int64_t> live;
    for (int64_t s = 0; s < S; ++s) {
      if (done[s])
        next[s].clear();
      else
        live.push_back(s);
    }
    if (live.empty()) break;
    const auto dl = model.draft(next);
    std::vector<std::vector<int32_t>> tokens(S);
    std::vector<int32_t> drafted(S, -1);
    std::vector<std::vector<double>> q(S);
    for (size_t k = 0; k < live.size(); ++k) {
      const int64_t s = live[k], index = static_cast<int64_t>(out[s].size());
      tokens[s] = {out[s].back()};
      if (model.length(s) + 2 > model.max_positions()) continue;  // no room for the draft
      q[s] = sampling_probs(&dl[k * V], draw_vocab, opt.sampler);
      drafted[s] =
          greedy ? sample_token(&dl[k * V], draw_vocab, opt.sampler, 0, 0) : draw_from(q[s], draws[s].u(index, kDraft));
      tokens[s].push_back(drafted[s]);
    }
    const auto lg = model.step_keep(tokens, true);
    int64_t row = 0;
    for (const int64_t s : live) {
      const int64_t index = static_cast<int64_t>(out[s].size());
      const float* p0 = &lg[row * V];
      row += static_cast<int64_t>(tokens[s].size());
      std::vector<int32_t> made;
      if (drafted[s] < 0) {
        made = {draw(p0, s, index, kResample)};
      } else {
        ++st.drafted;
        bool kept = false;
        const auto p = sampling_probs(p0, draw_vocab, opt.sampler);
        made = {
            accept_or_resample(p, q[s], drafted[s], draws[s].u(index, kAccept), draws[s].u(index, kResample), &kept)};
        if (kept) {
          ++st.accepted;
          made.push_back(draw(p0 + V, s, index + 1, kBonus));
        } else {
          model.truncate(s, model.length(s) - 1);  // the draft's row goes
        }
      }
      next[s] = made;
      for (const int32_t t : made) {
        ++st.decode_steps_tokens;
        if (!push(s, t)) break;
      }
    }
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  st.cache_bytes = model.cache_bytes();
  if (stats) *stats = st;
  return out;
}

}  // namespace ds::infer
