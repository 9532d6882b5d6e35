#include "infer/anthropic_api.h"

#include <fmt/format.h>

#include <utility>

namespace ds::infer::api {

namespace {

// The text of a content given as a string or as text blocks.
std::string text_of(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) refuse(where, fmt::format("'{}' must be a string or an array of text blocks", where));
  std::string text;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& b = content[j];
    if (!b.is_object() || b.value("type", "") != "text" || !b.contains("text") || !b["text"].is_string())
      refuse(where, fmt::format("'{}.{}' must be a text block {{\"type\": \"text\", \"text\": ...}}", where, j));
    text += b["text"].get<std::string>();
  }
  return text;
}

std::string block_type(const json& b) {
  return b.is_object() && b.contains("type") && b["type"].is_string() ? b["type"].get<std::string>() : "";
}

// A user turn: its tool results become OpenAI tool messages (before the
// text, as Anthropic puts them first), its text blocks one user message.
void user_turn(json& out, const json& content, const std::string& where) {
  if (content.is_string()) {
    out.push_back({{"role", "user"}, {"content", content}});
    return;
  }
  std::string text;
  bool has_text = false;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& b = content[j];
    const std::string at = fmt::format("{}.{}", where, j), type = block_type(b);
    if (type == "text") {
      text += text_of(json::array({b}), at);
      has_text = true;
    } else if (type == "tool_result") {
      if (!b.contains("tool_use_id") || !b["tool_use_id"].is_string())
        refuse(at, fmt::format("'{}.tool_use_id' must be a string", at));
      const json* c = field(b, "content");
      std::string result = c ? text_of(*c, at + ".content") : "";
      if (b.value("is_error", false)) result = "Error: " + result;
      out.push_back({{"role", "tool"}, {"tool_call_id", b["tool_use_id"]}, {"content", result}});
    } else {
      refuse(at, fmt::format("'{}': {} blocks are not supported in a user turn (text, tool_result)", at,
                             type.empty() ? "untyped" : type));
    }
  }
  if (has_text) out.push_back({{"role", "user"}, {"content", text}});
}

// An assistant turn: text, thinking (OpenAI's reasoning_content) and tool
// calls (tool_calls, the input as its JSON text).
void assistant_turn(json& out, const json& content, const std::string& where) {
  json m = {{"role", "assistant"}};
  if (content.is_string()) {
    m["content"] = content;
    out.push_back(std::move(m));
    return;
  }
  std::string text, reasoning;
  json calls = json::array();
  for (size_t j = 0; j < content.size(); ++j) {
    const json& b = content[j];
    const std::string at = fmt::format("{}.{}", where, j), type = block_type(b);
    if (type == "text") {
      text += text_of(json::array({b}), at);
    } else if (type == "thinking") {
      if (!b.contains("thinking") || !b["thinking"].is_string())
        refuse(at, fmt::format("'{}.thinking' must be a string", at));
      reasoning += b["thinking"].get<std::string>();
    } else if (type == "tool_use") {
      if (!b.contains("id") || !b["id"].is_string() || !b.contains("name") || !b["name"].is_string())
        refuse(at, fmt::format("'{}' needs a string 'id' and 'name'", at));
      const json* input = field(b, "input");
      if (input && !input->is_object()) refuse(at, fmt::format("'{}.input' must be an object", at));
      calls.push_back({{"id", b["id"]},
                       {"type", "function"},
                       {"function", {{"name", b["name"]}, {"arguments", (input ? *input : json::object()).dump()}}}});
    } else {
      refuse(at, fmt::format("'{}': {} blocks are not supported in an assistant turn (text, thinking, tool_use)", at,
                             type.empty() ? "untyped" : type));
    }
  }
  m["content"] = text;
  if (!reasoning.empty()) m["reasoning_content"] = reasoning;
  if (!calls.empty()) m["tool_calls"] = std::move(calls);
  out.push_back(std::move(m));
}

json chat_messages(const json& body) {
  json out = json::array();
  if (const json* s = field(body, "system")) {
    const std::string text = text_of(*s, "system");
    if (!text.empty()) out.push_back({{"role", "system"}, {"content", text}});
  }
  const json* m = field(body, "messages");
  if (!m || !m->is_array() || m->empty())
    refuse("messages", "'messages' must be a non-empty array of {\"role\", \"content\"} objects");
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string where = fmt::format("messages.{}", i);
    if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string())
      refuse(where, fmt::format("'{}' must be an object with a string 'role'", where));
    const std::string role = msg["role"].get<std::string>();
    const json* c = field(msg, "content");
    if (!c || !(c->is_string() || c->is_array()))
      refuse(where + ".content", fmt::format("'{}.content' must be a string or an array of blocks", where));
    if (role == "user")
      user_turn(out, *c, where + ".content");
    else if (role == "assistant")
      assistant_turn(out, *c, where + ".content");
    else
      refuse(where + ".role", fmt::format("'{}.role' must be user or assistant, got '{}'", where, role));
    // A last assistant turn would be continued (prefill); the chat format
    // closes every assistant turn it is given.
    if (role == "assistant" && i + 1 == m->size())
      refuse(where, fmt::format("'{}': continuing a final assistant turn (prefill) is not supported", where));
  }
  return out;
}

// tools: [{"name", "description", "input_schema"}] as OpenAI functions;
// tool_choice {"type": auto | any | tool | none}.
void tool_fields(const json& body, json& chat) {
  if (const json* t = field(body, "tools")) {
    if (!t->is_array()) refuse("tools", "'tools' must be an array");
    json tools = json::array();
    for (size_t i = 0; i < t->size(); ++i) {
      const json& d = (*t)[i];
      const std::string at = fmt::format("tools.{}", i);
      const std::string type = d.is_object() ? d.value("type", "custom") : "";
      if (type != "custom")
        refuse(at, fmt::format("'{}': only client tools (name, description, input_schema) are supported", at));
      if (!d.contains("name") || !d["name"].is_string()) refuse(at, fmt::format("'{}.name' must be a string", at));
      const json* schema = field(d, "input_schema");
      if (!schema || !schema->is_object()) refuse(at, fmt::format("'{}.input_schema' must be an object", at));
      json f = {{"name", d["name"]}, {"parameters", *schema}};
      if (const json* desc = field(d, "description")) f["description"] = *desc;
      tools.push_back({{"type", "function"}, {"function", std::move(f)}});
    }
    if (!tools.empty()) chat["tools"] = std::move(tools);
  }
  if (const json* c = field(body, "tool_choice")) {
    const std::string type = c->is_object() ? c->value("type", "") : "";
    if (type == "auto")
      chat["tool_choice"] = "auto";
    else if (type == "any")
      chat["tool_choice"] = "required";
    else if (type == "none")
      chat["tool_choice"] = "none";
    else if (type == "tool" && c->contains("name") && (*c)["name"].is_string())
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*c)["name"]}}}};
    else
      refuse("tool_choice",
             "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
             "{\"type\": \"tool\", \"name\": ...}");
  }
}

// thinking: {"type": "enabled", "budget_tokens": N} (N >= 1024, below
// max_tokens, as Anthropic requires) or {"type": "disabled"}; the chat
// format's thinking switch. The budget is checked, not enforced: the
// model thinks until it closes its reasoning.
void thinking_field(const json& body, json& chat, int64_t max_tokens) {
  const json* t = field(body, "thinking");
  if (!t) return;
  const std::string type = t->is_object() ? t->value("type", "") : "";
  if (type == "disabled") {
    chat["chat_template_kwargs"] = {{"thinking", false}};
    return;
  }
  if (type != "enabled")
    refuse("thinking", "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}");
  const json* b = field(*t, "budget_tokens");
  if (!b || !b->is_number_integer() || b->get<int64_t>() < 1024 || b->get<int64_t>() >= max_tokens)
    refuse("thinking.budget_tokens", "'thinking.budget_tokens' must be an integer >= 1024 and below 'max_tokens'");
  chat["chat_template_kwargs"] = {{"thinking", true}};
}

}  // namespace

json messages_to_chat(const json& body) {
  json chat = json::object();
  const json* model = field(body, "model");
  if (!model || !model->is_string()) refuse("model", "'model' is required: a string");
  chat["model"] = *model;
  const json* mt = field(body, "max_tokens");
  if (!mt) refuse("max_tokens", "'max_tokens' is required");
  if (!mt->is_number_integer() || mt->get<int64_t>() < 1 || mt->get<int64_t>() > INT32_MAX)
    refuse("max_tokens", fmt::format("'max_tokens' must be an integer in [1, {}]", INT32_MAX));
  chat["max_tokens"] = *mt;
  chat["messages"] = chat_messages(body);
  if (const json* s = field(body, "stop_sequences")) {
    if (!s->is_array()) refuse("stop_sequences", "'stop_sequences' must be an array of strings");
    if (!s->empty()) chat["stop"] = *s;
  }
  // Anthropic's temperature runs from 0 to 1.
  if (const json* t = field(body, "temperature")) {
    if (!t->is_number() || !(t->get<double>() >= 0.0 && t->get<double>() <= 1.0))
      refuse("temperature", "'temperature' must be a number in [0, 1]");
    chat["temperature"] = *t;
  }
  for (const char* key : {"top_p", "top_k", "stream"})
    if (const json* v = field(body, key)) chat[key] = *v;
  if (const json* md = field(body, "metadata"); md && !md->is_object())
    refuse("metadata", "'metadata' must be an object");
  for (const char* key : {"mcp_servers", "container"}) {
    const json* v = field(body, key);
    if (v && !(v->is_array() && v->empty())) refuse(key, fmt::format("'{}' is not supported", key));
  }
  tool_fields(body, chat);
  thinking_field(body, chat, mt->get<int64_t>());
  return chat;
}

std::string messages_tools_text(std::string_view body_text) {
  using ojson = chat::ojson;
  const ojson b = ojson::parse(body_text);
  if (!b.contains("tools") || !b["tools"].is_array() || b["tools"].empty()) return "";
  ojson tools = ojson::array();
  for (const auto& d : b["tools"]) {
    ojson f = {{"name", d["name"]}};
    if (d.contains("description") && !d["description"].is_null()) f["description"] = d["description"];
    f["parameters"] = d["input_schema"];
    tools.push_back({{"type", "function"}, {"function", std::move(f)}});
  }
  return ojson{{"tools", std::move(tools)}}.dump();
}

Refusal messages_refusal(Refusal r) {
  auto rename = [&](const std::string& from, const std::string& to) {
    if (r.param != from) return;
    r.param = to;
    for (size_t p = 0; (p = r.message.find("'" + from + "'", p)) != std::string::npos; p += to.size() + 2)
      r.message.replace(p, from.size() + 2, "'" + to + "'");
  };
  rename("stop", "stop_sequences");
  rename("chat_template_kwargs", "thinking");
  if (r.param.rfind("messages[", 0) == 0) {
    // read_request names messages[i]; the Messages API numbers its own
    // turns, which tool results may have split: name the list.
    r.param = "messages";
  }
  return r;
}

json messages_error_body(const Refusal& r) {
  const char* type = r.status == 404   ? "not_found_error"
                     : r.status == 413 ? "request_too_large"
                     : r.status == 429 ? "rate_limit_error"
                     : r.status == 503 ? "overloaded_error"
                     : r.status >= 500 ? "api_error"
                                       : "invalid_request_error";
  return {{"type", "error"}, {"error", {{"type", type}, {"message", r.message}}}};
}

namespace {

json block_json(const MessageBlock& b, bool start) {
  switch (b.kind) {
    case MessageBlock::Kind::Thinking:
      return {{"type", "thinking"}, {"thinking", start ? "" : b.text}, {"signature", ""}};
    case MessageBlock::Kind::ToolUse:
      return {{"type", "tool_use"}, {"id", b.id}, {"name", b.name}, {"input", start ? json::object() : b.input}};
    default:
      return {{"type", "text"}, {"text", start ? "" : b.text}};
  }
}

json stop_json(const MessageEnd& e) {
  return {{"stop_reason", e.stop_reason},
          {"stop_sequence", e.stop_sequence.empty() ? json(nullptr) : json(e.stop_sequence)}};
}

}  // namespace

json message_body(const std::string& id, const std::string& model, const std::vector<MessageBlock>& blocks,
                  const MessageEnd& end) {
  json content = json::array();
  for (const auto& b : blocks) content.push_back(block_json(b, false));
  json out = {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", model}, {"content", content}};
  out.update(stop_json(end));
  out["usage"] = {{"input_tokens", end.input_tokens}, {"output_tokens", end.output_tokens}};
  return out;
}

std::string message_event(const json& data) {
  return "event: " + data.value("type", std::string("message")) + "\ndata: " + wire(data) + "\n\n";
}

json message_start(const std::string& id, const std::string& model, int64_t input_tokens) {
  return {{"type", "message_start"},
          {"message",
           {{"id", id},
            {"type", "message"},
            {"role", "assistant"},
            {"content", json::array()},
            {"model", model},
            {"stop_reason", nullptr},
            {"stop_sequence", nullptr},
            {"usage", {{"input_tokens", input_tokens}, {"output_tokens", 0}}}}}};
}

json block_start(int64_t index, const MessageBlock& block) {
  return {{"type", "content_block_start"}, {"index", index}, {"content_block", block_json(block, true)}};
}

json text_delta(int64_t index, const std::string& text) {
  return {{"type", "content_block_delta"}, {"index", index}, {"delta", {{"type", "text_delta"}, {"text", text}}}};
}

json thinking_delta(int64_t index, const std::string& text) {
  return {
      {"type", "content_block_delta"}, {"index", index}, {"delta", {{"type", "thinking_delta"}, {"thinking", text}}}};
}

json input_json_delta(int64_t index, const std::string& partial_json) {
  return {{"type", "content_block_delta"},
          {"index", index},
          {"delta", {{"type", "input_json_delta"}, {"partial_json", partial_json}}}};
}

json block_stop(int64_t index) { return {{"type", "content_block_stop"}, {"index", index}}; }

json message_delta(const MessageEnd& end) {
  return {{"type", "message_delta"}, {"delta", stop_json(end)}, {"usage", {{"output_tokens", end.output_tokens}}}};
}

json message_stop() { return {{"type", "message_stop"}}; }

namespace {

// A call's arguments as the input object (the parser handed on only JSON
// objects; anything else becomes an empty input rather than an error).
json call_input(const std::string& arguments) {
  json j = json::parse(arguments, nullptr, /*allow_exceptions=*/false);
  return j.is_object() ? j : json::object();
}

}  // namespace

std::vector<MessageBlock> message_blocks(const chat::Piece& answer, const std::string& id_prefix) {
  using K = MessageBlock::Kind;
  std::vector<MessageBlock> out;
  if (!answer.reasoning.empty()) out.push_back({K::Thinking, answer.reasoning, "", "", nullptr});
  if (!answer.content.empty() || answer.calls.empty()) out.push_back({K::Text, answer.content, "", "", nullptr});
  for (size_t k = 0; k < answer.calls.size(); ++k)
    out.push_back(
        {K::ToolUse, "", id_prefix + std::to_string(k), answer.calls[k].name, call_input(answer.calls[k].arguments)});
  return out;
}

void MessageStream::open(std::vector<json>& out, MessageBlock::Kind kind, const MessageBlock& block) {
  if (open_) out.push_back(block_stop(index_));
  ++index_;
  open_ = true;
  kind_ = kind;
  out.push_back(block_start(index_, block));
}

std::vector<json> MessageStream::push(const chat::Piece& piece) {
  using K = MessageBlock::Kind;
  std::vector<json> out;
  if (!piece.reasoning.empty()) {
    if (!open_ || kind_ != K::Thinking) open(out, K::Thinking, {K::Thinking, "", "", "", nullptr});
    out.push_back(thinking_delta(index_, piece.reasoning));
  }
  if (!piece.content.empty()) {
    if (!open_ || kind_ != K::Text) open(out, K::Text, {K::Text, "", "", "", nullptr});
    out.push_back(text_delta(index_, piece.content));
  }
  for (const auto& call : piece.calls) {
    const MessageBlock b{K::ToolUse, "", prefix_ + std::to_string(calls_++), call.name, call_input(call.arguments)};
    open(out, K::ToolUse, b);
    out.push_back(input_json_delta(index_, b.input.dump()));
  }
  return out;
}

std::vector<json> MessageStream::text(const std::string& t) {
  chat::Piece p;
  p.content = t;
  return push(p);
}

std::vector<json> MessageStream::finish() {
  std::vector<json> out;
  if (!open_) open(out, MessageBlock::Kind::Text, {MessageBlock::Kind::Text, "", "", "", nullptr});
  out.push_back(block_stop(index_));
  open_ = false;
  return out;
}

}  // namespace ds::infer::api
