// `deepseek perplexity --model DIR (--data FILE | --tokens FILE.json |
//  --corpus DIR [--split eval]) [--ctx 512] [--chunks N] [--prefill N] [--json]`
//
// Token-level perplexity over a text (tokenized whole with the model's
// tokenizer, its BOS first when it has one, one final newline dropped as
// llama-perplexity's -f drops it), a token file (a JSON array of
// token-id arrays, joined in order) or a corpus written by `deepseek
// prepare` (one split's documents joined in order), computed as llama.cpp's
// llama-perplexity computes it (infer/perplexity.h): chunks of --ctx tokens,
// each from position 0 with its first token replaced by the BOS, the second
// half of each scored. With --prefill N, each chunk's first N tokens are
// read in one step and the rest one token a step, through the decode
// kernels generation runs (whose q4_k products round x to 8 bits): the
// perplexity a generating user gets. Prints the running value per chunk on
// stderr as llama-perplexity does ("[1]12.3456,[2]..."), then on stdout its final
// line ("Final estimate: PPL = ... +/- ...") or, with --json, one JSON
// object.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/commands.h"
#include "core/error.h"
#include "core/system.h"
#include "infer/model.h"
#include "infer/perplexity.h"
#include "io/text_input.h"
#include "io/token_lists.h"
#include "io/token_shards.h"
#include "io/tokenizer.h"

namespace ds::cli {

namespace {

struct PerplexityArgs {
  std::string model, data, tokens, corpus, split = "eval";
  int64_t ctx = 512, chunks = -1, prefill = 0;
  bool json = false, no_quant_sim = false;
};

// The token stream and the BOS a chunk starts with.
std::vector<int32_t> read_stream(const PerplexityArgs& a, int64_t vocab, std::optional<int32_t>& bos) {
  const int given = !a.data.empty() + !a.tokens.empty() + !a.corpus.empty();
  DS_CHECK(given == 1, "perplexity: give one of --data, --tokens and --corpus");
  const std::string tok_path = a.model + "/tokenizer.json";
  std::error_code ec;
  std::optional<io::Tokenizer> tok;
  if (std::filesystem::is_regular_file(tok_path, ec)) {
    tok = io::Tokenizer::from_file(tok_path);
    bos = tok->bos_id();
  }
  std::vector<int32_t> ids;
  if (!a.data.empty()) {
    DS_CHECK(tok, "perplexity: --data needs the model folder's tokenizer.json");
    std::string text = io::read_file(a.data, "data file");
    io::check_utf8(text, a.data.c_str());
    // llama-perplexity's -f drops one final newline: the same file gives the
    // same tokens in both.
    if (!text.empty() && text.back() == '\n') text.pop_back();
    ids = tok->encode(text, /*add_special_tokens=*/true);
  } else if (!a.tokens.empty()) {
    for (const auto& seq : io::parse_token_lists(io::read_file(a.tokens, "token file"), vocab, a.tokens))
      ids.insert(ids.end(), seq.begin(), seq.end());
  } else {
    DS_CHECK(a.split == "eval" || a.split == "train", "perplexity: --split must be eval or train, got '{}'", a.split);
    const io::TokenSplit split = io::TokenSplit::open(a.corpus, a.split, vocab);
    for (uint64_t d = 0; d < split.num_documents(); ++d)
      for (const uint32_t t : split.document(d)) ids.push_back(static_cast<int32_t>(t));
    if (!bos) bos = split.meta().bos_id;
  }
  for (const int32_t t : ids)
    DS_CHECK(t >= 0 && t < vocab, "perplexity: token id {} is outside the model's vocabulary of {}", t, vocab);
  return ids;
}

int run_perplexity(const PerplexityArgs& given) {
  PerplexityArgs a = given;
  a.model = infer::model_folder(a.model);
  infer::ModelOptions mo;
  mo.quant_sim = !a.no_quant_sim;
  const auto m = infer::open_model(a.model, mo);
  const int64_t V = m->vocab_size();
  infer::PerplexityOptions opt;
  opt.ctx = a.ctx;
  opt.chunks = a.chunks;
  const std::vector<int32_t> ids = read_stream(a, V, opt.bos);
  // A chunk as a request of one new token: the model's length and cache checks.
  infer::GenerateOptions request;
  request.max_new_tokens = 1;
  DS_CHECK(a.ctx >= 4 && a.ctx < m->max_positions(), "perplexity: --ctx {} must be in [4, {}) for this model", a.ctx,
           m->max_positions());
  DS_CHECK(a.prefill >= 0 && a.prefill <= a.ctx, "perplexity: --prefill {} must be in [0, --ctx {}]", a.prefill, a.ctx);
  m->check({a.ctx}, request);
  check_fits_in_memory(a.ctx * V * static_cast<int64_t>(sizeof(float)), "the logits of one chunk");
  m->load();
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = infer::perplexity(
      ids, opt, V,
      [&](const std::vector<int32_t>& chunk) { return m->logits(chunk, a.prefill, infer::CacheKind::Latent, nullptr); },
      [](int64_t i, double ppl) { fmt::print(stderr, "[{}]{:.4f},", i, ppl); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(stderr, "\nperplexity: {} chunks of {} tokens, {} tokens scored, {:.1f} s\n", r.chunks, a.ctx, r.scored,
             seconds);
  if (a.json) {
    const nlohmann::json j = {
        {"ppl", r.ppl},      {"ppl_error", r.ppl_error}, {"mean_nll", r.mean_nll}, {"chunks", r.chunks},
        {"ctx", a.ctx},      {"scored", r.scored},       {"prefill", a.prefill},   {"tokens", ids.size()},
        {"seconds", seconds}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("Final estimate: PPL = {:.4f} +/- {:.5f}\n", r.ppl, r.ppl_error);
  }
  return 0;
}

}  // namespace

void add_perplexity_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<PerplexityArgs>();
  auto* cmd = app.add_subcommand("perplexity", "perplexity of a model over a text, token file or corpus split, "
                                               "chunked as llama.cpp's llama-perplexity");
  cmd->add_option("--model", args->model, "Hugging Face model folder")->required();
  cmd->add_option("--data", args->data, "UTF-8 text file, tokenized whole with the model's tokenizer");
  cmd->add_option("--tokens", args->tokens, "JSON array of token-id arrays, joined in order");
  cmd->add_option("--corpus", args->corpus, "token corpus written by `deepseek prepare`");
  cmd->add_option("--split", args->split, "the corpus split: eval (default) or train");
  cmd->add_option("--ctx", args->ctx, "tokens a chunk (default 512, llama-perplexity's -c)");
  cmd->add_option("--chunks", args->chunks, "chunks at most (default: all)");
  cmd->add_option("--prefill", args->prefill,
                  "tokens of each chunk read in one step (default: all); the rest one a step, through the decode "
                  "kernels");
  cmd->add_flag("--json", args->json, "print one JSON object instead of llama-perplexity's final line");
  cmd->add_flag("--no-quant-sim", args->no_quant_sim,
                "DeepSeek-V4: skip the fp8/fp4 roundings of DeepSeek's inference code");
  commands.emplace_back(cmd, [args] { return run_perplexity(*args); });
}

}  // namespace ds::cli
