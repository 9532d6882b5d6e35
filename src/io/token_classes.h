// Engram's token classes: the "compressed tokenizer" of DeepSeek's Engram
// demo, which MaxText's Engram and DeepSeek-V4.1 hash through. Tokens whose
// text differs only by case, accents, Unicode compatibility forms or
// surrounding whitespace share a class, so their n-grams share table rows.
//
// For every id of the tokenizer: its text decoded alone (special tokens
// kept). A text holding U+FFFD (a partial UTF-8 sequence) is keyed by the
// raw token string; any other by its normal form (class_key below), or by the
// text itself when that is empty. Classes are numbered in first-seen order.
// The normal form is Hugging Face's normalizers' (NFKC, NFD, strip marks,
// lowercase one code point at a time), through ICU; tests compare it with
// Hugging Face's library itself on DeepSeek-V3's tokenizer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/tokenizer.h"

namespace ds::io {

struct TokenClasses {
  std::vector<int32_t> table;  // id -> class
  int32_t count = 0;           // the classes (V')
};

// The classes of ids [0, vocab): the tokenizer's, and class 0 for ids past
// its last (a model's vocabulary may be padded beyond its tokenizer).
TokenClasses engram_token_classes(const Tokenizer& tok, int64_t vocab);

// The normal form of a valid UTF-8 text: NFKC, NFD, marks (Mn, Mc, Me)
// removed, each code point lowercased (full mapping, no context), each run
// of [ \t\r\n] one space, a lone " " kept, the ends stripped of White_Space
// (U+E000 reads as a space afterwards, as the demo's sentinel does).
std::string class_key(std::string_view text);

}  // namespace ds::io
