// What the chat format files share: DeepSeek's marker strings and the
// renderer of each format (infer/chat_format.h is the public face).
#pragma once

#include <string_view>

#include "infer/chat_format.h"

namespace ds::infer::chat {

// U+FF5C (full-width bar) and U+2581 (lower one-eighth block) inside the
// markers are DeepSeek's own: the ASCII look-alikes are other tokens.
inline constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUser = "<｜User｜>";
inline constexpr std::string_view kAssistant = "<｜Assistant｜>";
// DeepSeek-V4.1's system turn and its image placeholder.
inline constexpr std::string_view kSystem = "<｜System｜>";
inline constexpr std::string_view kImage = "<｜deepseek_image｜>";
inline constexpr std::string_view kThinkBegin = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";
// DeepSeek-V3's and V3.1's tool-call tokens.
inline constexpr const char* kCallsBegin = "<｜tool▁calls▁begin｜>";
inline constexpr const char* kCallsEnd = "<｜tool▁calls▁end｜>";
inline constexpr const char* kCallBegin = "<｜tool▁call▁begin｜>";
inline constexpr const char* kCallEnd = "<｜tool▁call▁end｜>";
inline constexpr const char* kCallSep = "<｜tool▁sep｜>";
inline constexpr std::string_view kOutputsBegin = "<｜tool▁outputs▁begin｜>";
inline constexpr std::string_view kOutputsEnd = "<｜tool▁outputs▁end｜>";
inline constexpr std::string_view kOutputBegin = "<｜tool▁output▁begin｜>";
inline constexpr std::string_view kOutputEnd = "<｜tool▁output▁end｜>";
// DeepSeek Markup Language (V3.2 and V4): XML-like tags around "｜DSML｜".
inline constexpr std::string_view kDsml = "｜DSML｜";

Prompt render_v3(const Conversation& c);
[[noreturn]] void render_v3_tools_refusal();
Prompt render_v31(const Conversation& c);
Prompt render_v32(const Conversation& c);
Prompt render_v4(const Conversation& c);
Prompt render_v41(const Conversation& c);

// Whether f writes its calls in DSML (V3.2, V4, V4.1).
inline bool dsml_format(Format f) { return f == Format::V32 || f == Format::V4 || f == Format::V41; }

// The tag names of a DSML format: "function_calls" / "invoke" / "parameter"
// (V3.2), "tool_calls" / ... (V4), " calls" / " invoke" / " parameter"
// (V4.1, each after a space).
struct DsmlTags {
  std::string_view block, invoke, parameter;
};
DsmlTags dsml_tags(Format f);

// Whether the conversation's tools are printed into the prompt (and calls
// read back from the answer): there are tools and tool_choice is not "none".
inline bool tools_on(const Conversation& c) { return !c.tools.empty() && c.tool_choice != ToolChoice::None; }

// Client text inside a refusal, which is one line: as a JSON string (a
// newline in it escaped), cut after 80 bytes.
std::string quote(std::string_view s);

[[noreturn]] inline void invalid(std::string param, std::string message) {
  throw Invalid{std::move(param), std::move(message)};
}

}  // namespace ds::infer::chat
