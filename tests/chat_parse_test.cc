// Answers in DeepSeek's chat formats split back into reasoning, content and
// tool calls (infer/chat_parse.h): well-formed and malformed call blocks of
// each format, thinking splits, and every way to cut an answer into two
// streamed pieces (and byte by byte), each giving what the whole answer
// gives, with no marker cut in half handed on as text.
#include "infer/chat_parse.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace {
namespace chat_parse_test {

namespace chat = ds::infer::chat;
using chat::Format;
using json = nlohmann::json;

chat::Prompt asked(bool reasoning, bool tools, std::vector<std::string> names = {"get_weather", "search"}) {
  chat::Prompt p;
  p.reasoning_first = reasoning;
  p.parse_tools = tools;
  if (tools) p.tool_names = std::move(names);
  return p;
}

// The answer in two pieces cut at every byte, then one byte at a time:
// each must give what the whole answer gives, and no piece of content or
// reasoning handed on may end inside a marker.
void expect_streams_alike(Format f, const chat::Prompt& p, const std::string& text) {
  const chat::Piece whole = chat::parse_answer(f, p, text);
  auto same = [&](const chat::Piece& got, const std::string& how) {
    EXPECT_EQ(got.reasoning, whole.reasoning) << how;
    EXPECT_EQ(got.content, whole.content) << how;
    ASSERT_EQ(got.calls.size(), whole.calls.size()) << how;
    for (size_t k = 0; k < got.calls.size(); ++k) {
      EXPECT_EQ(got.calls[k].name, whole.calls[k].name) << how;
      EXPECT_EQ(got.calls[k].arguments, whole.calls[k].arguments) << how;
    }
  };
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    chat::AnswerParser parser(f, p);
    chat::Piece got = parser.push(std::string_view(text).substr(0, cut));
    got.append(parser.push(std::string_view(text).substr(cut)));
    got.append(parser.finish());
    same(got, "cut at " + std::to_string(cut));
  }
  chat::AnswerParser parser(f, p);
  chat::Piece got;
  for (const char c : text) got.append(parser.push(std::string_view(&c, 1)));
  got.append(parser.finish());
  same(got, "byte by byte");
}

// What a piece hands on before the rest of a cut marker arrives.
chat::Piece first_piece(Format f, const chat::Prompt& p, const std::string& text) {
  chat::AnswerParser parser(f, p);
  return parser.push(text);
}

TEST(ChatParse, HalfMarkersAreHeldBack) {
  EXPECT_EQ(first_piece(Format::V31, asked(true, false), "abc</thi").reasoning, "abc");
  EXPECT_EQ(first_piece(Format::V31, asked(false, true), "abc<｜tool▁calls").content, "abc");
  // A marker's bytes can end inside a UTF-8 character: held back too.
  EXPECT_EQ(first_piece(Format::V31, asked(false, true), "abc<\xEF\xBD").content, "abc");
  EXPECT_EQ(first_piece(Format::V4, asked(false, true), "abc\n\n<｜DSML｜tool").content, "abc");
  EXPECT_EQ(first_piece(Format::V4, asked(false, true), "abc\n").content, "abc");
  // Not a marker after all: handed on with the next piece.
  chat::AnswerParser parser(Format::V31, asked(true, false));
  EXPECT_EQ(parser.push("a</thin").reasoning, "a");
  EXPECT_EQ(parser.push("g>").reasoning, "</thing>");
  // Without tools nothing is held back in the content.
  EXPECT_EQ(first_piece(Format::V4, asked(false, false), "abc\n\n<｜DSML｜tool").content, "abc\n\n<｜DSML｜tool");
}

TEST(ChatParse, ThinkingSplitsReasoningFromContent) {
  // DeepSeek-V4's encoding README: "Simple arithmetic.</think>2 + 2 = 4."
  // (the EOS is not text here: the server ends the answer at it).
  const std::string text = "Simple arithmetic.</think>2 + 2 = 4.";
  for (Format f : {Format::V31, Format::V32, Format::V4}) {
    const chat::Piece got = chat::parse_answer(f, asked(true, false), text);
    EXPECT_EQ(got.reasoning, "Simple arithmetic.");
    EXPECT_EQ(got.content, "2 + 2 = 4.");
    expect_streams_alike(f, asked(true, false), text);
  }
  // Without thinking the same text is content; cut off before </think>,
  // everything is reasoning.
  EXPECT_EQ(chat::parse_answer(Format::V31, asked(false, false), text).content, text);
  const chat::Piece cut = chat::parse_answer(Format::V31, asked(true, false), "Simple arith</thi");
  EXPECT_EQ(cut.reasoning, "Simple arith</thi");
  EXPECT_EQ(cut.content, "");
}

TEST(ChatParse, V31Calls) {
  const std::string text =
      "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Paris\"}"
      "<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": \"café\", \"n\": [1, 2]}"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  const chat::Piece got = chat::parse_answer(Format::V31, asked(false, true), text);
  EXPECT_EQ(got.content, "Let me check.");
  ASSERT_EQ(got.calls.size(), 2u);
  EXPECT_EQ(got.calls[0].name, "get_weather");
  EXPECT_EQ(got.calls[0].arguments, "{\"location\": \"Paris\"}");
  EXPECT_EQ(got.calls[1].name, "search");
  EXPECT_EQ(json::parse(got.calls[1].arguments)["n"], json::parse("[1, 2]"));
  expect_streams_alike(Format::V31, asked(false, true), text);
  // Without tools in the request the markers are content.
  EXPECT_EQ(chat::parse_answer(Format::V31, asked(false, false), text).content, text);
  // parallel_tool_calls false keeps the first call.
  chat::Prompt one = asked(false, true);
  one.parallel_calls = false;
  EXPECT_EQ(chat::parse_answer(Format::V31, one, text).calls.size(), 1u);
}

TEST(ChatParse, V31MalformedCallsAreContent) {
  const std::string head = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>";
  for (const std::string& bad : {
           head + "get_weather<｜tool▁sep｜>{\"location\": <｜tool▁call▁end｜><｜tool▁calls▁end｜>",   // not JSON
           head + "get_weather<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",            // not an object
           head + "delete_all<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",                 // undefined
           head + "get_weather{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",                              // no separator
           std::string("<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"),                                  // no call
           head + "get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>text<｜tool▁calls▁end｜>",            // stray text
           head + "get_weather<｜tool▁sep｜>```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",  // V3's fence
           head + "get_weather<｜tool▁sep｜>{\"location\": \"Par",                                     // cut off
       }) {
    const chat::Piece got = chat::parse_answer(Format::V31, asked(false, true), "ok " + bad + " after");
    EXPECT_TRUE(got.calls.empty()) << bad;
    EXPECT_EQ(got.content, "ok " + bad + " after") << bad;
    expect_streams_alike(Format::V31, asked(false, true), "ok " + bad + " after");
  }
  // A deep nest in the arguments is refused before it is parsed.
  const std::string deep = head + "get_weather<｜tool▁sep｜>{\"a\": " + std::string(100, '[') + std::string(100, ']') +
                           "}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  EXPECT_TRUE(chat::parse_answer(Format::V31, asked(false, true), deep).calls.empty());
}

// A call the prompt began (tool_choice "required" or a named function).
TEST(ChatParse, ForcedCallContinuesThePrefill) {
  chat::Prompt p = asked(false, true);
  p.prefill = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>";
  const chat::Piece got =
      chat::parse_answer(Format::V31, p, "{\"location\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
  ASSERT_EQ(got.calls.size(), 1u);
  EXPECT_EQ(got.calls[0].arguments, "{\"location\": \"Oslo\"}");
  chat::Prompt d = asked(false, true);
  d.prefill = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n";
  const std::string rest =
      "<｜DSML｜parameter name=\"location\" string=\"true\">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls>";
  EXPECT_EQ(chat::parse_answer(Format::V4, d, rest).calls.size(), 1u);
  expect_streams_alike(Format::V4, d, rest);
  // A forced call the model breaks: its text, prefill included, is content.
  EXPECT_EQ(chat::parse_answer(Format::V4, d, "oops").content,
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\noops");
}

const std::string kDsmlCalls =
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"location\" string=\"true\">Zürich \"old town\"</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"search\">\n"
    "<｜DSML｜parameter name=\"filters\" string=\"false\">{\"tags\": [\"a\"], \"max\": 3}</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

TEST(ChatParse, DsmlCalls) {
  const std::string text = "I should look.</think>Checking.\n\n" + kDsmlCalls;
  const chat::Piece got = chat::parse_answer(Format::V4, asked(true, true), text);
  EXPECT_EQ(got.reasoning, "I should look.");
  EXPECT_EQ(got.content, "Checking.");  // the blank line before the block is the block's
  ASSERT_EQ(got.calls.size(), 2u);
  EXPECT_EQ(got.calls[0].name, "get_weather");
  // Built as DeepSeek's decoder builds it: strings as JSON strings, the
  // other values as written.
  EXPECT_EQ(got.calls[0].arguments, "{\"location\": \"Zürich \\\"old town\\\"\", \"days\": 3}");
  EXPECT_EQ(got.calls[1].arguments, "{\"filters\": {\"tags\": [\"a\"], \"max\": 3}}");
  expect_streams_alike(Format::V4, asked(true, true), text);
  // V3.2's block is function_calls; V4's parser leaves it as content.
  std::string v32 = text;
  for (size_t at; (at = v32.find("tool_calls")) != std::string::npos;) v32.replace(at, 10, "function_calls");
  EXPECT_EQ(chat::parse_answer(Format::V32, asked(true, true), v32).calls.size(), 2u);
  expect_streams_alike(Format::V32, asked(true, true), v32);
  const chat::Piece other = chat::parse_answer(Format::V4, asked(true, true), v32);
  EXPECT_TRUE(other.calls.empty());
  EXPECT_EQ(other.content, v32.substr(v32.find("Checking.")));
}

TEST(ChatParse, DsmlMalformedCallsAreContent) {
  const std::string open = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n";
  const std::string close = "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  for (const std::string& bad : {
           open +
               "<｜DSML｜parameter name=\"a\" string=\"true\">1</｜DSML｜parameter>\n"
               "<｜DSML｜parameter name=\"a\" string=\"true\">2</｜DSML｜parameter>\n" +
               close,                                                                                // twice
           open + "<｜DSML｜parameter name=\"a\" string=\"maybe\">1</｜DSML｜parameter>\n" + close,  // flag
           open + "<｜DSML｜parameter name=\"a\" string=\"true\">1\n" + close,                       // unclosed
           open + "stray\n" + close,                                                                 // text
           "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"rm\">\n" + close,                           // undefined
           std::string("<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>"),                               // no call
           open + "<｜DSML｜parameter name=\"a\" string=\"true\">1</｜DSML｜parameter>\n",           // cut off
       }) {
    const chat::Piece got = chat::parse_answer(Format::V4, asked(false, true), "ok\n\n" + bad);
    EXPECT_TRUE(got.calls.empty()) << bad;
    EXPECT_EQ(got.content, "ok\n\n" + bad) << bad;
    expect_streams_alike(Format::V4, asked(false, true), "ok\n\n" + bad);
  }
  // A value marked as JSON that is not JSON is kept as a string.
  const chat::Piece loose = chat::parse_answer(
      Format::V4, asked(false, true),
      open + "<｜DSML｜parameter name=\"a\" string=\"false\">not json</｜DSML｜parameter>\n" + close);
  ASSERT_EQ(loose.calls.size(), 1u);
  EXPECT_EQ(loose.calls[0].arguments, "{\"a\": \"not json\"}");
  // No parameters at all: an empty object.
  EXPECT_EQ(chat::parse_answer(Format::V4, asked(false, true), open + close).calls.at(0).arguments, "{}");
}

TEST(ChatParse, TextAroundCallsStaysInOrder) {
  // Newlines that turn out not to precede a block are content after all;
  // text after a block is content too.
  const std::string text = "a\n\nb\n" + kDsmlCalls + "\nafter";
  const chat::Piece got = chat::parse_answer(Format::V4, asked(false, true), text);
  EXPECT_EQ(got.content, "a\n\nb\nafter");
  EXPECT_EQ(got.calls.size(), 2u);
  expect_streams_alike(Format::V4, asked(false, true), text);
  const std::string newlines = "x\n\n\n";
  EXPECT_EQ(chat::parse_answer(Format::V4, asked(false, true), newlines).content, newlines);
  expect_streams_alike(Format::V4, asked(false, true), newlines);
}

}  // namespace chat_parse_test
}  // namespace
