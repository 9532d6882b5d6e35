#include "infer/server_output.h"

#include <fmt/format.h>

namespace ds::infer::api {

using json = nlohmann::json;

std::string token_text(const io::Tokenizer* tok, int32_t id) {
  if (!tok || id >= tok->vocab_size()) return fmt::format("token_id:{}", id);
  try {
    return tok->decode(std::vector<int32_t>{id}, /*skip_special_tokens=*/false);
  } catch (const std::exception&) {
    return fmt::format("token_id:{}", id);  // an id the tokenizer has a hole at
  }
}

// Characters of UTF-8 text (bytes that do not continue a character).
static int64_t characters(const std::string& s) {
  int64_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

json completion_logprobs(const io::Tokenizer* tok, const std::vector<LoggedToken>& tokens, int64_t* offset) {
  json texts = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (const LoggedToken& t : tokens) {
    const std::string text = token_text(tok, t.id);
    offsets.push_back(*offset);
    *offset += characters(text);
    texts.push_back(text);
    if (!t.lp) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    lps.push_back(t.lp->logprob);
    json top = json::object();
    for (const auto& [id, lp] : t.lp->top) {
      const std::string name = token_text(tok, id);
      if (!top.contains(name)) top[name] = lp;  // two ids of one text: the likelier
    }
    tops.push_back(std::move(top));
  }
  return {{"tokens", texts}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

static json chat_entry(const std::string& text, float logprob) {
  return {{"token", text}, {"logprob", logprob}, {"bytes", std::vector<uint8_t>(text.begin(), text.end())}};
}

json chat_logprobs(const io::Tokenizer* tok, const std::vector<LoggedToken>& tokens) {
  json content = json::array();
  for (const LoggedToken& t : tokens) {
    if (!t.lp) continue;
    json e = chat_entry(token_text(tok, t.id), t.lp->logprob);
    json top = json::array();
    for (const auto& [id, lp] : t.lp->top) top.push_back(chat_entry(token_text(tok, id), lp));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", content}};
}

static json call_object(const chat::Call& c, const std::string& id) {
  return {{"id", id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
}

json chat_message(const chat::Piece& p, bool thinking, const std::string& call_id) {
  json m = {{"role", "assistant"}};
  m["content"] = p.content.empty() && !p.calls.empty() ? json(nullptr) : json(p.content);
  if (thinking) m["reasoning_content"] = p.reasoning;
  if (!p.calls.empty()) {
    json calls = json::array();
    for (size_t k = 0; k < p.calls.size(); ++k) calls.push_back(call_object(p.calls[k], call_id + std::to_string(k)));
    m["tool_calls"] = std::move(calls);
  }
  return m;
}

json chat_delta(const chat::Piece& p, const std::string& call_id, size_t* calls) {
  json d = json::object();
  if (!p.reasoning.empty()) d["reasoning_content"] = p.reasoning;
  if (!p.content.empty()) d["content"] = p.content;
  if (!p.calls.empty()) {
    json list = json::array();
    for (const auto& c : p.calls) {
      json o = call_object(c, call_id + std::to_string(*calls));
      o["index"] = (*calls)++;
      list.push_back(std::move(o));
    }
    d["tool_calls"] = std::move(list);
  }
  return d;
}

}  // namespace ds::infer::api
