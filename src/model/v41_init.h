// A randomly initialised DeepSeek-V4.1 model folder (`deepseek init` of a
// deepseek_v41 config.json) in the release's own formats, as DeepSeek ships
// Flash: e4m3 projections with an e8m0 scale per 32 x 32 block, routed
// experts as packed e2m1 with an e8m0 scale per 32 inputs, Engram tables as
// e4m3 rows with an e8m0 scale per 32 columns, bf16 norms, embedding and
// head, float32 mHC mixes, sinks and router biases. Matrices are normal(0,
// 1 / sqrt(in)) (the embedding and the tables normal(0, 1)), norms 1, the
// mHC mixes' fn normal(0, 0.01) with scale 1 and base 0; one Philox stream
// per tensor, so the folder depends on the seed only.
//
// The Engram tables are written a chunk of rows at a time (a preset with
// tables of many GB needs no more memory than their scales); their sizes
// are the primes' sums for the tokenizer's class count, which replaces the
// config's engram_compressed_vocab_size. The tokenizer is copied into the
// folder.
#pragma once

#include <cstdint>
#include <string>

#include "model/v4_config.h"

namespace ds::model {

void write_random_v41(const V4Config& cfg, const std::string& dir, uint64_t seed, const std::string& tokenizer_json);

}  // namespace ds::model
