// `deepseek logits --model DIR --tokens FILE.json --out FILE.safetensors
//  [--incremental PREFIX] [--kv-cache latent|naive] [--no-quant-sim]`
//
// FILE.json is a JSON array of token-id arrays. The output holds float32
// `logits.<i>` [seq_i, vocab] per sequence. Without --incremental every
// sequence is one full forward; with it the first PREFIX tokens are prefilled
// and every later position goes through the KV cache one token at a time.
// A DeepSeek-V4 folder runs on its own attention state; --no-quant-sim turns
// off its fp8/fp4 roundings of DeepSeek's inference code (Hugging Face's
// arithmetic). A V4 folder with its MTP layer also gets `mtp_logits.<i>`
// [seq_i - 1, vocab] (row t: the draft for token t + 2) without --incremental.
#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "core/system.h"
#include "infer/generate.h"
#include "infer/v4_engine.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/text_input.h"
#include "io/token_lists.h"
#include "model/load.h"

namespace ds::cli {

namespace {

struct LogitsArgs {
  std::string model, tokens, out, cache = "latent";
  int64_t incremental = 0;
  CLI::Option* incremental_opt = nullptr;  // given or not
  bool no_quant_sim = false;
};

// The checks every sequence passes before any weight is read, for a model
// of `vocab` ids: the --incremental prefix and the memory of the logits.
int64_t check_logits_request(const LogitsArgs& a, const std::vector<int64_t>& lengths, int64_t vocab) {
  const bool incremental = a.incremental_opt != nullptr && a.incremental_opt->count() > 0;
  int64_t tokens = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    if (incremental)
      DS_CHECK(a.incremental >= 1 && a.incremental <= lengths[s], "--incremental {} must be in [1, {}] for sequence {}",
               a.incremental, lengths[s], s);
    tokens += lengths[s];
  }
  // The logits are kept until the file is written.
  check_fits_in_memory(tokens * vocab * static_cast<int64_t>(sizeof(float)), "the logits of these sequences");
  return incremental ? a.incremental : 0;
}

int run_logits_v4(const LogitsArgs& a, const std::string& out) {
  const model::V4Config cfg = infer::load_v4_config(a.model);
  const auto seqs = io::parse_token_lists(io::read_file(a.tokens, "token file"), cfg.vocab_size, a.tokens);
  std::vector<int64_t> lengths;
  for (const auto& ids : seqs) lengths.push_back(static_cast<int64_t>(ids.size()));
  infer::GenerateOptions request;
  request.max_new_tokens = 1;
  infer::check_v4_request(cfg, lengths, request, /*codes=*/!a.no_quant_sim);
  const int64_t prefix = check_logits_request(a, lengths, cfg.vocab_size);
  auto m = infer::load_v4_model(a.model, model::V4Options{!a.no_quant_sim});
  std::vector<std::pair<std::string, Tensor>> outs;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const auto& ids = seqs[s];
    const int64_t T = lengths[s];
    model::V4State st = m->model->new_state();
    std::vector<float> logits;
    if (prefix == 0 && m->config.num_nextn_predict_layers == 1 && T >= 2) {
      // A whole sequence of a model with its MTP layer: its logits too.
      std::vector<float> mtp;
      logits = m->model->forward({{&st, ids.data(), T}}, true, nullptr, &mtp);
      outs.emplace_back(fmt::format("mtp_logits.{}", s), Tensor::from_vector(mtp, {T - 1, cfg.vocab_size}));
    } else {
      logits = m->model->forward(st, ids.data(), prefix > 0 ? prefix : T, true);
    }
    for (int64_t t = prefix > 0 ? prefix : T; t < T; ++t) {
      auto one = m->model->forward(st, ids.data() + t, 1, true);
      logits.insert(logits.end(), one.begin(), one.end());
    }
    outs.emplace_back(fmt::format("logits.{}", s), Tensor::from_vector(logits, {T, cfg.vocab_size}));
  }
  io::save_safetensors(out, outs, {{"model", a.model}});
  fmt::print("wrote {} sequences of logits to {}\n", seqs.size(), a.out);
  return 0;
}

int run_logits(const LogitsArgs& a) {
  // The request is checked whole before any weight is read: the output
  // path, the token file against the config, the --incremental prefix.
  const std::string out = io::resolve_output_path(a.out);
  if (infer::is_v4_folder(a.model)) return run_logits_v4(a, out);
  DS_CHECK(!a.no_quant_sim, "--no-quant-sim applies to DeepSeek-V4 models only");
  const model::ModelConfig cfg = model::load_config(a.model);
  const auto seqs = io::parse_token_lists(io::read_file(a.tokens, "token file"), cfg.vocab_size, a.tokens);
  const int64_t V = cfg.vocab_size, L = cfg.num_hidden_layers;
  const auto kind = a.cache == "naive" ? infer::CacheKind::Naive : infer::CacheKind::Latent;
  // The sequences as a request of one new token each: the same length and
  // KV-cache checks as generation.
  std::vector<int64_t> lengths;
  for (const auto& ids : seqs) lengths.push_back(static_cast<int64_t>(ids.size()));
  infer::GenerateOptions request;
  request.max_new_tokens = 1;
  request.cache = kind;
  infer::check_generate_request(cfg, lengths, request);
  const bool incremental = check_logits_request(a, lengths, V) > 0;

  auto m = infer::load_model(a.model);
  std::vector<std::pair<std::string, Tensor>> outs;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const auto& ids = seqs[s];
    const int64_t T = static_cast<int64_t>(ids.size());
    infer::KvCache cache(kind, 1, L);
    std::vector<float> logits;
    if (!incremental) {
      logits = m->engine->step(cache, {ids}, /*all_logits=*/true);
    } else {
      logits = m->engine->step(cache, {{ids.begin(), ids.begin() + a.incremental}}, true);
      for (int64_t t = a.incremental; t < T; ++t) {
        auto one = m->engine->step(cache, {{ids[t]}}, true);
        logits.insert(logits.end(), one.begin(), one.end());
      }
    }
    Tensor t = Tensor::from_vector(logits, {T, V});
    outs.emplace_back(fmt::format("logits.{}", s), t);
  }
  io::save_safetensors(out, outs, {{"model", a.model}});
  fmt::print("wrote {} sequences of logits to {}\n", seqs.size(), a.out);
  return 0;
}

}  // namespace

void add_logits_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<LogitsArgs>();
  auto* cmd = app.add_subcommand("logits", "compute the logits of token sequences and save them as safetensors");
  cmd->add_option("--model", args->model, "Hugging Face model folder")->required();
  cmd->add_option("--tokens", args->tokens, "JSON array of token-id arrays")->required();
  cmd->add_option("--out", args->out, "output .safetensors file")->required();
  args->incremental_opt =
      cmd->add_option("--incremental", args->incremental,
                      "prefill this many tokens (>= 1), then compute each later position through the KV cache");
  cmd->add_option("--kv-cache", args->cache, "KV cache: latent (default) or naive")
      ->check(CLI::IsMember({"latent", "naive"}));
  cmd->add_flag("--no-quant-sim", args->no_quant_sim,
                "DeepSeek-V4: skip the fp8/fp4 roundings of DeepSeek's inference code (Hugging Face's arithmetic)");
  commands.emplace_back(cmd, [args] { return run_logits(*args); });
}

}  // namespace ds::cli
