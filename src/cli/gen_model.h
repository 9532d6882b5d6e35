// A model folder of either family for the commands that generate
// (generate, bench, serve): the V2/V3 engine with its KV cache, or
// DeepSeek-V4 with its per-sequence state, behind the generation loop.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "infer/engine.h"
#include "infer/generate.h"
#include "infer/v4_engine.h"
#include "model/config.h"
#include "model/load.h"

namespace ds::cli {

inline infer::CacheKind cache_kind(const std::string& s) {
  return s == "naive" ? infer::CacheKind::Naive : infer::CacheKind::Latent;
}

struct GenModel {
  bool v4 = false;
  model::ModelConfig cfg;  // V2/V3
  model::V4Config v4cfg;
  std::unique_ptr<infer::LoadedModel> m;
  std::unique_ptr<infer::LoadedV4Model> m4;
  std::unique_ptr<infer::V4Decoder> decoder;

  static GenModel config_of(const std::string& dir) {
    GenModel g;
    g.v4 = infer::is_v4_folder(dir);
    if (g.v4)
      g.v4cfg = infer::load_v4_config(dir);
    else
      g.cfg = model::load_config(dir);
    return g;
  }
  int64_t vocab_size() const { return v4 ? v4cfg.vocab_size : cfg.vocab_size; }
  int64_t eos_token_id() const { return v4 ? v4cfg.eos_token_id : cfg.eos_token_id; }
  int64_t max_positions() const { return v4 ? v4cfg.max_position_embeddings : cfg.max_position_embeddings; }
  void check(const std::vector<int64_t>& lengths, const infer::GenerateOptions& opt) const {
    if (v4)
      infer::check_v4_request(v4cfg, lengths, opt);
    else
      infer::check_generate_request(cfg, lengths, opt);
  }
  void load(const std::string& dir) {
    if (v4) {
      m4 = infer::load_v4_model(dir);
      decoder = std::make_unique<infer::V4Decoder>(*m4->model);
    } else {
      m = infer::load_model(dir);
    }
  }
  // A decoder of its own over the loaded model (`kind` applies to V2/V3).
  std::unique_ptr<infer::Decoder> new_decoder(infer::CacheKind kind) {
    if (v4) return std::make_unique<infer::V4Decoder>(*m4->model);
    return infer::kv_decoder(*m->engine, kind);
  }
  void generate(const std::vector<std::vector<int32_t>>& prompts, const infer::GenerateOptions& opt,
                infer::GenerateStats* st = nullptr) {
    if (v4)
      infer::generate(*decoder, prompts, opt, st);
    else
      infer::generate(*m->engine, prompts, opt, st);
  }
};

}  // namespace ds::cli
