// `deepseek logits --model DIR --tokens FILE.json --out FILE.safetensors
//  [--incremental PREFIX] [--kv-cache latent|naive]`
//
// FILE.json is a JSON array of token-id arrays. The output holds float32
// `logits.<i>` [seq_i, vocab] per sequence. Without --incremental every
// sequence is one full forward; with it the first PREFIX tokens are prefilled
// and every later position goes through the KV cache one token at a time.
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/load.h"

namespace ds::cli {

namespace {

struct LogitsArgs {
  std::string model, tokens, out, cache = "latent";
  int64_t incremental = -1;
};

std::vector<std::vector<int32_t>> read_token_lists(const std::string& path) {
  std::ifstream in(path);
  DS_CHECK(in.good(), "cannot read token file '{}'", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    DS_FAIL("'{}' is not valid JSON: {}", path, e.what());
  }
  DS_CHECK(j.is_array() && !j.empty(), "'{}' must be a non-empty JSON array of token-id arrays", path);
  std::vector<std::vector<int32_t>> out;
  for (const auto& seq : j) {
    DS_CHECK(seq.is_array() && !seq.empty(), "'{}': every sequence must be a non-empty array of token ids", path);
    std::vector<int32_t> ids;
    for (const auto& t : seq) {
      DS_CHECK(t.is_number_integer() && t.get<int64_t>() >= 0 && t.get<int64_t>() <= INT32_MAX,
               "'{}': token ids must be non-negative integers, got {}", path, t.dump());
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    out.push_back(std::move(ids));
  }
  return out;
}

int run_logits(const LogitsArgs& a) {
  auto seqs = read_token_lists(a.tokens);
  auto m = model::load_model(a.model);
  const int64_t V = m->config.vocab_size, L = m->config.num_hidden_layers;
  const auto kind = a.cache == "naive" ? infer::CacheKind::Naive : infer::CacheKind::Latent;
  std::vector<std::pair<std::string, Tensor>> outs;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const auto& ids = seqs[s];
    const int64_t T = static_cast<int64_t>(ids.size());
    infer::KvCache cache(kind, 1, L);
    std::vector<float> logits;
    if (a.incremental < 0) {
      logits = m->transformer->step(cache, {ids}, /*all_logits=*/true);
    } else {
      DS_CHECK(a.incremental >= 1 && a.incremental <= T, "--incremental {} must be in [1, {}] for sequence {}",
               a.incremental, T, s);
      logits = m->transformer->step(cache, {{ids.begin(), ids.begin() + a.incremental}}, true);
      for (int64_t t = a.incremental; t < T; ++t) {
        auto one = m->transformer->step(cache, {{ids[t]}}, true);
        logits.insert(logits.end(), one.begin(), one.end());
      }
    }
    Tensor t = Tensor::from_vector(logits, {T, V});
    outs.emplace_back(fmt::format("logits.{}", s), t);
  }
  io::save_safetensors(a.out, outs, {{"model", a.model}});
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
  cmd->add_option("--incremental", args->incremental,
                  "prefill this many tokens, then compute each later position through the KV cache");
  cmd->add_option("--kv-cache", args->cache, "KV cache: latent (default) or naive")
      ->check(CLI::IsMember({"latent", "naive"}));
  commands.emplace_back(cmd, [args] { return run_logits(*args); });
}

}  // namespace ds::cli
