// An HTTP server with OpenAI's completion API over a continuous batcher
// (infer/batcher.h), as llama.cpp's and vLLM's servers offer it:
//
//   POST /v1/completions       {"prompt": "text" | [ids], "max_tokens", "temperature", "top_p",
//                               "top_k", "seed", "stop", "stream", "ignore_eos", "n",
//                               "logprobs" (0-5), "echo", "presence_penalty",
//                               "frequency_penalty", "repetition_penalty", "logit_bias"}
//   POST /v1/chat/completions  {"messages": [{"role", "content", "tool_calls"}], ..., "logprobs"
//                               (bool), "top_logprobs", "tools", "tool_choice",
//                               "parallel_tool_calls", "thinking", "chat_template_kwargs",
//                               "reasoning_effort"} in the model's DeepSeek chat format
//                               (infer/chat_format.h): answers carry reasoning_content and
//                               tool_calls, streamed as deltas
//   GET  /v1/models, GET /health, GET /metrics (Prometheus' text format)
//
// Choice i of a request of n is its own sequence, drawn with seed + i.
// Streams are server-sent events ("data: {...}" per token, then
// "data: [DONE]"). A client that closes its connection before its answer is
// complete, streamed or not, has its generation cancelled at the next step. Every request the server cannot run gets an
// HTTP error with OpenAI's error object ({"error": {"message", "type", "param", "code"}}) and one line of message;
// nothing a client sends stops the server.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "infer/batcher.h"
#include "infer/chat_format.h"
#include "io/tokenizer.h"

namespace ds::infer {

// What a client may hold of the server, each bounded (see
// infer/http_transport.h); every refusal is OpenAI's error object.
struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port (bind() says which)
  std::string model_name = "deepseek";
  int threads = 32;                            // requests with a body handled at once; more get 503
  size_t max_body_bytes = size_t{8} << 20;     // larger bodies, chunked or not, get 413
  int max_connections = 256;                   // open connections; more get 503
  size_t max_header_bytes = size_t{16} << 10;  // a larger request header gets 431
  int max_json_depth = 64;                     // deeper nested bodies get 400
  double request_timeout_s = 10;               // to send one request's header and body, in all; then 408
  double idle_timeout_s = 5;                   // a connection idle between requests is closed
  double write_timeout_s = 30;                 // a client that reads nothing for this long is dropped
};

// What the server serves: the batcher and what it needs beyond it.
struct ServedModel {
  Batcher* batcher = nullptr;
  // Text in and out; without one only token-id prompts are taken and
  // responses carry token ids and empty text.
  const io::Tokenizer* tokenizer = nullptr;
  // Checks a request of `sequences` sequences (its choices) of this prompt
  // length and token budget against the machine (the KV cache's memory);
  // throws ds::Error to refuse it.
  std::function<void(int64_t prompt_tokens, int64_t max_new_tokens, int64_t sequences)> check;
  // How chat messages become a prompt and answers are read back.
  chat::Format chat_format = chat::Format::V3;
};

class Server {
 public:
  Server(ServedModel model, ServerOptions opt);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the socket; returns the port (ds::Error when it cannot).
  int bind();
  // Serves until stop() (from any thread).
  void run();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds::infer
