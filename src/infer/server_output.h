// The log-probabilities in the server's answers, in OpenAI's two shapes:
// the legacy completions' {"tokens", "token_logprobs", "top_logprobs",
// "text_offset"} (an echoed prompt's first token has null entries) and
// chat's {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "infer/chat_parse.h"
#include "infer/sampler.h"
#include "io/tokenizer.h"

namespace ds::infer::api {

// A token and its log-probabilities (none: the first prompt token, which
// nothing predicts).
struct LoggedToken {
  int32_t id;
  const TokenLogprob* lp;
};

// A token as logprobs name it: its text decoded alone (special tokens
// included; a byte-level piece of a UTF-8 character becomes U+FFFD), or
// "token_id:<id>" without a tokenizer (vLLM's form).
std::string token_text(const io::Tokenizer* tok, int32_t id);

// Completions' logprobs object. *offset is the text_offset of the first
// token (characters), advanced past each token's text: offsets are the
// cumulative lengths of the token strings, as vLLM computes them.
nlohmann::json completion_logprobs(const io::Tokenizer* tok, const std::vector<LoggedToken>& tokens, int64_t* offset);

// Chat's logprobs object; `bytes` is each token string's UTF-8.
nlohmann::json chat_logprobs(const io::Tokenizer* tok, const std::vector<LoggedToken>& tokens);

// Chat's message for an answer split by its chat format (infer/chat_parse.h):
// "content" (null when it is empty and calls were made), "reasoning_content"
// (with thinking on) and "tool_calls", call k with id `call_id` + k.
nlohmann::json chat_message(const chat::Piece& p, bool thinking, const std::string& call_id);

// A streamed chunk's "delta" for a piece of such an answer: only the fields
// the piece adds ({} for none), each call whole; *calls counts the calls
// handed on before, their index in tool_calls.
nlohmann::json chat_delta(const chat::Piece& p, const std::string& call_id, size_t* calls);

}  // namespace ds::infer::api
