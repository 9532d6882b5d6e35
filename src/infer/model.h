// A model folder of any family behind one face for the commands that
// generate or score (generate, bench, serve, logits): its config is read
// and checked first (open_model), the weights only on load(), so a bad
// request fails before any weight is read.
//
// The families own their caches: DeepSeek-V2/V3/V3.2 run on the engine with
// its KV cache (infer/engine.h), DeepSeek-V4 on its per-sequence state
// (infer/v4_engine.h). Everything above this interface is the same code.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "infer/generate.h"

namespace ds::infer {

struct ModelOptions {
  // DeepSeek-V4: the fp8/fp4 roundings of DeepSeek's inference code (false:
  // Hugging Face's arithmetic). Other families have no such roundings.
  bool quant_sim = true;
  // Load the checkpoint's MTP layer for speculative decoding (infer/speculative.h).
  bool mtp = false;
  // DeepSeek-V4.1: decode as DeepSeek's released inference code does
  // (model/v4_model.h, V4Options::late_index_keys), not as the model was trained.
  bool late_index_keys = false;
};

class Model {
 public:
  virtual ~Model() = default;

  // From the config alone.
  virtual int64_t vocab_size() const = 0;
  virtual int64_t eos_token_id() const = 0;
  virtual int64_t max_positions() const = 0;
  // check_generate_options, then the caches of every sequence at its
  // longest (prompt plus new tokens) against this machine's memory.
  virtual void check(const std::vector<int64_t>& prompt_lengths, const GenerateOptions& opt) const = 0;
  // What the cache of `kind` is called in reports ("latent", "naive", ...).
  virtual std::string cache_name(CacheKind kind) const = 0;
  // The attention it runs ("mla", "sparse", "dense", "deepseek_v4").
  virtual std::string attention_name() const = 0;
  // Model FLOPs of a forward pass over batch x seq tokens with the head on
  // head_rows rows (MaxText's accounting, model/flops.h).
  virtual double forward_flops(int64_t batch, int64_t seq, int64_t head_rows) const = 0;
  // DeepSeek-V3.2: attention over every key with the indexer off. ds::Error
  // for a model without an indexer.
  virtual void set_dense_attention(bool dense) = 0;

  // Reads and checks the weights.
  virtual void load() = 0;
  // After load(): a decoder of its own over the loaded weights.
  virtual std::unique_ptr<Decoder> new_decoder(CacheKind kind) = 0;
  // The logits [T, vocab] of every position of one sequence: its first
  // `prefix` tokens in one step (0: all of them), then one token a step.
  // With `mtp` and prefix 0, a model with an MTP layer also gives that
  // layer's logits [T - 1, vocab] there (left empty otherwise).
  virtual std::vector<float> logits(const std::vector<int32_t>& ids, int64_t prefix, CacheKind kind,
                                    std::vector<float>* mtp) = 0;

  // After load(): generate() (infer/generate.h) over a decoder of opt.cache.
  virtual std::vector<std::vector<int32_t>> generate(const std::vector<std::vector<int32_t>>& prompts,
                                                     const GenerateOptions& opt, GenerateStats* stats = nullptr) = 0;
};

// "naive" or "latent" (the --kv-cache values).
inline CacheKind cache_kind(const std::string& s) { return s == "naive" ? CacheKind::Naive : CacheKind::Latent; }

// The folder's config.json, checked; the family from its model_type.
std::unique_ptr<Model> open_model(const std::string& dir, const ModelOptions& opt = {});

// What --model names, as a folder: the folder itself, or for a GGUF file
// (llama.cpp's deepseek2; model/gguf_import.h) a temporary folder it is
// read into once per process (float32 weights, config.json, tokenizer),
// removed when the program exits.
std::string model_folder(const std::string& path);

}  // namespace ds::infer
