#include "infer/text_stream.h"

#include <algorithm>
#include <string_view>

namespace ds::infer {

namespace {
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
}

TextStream::TextStream(const io::Tokenizer& tok, std::vector<std::string> stops, int64_t eos_token_id)
    : tok_(tok), stops_(std::move(stops)), eos_(eos_token_id) {
  for (const auto& s : stops_) hold_ = std::max(hold_, s.size() - 1);
}

bool TextStream::refresh() {
  std::string text = tok_.decode(ids_, /*skip_special_tokens=*/true);
  if (text.size() < sent_ || text.compare(0, sent_, text_, 0, sent_) != 0) return false;
  text_ = std::move(text);
  return true;
}

std::string TextStream::take(size_t end) {
  std::string out = text_.substr(sent_, end - sent_);
  sent_ = end;
  return out;
}

std::string TextStream::push(int32_t id) {
  if (stopped_) return {};
  if (id != eos_) ids_.push_back(id);
  if (!refresh()) return {};
  if (!stops_.empty()) {
    // A stop string never starts in text already handed on: it would have
    // been found when that text was.
    size_t first = std::string::npos;
    const size_t from = sent_ > hold_ ? sent_ - hold_ : 0;
    for (const auto& s : stops_) {
      const size_t at = text_.find(s, from);
      if (at < first) first = at, stop_ = s;
    }
    if (first != std::string::npos) {
      stopped_ = true;
      return take(std::max(first, sent_));
    }
  }
  if (text_.ends_with(kReplacement)) return {};
  // Up to the held-back bytes, not inside a character.
  size_t safe = text_.size() - std::min(hold_, text_.size());
  while (safe > sent_ && safe < text_.size() && (static_cast<unsigned char>(text_[safe]) & 0xC0) == 0x80) --safe;
  return take(std::max(safe, sent_));
}

std::string TextStream::finish() {
  if (stopped_ || !refresh()) return {};
  return take(text_.size());
}

}  // namespace ds::infer
