// Text machinery under the tokenizer (io/tokenizer.h): UTF-8 sequences, the
// byte-level alphabet, and split regexes that behave like Hugging Face's.
//
// Regexes run on PCRE2 (UTF + UCP, JIT). Hugging Face runs Oniguruma, whose
// \s is Unicode White_Space (U+0085 included, U+180E excluded) and whose \w
// is letters, marks, decimal digits and connector punctuation; patterns are
// rewritten to those classes before PCRE2 compiles them. Known remaining
// difference: PCRE2 10.42 carries Unicode 14 tables, so characters first
// assigned in Unicode 15 or later (CJK Extensions H and I, ...) fall in no
// \p{..} class here.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>

#include "core/error.h"

namespace ds::io::detail {

// Length of the valid UTF-8 sequence at s[i..n), or 0 if it is not one
// (overlong forms, surrogates and code points above U+10FFFF are invalid, as
// in Rust's str).
size_t utf8_seq_len(const unsigned char* s, size_t i, size_t n);
void append_utf8(std::string& out, uint32_t cp);

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the
// other 68 bytes to U+0100.. in byte order, so every byte is one visible
// character and BPE never sees whitespace or control bytes.
std::array<uint32_t, 256> byte_to_codepoint();
// The byte-level form of raw bytes (what the vocabulary's keys are made of).
std::string byte_level_encode(std::string_view raw, const std::array<uint32_t, 256>& table);
// Hugging Face's ByteLevel decoder for one token: if every character is in the
// byte-level alphabet, the bytes they stand for; otherwise (added tokens like
// `<｜end▁of▁sentence｜>`) the token's own UTF-8 bytes.
std::string byte_level_decode(const std::string& token, const std::unordered_map<uint32_t, uint8_t>& cp_to_byte);

// Rewrites \s \S \w \W so that PCRE2 matches what Oniguruma matches; every
// other construct is copied unchanged.
std::string translate_pattern(const std::string& p, const std::string& origin);
// A literal (Split with {"String": ...}) as a pattern.
std::string quote_literal(const std::string& s);

// A compiled split pattern: PCRE2 with UTF and UCP, JIT-compiled where the CPU
// allows (the interpreter gives the same matches otherwise).
class Regex {
 public:
  // Compiles `pattern` (read from the file; `origin` names it in errors).
  Regex(const std::string& pattern, const std::string& origin);
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();
  // Leftmost match in s[0..n) at or after `start`; the subject is exactly
  // s[0..n), so lookarounds see nothing outside it (as Hugging Face, which
  // applies each Split to one piece at a time). Not reentrant: the caller
  // holds the tokenizer's lock.
  bool find(const char* s, size_t n, size_t start, size_t& begin, size_t& end) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s);
    const int rc = jit_ ? pcre2_jit_match(code_, subject, n, start, 0, match_, context_)
                        : pcre2_match(code_, subject, n, start, PCRE2_NO_UTF_CHECK, match_, context_);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      DS_FAIL("regex {} failed on a {}-byte piece: {}", source_, n, reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match_);
    begin = ov[0];
    end = ov[1];
    return true;
  }

 private:
  std::string source_;
  pcre2_code* code_ = nullptr;
  pcre2_match_data* match_ = nullptr;
  pcre2_match_context* context_ = nullptr;
  pcre2_jit_stack* stack_ = nullptr;
  bool jit_ = false;
};

// GPT-2's split regex, which ByteLevel applies itself when use_regex is true.
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Calls on_piece(begin, end) for the pieces of s[0..n) that a Split
// with behavior Isolated produces: every match and every gap between matches,
// empty ones left out (Hugging Face drops them). Iterates the way the
// Oniguruma binding does: an empty match right where the previous match ended
// is skipped by advancing one character, any other empty match still
// separates the gap before it from the text after it.
template <typename F>
void split_isolated(const Regex& re, const char* s, size_t n, F&& on_piece) {
  size_t search = 0, prev = 0;
  size_t last_match_end = std::numeric_limits<size_t>::max();
  const auto* u = reinterpret_cast<const unsigned char*>(s);
  while (search <= n) {
    size_t b, e;
    if (!re.find(s, n, search, b, e)) break;
    if (b == e && e == last_match_end) {
      search += search < n ? std::max<size_t>(1, utf8_seq_len(u, search, n)) : 1;
      continue;
    }
    search = last_match_end = e;
    if (prev < b) on_piece(prev, b);
    if (b < e) on_piece(b, e);
    prev = e;
  }
  if (prev < n) on_piece(prev, n);
}

}  // namespace ds::io::detail
