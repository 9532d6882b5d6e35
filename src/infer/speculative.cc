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
  DS_CHECK(opt.draft_tokens >= 1 && opt.draft_tokens <= kMaxDraftTokens,
           "speculative decoding drafts 1 to {} tokens a step, not {}", kMaxDraftTokens, opt.draft_tokens);
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

  // Each step: the MTP layer drafts a chain of up to K tokens from the
  // newest kept positions (the first from the model's hidden state, each
  // next from its own), the model checks [newest token, drafts] in one step
  // and the rule keeps drafts up to the first it replaces.
  const int64_t K = opt.draft_tokens;
  st.drafted_at.assign(static_cast<size_t>(K), 0);
  st.accepted_at.assign(static_cast<size_t>(K), 0);
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
    std::vector<std::vector<int32_t>> tokens(S), drafts(S);
    std::vector<std::vector<std::vector<double>>> q(S);
    std::vector<int64_t> want(S, 0);  // drafts sequence s makes this step
    auto take = [&](int64_t s, const float* row, int64_t j) {
      const int64_t index = static_cast<int64_t>(out[s].size()) + j;
      q[s].push_back(sampling_probs(row, draw_vocab, opt.sampler));
      drafts[s].push_back(greedy ? sample_token(row, draw_vocab, opt.sampler, 0, 0)
                                 : draw_from(q[s].back(), draws[s].u(index, kDraft)));
    };
    for (size_t k = 0; k < live.size(); ++k) {
      const int64_t s = live[k];
      tokens[s] = {out[s].back()};
      // Room for the drafts' positions, and no draft past the last token.
      want[s] = std::min({K, model.max_positions() - model.length(s) - 1,
                          opt.max_new_tokens - static_cast<int64_t>(out[s].size()) - 1});
      if (want[s] > 0) take(s, &dl[k * V], 0);
    }
    for (int64_t j = 1; j < K; ++j) {
      std::vector<int32_t> link(S, -1);
      bool any = false;
      for (const int64_t s : live) {
        if (want[s] <= j) continue;
        link[s] = drafts[s].back();
        any = true;
      }
      if (!any) break;
      const auto rows = model.draft_more(link);
      int64_t r = 0;
      for (const int64_t s : live)
        if (link[s] >= 0) take(s, &rows[r++ * V], j);
    }
    model.drop_links();
    for (const int64_t s : live) tokens[s].insert(tokens[s].end(), drafts[s].begin(), drafts[s].end());
    const auto lg = model.step_keep(tokens, true);
    int64_t row = 0;
    for (const int64_t s : live) {
      const int64_t index = static_cast<int64_t>(out[s].size()), k = static_cast<int64_t>(drafts[s].size());
      const float* rows = &lg[row * V];
      row += static_cast<int64_t>(tokens[s].size());
      std::vector<int32_t> made;
      int64_t kept_n = 0;
      for (int64_t j = 0; j < k; ++j) {
        ++st.drafted;
        ++st.drafted_at[static_cast<size_t>(j)];
      }
      for (int64_t j = 0; j < k; ++j) {
        bool kept = false;
        const auto p = sampling_probs(rows + j * V, draw_vocab, opt.sampler);
        made.push_back(accept_or_resample(p, q[s][static_cast<size_t>(j)], drafts[s][static_cast<size_t>(j)],
                                          draws[s].u(index + j, kAccept), draws[s].u(index + j, kResample), &kept));
        if (!kept) break;
        ++kept_n;
        ++st.accepted;
        ++st.accepted_at[static_cast<size_t>(j)];
      }
      // Every draft kept (or none made): the next token from the last row.
      if (kept_n == k) made.push_back(draw(rows + k * V, s, index + k, k == 0 ? kResample : kBonus));
      if (kept_n < k) model.truncate(s, model.length(s) - (k - kept_n));  // the replaced drafts' rows go
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
