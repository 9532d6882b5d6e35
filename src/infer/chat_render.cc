// The prompts of deepseek-v3 and deepseek-v3.1: DeepSeek's Jinja chat
// templates (tokenizer_config.json) restated as code. The rules and their
// sources are in docs/chat_formats.md; the comments say where this code
// departs from the template text and why.
#include <fmt/format.h>

#include "infer/chat_internal.h"

namespace ds::infer::chat {

namespace {

// Every system message's text, in order, joined by a blank line: both
// templates collect them before the first turn, wherever they stand.
std::string system_text(const Conversation& c) {
  std::string s;
  bool first = true;
  for (const auto& m : c.messages) {
    if (m.role != Role::System) continue;
    s += (first ? "" : "\n\n") + m.content;
    first = false;
  }
  return s;
}

bool any_system(const Conversation& c) {
  for (const auto& m : c.messages)
    if (m.role == Role::System) return true;
  return false;
}

bool has_tool_markup(const Conversation& c) {
  if (tools_on(c)) return true;
  for (const auto& m : c.messages)
    if (m.role == Role::Tool || !m.tool_calls.empty()) return true;
  return false;
}

// V3.1's tool definitions, as DeepSeek-V3.1's model card lays them out
// after the system text: a "### name" section per function, then the call
// format once. The parameters are printed with json.dumps' defaults, as the
// card writes them (non-ASCII characters as \u escapes).
std::string v31_tools(const Conversation& c) {
  std::string s = "## Tools\nYou have access to the following tools:\n\n";
  for (const auto& t : c.tools) {
    const ojson& f = t.function;
    const std::string desc =
        f.contains("description") && f["description"].is_string() ? f["description"].get<std::string>() : "";
    const ojson params = f.contains("parameters") && f["parameters"].is_object() ? f["parameters"] : ojson::object();
    s += fmt::format("### {}\nDescription: {}\n\nParameters: {}\n\n", t.name, desc, python_json(params, true));
  }
  s += "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n";
  s += fmt::format("{}{}tool_call_name{}tool_call_arguments{}{{additional_tool_calls}}{}\n\n", kCallsBegin, kCallBegin,
                   kCallSep, kCallEnd, kCallsEnd);
  s += "Where:\n"
       "- `tool_call_name` must be an exact match to one of the available tools\n"
       "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
       "- For multiple tool calls, chain them directly without separators or spaces";
  return s;
}

}  // namespace

void render_v3_tools_refusal() {
  invalid("tools",
          "'tools' is not supported by the deepseek-v3 chat format: DeepSeek-V3's template prints no tool definitions "
          "(deepseek-v3.1 and later formats do)");
}

// DeepSeek-V3: the system text after the BOS, "<｜User｜>" + text, and
// "<｜Assistant｜>" + text + EOS; "<｜Assistant｜>" opens the answer. Calls
// are "function<｜tool▁sep｜>name" and a ```json fence, one a line; results
// sit between <｜tool▁outputs▁begin｜> and <｜tool▁outputs▁end｜>, and the
// model answers right after them (no "<｜Assistant｜>"). The template's text
// closes a call block only after a second call and never resets its "first
// call" and "first output" flags; this code closes every block and starts
// each message afresh, as DeepSeek's later templates of the same format do.
Prompt render_v3(const Conversation& c) {
  if (c.thinking)
    invalid(
        "thinking",
        "the deepseek-v3 chat format has no thinking mode (DeepSeek-V3 does not think; deepseek-v3.1 and later do)");
  if (tools_on(c)) render_v3_tools_refusal();
  Prompt p;
  std::string& out = p.text;
  out = std::string(kBos) + system_text(c);
  bool in_outputs = false, continues = false;
  for (const auto& m : c.messages) {
    if (in_outputs && (m.role == Role::User || m.role == Role::Assistant)) {
      out += kOutputsEnd;
      in_outputs = false;
      continues = true;  // an assistant turn goes on straight after the results
    }
    if (m.role == Role::User) {
      out += std::string(kUser) + m.content;
      continues = false;
    } else if (m.role == Role::Assistant) {
      if (!continues) out += kAssistant;
      continues = false;
      out += m.content;
      if (!m.tool_calls.empty()) {
        out += kCallsBegin;
        for (size_t k = 0; k < m.tool_calls.size(); ++k)
          out += fmt::format("{}{}function{}{}\n```json\n{}\n```{}", k ? "\n" : "", kCallBegin, kCallSep,
                             m.tool_calls[k].name, m.tool_calls[k].arguments, kCallEnd);
        out += kCallsEnd;
      }
      out += kEos;
    } else if (m.role == Role::Tool) {
      out += in_outputs ? "\n" : std::string(kOutputsBegin);
      out += std::string(kOutputBegin) + m.content + std::string(kOutputEnd);
      in_outputs = true;
    }
  }
  if (in_outputs) out += kOutputsEnd;  // the model answers right after the results
  if (!in_outputs && c.for_answer) out += kAssistant;
  p.tool_markup = has_tool_markup(c);
  return p;
}

// DeepSeek-V3.1, after the later revision of its template, which differs
// from the first only where a conversation does not end with a user message
// (it opens an answer there too). The system text, with the tools after a blank line;
// "<｜User｜>" + text; an assistant turn right after a user turn opens with
// "<｜Assistant｜></think>" (historical turns never keep their reasoning),
// its text cut after the first "</think>"; calls are
// <｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>name<｜tool▁sep｜>arguments
// <｜tool▁call▁end｜>)+<｜tool▁calls▁end｜> + EOS; each result is
// <｜tool▁output▁begin｜>text<｜tool▁output▁end｜> and the model goes on
// right after the last one. Otherwise "<｜Assistant｜>" and <think> (thinking)
// or </think> open the answer.
Prompt render_v31(const Conversation& c) {
  const bool tools = tools_on(c);
  if (tools && c.thinking)
    invalid("tools",
            "'tools' need thinking off in the deepseek-v3.1 chat format: DeepSeek-V3.1 calls tools in non-thinking "
            "mode only");
  Prompt p;
  std::string& out = p.text;
  std::string sys = system_text(c);
  if (tools) sys += "\n\n" + v31_tools(c);
  out = std::string(kBos) + sys;
  bool last_user = false, is_tool = false, only_system = any_system(c);
  const std::string open = std::string(kAssistant) + std::string(kThinkEnd);
  for (const auto& m : c.messages) {
    if (m.role == Role::User) {
      is_tool = false;
      last_user = true;
      out += std::string(kUser) + m.content;
    } else if (m.role == Role::Assistant && !m.tool_calls.empty()) {
      if (last_user || only_system) out += open;
      last_user = is_tool = false;
      out += m.content + kCallsBegin;
      for (const auto& call : m.tool_calls)
        out += fmt::format("{}{}{}{}{}", kCallBegin, call.name, kCallSep, call.arguments, kCallEnd);
      out += std::string(kCallsEnd) + std::string(kEos);
    } else if (m.role == Role::Assistant) {
      if (last_user) out += open;
      last_user = false;
      if (is_tool) {
        out += m.content + std::string(kEos);
        is_tool = false;
      } else {
        const size_t cut = m.content.find(kThinkEnd);
        out += (cut == std::string::npos ? m.content : m.content.substr(cut + kThinkEnd.size())) + std::string(kEos);
      }
    } else if (m.role == Role::Tool) {
      last_user = false;
      is_tool = true;
      out += std::string(kOutputBegin) + m.content + std::string(kOutputEnd);
    }
    if (m.role != Role::System) only_system = false;
  }
  if (!is_tool && c.for_answer) {
    out += std::string(kAssistant) + std::string(c.thinking ? kThinkBegin : kThinkEnd);
    p.reasoning_first = c.thinking;
  }
  p.parse_tools = tools;
  p.tool_markup = has_tool_markup(c);
  if (!c.for_answer) return p;
  if (tools && c.tool_choice == ToolChoice::Required) p.prefill = kCallsBegin;
  if (tools && c.tool_choice == ToolChoice::Named)
    p.prefill = fmt::format("{}{}{}{}", kCallsBegin, kCallBegin, c.forced, kCallSep);
  out += p.prefill;
  return p;
}

}  // namespace ds::infer::chat
