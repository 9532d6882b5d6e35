#include "infer/chat_parse.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "infer/chat_internal.h"
#include "io/json_depth.h"

namespace ds::infer::chat {

void Piece::append(Piece&& p) {
  reasoning += p.reasoning;
  content += p.content;
  for (auto& c : p.calls) calls.push_back(std::move(c));
}

namespace {

// The length of the longest end of `s` that begins `marker` (and is shorter
// than it): text that a later piece may complete into the marker.
size_t partial_marker(std::string_view s, std::string_view marker) {
  for (size_t n = std::min(s.size(), marker.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

// The newlines (at most two) that end s[0, end): DSML's blank line before a
// call block belongs to the block, not to the content.
size_t newlines_before(std::string_view s, size_t end) {
  size_t n = 0;
  while (n < 2 && end > n && s[end - n - 1] == '\n') ++n;
  return n;
}

void skip_space(std::string_view& s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\n' || s.front() == '\r' || s.front() == '\t'))
    s.remove_prefix(1);
}

bool eat(std::string_view& s, std::string_view what) {
  if (!s.starts_with(what)) return false;
  s.remove_prefix(what.size());
  return true;
}

// s up to `stop` (consumed, not returned), or nullopt when stop is absent.
std::optional<std::string_view> until(std::string_view& s, std::string_view stop) {
  const size_t at = s.find(stop);
  if (at == std::string_view::npos) return std::nullopt;
  const std::string_view head = s.substr(0, at);
  s.remove_prefix(at + stop.size());
  return head;
}

std::string_view trim(std::string_view s) {
  skip_space(s);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Nesting deeper than 64 arrays or objects: refused before nlohmann parses
// it, as the server refuses such request bodies.
bool too_deep(std::string_view text) { return io::json_nests_deeper(text, 64); }

bool json_object(std::string_view text) {
  if (too_deep(text)) return false;
  const ojson v = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  return v.is_object();
}

bool json_value(std::string_view text) { return !too_deep(text) && ojson::accept(text); }

// V3.1: <｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>name<｜tool▁sep｜>
// arguments<｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>, space between calls
// allowed.
std::optional<std::vector<Call>> v31_block(std::string_view s, const std::set<std::string_view>& names) {
  if (!eat(s, kCallsBegin) || !s.ends_with(kCallsEnd)) return std::nullopt;
  s.remove_suffix(std::string_view(kCallsEnd).size());
  std::vector<Call> calls;
  for (skip_space(s); !s.empty(); skip_space(s)) {
    if (!eat(s, kCallBegin)) return std::nullopt;
    const auto name = until(s, kCallSep);
    const auto args = name ? until(s, kCallEnd) : std::nullopt;
    if (!args || !names.contains(trim(*name)) || !json_object(trim(*args))) return std::nullopt;
    calls.push_back({std::string(trim(*name)), std::string(trim(*args))});
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

// name="value" after optional space; the value runs to the next quote.
std::optional<std::string_view> attribute(std::string_view& s, std::string_view key) {
  skip_space(s);
  if (!eat(s, key) || !eat(s, "=\"")) return std::nullopt;
  return until(s, "\"");
}

// One <｜DSML｜invoke name="...">...</｜DSML｜invoke> (the opening tag's
// "<｜DSML｜invoke" already read; V4.1 spells the tags "<｜DSML｜ invoke"):
// its name and its arguments as a JSON object, built as DeepSeek's decoder
// builds it (string="true" values as JSON strings, the others as written).
std::optional<Call> dsml_invoke(const DsmlTags& tags, std::string_view& s, const std::set<std::string_view>& names) {
  const std::string param_open = fmt::format("<{}{}", kDsml, tags.parameter),
                    param_close = fmt::format("</{}{}>", kDsml, tags.parameter),
                    invoke_close = fmt::format("</{}{}>", kDsml, tags.invoke);
  const auto name = attribute(s, "name");
  skip_space(s);
  if (!name || !eat(s, ">") || !names.contains(*name)) return std::nullopt;
  std::set<std::string_view> keys;
  std::string args;
  for (skip_space(s); !eat(s, invoke_close); skip_space(s)) {
    if (!eat(s, param_open)) return std::nullopt;
    const auto key = attribute(s, "name");
    const auto is_string = key ? attribute(s, "string") : std::nullopt;
    skip_space(s);
    if (!is_string || (*is_string != "true" && *is_string != "false") || !eat(s, ">")) return std::nullopt;
    const auto value = until(s, param_close);
    if (!value || !keys.insert(*key).second) return std::nullopt;
    // A value marked as JSON that is not JSON is kept as the string it is.
    const bool raw = *is_string == "false" && json_value(*value);
    args += fmt::format("{}{}: {}", args.empty() ? "" : ", ", python_json(std::string(*key), false),
                        raw ? std::string(*value) : python_json(std::string(*value), false));
  }
  return Call{std::string(*name), "{" + args + "}"};
}

std::optional<std::vector<Call>> dsml_calls(Format f, std::string_view s, const std::set<std::string_view>& names) {
  const DsmlTags tags = dsml_tags(f);
  const std::string open = fmt::format("<{}{}>", kDsml, tags.block), close = fmt::format("</{}{}>", kDsml, tags.block),
                    invoke = fmt::format("<{}{}", kDsml, tags.invoke);
  if (!eat(s, open) || !s.ends_with(close)) return std::nullopt;
  s.remove_suffix(close.size());
  std::vector<Call> calls;
  for (skip_space(s); !s.empty(); skip_space(s)) {
    if (!eat(s, invoke)) return std::nullopt;
    auto call = dsml_invoke(tags, s, names);
    if (!call) return std::nullopt;
    calls.push_back(std::move(*call));
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

}  // namespace

std::optional<std::vector<Call>> parse_block(Format f, std::string_view block, const std::vector<std::string>& names) {
  const std::set<std::string_view> known(names.begin(), names.end());
  if (f == Format::V31) return v31_block(block, known);
  if (dsml_format(f)) return dsml_calls(f, block, known);
  return std::nullopt;
}

AnswerParser::AnswerParser(Format f, const Prompt& prompt)
    : think_end_(kThinkEnd),
      dsml_(dsml_format(f)),
      tools_(prompt.parse_tools && f != Format::V3),
      parallel_(prompt.parallel_calls),
      names_(prompt.tool_names),
      format_(f),
      state_(prompt.reasoning_first ? State::Reasoning : State::Content) {
  if (dsml_) {
    begin_ = fmt::format("<{}{}>", kDsml, dsml_tags(f).block);
    end_ = fmt::format("</{}{}>", kDsml, dsml_tags(f).block);
  } else {
    begin_ = kCallsBegin;
    end_ = kCallsEnd;
  }
  // A forced call: the answer continues the block the prompt opened.
  if (tools_ && !prompt.prefill.empty()) {
    state_ = State::Block;
    block_ = prompt.prefill.substr(prompt.prefill.find('<'));
  }
}

// Ends the call block in block_: its calls, or its text as content.
void AnswerParser::close_block(Piece& out) {
  auto calls = parse_block(format_, block_, names_);
  if (calls) {
    for (auto& c : *calls)
      if (parallel_ || calls_ == 0) {
        out.calls.push_back(std::move(c));
        ++calls_;
      }
  } else {
    out.content += sep_ + block_;
  }
  block_.clear();
  sep_.clear();
  state_ = State::Content;
}

// Hands on what buf_ decides, in the current state and those it leads to.
Piece AnswerParser::step() {
  Piece out;
  for (;;) {
    if (state_ == State::Reasoning) {
      const size_t at = buf_.find(think_end_);
      if (at == std::string::npos) {
        const size_t keep = partial_marker(buf_, think_end_);
        out.reasoning += buf_.substr(0, buf_.size() - keep);
        buf_.erase(0, buf_.size() - keep);
        return out;
      }
      out.reasoning += buf_.substr(0, at);
      buf_.erase(0, at + think_end_.size());
      state_ = State::Content;
    } else if (state_ == State::Content) {
      if (!tools_) {
        out.content += buf_;
        buf_.clear();
        return out;
      }
      const size_t at = buf_.find(begin_);
      if (at == std::string::npos) {
        size_t keep = partial_marker(buf_, begin_);
        if (dsml_) keep += newlines_before(buf_, buf_.size() - keep);
        out.content += buf_.substr(0, buf_.size() - keep);
        buf_.erase(0, buf_.size() - keep);
        return out;
      }
      const size_t nl = dsml_ ? newlines_before(buf_, at) : 0;
      out.content += buf_.substr(0, at - nl);
      sep_ = buf_.substr(at - nl, nl);
      block_ = begin_;
      buf_.erase(0, at + begin_.size());
      state_ = State::Block;
    } else {
      // Search the block from where its end could first begin.
      const size_t from = block_.size() >= end_.size() ? block_.size() - end_.size() + 1 : 0;
      block_ += buf_;
      buf_.clear();
      const size_t at = block_.find(end_, from);
      if (at == std::string::npos) return out;
      buf_ = block_.substr(at + end_.size());
      block_.resize(at + end_.size());
      close_block(out);
    }
  }
}

Piece AnswerParser::push(std::string_view text) {
  buf_ += text;
  return step();
}

Piece AnswerParser::finish() {
  Piece out = step();
  if (state_ == State::Reasoning) out.reasoning += buf_;
  if (state_ == State::Content) out.content += buf_;
  if (state_ == State::Block) out.content += sep_ + block_;  // a block that never ended
  buf_.clear();
  block_.clear();
  sep_.clear();
  return out;
}

Piece parse_answer(Format f, const Prompt& prompt, std::string_view text) {
  AnswerParser p(f, prompt);
  Piece out = p.push(text);
  out.append(p.finish());
  return out;
}

}  // namespace ds::infer::chat
