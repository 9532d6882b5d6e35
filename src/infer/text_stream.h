// The text of generated token ids as it grows, for programs that hand it on
// piece by piece (`deepseek generate`'s output, the server's streams).
// A byte-level token can end inside a UTF-8 character: text ending in
// U+FFFD is held back until a later token completes it (or the end). With
// stop strings, the text is cut before the first one, and text that could
// still become one (the longest stop's length minus one bytes) is held back
// until a later token decides it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/tokenizer.h"

namespace ds::infer {

class TextStream {
 public:
  // `eos_token_id` (>= 0) is left out of the text.
  explicit TextStream(const io::Tokenizer& tok, std::vector<std::string> stops = {}, int64_t eos_token_id = -1);
  // Adds a token; returns the text that can be handed on now. stopped()
  // turns true when a stop string appeared (the text before it is returned).
  std::string push(int32_t id);
  // The text held back, at the end of the generation ("" once stopped).
  std::string finish();
  bool stopped() const { return stopped_; }
  // The stop string that appeared first (empty: none).
  const std::string& stop() const { return stop_; }

 private:
  // Decodes the ids; false (and no change) when the result does not begin
  // with the text already handed on.
  bool refresh();
  std::string take(size_t end);

  const io::Tokenizer& tok_;
  std::vector<std::string> stops_;
  int64_t eos_;
  size_t hold_ = 0, sent_ = 0;
  std::vector<int32_t> ids_;
  std::string text_;
  bool stopped_ = false;
  std::string stop_;
};

}  // namespace ds::infer
