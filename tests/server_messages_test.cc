// Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens)
// over a socket: the answer is the chat path's (the same prompt, the same
// tokens as /v1/chat/completions and generate() alone), in Anthropic's
// shapes whole and streamed (its event order, the text of the deltas), with
// each stop reason; the body's translation into the chat path (system,
// turns, tool-use and tool-result blocks, thinking, tools, tool_choice) as
// exact JSON; and Anthropic's error object for every bad field, naming it.
#include "infer/anthropic_api.h"
#include "server_fixture.h"

namespace {
namespace server_messages_test {

using ServerMessagesTest = ServerTest;

// The server-sent events of a Messages stream: (event name, data).
std::vector<std::pair<std::string, json>> message_events(const std::string& body) {
  std::vector<std::pair<std::string, json>> out;
  size_t pos = 0;
  while ((pos = body.find("event: ", pos)) != std::string::npos) {
    const size_t nl = body.find('\n', pos), data = body.find("data: ", nl), end = body.find("\n\n", data);
    out.emplace_back(body.substr(pos + 7, nl - pos - 7), json::parse(body.substr(data + 6, end - data - 6)));
    pos = end;
  }
  return out;
}

const json kTurns = json::array({{{"role", "user"}, {"content", "hello"}},
                                 {{"role", "assistant"}, {"content", "hi"}},
                                 {{"role", "user"}, {"content", "world"}}});

TEST_F(ServerMessagesTest, AnswersWhatTheChatPathMakes) {
  const json chat = post_json(
      "/v1/chat/completions",
      {{"messages", json::array({{{"role", "system"}, {"content", "be brief"}}, kTurns[0], kTurns[1], kTurns[2]})},
       {"max_tokens", 6},
       {"temperature", 0}});
  const json r = post_json(
      "/v1/messages",
      {{"model", "tiny"}, {"system", "be brief"}, {"messages", kTurns}, {"max_tokens", 6}, {"temperature", 0}});
  const auto ids = chat["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  EXPECT_EQ(r["type"], "message");
  EXPECT_EQ(r["role"], "assistant");
  EXPECT_EQ(r["model"], "tiny");
  EXPECT_EQ(r["id"].get<std::string>().rfind("msg_", 0), 0u);
  ASSERT_EQ(r["content"].size(), 1u);
  EXPECT_EQ(r["content"][0]["type"], "text");
  EXPECT_EQ(r["content"][0]["text"], chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
  EXPECT_EQ(r["usage"]["output_tokens"], ids.size());
  EXPECT_EQ(r["stop_reason"], chat["choices"][0]["finish_reason"] == "length" ? "max_tokens" : "end_turn");
  EXPECT_TRUE(r["stop_sequence"].is_null());
  // The system prompt as text blocks reads the same; count_tokens counts it.
  const json blocks = json::array({{{"type", "text"}, {"text", "be "}}, {{"type", "text"}, {"text", "brief"}}});
  const json counted =
      post_json("/v1/messages/count_tokens", {{"model", "tiny"}, {"system", blocks}, {"messages", kTurns}});
  EXPECT_EQ(counted["input_tokens"], chat["usage"]["prompt_tokens"]);
}

TEST_F(ServerMessagesTest, StreamsAnthropicsEventsInOrder) {
  const json body = {{"model", "tiny"}, {"messages", kTurns}, {"max_tokens", 6}, {"temperature", 0}};
  const json whole = post_json("/v1/messages", body);
  json streamed = body;
  streamed["stream"] = true;
  auto [status, text] = post("/v1/messages", streamed.dump());
  ASSERT_EQ(status, 200) << text;
  const auto events = message_events(text);
  ASSERT_GE(events.size(), 6u) << text;
  std::vector<std::string> names;
  std::string deltas;
  for (const auto& [name, data] : events) {
    EXPECT_EQ(data["type"], name);  // each event's name is its data's type
    if (names.empty() || names.back() != name) names.push_back(name);
    if (name == "content_block_delta") {
      EXPECT_EQ(data["index"], 0);
      EXPECT_EQ(data["delta"]["type"], "text_delta");
      deltas += data["delta"]["text"].get<std::string>();
    }
  }
  const std::vector<std::string> order = {
      "message_start",      "ping",          "content_block_start", "content_block_delta",
      "content_block_stop", "message_delta", "message_stop"};
  if (deltas.empty()) names.insert(names.begin() + 3, "content_block_delta");  // no text: no delta
  EXPECT_EQ(names, order) << text;
  EXPECT_EQ(deltas, whole["content"][0]["text"]);
  const json& start = events.front().second["message"];
  EXPECT_EQ(start["usage"]["input_tokens"], whole["usage"]["input_tokens"]);
  EXPECT_TRUE(start["stop_reason"].is_null());
  const json& delta = events[events.size() - 2].second;
  EXPECT_EQ(delta["delta"]["stop_reason"], whole["stop_reason"]);
  EXPECT_EQ(delta["usage"]["output_tokens"], whole["usage"]["output_tokens"]);
}

TEST_F(ServerMessagesTest, SaysWhichStopEndedTheAnswer) {
  // Six tokens without a stop; then a stop string cut from their text.
  const json body = {{"model", "tiny"}, {"messages", kTurns}, {"max_tokens", 6}, {"temperature", 0}, {"top_k", 1}};
  const json free = post_json("/v1/messages", body);
  const std::string text = free["content"][0]["text"];
  ASSERT_GE(text.size(), 4u) << "the tiny model's six tokens make text";
  EXPECT_EQ(free["stop_reason"], "max_tokens");
  json stopped = body;
  // One whole UTF-8 character from the middle of the text.
  size_t at = text.size() / 2;
  while (at > 0 && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) --at;
  const unsigned char lead = static_cast<unsigned char>(text[at]);
  const std::string stop = text.substr(at, lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4);
  stopped["stop_sequences"] = {stop, "never appears"};
  const json r = post_json("/v1/messages", stopped);
  EXPECT_EQ(r["stop_reason"], "stop_sequence");
  EXPECT_EQ(r["stop_sequence"], stop);
  EXPECT_EQ(r["content"][0]["text"], text.substr(0, text.find(stop)));
}

TEST_F(ServerMessagesTest, RefusesBadFieldsWithAnthropicsErrorNamingThem) {
  auto refused = [&](const json& body, const std::string& says, int status = 400) {
    auto [s, text] = post("/v1/messages", body.dump());
    EXPECT_EQ(s, status) << text;
    const json e = json::parse(text);
    EXPECT_EQ(e["type"], "error") << text;
    EXPECT_EQ(e["error"]["type"], status == 400 ? "invalid_request_error" : "api_error") << text;
    EXPECT_NE(e["error"]["message"].get<std::string>().find(says), std::string::npos) << text;
  };
  const json ok = {{"model", "tiny"}, {"messages", kTurns}, {"max_tokens", 4}};
  auto with = [&](const char* key, const json& v) {
    json b = ok;
    b[key] = v;
    return b;
  };
  json no_max = ok;
  no_max.erase("max_tokens");
  refused(no_max, "'max_tokens' is required");
  json no_model = ok;
  no_model.erase("model");
  refused(no_model, "'model'");
  refused(with("max_tokens", 0), "'max_tokens'");
  refused(with("temperature", 1.5), "'temperature'");
  refused(with("top_p", "high"), "'top_p'");
  refused(with("stop_sequences", "end"), "'stop_sequences'");
  refused(with("stop_sequences", json::array({""})), "'stop_sequences'");  // read_request's, renamed
  refused(with("messages", json::array()), "'messages'");
  refused(with("messages", json::array({{{"role", "system"}, {"content", "x"}}})), "messages.0.role");
  refused(with("messages",
               json::array({{{"role", "user"}, {"content", json::array({{{"type", "image"}, {"source", "x"}}})}}})),
          "image blocks are not supported");
  refused(with("messages", json::array({kTurns[0], kTurns[1]})), "prefill");
  refused(with("system", 3), "'system'");
  refused(with("metadata", "x"), "'metadata'");
  refused(with("tool_choice", {{"type", "sometimes"}}), "'tool_choice'");
  refused(with("tools", json::array({{{"type", "web_search_20250305"}, {"name", "web_search"}}})), "only client tools");
  refused(with("thinking", {{"type", "enabled"}, {"budget_tokens", 10}}), "'thinking.budget_tokens'");
  refused(with("thinking", {{"type", "sometimes"}}), "'thinking'");
  auto [s, text] = post("/v1/messages", "{\"model\": ");
  EXPECT_EQ(s, 400);
  EXPECT_EQ(json::parse(text)["type"], "error");
}

TEST(MessagesToChat, TurnsToolsAndThinkingBecomeTheChatBody) {
  const json body = {
      {"model", "m"},
      {"max_tokens", 2048},
      {"system", json::array({{{"type", "text"}, {"text", "sys"}}})},
      {"stop_sequences", json::array({"END"})},
      {"temperature", 0.5},
      {"top_k", 3},
      {"stream", true},
      {"metadata", {{"user_id", "u"}}},
      {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}},
      {"tools", json::array({{{"name", "get_weather"},
                              {"description", "the weather"},
                              {"input_schema", {{"type", "object"}, {"properties", json::object()}}}}})},
      {"tool_choice", {{"type", "tool"}, {"name", "get_weather"}}},
      {"messages",
       json::array(
           {{{"role", "user"}, {"content", "weather?"}},
            {{"role", "assistant"},
             {"content",
              json::array(
                  {{{"type", "thinking"}, {"thinking", "look it up"}, {"signature", ""}},
                   {{"type", "text"}, {"text", "Let me check."}},
                   {{"type", "tool_use"}, {"id", "t1"}, {"name", "get_weather"}, {"input", {{"city", "Paris"}}}}})}},
            {{"role", "user"},
             {"content", json::array({{{"type", "tool_result"},
                                       {"tool_use_id", "t1"},
                                       {"content", json::array({{{"type", "text"}, {"text", "sunny"}}})}},
                                      {{"type", "text"}, {"text", "thanks"}}})}}})}};
  const json want = {
      {"model", "m"},
      {"max_tokens", 2048},
      {"stop", json::array({"END"})},
      {"temperature", 0.5},
      {"top_k", 3},
      {"stream", true},
      {"chat_template_kwargs", {{"thinking", true}}},
      {"tools", json::array({{{"type", "function"},
                              {"function",
                               {{"name", "get_weather"},
                                {"description", "the weather"},
                                {"parameters", {{"type", "object"}, {"properties", json::object()}}}}}}})},
      {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}},
      {"messages",
       json::array({{{"role", "system"}, {"content", "sys"}},
                    {{"role", "user"}, {"content", "weather?"}},
                    {{"role", "assistant"},
                     {"content", "Let me check."},
                     {"reasoning_content", "look it up"},
                     {"tool_calls",
                      json::array({{{"id", "t1"},
                                    {"type", "function"},
                                    {"function", {{"name", "get_weather"}, {"arguments", "{\"city\":\"Paris\"}"}}}}})}},
                    {{"role", "tool"}, {"tool_call_id", "t1"}, {"content", "sunny"}},
                    {{"role", "user"}, {"content", "thanks"}}})}};
  EXPECT_EQ(ds::infer::api::messages_to_chat(body), want) << ds::infer::api::messages_to_chat(body).dump(1);
}

// The chat formats print tool schemas as JSON, so the prompt depends on
// their key order: the client's, as on the chat route, with the function's
// keys in OpenAI's order (name, description, parameters).
TEST(MessagesToChat, ToolsKeepTheClientsKeyOrder) {
  const std::string body = R"({"model": "m", "max_tokens": 1, "messages": [], "tools": [
      {"input_schema": {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}},
       "name": "f", "description": "d"}, {"name": "g", "input_schema": {"type": "object"}}]})";
  EXPECT_EQ(ds::infer::api::messages_tools_text(body),
            R"({"tools":[{"type":"function","function":{"name":"f","description":"d","parameters":)"
            R"({"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}}}},)"
            R"({"type":"function","function":{"name":"g","parameters":{"type":"object"}}}]})");
  EXPECT_EQ(ds::infer::api::messages_tools_text(R"({"model": "m", "tools": []})"), "");
}

TEST(MessagesToChat, RefusalsOfTheChatPathNameTheMessagesField) {
  using ds::infer::api::Refusal;
  const Refusal r = ds::infer::api::messages_refusal({400, "'stop' strings must not be empty", "stop"});
  EXPECT_EQ(r.param, "stop_sequences");
  EXPECT_EQ(r.message, "'stop_sequences' strings must not be empty");
  EXPECT_EQ(ds::infer::api::messages_error_body({503, "busy", ""})["error"]["type"], "overloaded_error");
}

}  // namespace server_messages_test
}  // namespace
