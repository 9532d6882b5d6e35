// `deepseek tokenize --tokenizer FILE [--add-special-tokens]`: stdin holds a
// JSON array of strings; stdout gets a JSON array of token-id arrays, one per
// string.
// `deepseek detokenize --tokenizer FILE`: stdin holds a JSON array of token-id
// arrays; stdout gets a JSON array of the decoded strings.
// Bad JSON, wrong types, invalid UTF-8 and unknown ids are ds::Errors (one
// line on stderr, exit code 2).
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "io/tokenizer.h"

namespace ds::cli {

namespace {

using json = nlohmann::json;

struct TokenizerArgs {
  std::string tokenizer;
  bool add_special_tokens = false;
};

json read_stdin_json() {
  std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  DS_CHECK(!std::cin.bad(), "error reading standard input");
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    DS_FAIL("standard input is not valid JSON: {}", e.what());
  }
}

void print_json(const json& j) {
  // Non-ASCII text stays UTF-8; decode() only returns valid UTF-8.
  const std::string s = j.dump(-1, ' ', false, json::error_handler_t::strict);
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

int run_tokenize(const TokenizerArgs& a) {
  const auto tok = io::Tokenizer::from_file(a.tokenizer);
  const json in = read_stdin_json();
  DS_CHECK(in.is_array(), "tokenize: standard input must be a JSON array of strings, got {}", in.type_name());
  json out = json::array();
  for (size_t i = 0; i < in.size(); ++i) {
    DS_CHECK(in[i].is_string(), "tokenize: element {} must be a string, got {}", i, in[i].type_name());
    out.push_back(tok.encode(in[i].get_ref<const std::string&>(), a.add_special_tokens));
  }
  print_json(out);
  return 0;
}

int run_detokenize(const TokenizerArgs& a) {
  const auto tok = io::Tokenizer::from_file(a.tokenizer);
  const json in = read_stdin_json();
  DS_CHECK(in.is_array(), "detokenize: standard input must be a JSON array of token-id arrays, got {}", in.type_name());
  json out = json::array();
  std::vector<int32_t> ids;
  for (size_t i = 0; i < in.size(); ++i) {
    DS_CHECK(in[i].is_array(), "detokenize: element {} must be an array of token ids, got {}", i, in[i].type_name());
    ids.clear();
    for (const json& v : in[i]) {
      // Unsigned values above INT64_MAX would wrap in get<int64_t>().
      const bool in_range =
          v.is_number_integer() && (v.is_number_unsigned() ? v.get<uint64_t>() <= INT32_MAX
                                                           : v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX);
      DS_CHECK(in_range, "detokenize: element {} holds {}, which is not a token id (vocab size {})", i, v.dump(),
               tok.vocab_size());
      ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
    out.push_back(tok.decode(ids));
  }
  print_json(out);
  return 0;
}

}  // namespace

void add_tokenizer_commands(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<TokenizerArgs>();
  auto* enc = app.add_subcommand("tokenize", "JSON array of strings on stdin -> JSON array of token-id arrays");
  enc->add_option("--tokenizer", args->tokenizer, "tokenizer.json")->required();
  enc->add_flag("--add-special-tokens", args->add_special_tokens, "prepend the BOS id, as transformers does");
  commands.emplace_back(enc, [args] { return run_tokenize(*args); });

  auto* dec = app.add_subcommand("detokenize", "JSON array of token-id arrays on stdin -> JSON array of strings");
  dec->add_option("--tokenizer", args->tokenizer, "tokenizer.json")->required();
  commands.emplace_back(dec, [args] { return run_detokenize(*args); });
}

}  // namespace ds::cli
