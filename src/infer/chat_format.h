// DeepSeek's chat formats, one per generation of its models: a conversation
// in OpenAI's shape (messages, tools, tool_choice, thinking) becomes the
// prompt text that generation was trained on, and the model's answer is
// split back into reasoning, content and tool calls (infer/chat_parse.h).
//
//   deepseek-v3    DeepSeek-V3's template: no thinking, no tool definitions
//   deepseek-v3.1  DeepSeek-V3.1's template (also V3.1-Terminus' and
//                  V3.2-Exp's): thinking on or off, tools in the system text,
//                  calls as <｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}
//   deepseek-v3.2  DeepSeek-V3.2's reference encoder: DSML calls in a
//                  <｜DSML｜function_calls> block, <function_results>
//   deepseek-v4    DeepSeek-V4's reference encoder: DSML calls in a
//                  <｜DSML｜tool_calls> block, results as <tool_result> in a
//                  user turn
//   deepseek-v4.1  DeepSeek-V4.1's reference encoder: V4's turns with a
//                  <｜System｜> token, DSML tags with a leading space
//                  (<｜DSML｜ calls>) and a numeric reasoning effort
//
// Every rule, and where it comes from, is written down in
// docs/chat_formats.md; the tests render DeepSeek's published examples to
// their exact text. Nothing here touches a tokenizer: the server encodes
// the text (special tokens included) and checks the tokens it needs.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ds::infer::chat {

using ojson = nlohmann::ordered_json;

enum class Format { V3, V31, V32, V4, V41 };
inline constexpr Format kFormats[] = {Format::V3, Format::V31, Format::V32, Format::V4, Format::V41};

// The BOS every format's prompt text begins with.
inline constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";

// "deepseek-v3", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4", "deepseek-v4.1".
std::string_view format_name(Format f);
std::optional<Format> format_named(std::string_view name);
// Every name, comma-separated, for help texts and errors.
std::string format_names();

// The format of a model folder and why it was chosen: DeepSeek's
// encoding/ reference encoder when the folder ships one, else the
// tokenizer_config.json chat template, else config.json's model_type, else
// deepseek-v3 (the format of every earlier DeepSeek chat model).
struct Detection {
  Format format;
  std::string why;
};
Detection detect_format(const std::string& model_dir);

// A request a format cannot render: the body field at fault and one line.
struct Invalid {
  std::string param, message;
};

enum class Role { System, User, Assistant, Tool };

struct ToolCall {
  std::string id, name;
  std::string arguments;  // JSON text, as OpenAI's messages carry it
};

// One message, checked: text parts joined, "developer" read as "system"
// (deepseek-v4.1 alone renders it as its own kind of turn).
struct Message {
  Role role = Role::User;
  bool developer = false;
  std::string content;
  std::vector<std::string> parts;  // content's text parts (one for a string)
  bool has_content = true;         // an assistant's content may be null
  std::string reasoning;           // an assistant's reasoning_content
  std::vector<ToolCall> tool_calls;
  std::string tool_call_id;
};

// A function the model may call: its name and OpenAI's "function" object as
// the client wrote it (key order kept: the DSML formats print it as JSON).
struct Tool {
  std::string name;
  ojson function;
};

enum class ToolChoice { None, Auto, Required, Named };

struct Conversation {
  std::vector<Message> messages;
  std::vector<Tool> tools;
  ToolChoice tool_choice = ToolChoice::Auto;
  std::string forced;          // ToolChoice::Named: the function's name
  bool parallel_calls = true;  // false: the answer keeps its first call only
  bool thinking = false;
  // deepseek-v4: "max" asks for the most; deepseek-v4.1: 1-100 (an integer
  // in the request, kept as its digits) or "low", "high", "xhigh", "max".
  std::string reasoning_effort;
  bool effort_number = false;  // the request gave reasoning_effort as a number
  // false: render the messages as a transcript, with no turn opened for an
  // answer (a template's add_generation_prompt false), whatever ends them.
  bool for_answer = true;
};

// Reads "messages", "tools", "tool_choice", "parallel_tool_calls",
// "thinking", "chat_template_kwargs" and "reasoning_effort" from a chat
// body; `tools` is the body's "tools" parsed with its key order (null: the
// body has none). Throws Invalid naming the field; tools for a format that
// has none are refused before they are read.
Conversation read_conversation(const nlohmann::json& body, const ojson& tools, Format f);

// A rendered prompt and what the answer after it begins with.
struct Prompt {
  std::string text;              // BOS included
  bool reasoning_first = false;  // the prompt ends in <think>
  bool parse_tools = false;      // tool calls in the answer become tool_calls
  bool tool_markup = false;      // the prompt or the answer may hold call markers
  // The start of a tool call the prompt already holds (tool_choice
  // "required" or a named function): the answer continues it.
  std::string prefill;
  std::vector<std::string> tool_names;  // the calls the answer may make
  bool parallel_calls = true;
};

// The prompt for a conversation; throws Invalid for what `f` cannot
// render or honour (thinking in deepseek-v3, a forced call while thinking,
// a conversation that does not end in a turn for the model to answer).
Prompt render(Format f, const Conversation& c);

// The tokens a tokenizer must have for `f`: the chat tokens every DeepSeek
// chat tokenizer has, and with tool markup V3's and V3.1's call and result
// tokens (DSML is text). <think> and </think> are not required: a
// tokenizer without them encodes them as text, as Hugging Face's does, and
// DeepSeek-V3's has none.
std::vector<std::string> required_tokens(Format f, bool tools);

// Python's json.dumps with its default separators (", " and ": "), keys in
// their order; ensure_ascii writes every character above U+007F as \uXXXX
// (surrogate pairs above U+FFFF), as json.dumps does by default. DeepSeek's
// templates and encoders print JSON this way.
std::string python_json(const ojson& v, bool ensure_ascii);

}  // namespace ds::infer::chat
