// Model FLOPs of one training step by MaxText's accounting (maxtext_utils,
// DeepSeek decoder block): 3 x (forward matmul FLOPs) for every weight a token
// meets (attention projections, dense and expert MLPs, router, unembedding;
// the embedding lookup counts 0) plus 3 x causal attention (half of the T x T
// scores), per layer, MTP layers included (their eh_proj and head are not
// counted, as MaxText does not), times gradient_accumulation_steps. Remat
// recompute, norms, softmax and routing are not counted.
#pragma once

#include <cstdint>

#include "model/config.h"
#include "model/v4_config.h"

namespace ds::model {

double step_flops(const ModelConfig& c, int64_t batch, int64_t seq, int64_t mtp_layers = 0, int64_t grad_accum = 1);

// One forward pass over batch x seq tokens by the same accounting (a third
// of step_flops), with the unembedding applied to head_rows rows: every
// token's in training, only the last of each sequence in a prefill.
double forward_flops(const ModelConfig& c, int64_t batch, int64_t seq, int64_t head_rows, int64_t mtp_layers = 0);

// DeepSeek-V4 by the same rule: every weight a token meets (q-LoRA, the K=V
// latent, the grouped output, the compressors, router, shared and k routed
// experts, unembedding; the indexer's small projections are not counted),
// plus the attention over the keys a query sees on average (the window, and
// the compressed entries or the indexer's top-k of them).
double v4_step_flops(const V4Config& c, int64_t batch, int64_t seq, int64_t grad_accum = 1);
double v4_forward_flops(const V4Config& c, int64_t batch, int64_t seq, int64_t head_rows);

}  // namespace ds::model
