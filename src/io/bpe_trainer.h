// Trains a byte-level BPE tokenizer from UTF-8 documents and writes it as a
// Hugging Face tokenizer.json that io/tokenizer.h (and Hugging Face's
// `tokenizers`) load.
//
// Pre-tokenization is DeepSeek-V3's, run by the same code that encodes text
// (Tokenizer::pre_tokenize): Split on digit groups \p{N}{1,3}, then on runs of
// CJK ideographs and kana, then on the word/punctuation/whitespace regex, and
// ByteLevel, which writes every byte as one printable character (GPT-2's
// bytes_to_unicode). Each document becomes a list of words; the trainer only
// keeps how often each distinct word occurs.
//
// Training is Hugging Face's BpeTrainer: every word starts as its byte-level
// characters; repeatedly, the adjacent pair (A, B) with the largest count
//   count(A, B) = sum over words w of freq(w) * #occurrences of A B in w
// becomes a new token AB, and every occurrence of A B (left to right,
// non-overlapping) in every word is replaced by it. Ties go to the pair of
// smallest ids (A first, then B), so the result is fully determined by the
// word counts. Counts are kept exact incrementally: a merge at
//   ... P A B N ...  ->  ... P AB N ...
// removes the pairs (P, A), (A, B), (B, N) and adds (P, AB), (AB, N), each
// weighted by the word's frequency, and only the words that contain A B are
// visited (an index from each pair to the words holding it). A max-heap of
// (count, pair) is updated lazily: a popped entry whose count is out of date
// is pushed back with the current count. Training stops when the vocabulary
// reaches the requested size, or when the best pair occurs fewer than
// `min_frequency` times (or not at all). Hugging Face's trainer gives the same
// merges (checked in tests/bpe_trainer_test.cc) except in one corner: when a
// merge re-forms a token that already exists, it may apply a later merge of a
// pair holding that token to only some of the words, and list it twice.
//
// Id layout (DeepSeek-V3's, and what Hugging Face's BpeTrainer gives with the
// special tokens listed first):
//   0  <｜begin▁of▁sentence｜>   (BOS)
//   1  <｜end▁of▁sentence｜>     (EOS)
//   2  <｜▁pad▁｜>               (only with `pad_token`)
//   then the 256 byte-level characters in code point order ('!' .. '~',
//   '¡' .. '¬', '®' .. 'ÿ', then U+0100 .. U+0143 for the other bytes),
//   then the merged tokens in the order they were learned.
// The special tokens are both model vocabulary entries and added tokens
// (special, not normalized), so Hugging Face gives them the same ids. The
// requested vocabulary size counts all of them. A merge whose result already
// exists (A+B spelled like an earlier token) adds a merge but no token.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ds::io {

inline constexpr const char* kBosToken = "<｜begin▁of▁sentence｜>";
inline constexpr const char* kEosToken = "<｜end▁of▁sentence｜>";
inline constexpr const char* kPadToken = "<｜▁pad▁｜>";
// The largest vocabulary the trainer accepts.
inline constexpr int64_t kMaxTrainedVocab = int64_t{1} << 20;

struct BpeTrainerOptions {
  // Total vocabulary: special tokens + 256 byte tokens + merged tokens.
  int64_t vocab_size = 0;
  // A pair seen fewer times than this is never merged (0 and 1 both mean
  // "any pair that occurs").
  int64_t min_frequency = 2;
  // Also add <｜▁pad▁｜> as id 2.
  bool pad_token = false;
  // Long documents are pre-tokenized in pieces of about this many bytes, cut
  // only where a line ends and the next starts with an ASCII letter (no split
  // regex match crosses such a point), so the words are the same as for the
  // whole document and memory stays bounded.
  size_t chunk_bytes = size_t{1} << 20;
};

// What the trainer has read so far.
struct BpeCorpusStats {
  int64_t documents = 0;
  int64_t bytes = 0;
  int64_t words = 0;           // pre-tokenized pieces
  int64_t distinct_words = 0;  // distinct pieces
};

// A trained tokenizer. Tokens are in byte-level characters (the special
// tokens as their text); merges are (left id, right id) in rank order.
struct BpeModel {
  std::vector<std::string> vocab;  // by id
  std::vector<std::pair<int32_t, int32_t>> merges;
  int32_t num_special = 0;  // ids 0 .. num_special-1 are the special tokens
};

class BpeTrainer {
 public:
  // ds::Error if vocab_size is not in [256 + special tokens, 2^20] or
  // min_frequency is negative.
  explicit BpeTrainer(const BpeTrainerOptions& options);
  BpeTrainer(BpeTrainer&&) noexcept;
  BpeTrainer& operator=(BpeTrainer&&) noexcept;
  ~BpeTrainer();

  // Pre-tokenizes one document and counts its words; ds::Error naming
  // `origin` if it is not valid UTF-8.
  void add_document(std::string_view text, const std::string& origin = "document");
  // Reads a file: the whole file is one document, except for `.jsonl` files,
  // where each non-blank line is a JSON object whose string field "text" is
  // one document. ds::Error for an unreadable file, a bad line (naming its
  // number) or text that is not valid UTF-8.
  void add_file(const std::string& path);

  const BpeCorpusStats& stats() const;
  // Learns the merges from the words counted so far; ds::Error if no text
  // was added. Does not change the counts, so it can be called again.
  BpeModel train() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// tokenizer.json text: model BPE (vocab by id, merges as "A B"), DeepSeek-V3's
// pre_tokenizer and post_processor, a ByteLevel decoder, the special tokens as
// added tokens, no normalizer.
std::string bpe_tokenizer_json(const BpeModel& model);
// tokenizer_config.json text: BOS and EOS, add_bos_token true (so that
// Tokenizer::from_file and `transformers` prepend BOS), add_eos_token false.
std::string bpe_tokenizer_config_json(const BpeModel& model);
// Writes tokenizer.json to `path` and tokenizer_config.json into the same
// folder, each atomically (io/atomic_file.h). Both outputs are checked before
// either is written.
void write_bpe_tokenizer(const BpeModel& model, const std::string& path);
// The tokenizer_config.json path that belongs with a tokenizer.json path (the
// same folder); ds::Error if the tokenizer.json path itself has that name.
std::string tokenizer_config_path(const std::string& tokenizer_json_path);

}  // namespace ds::io
