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
#include "infer/model.h"
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
  bool late_index_keys = false;
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

int run_logits(const LogitsArgs& given) {
  LogitsArgs a = given;
  a.model = infer::model_folder(a.model);
  // The request is checked whole before any weight is read: the output
  // path, the token file against the config, the --incremental prefix.
  const std::string out = io::resolve_output_path(a.out);
  infer::ModelOptions mo;
  mo.quant_sim = !a.no_quant_sim;
  mo.late_index_keys = a.late_index_keys;
  const auto m = infer::open_model(a.model, mo);
  const int64_t V = m->vocab_size();
  const auto seqs = io::parse_token_lists(io::read_file(a.tokens, "token file"), V, a.tokens);
  const auto kind = infer::cache_kind(a.cache);
  // The sequences as a request of one new token each: the same length and
  // cache checks as generation.
  std::vector<int64_t> lengths;
  for (const auto& ids : seqs) lengths.push_back(static_cast<int64_t>(ids.size()));
  infer::GenerateOptions request;
  request.max_new_tokens = 1;
  request.cache = kind;
  m->check(lengths, request);
  const int64_t prefix = check_logits_request(a, lengths, V);

  m->load();
  std::vector<std::pair<std::string, Tensor>> outs;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t T = lengths[s];
    std::vector<float> mtp;
    auto logits = m->logits(seqs[s], prefix, kind, &mtp);
    if (!mtp.empty()) outs.emplace_back(fmt::format("mtp_logits.{}", s), Tensor::from_vector(mtp, {T - 1, V}));
    outs.emplace_back(fmt::format("logits.{}", s), Tensor::from_vector(logits, {T, V}));
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
  cmd->add_flag("--late-index-keys", args->late_index_keys,
                "DeepSeek-V4.1: decode as DeepSeek's released inference code does, where a ratio-2 layer whose pair is "
                "still open scores the index keys another layer published last (default: each layer its own "
                "source's keys, as the model was trained)");
  commands.emplace_back(cmd, [args] { return run_logits(*args); });
}

}  // namespace ds::cli
