#include "io/tokenizer_text.h"

#include <cstring>
#include <nlohmann/json.hpp>

#include "io/tokenizer.h"

namespace ds::io {

namespace detail {

namespace {

using json = nlohmann::json;
}  // namespace

// ---------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------

// Second bytes are range-checked per lead byte, which rules out overlong forms,
// surrogates (ED A0..BF) and code points above U+10FFFF.
size_t utf8_seq_len(const unsigned char* s, size_t i, size_t n) {
  const unsigned c = s[i];
  if (c < 0x80) return 1;
  auto cont = [&](size_t k, unsigned lo, unsigned hi) { return i + k < n && s[i + k] >= lo && s[i + k] <= hi; };
  if (c >= 0xC2 && c <= 0xDF) return cont(1, 0x80, 0xBF) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    const unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    return cont(1, lo, hi) && cont(2, 0x80, 0xBF) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    const unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    return cont(1, lo, hi) && cont(2, 0x80, 0xBF) && cont(3, 0x80, 0xBF) ? 4 : 0;
  }
  return 0;
}

namespace {

// Bytes of the maximal prefix of a valid sequence starting at s[i] (at least
// 1): the unit that one U+FFFD replaces in from_utf8_lossy.
size_t utf8_invalid_len(const unsigned char* s, size_t i, size_t n) {
  const unsigned c = s[i];
  unsigned lo = 0x80, hi = 0xBF;
  size_t need;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 1;
  }
  size_t k = 1;
  if (i + k < n && s[i + k] >= lo && s[i + k] <= hi) {
    ++k;
    while (k <= need && i + k < n && s[i + k] >= 0x80 && s[i + k] <= 0xBF) ++k;
  }
  return k;
}

// Decodes the (valid) sequence of `len` bytes at s[i] to its code point.
uint32_t utf8_decode(const unsigned char* s, size_t i, size_t len) {
  if (len == 1) return s[i];
  uint32_t cp = s[i] & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (s[i + k] & 0x3F);
  return cp;
}

}  // namespace

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// ---------------------------------------------------------------------------
// Byte-level alphabet (GPT-2's bytes_to_unicode): printable Latin-1 bytes map
// to themselves, the other 68 bytes to U+0100.. in byte order, so every byte
// is one visible character and BPE never sees whitespace or control bytes.
// ---------------------------------------------------------------------------

std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> t{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    t[b] = printable ? b : next++;
  }
  return t;
}

std::string byte_level_encode(std::string_view raw, const std::array<uint32_t, 256>& table) {
  std::string s;
  s.reserve(raw.size() * 2);
  for (unsigned char b : raw) append_utf8(s, table[b]);
  return s;
}

std::string byte_level_decode(const std::string& token, const std::unordered_map<uint32_t, uint8_t>& cp_to_byte) {
  std::string out;
  const auto* s = reinterpret_cast<const unsigned char*>(token.data());
  for (size_t i = 0; i < token.size();) {
    const size_t len = utf8_seq_len(s, i, token.size());
    if (len == 0) return token;
    auto it = cp_to_byte.find(utf8_decode(s, i, len));
    if (it == cp_to_byte.end()) return token;
    out += static_cast<char>(it->second);
    i += len;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Regex (PCRE2, UTF + UCP, JIT) with Oniguruma's meaning of \s and \w.
// ---------------------------------------------------------------------------

namespace {

// Unicode White_Space, Oniguruma's \s: PCRE2's UCP \s adds U+180E, which
// Unicode dropped from White_Space in 6.3 and Hugging Face does not split on.
constexpr const char* kWhiteSpace =
    "\\t-\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
// Oniguruma's Unicode \w; PCRE2 10.42's UCP \w is \p{L}\p{N}_ instead.
constexpr const char* kWord = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";

}  // namespace

// Tracks character classes because the replacement differs inside one.
std::string translate_pattern(const std::string& p, const std::string& origin) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 'Q') {  // \Q...\E quotes literally
        const size_t end = p.find("\\E", i + 1);
        const size_t stop = end == std::string::npos ? p.size() : end + 2;
        out.append(p, i - 1, stop - (i - 1));
        i = stop - 1;
      } else if (e == 's') {
        out += in_class ? std::string(kWhiteSpace) : fmt::format("[{}]", kWhiteSpace);
      } else if (e == 'S') {
        // Not White_Space = PCRE2's \S plus U+180E.
        out += in_class ? "\\S\\x{180E}" : "[\\S\\x{180E}]";
      } else if (e == 'w') {
        out += in_class ? std::string(kWord) : fmt::format("[{}]", kWord);
      } else if (e == 'W') {
        DS_CHECK(!in_class, "{}: \\W inside a character class is not supported in pattern {}", origin, p);
        out += fmt::format("[^{}]", kWord);
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const size_t end = p.find(":]", i + 2);
      if (end != std::string::npos) {
        out.append(p, i, end + 2 - i);
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

std::string quote_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
        static_cast<unsigned char>(c) >= 0x80)
      out += c;
    else
      out += fmt::format("\\x{{{:x}}}", static_cast<unsigned>(static_cast<unsigned char>(c)));
  }
  return out;
}

Regex::Regex(const std::string& pattern, const std::string& origin) : source_(pattern) {
  const std::string translated = translate_pattern(pattern, origin);
  int err = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), PCRE2_UTF | PCRE2_UCP, &err,
                        &offset, nullptr);
  if (!code_) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    DS_FAIL("{}: cannot compile regex {} (as {}): {} at offset {}", origin, json(pattern).dump(),
            json(translated).dump(), reinterpret_cast<const char*>(msg), offset);
  }
  // Without a JIT (an unsupported CPU) the interpreter gives the same matches.
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  match_ = pcre2_match_data_create_from_pattern(code_, nullptr);
  context_ = pcre2_match_context_create(nullptr);
  // Long whitespace or letter runs backtrack through `\s+(?!\S)`; give the
  // JIT room beyond its 32 KiB default so they cannot fail.
  stack_ = pcre2_jit_stack_create(32 << 10, 8 << 20, nullptr);
  DS_CHECK(match_ && context_ && stack_, "{}: out of memory creating regex state", origin);
  pcre2_jit_stack_assign(context_, nullptr, stack_);
}

Regex::~Regex() {
  pcre2_jit_stack_free(stack_);
  pcre2_match_context_free(context_);
  pcre2_match_data_free(match_);
  pcre2_code_free(code_);
}

}  // namespace detail

using detail::utf8_invalid_len;
using detail::utf8_seq_len;

void check_utf8(std::string_view s, const char* what) {
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    // ASCII fast path, eight bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, u + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const size_t len = utf8_seq_len(u, i, n);
    DS_CHECK(len > 0, "{} is not valid UTF-8 (bad byte 0x{:02x} at offset {})", what, u[i], i);
    i += len;
  }
}

std::string utf8_lossy(std::string_view bytes) {
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  std::string out;
  out.reserve(n);
  for (size_t i = 0; i < n;) {
    const size_t len = utf8_seq_len(u, i, n);
    if (len > 0) {
      out.append(bytes.data() + i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += utf8_invalid_len(u, i, n);
    }
  }
  return out;
}

}  // namespace ds::io
