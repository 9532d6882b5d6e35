// Model commands:
//   deepseek init --config FILE --out DIR [--seed S] [--dtype bf16|f16|f32|fp8] [--set key=value ...]
//   deepseek generate --model DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
//                     [--top-p P] [--seed S] [--kv-cache latent|naive]
//   deepseek bench --model DIR [--batch B] [--prompt-len P] [--new-tokens N] [--kv-cache latent|naive]
// A DeepSeek-V4 folder (model_type deepseek_v4) runs on its own attention
// state (infer/v4_engine.h); --kv-cache does not apply to it.
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "infer/generate.h"
#include "infer/model.h"
#include "infer/text_stream.h"
#include "io/tokenizer.h"
#include "model/family_kind.h"
#include "model/init.h"
#include "ops/linear.h"

namespace ds::cli {

namespace {

namespace fs = std::filesystem;

// Largest token count an option may give (a model's positions are bounded far
// lower; this keeps arithmetic on counts from overflowing first).
constexpr int64_t kMaxCount = int64_t{1} << 30;

// Peak resident set of this process (file-backed mmapped weights included).
size_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<size_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

// Bytes of the weight files in a model folder.
size_t weight_file_bytes(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".safetensors") n += e.file_size();
  return n;
}

std::string mib(size_t bytes) {
  if (bytes < (1u << 20)) return fmt::format("{:.1f} KiB", bytes / 1024.0);
  return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024.0));
}

// ---- init -----------------------------------------------------------------

struct InitArgs {
  std::string config, out, dtype = "bf16", tokenizer;
  std::vector<std::string> overrides;
  uint64_t seed = 0;
};

// --dtype's names.
const std::pair<const char*, DType> kInitDtypes[] = {
    {"bf16", DType::BF16}, {"f16", DType::F16}, {"f32", DType::F32}, {"fp8", DType::F8E4M3}};

int run_init(const InitArgs& a) {
  const bool yaml = a.config.ends_with(".yml") || a.config.ends_with(".yaml");
  DS_CHECK(yaml || a.overrides.empty(), "--set applies to YAML presets only, not '{}'", a.config);
  // The family a preset's decoder_block or a config.json's model_type names,
  // written as `deepseek export` writes a trained one, with the training
  // run's random initialisation.
  const model::ModelSpec spec =
      yaml ? model::model_from_preset(a.config, a.overrides) : model::model_from_hf_config_file(a.config);
  const auto family = spec.family();
  DType dtype = DType::BF16;
  for (const auto& [name, dt] : kInitDtypes)
    if (a.dtype == name) dtype = dt;
  const auto dtypes = family->init_dtypes();
  if (std::find(dtypes.begin(), dtypes.end(), dtype) == dtypes.end()) {
    std::vector<std::string> can;
    for (const auto& [name, dt] : kInitDtypes)
      if (std::find(dtypes.begin(), dtypes.end(), dt) != dtypes.end()) can.push_back(name);
    std::string list;
    for (size_t i = 0; i < can.size(); ++i) list += (i == 0 ? "" : i + 1 == can.size() ? " or " : ", ") + can[i];
    DS_FAIL("init: --dtype {}: a {} model is written in {} only", a.dtype, family->name(), list);
  }
  family->write_random(a.out, a.seed, model::InitOptions{}.init_std, dtype, a.tokenizer);
  const nlohmann::json root = family->hf_config();
  const nlohmann::json& hf = root.contains("text_config") ? root["text_config"] : root;  // DeepSeek-V4.1 nests it
  fmt::print("wrote a randomly initialised {} model ({} layers, hidden {}, {} routed experts) to {} ({})\n",
             root.value("model_type", ""), hf.value("num_hidden_layers", int64_t{0}),
             hf.value("hidden_size", int64_t{0}), hf.value("n_routed_experts", int64_t{0}), a.out,
             mib(weight_file_bytes(a.out)));
  return 0;
}

// ---- generate -------------------------------------------------------------

struct GenerateArgs {
  std::string model, prompt, tokenizer, cache = "latent";
  int64_t max_new_tokens = 128;
  int64_t prefill_chunk = infer::GenerateOptions{}.prefill_chunk;
  float temperature = 0.7f, top_p = 0.95f;
  int64_t top_k = 0;
  uint64_t seed = 0;
  bool raw = false;
  std::string speculative = "none";
  int64_t draft_tokens = 1;
  bool late_index_keys = false;
};

// --speculative none | mtp: the model options and the generation's draft tokens.
infer::ModelOptions speculative_options(const std::string& mode) {
  DS_CHECK(mode == "none" || mode == "mtp", "--speculative must be none or mtp, got '{}'", mode);
  infer::ModelOptions o;
  o.mtp = mode == "mtp";
  return o;
}

// Each draft position's share kept (position 1: the first draft of a step).
std::vector<double> acceptance_by_position(const infer::GenerateStats& st) {
  std::vector<double> r;
  for (size_t j = 0; j < st.drafted_at.size(); ++j)
    r.push_back(st.drafted_at[j] > 0 ? static_cast<double>(st.accepted_at[j]) / static_cast<double>(st.drafted_at[j])
                                     : 0.0);
  return r;
}

std::string by_position(const infer::GenerateStats& st) {
  if (st.drafted_at.size() < 2) return "";
  std::string s = "; by position";
  const auto r = acceptance_by_position(st);
  for (size_t j = 0; j < r.size(); ++j) s += fmt::format(" {}: {:.1f}%", j + 1, 100 * r[j]);
  return s;
}

int run_generate(const GenerateArgs& given) {
  GenerateArgs a = given;
  a.model = infer::model_folder(a.model);
  // Everything that can be wrong with the request is found before the
  // weights are read: options, tokenizer, prompt length.
  infer::GenerateOptions opt;
  opt.max_new_tokens = a.max_new_tokens;
  opt.prefill_chunk = a.prefill_chunk;
  opt.sampler = {a.temperature, a.top_k, a.top_p, a.seed};
  opt.cache = infer::cache_kind(a.cache);
  auto mo = speculative_options(a.speculative);
  mo.late_index_keys = a.late_index_keys;
  DS_CHECK(a.draft_tokens >= 1 && a.draft_tokens <= infer::kMaxDraftTokens, "--draft-tokens must be in [1, {}], got {}",
           infer::kMaxDraftTokens, a.draft_tokens);
  opt.draft_tokens = mo.mtp ? a.draft_tokens : 0;
  const auto g = infer::open_model(a.model, mo);
  const std::string tok_path = a.tokenizer.empty() ? (fs::path(a.model) / "tokenizer.json").string() : a.tokenizer;
  DS_CHECK(fs::is_regular_file(tok_path), "no tokenizer at '{}' (pass --tokenizer FILE)", tok_path);
  const io::Tokenizer tok = io::Tokenizer::from_file(tok_path);
  DS_CHECK(tok.vocab_size() <= g->vocab_size(), "the tokenizer's {} ids do not fit the model's vocabulary of {}",
           tok.vocab_size(), g->vocab_size());
  const std::vector<int32_t> prompt = tok.encode(a.prompt, /*add_special_tokens=*/!a.raw);
  DS_CHECK(!prompt.empty(), "the prompt encodes to no tokens");
  opt.eos_token_id = g->eos_token_id();
  opt.sample_vocab = tok.vocab_size();
  g->check({static_cast<int64_t>(prompt.size())}, opt);

  g->load();
  infer::TextStream stream(tok, {}, opt.eos_token_id);
  // A closed or full output stops the generation.
  auto print = [](const std::string& text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    check_stdout();
  };
  opt.on_token = [&](int64_t, int32_t id) { print(stream.push(id)); };
  std::fputs(a.prompt.c_str(), stdout);
  check_stdout();
  infer::GenerateStats st;
  g->generate({prompt}, opt, &st);
  print(stream.finish());
  std::fputs("\n", stdout);
  check_stdout();
  std::fprintf(
      stderr, "%s",
      fmt::format("prefill: {} tokens in {:.3f} s ({:.1f} tok/s); decode: {} tokens in {:.3f} s ({:.1f} tok/s)\n"
                  "KV cache ({}): {} for {} tokens; weights {}; peak RSS {}; {} threads\n",
                  st.prompt_tokens, st.prefill_seconds, st.prefill_tokens_per_second(), st.decode_steps_tokens,
                  st.decode_seconds, st.decode_tokens_per_second(), g->cache_name(opt.cache), mib(st.cache_bytes),
                  st.prompt_tokens + st.generated_tokens, mib(weight_file_bytes(a.model)), mib(peak_rss_bytes()),
                  num_threads())
          .c_str());
  if (opt.draft_tokens > 0)
    std::fprintf(stderr, "%s",
                 fmt::format("speculative (mtp): {} of {} drafts accepted ({:.1f}%){}\n", st.accepted, st.drafted,
                             100.0 * st.acceptance(), by_position(st))
                     .c_str());
  return 0;
}

// ---- bench ----------------------------------------------------------------

struct BenchArgs {
  std::string model, cache = "latent";
  int64_t batch = 1, prompt_len = 128, new_tokens = 32, repeat = 3;
  int64_t prefill_chunk = infer::GenerateOptions{}.prefill_chunk;
  uint64_t seed = 0;
  bool dense_attention = false;
  std::string speculative = "none";
  int64_t draft_tokens = 1;
};

int run_bench(const BenchArgs& given) {
  BenchArgs a = given;
  a.model = infer::model_folder(a.model);
  const size_t base_rss = peak_rss_bytes();  // the program and its libraries, before any weight
  const auto mo = speculative_options(a.speculative);
  DS_CHECK(a.draft_tokens >= 1 && a.draft_tokens <= infer::kMaxDraftTokens, "--draft-tokens must be in [1, {}], got {}",
           infer::kMaxDraftTokens, a.draft_tokens);
  const auto g = infer::open_model(a.model, mo);
  DS_CHECK(a.prompt_len + a.new_tokens + 1 <= g->max_positions(),
           "--prompt-len {} + --new-tokens {} exceed max_position_embeddings {}", a.prompt_len, a.new_tokens,
           g->max_positions());
  {
    infer::GenerateOptions check;
    check.cache = infer::cache_kind(a.cache);
    check.prefill_chunk = a.prefill_chunk;
    check.max_new_tokens = a.new_tokens + 1;
    g->check(std::vector<int64_t>(static_cast<size_t>(a.batch), a.prompt_len), check);
  }
  g->set_dense_attention(a.dense_attention);
  g->load();
  const int64_t V = g->vocab_size();
  Philox rng(a.seed);
  std::vector<std::vector<int32_t>> prompts(a.batch);
  for (int64_t s = 0; s < a.batch; ++s)
    for (int64_t i = 0; i < a.prompt_len; ++i)
      prompts[s].push_back(static_cast<int32_t>(rng.u32(static_cast<uint64_t>(s * a.prompt_len + i)) % V));
  infer::GenerateOptions opt;  // greedy, no early stop: every run does the same work
  opt.cache = infer::cache_kind(a.cache);
  opt.prefill_chunk = a.prefill_chunk;
  opt.draft_tokens = mo.mtp ? a.draft_tokens : 0;
  // Warm-up, not timed: the same prompts touch every weight page and grow
  // the allocator's arenas.
  opt.max_new_tokens = 2;
  g->generate(prompts, opt);
  // One token comes from the prefill, then new_tokens decode steps. The
  // median of the repeats is reported for each phase.
  opt.max_new_tokens = a.new_tokens + 1;
  std::vector<double> prefill, decode;
  infer::GenerateStats st;
  for (int64_t r = 0; r < a.repeat; ++r) {
    g->generate(prompts, opt, &st);
    prefill.push_back(st.prefill_tokens_per_second());
    decode.push_back(st.decode_tokens_per_second());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  // Model FLOPs of the prefill per prompt token, by MaxText's accounting
  // (every weight a token meets, causal attention; the unembedding only for
  // the last token of each prompt, the logits a prefill computes), the same
  // figure for any implementation of the model.
  const double prefill_flops =
      g->forward_flops(a.batch, a.prompt_len, a.batch) / static_cast<double>(a.batch * a.prompt_len);
  nlohmann::json j = {
      {"impl", "deepseek.cpp"},
      {"batch", a.batch},
      {"prompt_len", a.prompt_len},
      {"new_tokens", a.new_tokens},
      {"threads", num_threads()},
      {"kv_cache", g->cache_name(opt.cache)},
      {"attention", g->attention_name()},
      {"prefill_chunk", a.prefill_chunk},
      {"matmul_precision", ops::matmul_precision_name(ops::matmul_precision())},
      {"quantized_x", ops::quantized_x() == ops::QuantizedX::kInt8 ? "int8" : "f32"},
      {"bf16_dot_products", ops::matmul_precision() == ops::MatmulPrecision::kBf16 && ops::bf16_dot_products()},
      {"repeat", a.repeat},
      {"prefill_tokens_per_s", median(prefill)},
      {"prefill_model_flops_per_token", prefill_flops},
      {"prefill_gflop_per_s", prefill_flops * median(prefill) * 1e-9},
      {"decode_tokens_per_s", median(decode)},
      {"speculative", a.speculative},
      {"draft_acceptance", st.acceptance()},
      {"draft_tokens", opt.draft_tokens},
      {"draft_acceptance_by_position", acceptance_by_position(st)},
      {"cache_bytes", st.cache_bytes},
      {"weight_file_bytes", weight_file_bytes(a.model)},
      {"base_rss_bytes", base_rss},
      {"peak_rss_bytes", peak_rss_bytes()}};
  fmt::print("{}\n", j.dump());
  return 0;
}

}  // namespace

void add_model_commands(CLI::App& app, CommandList& commands) {
  {
    auto args = std::make_shared<InitArgs>();
    auto* cmd = app.add_subcommand("init", "write a randomly initialised model folder from a config");
    cmd->add_option("--config", args->config, "YAML preset (MaxText key names) or Hugging Face config.json")
        ->required()
        ->check(CLI::ExistingFile);
    cmd->add_option("--out", args->out, "model folder to write")->required();
    cmd->add_option("--seed", args->seed, "initialisation seed");
    cmd->add_option("--dtype", args->dtype,
                    "weight dtype: bf16 (default), f16, f32, or fp8 (e4m3 projections with 128x128 block scales, "
                    "as DeepSeek-V3 ships)")
        ->check(CLI::IsMember({"bf16", "f16", "f32", "fp8"}));
    cmd->add_option("--set", args->overrides, "override a YAML key: key=value (repeatable)");
    cmd->add_option("--tokenizer", args->tokenizer,
                    "tokenizer.json to copy into the folder (needed by DeepSeek-V4.1's Engram layers, whose token "
                    "classes come from it)")
        ->check(CLI::ExistingFile);
    commands.emplace_back(cmd, [args] { return run_init(*args); });
  }
  {
    auto args = std::make_shared<GenerateArgs>();
    auto* cmd = app.add_subcommand("generate", "continue a prompt with a model, streaming the text");
    cmd->add_option("--model", args->model, "Hugging Face model folder (config.json, safetensors, tokenizer.json)")
        ->required();
    cmd->add_option("--prompt", args->prompt, "prompt text")->required();
    cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json (default: the model folder's)");
    cmd->add_option("--max-new-tokens", args->max_new_tokens, "tokens to generate at most (default 128)")
        ->check(CLI::Range(int64_t{0}, kMaxCount));
    cmd->add_option("--temperature", args->temperature, "sampling temperature; 0 is greedy (default 0.7)");
    cmd->add_option("--top-k", args->top_k, "keep the K most likely tokens; 0 keeps all (default)");
    cmd->add_option("--top-p", args->top_p, "nucleus: keep the smallest set of probability >= P (default 0.95)");
    cmd->add_option("--seed", args->seed, "sampling seed (default 0)");
    cmd->add_option("--kv-cache", args->cache, "KV cache: latent (default) or naive")
        ->check(CLI::IsMember({"latent", "naive"}));
    cmd->add_option("--prefill-chunk", args->prefill_chunk,
                    "prompt tokens per prefill step over the whole batch; 0: all at once (default 512)")
        ->check(CLI::Range(int64_t{0}, kMaxCount));
    cmd->add_flag("--raw", args->raw, "do not prepend the tokenizer's BOS token");
    cmd->add_option("--speculative", args->speculative,
                    "speculative decoding: none (default) or mtp (the model's MTP layer drafts, one step checks)");
    cmd->add_option("--draft-tokens", args->draft_tokens, "tokens the MTP layer drafts a step (default 1)");
    cmd->add_flag("--late-index-keys", args->late_index_keys,
                  "DeepSeek-V4.1: decode as DeepSeek's released inference code does (see deepseek logits --help)");
    commands.emplace_back(cmd, [args] { return run_generate(*args); });
  }
  {
    auto args = std::make_shared<BenchArgs>();
    auto* cmd = app.add_subcommand("bench", "measure prefill and decode tokens/s on random prompts (JSON line)");
    cmd->add_option("--model", args->model, "Hugging Face model folder")->required();
    cmd->add_option("--batch", args->batch, "prompts decoded together (default 1)")
        ->check(CLI::Range(int64_t{1}, infer::kMaxSequences));
    cmd->add_option("--prompt-len", args->prompt_len, "tokens per prompt (default 128)")
        ->check(CLI::Range(int64_t{1}, kMaxCount));
    cmd->add_option("--new-tokens", args->new_tokens, "decode steps (default 32)")
        ->check(CLI::Range(int64_t{1}, kMaxCount));
    cmd->add_option("--kv-cache", args->cache, "KV cache: latent (default) or naive")
        ->check(CLI::IsMember({"latent", "naive"}));
    cmd->add_option("--repeat", args->repeat, "timed runs; the median is reported (default 3)")
        ->check(CLI::Range(int64_t{1}, int64_t{1000}));
    cmd->add_option("--prefill-chunk", args->prefill_chunk,
                    "prompt tokens per prefill step over the whole batch; 0: all at once (default 512)")
        ->check(CLI::Range(int64_t{0}, kMaxCount));
    cmd->add_option("--seed", args->seed, "seed of the random prompts");
    cmd->add_option("--speculative", args->speculative, "speculative decoding: none (default) or mtp");
    cmd->add_option("--draft-tokens", args->draft_tokens, "tokens the MTP layer drafts a step (default 1)");
    cmd->add_flag("--dense-attention", args->dense_attention,
                  "DeepSeek-V3.2: attend to every key with the indexer off (dense MLA), for comparison");
    commands.emplace_back(cmd, [args] { return run_bench(*args); });
  }
}

}  // namespace ds::cli
