#include "infer/server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <ctime>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.h"
#include "infer/text_stream.h"

namespace ds::infer {

namespace {

using json = nlohmann::json;

// A request the server does not run: the HTTP status, one line, and the
// body parameter at fault (empty: none).
struct Refusal {
  int status;
  std::string message, param;
};

[[noreturn]] void refuse(std::string param, std::string message, int status = 400) {
  throw Refusal{status, std::move(message), std::move(param)};
}

json error_body(const Refusal& r) {
  const char* type = r.status == 503 ? "unavailable_error" : r.status >= 500 ? "server_error" : "invalid_request_error";
  return {{"error",
           {{"message", r.message},
            {"type", type},
            {"param", r.param.empty() ? json(nullptr) : json(r.param)},
            {"code", nullptr}}}};
}

// JSON text for the wire. Messages can quote a client's bytes (a JSON
// parse error does); invalid UTF-8 becomes U+FFFD rather than an exception.
std::string wire(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_error(httplib::Response& res, const Refusal& r) {
  res.status = r.status;
  res.set_content(wire(error_body(r)), "application/json");
}

// A library error's message without the source location it ends with.
std::string plain(const char* what) {
  std::string s = what;
  const size_t p = s.rfind(" [src/");
  if (p != std::string::npos && s.back() == ']') s.resize(p);
  return s;
}

// ---- request fields ---------------------------------------------------------

const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

int64_t int_field(const json& body, const char* key, int64_t def, int64_t lo, int64_t hi) {
  const json* v = field(body, key);
  if (!v) return def;
  if (!v->is_number_integer()) refuse(key, fmt::format("'{}' must be an integer", key));
  const bool above = v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi);
  if (above || v->get<int64_t>() < lo || v->get<int64_t>() > hi)
    refuse(key, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, v->dump()));
  return v->get<int64_t>();
}

double number_field(const json& body, const char* key, double def, double lo, double hi) {
  const json* v = field(body, key);
  if (!v) return def;
  if (!v->is_number()) refuse(key, fmt::format("'{}' must be a number", key));
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) refuse(key, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, v->dump()));
  return x;
}

bool bool_field(const json& body, const char* key, bool def) {
  const json* v = field(body, key);
  if (!v) return def;
  if (!v->is_boolean()) refuse(key, fmt::format("'{}' must be true or false", key));
  return v->get<bool>();
}

// Fields of OpenAI's API this server does not implement: each may be absent
// or hold its default (the value that changes nothing).
void refuse_unsupported(const json& body, bool chat) {
  auto must_be = [&](const char* key, const json& neutral) {
    const json* v = field(body, key);
    if (v && *v != neutral) refuse(key, fmt::format("'{}' is not supported (only {})", key, neutral.dump()));
  };
  must_be("n", 1);
  must_be("presence_penalty", 0);
  must_be("frequency_penalty", 0);
  for (const char* key : {"logit_bias", "tools", "functions"}) {
    const json* v = field(body, key);
    if (v && !v->empty()) refuse(key, fmt::format("'{}' is not supported", key));
  }
  if (chat) {
    must_be("logprobs", false);
    const json* rf = field(body, "response_format");
    if (rf && !(rf->is_object() && rf->value("type", "") == "text"))
      refuse("response_format", "'response_format' is not supported (only {\"type\": \"text\"})");
  } else {
    must_be("best_of", 1);
    must_be("echo", false);
    must_be("suffix", "");
    const json* lp = field(body, "logprobs");
    if (lp && *lp != 0 && *lp != false) refuse("logprobs", "'logprobs' is not supported");
  }
}

// Stop strings: one string or an array of up to 16 non-empty ones.
std::vector<std::string> stop_field(const json& body) {
  const json* v = field(body, "stop");
  if (!v) return {};
  std::vector<std::string> out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array() && v->size() <= 16) {
    for (const auto& s : *v) {
      if (!s.is_string()) refuse("stop", "'stop' must be a string or an array of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    refuse("stop", "'stop' must be a string or an array of at most 16 strings");
  }
  for (const auto& s : out)
    if (s.empty()) refuse("stop", "'stop' strings must not be empty");
  return out;
}

}  // namespace

// ---- the server ------------------------------------------------------------------

struct Server::Impl {
  ServedModel model;
  ServerOptions opt;
  httplib::Server http;
  std::atomic<uint64_t> next_id{0};
  std::random_device seeds;
  std::mutex seeds_mu;
  std::atomic<bool> in_run{false}, stop_requested{false}, run_done{false};

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

  const io::Tokenizer& tokenizer(const char* param) {
    if (!model.tokenizer) refuse(param, "this model has no tokenizer.json: send the prompt as an array of token ids");
    return *model.tokenizer;
  }

  std::vector<int32_t> encode(const std::string& text, const char* param) {
    try {
      return tokenizer(param).encode(text, /*add_special_tokens=*/true);
    } catch (const Error& e) {
      refuse(param, plain(e.what()));
    }
  }

  std::vector<int32_t> ids_of(const json& a) {
    std::vector<int32_t> ids;
    for (const auto& t : a) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
        refuse("prompt", "'prompt' as an array holds token ids: non-negative integers");
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    return ids;
  }

  // /v1/completions: "prompt" is text, token ids, or a one-element array of
  // either.
  std::vector<int32_t> completion_prompt(const json& body) {
    const json* p = field(body, "prompt");
    if (!p) refuse("prompt", "'prompt' is missing");
    if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
    if (p->is_string()) return encode(p->get<std::string>(), "prompt");
    if (p->is_array() && (p->empty() || (!(*p)[0].is_array() && !(*p)[0].is_string()))) return ids_of(*p);
    if (p->is_array()) refuse("prompt", "one prompt per request");
    refuse("prompt", "'prompt' must be a string or an array of token ids");
  }

  // /v1/chat/completions: DeepSeek-V3's chat format. After the BOS, the system
  // messages' text (joined by blank lines), then "<｜User｜>" + text for a
  // user message and "<｜Assistant｜>" + text + "<｜end▁of▁sentence｜>" for an
  // assistant one, and "<｜Assistant｜>" to open the answer.
  std::vector<int32_t> chat_prompt(const json& body) {
    const json* msgs = field(body, "messages");
    if (!msgs || !msgs->is_array() || msgs->empty())
      refuse("messages", "'messages' must be a non-empty array of {\"role\", \"content\"} objects");
    const io::Tokenizer& tok = tokenizer("messages");
    const std::string user = "<｜User｜>", assistant = "<｜Assistant｜>", eos = "<｜end▁of▁sentence｜>";
    for (const auto& t : {user, assistant, eos})
      if (!tok.token_to_id(t))
        refuse("messages", fmt::format("this model's tokenizer has no '{}' token, so it has no DeepSeek chat format: "
                                       "use /v1/completions",
                                       t));
    std::string system, turns;
    for (size_t i = 0; i < msgs->size(); ++i) {
      const json& m = (*msgs)[i];
      const std::string where = fmt::format("messages[{}]", i);
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        refuse(where, fmt::format("'{}' must be an object with a string 'role'", where));
      const std::string role = m["role"].get<std::string>();
      // content: a string, or an array of {"type": "text", "text": ...} parts.
      std::string content;
      const json* c = field(m, "content");
      if (c && c->is_string()) {
        content = c->get<std::string>();
      } else if (c && c->is_array()) {
        for (const auto& part : *c) {
          if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
              !part["text"].is_string())
            refuse(where, fmt::format("'{}.content' parts must be {{\"type\": \"text\", \"text\": ...}}", where));
          content += part["text"].get<std::string>();
        }
      } else if (c || role != "assistant") {
        refuse(where, fmt::format("'{}.content' must be a string or an array of text parts", where));
      }
      if (role == "system" || role == "developer") {
        system += (system.empty() ? "" : "\n\n") + content;
      } else if (role == "user") {
        turns += user + content;
      } else if (role == "assistant") {
        turns += assistant + content + eos;
      } else {
        refuse(where, fmt::format("'{}.role' must be system, user or assistant, got '{}'", where, role));
      }
    }
    try {
      std::vector<int32_t> ids;
      if (auto bos = tok.bos_id()) ids.push_back(*bos);
      for (int32_t t : tok.encode(system + turns + assistant, /*add_special_tokens=*/false)) ids.push_back(t);
      return ids;
    } catch (const Error& e) {
      refuse("messages", plain(e.what()));
    }
  }

  Job start(const json& body, bool chat) {
    refuse_unsupported(body, chat);
    Batcher& b = *model.batcher;
    BatchRequest r;
    r.prompt = chat ? chat_prompt(body) : completion_prompt(body);
    const int64_t n = static_cast<int64_t>(r.prompt.size());
    if (n == 0) refuse(chat ? "messages" : "prompt", "the prompt is empty");
    if (n > b.max_positions())
      refuse(chat ? "messages" : "prompt",
             fmt::format("the prompt has {} tokens, beyond the model's {} positions", n, b.max_positions()));
    // Chat answers run to EOS or the model's last position by default, as
    // OpenAI's do; completions stop after 16 tokens.
    const int64_t room = b.max_positions() - n + 1;
    const char* max_key = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    r.max_new_tokens = int_field(body, max_key, chat ? room : 16, 0, std::numeric_limits<int32_t>::max());
    r.sampler.temperature = static_cast<float>(number_field(body, "temperature", 1.0, 0.0, 2.0));
    r.sampler.top_p = static_cast<float>(number_field(body, "top_p", 1.0, 0.0, 1.0));
    if (r.sampler.top_p <= 0.0f) refuse("top_p", "'top_p' must be in (0, 1]");
    // top_k: vLLM's and llama.cpp's extension (-1 or 0: no cut).
    r.sampler.top_k = std::max<int64_t>(0, int_field(body, "top_k", 0, -1, std::numeric_limits<int32_t>::max()));
    // vLLM's extension: generate max_tokens whatever the model says.
    r.ignore_eos = bool_field(body, "ignore_eos", false);
    const json* seed = field(body, "seed");
    if (seed && !seed->is_number_integer()) refuse("seed", "'seed' must be an integer");
    r.sampler.seed = seed ? seed->get<uint64_t>() : random_seed();
    Job job;
    job.chat = chat;
    job.stream = bool_field(body, "stream", false);
    if (const json* so = field(body, "stream_options")) {
      if (!so->is_object()) refuse("stream_options", "'stream_options' must be an object");
      job.include_usage = bool_field(*so, "include_usage", false);
    }
    const auto stops = stop_field(body);
    if (!stops.empty() && !model.tokenizer) refuse("stop", "'stop' needs text: this model has no tokenizer.json");
    if (model.tokenizer)
      job.text = std::make_unique<TextStream>(*model.tokenizer, stops, b.options().eos_token_id);
    if (const json* m = field(body, "model")) {
      if (!m->is_string()) refuse("model", "'model' must be a string");
    }
    job.model = opt.model_name;
    job.id = fmt::format("{}-{:x}", chat ? "chatcmpl" : "cmpl", next_id++);
    job.created = static_cast<int64_t>(std::time(nullptr));
    try {
      if (model.check) model.check(n, r.max_new_tokens);
    } catch (const Error& e) {
      // A chat's default runs to the model's last position, which may not
      // fit where a shorter answer would.
      const bool defaulted = !field(body, max_key);
      refuse(max_key, plain(e.what()) + (defaulted ? fmt::format("; set '{}' to ask for fewer tokens", max_key) : ""));
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

  void complete(Job& job, httplib::Response& res) {
    std::string text, delta;
    int32_t token;
    while (advance(job, delta, token)) text += delta;
    text += delta;
    if (auto f = failure(job)) return send_error(res, *f);
    json choice = {{"index", 0}, {"finish_reason", finish_reason(job)}, {"logprobs", nullptr}};
    if (job.chat)
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    else
      choice["text"] = text;
    choice["token_ids"] = job.ids;
    json out = envelope(job, false);
    out["choices"] = json::array({choice});
    out["usage"] = usage(job);
    res.set_content(wire(out), "application/json");
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

  static bool send_event(httplib::DataSink& sink, const std::string& data) {
    const std::string ev = "data: " + data + "\n\n";
    return sink.write(ev.data(), ev.size());
  }

  void stream(std::shared_ptr<Job> job, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job](size_t, httplib::DataSink& sink) {
          std::string delta;
          int32_t token;
          bool first = true;
          std::optional<Refusal> failed;
          try {
            while (advance(*job, delta, token)) {
              if (!send_event(sink, wire(chunk(*job, delta, {token}, nullptr, first)))) {
                job->gen->cancel();  // the client went away
                return false;
              }
              first = false;
            }
            failed = failure(*job);
          } catch (const std::exception& e) {
            job->gen->cancel();
            failed = Refusal{500, "internal error: " + plain(e.what()), ""};
          }
          if (failed) {
            send_event(sink, wire(error_body(*failed)));
          } else {
            // A chat stream's first chunk carries the role, even with no token.
            if (!delta.empty() || (job->chat && first)) send_event(sink, wire(chunk(*job, delta, {}, nullptr, first)));
            send_event(sink, wire(chunk(*job, "", {}, finish_reason(*job), false)));
            if (job->include_usage) {
              json u = envelope(*job, true);
              u["choices"] = json::array();
              u["usage"] = usage(*job);
              send_event(sink, wire(u));
            }
          }
          send_event(sink, "[DONE]");
          sink.done();
          return true;
        },
        [job](bool) { job->gen->cancel(); });
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool chat) {
    try {
      json body;
      try {
        body = json::parse(req.body);
      } catch (const json::parse_error& e) {
        refuse("", fmt::format("the body is not valid JSON: {}", e.what()));
      }
      if (!body.is_object()) refuse("", "the body must be a JSON object");
      auto job = std::make_shared<Job>(start(body, chat));
      if (job->stream) {
        stream(job, res);
        return;
      }
      try {
        complete(*job, res);
      } catch (...) {
        job->gen->cancel();  // nobody will read the rest
        throw;
      }
    } catch (const Refusal& r) {
      send_error(res, r);
    } catch (const json::exception& e) {
      send_error(res, Refusal{400, fmt::format("malformed request: {}", e.what()), ""});
    }
  }
};

Server::Server(ServedModel model, ServerOptions opt) : impl_(std::make_unique<Impl>()) {
  DS_CHECK(model.batcher, "server: no batcher");
  DS_CHECK(opt.threads >= 1, "server: threads must be >= 1, got {}", opt.threads);
  DS_CHECK(opt.port >= 0 && opt.port <= 65535, "server: port {} outside [0, 65535]", opt.port);
  impl_->model = std::move(model);
  impl_->opt = std::move(opt);
  Impl* im = impl_.get();
  auto& http = im->http;
  const int threads = im->opt.threads;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http.set_payload_max_length(im->opt.max_body_bytes);
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a
  // second server on the same port would share it instead of failing.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  http.Post("/v1/completions",
            [im](const httplib::Request& req, httplib::Response& res) { im->handle(req, res, false); });
  http.Post("/v1/chat/completions",
            [im](const httplib::Request& req, httplib::Response& res) { im->handle(req, res, true); });
  http.Get("/v1/models", [im](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", im->opt.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "deepseek.cpp"},
              {"max_model_len", im->model.batcher->max_positions()}};
    res.set_content(wire(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  http.Get("/health", [im](const httplib::Request&, httplib::Response& res) {
    res.set_content(wire(json{{"status", im->model.batcher->closed() ? "stopping" : "ok"},
                              {"running", im->model.batcher->running()},
                              {"waiting", im->model.batcher->waiting()}}),
                    "application/json");
  });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = plain(e.what());
    } catch (...) {
    }
    send_error(res, Refusal{500, "internal error: " + what, ""});
  });
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string msg = res.status == 404   ? fmt::format("no route {} {}", req.method, req.path)
                            : res.status == 413 ? std::string("the request body is too large")
                                                : fmt::format("HTTP {}", res.status);
    send_error(res, Refusal{res.status, msg, ""});
  });
}

Server::~Server() = default;

int Server::bind() {
  auto& o = impl_->opt;
  const int port = o.port == 0 ? impl_->http.bind_to_any_port(o.host)
                               : (impl_->http.bind_to_port(o.host, o.port) ? o.port : -1);
  DS_CHECK(port > 0, "cannot listen on {}:{} (in use, or not an address of this machine)", o.host, o.port);
  return port;
}

// httplib's stop() does nothing before the server listens, so stop() and
// run() meet through two flags: whichever comes second sees the other's.
void Server::run() {
  impl_->in_run = true;
  if (!impl_->stop_requested) impl_->http.listen_after_bind();
  impl_->run_done = true;
}

void Server::stop() {
  impl_->stop_requested = true;
  if (!impl_->in_run) return;  // run() will see stop_requested
  while (!impl_->http.is_running() && !impl_->run_done)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  impl_->http.stop();
}

}  // namespace ds::infer
