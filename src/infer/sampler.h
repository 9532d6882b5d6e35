// Token sampling: greedy, temperature, top-k, top-p (nucleus), seeded.
//
// The random draw for (sequence s, step i) is Philox(seed, stream s) at
// counter i, so a run is reproducible and independent of batch composition.
#pragma once

#include <cstdint>

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

}  // namespace ds::infer
