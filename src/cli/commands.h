// Subcommands of the `deepseek` program. Each command file adds its
// subcommand(s) to the app and returns the function that runs them; main()
// parses, then runs the one that was chosen. Commands report bad input by
// throwing ds::Error (main prints one line and exits 2).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <utility>
#include <vector>

namespace ds::cli {

using CommandList = std::vector<std::pair<CLI::App*, std::function<int()>>>;

// ds::Error if standard output has failed (full, closed): flushes it first.
// Commands that stream call it as they go, main() once at the end.
void check_stdout();

void add_selfcheck_command(CLI::App& app, CommandList& commands);
void add_tokenizer_commands(CLI::App& app, CommandList& commands);  // tokenize, detokenize
void add_logits_command(CLI::App& app, CommandList& commands);
void add_perplexity_command(CLI::App& app, CommandList& commands);  // llama-perplexity's measure
void add_quantize_command(CLI::App& app, CommandList& commands);    // q8_0 / q4_k model folders
void add_model_commands(CLI::App& app, CommandList& commands);  // init, generate, bench
void add_prepare_command(CLI::App& app, CommandList& commands);  // tokenize a corpus into token shards
void add_tokenizer_train_command(CLI::App& app, CommandList& commands);  // tokenizer train
void add_train_commands(CLI::App& app, CommandList& commands);           // train, export
void add_serve_command(CLI::App& app, CommandList& commands);            // OpenAI-compatible HTTP server

}  // namespace ds::cli
