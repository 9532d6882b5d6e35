#include "infer/server.h"

#include <fmt/format.h>
#include <poll.h>

#include <atomic>
#include <condition_variable>
#include <ctime>
#include <limits>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "core/error.h"
#include "infer/anthropic_api.h"
#include "infer/chat_parse.h"
#include "infer/http_transport.h"
#include "infer/metrics.h"
#include "infer/server_api.h"
#include "infer/server_output.h"
#include "infer/text_stream.h"

namespace ds::infer {

namespace {

using api::json;
using api::plain;
using api::Refusal;
using api::refuse;
using api::wire;

void send_error(http::Responder& out, const Refusal& r) { out.send(r.status, api::error_text(r)); }

// /health's view of the cache pool and the prefix cache.
json pool_health(const BatcherCounters& k) {
  auto v = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  return {{"limit_bytes", v(k.pool_limit)},
          {"bytes", v(k.pool_bytes)},
          {"peak_bytes", v(k.pool_peak)},
          {"preemptions", v(k.preemptions)},
          {"prefix_entries", v(k.prefix_entries)},
          {"prefix_bytes", v(k.prefix_bytes)},
          {"prefix_hits", v(k.prefix_hits)},
          {"prefix_hit_tokens", v(k.prefix_hit_tokens)},
          {"prefix_evictions", v(k.prefix_evictions)}};
}

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

// Requests answered, by route and status, for /metrics. Routes are the
// server's own (anything else counts as "other"), so a client cannot grow
// the label set.
class RequestCounts {
 public:
  void add(std::string_view route, int status) {
    std::lock_guard lk(mu_);
    ++counts_[{std::string(route), status}];
  }
  void render(std::string& out) const {
    metrics::header(out, "deepseek_requests_total", "counter", "HTTP requests answered, by route and status.");
    std::lock_guard lk(mu_);
    for (const auto& [key, n] : counts_)
      metrics::sample(out, "deepseek_requests_total", fmt::format("route=\"{}\",status=\"{}\"", key.first, key.second),
                      static_cast<double>(n));
  }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> counts_;
};

std::string_view route_label(std::string_view path) {
  for (const char* r : {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                        "/v1/models", "/health", "/metrics"})
    if (path == r) return r;
  return "other";
}

}  // namespace

// ---- the server ------------------------------------------------------------------

struct Server::Impl {
  ServedModel model;
  ServerOptions opt;
  std::unique_ptr<http::Transport> transport;
  Watcher watcher;
  RequestCounts requests;
  std::atomic<uint64_t> next_id{0};
  std::random_device seeds;
  std::mutex seeds_mu;

  // One choice of a request: its own sequence.
  struct Choice {
    std::shared_ptr<Generation> gen;
    std::unique_ptr<TextStream> text;   // none without a tokenizer
    std::vector<int32_t> ids;           // made so far
    std::vector<TokenLogprob> lps;      // with logprobs: one per id
    bool begun = false, ended = false;  // streams: the first chunk and the end are sent
    // Chat answers with reasoning or calls: the answer split as it comes,
    // and the calls streamed so far.
    std::unique_ptr<chat::AnswerParser> parser;
    size_t calls_sent = 0;
    bool stopped() const { return text && text->stopped(); }
  };

  // A request, checked and submitted.
  struct Job {
    bool chat = false, stream = false, include_usage = false, echo = false;
    bool messages = false;  // Anthropic's Messages API (one choice)
    bool thinking = false;  // chat answers carry reasoning_content
    int64_t logprobs = -1;
    std::string id, model;
    int64_t created = 0;
    std::vector<int32_t> prompt;
    std::vector<Choice> choices;
    std::shared_ptr<Signal> signal = std::make_shared<Signal>();
    // Cancels every choice still running (nobody will read the rest).
    void cancel() const {
      for (const auto& c : choices)
        if (c.gen) c.gen->cancel();
    }
  };

  uint64_t random_seed() {
    std::lock_guard lk(seeds_mu);
    return (static_cast<uint64_t>(seeds()) << 32) ^ seeds();
  }

  api::Limits limits() const {
    return {model.tokenizer, model.batcher->max_positions(), model.batcher->vocab_size(), model.chat_format};
  }

  Job start(const json& body, std::string_view body_text, bool chat) {
    Batcher& b = *model.batcher;
    api::Request q = api::read_request(body, chat, limits(), body_text);
    BatchRequest& r = q.batch;
    if (!q.has_seed) r.sampler.seed = random_seed();
    Job job;
    job.chat = chat;
    job.stream = q.stream;
    job.include_usage = q.include_usage;
    job.echo = q.echo;
    job.logprobs = q.logprobs;
    job.thinking = q.thinking;
    job.prompt = r.prompt;
    job.model = opt.model_name;
    job.id = fmt::format("{}-{:x}", chat ? "chatcmpl" : "cmpl", next_id++);
    job.created = static_cast<int64_t>(std::time(nullptr));
    try {
      if (model.check) model.check(static_cast<int64_t>(r.prompt.size()), r.max_new_tokens, q.n);
    } catch (const Error& e) {
      // A chat's default runs to the model's last position, which may not
      // fit where a shorter answer would.
      refuse(q.max_key,
             plain(e.what()) + (q.max_defaulted ? fmt::format("; set '{}' to ask for fewer tokens", q.max_key) : ""));
    }
    // Choice i draws with seed + i: choice 0 is what n = 1 makes. The
    // choices read the prompt once (Batcher::submit_choices).
    job.choices.resize(static_cast<size_t>(q.n));
    for (auto& c : job.choices) {
      if (model.tokenizer) c.text = std::make_unique<TextStream>(*model.tokenizer, q.stops, b.options().eos_token_id);
      const chat::Prompt& cp = q.chat_prompt;
      if (chat && model.tokenizer && (cp.reasoning_first || cp.parse_tools || q.thinking))
        c.parser = std::make_unique<chat::AnswerParser>(model.chat_format, cp);
    }
    try {
      auto gens = b.submit_choices(std::move(r), q.n, job.signal);
      for (size_t i = 0; i < gens.size(); ++i) job.choices[i].gen = std::move(gens[i]);
    } catch (const Unavailable& e) {
      refuse("", plain(e.what()), 503);
    } catch (const Error& e) {
      refuse("", plain(e.what()));
    }
    return job;
  }

  enum class Next { Token, End, None };

  // The next token of a choice: Token (delta: the text that can be sent),
  // End (a stop string counts; delta: the text held back), or None when
  // !wait and no token is ready.
  static Next advance(const Job& job, Choice& c, std::string& delta, bool wait) {
    delta.clear();
    if (c.stopped()) return Next::End;
    int32_t token;
    TokenLogprob lp;
    const bool got = wait ? c.gen->next(&token, &lp) : c.gen->try_next(&token, &lp);
    if (!got) {
      if (!wait && !c.gen->drained()) return Next::None;
      if (c.text) delta = c.text->finish();
      return Next::End;
    }
    c.ids.push_back(token);
    if (job.logprobs >= 0) c.lps.push_back(std::move(lp));
    if (c.text) delta = c.text->push(token);
    if (c.stopped()) c.gen->cancel();
    return Next::Token;
  }

  static std::string finish_reason(const Choice& c) {
    // An answer that ends after its calls asks for their results.
    const char* stop = c.parser && c.parser->called() ? "tool_calls" : "stop";
    if (c.stopped()) return stop;
    switch (c.gen->finish()) {
      case Finish::Eos:
        return stop;
      case Finish::Length:
        return "length";
      default:
        return "abort";
    }
  }

  // A generation that ended without finishing: the refusal to send.
  static std::optional<Refusal> failure(const Choice& c) {
    if (c.stopped()) return std::nullopt;
    switch (c.gen->finish()) {
      case Finish::Failed:
        return Refusal{500, "generation failed: " + plain(c.gen->error().c_str()), ""};
      case Finish::Cancelled:
        return Refusal{503, "the server is shutting down", ""};
      default:
        return std::nullopt;
    }
  }

  json usage(const Job& job) const {
    const int64_t p = static_cast<int64_t>(job.prompt.size());
    int64_t c = 0;
    for (const auto& ch : job.choices) c += static_cast<int64_t>(ch.ids.size());
    return {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}};
  }

  json envelope(const Job& job, bool chunk) const {
    return {{"id", job.id},
            {"object", job.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
            {"created", job.created},
            {"model", job.model}};
  }

  // The echoed prompt's text and logprob entries (completions' echo).
  std::string prompt_text(const Job& job) const {
    if (!model.tokenizer) return "";
    try {
      return model.tokenizer->decode(job.prompt, /*skip_special_tokens=*/true);
    } catch (const Error&) {
      // Token ids the model has and the tokenizer does not: each by name.
      std::string text;
      for (const int32_t id : job.prompt) text += api::token_text(model.tokenizer, id);
      return text;
    }
  }
  static std::vector<api::LoggedToken> prompt_tokens(const Job& job, const std::vector<TokenLogprob>& lps) {
    std::vector<api::LoggedToken> out;
    for (size_t i = 0; i < job.prompt.size(); ++i)
      out.push_back({job.prompt[i], i > 0 && i < lps.size() ? &lps[i] : nullptr});
    return out;
  }
  // The logprobs of choice c's tokens [from, to).
  static std::vector<api::LoggedToken> made_tokens(const Choice& c, size_t from, size_t to) {
    std::vector<api::LoggedToken> out;
    for (size_t i = from; i < to; ++i) out.push_back({c.ids[i], &c.lps[i]});
    return out;
  }
  json logprobs_of(const Job& job, const std::vector<api::LoggedToken>& tokens, int64_t* offset) const {
    if (job.logprobs < 0) return nullptr;
    return job.chat ? api::chat_logprobs(model.tokenizer, tokens)
                    : api::completion_logprobs(model.tokenizer, tokens, offset);
  }

  void complete(Job& job, http::Responder& out, const Watch& watch) {
    json choices = json::array();
    std::string delta;
    for (size_t i = 0; i < job.choices.size(); ++i) {
      Choice& c = job.choices[i];
      std::string text;
      while (advance(job, c, delta, true) == Next::Token) text += delta;
      text += delta;
      if (watch.client_gone()) return out.abandon();
      if (auto f = failure(c)) return send_error(out, *f);
      int64_t offset = 0;
      std::vector<api::LoggedToken> logged;
      std::vector<TokenLogprob> plps;
      if (job.echo) {
        plps = c.gen->prompt_logprobs();
        text = prompt_text(job) + text;
        logged = prompt_tokens(job, plps);
      }
      for (const auto& t : made_tokens(c, 0, job.logprobs >= 0 ? c.ids.size() : 0)) logged.push_back(t);
      json choice = {
          {"index", i}, {"finish_reason", finish_reason(c)}, {"logprobs", logprobs_of(job, logged, &offset)}};
      if (job.chat && c.parser) {
        chat::Piece piece = c.parser->push(text);
        piece.append(c.parser->finish());
        choice["message"] = api::chat_message(piece, job.thinking, call_id(job, i));
        choice["finish_reason"] = finish_reason(c);
      } else if (job.chat) {
        choice["message"] = {{"role", "assistant"}, {"content", text}};
      } else
        choice["text"] = text;
      choice["token_ids"] = c.ids;
      choices.push_back(std::move(choice));
    }
    json out_body = envelope(job, false);
    out_body["choices"] = std::move(choices);
    out_body["usage"] = usage(job);
    out.send(200, wire(out_body));
  }

  // Ids of choice i's tool calls: this prefix and the call's index.
  static std::string call_id(const Job& job, size_t i) {
    return fmt::format("call_{}_{}_", job.id.substr(job.id.find('-') + 1), i);
  }

  // A streamed chunk: completions' text, or chat's delta, {"content": text}
  // or what a piece of a parsed answer adds (`parsed`), the role first.
  json chunk(const Job& job, size_t index, const std::string& delta, const std::vector<int32_t>& ids,
             const json& finish, bool first, json logprobs = nullptr, const json* parsed = nullptr) const {
    json choice = {{"index", index}, {"logprobs", std::move(logprobs)}, {"finish_reason", finish}};
    if (job.chat) {
      json d = parsed ? *parsed : json{{"content", delta}};
      if (first) d["role"] = "assistant";
      choice["delta"] = finish.is_null() ? std::move(d) : json::object();
    } else {
      choice["text"] = delta;
    }
    choice["token_ids"] = ids;
    json out = envelope(job, true);
    out["choices"] = json::array({choice});
    return out;
  }

  static bool send_event(http::Responder& out, const std::string& data) { return out.chunk("data: " + data + "\n\n"); }

  // Choice i's events for what advance() gave: its echoed prompt before
  // anything else, then the token (or the text held back and its end).
  // False when the client has gone.
  bool stream_choice(Job& job, size_t i, Next got, const std::string& delta, http::Responder& out) {
    Choice& c = job.choices[i];
    int64_t offset = 0;
    if (!c.begun && job.echo) {
      const auto plps = c.gen->prompt_logprobs();
      const json lp = logprobs_of(job, prompt_tokens(job, plps), &offset);
      if (!send_event(out, wire(chunk(job, i, prompt_text(job), job.prompt, nullptr, false, lp)))) return false;
    }
    if (got == Next::Token) {
      const size_t t = c.ids.size() - 1;
      const json lp = job.logprobs >= 0 ? logprobs_of(job, made_tokens(c, t, t + 1), &offset) : json(nullptr);
      const json parsed = c.parser ? api::chat_delta(c.parser->push(delta), call_id(job, i), &c.calls_sent) : json();
      if (!send_event(out, wire(chunk(job, i, delta, {c.ids[t]}, nullptr, !c.begun, lp, c.parser ? &parsed : nullptr))))
        return false;
      c.begun = true;
      return true;
    }
    // A chat stream's first chunk carries the role, even with no token.
    if (c.parser) {
      chat::Piece rest = c.parser->push(delta);
      rest.append(c.parser->finish());
      const json parsed = api::chat_delta(rest, call_id(job, i), &c.calls_sent);
      if (!rest.empty() || !c.begun) send_event(out, wire(chunk(job, i, "", {}, nullptr, !c.begun, nullptr, &parsed)));
    } else if (!delta.empty() || (job.chat && !c.begun)) {
      send_event(out, wire(chunk(job, i, delta, {}, nullptr, !c.begun)));
    }
    c.begun = c.ended = true;
    return send_event(out, wire(chunk(job, i, "", {}, finish_reason(c), false)));
  }

  void stream(Job& job, http::Responder& out) {
    if (!out.begin_chunks(200, "text/event-stream")) return job.cancel();
    std::optional<Refusal> failed;
    std::string delta;
    try {
      // Every choice's tokens as they come: a pass takes what is ready,
      // then waits for the next token or end of any choice.
      for (size_t open = job.choices.size(); open > 0 && !failed;) {
        const uint64_t seen = job.signal->events();
        bool moved = false;
        for (size_t i = 0; i < job.choices.size() && !failed; ++i) {
          Choice& c = job.choices[i];
          if (c.ended) continue;
          const Next got = advance(job, c, delta, false);
          if (got == Next::None) continue;
          moved = true;
          if (got == Next::End && (failed = failure(c))) break;
          if (!stream_choice(job, i, got, delta, out)) return job.cancel();  // gone
          if (c.ended) --open;
        }
        if (!moved && open > 0) job.signal->wait(seen);
      }
    } catch (const std::exception& e) {
      failed = Refusal{500, "internal error: " + plain(e.what()), ""};
    }
    if (failed) {
      job.cancel();
      send_event(out, wire(api::error_body(*failed)));
    } else if (job.include_usage) {
      json u = envelope(job, true);
      u["choices"] = json::array();
      u["usage"] = usage(job);
      send_event(out, wire(u));
    }
    send_event(out, "[DONE]");
    out.end_chunks();
  }

  void handle(const std::string& body, http::Responder& out, bool chat) {
    try {
      run(start(api::parse_body(body, opt.max_json_depth), body, chat), out);
    } catch (const Refusal& r) {
      send_error(out, r);
    } catch (const json::exception& e) {
      send_error(out, Refusal{400, fmt::format("malformed request: {}", e.what()), ""});
    }
  }

  // A submitted job's answer, streamed or whole.
  void run(Job job, http::Responder& out) {
    // Each choice's generation is watched: a client that leaves cancels them all.
    std::vector<std::unique_ptr<Watch>> watches;
    for (const auto& c : job.choices) watches.push_back(std::make_unique<Watch>(watcher, out.socket(), c.gen));
    // However the answer ends (a failed choice, an error, a client gone),
    // nobody reads the rest of the choices still running.
    struct CancelRest {
      const Job& job;
      ~CancelRest() { job.cancel(); }
    } rest{job};
    if (job.messages) return job.stream ? stream_message(job, out) : complete_message(job, out, *watches.front());
    if (job.stream) return stream(job, out);
    complete(job, out, *watches.front());
  }

  // ---- Anthropic's Messages API: the chat path, answered in its shapes ----

  static void send_message_error(http::Responder& out, const Refusal& r) {
    out.send(r.status, wire(api::messages_error_body(r)));
  }

  // POST /v1/messages and /v1/messages/count_tokens.
  void handle_messages(const std::string& body, http::Responder& out, bool count) {
    try {
      json chat;
      try {
        json b = api::parse_body(body, opt.max_json_depth);
        if (count && !b.contains("max_tokens")) b["max_tokens"] = 1;  // counting generates nothing
        chat = api::messages_to_chat(b);
        const std::string tools = api::messages_tools_text(body);
        if (count) {
          const api::Request q = api::read_request(chat, true, limits(), tools);
          return out.send(200, wire(json{{"input_tokens", q.batch.prompt.size()}}));
        }
        chat["n"] = 1;
        Job job = start(chat, tools, true);
        job.messages = true;
        job.id = fmt::format("msg_{:x}", next_id++);
        return run(std::move(job), out);
      } catch (const Refusal& r) {
        throw api::messages_refusal(r);
      }
    } catch (const Refusal& r) {
      send_message_error(out, r);
    } catch (const json::exception& e) {
      send_message_error(out, Refusal{400, fmt::format("malformed request: {}", e.what()), ""});
    }
  }

  api::MessageEnd message_end(const Job& job, const Choice& c) const {
    api::MessageEnd e;
    e.input_tokens = static_cast<int64_t>(job.prompt.size());
    e.output_tokens = static_cast<int64_t>(c.ids.size());
    if (c.stopped()) {
      e.stop_reason = "stop_sequence";
      e.stop_sequence = c.text->stop();
    } else {
      e.stop_reason = c.gen->finish() == Finish::Length ? "max_tokens" : "end_turn";
    }
    return e;
  }

  // Tool-use ids of a Messages answer.
  static std::string tool_use_id(const Job& job) { return "toolu_" + job.id.substr(job.id.find('_') + 1) + "_"; }

  void complete_message(Job& job, http::Responder& out, const Watch& watch) {
    Choice& c = job.choices[0];
    std::string text, delta;
    while (advance(job, c, delta, true) == Next::Token) text += delta;
    text += delta;
    if (watch.client_gone()) return out.abandon();
    if (auto f = failure(c)) return send_message_error(out, *f);
    // The chat format's parser splits thinking and tool calls from the text.
    chat::Piece answer;
    if (c.parser) {
      answer = c.parser->push(text);
      answer.append(c.parser->finish());
    } else {
      answer.content = text;
    }
    api::MessageEnd end = message_end(job, c);
    if (!answer.calls.empty()) end.stop_reason = "tool_use";
    out.send(200, wire(api::message_body(job.id, job.model, api::message_blocks(answer, tool_use_id(job)), end)));
  }

  // Events: message_start, ping, the answer's blocks as they arrive
  // (api::MessageStream), message_delta with the stop reason,
  // message_stop; a failure after the start is an `error` event.
  void stream_message(Job& job, http::Responder& out) {
    if (!out.begin_chunks(200, "text/event-stream")) return job.cancel();
    Choice& c = job.choices[0];
    auto send_all = [&](const std::vector<json>& events) {
      for (const json& e : events)
        if (!out.chunk(api::message_event(e))) return false;
      return true;
    };
    api::MessageStream blocks(tool_use_id(job));
    bool ok = send_all(
        {api::message_start(job.id, job.model, static_cast<int64_t>(job.prompt.size())), json{{"type", "ping"}}});
    std::optional<Refusal> failed;
    std::string delta;
    try {
      while (ok) {
        const Next got = advance(job, c, delta, true);
        if (c.parser) {
          chat::Piece piece = c.parser->push(delta);
          if (got == Next::End) piece.append(c.parser->finish());
          ok = send_all(blocks.push(piece));
        } else if (!delta.empty()) {
          ok = send_all(blocks.text(delta));
        }
        if (got == Next::End) {
          failed = failure(c);
          break;
        }
      }
    } catch (const std::exception& e) {
      failed = Refusal{500, "internal error: " + plain(e.what()), ""};
    }
    if (!ok) return job.cancel();  // gone
    if (failed) {
      job.cancel();
      send_all({api::messages_error_body(*failed)});
    } else {
      api::MessageEnd end = message_end(job, c);
      if (blocks.called()) end.stop_reason = "tool_use";
      send_all(blocks.finish());
      send_all({api::message_delta(end), api::message_stop()});
    }
    out.end_chunks();
  }

  // GET /metrics: Prometheus' text format.
  std::string render_metrics() const {
    const Batcher& b = *model.batcher;
    const BatcherCounters& k = b.counters();
    std::string out;
    requests.render(out);
    metrics::scalar(out, "deepseek_prompt_tokens_total", "counter", "Prompt tokens read into the caches.",
                    static_cast<double>(k.prompt_tokens.load()));
    metrics::scalar(out, "deepseek_generation_tokens_total", "counter", "Tokens generated.",
                    static_cast<double>(k.generated_tokens.load()));
    k.time_to_first_token.render(out, "deepseek_time_to_first_token_seconds",
                                 "From a sequence's submission (queueing included) to its first new token.");
    k.time_per_output_token.render(out, "deepseek_time_per_output_token_seconds",
                                   "Between one new token of a sequence and its next.");
    metrics::scalar(out, "deepseek_draft_tokens_total", "counter",
                    "Speculative decoding: tokens the MTP layer drafted and a step checked.",
                    static_cast<double>(k.drafted.load()));
    metrics::scalar(out, "deepseek_draft_accepted_total", "counter",
                    "Speculative decoding: drafted tokens kept (their share is the acceptance rate).",
                    static_cast<double>(k.accepted.load()));
    const int64_t K = b.options().draft_tokens;
    if (K > 0) {
      metrics::header(out, "deepseek_draft_tokens_by_position_total", "counter",
                      "Speculative decoding: drafts checked at each position of a step's chain (1: the first).");
      for (int64_t j = 0; j < K; ++j)
        metrics::sample(out, "deepseek_draft_tokens_by_position_total", fmt::format("position=\"{}\"", j + 1),
                        static_cast<double>(k.drafted_at[static_cast<size_t>(j)].load()));
      metrics::header(out, "deepseek_draft_accepted_by_position_total", "counter",
                      "Speculative decoding: drafts kept at each position of a step's chain.");
      for (int64_t j = 0; j < K; ++j)
        metrics::sample(out, "deepseek_draft_accepted_by_position_total", fmt::format("position=\"{}\"", j + 1),
                        static_cast<double>(k.accepted_at[static_cast<size_t>(j)].load()));
    }
    metrics::scalar(out, "deepseek_running_sequences", "gauge", "Sequences in batch slots.",
                    static_cast<double>(b.running()));
    metrics::scalar(out, "deepseek_waiting_sequences", "gauge", "Sequences waiting for a slot.",
                    static_cast<double>(b.waiting()));
    metrics::scalar(out, "deepseek_max_sequences", "gauge", "Batch slots.",
                    static_cast<double>(b.options().max_sequences));
    metrics::scalar(out, "deepseek_cache_bytes", "gauge",
                    "Bytes the KV caches (or V4 states) hold after the last step.",
                    static_cast<double>(k.cache_bytes.load()));
    render_pool_metrics(out, k);
    return out;
  }

  void route(const http::Request& req, std::string_view path, http::Responder& out) {
    const bool get = req.method() == http::bhttp::verb::get, post = req.method() == http::bhttp::verb::post;
    if (post && (path == "/v1/completions" || path == "/v1/chat/completions"))
      return handle(req.body(), out, path == "/v1/chat/completions");
    if (post && (path == "/v1/messages" || path == "/v1/messages/count_tokens"))
      return handle_messages(req.body(), out, path == "/v1/messages/count_tokens");
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
                                     {"waiting", model.batcher->waiting()},
                                     {"cache", pool_health(model.batcher->counters())}}));
    if (get && path == "/metrics") return out.send(200, render_metrics(), "text/plain; version=0.0.4; charset=utf-8");
    send_error(out, Refusal{404, fmt::format("no route {} {}", std::string(req.method_string()), path), ""});
  }

  void dispatch(const http::Request& req, http::Responder& out) {
    const auto target = req.target();
    std::string_view path(target.data(), target.size());
    path = path.substr(0, path.find('?'));
    // Counted as the answer goes out, before the client can read it; 0: the
    // client left before an answer.
    bool counted = false;
    out.on_answer = [&](int status) {
      requests.add(route_label(path), status);
      counted = true;
    };
    try {
      route(req, path, out);
    } catch (const std::exception& e) {
      if (!out.answered()) send_error(out, Refusal{500, "internal error: " + plain(e.what()), ""});
    }
    if (!counted) requests.add(route_label(path), 0);
    out.on_answer = nullptr;
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
      // The transport's own refusals (a body over the limit, a slow or
      // malformed request, a full server) never reach a route: each is
      // counted here, under route "unrouted", as its body is made.
      [im](int status, const std::string& message) {
        im->requests.add("unrouted", status);
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
