// `deepseek prepare --tokenizer FILE --input GLOB [--input GLOB ...] --out DIR
//                   [--eval-fraction 0.05] [--seed 0] [--shard-tokens 50000000]`
// Tokenizes a text corpus into the token directory the `tokens` training
// dataset reads (format: io/token_shards.h).
//
// Documents: every file the globs match is one document, except `.jsonl`
// files, where every non-blank line is a JSON object whose "text" string is
// one. Documents with empty text are skipped (and counted in the summary).
// Each document becomes BOS (when the tokenizer has one) + the ids of
// its text + EOS (when the tokenizer has <｜end▁of▁sentence｜>). A fraction of
// the documents, drawn with the seed, is held out as the eval split (at least
// one in each split when there are two or more documents); both splits keep
// the input order. The inputs are read and checked once before anything is
// written, then read again and tokenized in parallel, batch by batch, so
// memory holds one batch and one shard per split, not the corpus.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/rng.h"
#include "io/atomic_file.h"
#include "io/text_input.h"
#include "io/token_shards.h"
#include "io/tokenizer.h"

namespace ds::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct PrepareArgs {
  std::string tokenizer;
  std::vector<std::string> inputs;
  std::string out;
  double eval_fraction = 0.05;
  uint64_t seed = 0;
  int64_t shard_tokens = 50'000'000;
};

// Tokenization batches: up to this many documents or bytes of text at once.
constexpr size_t kBatchDocs = 4096;
constexpr size_t kBatchBytes = size_t{32} << 20;

struct InputFile {
  std::string path;
  bool jsonl = false;
};

// A document: a whole file, or one line of a .jsonl file.
struct DocRef {
  uint32_t file = 0;
  uint64_t begin = 0, size = 0;  // byte range of the line (jsonl)
  uint64_t line = 0;             // 1-based line number (jsonl)
};

std::vector<InputFile> expand_inputs(const std::vector<std::string>& patterns) {
  std::vector<InputFile> files;
  for (auto& path : io::expand_corpus_globs(patterns)) files.push_back({path, io::is_jsonl(path)});
  return files;
}

// The text of a .jsonl line, named "prepare: FILE:LINE" in errors.
std::string jsonl_text(std::string_view line, const std::string& path, uint64_t lineno) {
  return io::jsonl_text(line, fmt::format("prepare: {}:{}", path, lineno));
}

std::string read_input(const std::string& path) { return io::read_file(path, "input file"); }

// Pass 1: every document of `f` (already read as `content`), checked.
// Returns the number of empty documents left out.
uint64_t list_documents(const InputFile& f, uint32_t index, const std::string& content, std::vector<DocRef>& docs) {
  if (!f.jsonl) {
    io::check_utf8(content, f.path.c_str());
    if (content.empty()) return 1;
    docs.push_back({index, 0, content.size(), 0});
    return 0;
  }
  uint64_t empty = 0;
  uint64_t lineno = 0;
  for (size_t begin = 0; begin < content.size();) {
    size_t end = content.find('\n', begin);
    if (end == std::string::npos) end = content.size();
    ++lineno;
    const std::string_view line(content.data() + begin, end - begin);
    if (!io::is_blank_line(line)) {
      if (jsonl_text(line, f.path, lineno).empty()) {
        ++empty;
      } else {
        docs.push_back({index, begin, line.size(), lineno});
      }
    }
    begin = end + 1;
  }
  return empty;
}

int run_prepare(const PrepareArgs& a) {
  DS_CHECK(a.eval_fraction > 0 && a.eval_fraction < 1, "prepare: --eval-fraction must be in (0, 1), got {}",
           a.eval_fraction);
  DS_CHECK(a.shard_tokens >= 1, "prepare: --shard-tokens must be at least 1, got {}", a.shard_tokens);
  const auto tok = io::Tokenizer::from_file(a.tokenizer);
  io::check_output_folder(a.out);
  const std::optional<int32_t> bos = tok.bos_id();
  const std::optional<int32_t> eos = tok.token_to_id("<｜end▁of▁sentence｜>");

  // Pass 1: list and check every document before writing anything.
  const std::vector<InputFile> files = expand_inputs(a.inputs);
  std::vector<DocRef> docs;
  uint64_t skipped = 0;
  for (size_t i = 0; i < files.size(); ++i)
    skipped += list_documents(files[i], static_cast<uint32_t>(i), read_input(files[i].path), docs);
  const uint64_t n = docs.size();
  DS_CHECK(n > 0, "prepare: empty corpus: the {} input file(s) hold no text", files.size());

  // The eval documents: the first k of a seeded permutation.
  std::vector<char> is_eval(n, 0);
  if (n >= 2) {
    const auto k = static_cast<uint64_t>(
        std::clamp<double>(std::llround(static_cast<double>(n) * a.eval_fraction), 1.0, static_cast<double>(n - 1)));
    std::vector<uint64_t> order(n);
    std::iota(order.begin(), order.end(), uint64_t{0});
    const Philox rng(a.seed);
    for (uint64_t i = n; i > 1; --i) {
      const auto w = rng.block(i);
      std::swap(order[i - 1], order[((static_cast<uint64_t>(w[0]) << 32) | w[1]) % i]);
    }
    for (uint64_t i = 0; i < k; ++i) is_eval[order[i]] = 1;
  }

  // Pass 2: tokenize batch by batch, in parallel, and write in input order.
  io::TokenCorpusWriter writer(a.out, static_cast<uint64_t>(a.shard_tokens), tok.vocab_size());
  std::vector<std::string> texts;
  std::vector<uint64_t> which;  // document index of each text
  size_t bytes = 0;
  auto flush = [&] {
    std::vector<std::vector<int32_t>> ids(texts.size());
    std::vector<std::exception_ptr> errors(texts.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t i = 0; i < texts.size(); ++i) {
      try {
        std::vector<int32_t>& out = ids[i];
        if (bos) out.push_back(*bos);
        const std::vector<int32_t> body = tok.encode(texts[i]);
        out.insert(out.end(), body.begin(), body.end());
        if (eos) out.push_back(*eos);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
    for (size_t i = 0; i < texts.size(); ++i) {
      if (errors[i]) std::rethrow_exception(errors[i]);
      writer.add(is_eval[which[i]] ? "eval" : "train", ids[i]);
    }
    texts.clear();
    which.clear();
    bytes = 0;
  };
  std::string content;
  uint32_t loaded = UINT32_MAX;
  for (uint64_t d = 0; d < n; ++d) {
    const DocRef& r = docs[d];
    const InputFile& f = files[r.file];
    if (r.file != loaded) {
      content = read_input(f.path);
      loaded = r.file;
    }
    if (f.jsonl) {
      texts.push_back(jsonl_text(std::string_view(content).substr(r.begin, r.size), f.path, r.line));
    } else {
      // The file must not have changed since pass 1.
      DS_CHECK(content.size() == r.size, "prepare: '{}' changed while it was being read", f.path);
      texts.push_back(content);
    }
    which.push_back(d);
    bytes += texts.back().size();
    if (texts.size() >= kBatchDocs || bytes >= kBatchBytes) flush();
  }
  flush();

  io::TokenCorpusMeta meta;
  meta.bos_id = bos;
  meta.eos_id = eos;
  meta.tokenizer = fs::absolute(a.tokenizer).lexically_normal().string();
  meta = writer.finish(meta);
  std::printf(
      "prepared %llu documents (%llu train, %llu eval), %llu tokens (%llu train, %llu eval) from %zu files into "
      "%zu shards in %s (%llu empty documents skipped)\n",
      static_cast<unsigned long long>(n), static_cast<unsigned long long>(meta.train.documents),
      static_cast<unsigned long long>(meta.eval.documents),
      static_cast<unsigned long long>(meta.train.tokens + meta.eval.tokens),
      static_cast<unsigned long long>(meta.train.tokens), static_cast<unsigned long long>(meta.eval.tokens),
      files.size(), meta.train.shards.size() + meta.eval.shards.size(), a.out.c_str(),
      static_cast<unsigned long long>(skipped));
  return 0;
}

}  // namespace

void add_prepare_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<PrepareArgs>();
  auto* cmd = app.add_subcommand("prepare", "tokenize text files into token shards for training (dataset_type=tokens)");
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json")->required();
  cmd->add_option("--input", args->inputs,
                  "input files or globs (repeatable; several may follow one --input): each file is one document, "
                  "each line's \"text\" of a .jsonl file is one")
      ->required();
  cmd->add_option("--out", args->out, "output directory")->required();
  cmd->add_option("--eval-fraction", args->eval_fraction, "fraction of documents held out for eval, in (0, 1)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "seed of the eval selection")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            // Not CLI::NonNegativeNumber, whose message names DBL_MAX as the bound; and
            // "-1" must not wrap around to 2^64 - 1.
            uint64_t x = 0;
            if (!v.empty() && v[0] != '-' && CLI::detail::lexical_cast(v, x)) return "";
            return fmt::format("Value {} not in range 0 to {}", v, std::numeric_limits<uint64_t>::max());
          },
          "UINT64"))
      ->capture_default_str();
  cmd->add_option("--shard-tokens", args->shard_tokens, "tokens per shard file (a longer document gets its own)")
      ->capture_default_str();
  commands.emplace_back(cmd, [args] { return run_prepare(*args); });
}

}  // namespace ds::cli
