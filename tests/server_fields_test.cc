// The server's OpenAI fields beyond a plain completion, over a socket:
// log-probabilities (completions' logprobs and echo, chat's logprobs and
// top_logprobs) against the model's own logits as `deepseek logits` computes
// them, n choices with per-choice seeds, penalties and logit_bias against a
// reference applied by hand, refusals of bad values, and GET /metrics in
// Prometheus' text format.
#include <map>
#include <regex>
#include <sstream>

#include "infer/model.h"
#include "server_fixture.h"

namespace {
namespace server_fields_test {

constexpr int64_t kDrawVocab = 294;  // the fixture's sample_vocab

// The logits [T, vocab] of every position of `ids`, as `deepseek logits`
// computes them (one forward over the whole sequence).
std::vector<float> model_logits(const std::string& dir, const std::vector<int32_t>& ids, int64_t* vocab) {
  auto m = ds::infer::open_model(dir);
  m->load();
  *vocab = m->vocab_size();
  return m->logits(ids, 0, ds::infer::CacheKind::Latent, nullptr);
}

// log-softmax of row r at id, in double.
double log_softmax(const std::vector<float>& lg, int64_t V, int64_t r, int32_t id) {
  const float* row = lg.data() + r * V;
  double mx = row[0], z = 0;
  for (int64_t i = 1; i < V; ++i) mx = std::max<double>(mx, row[i]);
  for (int64_t i = 0; i < V; ++i) z += std::exp(row[i] - mx);
  return row[id] - mx - std::log(z);
}

// The k most likely ids of row r below kDrawVocab.
std::vector<int32_t> top_ids(const std::vector<float>& lg, int64_t V, int64_t r, int k) {
  std::vector<int32_t> ids(kDrawVocab);
  for (int32_t i = 0; i < kDrawVocab; ++i) ids[i] = i;
  const float* row = lg.data() + r * V;
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  ids.resize(k);
  return ids;
}

using ServerFieldsTest = ServerTest;

TEST_F(ServerFieldsTest, EchoWithoutNewTokensGivesThePromptsLogprobs) {
  // Longer than the fixture's 6-token prefill chunk: the prompt is read in
  // two steps, the second through the cache.
  const std::vector<int32_t> ids = {285, 40, 41, 42, 43, 44, 45, 46, 47, 48};
  int64_t V = 0;
  const auto ref = model_logits(dir_, ids, &V);
  const json r = post_json("/v1/completions", {{"prompt", ids}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 3}});
  const json& c = r["choices"][0];
  EXPECT_EQ(c["text"], tok_->decode(ids, true));
  EXPECT_EQ(c["finish_reason"], "length");
  EXPECT_TRUE(c["token_ids"].empty());
  EXPECT_EQ(r["usage"]["completion_tokens"], 0);
  const json& lp = c["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size());
  ASSERT_EQ(lp["token_logprobs"].size(), ids.size());
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["text_offset"][0], 0);
  for (size_t t = 1; t < ids.size(); ++t) {
    EXPECT_NEAR(lp["token_logprobs"][t].get<double>(), log_softmax(ref, V, t - 1, ids[t]), 1e-5) << t;
    EXPECT_EQ(lp["tokens"][t], tok_->decode(std::vector<int32_t>{ids[t]}));
    // By text: two ids of one text (byte pieces decode to U+FFFD) keep the likelier.
    json want = json::object();
    for (int32_t id : top_ids(ref, V, t - 1, 3)) {
      const std::string name = tok_->decode(std::vector<int32_t>{id});
      if (!want.contains(name)) want[name] = log_softmax(ref, V, t - 1, id);
    }
    const json& top = lp["top_logprobs"][t];
    ASSERT_EQ(top.size(), want.size()) << top << " against " << want;
    for (const auto& [name, v] : want.items()) {
      ASSERT_TRUE(top.contains(name)) << name << " in " << top;
      EXPECT_NEAR(top[name].get<double>(), v.get<double>(), 1e-5);
    }
    EXPECT_GE(lp["text_offset"][t].get<int64_t>(), lp["text_offset"][t - 1].get<int64_t>());
  }
  // Streamed: the echo is one event, then the end.
  json sreq = {{"prompt", ids}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}, {"stream", true}};
  auto [status, body] = post("/v1/completions", sreq.dump());
  ASSERT_EQ(status, 200) << body;
  const Events ev = parse_events(body);
  ASSERT_EQ(ev.chunks.size(), 2u) << body;
  EXPECT_EQ(ev.chunks[0]["choices"][0]["text"], c["text"]);
  EXPECT_EQ(ev.chunks[0]["choices"][0]["logprobs"]["token_logprobs"], lp["token_logprobs"]);
  EXPECT_EQ(ev.chunks[1]["choices"][0]["finish_reason"], "length");
  // Ids of the model beyond the tokenizer's (the vocabulary is padded): named by id.
  const json pad = post_json("/v1/completions", {{"prompt", {285, 298}}, {"max_tokens", 0}, {"echo", true}});
  EXPECT_NE(pad["choices"][0]["text"].get<std::string>().find("token_id:298"), std::string::npos) << pad;
}

TEST_F(ServerFieldsTest, GeneratedTokensLogprobsAreTheModelsBeforePenalties) {
  const auto prompt = tok_->encode("hello world", true);
  // Greedy with a frequency penalty: the logprobs are the model's, not the
  // penalised ones the draw used.
  const json r = post_json("/v1/completions", {{"prompt", "hello world"},
                                               {"max_tokens", 6},
                                               {"temperature", 0},
                                               {"echo", true},
                                               {"logprobs", 2},
                                               {"frequency_penalty", 1.5},
                                               {"ignore_eos", true}});
  const json& c = r["choices"][0];
  const auto made = c["token_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(made.size(), 6u);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), made.begin(), made.end() - 1);
  int64_t V = 0;
  const auto ref = model_logits(dir_, all, &V);
  const json& lp = c["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), prompt.size() + made.size());
  EXPECT_EQ(c["text"], tok_->decode(prompt, true) + text_of(made));
  for (size_t t = 1; t < prompt.size() + made.size(); ++t) {
    const int32_t id = t < prompt.size() ? prompt[t] : made[t - prompt.size()];
    EXPECT_NEAR(lp["token_logprobs"][t].get<double>(), log_softmax(ref, V, t - 1, id), 1e-5) << t;
  }
}

TEST_F(ServerFieldsTest, ChatLogprobsStreamedAndWhole) {
  const json messages = json::array({{{"role", "user"}, {"content", "hello"}}});
  const json req = {{"messages", messages}, {"max_tokens", 5},   {"temperature", 0},
                    {"logprobs", true},     {"top_logprobs", 2}, {"ignore_eos", true}};
  const json r = post_json("/v1/chat/completions", req);
  const json& c = r["choices"][0];
  const auto made = c["token_ids"].get<std::vector<int32_t>>();
  const json& content = c["logprobs"]["content"];
  ASSERT_EQ(content.size(), made.size());
  for (size_t i = 0; i < made.size(); ++i) {
    const std::string text = tok_->decode(std::vector<int32_t>{made[i]});
    EXPECT_EQ(content[i]["token"], text);
    EXPECT_EQ(content[i]["bytes"].size(), text.size());
    ASSERT_EQ(content[i]["top_logprobs"].size(), 2u);
    // Greedy: the token is the most likely one.
    EXPECT_EQ(content[i]["top_logprobs"][0]["token"], text);
    EXPECT_FLOAT_EQ(content[i]["top_logprobs"][0]["logprob"].get<float>(), content[i]["logprob"].get<float>());
    EXPECT_LE(content[i]["logprob"].get<double>(), 0.0);
  }
  json sreq = req;
  sreq["stream"] = true;
  auto [status, body] = post("/v1/chat/completions", sreq.dump());
  ASSERT_EQ(status, 200) << body;
  json streamed = json::array();
  for (const auto& ch : parse_events(body).chunks)
    if (!ch["choices"][0]["logprobs"].is_null())
      for (const auto& e : ch["choices"][0]["logprobs"]["content"]) streamed.push_back(e);
  EXPECT_EQ(streamed, content);
  // Without logprobs the field is null.
  EXPECT_TRUE(post_json("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 2}})["choices"][0]["logprobs"]
                  .is_null());
}

TEST_F(ServerFieldsTest, NChoicesEachDrawWithSeedPlusIndex) {
  const std::vector<int32_t> ids = {285, 30, 31, 32};
  const json req = {{"prompt", ids}, {"max_tokens", 6}, {"temperature", 1.0}, {"seed", 5}, {"n", 3}};
  const json r = post_json("/v1/completions", req);
  ASSERT_EQ(r["choices"].size(), 3u);
  size_t made = 0;
  for (int i = 0; i < 3; ++i) {
    const json& c = r["choices"][i];
    EXPECT_EQ(c["index"], i);
    const auto want = alone(ids, 6, ds::infer::SamplerConfig{1.0f, 0, 1.0f, 5u + static_cast<uint64_t>(i)});
    EXPECT_EQ(c["token_ids"].get<std::vector<int32_t>>(), want) << "choice " << i;
    EXPECT_EQ(c["text"], text_of(want));
    made += want.size();
  }
  EXPECT_EQ(r["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(r["usage"]["completion_tokens"], made);
  // Choice 0 is what n = 1 makes.
  json one = req;
  one["n"] = 1;
  EXPECT_EQ(post_json("/v1/completions", one)["choices"][0]["token_ids"], r["choices"][0]["token_ids"]);
  // Streamed: the chunks of each index add up to its choice.
  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  auto [status, body] = post("/v1/completions", sreq.dump());
  ASSERT_EQ(status, 200) << body;
  const Events ev = parse_events(body);
  ASSERT_TRUE(ev.done);
  std::map<int, std::vector<int32_t>> ids_of;
  std::map<int, std::string> text_of_choice, finish;
  for (const auto& ch : ev.chunks) {
    if (ch["choices"].empty()) continue;
    const json& c = ch["choices"][0];
    const int i = c["index"];
    for (int32_t t : c["token_ids"]) ids_of[i].push_back(t);
    text_of_choice[i] += c["text"].get<std::string>();
    if (!c["finish_reason"].is_null()) finish[i] = c["finish_reason"];
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ids_of[i], r["choices"][i]["token_ids"].get<std::vector<int32_t>>()) << i;
    EXPECT_EQ(text_of_choice[i], r["choices"][i]["text"]) << i;
    EXPECT_EQ(finish[i], r["choices"][i]["finish_reason"]) << i;
  }
  EXPECT_EQ(ev.chunks.back()["usage"], r["usage"]);
  // Chat streams give each choice its role first.
  auto [cs, cb] = post("/v1/chat/completions", json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                                                    {"max_tokens", 3},
                                                    {"n", 2},
                                                    {"stream", true}}
                                                   .dump());
  ASSERT_EQ(cs, 200) << cb;
  std::map<int, int> firsts;
  for (const auto& ch : parse_events(cb).chunks) {
    const json& c = ch["choices"][0];
    if (!firsts.count(c["index"])) {
      firsts[c["index"]] = 1;
      EXPECT_EQ(c["delta"]["role"], "assistant") << ch;
    }
  }
  EXPECT_EQ(firsts.size(), 2u);
}

TEST_F(ServerFieldsTest, PenaltiesAndBiasFollowTheirDefinitions) {
  const auto prompt = tok_->encode("hello world", true);
  const float presence = 0.7f, frequency = 0.4f, repetition = 1.3f;
  const json r = post_json("/v1/completions", {{"prompt", "hello world"},
                                               {"max_tokens", 8},
                                               {"temperature", 0},
                                               {"presence_penalty", presence},
                                               {"frequency_penalty", frequency},
                                               {"repetition_penalty", repetition},
                                               {"logit_bias", {{"7", 1.0}, {"9", -2.5}}},
                                               {"ignore_eos", true}});
  const auto made = r["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(made.size(), 8u);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), made.begin(), made.end() - 1);
  int64_t V = 0;
  const auto ref = model_logits(dir_, all, &V);
  // Each greedy token is the argmax of the model's row changed by hand.
  std::map<int32_t, int> count;
  for (size_t t = 0; t < made.size(); ++t) {
    std::vector<float> row(ref.begin() + (prompt.size() + t - 1) * V, ref.begin() + (prompt.size() + t) * V);
    for (int32_t id = 0; id < V; ++id) {
      const bool seen = count.count(id) || std::find(prompt.begin(), prompt.end(), id) != prompt.end();
      if (seen) row[id] = row[id] > 0 ? row[id] / repetition : row[id] * repetition;
      if (count.count(id)) row[id] -= count[id] * frequency + presence;
    }
    row[7] += 1.0f;
    row[9] -= 2.5f;
    const float best = *std::max_element(row.begin(), row.begin() + kDrawVocab);
    EXPECT_NEAR(row[made[t]], best, 1e-4) << "token " << t;
    ++count[made[t]];
  }
  // A bias of 100 makes its token every time; -100 never.
  const json forced = post_json(
      "/v1/completions",
      {{"prompt", "hello world"}, {"max_tokens", 4}, {"temperature", 0.8}, {"seed", 1}, {"logit_bias", {{"77", 100}}}});
  EXPECT_EQ(forced["choices"][0]["token_ids"].get<std::vector<int32_t>>(), std::vector<int32_t>(4, 77));
  const int32_t greedy = alone(prompt, 1)[0];
  const json banned = post_json("/v1/completions", {{"prompt", "hello world"},
                                                    {"max_tokens", 1},
                                                    {"temperature", 0},
                                                    {"logit_bias", {{std::to_string(greedy), -100}}}});
  EXPECT_NE(banned["choices"][0]["token_ids"][0], greedy);
}

TEST_F(ServerFieldsTest, BadValuesNameTheirField) {
  const std::string C = "/v1/completions", Chat = "/v1/chat/completions";
  const std::string P = R"({"prompt": [1], )",
                    M = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, )";
  expect_refused(C, P + R"("n": 0})", 400, "'n' must be in [1, 8]", "n");
  expect_refused(C, P + R"("n": 9})", 400, "'n' must be in [1, 8]", "n");
  expect_refused(C, P + R"("n": "2"})", 400, "'n' must be an integer", "n");
  expect_refused(C, P + R"("n": 8, "max_tokens": 15})", 400, "would not fit", "max_tokens");
  expect_refused(C, P + R"("logprobs": 6})", 400, "'logprobs' must be in [0, 5]", "logprobs");
  expect_refused(C, P + R"("logprobs": -1})", 400, "'logprobs' must be in [0, 5]", "logprobs");
  expect_refused(C, P + R"("logprobs": true})", 400, "'logprobs' must be an integer", "logprobs");
  expect_refused(C, P + R"("logprobs": 1.5})", 400, "'logprobs' must be an integer", "logprobs");
  expect_refused(C, P + R"("echo": "yes"})", 400, "true or false", "echo");
  expect_refused(Chat, M + R"("logprobs": 1})", 400, "'logprobs' must be true or false", "logprobs");
  expect_refused(Chat, M + R"("logprobs": true, "top_logprobs": 21})", 400, "'top_logprobs' must be in [0, 20]",
                 "top_logprobs");
  expect_refused(Chat, M + R"("top_logprobs": 2})", 400, "needs 'logprobs': true", "top_logprobs");
  expect_refused(C, P + R"("presence_penalty": 2.5})", 400, "'presence_penalty' must be in [-2, 2]",
                 "presence_penalty");
  expect_refused(Chat, M + R"("frequency_penalty": -3})", 400, "'frequency_penalty' must be in [-2, 2]",
                 "frequency_penalty");
  expect_refused(C, P + R"("frequency_penalty": "x"})", 400, "'frequency_penalty' must be a number",
                 "frequency_penalty");
  expect_refused(C, P + R"("repetition_penalty": 0})", 400, "'repetition_penalty' must be > 0", "repetition_penalty");
  expect_refused(C, P + R"("repetition_penalty": -1})", 400, "'repetition_penalty'", "repetition_penalty");
  expect_refused(C, P + R"("logit_bias": [1]})", 400, "'logit_bias' must be an object", "logit_bias");
  expect_refused(C, P + R"("logit_bias": {"abc": 1}})", 400, "keys must be token ids in [0, 300)", "logit_bias");
  expect_refused(C, P + R"("logit_bias": {"-1": 1}})", 400, "keys must be token ids", "logit_bias");
  expect_refused(C, P + R"("logit_bias": {"300": 1}})", 400, "keys must be token ids", "logit_bias");
  expect_refused(C, P + R"("logit_bias": {"99999999999": 1}})", 400, "keys must be token ids", "logit_bias");
  expect_refused(Chat, M + R"("logit_bias": {"5": 101}})", 400, "values must be numbers in [-100, 100]", "logit_bias");
  expect_refused(C, P + R"("logit_bias": {"5": "x"}})", 400, "values must be numbers", "logit_bias");
  expect_refused(C, P + R"("best_of": 2})", 400, "'best_of' is not supported", "best_of");
  expect_refused(C, P + R"("suffix": "x"})", 400, "'suffix' is not supported", "suffix");
  // Neutral values are taken.
  const json ok = post_json(C, {{"prompt", {285, 1}},
                                {"max_tokens", 2},
                                {"temperature", 0},
                                {"n", 1},
                                {"logprobs", nullptr},
                                {"echo", false},
                                {"presence_penalty", 0},
                                {"frequency_penalty", 0},
                                {"repetition_penalty", 1},
                                {"logit_bias", json::object()}});
  EXPECT_EQ(ok["choices"][0]["token_ids"].get<std::vector<int32_t>>(), alone({285, 1}, 2));
  EXPECT_TRUE(ok["choices"][0]["logprobs"].is_null());
}

// name{labels} -> value of every sample line; fails the test on a line that
// is neither a comment nor a sample.
std::map<std::string, double> parse_metrics(const std::string& text) {
  static const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*")*\})?) )"
      R"((-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?|\+Inf|-Inf|NaN)$)");
  static const std::regex comment(R"(^# (HELP [a-zA-Z_:][a-zA-Z0-9_:]* .*|TYPE [a-zA-Z_:][a-zA-Z0-9_:]* )"
                                  R"((counter|gauge|histogram|summary|untyped))$)");
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_match(line, comment)) continue;
    EXPECT_TRUE(std::regex_match(line, m, sample)) << "not a sample: '" << line << "'";
    if (!m.empty()) out[m[1]] = std::stod(m[4]);
  }
  EXPECT_EQ(text.back(), '\n');
  return out;
}

TEST_F(ServerFieldsTest, MetricsParseAndMoveAfterARequest) {
  auto scrape = [&] {
    auto c = client();
    auto r = c.Get("/metrics");
    EXPECT_TRUE(r);
    if (!r) return std::map<std::string, double>{};
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->get_header_value("Content-Type").rfind("text/plain", 0), 0u);
    return parse_metrics(r->body);
  };
  const auto before = scrape();
  const std::string ok = R"(deepseek_requests_total{route="/v1/completions",status="200"})";
  const std::string bad = R"(deepseek_requests_total{route="/v1/completions",status="400"})";
  const std::vector<int32_t> ids = {285, 50, 51, 52};
  post_json("/v1/completions", {{"prompt", ids}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}});
  expect_refused("/v1/completions", R"({"prompt": [1], "n": 0})", 400, "'n'");
  client().Get("/no/such/route");
  // Over the fixture's 1 MiB body limit: the transport refuses it before any route.
  EXPECT_EQ(post("/v1/completions", std::string((size_t{1} << 20) + 10, ' ')).first, 413);
  const auto after = scrape();
  auto get = [](const std::map<std::string, double>& m, const std::string& k) {
    auto it = m.find(k);
    return it == m.end() ? 0.0 : it->second;
  };
  EXPECT_EQ(get(after, ok) - get(before, ok), 1);
  EXPECT_EQ(get(after, bad) - get(before, bad), 1);
  EXPECT_EQ(get(after, R"(deepseek_requests_total{route="other",status="404"})"), 1);
  EXPECT_EQ(get(after, R"(deepseek_requests_total{route="unrouted",status="413"})"), 1);
  EXPECT_EQ(get(after, R"(deepseek_requests_total{route="/metrics",status="200"})"), 1);  // the first scrape
  EXPECT_EQ(get(after, "deepseek_prompt_tokens_total") - get(before, "deepseek_prompt_tokens_total"), 4);
  EXPECT_EQ(get(after, "deepseek_generation_tokens_total") - get(before, "deepseek_generation_tokens_total"), 5);
  const std::string ttft = "deepseek_time_to_first_token_seconds", tpot = "deepseek_time_per_output_token_seconds";
  EXPECT_EQ(get(after, ttft + "_count") - get(before, ttft + "_count"), 1);
  EXPECT_EQ(get(after, tpot + "_count") - get(before, tpot + "_count"), 4);
  EXPECT_GT(get(after, ttft + "_sum"), 0);
  EXPECT_EQ(get(after, ttft + "_bucket{le=\"+Inf\"}"), get(after, ttft + "_count"));
  // Buckets are cumulative.
  double last = 0;
  for (const auto& [k, v] : after)
    if (k.rfind(tpot + "_bucket", 0) == 0 && k.find("+Inf") == std::string::npos) {
      EXPECT_GE(v, 0);
      last = std::max(last, v);
    }
  EXPECT_LE(last, get(after, tpot + "_count"));
  EXPECT_EQ(get(after, "deepseek_running_sequences"), 0);
  EXPECT_EQ(get(after, "deepseek_waiting_sequences"), 0);
  EXPECT_EQ(get(after, "deepseek_max_sequences"), 4);
  EXPECT_TRUE(after.count("deepseek_cache_bytes"));
}

}  // namespace server_fields_test
}  // namespace

namespace {
namespace server_fields_test {

// With prefix caching, a conversation's next turn (the last prompt, its
// answer and new tokens) reads only the new tokens: /metrics and /health
// say so, and the answers are what the model makes for each prompt alone.
TEST_F(ServerFieldsTest, ATurnThatExtendsTheLastReadsOnlyItsNewTokens) {
  stop();
  fs::remove_all(dir_);
  ds::infer::BatcherOptions bo{2, 16, 512, kEos, 294};
  bo.cache_memory = 16 << 20;
  bo.prefix_cache = true;
  start(bo);
  auto scrape = [&] {
    auto r = client().Get("/metrics");
    EXPECT_TRUE(r);
    return r ? parse_metrics(r->body) : std::map<std::string, double>{};
  };
  std::vector<int32_t> prompt = {285, 50, 51, 52, 53, 54};
  std::vector<double> read;
  for (int turn = 0; turn < 4; ++turn) {
    const double before = scrape()["deepseek_prompt_tokens_total"];
    const json r =
        post_json("/v1/completions", {{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}});
    const auto ids = r["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(ids, alone(prompt, 3)) << "turn " << turn;
    EXPECT_EQ(r["usage"]["prompt_tokens"], prompt.size());  // usage counts the whole prompt
    read.push_back(scrape()["deepseek_prompt_tokens_total"] - before);
    prompt.insert(prompt.end(), ids.begin(), ids.end());
    prompt.insert(prompt.end(), {60 + turn, 70 + turn});
  }
  // The first turn reads 6; the others the last answer's final token and 2 new.
  EXPECT_EQ(read, (std::vector<double>{6, 3, 3, 3}));
  const auto m = scrape();
  EXPECT_EQ(m.at("deepseek_prefix_cache_hits_total"), 3);
  EXPECT_EQ(m.at("deepseek_prefix_cache_hit_tokens_total"), 8 + 13 + 18);
  EXPECT_EQ(m.at("deepseek_prefix_cache_entries"), 1);  // each turn's cache stands in for the last
  EXPECT_EQ(m.at("deepseek_cache_pool_limit_bytes"), 16 << 20);
  EXPECT_LE(m.at("deepseek_cache_pool_peak_bytes"), 16 << 20);
  EXPECT_GT(m.at("deepseek_prefix_cache_bytes"), 0);
  auto h = client().Get("/health");
  ASSERT_TRUE(h);
  const json health = json::parse(h->body);
  EXPECT_EQ(health["cache"]["prefix_hits"], 3);
  EXPECT_EQ(health["cache"]["limit_bytes"], 16 << 20);
  EXPECT_EQ(health["cache"]["prefix_entries"], 1);
}

}  // namespace server_fields_test
}  // namespace
