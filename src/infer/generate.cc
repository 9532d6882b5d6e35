#include "infer/generate.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "core/error.h"

namespace ds::infer {

double GenerateStats::decode_tokens_per_second() const {
  return decode_seconds > 0 ? decode_steps_tokens / decode_seconds : 0;
}

std::vector<std::vector<int32_t>> generate(model::Transformer& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& opt, GenerateStats* stats) {
  DS_CHECK(!prompts.empty(), "generate: no prompts");
  DS_CHECK(opt.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got {}", opt.max_new_tokens);
  check_sampler(opt.sampler);
  DS_CHECK(opt.prefill_chunk >= 0, "generate: prefill_chunk must be >= 0, got {}", opt.prefill_chunk);
  for (size_t s = 0; s < prompts.size(); ++s) DS_CHECK(!prompts[s].empty(), "generate: prompt {} is empty", s);
  const auto& cfg = model.config();
  const int64_t V = cfg.vocab_size, S = static_cast<int64_t>(prompts.size());
  DS_CHECK(opt.sample_vocab >= 0 && opt.sample_vocab <= V, "generate: sample_vocab {} outside [0, {}]",
           opt.sample_vocab, V);
  const int64_t draw_vocab = opt.sample_vocab > 0 ? opt.sample_vocab : V;
  KvCache cache(opt.cache, S, cfg.num_hidden_layers);
  std::vector<std::vector<int32_t>> out(S);
  std::vector<bool> done(S, opt.max_new_tokens == 0);
  GenerateStats st;
  for (const auto& p : prompts) st.prompt_tokens += static_cast<int64_t>(p.size());
  using clock = std::chrono::steady_clock;

  auto emit = [&](const std::vector<float>& logits, const std::vector<int64_t>& rows_for) {
    for (size_t r = 0; r < rows_for.size(); ++r) {
      const int64_t s = rows_for[r];
      const int32_t tok =
          sample_token(&logits[r * V], draw_vocab, opt.sampler, static_cast<uint64_t>(s), out[s].size());
      out[s].push_back(tok);
      ++st.generated_tokens;
      if (opt.on_token) opt.on_token(s, tok);
      if ((opt.eos_token_id >= 0 && tok == opt.eos_token_id) ||
          static_cast<int64_t>(out[s].size()) >= opt.max_new_tokens ||
          cache.seqs[s].length >= cfg.max_position_embeddings)
        done[s] = true;
    }
  };

  if (opt.max_new_tokens > 0) {
    auto t0 = clock::now();
    // Prefill in steps of at most prefill_chunk tokens, taken from the
    // prompts in order; a sequence's first logits come from the step that
    // reaches the end of its prompt.
    std::vector<float> logits(static_cast<size_t>(S * V));
    std::vector<size_t> fed(S, 0);
    for (int64_t next = 0; next < S;) {
      std::vector<std::vector<int32_t>> part(S);
      int64_t budget = opt.prefill_chunk > 0 ? opt.prefill_chunk : std::numeric_limits<int64_t>::max();
      for (int64_t s = next; s < S && budget > 0; ++s) {
        const auto& p = prompts[s];
        const size_t n = std::min<size_t>(p.size() - fed[s], static_cast<size_t>(budget));
        part[s].assign(p.begin() + static_cast<std::ptrdiff_t>(fed[s]),
                       p.begin() + static_cast<std::ptrdiff_t>(fed[s] + n));
        fed[s] += n;
        budget -= static_cast<int64_t>(n);
      }
      const auto lg = model.step(cache, part, false);
      // step returns one row per sequence that received tokens, in order.
      int64_t row = 0;
      for (int64_t s = next; s < S; ++s) {
        if (part[s].empty()) continue;
        if (fed[s] == prompts[s].size())
          std::copy(lg.begin() + row * V, lg.begin() + (row + 1) * V, logits.begin() + s * V);
        ++row;
      }
      while (next < S && fed[next] == prompts[next].size()) ++next;
    }
    st.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
    std::vector<int64_t> all(S);
    for (int64_t s = 0; s < S; ++s) all[s] = s;
    emit(logits, all);
    auto t1 = clock::now();
    for (;;) {
      std::vector<std::vector<int32_t>> step(S);
      std::vector<int64_t> rows;
      for (int64_t s = 0; s < S; ++s)
        if (!done[s]) {
          step[s] = {out[s].back()};
          rows.push_back(s);
        }
      if (rows.empty()) break;
      auto lg = model.step(cache, step, false);
      st.decode_steps_tokens += static_cast<int64_t>(rows.size());
      emit(lg, rows);
    }
    st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  }
  st.cache_bytes = cache.bytes();
  if (stats) *stats = st;
  return out;
}

}  // namespace ds::infer
