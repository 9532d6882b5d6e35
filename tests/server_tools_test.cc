// The chat formats over a socket: a decoder stub answers a scripted text
// after the prompt the server renders (and the test checks that prompt
// token by token), so that the client's view of reasoning_content and
// tool_calls, whole and streamed, can be checked against what the model
// "said": a DSML call (deepseek-v4), a call the prompt forced
// (deepseek-v3.1, tool_choice naming a function), V3.1's thinking split, n
// choices each with their own calls, a broken call handed on as content,
// and the requests each format refuses; and through Anthropic's Messages
// API, the same answers as thinking, text and tool_use blocks.
#include <mutex>
#include <set>

#include "infer/anthropic_api.h"
#include "infer/chat_format.h"
#include "server_fixture.h"

namespace {
namespace server_tools_test {

namespace chat = ds::infer::chat;

// The test tokenizer's markers beyond the fixture's two chat tokens: V3.1's
// thinking and call tokens, so that each is one id as in DeepSeek's
// tokenizers.
constexpr int32_t kThink = 294, kVocab = 304;
const std::vector<std::string> kMarkers = {"<think>",
                                           "</think>",
                                           "<｜tool▁calls▁begin｜>",
                                           "<｜tool▁calls▁end｜>",
                                           "<｜tool▁call▁begin｜>",
                                           "<｜tool▁call▁end｜>",
                                           "<｜tool▁sep｜>",
                                           "<｜tool▁output▁begin｜>",
                                           "<｜tool▁output▁end｜>"};

std::string tools_tokenizer_json(size_t markers = kMarkers.size()) {
  json t = json::parse(chat_tokenizer_json());
  for (size_t i = 0; i < markers; ++i)
    t["added_tokens"].push_back(added_token(kThink + static_cast<int>(i), kMarkers[i]));
  return t.dump();
}

// A model that answers `script` after a prompt of `prompt_len` tokens, then
// EOS, whatever the prompt; it keeps the first prompt it is given.
class ScriptedDecoder : public ds::infer::Decoder {
 public:
  void expect(size_t prompt_len, std::vector<int32_t> script) {
    std::lock_guard lk(mu_);
    prompt_len_ = prompt_len;
    script_ = std::move(script);
    seen_.clear();
  }
  std::vector<int32_t> seen_prompt() {
    std::lock_guard lk(mu_);
    return seen_;
  }
  int64_t vocab_size() const override { return kVocab; }
  int64_t max_positions() const override { return 8192; }
  void start(int64_t sequences) override { hist_.assign(static_cast<size_t>(sequences), {}); }
  void reset(int64_t s) override { hist_[static_cast<size_t>(s)].clear(); }
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override {
    std::lock_guard lk(mu_);
    std::vector<float> rows;
    for (size_t s = 0; s < tokens.size(); ++s) {
      if (tokens[s].empty()) continue;
      auto& h = hist_[s];
      h.insert(h.end(), tokens[s].begin(), tokens[s].end());
      if (seen_.empty() && h.size() >= prompt_len_) seen_.assign(h.begin(), h.begin() + prompt_len_);
      const size_t made = h.size() >= prompt_len_ ? h.size() - prompt_len_ : 0;
      const int32_t next = made < script_.size() ? script_[made] : kEos;
      std::vector<float> row(kVocab, -1e4f);
      row[next] = 1e4f;
      rows.insert(rows.end(), row.begin(), row.end());
    }
    return rows;
  }
  int64_t length(int64_t s) const override { return static_cast<int64_t>(hist_[static_cast<size_t>(s)].size()); }
  size_t cache_bytes() const override { return 0; }

 private:
  std::mutex mu_;
  size_t prompt_len_ = 0;
  std::vector<int32_t> script_, seen_;
  std::vector<std::vector<int32_t>> hist_;
};

const json kWeather = json::parse(R"({"type": "function", "function": {"name": "get_weather",
    "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})");

class ServerToolsTest : public ::testing::Test {
 protected:
  // `call_tokens` false: a tokenizer with <think> and </think> but without
  // V3.1's call tokens.
  void start(chat::Format f, bool call_tokens = true) {
    stop();
    format_ = f;
    tok_ = std::make_unique<ds::io::Tokenizer>(ds::io::Tokenizer::from_json(tools_tokenizer_json(call_tokens ? 9 : 2)));
    batcher_ = std::make_unique<ds::infer::Batcher>(dec_, ds::infer::BatcherOptions{4, 256, 64, kEos, kVocab});
    ds::infer::ServedModel sm;
    sm.batcher = batcher_.get();
    sm.tokenizer = tok_.get();
    sm.chat_format = f;
    ds::infer::ServerOptions so;
    so.port = 0;
    server_ = std::make_unique<ds::infer::Server>(sm, so);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  void TearDown() override { stop(); }
  void stop() {
    if (!server_) return;
    batcher_->close();
    server_->stop();
    thread_.join();
    server_.reset();
  }

  // The prompt ids the server should send for `body`: its chat format's
  // text, encoded, the tokenizer's BOS first.
  // The prompt of a chat body; `tools_text` holds its tools in the order
  // the server reads them (default: the body's).
  std::vector<int32_t> prompt_ids(const json& body, const std::string& tools_text = "") {
    const chat::ojson tools = !tools_text.empty()      ? chat::ojson::parse(tools_text)["tools"]
                              : body.contains("tools") ? chat::ojson::parse(body["tools"].dump())
                                                       : chat::ojson();
    const std::string text = chat::render(format_, chat::read_conversation(body, tools, format_)).text;
    std::vector<int32_t> ids = tok_->encode(text.substr(chat::kBos.size()));
    ids.insert(ids.begin(), 285);
    return ids;
  }

  std::pair<int, std::string> post(const std::string& path, const std::string& body) {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    auto r = c.Post(path, body, "application/json");
    if (!r) return {-1, httplib::to_string(r.error())};
    return {r->status, r->body};
  }
  // Posts `body` after scripting `answer`; checks the prompt the model saw.
  std::pair<int, std::string> ask(json body, const std::string& answer) {
    const auto prompt = prompt_ids(body);
    dec_.expect(prompt.size(), tok_->encode(answer));
    auto [status, text] = post("/v1/chat/completions", body.dump());
    if (status == 200) {
      EXPECT_EQ(dec_.seen_prompt(), prompt);
    }
    return {status, text};
  }
  json ask_json(const json& body, const std::string& answer) {
    auto [status, text] = ask(body, answer);
    EXPECT_EQ(status, 200) << text;
    return json::parse(text);
  }
  // A streamed answer's deltas, merged: content and reasoning_content
  // joined, tool_calls gathered by index; and the finish_reason.
  json ask_stream(json body, const std::string& answer) {
    body["stream"] = true;
    auto [status, text] = ask(body, answer);
    EXPECT_EQ(status, 200) << text;
    const Events ev = parse_events(text);
    EXPECT_TRUE(ev.done);
    json merged = {{"content", ""}, {"reasoning_content", ""}, {"tool_calls", json::array()}};
    for (const auto& c : ev.chunks) {
      const json& ch = c["choices"][0];
      if (!ch["finish_reason"].is_null()) merged["finish_reason"] = ch["finish_reason"];
      const json& d = ch["delta"];
      for (const char* k : {"content", "reasoning_content"})
        if (d.contains(k)) merged[k] = merged[k].get<std::string>() + d[k].get<std::string>();
      if (d.contains("tool_calls"))
        for (const auto& call : d["tool_calls"]) {
          EXPECT_EQ(call["index"], merged["tool_calls"].size());
          merged["tool_calls"].push_back(call);
        }
    }
    return merged;
  }

  ScriptedDecoder dec_;
  chat::Format format_ = chat::Format::V3;
  std::unique_ptr<ds::io::Tokenizer> tok_;
  std::unique_ptr<ds::infer::Batcher> batcher_;
  std::unique_ptr<ds::infer::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

const std::string kDsmlCall =
    "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>";

TEST_F(ServerToolsTest, DsmlCallReachesTheClient) {
  start(chat::Format::V4);
  const json body = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
                     {"tools", {kWeather}},
                     {"max_tokens", 200},
                     {"temperature", 0}};
  const json r = ask_json(body, "Let me look." + kDsmlCall);
  const json& choice = r["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const json& m = choice["message"];
  EXPECT_EQ(m["content"], "Let me look.");
  EXPECT_FALSE(m.contains("reasoning_content"));  // thinking is off
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["type"], "function");
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  const std::string id = m["tool_calls"][0]["id"];
  EXPECT_TRUE(id.starts_with("call_")) << id;
  // Streamed: the same text and call, the call as one delta with its index.
  const json s = ask_stream(body, "Let me look." + kDsmlCall);
  EXPECT_EQ(s["content"], "Let me look.");
  ASSERT_EQ(s["tool_calls"].size(), 1u);
  EXPECT_EQ(s["tool_calls"][0]["function"], m["tool_calls"][0]["function"]);
  EXPECT_EQ(s["finish_reason"], "tool_calls");
  // The call's result goes back as a tool message; the next answer is text.
  json next = body;
  next["messages"].push_back(m);
  next["messages"].push_back({{"role", "tool"}, {"tool_call_id", id}, {"content", "18C, sunny"}});
  const json r2 = ask_json(next, "It is 18C and sunny.");
  EXPECT_EQ(r2["choices"][0]["message"]["content"], "It is 18C and sunny.");
  EXPECT_EQ(r2["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(r2["choices"][0]["message"].contains("tool_calls"));
}

TEST_F(ServerToolsTest, EachChoiceHasItsOwnCalls) {
  start(chat::Format::V4);
  const json body = {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
                     {"tools", {kWeather}},
                     {"n", 2},
                     {"max_tokens", 200},
                     {"thinking", true}};
  const json r = ask_json(body, "Paris, then.</think>" + kDsmlCall);
  ASSERT_EQ(r["choices"].size(), 2u);
  std::set<std::string> ids;
  for (const auto& c : r["choices"]) {
    EXPECT_EQ(c["message"]["reasoning_content"], "Paris, then.");
    EXPECT_TRUE(c["message"]["content"].is_null());
    ASSERT_EQ(c["message"]["tool_calls"].size(), 1u);
    ids.insert(c["message"]["tool_calls"][0]["id"].get<std::string>());
  }
  EXPECT_EQ(ids.size(), 2u);
}

TEST_F(ServerToolsTest, ABrokenCallIsContent) {
  start(chat::Format::V4);
  const std::string broken =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"delete_everything\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  const json body = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"tools", {kWeather}}, {"max_tokens", 200}};
  const json r = ask_json(body, "Sure." + broken);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "Sure." + broken);
  EXPECT_FALSE(r["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  const json s = ask_stream(body, "Sure." + broken);
  EXPECT_EQ(s["content"], "Sure." + broken);
  EXPECT_TRUE(s["tool_calls"].empty());
  // Cut off inside a call by max_tokens: the text so far, as content.
  json shorter = body;
  shorter["max_tokens"] = 12;
  const json cut = ask_json(shorter, "Sure." + kDsmlCall);
  EXPECT_EQ(cut["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(cut["choices"][0]["message"]["content"].get<std::string>().starts_with("Sure."));
  EXPECT_FALSE(cut["choices"][0]["message"].contains("tool_calls"));
}

TEST_F(ServerToolsTest, V31ThinkingAndAForcedCall) {
  start(chat::Format::V31);
  const json think = {{"messages", {{{"role", "user"}, {"content", "2+2?"}}}},
                      {"chat_template_kwargs", {{"thinking", true}}},
                      {"max_tokens", 100}};
  const json r = ask_json(think, "Four, simply.</think>4");
  EXPECT_EQ(r["choices"][0]["message"]["reasoning_content"], "Four, simply.");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "4");
  const json s = ask_stream(think, "Four, simply.</think>4");
  EXPECT_EQ(s["reasoning_content"], "Four, simply.");
  EXPECT_EQ(s["content"], "4");
  // After a tool's result the model goes straight on, without reasoning; the
  // answer still says it thought of nothing.
  const json after = {
      {"messages",
       {{{"role", "user"}, {"content", "Oslo?"}},
        {{"role", "assistant"},
         {"tool_calls",
          {{{"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Oslo\"}"}}}}}}},
        {{"role", "tool"}, {"content", "5C"}}}},
      {"thinking", true},
      {"max_tokens", 100}};
  const json a = ask_json(after, "5C in Oslo.");
  EXPECT_EQ(a["choices"][0]["message"]["content"], "5C in Oslo.");
  EXPECT_EQ(a["choices"][0]["message"]["reasoning_content"], "");
  // tool_choice names the function: the prompt already holds the call's
  // start, and the model writes its arguments.
  const json forced = {{"messages", {{{"role", "user"}, {"content", "Oslo"}}}},
                       {"tools", {kWeather}},
                       {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}},
                       {"max_tokens", 100}};
  const json f = ask_json(forced, "{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
  const json& m = f["choices"][0]["message"];
  EXPECT_TRUE(m["content"].is_null());
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Oslo\"}");
  EXPECT_EQ(f["choices"][0]["finish_reason"], "tool_calls");
}

// A Messages body's answer: the prompt is the chat path's for the same
// turns (api::messages_to_chat), its tools in the client's key order
// (api::messages_tools_text), whole and streamed.
class MessagesToolsTest : public ServerToolsTest {
 protected:
  std::pair<int, std::string> ask_messages(const json& body, const std::string& answer) {
    const auto prompt =
        prompt_ids(ds::infer::api::messages_to_chat(body), ds::infer::api::messages_tools_text(body.dump()));
    dec_.expect(prompt.size(), tok_->encode(answer));
    auto [status, text] = post("/v1/messages", body.dump());
    if (status == 200) {
      EXPECT_EQ(dec_.seen_prompt(), prompt);
    }
    return {status, text};
  }
};

const json kWeatherTool = json::parse(R"({"name": "get_weather", "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}})");

TEST_F(MessagesToolsTest, ToolUseAndThinkingAreBlocks) {
  start(chat::Format::V4);
  const json body = {{"model", "m"},
                     {"max_tokens", 200},
                     {"tools", {kWeatherTool}},
                     {"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}};
  auto [status, text] = ask_messages(body, "Let me look." + kDsmlCall);
  ASSERT_EQ(status, 200) << text;
  const json r = json::parse(text);
  EXPECT_EQ(r["stop_reason"], "tool_use");
  ASSERT_EQ(r["content"].size(), 2u) << text;
  EXPECT_EQ(r["content"][0], json({{"type", "text"}, {"text", "Let me look."}}));
  const json& use = r["content"][1];
  EXPECT_EQ(use["type"], "tool_use");
  EXPECT_EQ(use["name"], "get_weather");
  EXPECT_EQ(use["input"], json({{"city", "Paris"}}));
  const std::string id = use["id"];
  EXPECT_TRUE(id.starts_with("toolu_")) << id;
  // Streamed: a text block, then a tool_use block whose input comes whole.
  json streamed = body;
  streamed["stream"] = true;
  auto [s2, events] = ask_messages(streamed, "Let me look." + kDsmlCall);
  ASSERT_EQ(s2, 200);
  std::vector<std::string> kinds;
  std::string typed, input;
  size_t pos = 0;
  while ((pos = events.find("data: ", pos)) != std::string::npos) {
    const size_t end = events.find("\n\n", pos);
    const json e = json::parse(events.substr(pos + 6, end - pos - 6));
    pos = end;
    if (e["type"] == "content_block_start") kinds.push_back(e["content_block"]["type"]);
    if (e["type"] == "content_block_delta" && e["delta"]["type"] == "text_delta") typed += e["delta"]["text"];
    if (e["type"] == "content_block_delta" && e["delta"]["type"] == "input_json_delta")
      input += e["delta"]["partial_json"];
    if (e["type"] == "message_delta") {
      EXPECT_EQ(e["delta"]["stop_reason"], "tool_use");
    }
  }
  EXPECT_EQ(kinds, (std::vector<std::string>{"text", "tool_use"}));
  EXPECT_EQ(typed, "Let me look.");
  EXPECT_EQ(json::parse(input), json({{"city", "Paris"}}));
  // The result goes back as a tool_result block; the next answer is text.
  json next = body;
  next["messages"].push_back({{"role", "assistant"}, {"content", r["content"]}});
  next["messages"].push_back(
      {{"role", "user"}, {"content", {{{"type", "tool_result"}, {"tool_use_id", id}, {"content", "18C, sunny"}}}}});
  auto [s3, t3] = ask_messages(next, "It is 18C and sunny.");
  ASSERT_EQ(s3, 200) << t3;
  const json r3 = json::parse(t3);
  EXPECT_EQ(r3["content"], json::array({{{"type", "text"}, {"text", "It is 18C and sunny."}}}));
  EXPECT_EQ(r3["stop_reason"], "end_turn");
  // Thinking (V3.1): the reasoning is a thinking block before the text.
  start(chat::Format::V31);
  const json think = {{"model", "m"},
                      {"max_tokens", 2048},
                      {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}},
                      {"messages", {{{"role", "user"}, {"content", "2+2?"}}}}};
  auto [s4, t4] = ask_messages(think, "Four, simply.</think>4");
  ASSERT_EQ(s4, 200) << t4;
  const json r4 = json::parse(t4);
  ASSERT_EQ(r4["content"].size(), 2u) << t4;
  EXPECT_EQ(r4["content"][0]["type"], "thinking");
  EXPECT_EQ(r4["content"][0]["thinking"], "Four, simply.");
  EXPECT_EQ(r4["content"][1], json({{"type", "text"}, {"text", "4"}}));
}

TEST_F(ServerToolsTest, RefusalsNameTheirField) {
  auto refused = [&](const json& body, const std::string& param, const std::string& says) {
    auto [status, text] = post("/v1/chat/completions", body.dump());
    EXPECT_EQ(status, 400) << body.dump() << " -> " << text;
    const json e = json::parse(text);
    EXPECT_EQ(e["error"]["param"], param) << text;
    EXPECT_NE(e["error"]["message"].get<std::string>().find(says), std::string::npos) << text;
    EXPECT_EQ(e["error"]["message"].get<std::string>().find('\n'), std::string::npos) << text;
  };
  const json hi = {{{"role", "user"}, {"content", "hi"}}};
  start(chat::Format::V3);
  refused({{"messages", hi}, {"tools", {kWeather}}}, "tools", "not supported by the deepseek-v3 chat format");
  refused({{"messages", hi}, {"thinking", true}}, "thinking", "no thinking mode");
  start(chat::Format::V31);
  refused({{"messages", hi}, {"tools", {kWeather}}, {"thinking", true}}, "tools", "non-thinking mode only");
  refused({{"messages", hi}, {"tools", 5}}, "tools", "must be an array");
  refused({{"messages", hi}, {"tool_choice", "required"}}, "tool_choice", "no 'tools'");
  refused({{"messages", hi},
           {"tools", {kWeather}},
           {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}},
          "tool_choice", "not in 'tools'");
  refused({{"messages", hi}, {"reasoning_effort", "max"}}, "reasoning_effort", "only deepseek-v4");
  // Client text quoted in a refusal keeps it one line.
  refused({{"messages", {{{"role", "ro\nbot"}, {"content", "x"}}}}}, "messages[0]", "got \"ro\\nbot\"");
  // A "type" that is not a string is the field's refusal, not a library error.
  refused({{"messages", hi}, {"tools", {kWeather}}, {"tool_choice", {{"type", {{0}}}}}}, "tool_choice",
          "'tool_choice' must be");
  refused({{"messages", hi}, {"response_format", {{"type", 5}}}}, "response_format", "only {\"type\": \"text\"}");
  refused({{"messages", hi}, {"chat_template_kwargs", {{"foo", true}}}}, "chat_template_kwargs", "\"foo\"");
  start(chat::Format::V31, /*call_tokens=*/false);
  refused({{"messages", hi}, {"tools", {kWeather}}}, "tools", "no '<｜tool▁calls▁begin｜>' token");
  start(chat::Format::V4);
  refused({{"messages", {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "yo"}}}}},
          "messages", "ends with a user message");
  refused({{"messages", hi}, {"tools", {kWeather}}, {"tool_choice", "required"}, {"thinking", true}}, "tool_choice",
          "needs thinking off");
  // Completions take no tools.
  auto [status, text] = post("/v1/completions", R"({"prompt": "x", "tools": [{"type": "function"}]})");
  EXPECT_EQ(status, 400);
  EXPECT_EQ(json::parse(text)["error"]["param"], "tools");
}

}  // namespace server_tools_test
}  // namespace
