#include "io/token_classes.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <unordered_map>

#include "core/error.h"

namespace ds::io {

namespace {

constexpr UChar32 kSentinel = 0xE000;

bool is_mark(UChar32 c) {
  const auto t = u_charType(c);
  return t == U_NON_SPACING_MARK || t == U_COMBINING_SPACING_MARK || t == U_ENCLOSING_MARK;
}

}  // namespace

std::string class_key(std::string_view text) {
  UErrorCode st = U_ZERO_ERROR;
  const icu::Normalizer2* nfkc = icu::Normalizer2::getNFKCInstance(st);
  const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(st);
  DS_CHECK(U_SUCCESS(st), "ICU: the Unicode normalisation data is missing ({})", u_errorName(st));
  icu::UnicodeString s = icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  s = nfkc->normalize(s, st);
  s = nfd->normalize(s, st);
  DS_CHECK(U_SUCCESS(st), "ICU: normalisation failed ({})", u_errorName(st));
  // Marks out, each code point lowercased alone, whitespace runs collapsed.
  icu::UnicodeString t;
  bool in_space = false;
  for (int32_t i = 0; i < s.length(); i = s.moveIndex32(i, 1)) {
    const UChar32 c = s.char32At(i);
    if (is_mark(c)) continue;
    icu::UnicodeString one(c);
    one.toLower(icu::Locale::getRoot());
    for (int32_t j = 0; j < one.length(); j = one.moveIndex32(j, 1)) {
      const UChar32 d = one.char32At(j);
      const bool space = d == ' ' || d == '\t' || d == '\r' || d == '\n';
      if (space && in_space) continue;
      t.append(space ? UChar32{' '} : d);
      in_space = space;
    }
  }
  if (t == icu::UnicodeString(UChar32{' '})) t = icu::UnicodeString(kSentinel);
  int32_t b = 0, e = t.length();
  while (b < e && u_isUWhiteSpace(t.char32At(b))) b = t.moveIndex32(b, 1);
  while (e > b) {
    const int32_t p = t.moveIndex32(e, -1);
    if (!u_isUWhiteSpace(t.char32At(p))) break;
    e = p;
  }
  icu::UnicodeString u = t.tempSubStringBetween(b, e);
  u.findAndReplace(icu::UnicodeString(kSentinel), icu::UnicodeString(UChar32{' '}));
  std::string out;
  u.toUTF8String(out);
  return out;
}

TokenClasses engram_token_classes(const Tokenizer& tok, int64_t vocab) {
  DS_CHECK(vocab >= 1, "engram token classes: the vocabulary must be positive, got {}", vocab);
  TokenClasses c;
  c.table.assign(static_cast<size_t>(vocab), 0);
  std::unordered_map<std::string, int32_t> seen;
  const int64_t known = std::min<int64_t>(vocab, tok.vocab_size());
  for (int64_t id = 0; id < known; ++id) {
    const int32_t i = static_cast<int32_t>(id);
    const std::string text = tok.decode(std::span<const int32_t>(&i, 1), false);
    std::string key;
    if (text.find("\xEF\xBF\xBD") != std::string::npos) {
      key = tok.id_to_token(i);
    } else {
      key = class_key(text);
      if (key.empty()) key = text;
    }
    const auto [it, fresh] = seen.emplace(std::move(key), static_cast<int32_t>(seen.size()));
    c.table[static_cast<size_t>(id)] = it->second;
  }
  c.count = static_cast<int32_t>(std::max<size_t>(seen.size(), 1));
  return c;
}

}  // namespace ds::io
