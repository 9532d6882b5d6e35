// The prompts of deepseek-v3.2 and deepseek-v4: DeepSeek's reference
// encoders (encoding/encoding_dsv32.py, encoding/encoding_dsv4.py, which
// replace a Jinja template from V3.2 on) restated as code. Calls are DSML:
//
//   \n\n<｜DSML｜tool_calls>                      (V3.2: function_calls)
//   <｜DSML｜invoke name="get_weather">
//   <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
//   <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
//   </｜DSML｜invoke>
//   </｜DSML｜tool_calls>
//
// a string argument verbatim, any other as JSON. The rules and their
// sources are in docs/chat_formats.md.
#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "infer/chat_internal.h"

namespace ds::infer::chat {

DsmlTags dsml_tags(Format f) {
  if (f == Format::V32) return {"function_calls", "invoke", "parameter"};
  if (f == Format::V41) return {" calls", " invoke", " parameter"};
  return {"tool_calls", "invoke", "parameter"};
}

namespace {

// The tool definitions each encoder appends to the system text that carries
// them ({dsml} is ｜DSML｜, {schemas} one JSON object per function, a line each).
constexpr std::string_view kV32Tools =
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    "You can invoke functions by writing a \"<{dsml}function_calls>\" block like the following as part of your reply "
    "to the user:\n"
    "<{dsml}function_calls>\n"
    "<{dsml}invoke name=\"$FUNCTION_NAME\">\n"
    "<{dsml}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{dsml}parameter>\n"
    "...\n"
    "</{dsml}invoke>\n"
    "<{dsml}invoke name=\"$FUNCTION_NAME2\">\n"
    "...\n"
    "</{dsml}invoke>\n"
    "</{dsml}function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects "
    "should use JSON format. The \"string\" attribute should be set to \"true\" for string type parameters and "
    "\"false\" for other types (numbers, booleans, arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking "
    "block. Here is an example:\n"
    "<{dsml}function_calls>\n"
    "...\n"
    "</{dsml}function_calls>\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n"
    "<think>...thinking about results</think>\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    "{schemas}\n"
    "</functions>\n";

// V4.1 prints the same text with its own tag names.
constexpr std::string_view kV4Tools =
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<{dsml}{block}>\" block like the following:\n"
    "\n"
    "<{dsml}{block}>\n"
    "<{dsml}{invoke} name=\"$TOOL_NAME\">\n"
    "<{dsml}{param} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{dsml}{param}>\n"
    "...\n"
    "</{dsml}{invoke}>\n"
    "<{dsml}{invoke} name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</{dsml}{invoke}>\n"
    "</{dsml}{block}>\n"
    "\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n"
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    "{schemas}\n"
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

// V4's prefix for reasoning_effort "max" in thinking mode, at the very start.
constexpr std::string_view kV4EffortMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

std::string tools_text(Format f, const Conversation& c) {
  std::string schemas;
  for (const auto& t : c.tools) {
    if (!schemas.empty()) schemas += '\n';
    schemas += python_json(t.function, false);
  }
  const DsmlTags tags = dsml_tags(f);
  return fmt::format(fmt::runtime(f == Format::V32 ? kV32Tools : kV4Tools), fmt::arg("dsml", kDsml),
                     fmt::arg("block", tags.block), fmt::arg("invoke", tags.invoke), fmt::arg("param", tags.parameter),
                     fmt::arg("schemas", schemas));
}

// One call as DSML. Its arguments must be a JSON object; V4's encoder
// passes text that is not JSON at all as {"arguments": text}, V3.2's and
// V4.1's refuse it.
std::string invoke(Format f, const ToolCall& call, const std::string& where) {
  ojson args;
  try {
    args = ojson::parse(call.arguments);
  } catch (const ojson::exception&) {
    if (f != Format::V4)
      invalid(where,
              fmt::format("'{}' tool call arguments must be a JSON object, got {}", where, quote(call.arguments)));
    args = {{"arguments", call.arguments}};
  }
  if (!args.is_object())
    invalid(where, fmt::format("'{}' tool call arguments must be a JSON object, got {}", where, quote(call.arguments)));
  const DsmlTags tags = dsml_tags(f);
  std::string params;
  for (const auto& [k, v] : args.items())
    params += fmt::format("{}<{}{} name=\"{}\" string=\"{}\">{}</{}{}>", params.empty() ? "" : "\n", kDsml,
                          tags.parameter, k, v.is_string() ? "true" : "false",
                          v.is_string() ? v.get<std::string>() : python_json(v, false), kDsml, tags.parameter);
  return fmt::format("<{0}{1} name=\"{2}\">\n{3}\n</{0}{1}>", kDsml, tags.invoke, call.name, params);
}

std::string calls_text(Format f, const Message& m, const std::string& where) {
  if (m.tool_calls.empty()) return "";
  std::string list;
  for (const auto& call : m.tool_calls) list += (list.empty() ? "" : "\n") + invoke(f, call, where);
  return fmt::format("\n\n<{0}{1}>\n{2}\n</{0}{1}>", kDsml, dsml_tags(f).block, list);
}

// The call the prompt starts for tool_choice "required" or a named function,
// as an assistant turn with no text and that call would begin.
std::string forced_prefill(Format f, const Conversation& c) {
  if (!c.for_answer || !tools_on(c) || (c.tool_choice != ToolChoice::Required && c.tool_choice != ToolChoice::Named))
    return "";
  std::string s = fmt::format("\n\n<{}{}>\n", kDsml, dsml_tags(f).block);
  if (c.tool_choice == ToolChoice::Named)
    s += fmt::format("<{}{} name=\"{}\">\n", kDsml, dsml_tags(f).invoke, c.forced);
  return s;
}

// The messages to render: with tools, the first system message carries them,
// or an empty one is put first (as vLLM and SGLang do). `index` maps back to
// the request's messages for errors (-1: the inserted one).
struct Listed {
  std::vector<const Message*> msgs;
  std::vector<int> index;
  int tools_at = -1;
};

Listed listed(const Conversation& c, const Message& empty_system) {
  Listed l;
  const bool insert = tools_on(c) && c.messages.front().role != Role::System;
  if (insert) {
    l.msgs.push_back(&empty_system);
    l.index.push_back(-1);
  }
  for (size_t i = 0; i < c.messages.size(); ++i) {
    l.msgs.push_back(&c.messages[i]);
    l.index.push_back(static_cast<int>(i));
  }
  if (tools_on(c)) l.tools_at = 0;
  return l;
}

std::string where_of(const Listed& l, size_t i) { return fmt::format("messages[{}]", std::max(0, l.index[i])); }

// V3.2's results after an assistant turn: "\n\n<function_results>", then
// "\n<result>" + text + "</result>" per call, then "\n</function_results>" and
// "\n\n" with <think> (thinking) or </think>. Returns whether the block closed.
bool v32_result(const Listed& l, size_t i, bool think, std::string& out) {
  size_t a = i;
  while (a > 0 && l.msgs[a - 1]->role == Role::Tool) --a;
  if (a == 0 || l.msgs[a - 1]->role != Role::Assistant || l.msgs[a - 1]->tool_calls.empty())
    invalid(where_of(l, i), fmt::format("'{}' is a tool result with no assistant tool call before it", where_of(l, i)));
  const size_t order = i - a + 1, calls = l.msgs[a - 1]->tool_calls.size();
  if (order > calls)
    invalid(where_of(l, i), fmt::format("'{}' is tool result {} of an assistant turn with {} tool calls",
                                        where_of(l, i), order, calls));
  if (order == 1) out += "\n\n<function_results>";
  out += "\n<result>" + l.msgs[i]->content + "</result>";
  if (order < calls) return false;
  out += "\n</function_results>\n\n" + std::string(think ? kThinkBegin : kThinkEnd);
  return true;
}

}  // namespace

// DeepSeek-V3.2: the BOS; a system message's text (the one with the tools:
// + "\n\n" + the tool definitions); a user turn "<｜User｜>" + text +
// "<｜Assistant｜>" and <think> (thinking, the last user turn only) or
// </think>; an assistant turn its reasoning + "</think>" (thinking, after
// the last user turn only), text, calls and EOS; tool results as above.
Prompt render_v32(const Conversation& c) {
  Message empty_system;
  empty_system.role = Role::System;
  const Listed l = listed(c, empty_system);
  int last_user = -1;
  for (size_t i = 0; i < l.msgs.size(); ++i)
    if (l.msgs[i]->role == Role::User) last_user = static_cast<int>(i);
  Prompt p;
  std::string& out = p.text;
  out = kBos;
  bool closed = false;  // the last tool result closed its block
  for (size_t i = 0; i < l.msgs.size(); ++i) {
    const Message& m = *l.msgs[i];
    const bool after_user = static_cast<int>(i) > last_user;
    if (m.role == Role::System) {
      out += m.content;
      if (static_cast<int>(i) == l.tools_at) out += "\n\n" + tools_text(Format::V32, c);
    } else if (m.role == Role::User) {
      const bool think = c.thinking && static_cast<int>(i) == last_user;
      out += std::string(kUser) + m.content + std::string(kAssistant) + std::string(think ? kThinkBegin : kThinkEnd);
    } else if (m.role == Role::Tool) {
      closed = v32_result(l, i, c.thinking && static_cast<int>(i) >= last_user, out);
    } else {
      std::string think;
      if (c.thinking && after_user) {
        if (m.reasoning.empty() && m.tool_calls.empty())
          invalid(where_of(l, i), fmt::format("in thinking mode '{}', an assistant turn after the last user message, "
                                              "needs reasoning_content or tool_calls",
                                              where_of(l, i)));
        think = m.reasoning + std::string(kThinkEnd);
      }
      out += think + m.content + calls_text(Format::V32, m, where_of(l, i)) + std::string(kEos);
    }
  }
  const Role last = l.msgs.back()->role;
  if (c.for_answer && !(last == Role::User || (last == Role::Tool && closed)))
    invalid("messages",
            "the deepseek-v3.2 chat format answers a conversation that ends with a user message or with the results "
            "of every tool call of the last assistant turn");
  p.reasoning_first = c.thinking;
  p.parse_tools = tools_on(c);
  p.tool_markup = true;
  p.prefill = forced_prefill(Format::V32, c);
  out += p.prefill;
  return p;
}

namespace {

// A V4 user turn: text parts and tool results, in order, joined by a blank
// line; tool messages and user messages next to each other make one turn.
struct Block {
  bool result = false;
  std::string text, id;
};
struct Turn {
  Role role;
  const Message* m;
  std::vector<Block> blocks;
  bool tools = false;
  std::string where;  // the request's message, for errors
  std::string text;   // V4.1: a system, developer or assistant turn's text
};

// Results in the order of the calls of the last assistant turn with calls
// (by id; unknown ids count as the first call), the sort stable.
void sort_results(std::vector<Turn>& turns) {
  std::map<std::string, size_t> order;
  for (auto& t : turns) {
    if (t.role == Role::Assistant && !t.m->tool_calls.empty()) {
      order.clear();
      for (size_t k = 0; k < t.m->tool_calls.size(); ++k)
        if (!t.m->tool_calls[k].id.empty()) order.emplace(t.m->tool_calls[k].id, k);
    }
    if (t.role != Role::User || order.empty()) continue;
    std::vector<Block> results;
    for (const auto& b : t.blocks)
      if (b.result) results.push_back(b);
    auto rank = [&](const Block& b) {
      auto it = order.find(b.id);
      return it == order.end() ? size_t{0} : it->second;
    };
    std::stable_sort(results.begin(), results.end(), [&](const Block& a, const Block& b) { return rank(a) < rank(b); });
    size_t r = 0;
    for (auto& b : t.blocks)
      if (b.result) b = results[r++];
  }
}

// A user turn: "<｜User｜>" + its blocks (results as <tool_result>text
// </tool_result>) joined by a blank line.
std::string user_turn(const Turn& t) {
  std::string out(kUser);
  for (size_t b = 0; b < t.blocks.size(); ++b)
    out += (b ? "\n\n" : "") +
           (t.blocks[b].result ? "<tool_result>" + t.blocks[b].text + "</tool_result>" : t.blocks[b].text);
  return out;
}

// An assistant turn: its reasoning + "</think>" (think), text, calls, EOS.
std::string assistant_turn(Format f, const Turn& t, bool think, const std::string& text) {
  return (think ? t.m->reasoning + std::string(kThinkEnd) : std::string()) + text + calls_text(f, *t.m, t.where) +
         std::string(kEos);
}

std::vector<Turn> v4_turns(const Listed& l) {
  std::vector<Turn> turns;
  for (size_t i = 0; i < l.msgs.size(); ++i) {
    const Message& m = *l.msgs[i];
    if (m.role == Role::User || m.role == Role::Tool) {
      Block b;
      b.result = m.role == Role::Tool;
      b.id = m.tool_call_id;
      for (const auto& part : m.parts) b.text += (b.result && !b.text.empty() ? "\n\n" : "") + part;
      if (turns.empty() || turns.back().role != Role::User)
        turns.push_back({Role::User, &m, {}, false, where_of(l, i), ""});
      turns.back().blocks.push_back(std::move(b));
    } else {
      turns.push_back({m.role, &m, {}, static_cast<int>(i) == l.tools_at, where_of(l, i), ""});
    }
  }
  sort_results(turns);
  return turns;
}

}  // namespace

// DeepSeek-V4: the BOS (and, thinking with reasoning_effort "max", its
// prefix); a system message's text (+ "\n\n" + the tools); a user turn
// "<｜User｜>" + its blocks (results as <tool_result>text</tool_result>);
// an assistant turn its reasoning + "</think>" (thinking: every turn when
// there are tools, else those after the last user turn), text, calls and
// EOS. A user turn followed by an assistant turn or last gets
// "<｜Assistant｜>" and <think> (thinking: every turn when there are tools,
// else the last user turn) or </think>.
Prompt render_v4(const Conversation& c) {
  Message empty_system;
  empty_system.role = Role::System;
  const Listed l = listed(c, empty_system);
  const std::vector<Turn> turns = v4_turns(l);
  int last_user = -1;
  for (size_t i = 0; i < turns.size(); ++i)
    if (turns[i].role == Role::User) last_user = static_cast<int>(i);
  // Reasoning of earlier turns is dropped unless tools are defined: a tool
  // conversation needs its reasoning to follow its steps.
  const bool drop = !tools_on(c);
  Prompt p;
  std::string& out = p.text;
  out = kBos;
  if (c.thinking && c.reasoning_effort == "max") out += kV4EffortMax;
  for (size_t i = 0; i < turns.size(); ++i) {
    const Turn& t = turns[i];
    const int at = static_cast<int>(i);
    if (t.role == Role::System) {
      out += t.m->content;
      if (t.tools) out += "\n\n" + tools_text(Format::V4, c);
    } else if (t.role == Role::User) {
      out += user_turn(t);
    } else {
      out += assistant_turn(Format::V4, t, c.thinking && (!drop || at > last_user), t.m->content);
    }
    // A user turn answered next (or last) opens the assistant's turn.
    const bool answered = i + 1 == turns.size() || turns[i + 1].role == Role::Assistant;
    if (answered && t.role == Role::User)
      out += std::string(kAssistant) + std::string(c.thinking && (!drop || at >= last_user) ? kThinkBegin : kThinkEnd);
  }
  if (c.for_answer && turns.back().role != Role::User)
    invalid("messages",
            "the deepseek-v4 chat format answers a conversation that ends with a user message or with tool results");
  p.reasoning_first = c.thinking;
  p.parse_tools = tools_on(c);
  p.tool_markup = true;
  p.prefill = forced_prefill(Format::V4, c);
  out += p.prefill;
  return p;
}

namespace {

std::string joined(const std::vector<std::string>& parts) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? "\n\n" : "") + parts[i];
  return s;
}

// DeepSeek-V4.1's turns: V4's (user and tool messages next to each other
// make one user turn, results sorted by call), with every text part a block
// of its own and a developer message a turn of its own kind; text parts of
// other messages joined by a blank line. The image placeholder is refused in
// any text, as the encoder refuses it.
std::vector<Turn> v41_turns(const Listed& l) {
  std::vector<Turn> turns;
  for (size_t i = 0; i < l.msgs.size(); ++i) {
    const Message& m = *l.msgs[i];
    const std::string where = where_of(l, i);
    for (const auto* text : {&m.content, &m.reasoning})
      if (text->find(kImage) != std::string::npos)
        invalid(where, fmt::format("'{}' holds the image placeholder {}: images are not supported", where, kImage));
    if (m.role == Role::User || m.role == Role::Tool) {
      if (turns.empty() || turns.back().role != Role::User) turns.push_back({Role::User, &m, {}, false, where, ""});
      if (m.role == Role::Tool || !m.parts.empty())
        turns.back().blocks.push_back({m.role == Role::Tool, joined(m.parts), m.tool_call_id});
    } else {
      if (m.developer && joined(m.parts).empty())
        invalid(where, fmt::format("'{}' is a developer message with no content", where));
      turns.push_back({m.role, &m, {}, static_cast<int>(i) == l.tools_at, where, joined(m.parts)});
    }
  }
  sort_results(turns);
  return turns;
}

// A turn that opens the assistant's answer when one follows it: a user or
// developer turn, or a system message after the first.
bool asks(const std::vector<Turn>& turns, size_t i) {
  return turns[i].role == Role::User || (turns[i].role == Role::System && (turns[i].m->developer || i > 0));
}

int last_asking(const std::vector<Turn>& turns) {
  for (size_t i = turns.size(); i-- > 0;)
    if (asks(turns, i)) return static_cast<int>(i);
  return -1;
}

// The effort of a thinking answer: 1-100, or low 25, high 50 (the default),
// xhigh 75, max 100.
int v41_effort(const Conversation& c) {
  const std::string& e = c.reasoning_effort;
  if (e.empty() || e == "high") return 50;
  if (c.effort_number) {
    const long v = std::strtol(e.c_str(), nullptr, 10);
    if (e.size() <= 3 && v >= 1 && v <= 100) return static_cast<int>(v);
  } else if (e == "low" || e == "xhigh" || e == "max") {
    return e == "low" ? 25 : e == "xhigh" ? 75 : 100;
  }
  invalid("reasoning_effort",
          "'reasoning_effort' must be an integer from 1 to 100 or \"low\", \"high\", \"xhigh\" or \"max\" in the "
          "deepseek-v4.1 chat format");
}

}  // namespace

// DeepSeek-V4.1: the BOS; in thinking mode "<｜System｜>" and the effort line
// first; a system message "<｜System｜>" + its text (+ "\n\n" + the tools); a
// developer message "<｜User｜>" + its text; a user turn "<｜User｜>" + its
// blocks joined by a blank line; an assistant turn as V4's. A user or
// developer turn, or a system message after the first, followed by an
// assistant turn (or last) gets "<｜Assistant｜>" and <think> or </think> as
// V4's. Thinking without tools drops developer messages before the last
// turn that asks.
Prompt render_v41(const Conversation& c) {
  Message empty_system;
  empty_system.role = Role::System;
  const Listed l = listed(c, empty_system);
  std::vector<Turn> turns = v41_turns(l);
  const bool drop = !tools_on(c);
  const int effort = v41_effort(c);
  if (c.thinking && drop) {
    const int last = last_asking(turns);
    std::vector<Turn> kept;
    for (size_t i = 0; i < turns.size(); ++i)
      if (!turns[i].m->developer || static_cast<int>(i) >= last) kept.push_back(std::move(turns[i]));
    turns = std::move(kept);
  }
  const int last_user = last_asking(turns);
  Prompt p;
  std::string& out = p.text;
  out = kBos;
  for (size_t i = 0; i < turns.size(); ++i) {
    const Turn& t = turns[i];
    const int at = static_cast<int>(i);
    const bool system = t.role == Role::System && !t.m->developer;
    if (i == 0 && (c.thinking || system)) out += kSystem;
    if (i == 0 && c.thinking)
      out += fmt::format(
          "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n", effort);
    if (t.role == Role::System) {
      out += system ? (i > 0 ? std::string(kSystem) : std::string()) : std::string(kUser);
      out += t.text;
      if (t.tools) out += "\n\n" + tools_text(Format::V41, c);
    } else if (t.role == Role::User) {
      out += user_turn(t);
    } else {
      out += assistant_turn(Format::V41, t, c.thinking && (!drop || at > last_user), t.text);
    }
    const bool answered = i + 1 == turns.size() || turns[i + 1].role == Role::Assistant;
    if (answered && asks(turns, i))
      out += std::string(kAssistant) + std::string(c.thinking && (!drop || at >= last_user) ? kThinkBegin : kThinkEnd);
  }
  if (c.for_answer && (turns.empty() || !asks(turns, turns.size() - 1)))
    invalid("messages",
            "the deepseek-v4.1 chat format answers a conversation that ends with a user, developer or later system "
            "message or with tool results");
  p.reasoning_first = c.thinking;
  p.parse_tools = tools_on(c);
  p.tool_markup = true;
  p.prefill = forced_prefill(Format::V41, c);
  out += p.prefill;
  return p;
}

}  // namespace ds::infer::chat
