// `deepseek tokenizer train --input GLOB [--input GLOB ...] --vocab-size N
//  --out tokenizer.json [--min-frequency 2] [--pad-token]`
//
// Trains a byte-level BPE tokenizer with DeepSeek-V3's pre-tokenizer
// (io/bpe_trainer.h) and writes tokenizer.json plus a tokenizer_config.json
// beside it (BOS <｜begin▁of▁sentence｜> = 0, EOS <｜end▁of▁sentence｜> = 1,
// add_bos_token true). Each GLOB (glob(3), quoted so the shell leaves it
// alone, or already expanded by the shell) names corpus files: a file is one
// document, a `.jsonl` file holds one JSON object per line whose "text" field
// is a document. Prints one summary line.
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/bpe_trainer.h"
#include "io/text_input.h"

namespace ds::cli {

namespace {

struct TrainTokenizerArgs {
  std::vector<std::string> inputs;
  std::string out;
  int64_t vocab_size = 0;
  int64_t min_frequency = 2;
  bool pad_token = false;
};

int run_tokenizer_train(const TrainTokenizerArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  io::BpeTrainerOptions opt;
  opt.vocab_size = a.vocab_size;
  opt.min_frequency = a.min_frequency;
  opt.pad_token = a.pad_token;
  io::BpeTrainer trainer(opt);  // checks the sizes before any reading
  // Refuse an unwritable output before the work, not after.
  io::resolve_output_path(a.out);
  io::resolve_output_path(io::tokenizer_config_path(a.out));
  for (const auto& file : io::expand_corpus_globs(a.inputs)) trainer.add_file(file);
  const io::BpeModel model = trainer.train();
  io::write_bpe_tokenizer(model, a.out);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& st = trainer.stats();
  fmt::print(
      "trained {}: {} documents, {} bytes, {} words ({} distinct); vocabulary {} ({} special + 256 bytes + {} "
      "learned), {} merges; {:.2f} s\n",
      a.out, st.documents, st.bytes, st.words, st.distinct_words, model.vocab.size(), model.num_special,
      model.vocab.size() - 256 - model.num_special, model.merges.size(), secs);
  return 0;
}

}  // namespace

void add_tokenizer_train_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<TrainTokenizerArgs>();
  auto* group = app.add_subcommand("tokenizer", "tokenizer tools");
  group->require_subcommand(1);
  auto* train = group->add_subcommand("train", "train a byte-level BPE tokenizer.json (DeepSeek-V3 pre-tokenizer)");
  train->add_option("--input", args->inputs, "corpus files: glob pattern(s); .jsonl = one {\"text\": ...} per line")
      ->required();
  train->add_option("--vocab-size", args->vocab_size, "total vocabulary, special tokens and 256 bytes included")
      ->required();
  train->add_option("--out", args->out, "tokenizer.json to write (tokenizer_config.json goes beside it)")->required();
  train->add_option("--min-frequency", args->min_frequency, "never merge a pair seen fewer times")
      ->capture_default_str();
  train->add_flag("--pad-token", args->pad_token, "also add <｜▁pad▁｜> as id 2");
  commands.emplace_back(train, [args] { return run_tokenizer_train(*args); });
}

}  // namespace ds::cli
