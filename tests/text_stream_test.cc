// The text of generated ids handed on piece by piece: the pieces add up to
// the decoded text, never end inside a UTF-8 character, leave out the EOS,
// and stop strings cut the text before them even when they span tokens.
#include "infer/text_stream.h"

#include <gtest/gtest.h>

namespace {
namespace text_stream_test {

const ds::io::Tokenizer& tiny() {
  static const auto tok =
      ds::io::Tokenizer::from_file(std::string(DEEPSEEK_SOURCE_DIR) + "/tests/data/tokenizer/tiny/tokenizer.json");
  return tok;
}

// Feeds the ids one at a time; the pieces handed on, the last from finish().
std::vector<std::string> pieces(ds::infer::TextStream& s, const std::vector<int32_t>& ids) {
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(s.push(id));
  out.push_back(s.finish());
  return out;
}

std::string joined(const std::vector<std::string>& p) {
  std::string s;
  for (const auto& x : p) s += x;
  return s;
}

TEST(TextStream, PiecesAddUpAndNeverSplitACharacter) {
  const std::string text = "héllo wörld, 世界 ok";
  const auto ids = tiny().encode(text);
  ds::infer::TextStream s(tiny(), {}, 286);
  auto with_eos = ids;
  with_eos.insert(with_eos.begin() + 3, 286);  // <｜end▁of▁sentence｜> in the middle: left out
  const auto p = pieces(s, with_eos);
  EXPECT_EQ(joined(p), text);
  size_t held = 0;
  for (const auto& x : p) {
    EXPECT_NO_THROW(ds::io::check_utf8(x, "a piece")) << x;
    EXPECT_EQ(x.find("\xEF\xBF\xBD"), std::string::npos) << x;
    held += x.empty();
  }
  // Multi-byte characters take several byte tokens: some pushes hand on nothing.
  EXPECT_GT(held, 1u);
}

TEST(TextStream, StopStringsCutTheText) {
  const std::string text = "hello world, hello again";
  const auto ids = tiny().encode(text);
  for (const std::string stop : {"o w", "again", "h", "d, h"}) {
    ds::infer::TextStream s(tiny(), {"never", stop});
    std::string got;
    size_t pushed = 0;
    for (int32_t id : ids) {
      got += s.push(id);
      ++pushed;
      if (s.stopped()) break;
    }
    got += s.finish();
    EXPECT_TRUE(s.stopped()) << stop;
    EXPECT_EQ(got, text.substr(0, text.find(stop))) << stop;
    EXPECT_EQ(s.push(ids[0]), "") << "nothing after the stop";
    EXPECT_LE(pushed, ids.size());
  }
  // No stop in the text: all of it, at the end at the latest.
  ds::infer::TextStream s(tiny(), {"xyz"});
  EXPECT_EQ(joined(pieces(s, ids)), text);
  EXPECT_FALSE(s.stopped());
}

}  // namespace text_stream_test
}  // namespace
