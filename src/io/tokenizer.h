// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (the format
// of DeepSeek-V3's tokenizer), producing the same ids as Hugging Face's
// `tokenizers` library.
//
// Encoding pipeline, in Hugging Face's order:
//   1. added tokens: the text is split on the contents of `added_tokens`
//      (leftmost-longest; tokens with normalized=false first, then the
//      normalized ones on the remaining pieces). Special-token strings inside
//      the text are recognised and become their ids.
//   2. pre-tokenizer: a Sequence of Split steps (regex, Isolated) applied piece
//      by piece, then ByteLevel (bytes -> printable characters, optionally with
//      GPT-2's own split regex).
//   3. model: BPE over the byte-level characters of each piece, merging the
//      adjacent pair of lowest merge rank (leftmost on ties) until none is left.
// Decoding maps ids back to byte strings (ByteLevel decoder) and replaces
// invalid UTF-8 with U+FFFD the way Rust's String::from_utf8_lossy does.
//
// Split regexes run on PCRE2 with Hugging Face's (Oniguruma's) meaning of \s
// and \w; see io/tokenizer_text.h for the one known difference (characters
// first assigned in Unicode 15 or later).
//
// Anything the file asks for that is not implemented (another model type, a
// normalizer, lstrip/rstrip/single_word added tokens, other pre-tokenizers)
// is rejected with a ds::Error at load time rather than silently ignored.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ds::io {

class Tokenizer {
 public:
  // Reads `path` (tokenizer.json). If a tokenizer_config.json sits beside it,
  // its `bos_token` and `add_bos_token` decide what encode(.., true) prepends;
  // otherwise the BOS is the added token `<｜begin▁of▁sentence｜>` when present.
  static Tokenizer from_file(const std::string& path);
  // Same from JSON text; `config_json` is the tokenizer_config.json text or "".
  // `origin` names the source in error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                             const std::string& origin = "tokenizer.json");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (valid UTF-8, else ds::Error). With
  // `add_special_tokens` the BOS id is prepended, as `transformers` does by
  // default; the bare Hugging Face tokenizer (and false here) never adds it.
  // Thread-safe; concurrent calls share one word cache under a lock.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Text of `ids` (ds::Error for an id that names no token). Added tokens
  // decode to their content; byte sequences that are not valid UTF-8 become
  // U+FFFD, as Hugging Face's decode(ids, skip_special_tokens) does; with
  // `skip_special_tokens` the ids of special added tokens are left out.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The pieces the pre-tokenizer alone cuts `text` into (no added-token
  // matching), each in byte-level characters: Hugging Face's pre_tokenize_str.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

  // 1 + the largest id (model vocabulary and added tokens).
  int32_t vocab_size() const;
  // The BOS id that encode(.., true) prepends, or nullopt if there is none.
  std::optional<int32_t> bos_id() const;
  // An id's token string as stored in the file (byte-level characters for
  // model tokens, the content for added tokens); ds::Error if unknown.
  const std::string& id_to_token(int32_t id) const;
  // The id of a token string (added tokens first), if any.
  std::optional<int32_t> token_to_id(std::string_view token) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Throws ds::Error naming the first byte offset that is not valid UTF-8
// (overlong forms, surrogates and code points above U+10FFFF included);
// `what` names the input in the message.
void check_utf8(std::string_view s, const char* what);

// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes
// one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

}  // namespace ds::io
