// OpenAI's completion API as the server reads it: a request body, checked
// byte by byte and field by field, becomes a BatchRequest; what cannot run
// becomes a Refusal, sent as OpenAI's error object. No sockets here: the
// HTTP layer (infer/http_transport.h) and the fuzzers use it alike.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "infer/batcher.h"
#include "infer/chat_format.h"
#include "io/tokenizer.h"

namespace ds::infer::api {

using json = nlohmann::json;

// A request the server does not run: the HTTP status, one line, and the
// body parameter at fault (empty: none).
struct Refusal {
  int status;
  std::string message, param;
};

[[noreturn]] void refuse(std::string param, std::string message, int status = 400);

// OpenAI's error object for a refusal, and its JSON text.
json error_body(const Refusal& r);
std::string error_text(const Refusal& r);

// JSON text for the wire. Messages can quote a client's bytes (a JSON
// parse error does); invalid UTF-8 becomes U+FFFD rather than an exception.
std::string wire(const json& j);

// A library error's message without the source location it ends with.
std::string plain(const char* what);

// Deepest nesting of arrays and objects nlohmann is asked to build: its
// parser costs about 40 bytes of memory per byte of "[[[[...", so a body is
// scanned first and refused past this depth.
inline constexpr int kMaxJsonDepth = 64;

// The body as a JSON object; refuses text that is not JSON, nests deeper
// than max_depth, or is not an object.
json parse_body(std::string_view body, int max_depth = kMaxJsonDepth);

// The body's member `key`, or nullptr when it is absent or null.
const json* field(const json& body, const char* key);

// What a request needs to be checked beyond its body.
struct Limits {
  const io::Tokenizer* tokenizer = nullptr;  // none: only token-id prompts
  int64_t max_positions = 0;                 // the model's
  int64_t vocab = 0;                         // the model's ids (logit_bias keys below it)
  chat::Format chat_format = chat::Format::V3;  // how chat messages become a prompt
};

// Choices per request at most ("n").
inline constexpr int64_t kMaxChoices = 8;
// Most likely ids per token at most: completions' "logprobs" and chat's
// "top_logprobs".
inline constexpr int64_t kMaxCompletionLogprobs = 5;

// A checked request: what the batcher runs and how to answer.
struct Request {
  BatchRequest batch;  // batch.sampler.seed is set only when has_seed; choice i draws with seed + i
  bool has_seed = false;
  bool chat = false, stream = false, include_usage = false;
  int64_t n = 1;      // choices, each its own sequence
  bool echo = false;  // completions: the prompt's text (and logprobs) before each choice's
  // Log-probabilities: none (-1), or each token's with this many most
  // likely ids (batch.logprobs and batch.top_logprobs say the same).
  int64_t logprobs = -1;
  std::vector<std::string> stops;
  const char* max_key = "max_tokens";  // the field that set max_new_tokens
  bool max_defaulted = true;           // ... or none did
  // Chat: the rendered prompt (what the answer begins with, the calls it may
  // make) and whether thinking is on (answers carry reasoning_content).
  chat::Prompt chat_prompt;
  bool thinking = false;
};

// Checks a /v1/completions (chat false) or /v1/chat/completions body;
// throws Refusal. `body_text` is the body as sent: the chat formats print
// the tools' JSON in the client's key order, which `body` no longer has
// (without it, in sorted order).
Request read_request(const json& body, bool chat, const Limits& limits, std::string_view body_text = {});

}  // namespace ds::infer::api
