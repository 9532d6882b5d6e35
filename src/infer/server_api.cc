#include "infer/server_api.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "io/json_depth.h"

namespace ds::infer::api {

[[noreturn]] void refuse(std::string param, std::string message, int status) {
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

// A library error's message without the source location it ends with.
std::string plain(const char* what) {
  std::string s = what;
  const size_t p = s.rfind(" [src/");
  if (p != std::string::npos && s.back() == ']') s.resize(p);
  return s;
}

std::string error_text(const Refusal& r) { return wire(error_body(r)); }

json parse_body(std::string_view body, int max_depth) {
  if (io::json_nests_deeper(body, max_depth))
    refuse("", fmt::format("the body is nested deeper than {} arrays or objects", max_depth));
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number beyond double (1e400).
    refuse("", fmt::format("the body is not valid JSON: {}", e.what()));
  }
  if (!j.is_object()) refuse("", "the body must be a JSON object");
  return j;
}

const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

namespace {

// ---- request fields ---------------------------------------------------------

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
  // Chat's tools are the chat format's (infer/chat_format.h); OpenAI's
  // older "functions" are not, nor are tools for plain completions.
  if (const json* v = field(body, "functions"); v && !v->empty())
    refuse("functions", "'functions' is not supported (use 'tools' on /v1/chat/completions)");
  if (const json* v = field(body, "tools"); v && !v->empty() && !chat)
    refuse("tools", "'tools' is not supported (only on /v1/chat/completions)");
  if (chat) {
    const json* rf = field(body, "response_format");
    // (A "type" that is not a string is refused too, not thrown on.)
    if (rf && !(rf->is_object() && rf->contains("type") && (*rf)["type"] == "text"))
      refuse("response_format", "'response_format' is not supported (only {\"type\": \"text\"})");
  } else {
    must_be("best_of", 1);
    must_be("suffix", "");
  }
}

// presence_penalty, frequency_penalty (OpenAI's), repetition_penalty (vLLM's
// and llama.cpp's) and logit_bias: {"token id": bias}.
LogitAdjust adjust_fields(const json& body, int64_t vocab) {
  LogitAdjust a;
  a.presence = static_cast<float>(number_field(body, "presence_penalty", 0.0, -2.0, 2.0));
  a.frequency = static_cast<float>(number_field(body, "frequency_penalty", 0.0, -2.0, 2.0));
  a.repetition = static_cast<float>(
      number_field(body, "repetition_penalty", 1.0, 0.0, static_cast<double>(std::numeric_limits<float>::max())));
  if (a.repetition <= 0.0f) refuse("repetition_penalty", "'repetition_penalty' must be > 0");
  const json* lb = field(body, "logit_bias");
  if (!lb) return a;
  if (!lb->is_object()) refuse("logit_bias", "'logit_bias' must be an object of token ids (strings) to numbers");
  for (const auto& [key, v] : lb->items()) {
    const bool digits = !key.empty() && key.size() <= 10 &&
                        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    const int64_t id = digits ? std::stoll(key) : -1;
    if (id < 0 || (vocab > 0 && id >= vocab))
      refuse("logit_bias", fmt::format("'logit_bias' keys must be token ids in [0, {}), got {}", vocab,
                                       json(key).dump(-1, ' ', false, json::error_handler_t::replace)));
    if (!v.is_number() || !(v.get<double>() >= -100.0 && v.get<double>() <= 100.0))
      refuse("logit_bias", fmt::format("'logit_bias' values must be numbers in [-100, 100], got {}", v.dump()));
    a.bias.emplace_back(static_cast<int32_t>(id), v.get<float>());
  }
  return a;
}

// chat: "logprobs" true or false and "top_logprobs" 0-20; completions:
// "logprobs" an integer 0-5 (the most likely ids with each token) and
// "echo". Sets out.logprobs, out.echo and what the batcher computes.
void logprob_fields(const json& body, Request& out) {
  if (out.chat) {
    const bool on = bool_field(body, "logprobs", false);
    const int64_t top = int_field(body, "top_logprobs", 0, 0, kMaxTopLogprobs);
    if (!on && field(body, "top_logprobs")) refuse("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    out.logprobs = on ? top : -1;
  } else {
    const json* lp = field(body, "logprobs");
    if (lp && !(lp->is_boolean() && !lp->get<bool>())) {
      if (!lp->is_number_integer())
        refuse("logprobs", fmt::format("'logprobs' must be an integer in [0, {}]", kMaxCompletionLogprobs));
      out.logprobs = int_field(body, "logprobs", -1, 0, kMaxCompletionLogprobs);
    }
    out.echo = bool_field(body, "echo", false);
  }
  BatchRequest& r = out.batch;
  r.logprobs = out.logprobs >= 0;
  r.top_logprobs = std::max<int64_t>(0, out.logprobs);
  r.prompt_logprobs = out.echo && r.logprobs;
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

const io::Tokenizer& tokenizer(const Limits& lim, const char* param) {
  if (!lim.tokenizer) refuse(param, "this model has no tokenizer.json: send the prompt as an array of token ids");
  return *lim.tokenizer;
}

std::vector<int32_t> encode(const Limits& lim, const std::string& text, const char* param) {
  try {
    return tokenizer(lim, param).encode(text, /*add_special_tokens=*/true);
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
std::vector<int32_t> completion_prompt(const Limits& lim, const json& body) {
  const json* p = field(body, "prompt");
  if (!p) refuse("prompt", "'prompt' is missing");
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
  if (p->is_string()) return encode(lim, p->get<std::string>(), "prompt");
  if (p->is_array() && (p->empty() || (!(*p)[0].is_array() && !(*p)[0].is_string()))) return ids_of(*p);
  if (p->is_array()) refuse("prompt", "one prompt per request");
  refuse("prompt", "'prompt' must be a string or an array of token ids");
}

// The body's "tools" with the key order the client wrote (null: none).
chat::ojson ordered_tools(const json& body, std::string_view text) {
  const json* t = field(body, "tools");
  if (!t || (t->is_array() && t->empty())) return nullptr;
  if (text.empty()) return chat::ojson::parse(t->dump());
  // The body parsed before, so it parses again; a key given twice keeps
  // its last value in both parses.
  chat::ojson j = chat::ojson::parse(text);
  return j["tools"];
}

// /v1/chat/completions: the messages in the served model's chat format
// (infer/chat_format.h), encoded with their special tokens; the BOS is the
// tokenizer's own, as /v1/completions adds it.
std::vector<int32_t> chat_prompt(const Limits& lim, const json& body, std::string_view text, Request& out) {
  chat::Conversation c;
  try {
    c = chat::read_conversation(body, ordered_tools(body, text), lim.chat_format);
    out.chat_prompt = chat::render(lim.chat_format, c);
  } catch (const chat::Invalid& e) {
    refuse(e.param, e.message);
  }
  out.thinking = c.thinking;
  const io::Tokenizer& tok = tokenizer(lim, "messages");
  const std::string_view name = chat::format_name(lim.chat_format);
  for (const auto& t : chat::required_tokens(lim.chat_format, false))
    if (!tok.token_to_id(t))
      refuse("messages", fmt::format("this model's tokenizer has no '{}' token, which the {} chat format needs, so it "
                                     "has no DeepSeek chat format: use /v1/completions",
                                     t, name));
  if (out.chat_prompt.tool_markup)
    for (const auto& t : chat::required_tokens(lim.chat_format, true))
      if (!tok.token_to_id(t))
        refuse(out.chat_prompt.parse_tools ? "tools" : "messages",
               fmt::format("'tools' is not supported: this model's tokenizer has no '{}' token, which tool calls in "
                           "the {} chat format need",
                           t, name));
  try {
    std::vector<int32_t> ids;
    if (auto bos = tok.bos_id()) ids.push_back(*bos);
    const std::string& prompt = out.chat_prompt.text;
    const size_t skip = prompt.starts_with(chat::kBos) ? chat::kBos.size() : 0;
    for (int32_t t : tok.encode(std::string_view(prompt).substr(skip), /*add_special_tokens=*/false)) ids.push_back(t);
    return ids;
  } catch (const Error& e) {
    refuse("messages", plain(e.what()));
  }
}

}  // namespace

Request read_request(const json& body, bool chat, const Limits& lim, std::string_view body_text) {
  refuse_unsupported(body, chat);
  Request out;
  out.chat = chat;
  BatchRequest& r = out.batch;
  r.prompt = chat ? chat_prompt(lim, body, body_text, out) : completion_prompt(lim, body);
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  if (n == 0) refuse(chat ? "messages" : "prompt", "the prompt is empty");
  if (n > lim.max_positions)
    refuse(chat ? "messages" : "prompt",
           fmt::format("the prompt has {} tokens, beyond the model's {} positions", n, lim.max_positions));
  // Chat answers run to EOS or the model's last position by default, as
  // OpenAI's do; completions stop after 16 tokens.
  const int64_t room = lim.max_positions - n + 1;
  out.max_key = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  out.max_defaulted = !field(body, out.max_key);
  r.max_new_tokens = int_field(body, out.max_key, chat ? room : 16, 0, std::numeric_limits<int32_t>::max());
  r.sampler.temperature = static_cast<float>(number_field(body, "temperature", 1.0, 0.0, 2.0));
  r.sampler.top_p = static_cast<float>(number_field(body, "top_p", 1.0, 0.0, 1.0));
  if (r.sampler.top_p <= 0.0f) refuse("top_p", "'top_p' must be in (0, 1]");
  // top_k: vLLM's and llama.cpp's extension (-1 or 0: no cut).
  r.sampler.top_k = std::max<int64_t>(0, int_field(body, "top_k", 0, -1, std::numeric_limits<int32_t>::max()));
  // vLLM's extension: generate max_tokens whatever the model says.
  r.ignore_eos = bool_field(body, "ignore_eos", false);
  const json* seed = field(body, "seed");
  if (seed && !seed->is_number_integer()) refuse("seed", "'seed' must be an integer");
  out.has_seed = seed != nullptr;
  if (seed) r.sampler.seed = seed->get<uint64_t>();
  out.stream = bool_field(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) refuse("stream_options", "'stream_options' must be an object");
    out.include_usage = bool_field(*so, "include_usage", false);
  }
  out.stops = stop_field(body);
  if (!out.stops.empty() && !lim.tokenizer) refuse("stop", "'stop' needs text: this model has no tokenizer.json");
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) refuse("model", "'model' must be a string");
  }
  out.n = int_field(body, "n", 1, 1, kMaxChoices);
  r.adjust = adjust_fields(body, lim.vocab);
  logprob_fields(body, out);
  return out;
}

}  // namespace ds::infer::api
