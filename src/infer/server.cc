#include "infer/server.h"

#include <fmt/format.h>
#include <poll.h>

#include <atomic>
#include <condition_variable>
#include <ctime>
#include <limits>
#include <list>
#include <optional>
#include <random>
#include <thread>

#include "core/error.h"
#include "infer/http_transport.h"
#include "infer/server_api.h"
#include "infer/text_stream.h"

namespace ds::infer {

namespace {

using api::json;
using api::plain;
using api::Refusal;
using api::refuse;
using api::wire;

void send_error(http::Responder& out, const Refusal& r) { out.send(r.status, api::error_text(r)); }

// Generations whose clients may leave before their answer is made. A thread
// polls their sockets every 50 ms and cancels the generation of a client
// that closed its side or reset the connection, so that its slot is free
// at the next step whether the answer is streamed or not (a stream also
// notices at its next write).
class Watcher {
 public:
  struct Entry {
    int fd;
    std::shared_ptr<Generation> gen;
    std::atomic<bool> gone{false};
  };

  Watcher() : thread_([this] { loop(); }) {}
  ~Watcher() {
    {
      std::lock_guard lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  std::list<Entry>::iterator add(int fd, std::shared_ptr<Generation> gen) {
    std::lock_guard lk(mu_);
    entries_.emplace_back(fd, std::move(gen));
    return std::prev(entries_.end());
  }
  // Before the socket closes: the thread polls it no more.
  void remove(std::list<Entry>::iterator it) {
    std::lock_guard lk(mu_);
    entries_.erase(it);
  }
  // Every generation watched now or later is cancelled (the server stops).
  void cancel_all() {
    std::lock_guard lk(mu_);
    cancel_all_ = true;
    for (auto& e : entries_) e.gen->cancel();
  }

 private:
  void loop() {
    std::unique_lock lk(mu_);
    std::vector<pollfd> fds;
    while (!done_) {
      fds.clear();
      for (auto& e : entries_) {
        if (cancel_all_) e.gen->cancel();
        fds.push_back({e.fd, POLLRDHUP, 0});
      }
      if (!fds.empty() && ::poll(fds.data(), fds.size(), 0) > 0) {
        size_t i = 0;
        for (auto& e : entries_)
          if (fds[i++].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
            e.gone = true;
            e.gen->cancel();
          }
      }
      cv_.wait_for(lk, std::chrono::milliseconds(50));
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Entry> entries_;
  bool done_ = false, cancel_all_ = false;
  std::thread thread_;
};

// A generation watched for as long as its request is answered.
class Watch {
 public:
  Watch(Watcher& w, int fd, std::shared_ptr<Generation> gen) : w_(w), it_(w.add(fd, std::move(gen))) {}
  ~Watch() { w_.remove(it_); }
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;
  bool client_gone() const { return it_->gone; }

 private:
  Watcher& w_;
  std::list<Watcher::Entry>::iterator it_;
};

}  // namespace

// ---- the server ------------------------------------------------------------------

struct Server::Impl {
  ServedModel model;
  ServerOptions opt;
  std::unique_ptr<http::Transport> transport;
  Watcher watcher;
  std::atomic<uint64_t> next_id{0};
  std::random_device seeds;
  std::mutex seeds_mu;

  // A request, checked and submitted.
  struct Job {
    bool chat = false, stream = false, include_usage = false;
    std::string id, model;
    int64_t created = 0;
    std::shared_ptr<Generation> gen;
    std::unique_ptr<TextStream> text;  // none without a tokenizer
    bool stopped() const { return text && text->stopped(); }
    std::vector<int32_t> ids;  // made so far
  };

  uint64_t random_seed() {
    std::lock_guard lk(seeds_mu);
    return (static_cast<uint64_t>(seeds()) << 32) ^ seeds();
  }

  Job start(const json& body, bool chat) {
    Batcher& b = *model.batcher;
    api::Request q = api::read_request(body, chat, {model.tokenizer, b.max_positions()});
    BatchRequest& r = q.batch;
    if (!q.has_seed) r.sampler.seed = random_seed();
    Job job;
    job.chat = chat;
    job.stream = q.stream;
    job.include_usage = q.include_usage;
    if (model.tokenizer) job.text = std::make_unique<TextStream>(*model.tokenizer, q.stops, b.options().eos_token_id);
    job.model = opt.model_name;
    job.id = fmt::format("{}-{:x}", chat ? "chatcmpl" : "cmpl", next_id++);
    job.created = static_cast<int64_t>(std::time(nullptr));
    try {
      if (model.check) model.check(static_cast<int64_t>(r.prompt.size()), r.max_new_tokens);
    } catch (const Error& e) {
      // A chat's default runs to the model's last position, which may not
      // fit where a shorter answer would.
      refuse(q.max_key,
             plain(e.what()) + (q.max_defaulted ? fmt::format("; set '{}' to ask for fewer tokens", q.max_key) : ""));
    }
    try {
      job.gen = b.submit(std::move(r));
    } catch (const Unavailable& e) {
      refuse("", plain(e.what()), 503);
    } catch (const Error& e) {
      refuse("", plain(e.what()));
    }
    return job;
  }

  // Waits for the next token; false at the end (a stop string counts).
  // `delta` gets the text that can be sent.
  static bool advance(Job& job, std::string& delta, int32_t& token) {
    delta.clear();
    if (job.stopped()) return false;
    if (!job.gen->next(&token)) {
      if (job.text) delta = job.text->finish();
      return false;
    }
    job.ids.push_back(token);
    if (job.text) delta = job.text->push(token);
    if (job.stopped()) job.gen->cancel();
    return true;
  }

  static std::string finish_reason(const Job& job) {
    if (job.stopped()) return "stop";
    switch (job.gen->finish()) {
      case Finish::Eos:
        return "stop";
      case Finish::Length:
        return "length";
      default:
        return "abort";
    }
  }

  // A generation that ended without finishing: the refusal to send.
  static std::optional<Refusal> failure(const Job& job) {
    if (job.stopped()) return std::nullopt;
    switch (job.gen->finish()) {
      case Finish::Failed:
        return Refusal{500, "generation failed: " + plain(job.gen->error().c_str()), ""};
      case Finish::Cancelled:
        return Refusal{503, "the server is shutting down", ""};
      default:
        return std::nullopt;
    }
  }

  json usage(const Job& job) const {
    const int64_t p = job.gen->prompt_tokens(), c = static_cast<int64_t>(job.ids.size());
    return {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}};
  }

  json envelope(const Job& job, bool chunk) const {
    return {{"id", job.id},
            {"object", job.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
            {"created", job.created},
            {"model", job.model}};
  }

  void complete(Job& job, http::Responder& out, const Watch& watch) {
    std::string text, delta;
    int32_t token;
    while (advance(job, delta, token)) text += delta;
    text += delta;
    if (watch.client_gone()) return out.abandon();
    if (auto f = failure(job)) return send_error(out, *f);
    json choice = {{"index", 0}, {"finish_reason", finish_reason(job)}, {"logprobs", nullptr}};
    if (job.chat)
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    else
      choice["text"] = text;
    choice["token_ids"] = job.ids;
    json out_body = envelope(job, false);
    out_body["choices"] = json::array({choice});
    out_body["usage"] = usage(job);
    out.send(200, wire(out_body));
  }

  json chunk(const Job& job, const std::string& delta, const std::vector<int32_t>& ids, const json& finish,
             bool first) const {
    json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}};
    if (job.chat) {
      choice["delta"] = first ? json{{"role", "assistant"}, {"content", delta}} : json{{"content", delta}};
      if (!finish.is_null()) choice["delta"] = json::object();
    } else {
      choice["text"] = delta;
    }
    choice["token_ids"] = ids;
    json out = envelope(job, true);
    out["choices"] = json::array({choice});
    return out;
  }

  static bool send_event(http::Responder& out, const std::string& data) { return out.chunk("data: " + data + "\n\n"); }

  void stream(Job& job, http::Responder& out) {
    if (!out.begin_chunks(200, "text/event-stream")) return job.gen->cancel();
    std::string delta;
    int32_t token;
    bool first = true;
    std::optional<Refusal> failed;
    try {
      while (advance(job, delta, token)) {
        if (!send_event(out, wire(chunk(job, delta, {token}, nullptr, first)))) return job.gen->cancel();  // gone
        first = false;
      }
      failed = failure(job);
    } catch (const std::exception& e) {
      job.gen->cancel();
      failed = Refusal{500, "internal error: " + plain(e.what()), ""};
    }
    if (failed) {
      send_event(out, wire(api::error_body(*failed)));
    } else {
      // A chat stream's first chunk carries the role, even with no token.
      if (!delta.empty() || (job.chat && first)) send_event(out, wire(chunk(job, delta, {}, nullptr, first)));
      send_event(out, wire(chunk(job, "", {}, finish_reason(job), false)));
      if (job.include_usage) {
        json u = envelope(job, true);
        u["choices"] = json::array();
        u["usage"] = usage(job);
        send_event(out, wire(u));
      }
    }
    send_event(out, "[DONE]");
    out.end_chunks();
  }

  void handle(const std::string& body, http::Responder& out, bool chat) {
    try {
      auto job = start(api::parse_body(body, opt.max_json_depth), chat);
      Watch watch(watcher, out.socket(), job.gen);
      if (job.stream) return stream(job, out);
      try {
        complete(job, out, watch);
      } catch (...) {
        job.gen->cancel();  // nobody will read the rest
        throw;
      }
    } catch (const Refusal& r) {
      send_error(out, r);
    } catch (const json::exception& e) {
      send_error(out, Refusal{400, fmt::format("malformed request: {}", e.what()), ""});
    }
  }

  void dispatch(const http::Request& req, http::Responder& out) {
    const auto target = req.target();
    std::string_view path(target.data(), target.size());
    path = path.substr(0, path.find('?'));
    const bool get = req.method() == http::bhttp::verb::get, post = req.method() == http::bhttp::verb::post;
    try {
      if (post && (path == "/v1/completions" || path == "/v1/chat/completions"))
        return handle(req.body(), out, path == "/v1/chat/completions");
      if (get && path == "/v1/models") {
        json m = {{"id", opt.model_name},
                  {"object", "model"},
                  {"created", 0},
                  {"owned_by", "deepseek.cpp"},
                  {"max_model_len", model.batcher->max_positions()}};
        return out.send(200, wire(json{{"object", "list"}, {"data", json::array({m})}}));
      }
      if (get && path == "/health")
        return out.send(200, wire(json{{"status", model.batcher->closed() ? "stopping" : "ok"},
                                       {"running", model.batcher->running()},
                                       {"waiting", model.batcher->waiting()}}));
      send_error(out, Refusal{404, fmt::format("no route {} {}", std::string(req.method_string()), path), ""});
    } catch (const std::exception& e) {
      if (!out.answered()) send_error(out, Refusal{500, "internal error: " + plain(e.what()), ""});
    }
  }
};

Server::Server(ServedModel model, ServerOptions opt) : impl_(std::make_unique<Impl>()) {
  DS_CHECK(model.batcher, "server: no batcher");
  DS_CHECK(opt.threads >= 1, "server: threads must be >= 1, got {}", opt.threads);
  DS_CHECK(opt.max_connections >= 1, "server: max_connections must be >= 1, got {}", opt.max_connections);
  DS_CHECK(opt.port >= 0 && opt.port <= 65535, "server: port {} outside [0, 65535]", opt.port);
  DS_CHECK(opt.request_timeout_s > 0 && opt.idle_timeout_s > 0 && opt.write_timeout_s > 0,
           "server: timeouts must be positive");
  impl_->model = std::move(model);
  impl_->opt = std::move(opt);
  Impl* im = impl_.get();
  const ServerOptions& o = im->opt;
  http::TransportOptions t;
  t.host = o.host;
  t.port = o.port;
  t.max_connections = o.max_connections;
  t.max_requests = o.threads;
  t.max_body_bytes = o.max_body_bytes;
  t.max_header_bytes = o.max_header_bytes;
  t.request_timeout_s = o.request_timeout_s;
  t.idle_timeout_s = o.idle_timeout_s;
  t.write_timeout_s = o.write_timeout_s;
  im->transport = std::make_unique<http::Transport>(
      t, [im](const http::Request& req, http::Responder& out) { im->dispatch(req, out); },
      [](int status, const std::string& message) {
        return api::error_text(Refusal{status, message, ""});
      });
}

Server::~Server() = default;

int Server::bind() {
  auto& o = impl_->opt;
  const int port = impl_->transport->bind();
  DS_CHECK(port > 0, "cannot listen on {}:{} (in use, or not an address of this machine)", o.host, o.port);
  return port;
}

void Server::run() { impl_->transport->run(); }

void Server::stop() {
  impl_->transport->stop();
  impl_->watcher.cancel_all();
}

}  // namespace ds::infer
