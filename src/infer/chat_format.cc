// Chat formats: names, the choice for a model folder, and the request's
// conversation read from OpenAI's fields. The renderers are in
// chat_render.cc (deepseek-v3, deepseek-v3.1) and chat_dsml.cc
// (deepseek-v3.2, deepseek-v4, deepseek-v4.1).
#include "infer/chat_format.h"

#include <fmt/format.h>

#include <array>
#include <filesystem>
#include <set>

#include "infer/chat_internal.h"
#include "io/text_input.h"

namespace ds::infer::chat {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr std::array<std::pair<Format, std::string_view>, 5> kNames = {{{Format::V3, "deepseek-v3"},
                                                                        {Format::V31, "deepseek-v3.1"},
                                                                        {Format::V32, "deepseek-v3.2"},
                                                                        {Format::V4, "deepseek-v4"},
                                                                        {Format::V41, "deepseek-v4.1"}}};

}  // namespace

std::string_view format_name(Format f) {
  for (const auto& [k, n] : kNames)
    if (k == f) return n;
  return "?";
}

std::optional<Format> format_named(std::string_view name) {
  for (const auto& [k, n] : kNames)
    if (n == name) return k;
  return std::nullopt;
}

std::string format_names() {
  std::string s;
  for (const auto& [k, n] : kNames) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

// ---- the format of a model folder --------------------------------------------

namespace {

// A JSON file's object, or null when it is missing or not a JSON object.
json read_object(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return nullptr;
  try {
    json j = json::parse(io::read_file(p.string(), "json"));
    return j.is_object() ? j : json(nullptr);
  } catch (const std::exception&) {
    return nullptr;
  }
}

// The format a Jinja chat template renders, told by the strings each of
// DeepSeek's templates alone contains.
std::optional<Format> format_of_template(const std::string& t) {
  if (t.find("｜DSML｜ calls") != std::string::npos) return Format::V41;
  if (t.find("｜DSML｜tool_calls") != std::string::npos) return Format::V4;
  if (t.find("｜DSML｜function_calls") != std::string::npos) return Format::V32;
  // V3.1's template prints a call as name<｜tool▁sep｜>arguments and opens
  // the answer with <think> or </think>; V3's prints "function" and a fence.
  if (t.find("</think>") != std::string::npos && t.find("<｜tool▁sep｜>") != std::string::npos &&
      t.find("thinking") != std::string::npos)
    return Format::V31;
  if (t.find("<｜User｜>") != std::string::npos && t.find("<｜Assistant｜>") != std::string::npos) return Format::V3;
  return std::nullopt;
}

}  // namespace

Detection detect_format(const std::string& model_dir) {
  const fs::path dir(model_dir);
  std::error_code ec;
  // V3.2 and later ship no template: their folders hold a reference encoder.
  if (fs::is_regular_file(dir / "encoding" / "encoding_dsv41.py", ec))
    return {Format::V41, "the folder's encoding/encoding_dsv41.py"};
  if (fs::is_regular_file(dir / "encoding" / "encoding_dsv4.py", ec))
    return {Format::V4, "the folder's encoding/encoding_dsv4.py"};
  if (fs::is_regular_file(dir / "encoding" / "encoding_dsv32.py", ec))
    return {Format::V32, "the folder's encoding/encoding_dsv32.py"};
  const json tc = read_object(dir / "tokenizer_config.json");
  if (tc.is_object() && tc.contains("chat_template") && tc["chat_template"].is_string())
    if (auto f = format_of_template(tc["chat_template"].get<std::string>()))
      return {*f, "tokenizer_config.json's chat_template"};
  const json cfg = read_object(dir / "config.json");
  const std::string type = cfg.is_object() && cfg.contains("model_type") && cfg["model_type"].is_string()
                               ? cfg["model_type"].get<std::string>()
                               : "";
  if (type == "deepseek_v41") return {Format::V41, "config.json's model_type deepseek_v41"};
  if (type == "deepseek_v4") return {Format::V4, "config.json's model_type deepseek_v4"};
  if (type == "deepseek_v32") return {Format::V32, "config.json's model_type deepseek_v32"};
  return {Format::V3, type.empty() ? "the default" : fmt::format("config.json's model_type {}", type)};
}

// ---- the conversation of a request -------------------------------------------

namespace {

const json* field(const json& o, const char* key) {
  auto it = o.find(key);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

// Whether object o has key with the string value `want` (false for any other
// type: nlohmann's value() would throw for one).
template <class J>
bool has_string(const J& o, const char* key, std::string_view want) {
  if (!o.is_object()) return false;
  auto it = o.find(key);
  return it != o.end() && it->is_string() && it->template get_ref<const std::string&>() == want;
}

// content: a string, or an array of {"type": "text", "text": ...} parts.
void read_content(const json& m, const std::string& where, Message& out, bool may_be_null) {
  const json* c = field(m, "content");
  if (c && c->is_string()) {
    out.content = c->get<std::string>();
    out.parts = {out.content};
  } else if (c && c->is_array()) {
    for (const auto& part : *c) {
      if (!has_string(part, "type", "text") || !part.contains("text") || !part["text"].is_string())
        invalid(where, fmt::format("'{}.content' parts must be {{\"type\": \"text\", \"text\": ...}}", where));
      out.parts.push_back(part["text"].get<std::string>());
      out.content += out.parts.back();
    }
  } else if (c || !may_be_null) {
    invalid(where, fmt::format("'{}.content' must be a string or an array of text parts", where));
  } else {
    out.has_content = false;
  }
}

// o[key] as a string ("" when absent and not required); errors name the
// body field `param` and the path `where` of o.
std::string string_in(const json& o, const char* key, const std::string& param, const std::string& where,
                      bool required) {
  const json* v = field(o, key);
  if (!v) {
    if (required) invalid(param, fmt::format("'{}.{}' is missing", where, key));
    return "";
  }
  if (!v->is_string()) invalid(param, fmt::format("'{}.{}' must be a string", where, key));
  return v->get<std::string>();
}

// Function names go between quotes and markers of every format: letters,
// digits and _ . : - (OpenAI's set, with the dots and colons of namespaced
// tools), 1 to 64 of them.
bool good_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (const char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ':' || c == '-')) return false;
  return true;
}

std::vector<ToolCall> read_tool_calls(const json& m, const std::string& where) {
  const json* tc = field(m, "tool_calls");
  if (!tc) return {};
  if (!tc->is_array()) invalid(where, fmt::format("'{}.tool_calls' must be an array", where));
  std::vector<ToolCall> calls;
  for (size_t k = 0; k < tc->size(); ++k) {
    const json& c = (*tc)[k];
    const std::string at = fmt::format("{}.tool_calls[{}]", where, k);
    if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
      invalid(where, fmt::format("'{}' must be an object with a 'function' object", at));
    if (const json* type = field(c, "type"); type && *type != "function")
      invalid(where, fmt::format("'{}.type' must be \"function\"", at));
    ToolCall call;
    call.id = string_in(c, "id", where, at, false);
    call.name = string_in(c["function"], "name", where, at + ".function", true);
    if (!good_name(call.name))
      invalid(where, fmt::format("'{}.function.name' must be 1-64 letters, digits, '_', '.', ':' or '-'", at));
    call.arguments = string_in(c["function"], "arguments", where, at + ".function", true);
    calls.push_back(std::move(call));
  }
  return calls;
}

Message read_message(const json& m, size_t i) {
  const std::string where = fmt::format("messages[{}]", i);
  if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
    invalid(where, fmt::format("'{}' must be an object with a string 'role'", where));
  const std::string role = m["role"].get<std::string>();
  Message out;
  if (role == "system" || role == "developer") {
    out.role = Role::System;
    out.developer = role == "developer";
  } else if (role == "user") {
    out.role = Role::User;
  } else if (role == "assistant") {
    out.role = Role::Assistant;
    out.tool_calls = read_tool_calls(m, where);
    out.reasoning = string_in(m, "reasoning_content", where, where, false);
    if (out.reasoning.empty()) out.reasoning = string_in(m, "reasoning", where, where, false);
  } else if (role == "tool") {
    out.role = Role::Tool;
    out.tool_call_id = string_in(m, "tool_call_id", where, where, false);
  } else {
    invalid(where,
            fmt::format("'{}.role' must be system, developer, user, assistant or tool, got {}", where, quote(role)));
  }
  read_content(m, where, out, out.role == Role::Assistant);
  return out;
}

std::vector<Tool> read_tools(const ojson& tools) {
  if (tools.is_null()) return {};
  if (!tools.is_array()) invalid("tools", "'tools' must be an array of {\"type\": \"function\", \"function\": ...}");
  std::vector<Tool> out;
  std::set<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string where = fmt::format("tools[{}]", i);
    if (!has_string(t, "type", "function") || !t.contains("function") || !t["function"].is_object())
      invalid(where, fmt::format("'{}' must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where));
    const ojson& f = t["function"];
    if (!f.contains("name") || !f["name"].is_string() || !good_name(f["name"].get<std::string>()))
      invalid(where, fmt::format("'{}.function.name' must be 1-64 letters, digits, '_', '.', ':' or '-'", where));
    if (f.contains("description") && !f["description"].is_string() && !f["description"].is_null())
      invalid(where, fmt::format("'{}.function.description' must be a string", where));
    if (f.contains("parameters") && !f["parameters"].is_object() && !f["parameters"].is_null())
      invalid(where, fmt::format("'{}.function.parameters' must be a JSON Schema object", where));
    const std::string name = f["name"].get<std::string>();
    if (!names.insert(name).second) invalid(where, fmt::format("'{}': a second function named '{}'", where, name));
    out.push_back({name, f});
  }
  return out;
}

void read_tool_choice(const json& body, Conversation& c) {
  const json* v = field(body, "tool_choice");
  c.tool_choice = c.tools.empty() ? ToolChoice::None : ToolChoice::Auto;
  if (!v) return;
  if (*v == "none") {
    c.tool_choice = ToolChoice::None;
  } else if (*v == "auto") {
  } else if (*v == "required") {
    c.tool_choice = ToolChoice::Required;
  } else if (has_string(*v, "type", "function") && v->contains("function") && (*v)["function"].is_object() &&
             (*v)["function"].contains("name") && (*v)["function"]["name"].is_string()) {
    c.tool_choice = ToolChoice::Named;
    c.forced = (*v)["function"]["name"].get<std::string>();
    bool known = false;
    for (const auto& t : c.tools) known = known || t.name == c.forced;
    if (!known) invalid("tool_choice", fmt::format("'tool_choice' names {}, which is not in 'tools'", quote(c.forced)));
  } else {
    invalid("tool_choice",
            "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
            "{\"name\": ...}}");
  }
  if (c.tools.empty() && (c.tool_choice == ToolChoice::Required || c.tool_choice == ToolChoice::Named))
    invalid("tool_choice", "'tool_choice' asks for a call, but the request has no 'tools'");
}

// thinking: true or false, or DeepSeek's API shape {"type": "enabled" |
// "disabled"}; chat_template_kwargs: vLLM's and SGLang's {"thinking": bool}
// (or "enable_thinking").
void read_thinking(const json& body, Conversation& c) {
  std::optional<bool> top, kw;
  if (const json* t = field(body, "thinking")) {
    if (t->is_boolean()) {
      top = t->get<bool>();
    } else if (t->is_object() && t->size() == 1 && t->contains("type") &&
               ((*t)["type"] == "enabled" || (*t)["type"] == "disabled")) {
      top = (*t)["type"] == "enabled";
    } else {
      invalid("thinking", "'thinking' must be true, false or {\"type\": \"enabled\" | \"disabled\"}");
    }
  }
  if (const json* k = field(body, "chat_template_kwargs")) {
    if (!k->is_object()) invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    for (const auto& [key, v] : k->items()) {
      if (key != "thinking" && key != "enable_thinking")
        invalid(
            "chat_template_kwargs",
            fmt::format("'chat_template_kwargs' key {} is not supported (only thinking, enable_thinking)", quote(key)));
      if (!v.is_boolean())
        invalid("chat_template_kwargs", fmt::format("'chat_template_kwargs.{}' must be true or false", key));
      if (kw && *kw != v.get<bool>())
        invalid("chat_template_kwargs", "'chat_template_kwargs' thinking and enable_thinking disagree");
      kw = v.get<bool>();
    }
  }
  if (top && kw && *top != *kw) invalid("thinking", "'thinking' and 'chat_template_kwargs' disagree");
  c.thinking = top.value_or(kw.value_or(false));
}

}  // namespace

Conversation read_conversation(const json& body, const ojson& tools, Format f) {
  const bool none = body.contains("tool_choice") && body["tool_choice"] == "none";
  if (f == Format::V3 && !tools.is_null() && !tools.empty() && !none) render_v3_tools_refusal();
  const json* msgs = field(body, "messages");
  if (!msgs || !msgs->is_array() || msgs->empty())
    invalid("messages", "'messages' must be a non-empty array of {\"role\", \"content\"} objects");
  Conversation c;
  for (size_t i = 0; i < msgs->size(); ++i) c.messages.push_back(read_message((*msgs)[i], i));
  c.tools = read_tools(tools);
  read_tool_choice(body, c);
  if (const json* p = field(body, "parallel_tool_calls")) {
    if (!p->is_boolean()) invalid("parallel_tool_calls", "'parallel_tool_calls' must be true or false");
    c.parallel_calls = p->get<bool>();
  }
  read_thinking(body, c);
  // Each format says which values it takes (render).
  if (const json* e = field(body, "reasoning_effort")) {
    if (e->is_number_integer()) {
      c.reasoning_effort = e->dump();
      c.effort_number = true;
    } else if (e->is_string()) {
      c.reasoning_effort = e->get<std::string>();
    } else {
      invalid("reasoning_effort", "'reasoning_effort' must be a string or an integer");
    }
  }
  return c;
}

// ---- rendering -----------------------------------------------------------------

Prompt render(Format f, const Conversation& c) {
  if (!c.reasoning_effort.empty() && f != Format::V4 && f != Format::V41)
    invalid(
        "reasoning_effort",
        fmt::format("'reasoning_effort' is not supported by the {} chat format (only deepseek-v4 and deepseek-v4.1)",
                    format_name(f)));
  const std::string& e = c.reasoning_effort;
  if (f == Format::V4 && !e.empty() && (c.effort_number || !(e == "low" || e == "medium" || e == "high" || e == "max")))
    invalid("reasoning_effort",
            "'reasoning_effort' must be \"low\", \"medium\", \"high\" or \"max\" in the deepseek-v4 chat format");
  if (c.thinking && (c.tool_choice == ToolChoice::Required || c.tool_choice == ToolChoice::Named))
    invalid("tool_choice",
            "'tool_choice' \"required\" or a named function needs thinking off: the server forces the call by "
            "starting the answer with it, and a thinking answer starts with its reasoning");
  Prompt p;
  switch (f) {
    case Format::V3:
      p = render_v3(c);
      break;
    case Format::V31:
      p = render_v31(c);
      break;
    case Format::V32:
      p = render_v32(c);
      break;
    case Format::V4:
      p = render_v4(c);
      break;
    case Format::V41:
      p = render_v41(c);
      break;
  }
  if (p.parse_tools)
    for (const auto& t : c.tools) p.tool_names.push_back(t.name);
  p.parallel_calls = c.parallel_calls;
  return p;
}

std::vector<std::string> required_tokens(Format f, bool tools) {
  std::vector<std::string> t = {std::string(kUser), std::string(kAssistant), std::string(kEos)};
  if (f == Format::V41) t.emplace_back(kSystem);
  if (!tools || (f != Format::V3 && f != Format::V31)) return t;
  for (const auto* m : {kCallsBegin, kCallsEnd, kCallBegin, kCallEnd, kCallSep}) t.emplace_back(m);
  for (const auto m : {kOutputBegin, kOutputEnd}) t.emplace_back(m);
  if (f == Format::V3)
    for (const auto m : {kOutputsBegin, kOutputsEnd}) t.emplace_back(m);
  return t;
}

std::string quote(std::string_view s) {
  const bool cut = s.size() > 80;
  return ojson(std::string(s.substr(0, 80)) + (cut ? "..." : "")).dump(-1, ' ', false, ojson::error_handler_t::replace);
}

// ---- Python's json.dumps -------------------------------------------------------

namespace {

void append_escaped(std::string& out, const std::string& s, bool ensure_ascii) {
  // nlohmann escapes what json.dumps escapes (", \, control characters as
  // \b \f \n \r \t or \u00xx) and, with ensure_ascii, writes \uxxxx in
  // lower case with surrogate pairs, as Python does.
  out += ojson(s).dump(-1, ' ', ensure_ascii, ojson::error_handler_t::replace);
}

void dump(std::string& out, const ojson& v, bool ensure_ascii) {
  switch (v.type()) {
    case ojson::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.items()) {
        if (!first) out += ", ";
        first = false;
        append_escaped(out, k, ensure_ascii);
        out += ": ";
        dump(out, x, ensure_ascii);
      }
      out += '}';
      break;
    }
    case ojson::value_t::array: {
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ", ";
        dump(out, v[i], ensure_ascii);
      }
      out += ']';
      break;
    }
    case ojson::value_t::string:
      append_escaped(out, v.get_ref<const std::string&>(), ensure_ascii);
      break;
    default:
      out += v.dump();
  }
}

}  // namespace

std::string python_json(const ojson& v, bool ensure_ascii) {
  std::string out;
  dump(out, v, ensure_ascii);
  return out;
}

}  // namespace ds::infer::chat
