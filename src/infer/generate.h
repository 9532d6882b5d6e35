// Autoregressive generation over a batch of prompts with a KV cache: the
// prompts are prefilled (in steps of at most prefill_chunk tokens), then one
// decode step per new token runs for the sequences still going. Tokens are
// handed to a callback as they are made.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "infer/engine.h"
#include "infer/kv_cache.h"
#include "infer/sampler.h"

namespace ds::infer {

// Sequences one generate() call takes at most.
inline constexpr int64_t kMaxSequences = int64_t{1} << 16;

// Draft tokens a speculative step at most (--draft-tokens).
inline constexpr int64_t kMaxDraftTokens = 8;

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  SamplerConfig sampler;
  CacheKind cache = CacheKind::Latent;
  int64_t eos_token_id = -1;  // < 0: never stop early
  // Sample only ids below this (0: the whole vocabulary). Checkpoints pad
  // their vocabulary beyond the tokenizer's ids; those rows are never drawn.
  int64_t sample_vocab = 0;
  std::function<void(int64_t sequence, int32_t token)> on_token;
  // Prompt tokens per prefill step, over all sequences (0: all in one step).
  // Bounds the activation memory of long prompts and big batches; a prompt
  // longer than this continues from its cache in the next step.
  int64_t prefill_chunk = 512;
  // Speculative decoding (infer/speculative.h): the model's MTP layer
  // drafts this many tokens a step, which one step of the model checks
  // (0: off; 1 is the one depth supported).
  int64_t draft_tokens = 0;
};

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  size_t cache_bytes = 0;
  double prefill_tokens_per_second() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0; }
  double decode_tokens_per_second() const;
  int64_t decode_steps_tokens = 0;    // tokens produced by decode steps (excludes the first, from prefill)
  int64_t drafted = 0, accepted = 0;  // speculative decoding: draft tokens checked, and kept
  // ... by position in the chain (index 0: the first draft of a step).
  std::vector<int64_t> drafted_at, accepted_at;
  double acceptance() const { return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0; }
};

// Elements a position holds in each row list of a cache of `kind` (the
// indexer's keys with `indexer`, for DeepSeek-V3.2 models).
RowWidths cache_row_widths(const model::ModelConfig& cfg, CacheKind kind, bool indexer);
// Bytes the KV cache of `kind` holds per token (all layers).
int64_t kv_cache_bytes_per_token(const model::ModelConfig& cfg, CacheKind kind);

// Everything about a request that can be checked before any weight is read:
// the options, each prompt against max_position_embeddings, and the KV cache
// against this machine's memory. generate() calls it first;
// programs call it before they load a model.
void check_generate_request(const model::ModelConfig& cfg, const std::vector<int64_t>& prompt_lengths,
                            const GenerateOptions& opt);

// Returns the new tokens of every sequence (EOS included when produced).
std::vector<std::vector<int32_t>> generate(infer::Engine& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& opt, GenerateStats* stats = nullptr);

// A sequence's cache or state taken out of a decoder when its request ends
// (Decoder::take_snapshot), kept by the prefix cache (infer/prefix_cache.h)
// and copied into later sequences that start with the same tokens.
class CacheSnapshot {
 public:
  virtual ~CacheSnapshot() = default;
  virtual int64_t length() const = 0;  // positions held
  virtual size_t bytes() const = 0;    // allocated
};

// What the generation loop drives: a set of sequences that take new tokens
// and give the logits of each one's last token. Called from one thread at a
// time; decoders over one engine or V4 model share it, and so that thread. The V2/V3 engine over a KV
// cache is one (the overload above); DeepSeek-V4 (infer/v4_engine.h) another.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_positions() const = 0;
  // Drops every sequence and starts `sequences` empty ones.
  virtual void start(int64_t sequences) = 0;
  // Empties sequence s (its cache or state freed), leaving the others as
  // they are: the next tokens it receives start a new sequence there.
  virtual void reset(int64_t sequence) = 0;
  // Appends tokens[s] to sequence s (any may be empty); one row of logits
  // [vocab] per sequence that received tokens, in order.
  virtual std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) = 0;
  // As step(), with a row of logits for every new token (sequence by
  // sequence, in order): the server's prompt log-probabilities. A decoder
  // that cannot give them throws ds::Error.
  virtual std::vector<float> step_all(const std::vector<std::vector<int32_t>>& tokens);
  virtual int64_t length(int64_t sequence) const = 0;
  virtual size_t cache_bytes() const = 0;
  // Makes sequence `to` a copy of sequence `from` (its cache or state), so
  // that both continue from the same tokens: the choices of one request
  // read their prompt once. A decoder that cannot throws ds::Error.
  virtual void copy(int64_t from, int64_t to);

  // Speculative decoding with the model's MTP layer (infer/speculative.h);
  // the defaults throw ds::Error. Whether the MTP layer is loaded:
  virtual bool can_draft() const { return false; }
  // As step() (all_logits: as step_all()), keeping each new token's hidden
  // state for draft().
  virtual std::vector<float> step_keep(const std::vector<std::vector<int32_t>>& tokens, bool all_logits);
  // The MTP layer over each sequence's oldest kept positions: next[s] the
  // tokens that follow them (at most as many as are kept), which it then
  // drops. One row of MTP logits per sequence with tokens, in order.
  virtual std::vector<float> draft(const std::vector<std::vector<int32_t>>& next);
  // The next link of a chain of drafts: the MTP layer once more, over
  // tokens[s] (the draft just made; -1: none) and its own last hidden state
  // in place of the model's, one position past the last. One row of MTP
  // logits per sequence with a token, in order. The links stay in the MTP
  // layer's cache until drop_links().
  virtual std::vector<float> draft_more(const std::vector<int32_t>& tokens);
  // Drops every chained link from the MTP layer's cache: the model's own
  // hidden states replace them at the next draft().
  virtual void drop_links();
  // Drops sequence s's tokens from `length` on (a rejected draft) and their
  // kept hidden states.
  virtual void truncate(int64_t sequence, int64_t length);

  // The cache pool (BatcherOptions::cache_memory). Bytes sequence s's
  // buffers have allocated now, and will have once n more tokens are
  // appended (with speculative decoding: read, drafted after and checked).
  // The defaults count nothing.
  virtual size_t sequence_bytes(int64_t /*sequence*/) const { return 0; }
  virtual size_t bytes_after(int64_t /*sequence*/, int64_t /*n*/) const { return 0; }
  // The most a sequence of at most `tokens` positions allocates once
  // limit_length(tokens) is set: what decides how long a sequence the pool
  // can hold at all.
  virtual size_t bytes_for(int64_t /*tokens*/) const { return 0; }
  // Sequences hold at most `tokens` positions from now on (their buffers
  // never grow past what that needs).
  virtual void limit_length(int64_t /*tokens*/) {}

  // Prefix caching (infer/prefix_cache.h). Moves sequence s's cache out
  // (the sequence is left empty, as after reset); null for a decoder that
  // cannot, or a sequence it cannot take now.
  virtual std::shared_ptr<const CacheSnapshot> take_snapshot(int64_t /*sequence*/) { return nullptr; }
  // The longest length <= want that `snap` can be restored to (0: none):
  // a cache that can be cut at any position gives want.
  virtual int64_t restorable(const CacheSnapshot& /*snap*/, int64_t /*want*/) const { return 0; }
  // Makes empty sequence s the first `length` positions of snap (a length
  // restorable() gave), allocating at most bytes_for(length).
  virtual void restore(int64_t sequence, const CacheSnapshot& snap, int64_t length);
  // With the MTP layer: the positions of sequence s it has read (after a
  // restore, the tokens that follow the others are for the next draft()).
  virtual int64_t drafted(int64_t /*sequence*/) const { return 0; }
};

// The V2/V3 engine over a KV cache of `kind`, as a Decoder.
std::unique_ptr<Decoder> kv_decoder(Engine& engine, CacheKind kind);

// The request checks of check_generate_request that need no model config
// (options, prompt count, lengths against max_positions), then the loop.
// The caller checks memory.
std::vector<std::vector<int32_t>> generate(Decoder& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& opt, GenerateStats* stats = nullptr);
void check_generate_options(int64_t vocab_size, int64_t max_positions, const std::vector<int64_t>& prompt_lengths,
                            const GenerateOptions& opt);

// A prefill step of the generation loops: prompts[s] from fed[s] on, taken
// in order from `lead` (every earlier prompt is read), at most `chunk`
// tokens in all (0: no limit). The caller advances fed.
std::vector<std::vector<int32_t>> prefill_part(const std::vector<std::vector<int32_t>>& prompts,
                                               const std::vector<size_t>& fed, int64_t lead, int64_t chunk);

}  // namespace ds::infer
