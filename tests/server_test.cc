// The HTTP server, driven over a socket as a client would: completions from
// token ids and text, streamed and whole, chat in DeepSeek's format, stop
// strings, concurrent clients and a client that goes away each make what
// generate() makes for the same prompt alone; every malformed or impossible
// request gets an HTTP error with OpenAI's error object.
#include "server_fixture.h"

namespace {
namespace server_test {

TEST_F(ServerTest, CompletionOfTokenIdsAndOfText) {
  const std::vector<int32_t> ids = {285, 40, 41, 42, 43, 44, 45, 46};  // longer than one prefill chunk
  json r = post_json("/v1/completions", {{"prompt", ids}, {"max_tokens", 7}, {"temperature", 0}});
  const auto want = alone(ids, 7);
  EXPECT_EQ(r["choices"][0]["token_ids"].get<std::vector<int32_t>>(), want);
  EXPECT_EQ(r["choices"][0]["text"], text_of(want));
  EXPECT_EQ(r["choices"][0]["finish_reason"], want.back() == kEos ? "stop" : "length");
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["model"], "tiny");
  EXPECT_EQ(r["usage"]["prompt_tokens"], 8);
  EXPECT_EQ(r["usage"]["completion_tokens"], want.size());
  EXPECT_EQ(r["usage"]["total_tokens"], 8 + want.size());

  // Text: encoded with the BOS, as `deepseek generate` does.
  const auto text_ids = tok_->encode("hello world", true);
  ASSERT_EQ(text_ids.front(), 285);
  const ds::infer::SamplerConfig s{0.9f, 20, 0.95f, 77};
  r = post_json("/v1/completions",
                {{"prompt", "hello world"}, {"max_tokens", 9}, {"temperature", 0.9}, {"top_k", 20}, {"top_p", 0.95},
                 {"seed", 77}});
  EXPECT_EQ(r["choices"][0]["token_ids"].get<std::vector<int32_t>>(), alone(text_ids, 9, s));
  EXPECT_EQ(r["usage"]["prompt_tokens"], text_ids.size());
  // The same seed gives the same tokens; a one-element prompt array is the prompt.
  json again = post_json("/v1/completions", {{"prompt", json::array({"hello world"})},
                                             {"max_tokens", 9},
                                             {"temperature", 0.9},
                                             {"top_k", 20},
                                             {"top_p", 0.95},
                                             {"seed", 77}});
  EXPECT_EQ(again["choices"][0]["token_ids"], r["choices"][0]["token_ids"]);
}

TEST_F(ServerTest, StreamedEqualsWhole) {
  const json req = {{"prompt", "hello world"}, {"max_tokens", 12}, {"temperature", 0}};
  const json whole = post_json("/v1/completions", req);
  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  auto [status, body] = post("/v1/completions", sreq.dump());
  ASSERT_EQ(status, 200) << body;
  const Events ev = parse_events(body);
  ASSERT_TRUE(ev.done);
  ASSERT_GE(ev.chunks.size(), 3u);
  std::string text;
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < ev.chunks.size(); ++i) {
    const json& c = ev.chunks[i]["choices"][0];
    text += c["text"].get<std::string>();
    for (int32_t t : c["token_ids"]) ids.push_back(t);
    if (i + 2 < ev.chunks.size()) {
      EXPECT_TRUE(c["finish_reason"].is_null());
    }
  }
  EXPECT_EQ(text, whole["choices"][0]["text"]);
  EXPECT_EQ(ids, whole["choices"][0]["token_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(ev.chunks[ev.chunks.size() - 2]["choices"][0]["finish_reason"], whole["choices"][0]["finish_reason"]);
  EXPECT_EQ(ev.chunks.back()["usage"], whole["usage"]);
  EXPECT_TRUE(ev.chunks.back()["choices"].empty());
}

TEST_F(ServerTest, ChatInDeepSeeksFormat) {
  // BOS, the system text, then <｜User｜> and <｜Assistant｜> around the turns.
  std::vector<int32_t> prompt = {285};
  for (int32_t t : tok_->encode("be brief", false)) prompt.push_back(t);
  prompt.push_back(kUser);
  for (int32_t t : tok_->encode("hello", false)) prompt.push_back(t);
  prompt.push_back(kAssistant);
  for (int32_t t : tok_->encode("hi", false)) prompt.push_back(t);
  prompt.push_back(kEos);
  prompt.push_back(kUser);
  for (int32_t t : tok_->encode("world", false)) prompt.push_back(t);
  prompt.push_back(kAssistant);
  const json messages = json::array({{{"role", "system"}, {"content", "be brief"}},
                                     {{"role", "user"}, {"content", "hello"}},
                                     {{"role", "assistant"}, {"content", "hi"}},
                                     {{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "wor"}},
                                                                                  {{"type", "text"}, {"text", "ld"}}})}}});
  const json r = post_json("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 6}, {"temperature", 0}});
  const auto want = alone(prompt, 6);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(r["choices"][0]["token_ids"].get<std::vector<int32_t>>(), want);
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["message"]["content"], text_of(want));

  auto [status, body] =
      post("/v1/chat/completions", json{{"messages", messages}, {"max_tokens", 6}, {"temperature", 0}, {"stream", true}}
                                       .dump());
  ASSERT_EQ(status, 200);
  const Events ev = parse_events(body);
  ASSERT_TRUE(ev.done);
  EXPECT_EQ(ev.chunks.front()["object"], "chat.completion.chunk");
  EXPECT_EQ(ev.chunks.front()["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  for (const auto& c : ev.chunks) {
    const json& d = c["choices"][0]["delta"];
    if (d.contains("content")) content += d["content"].get<std::string>();
  }
  EXPECT_EQ(content, r["choices"][0]["message"]["content"]);
  EXPECT_EQ(ev.chunks.back()["choices"][0]["finish_reason"], r["choices"][0]["finish_reason"]);
  // No token at all: the role still comes first, then the end.
  auto [s0, b0] = post("/v1/chat/completions", json{{"messages", messages}, {"max_tokens", 0}, {"stream", true}}.dump());
  ASSERT_EQ(s0, 200);
  const Events none = parse_events(b0);
  ASSERT_EQ(none.chunks.size(), 2u) << b0;
  EXPECT_EQ(none.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(none.chunks[1]["choices"][0]["finish_reason"], "length");
}

TEST_F(ServerTest, StopStringsEndTheText) {
  // A greedy run without stop strings, then stops cut from its text.
  const json base = {{"prompt", "hello world"}, {"max_tokens", 16}, {"temperature", 0}};
  const std::string full = post_json("/v1/completions", base)["choices"][0]["text"];
  ASSERT_GE(full.size(), 8u) << "the random model's continuation is too short to cut";
  for (size_t at : {size_t{0}, size_t{3}, full.size() - 2}) {
    // Two ASCII bytes (or whole characters) of the text as the stop string.
    while (at > 0 && (static_cast<unsigned char>(full[at]) & 0xC0) == 0x80) --at;
    size_t len = 2;
    while (at + len < full.size() && (static_cast<unsigned char>(full[at + len]) & 0xC0) == 0x80) ++len;
    const std::string stop = full.substr(at, len);
    const std::string want = full.substr(0, full.find(stop));
    json req = base;
    req["stop"] = json::array({"never appears \x01", stop});
    const json r = post_json("/v1/completions", req);
    EXPECT_EQ(r["choices"][0]["text"], want) << "stop '" << stop << "'";
    EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
    req["stream"] = true;
    auto [status, body] = post("/v1/completions", req.dump());
    ASSERT_EQ(status, 200);
    std::string streamed;
    const Events ev = parse_events(body);
    for (const auto& c : ev.chunks) streamed += c["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(streamed, want) << "streamed, stop '" << stop << "'";
    EXPECT_EQ(ev.chunks.back()["choices"][0]["finish_reason"], "stop");
  }
}

TEST_F(ServerTest, ConcurrentClientsEachGetTheirOwnTokens) {
  // Six clients at once on four slots, prompts of different lengths.
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p = {285};
    for (int j = 0; j <= 3 * i; ++j) p.push_back(static_cast<int32_t>(20 + (7 * i + 3 * j) % 200));
    prompts.push_back(p);
  }
  std::vector<json> got(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i)
    clients.emplace_back([&, i] {
      auto [status, body] = post("/v1/completions", json{{"prompt", prompts[i]},
                                                          {"max_tokens", 5 + i},
                                                          {"temperature", 0},
                                                          {"stream", i % 2 == 1}}
                                                         .dump());
      got[i] = json{{"status", status}, {"body", body}};
    });
  for (auto& c : clients) c.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i]["status"], 200) << got[i]["body"];
    const std::string body = got[i]["body"];
    std::vector<int32_t> ids;
    if (i % 2 == 1) {
      for (const auto& c : parse_events(body).chunks)
        for (int32_t t : c["choices"][0]["token_ids"]) ids.push_back(t);
    } else {
      ids = json::parse(body)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    }
    EXPECT_EQ(ids, alone(prompts[i], static_cast<int64_t>(5 + i))) << "client " << i;
  }
}

TEST_F(ServerTest, AClientThatGoesAwayFreesItsSlot) {
  stop();
  fs::remove_all(dir_);
  // One slot, nobody may wait: a second request while the first runs is 503.
  start(ds::infer::BatcherOptions{1, 0, 512, kEos, 294}, /*slow=*/true);
  const std::vector<int32_t> first = {285, 50, 51};
  auto c = client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  // 100 tokens whatever the model says (about 2 s); the client leaves after
  // 3 chunks.
  req.body =
      json{{"prompt", first}, {"max_tokens", 100}, {"temperature", 0}, {"stream", true}, {"ignore_eos", true}}.dump();
  int chunks = 0;
  bool busy_checked = false;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    chunks += static_cast<int>(std::count(data, data + n, '\n')) / 2;
    if (!busy_checked) {
      busy_checked = true;
      expect_refused("/v1/completions", R"({"prompt": [1, 2], "max_tokens": 2})", 503, "every slot is busy");
    }
    return chunks < 3;
  };
  httplib::Response res;
  httplib::Error err;
  c.send(req, res, err);
  EXPECT_TRUE(busy_checked);
  // The slot is freed within a few steps, long before the 97 steps (about
  // 2 s) the generation had left: the next request runs, and what it makes
  // is its own.
  const auto left = std::chrono::steady_clock::now();
  const std::vector<int32_t> p = {285, 60, 61};
  std::pair<int, std::string> r;
  double waited = 0;
  do {
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - left).count();
    r = post("/v1/completions", json{{"prompt", p}, {"max_tokens", 4}, {"temperature", 0}}.dump());
    if (r.first == 503) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (r.first == 503 && waited < 5);
  ASSERT_EQ(r.first, 200) << r.second;
  EXPECT_LT(waited, 1.2) << "the slot was freed only when the generation ended by itself";
  EXPECT_EQ(json::parse(r.second)["choices"][0]["token_ids"].get<std::vector<int32_t>>(), alone(p, 4));
}

TEST_F(ServerTest, BadRequestsGetOneLineErrors) {
  const std::string C = "/v1/completions", Chat = "/v1/chat/completions";
  expect_refused(C, "{bad", 400, "not valid JSON");
  expect_refused(C, "{\"prompt\": \"\xff\xfe\"}", 400, "not valid JSON");  // not UTF-8, quoted in the message
  expect_refused(C, "[1, 2]", 400, "must be a JSON object");
  expect_refused(C, "{}", 400, "'prompt' is missing", "prompt");
  expect_refused(C, R"({"prompt": 5})", 400, "must be a string or an array", "prompt");
  expect_refused(C, R"({"prompt": [1, "a"]})", 400, "token ids", "prompt");
  expect_refused(C, R"({"prompt": [1, -2]})", 400, "token ids", "prompt");
  expect_refused(C, R"({"prompt": ["a", "b"]})", 400, "one prompt per request", "prompt");
  expect_refused(C, R"({"prompt": [[1], [2]]})", 400, "one prompt per request", "prompt");
  expect_refused(C, R"({"prompt": []})", 400, "the prompt is empty", "prompt");
  expect_refused(C, R"({"prompt": [1, 300]})", 400, "outside the vocabulary");
  expect_refused(C, json{{"prompt", std::vector<int32_t>(129, 5)}}.dump(), 400, "beyond the model's 128 positions",
                 "prompt");
  expect_refused(C, R"({"prompt": [1], "max_tokens": -1})", 400, "'max_tokens' must be in", "max_tokens");
  expect_refused(C, R"({"prompt": [1], "max_tokens": "8"})", 400, "'max_tokens' must be an integer", "max_tokens");
  expect_refused(C, R"({"prompt": [1], "max_tokens": 18446744073709551615})", 400, "'max_tokens' must be in");
  expect_refused(C, R"({"prompt": [1], "max_tokens": 200000})", 400, "would not fit", "max_tokens");
  expect_refused(C, R"({"prompt": [1], "temperature": 3})", 400, "'temperature' must be in", "temperature");
  expect_refused(C, R"({"prompt": [1], "temperature": "hot"})", 400, "must be a number", "temperature");
  expect_refused(C, R"({"prompt": [1], "top_p": 0})", 400, "'top_p'", "top_p");
  expect_refused(C, R"({"prompt": [1], "top_k": -2})", 400, "'top_k' must be in", "top_k");
  expect_refused(C, R"({"prompt": [1], "seed": 1.5})", 400, "'seed' must be an integer", "seed");
  expect_refused(C, R"({"prompt": [1], "stream": "yes"})", 400, "true or false", "stream");
  expect_refused(C, R"({"prompt": [1], "ignore_eos": 1})", 400, "true or false", "ignore_eos");
  expect_refused(C, R"({"prompt": [1], "stop": 3})", 400, "'stop' must be", "stop");
  expect_refused(C, R"({"prompt": [1], "stop": [""]})", 400, "must not be empty", "stop");
  expect_refused(C, R"({"prompt": [1], "best_of": 2})", 400, "'best_of' is not supported", "best_of");
  expect_refused(C, R"({"prompt": [1], "model": 7})", 400, "'model' must be a string", "model");
  expect_refused(C, R"({"prompt": "\ud800"})", 400, "");  // a lone surrogate: not UTF-8 text
  // A chat's default budget runs to the model's last position (128 here),
  // beyond the 120 tokens the check allows: the message says what to set.
  expect_refused(Chat, R"({"messages": [{"role": "user", "content": "hi"}]})", 400,
                 "would not fit; set 'max_tokens' to ask for fewer tokens", "max_tokens");
  expect_refused(Chat, R"({"messages": []})", 400, "'messages' must be", "messages");
  expect_refused(Chat, R"({"messages": [{"content": "hi"}]})", 400, "string 'role'", "messages[0]");
  expect_refused(Chat, R"({"messages": [{"role": "robot", "content": "hi"}]})", 400,
                 "system, developer, user, assistant or tool", "messages[0]");
  expect_refused(Chat, R"({"messages": [{"role": "user", "content": 5}]})", 400, "must be a string", "messages[0]");
  expect_refused(Chat, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400, "parts must be",
                 "messages[0]");
  expect_refused(Chat, R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]})", 400,
                 "'tools' is not supported", "tools");
  expect_refused(Chat, R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json"}})", 400,
                 "'response_format' is not supported", "response_format");
  // Routes and sizes.
  auto c = client();
  auto r = c.Get("/v1/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_NE(json::parse(r->body)["error"]["message"].get<std::string>().find("no route GET /v1/nothing"),
            std::string::npos);
  r = c.Get("/v1/completions");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  expect_refused(C, json{{"prompt", std::string(size_t{2} << 20, 'a')}}.dump(), 413, "too large");
  // The server still serves.
  const json ok = post_json(C, {{"prompt", {285, 1}}, {"max_tokens", 2}, {"temperature", 0}});
  EXPECT_EQ(ok["choices"][0]["token_ids"].get<std::vector<int32_t>>(), alone({285, 1}, 2));
}

TEST_F(ServerTest, ModelsAndHealth) {
  auto c = client();
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  const json m = json::parse(r->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["max_model_len"], 128);
  r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["status"], "ok");
}

TEST_F(ServerTest, WithoutATokenizerPromptsAreTokenIds) {
  stop();
  ds::infer::ServedModel sm;
  batcher_ = std::make_unique<ds::infer::Batcher>(*served_dec_, ds::infer::BatcherOptions{2});
  sm.batcher = batcher_.get();
  ds::infer::ServerOptions so;
  so.port = 0;
  server_ = std::make_unique<ds::infer::Server>(sm, so);
  port_ = server_->bind();
  thread_ = std::thread([this] { server_->run(); });
  const json r = post_json("/v1/completions", {{"prompt", {5, 6, 7}}, {"max_tokens", 3}, {"temperature", 0}});
  GenerateOptions opt;
  opt.max_new_tokens = 3;
  EXPECT_EQ(r["choices"][0]["token_ids"].get<std::vector<int32_t>>(), ds::infer::generate(*ref_dec_, {{5, 6, 7}}, opt)[0]);
  EXPECT_EQ(r["choices"][0]["text"], "");
  expect_refused("/v1/completions", R"({"prompt": "hello"})", 400, "no tokenizer.json", "prompt");
  expect_refused("/v1/completions", R"({"prompt": [1], "stop": "x"})", 400, "no tokenizer.json", "stop");
  expect_refused("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}]})", 400,
                 "no tokenizer.json", "messages");
}

TEST_F(ServerTest, ShutdownEndsOpenStreams) {
  stop();
  fs::remove_all(dir_);
  start(ds::infer::BatcherOptions{1, 256, 512, kEos, 294}, /*slow=*/true);
  auto c = client();
  std::string body;
  std::thread reader([&] {
    auto r = c.Post("/v1/completions",
                    json{{"prompt", {285, 50}}, {"max_tokens", 100}, {"stream", true}, {"temperature", 0},
                         {"ignore_eos", true}}
                        .dump(),
                    "application/json");
    if (r) body = r->body;
  });
  // Wait until the request runs, then shut down.
  for (int i = 0; i < 500 && batcher_->running() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  batcher_->close();
  reader.join();
  const Events ev = parse_events(body);
  ASSERT_FALSE(ev.chunks.empty()) << body;
  EXPECT_TRUE(ev.done);
  EXPECT_EQ(ev.chunks.back()["error"]["message"], "the server is shutting down");
  expect_refused("/v1/completions", R"({"prompt": [1]})", 503, "shutting down");
}

}  // namespace server_test
}  // namespace
