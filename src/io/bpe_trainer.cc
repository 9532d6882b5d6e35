#include "io/bpe_trainer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/text_input.h"
#include "io/tokenizer.h"
#include "io/tokenizer_text.h"

namespace ds::io {

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// DeepSeek-V3's pre_tokenizer, as in its tokenizer.json.
constexpr const char* kPreTokenizerJson =
    R"json({
  "type": "Sequence",
  "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
    {"type": "Split",
     "pattern": {"Regex": ")json"
    // (one JSON string; the C++ literal is cut only to keep the lines short)
    R"json([!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|)json"
    R"json( ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ]
})json";
constexpr const char* kPostProcessorJson =
    R"json({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})json";
constexpr const char* kDecoderJson =
    R"json({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true})json";

// The byte-level characters in code point order: the order of the 256 byte
// tokens' ids.
std::vector<std::string> byte_alphabet() {
  const auto cp = detail::byte_to_codepoint();
  std::vector<uint32_t> sorted(cp.begin(), cp.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::string> out;
  for (uint32_t c : sorted) {
    std::string s;
    detail::append_utf8(s, c);
    out.push_back(std::move(s));
  }
  return out;
}

// A Tokenizer that only pre-tokenizes: the byte tokens and no merges.
Tokenizer make_pre_tokenizer() {
  json vocab = json::object();
  const auto alphabet = byte_alphabet();
  for (size_t i = 0; i < alphabet.size(); ++i) vocab[alphabet[i]] = i;
  json root = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
               {"pre_tokenizer", json::parse(kPreTokenizerJson)},
               {"decoder", json::parse(kDecoderJson)}};
  return Tokenizer::from_json(root.dump(), {}, "DeepSeek-V3 pre-tokenizer");
}

// Where a document may be cut without changing its pre-tokenization: right
// after a '\n' that is followed by an ASCII letter. No piece of the split
// regexes runs across it: the digit and CJK runs stop at the '\n', and in the
// last regex a '\n' is only ever the end of a match (`[\r\n]*` / `[\r\n]+`
// before nothing else, `\s` runs that the letter ends) or excluded
// (`[^\r\n...]`), so every split happens there with or without the rest.
size_t next_cut(std::string_view text, size_t from) {
  for (size_t i = text.find('\n', from); i != std::string_view::npos; i = text.find('\n', i + 1)) {
    if (i + 1 >= text.size()) return std::string_view::npos;
    const char c = text[i + 1];
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return i + 1;
  }
  return std::string_view::npos;
}

// Hash of a packed (left, right) pair (splitmix64 finalizer).
struct PairHash {
  size_t operator()(uint64_t k) const {
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebull;
    return static_cast<size_t>(k ^ (k >> 31));
  }
};

uint64_t pack(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

// A JSON string literal, UTF-8 kept as it is.
std::string quote(const std::string& s) { return json(s).dump(-1, ' ', false, json::error_handler_t::strict); }

// `j` pretty-printed, its lines after the first indented by `indent`.
std::string nested(const ordered_json& j, const std::string& indent) {
  const std::string s = j.dump(2, ' ', false, json::error_handler_t::strict);
  std::string out;
  for (char c : s) {
    out += c;
    if (c == '\n') out += indent;
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Counting words.
// ---------------------------------------------------------------------------

struct BpeTrainer::Impl {
  BpeTrainerOptions opt;
  Tokenizer pre = make_pre_tokenizer();
  std::unordered_map<std::string, int64_t> word_counts;  // byte-level word -> occurrences
  BpeCorpusStats stats;

  void count(std::string_view text) {
    for (auto& w : pre.pre_tokenize(text)) {
      ++word_counts[std::move(w)];
      ++stats.words;
    }
  }
};

BpeTrainer::BpeTrainer(const BpeTrainerOptions& options) : impl_(std::make_unique<Impl>()) {
  const int64_t specials = options.pad_token ? 3 : 2;
  DS_CHECK(options.vocab_size >= 256 + specials && options.vocab_size <= kMaxTrainedVocab,
           "vocabulary size {} is out of range: it must be at least {} (256 byte tokens + {} special tokens) and at "
           "most {}",
           options.vocab_size, 256 + specials, specials, kMaxTrainedVocab);
  DS_CHECK(options.min_frequency >= 0, "min frequency {} must not be negative", options.min_frequency);
  DS_CHECK(options.chunk_bytes > 0, "chunk size must be positive");
  impl_->opt = options;
}
BpeTrainer::BpeTrainer(BpeTrainer&&) noexcept = default;
BpeTrainer& BpeTrainer::operator=(BpeTrainer&&) noexcept = default;
BpeTrainer::~BpeTrainer() = default;

void BpeTrainer::add_document(std::string_view text, const std::string& origin) {
  check_utf8(text, origin.c_str());
  Impl& t = *impl_;
  size_t begin = 0;
  while (text.size() - begin > t.opt.chunk_bytes) {
    const size_t cut = next_cut(text, begin + t.opt.chunk_bytes);
    if (cut == std::string_view::npos) break;
    t.count(text.substr(begin, cut - begin));
    begin = cut;
  }
  t.count(text.substr(begin));
  ++t.stats.documents;
  t.stats.bytes += static_cast<int64_t>(text.size());
  t.stats.distinct_words = static_cast<int64_t>(t.word_counts.size());
}

void BpeTrainer::add_file(const std::string& path) {
  std::error_code ec;
  DS_CHECK(std::filesystem::is_regular_file(path, ec), "corpus file '{}' does not exist or is not a regular file",
           path);
  if (!is_jsonl(path)) {
    add_document(read_file(path, "corpus file"), "corpus file '" + path + "'");
    return;
  }
  // Line by line, so a large .jsonl file is never held whole.
  std::ifstream f(path, std::ios::binary);
  DS_CHECK(f.good(), "cannot open corpus file '{}'", path);
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    if (is_blank_line(line)) continue;
    const std::string where = fmt::format("corpus file '{}' line {}", path, n);
    add_document(jsonl_text(line, where), where);
  }
  DS_CHECK(!f.bad(), "error reading corpus file '{}'", path);
}

const BpeCorpusStats& BpeTrainer::stats() const { return impl_->stats; }

// ---------------------------------------------------------------------------
// Merging.
// ---------------------------------------------------------------------------

namespace {

// Count of a pair and the words that have held it (a word may be listed
// more than once, or no longer hold the pair; the merge loop checks).
struct PairInfo {
  int64_t count = 0;
  std::vector<int32_t> words;
};

// Heap entry: larger count first, then smaller (left, right).
struct Candidate {
  int64_t count;
  uint64_t pair;
  bool operator<(const Candidate& o) const { return count != o.count ? count < o.count : pair > o.pair; }
};

class MergeState {
 public:
  MergeState(std::vector<int32_t> symbols, std::vector<uint32_t> offsets, std::vector<int64_t> freq)
      : sym_(std::move(symbols)), off_(std::move(offsets)), freq_(std::move(freq)) {
    const size_t n = freq_.size();
    len_.resize(n);
    for (size_t w = 0; w < n; ++w) len_[w] = off_[w + 1] - off_[w];
    seen_.assign(n, -1);
    for (size_t w = 0; w < n; ++w) {
      const int32_t* s = sym_.data() + off_[w];
      for (uint32_t i = 0; i + 1 < len_[w]; ++i) add(s[i], s[i + 1], freq_[w], static_cast<int32_t>(w));
    }
    std::vector<Candidate> all;
    all.reserve(pairs_.size());
    for (const auto& [p, info] : pairs_) all.push_back({info.count, p});
    heap_ = std::priority_queue<Candidate>(std::less<Candidate>(), std::move(all));
    touched_.clear();
  }

  // The best pair with its count, or false when there is none.
  bool best(uint64_t& pair, int64_t& count) {
    while (!heap_.empty()) {
      const Candidate top = heap_.top();
      heap_.pop();
      auto it = pairs_.find(top.pair);
      const int64_t now = it == pairs_.end() ? 0 : it->second.count;
      if (now == top.count) {
        pair = top.pair, count = now;
        return true;
      }
      if (now > 0) heap_.push({now, top.pair});
    }
    return false;
  }

  // Replaces every occurrence of (a, b) by `merged` in every word.
  void merge(int32_t a, int32_t b, int32_t merged) {
    const std::vector<int32_t> where = std::move(pairs_[pack(a, b)].words);
    ++stamp_;
    for (int32_t w : where) {
      if (seen_[w] == stamp_) continue;
      seen_[w] = stamp_;
      merge_word(w, a, b, merged);
    }
    std::sort(touched_.begin(), touched_.end());
    touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
    for (uint64_t p : touched_) {
      const int64_t c = pairs_[p].count;
      if (c > 0) heap_.push({c, p});
    }
    touched_.clear();
  }

 private:
  void add(int32_t x, int32_t y, int64_t c, int32_t w) {
    const uint64_t p = pack(x, y);
    PairInfo& info = pairs_[p];
    info.count += c;
    if (c > 0) {
      if (info.words.empty() || info.words.back() != w) info.words.push_back(w);
      touched_.push_back(p);
    }
  }

  // Left to right, non-overlapping; s[r..] is read, s[..out) written.
  void merge_word(int32_t w, int32_t a, int32_t b, int32_t merged) {
    int32_t* s = sym_.data() + off_[w];
    const uint32_t n = len_[w];
    const int64_t c = freq_[w];
    uint32_t r = 0, out = 0;
    while (r < n) {
      if (r + 1 < n && s[r] == a && s[r + 1] == b) {
        if (out > 0) {
          add(s[out - 1], a, -c, w);
          add(s[out - 1], merged, c, w);
        }
        if (r + 2 < n) {
          add(b, s[r + 2], -c, w);
          add(merged, s[r + 2], c, w);
        }
        add(a, b, -c, w);
        s[out++] = merged;
        r += 2;
      } else {
        s[out++] = s[r++];
      }
    }
    len_[w] = out;
  }

  std::vector<int32_t> sym_;   // all words' symbols, word w at off_[w] .. off_[w] + len_[w]
  std::vector<uint32_t> off_;  // start of each word (and the end)
  std::vector<uint32_t> len_;  // current length of each word
  std::vector<int64_t> freq_;  // occurrences of each word
  std::vector<int32_t> seen_;  // merge step that last visited each word
  int32_t stamp_ = 0;
  std::unordered_map<uint64_t, PairInfo, PairHash> pairs_;
  std::priority_queue<Candidate> heap_;
  std::vector<uint64_t> touched_;  // pairs that gained occurrences in this step
};

}  // namespace

BpeModel BpeTrainer::train() const {
  const Impl& t = *impl_;
  DS_CHECK(t.stats.bytes > 0, "the training corpus is empty ({} documents, no text)", t.stats.documents);
  BpeModel model;
  model.vocab = {kBosToken, kEosToken};
  if (t.opt.pad_token) model.vocab.push_back(kPadToken);
  model.num_special = static_cast<int32_t>(model.vocab.size());
  std::unordered_map<std::string, int32_t> token_id;
  for (const auto& s : byte_alphabet()) {
    token_id.emplace(s, static_cast<int32_t>(model.vocab.size()));
    model.vocab.push_back(s);
  }

  // Words as symbol ids, sorted so that the layout does not depend on hashing.
  std::vector<const std::pair<const std::string, int64_t>*> words;
  words.reserve(t.word_counts.size());
  for (const auto& wc : t.word_counts) words.push_back(&wc);
  std::sort(words.begin(), words.end(), [](auto* x, auto* y) { return x->first < y->first; });
  std::array<int32_t, 0x144> char_id{};  // byte-level code point -> id
  for (const auto& [s, id] : token_id) {
    const auto* u = reinterpret_cast<const unsigned char*>(s.data());
    char_id[s.size() == 1 ? u[0] : ((u[0] & 0x1F) << 6) | (u[1] & 0x3F)] = id;
  }
  std::vector<int32_t> symbols;
  std::vector<uint32_t> offsets{0};
  std::vector<int64_t> freq;
  for (const auto* wc : words) {
    const std::string& w = wc->first;
    const auto* u = reinterpret_cast<const unsigned char*>(w.data());
    for (size_t i = 0; i < w.size();) {
      // Byte-level characters are U+0021 .. U+0143: one or two UTF-8 bytes.
      if (u[i] < 0x80) {
        symbols.push_back(char_id[u[i]]);
        i += 1;
      } else {
        symbols.push_back(char_id[((u[i] & 0x1F) << 6) | (u[i + 1] & 0x3F)]);
        i += 2;
      }
    }
    DS_CHECK(symbols.size() < UINT32_MAX, "the training corpus has too many distinct words");
    offsets.push_back(static_cast<uint32_t>(symbols.size()));
    freq.push_back(wc->second);
  }
  MergeState state(std::move(symbols), std::move(offsets), std::move(freq));

  const int64_t min_count = std::max<int64_t>(1, t.opt.min_frequency);
  while (static_cast<int64_t>(model.vocab.size()) < t.opt.vocab_size) {
    uint64_t pair;
    int64_t count;
    if (!state.best(pair, count) || count < min_count) break;
    const auto a = static_cast<int32_t>(pair >> 32), b = static_cast<int32_t>(pair & 0xFFFFFFFFu);
    std::string joined = model.vocab[a] + model.vocab[b];
    auto [it, fresh] = token_id.emplace(joined, static_cast<int32_t>(model.vocab.size()));
    if (fresh) model.vocab.push_back(std::move(joined));
    model.merges.emplace_back(a, b);
    state.merge(a, b, it->second);
  }
  return model;
}

// ---------------------------------------------------------------------------
// Corpus files and output.
// ---------------------------------------------------------------------------

std::string bpe_tokenizer_json(const BpeModel& model) {
  ordered_json added = ordered_json::array();
  for (int32_t id = 0; id < model.num_special; ++id)
    added.push_back({{"id", id},
                     {"content", model.vocab[id]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  std::string s = "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n";
  s += "  \"added_tokens\": " + nested(added, "  ") + ",\n";
  s += "  \"normalizer\": null,\n";
  s += "  \"pre_tokenizer\": " + nested(ordered_json::parse(kPreTokenizerJson), "  ") + ",\n";
  s += "  \"post_processor\": " + nested(ordered_json::parse(kPostProcessorJson), "  ") + ",\n";
  s += "  \"decoder\": " + nested(ordered_json::parse(kDecoderJson), "  ") + ",\n";
  s += "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n";
  s += "    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n";
  s += "    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n    \"vocab\": {";
  for (size_t id = 0; id < model.vocab.size(); ++id)
    s += fmt::format("{}\n      {}: {}", id ? "," : "", quote(model.vocab[id]), id);
  s += "\n    },\n    \"merges\": [";
  for (size_t r = 0; r < model.merges.size(); ++r)
    s += fmt::format("{}\n      {}", r ? "," : "",
                     quote(model.vocab[model.merges[r].first] + " " + model.vocab[model.merges[r].second]));
  s += "\n    ]\n  }\n}\n";
  return s;
}

std::string bpe_tokenizer_config_json(const BpeModel& model) {
  const bool pad = model.num_special > 2;
  const ordered_json cfg = {{"add_bos_token", true},
                            {"add_eos_token", false},
                            {"bos_token", kBosToken},
                            {"eos_token", kEosToken},
                            {"pad_token", pad ? kPadToken : kEosToken},
                            {"unk_token", nullptr},
                            {"clean_up_tokenization_spaces", false},
                            {"legacy", true},
                            {"model_max_length", 131072},
                            {"tokenizer_class", "LlamaTokenizerFast"}};
  return cfg.dump(2, ' ', false, json::error_handler_t::strict) + "\n";
}

std::string tokenizer_config_path(const std::string& tokenizer_json_path) {
  const std::filesystem::path p(tokenizer_json_path);
  DS_CHECK(p.filename() != "tokenizer_config.json",
           "output '{}': that name is taken by the tokenizer_config.json written beside it", tokenizer_json_path);
  return (p.parent_path() / "tokenizer_config.json").string();
}

void write_bpe_tokenizer(const BpeModel& model, const std::string& path) {
  const std::string config_path = tokenizer_config_path(path);
  resolve_output_path(path);
  resolve_output_path(config_path);
  write_file_atomic(path, bpe_tokenizer_json(model));
  write_file_atomic(config_path, bpe_tokenizer_config_json(model));
}

}  // namespace ds::io
