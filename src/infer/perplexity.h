// Perplexity as llama.cpp's llama-perplexity computes it, so that the two
// engines' numbers compare: the token stream is cut into chunks of `ctx`
// tokens (the rest after the last whole chunk is left out), each chunk's
// first token is replaced by the BOS (when the tokenizer has one) and the
// chunk runs as one sequence from position 0; the second half of each
// chunk is scored: rows first = ctx / 2 .. ctx - 2 predict the token after
// them, ctx - first - 1 scores a chunk. PPL = exp(mean NLL), and its error
// is llama.cpp's: ppl * sqrt((mean(NLL^2) - mean(NLL)^2) / (n - 1)).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace ds::infer {

struct PerplexityOptions {
  int64_t ctx = 512;    // tokens a chunk
  int64_t chunks = -1;  // chunks at most (-1: all)
  std::optional<int32_t> bos;
};

struct PerplexityResult {
  double ppl = 0, ppl_error = 0, mean_nll = 0;
  int64_t chunks = 0, scored = 0;
};

// `logits(chunk)` returns the [ctx, vocab] logits of one chunk (row-major).
// `progress(i, ppl)` is told the running perplexity after chunk i (from 1).
// A stream shorter than 2 * ctx, or ctx below 4, is a ds::Error.
PerplexityResult perplexity(const std::vector<int32_t>& ids, const PerplexityOptions& opt, int64_t vocab,
                            const std::function<std::vector<float>(const std::vector<int32_t>&)>& logits,
                            const std::function<void(int64_t, double)>& progress = {});

// -log softmax(row)[token] in double precision.
double token_nll(const float* row, int64_t vocab, int32_t token);

}  // namespace ds::infer
