// A model's answer in a DeepSeek chat format, split into what OpenAI's chat
// API returns: reasoning_content (the text before </think> when the prompt
// opened <think>), content, and tool_calls (each call block of the format,
// once it is complete and well formed). Text arrives piece by piece as it is
// generated; a marker cut in half between two pieces is held back until the
// next piece decides it. Answers that do not follow the format are never an
// error: a call block that does not parse, names a function the request did
// not define, or never ends is handed on as content, as written.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "infer/chat_format.h"

namespace ds::infer::chat {

struct Call {
  std::string name;
  std::string arguments;  // a JSON object's text
};

// What a piece of the answer adds.
struct Piece {
  std::string reasoning, content;
  std::vector<Call> calls;
  bool empty() const { return reasoning.empty() && content.empty() && calls.empty(); }
  void append(Piece&& p);
};

class AnswerParser {
 public:
  // The answer to `prompt` (what it begins with, the calls it may make).
  AnswerParser(Format f, const Prompt& prompt);
  // Adds generated text; returns what can be handed on now.
  Piece push(std::string_view text);
  // The end of the answer: what was held back.
  Piece finish();
  // Whether a call was handed on.
  bool called() const { return calls_ > 0; }

 private:
  enum class State { Reasoning, Content, Block };
  Piece step();
  void close_block(Piece& out);

  std::string think_end_, begin_, end_;
  bool dsml_, tools_, parallel_;
  std::vector<std::string> names_;
  Format format_;
  State state_;
  std::string buf_;    // text not handed on yet
  std::string block_;  // a call block so far (from its opening marker)
  std::string sep_;    // the newlines before a DSML block (content if it fails)
  size_t calls_ = 0;
};

// A whole answer at once (push, then finish).
Piece parse_answer(Format f, const Prompt& prompt, std::string_view text);

// The calls of one call block of format `f`, opening and closing markers
// included; nullopt unless it is well formed, every call names one of
// `names` and has a JSON object for arguments.
std::optional<std::vector<Call>> parse_block(Format f, std::string_view block, const std::vector<std::string>& names);

}  // namespace ds::infer::chat
