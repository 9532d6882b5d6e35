// Speculative decoding with the model's own MTP layer (DeepSeek-V3's
// multi-token prediction module, depth 1): each step the MTP layer drafts
// the token after next from the last hidden state, and one step of the main
// model over [next, draft] checks it through the KV cache (the decode path:
// two rows a sequence instead of one). A draft the model agrees with gives
// two tokens for one read of the weights; a rejected one is dropped from
// the cache (Decoder::truncate).
//
// With K draft tokens (--draft-tokens) the MTP layer is chained as vLLM and
// SGLang chain DeepSeek's one module: draft j + 1 reads draft j and the MTP
// layer's own hidden state there in place of the model's (Decoder::
// draft_more); the model checks [next, d1 .. dK] in one step, the rule
// keeps drafts in order up to the first it replaces, and the chain's rows
// leave the MTP layer's cache (Decoder::drop_links) before the model's own
// hidden states of the kept positions replace them.
//
// The acceptance rule is the standard speculative-sampling one (Leviathan
// et al. 2023; Chen et al. 2023): with p the model's sampling distribution
// at the draft's position and q the MTP layer's, the draft d (drawn from q)
// is kept with probability min(1, p(d) / q(d)); else the token is drawn
// from max(0, p - q), renormalised; after a kept draft the next token is
// drawn from the model's next row. Every token is then distributed as
// plain sampling from the model would draw it. Greedy decoding is the case
// of one-hot p and q: the draft is kept when it is the model's argmax, so
// greedy output is the plain loop's, token for token, as long as a
// two-row step gives the one-row step's logits bits.
//
// The MTP layer reads every position the model keeps: the prompt's (as it
// is read) and each accepted token's, so its own cache never holds a
// rejected draft (nor, past a step, a chained one).
#pragma once

#include <cstdint>
#include <vector>

#include "infer/generate.h"

namespace ds::infer {

// generate() with opt.draft_tokens > 0 (the caller checked the options).
std::vector<std::vector<int32_t>> generate_speculative(Decoder& model, const std::vector<std::vector<int32_t>>& prompts,
                                                       const GenerateOptions& opt, GenerateStats* stats);

// One speculative decision: p the model's row at the draft's position, q
// the MTP layer's, draft the drafted id, u_accept and u_resample uniform in
// [0, 1). Returns the draft when kept, else the id drawn from max(0, p - q).
int32_t accept_or_resample(const std::vector<double>& p, const std::vector<double>& q, int32_t draft, double u_accept,
                           double u_resample, bool* accepted);

}  // namespace ds::infer
