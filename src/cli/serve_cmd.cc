// deepseek serve --model DIR [--host H] [--port P] [--max-sequences S] ...
// OpenAI's completion API over HTTP (infer/server.h) for a model folder of
// any family, with continuous batching (infer/batcher.h). Runs until
// SIGINT or SIGTERM, which end the generations still running and stop it.
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <optional>
#include <thread>

#include "cli/commands.h"
#include "core/error.h"
#include "core/system.h"
#include "infer/batcher.h"
#include "infer/chat_format.h"
#include "infer/model.h"
#include "infer/server.h"
#include "io/tokenizer.h"

namespace ds::cli {

namespace {

namespace fs = std::filesystem;

struct ServeArgs {
  std::string model, tokenizer, host = "127.0.0.1", name, cache = "latent", chat_format = "auto";
  int port = 8080;
  int64_t max_sequences = 8, max_waiting = 256;
  int64_t prefill_chunk = infer::GenerateOptions{}.prefill_chunk;
  int http_threads = 32;
  int max_connections = infer::ServerOptions{}.max_connections;
  double request_timeout = infer::ServerOptions{}.request_timeout_s;
  std::string speculative = "none";
  int64_t draft_tokens = 1;
  int64_t draft_max_sequences = 0;
  std::string cache_memory = "auto";
  bool no_prefix_cache = false;
};

// A size: bytes, or a number with KiB, MiB, GiB, TiB (or K, M, G, T: the
// same powers of two; KB, MB, GB, TB: powers of ten).
size_t parse_size(const std::string& text, const char* what) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  double scale = unit.empty() || unit == "B" ? 1 : 0;
  const size_t power = unit.empty() ? std::string::npos : std::string("KMGT").find(unit[0]);
  if (power != std::string::npos) {
    const std::string rest = unit.substr(1);
    if (rest.empty() || rest == "iB") scale = std::pow(1024.0, static_cast<double>(power + 1));
    if (rest == "B") scale = std::pow(1000.0, static_cast<double>(power + 1));
  }
  if (used > 0 && scale > 0 && v > 0 && v * scale < 9e18) return static_cast<size_t>(v * scale);
  throw Error(
      fmt::format("{} '{}' is not a size (bytes, or a number with KiB, MiB, GiB, TiB, KB, MB, GB or TB)", what, text));
}

void say(const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }

int run_serve(const ServeArgs& given) {
  ServeArgs a = given;
  // Named after what --model names (a GGUF file is served under its own
  // name, from the folder it is read into).
  if (a.name.empty()) a.name = fs::path(a.model).lexically_normal().filename().string();
  a.model = infer::model_folder(a.model);
  DS_CHECK(a.speculative == "none" || a.speculative == "mtp", "--speculative must be none or mtp, got '{}'",
           a.speculative);
  infer::ModelOptions mo;
  mo.mtp = a.speculative == "mtp";
  DS_CHECK(a.draft_tokens >= 1 && a.draft_tokens <= infer::kMaxDraftTokens, "--draft-tokens must be in [1, {}], got {}",
           infer::kMaxDraftTokens, a.draft_tokens);
  const auto g = infer::open_model(a.model, mo);
  // The tokenizer is optional: without one, prompts are token ids.
  std::optional<io::Tokenizer> tok;
  const std::string tok_path = a.tokenizer.empty() ? (fs::path(a.model) / "tokenizer.json").string() : a.tokenizer;
  if (!a.tokenizer.empty() || fs::is_regular_file(tok_path)) {
    DS_CHECK(fs::is_regular_file(tok_path), "no tokenizer at '{}'", tok_path);
    tok = io::Tokenizer::from_file(tok_path);
    DS_CHECK(tok->vocab_size() <= g->vocab_size(), "the tokenizer's {} ids do not fit the model's vocabulary of {}",
             tok->vocab_size(), g->vocab_size());
  }
  const infer::CacheKind kind = infer::cache_kind(a.cache);
  // The chat format: named, or the one the model folder's files show.
  infer::chat::Detection chat{infer::chat::Format::V3, "--chat-format"};
  if (a.chat_format == "auto") {
    chat = infer::chat::detect_format(a.model);
  } else {
    const auto f = infer::chat::format_named(a.chat_format);
    DS_CHECK(f, "--chat-format '{}' is not one of auto, {}", a.chat_format, infer::chat::format_names());
    chat.format = *f;
  }
  const std::string& name = a.name;

  // SIGINT and SIGTERM are taken by one thread (sigwait) rather than a
  // handler: every thread made from here on inherits the blocked mask.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  const size_t pool = a.cache_memory == "auto" ? 0 : parse_size(a.cache_memory, "--cache-memory");
  g->load();
  auto decoder = g->new_decoder(kind);
  infer::BatcherOptions bo{a.max_sequences,
                           a.max_waiting,
                           a.prefill_chunk,
                           g->eos_token_id(),
                           tok ? tok->vocab_size() : 0,
                           mo.mtp ? a.draft_tokens : 0};
  // By default half of what the machine has left once the weights are in.
  bo.cache_memory = pool > 0 ? pool : static_cast<size_t>(available_memory_bytes() / 2);
  bo.prefix_cache = !a.no_prefix_cache;
  bo.draft_max_sequences = a.draft_max_sequences;
  infer::Batcher batcher(*decoder, bo);
  infer::ServedModel served;
  served.batcher = &batcher;
  served.tokenizer = tok ? &*tok : nullptr;
  served.chat_format = chat.format;
  served.check = [&g, kind, &a](int64_t prompt, int64_t max_new, int64_t sequences) {
    infer::GenerateOptions o;
    o.cache = kind;
    o.max_new_tokens = max_new;
    o.prefill_chunk = a.prefill_chunk;
    g->check(std::vector<int64_t>(static_cast<size_t>(sequences), prompt), o);
  };
  infer::ServerOptions so{a.host, a.port, name, a.http_threads};
  so.max_connections = a.max_connections;
  so.request_timeout_s = a.request_timeout;
  infer::Server server(served, so);
  const int port = server.bind();

  std::atomic<bool> running{true};
  std::thread signals([&] {
    const timespec tick{0, 200'000'000};
    while (running.load()) {
      const int sig = sigtimedwait(&sigs, nullptr, &tick);
      if (sig == SIGINT || sig == SIGTERM) {
        say(fmt::format("deepseek serve: {}, stopping", sig == SIGINT ? "SIGINT" : "SIGTERM"));
        batcher.close();  // ends the running generations, so their connections finish
        server.stop();
        return;
      }
    }
  });
  say(fmt::format(
      "deepseek serve: {} on http://{}:{} (POST /v1/completions, /v1/chat/completions, /v1/messages; GET /v1/models, "
      "/health, /metrics); {} sequences at once, {}; chat format {} ({}); cache pool {:.1f} MiB "
      "(sequences of up to {} tokens), prefix caching {}",
      name, a.host, port, a.max_sequences, tok ? "text or token-id prompts" : "token-id prompts only",
      infer::chat::format_name(chat.format), chat.why, static_cast<double>(bo.cache_memory) / (1 << 20),
      batcher.max_positions(), bo.prefix_cache ? "on" : "off"));
  server.run();
  running = false;
  signals.join();
  return 0;
}

}  // namespace

void add_serve_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand("serve", "serve a model over HTTP with OpenAI's completion API (continuous batching)");
  cmd->add_option("--model", args->model, "Hugging Face model folder (config.json, safetensors, tokenizer.json)")
      ->required();
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json (default: the model folder's, when it has one)");
  cmd->add_option("--host", args->host, "address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)");
  cmd->add_option("--port", args->port, "port (default 8080; 0 picks a free one)")->check(CLI::Range(0, 65535));
  cmd->add_option("--name", args->name, "model name in responses and /v1/models (default: the folder's name)");
  cmd->add_option("--max-sequences", args->max_sequences,
                  "sequences decoded together; more requests wait for a slot (default 8)")
      ->check(CLI::Range(int64_t{1}, infer::kMaxSequences));
  cmd->add_option("--max-waiting", args->max_waiting,
                  "requests that may wait for a slot; beyond them the server answers 503 (default 256)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--prefill-chunk", args->prefill_chunk,
                  "prompt tokens per step over all sequences; 0: no limit (default 512)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--speculative", args->speculative,
                  "speculative decoding: none (default) or mtp (the model's MTP layer drafts, one step checks)");
  cmd->add_option("--draft-tokens", args->draft_tokens,
                  "tokens the MTP layer drafts a step with --speculative mtp (default 1; above 1 it is chained)");
  cmd->add_option("--draft-max-sequences", args->draft_max_sequences,
                  "with --speculative mtp, draft only while at most N sequences decode; 0: always (default)")
      ->check(CLI::Range(int64_t{0}, infer::kMaxSequences));
  cmd->add_option(
         "--chat-format", args->chat_format,
         "how chat messages become a prompt: auto (default: from the model folder), " + infer::chat::format_names())
      ->check(CLI::IsMember([] {
        std::vector<std::string> names = {"auto"};
        for (auto f : infer::chat::kFormats) names.emplace_back(infer::chat::format_name(f));
        return names;
      }()));
  cmd->add_option("--cache-memory", args->cache_memory,
                  "bytes the KV caches and the prefix cache hold together at most, e.g. 4GiB (default auto: half "
                  "of the memory available once the model is loaded); sequences beyond it wait, and the longest "
                  "sequence it holds bounds the context");
  cmd->add_flag("--no-prefix-cache", args->no_prefix_cache,
                "read every prompt from its start (default: a prompt that begins with tokens a finished request "
                "held reuses their cache)");
  cmd->add_option("--kv-cache", args->cache, "KV cache: latent (default) or naive")
      ->check(CLI::IsMember({"latent", "naive"}));
  cmd->add_option("--http-threads", args->http_threads,
                  "requests with a body handled at once; more are refused with 503 (default 32)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-connections", args->max_connections,
                  "connections open at once; more are refused with 503 (default 256)")
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--request-timeout", args->request_timeout,
                  "seconds a client has to send one request's header and body, in all; then 408 (default 10)")
      ->check(CLI::Range(0.001, 3600.0));
  commands.emplace_back(cmd, [args] { return run_serve(*args); });
}

}  // namespace ds::cli
