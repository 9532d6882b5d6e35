// Token sampling: greedy, temperature, top-k, top-p (nucleus), seeded; the
// penalties and biases that change a row of logits before it; the
// log-probabilities the server reports.
//
// The random draw for (sequence s, step i) is Philox(seed, stream s) at
// counter i, so a run is reproducible and independent of batch composition.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ds::infer {

struct SamplerConfig {
  float temperature = 0.0f;  // <= 0: greedy (argmax, ties to the lower id)
  int64_t top_k = 0;         // 0: no top-k cut
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

// Validates the configuration (one clear error for impossible values).
void check_sampler(const SamplerConfig& c);

int32_t sample_token(const float* logits, int64_t vocab, const SamplerConfig& c, uint64_t sequence, uint64_t step);

// The distribution sample_token draws from for a row, over [0, vocab):
// greedy puts all the mass on the argmax; otherwise temperature, top-k and
// top-p as sample_token applies them. Speculative decoding's acceptance
// rule compares two of them.
std::vector<double> sampling_probs(const float* logits, int64_t vocab, const SamplerConfig& c);
// The id whose cumulative mass first exceeds u times the total (u in
// [0, 1); the weights need not sum to 1).
int32_t draw_from(const std::vector<double>& probs, double u);

// What changes a sequence's logits before sampling, in this order:
//  - repetition (llama.cpp's and vLLM's): the logit l of every id in the
//    prompt or made so far becomes l / repetition if l > 0, else
//    l * repetition (1: off);
//  - frequency and presence (OpenAI's): l - count * frequency - presence for
//    an id made `count` > 0 times so far (the prompt does not count);
//  - bias (OpenAI's logit_bias): added to the id's logit.
// Each touches only the ids it names: a row costs nothing extra without them.
struct LogitAdjust {
  float presence = 0.0f, frequency = 0.0f, repetition = 1.0f;
  std::vector<std::pair<int32_t, float>> bias;
  bool any() const { return presence != 0.0f || frequency != 0.0f || repetition != 1.0f || !bias.empty(); }
};

// The ids a LogitAdjust looks at: made `count` times, in the prompt or not.
struct TokenSeen {
  int32_t count = 0;
  bool in_prompt = false;
};
using TokenHistory = std::unordered_map<int32_t, TokenSeen>;

// One clear error for values outside OpenAI's ranges (presence and frequency
// in [-2, 2], repetition > 0, biases in [-100, 100] on ids below vocab).
void check_adjust(const LogitAdjust& a, int64_t vocab);

// Changes logits[0, vocab) in place.
void adjust_logits(float* logits, int64_t vocab, const LogitAdjust& a, const TokenHistory& seen);

// Log-probabilities reported with a token: its own and the most likely ids'.
inline constexpr int64_t kMaxTopLogprobs = 20;
struct TokenLogprob {
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // most likely first (ties to the lower id)
};

// The log-softmax over logits[0, vocab) of `id`, and of the `top` (<=
// kMaxTopLogprobs) most likely ids below top_vocab. Two passes over the row;
// nothing the size of the vocabulary is allocated.
TokenLogprob token_logprob(const float* logits, int64_t vocab, int32_t id, int64_t top, int64_t top_vocab);

}  // namespace ds::infer
