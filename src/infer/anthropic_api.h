// Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens)
// over the server's one chat path: a Messages body is checked and turned
// into the OpenAI chat body that api::read_request reads (system text,
// messages with text, tool-use and tool-result blocks, max_tokens,
// stop_sequences, sampling, tools, thinking), so both APIs share every
// check and the chat format; refusals are worded with the Messages field
// names and sent as Anthropic's error object. Answers and stream events in
// Anthropic's shapes. No sockets here.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "infer/chat_parse.h"
#include "infer/server_api.h"

namespace ds::infer::api {

// The OpenAI chat body for a Messages body; throws Refusal (param: the
// Messages field at fault).
json messages_to_chat(const json& body);

// The chat body's "tools" in the client's order, for read_request's
// body_text: {"tools": [{"type": "function", "function": {"name",
// "description", "parameters"}}]} with input_schema's keys as the client
// wrote them (the chat formats print the schemas, so their order is part of
// the prompt); "" when the body has none. `body_text` is the Messages body
// that messages_to_chat accepted.
std::string messages_tools_text(std::string_view body_text);

// A refusal of the translated body (read_request's), its param renamed to
// the Messages field it came from (stop -> stop_sequences, ...).
Refusal messages_refusal(Refusal r);

// Anthropic's error object: {"type": "error", "error": {"type", "message"}}.
json messages_error_body(const Refusal& r);

// One content block of an answer: text, thinking, or a tool call.
struct MessageBlock {
  enum class Kind { Text, Thinking, ToolUse } kind = Kind::Text;
  std::string text;      // Text: the text; Thinking: the reasoning
  std::string id, name;  // ToolUse
  json input;            // ToolUse: the arguments
};

// An answer's end: "end_turn" (the model's end of sequence), "max_tokens",
// "stop_sequence" (with the one that appeared) or "tool_use".
struct MessageEnd {
  std::string stop_reason;
  std::string stop_sequence;  // empty: null
  int64_t input_tokens = 0, output_tokens = 0;
};

// The non-streamed answer.
json message_body(const std::string& id, const std::string& model, const std::vector<MessageBlock>& blocks,
                  const MessageEnd& end);

// A server-sent event of a Messages stream: "event: <type>\ndata: <json>\n\n".
std::string message_event(const json& data);
// The stream's events, in the order Anthropic sends them: message_start,
// then per block content_block_start, its deltas, content_block_stop; then
// message_delta (stop reason, output tokens) and message_stop.
json message_start(const std::string& id, const std::string& model, int64_t input_tokens);
json block_start(int64_t index, const MessageBlock& block);
json text_delta(int64_t index, const std::string& text);
json thinking_delta(int64_t index, const std::string& text);
json input_json_delta(int64_t index, const std::string& partial_json);
json block_stop(int64_t index);
json message_delta(const MessageEnd& end);
json message_stop();

// An answer parsed by its chat format as Messages blocks: a thinking block
// (the reasoning), a text block (the content; also when nothing else is
// there), a tool_use block per call (ids id_prefix + k, the arguments as
// the input object).
std::vector<MessageBlock> message_blocks(const chat::Piece& answer, const std::string& id_prefix);

// A streamed answer's blocks, opened and closed as its parts arrive:
// thinking, then text, then each call (a tool_use block whose input goes
// in one input_json_delta). Each call returns the events to send.
class MessageStream {
 public:
  explicit MessageStream(std::string id_prefix) : prefix_(std::move(id_prefix)) {}
  std::vector<json> push(const chat::Piece& piece);
  std::vector<json> text(const std::string& t);  // an answer without a parser: text only
  // Closes the open block (an empty text block when none was opened).
  std::vector<json> finish();
  bool called() const { return calls_ > 0; }

 private:
  void open(std::vector<json>& out, MessageBlock::Kind kind, const MessageBlock& block);
  std::string prefix_;
  int64_t index_ = -1, calls_ = 0;
  bool open_ = false;
  MessageBlock::Kind kind_ = MessageBlock::Kind::Text;
};

}  // namespace ds::infer::api
