// The server's test fixture: a tiny random model with DeepSeek's chat tokens
// behind a Batcher and a Server on a free loopback port, the reference
// generate() on a model of its own, and helpers to post requests and check
// OpenAI's error object. Shared by server_test.cc and
// server_hardening_test.cc.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <omp.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "forwarding_decoder.h"
#include "infer/server.h"
#include "model_fixture.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using ds::infer::GenerateOptions;

namespace {

constexpr int32_t kEos = 286;                     // the tiny tokenizer's <｜end▁of▁sentence｜>
constexpr int32_t kUser = 292, kAssistant = 293;  // added below

// One entry of a tokenizer.json's added_tokens: `content` as token `id`.
json added_token(int id, const std::string& content) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", false}};
}

// The tiny test tokenizer with DeepSeek's two chat tokens added.
std::string chat_tokenizer_json() {
  std::ifstream in(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/tokenizer/tiny/tokenizer.json");
  json t = json::parse(in);
  t["added_tokens"].push_back(added_token(kUser, "<｜User｜>"));
  t["added_tokens"].push_back(added_token(kAssistant, "<｜Assistant｜>"));
  return t.dump();
}

// Server-sent events of a stream: the JSON of each "data:" line but [DONE].
struct Events {
  std::vector<json> chunks;
  bool done = false;
};
inline Events parse_events(const std::string& body) {
  Events ev;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const size_t end = body.find("\n\n", pos);
    const std::string data = body.substr(pos + 6, end - pos - 6);
    if (data == "[DONE]")
      ev.done = true;
    else
      ev.chunks.push_back(json::parse(data));
    pos = end;
  }
  return ev;
}

// A decoder that takes at least 20 ms a step: a generation of 100 tokens
// runs for 2 s, long after a test has acted on it.
class SlowDecoder : public ds::test::ForwardingDecoder {
 public:
  using ForwardingDecoder::ForwardingDecoder;
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return ForwardingDecoder::step(tokens);
  }
};

// A decoder whose steps run on one OpenMP thread. A team of two on a
// two-core machine that other work keeps busy waits, at each of a step's
// hundreds of parallel regions, for the scheduler to run both threads: a
// completion of the tiny model then took a quarter of a second, not 1 ms,
// and a test that counts answers in a few seconds measured the scheduler,
// not the server. The count is set on the calling thread, the batcher's
// (OpenMP's thread count is each thread's own).
class OneThreadDecoder : public ds::test::ForwardingDecoder {
 public:
  using ForwardingDecoder::ForwardingDecoder;
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override {
    omp_set_num_threads(1);
    return ForwardingDecoder::step(tokens);
  }
  std::vector<float> step_all(const std::vector<std::vector<int32_t>>& tokens) override {
    omp_set_num_threads(1);
    return ForwardingDecoder::step_all(tokens);
  }
};

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { start(ds::infer::BatcherOptions{4, 256, 6, kEos, 294}); }
  void TearDown() override {
    stop();
    fs::remove_all(dir_);
  }

  // `tweak` changes the server's options after the fixture's own.
  void start(ds::infer::BatcherOptions bo, bool slow = false,
             const std::function<void(ds::infer::ServerOptions&)>& tweak = {}) {
    char tmpl[] = "/tmp/ds_server_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    auto cfg = ds::test::tiny_v3_config();
    cfg["vocab_size"] = 300;
    cfg["eos_token_id"] = kEos;
    ds::test::write_random_model(dir_, cfg, 33);
    tok_ = std::make_unique<ds::io::Tokenizer>(ds::io::Tokenizer::from_json(chat_tokenizer_json()));
    m_ = ds::infer::load_model(dir_);
    served_dec_ = ds::infer::kv_decoder(*m_->engine, ds::infer::CacheKind::Latent);
    // The reference runs on a model of its own: an engine serves one thread.
    m_ref_ = ds::infer::load_model(dir_);
    ref_dec_ = ds::infer::kv_decoder(*m_ref_->engine, ds::infer::CacheKind::Latent);
    slow_ = std::make_unique<SlowDecoder>(*served_dec_);
    one_thread_dec_ = std::make_unique<OneThreadDecoder>(*served_dec_);
    batcher_ = std::make_unique<ds::infer::Batcher>(slow ? *slow_ : one_thread_ ? *one_thread_dec_ : *served_dec_, bo);
    ds::infer::ServedModel sm;
    sm.batcher = batcher_.get();
    sm.tokenizer = tok_.get();
    // As if the machine had memory for 120 tokens of KV cache per request.
    sm.check = [](int64_t prompt, int64_t max_new, int64_t sequences) {
      if ((prompt + max_new) * sequences > 120) throw ds::Error("the KV cache of this request would not fit");
    };
    ds::infer::ServerOptions so;
    so.port = 0;
    so.model_name = "tiny";
    so.max_body_bytes = size_t{1} << 20;
    if (tweak) tweak(so);
    server_ = std::make_unique<ds::infer::Server>(sm, so);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  void stop() {
    if (!server_) return;
    batcher_->close();
    server_->stop();
    thread_.join();
    server_.reset();
    batcher_.reset();
  }

  httplib::Client client() {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c;
  }
  // POST body to path; the status and the response body.
  std::pair<int, std::string> post(const std::string& path, const std::string& body) {
    auto c = client();
    auto r = c.Post(path, body, "application/json");
    if (!r) return {-1, httplib::to_string(r.error())};
    return {r->status, r->body};
  }
  json post_json(const std::string& path, const json& body, int want_status = 200) {
    auto [status, text] = post(path, body.dump());
    EXPECT_EQ(status, want_status) << text;
    return json::parse(text);
  }

  // What generate() makes for these prompt ids alone.
  std::vector<int32_t> alone(const std::vector<int32_t>& prompt, int64_t max_new, ds::infer::SamplerConfig s = {}) {
    GenerateOptions opt;
    opt.max_new_tokens = max_new;
    opt.sampler = s;
    opt.eos_token_id = kEos;
    opt.sample_vocab = 294;
    return ds::infer::generate(*ref_dec_, {prompt}, opt)[0];
  }
  std::string text_of(const std::vector<int32_t>& ids) { return tok_->decode(ids, true); }

  // The error object of a refused request, checked for its shape.
  void expect_refused(const std::string& path, const std::string& body, int status, const std::string& says,
                      const std::string& param = "") {
    auto [got, text] = post(path, body);
    EXPECT_EQ(got, status) << body << " -> " << text;
    json e;
    ASSERT_NO_THROW(e = json::parse(text)) << text;
    ASSERT_TRUE(e.contains("error")) << text;
    const std::string msg = e["error"]["message"].get<std::string>();
    EXPECT_NE(msg.find(says), std::string::npos) << body << " -> " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(msg.find("[src/"), std::string::npos) << msg;
    if (!param.empty()) {
      EXPECT_EQ(e["error"]["param"], param) << text;
    }
  }

  std::string dir_;
  std::unique_ptr<ds::io::Tokenizer> tok_;
  std::unique_ptr<ds::infer::LoadedModel> m_, m_ref_;
  std::unique_ptr<ds::infer::Decoder> served_dec_, ref_dec_, slow_, one_thread_dec_;
  // The next start() serves through a OneThreadDecoder.
  bool one_thread_ = false;
  std::unique_ptr<ds::infer::Batcher> batcher_;
  std::unique_ptr<ds::infer::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace
