#include "infer/perplexity.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace ds::infer {

double token_nll(const float* row, int64_t vocab, int32_t token) {
  double mx = row[0];
  for (int64_t i = 1; i < vocab; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
  return mx + std::log(sum) - static_cast<double>(row[token]);
}

PerplexityResult perplexity(const std::vector<int32_t>& ids, const PerplexityOptions& opt, int64_t vocab,
                            const std::function<std::vector<float>(const std::vector<int32_t>&)>& logits,
                            const std::function<void(int64_t, double)>& progress) {
  const int64_t ctx = opt.ctx, n = static_cast<int64_t>(ids.size());
  DS_CHECK(ctx >= 4, "perplexity: a context of {} tokens is too short (at least 4)", ctx);
  DS_CHECK(n >= 2 * ctx,
           "perplexity: the data has {} tokens; a context of {} needs at least {} (two chunks), as llama-perplexity "
           "does",
           n, ctx, 2 * ctx);
  const int64_t all = n / ctx, chunks = opt.chunks < 0 ? all : std::min(opt.chunks, all);
  DS_CHECK(chunks >= 1, "perplexity: --chunks must be at least 1, got {}", opt.chunks);
  const int64_t first = ctx / 2;
  PerplexityResult r;
  double nll = 0, nll2 = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<int32_t> chunk(ids.begin() + c * ctx, ids.begin() + (c + 1) * ctx);
    if (opt.bos) chunk[0] = *opt.bos;
    const std::vector<float> lg = logits(chunk);
    DS_CHECK(static_cast<int64_t>(lg.size()) == ctx * vocab, "perplexity: {} logits for a chunk of {} x {}",
             lg.size(), ctx, vocab);
    for (int64_t t = first; t + 1 < ctx; ++t) {
      // The chunk's original token: only the first one is replaced.
      const double v = token_nll(&lg[static_cast<size_t>(t * vocab)], vocab, ids[c * ctx + t + 1]);
      nll += v;
      nll2 += v * v;
      ++r.scored;
    }
    ++r.chunks;
    if (progress) progress(c + 1, std::exp(nll / static_cast<double>(r.scored)));
  }
  const double count = static_cast<double>(r.scored);
  r.mean_nll = nll / count;
  r.ppl = std::exp(r.mean_nll);
  const double var = nll2 / count - r.mean_nll * r.mean_nll;
  r.ppl_error = var > 0 && count > 1 ? std::sqrt(var / (count - 1)) * r.ppl : 0;
  return r;
}

}  // namespace ds::infer
