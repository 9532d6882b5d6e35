// `deepseek tokenize --tokenizer FILE [--add-special-tokens]`: stdin holds a
// JSON array of strings; stdout gets a JSON array of token-id arrays, one per
// string.
// `deepseek detokenize --tokenizer FILE`: stdin holds a JSON array of token-id
// arrays; stdout gets a JSON array of the decoded strings.
// `deepseek chat-template --model DIR [--chat-format F] [--ids]`: stdin
// holds a chat request body (OpenAI's messages, tools, tool_choice,
// thinking, reasoning_effort, ...); stdout gets the prompt text that
// `deepseek serve` builds from it for the model folder, or with --ids the
// token ids it would generate from (the same code reads the request).
// Bad JSON, wrong types, invalid UTF-8 and unknown ids are ds::Errors (one
// line on stderr, exit code 2); a request the server would refuse is
// refused with the server's message.
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
#include "infer/chat_format.h"
#include "infer/model.h"
#include "infer/server_api.h"
#include "io/tokenizer.h"

namespace ds::cli {

namespace {

using json = nlohmann::json;

struct TokenizerArgs {
  std::string tokenizer;
  bool add_special_tokens = false;
};

std::string read_stdin() {
  std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  DS_CHECK(!std::cin.bad(), "error reading standard input");
  return text;
}

json read_stdin_json() {
  const std::string text = read_stdin();
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

struct TemplateArgs {
  std::string model, chat_format = "auto";
  bool ids = false;
};

int run_chat_template(const TemplateArgs& given) {
  TemplateArgs a = given;
  a.model = infer::model_folder(a.model);
  namespace chat = infer::chat;
  namespace api = infer::api;
  const auto tok = io::Tokenizer::from_file(a.model + "/tokenizer.json");
  chat::Format format = chat::detect_format(a.model).format;
  if (a.chat_format != "auto") {
    const auto f = chat::format_named(a.chat_format);
    DS_CHECK(f, "--chat-format '{}' is not one of auto, {}", a.chat_format, chat::format_names());
    format = *f;
  }
  api::Limits lim;
  lim.tokenizer = &tok;
  lim.max_positions = INT32_MAX;  // the prompt alone: the model's length is the server's check
  lim.vocab = tok.vocab_size();
  lim.chat_format = format;
  const std::string text = read_stdin();
  api::Request r;
  try {
    r = api::read_request(api::parse_body(text), /*chat=*/true, lim, text);
  } catch (const api::Refusal& e) {
    DS_FAIL("chat-template: {}{}", e.param.empty() ? "" : e.param + ": ", e.message);
  }
  if (a.ids) {
    print_json(json(r.batch.prompt));
  } else {
    std::fwrite(r.chat_prompt.text.data(), 1, r.chat_prompt.text.size(), stdout);
    std::fflush(stdout);
  }
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

  auto targs = std::make_shared<TemplateArgs>();
  auto* tpl = app.add_subcommand("chat-template",
                                 "chat request body on stdin -> the prompt text `serve` builds from it (or its ids)");
  tpl->add_option("--model", targs->model, "model folder (its tokenizer.json, and its files for --chat-format auto)")
      ->required();
  tpl->add_option("--chat-format", targs->chat_format,
                  "auto (default: from the model folder), " + infer::chat::format_names());
  tpl->add_flag("--ids", targs->ids, "print the token ids the server generates from, as a JSON array");
  commands.emplace_back(tpl, [targs] { return run_chat_template(*targs); });
}

}  // namespace ds::cli
