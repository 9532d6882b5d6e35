#include "io/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "io/text_input.h"
#include "io/tokenizer_text.h"

namespace ds::io {

namespace {

using json = nlohmann::json;
using namespace detail;

// ---------------------------------------------------------------------------
// Added tokens: a byte trie matched leftmost-longest, as the Aho-Corasick
// automaton Hugging Face builds with MatchKind::LeftmostLongest.
// ---------------------------------------------------------------------------

class TokenTrie {
 public:
  void add(std::string_view s, int32_t id) {
    int32_t node = 0;
    for (unsigned char c : s) {
      int32_t child = find_child(node, c);
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        nodes_[node].children.emplace_back(c, child);
      }
      node = child;
    }
    nodes_[node].id = id;
    first_[static_cast<unsigned char>(s[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }

  // Finds the leftmost position in s[from..n) where a token starts, and the
  // longest token there. Returns false if there is none.
  bool find(const char* s, size_t n, size_t from, size_t& begin, size_t& end, int32_t& id) const {
    for (size_t i = from; i < n; ++i) {
      if (!first_[static_cast<unsigned char>(s[i])]) continue;
      int32_t node = 0, best = -1;
      size_t best_end = 0;
      for (size_t j = i; j < n; ++j) {
        node = find_child(node, static_cast<unsigned char>(s[j]));
        if (node < 0) break;
        if (nodes_[node].id >= 0) best = nodes_[node].id, best_end = j + 1;
      }
      if (best >= 0) {
        begin = i, end = best_end, id = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t id = -1;
  };
  int32_t find_child(int32_t node, unsigned char c) const {
    for (const auto& [byte, child] : nodes_[node].children)
      if (byte == c) return child;
    return -1;
  }
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_{};
  bool empty_ = true;
};

// ---------------------------------------------------------------------------
// Merge table: (left id, right id) -> (rank, merged id), open addressing.
// ---------------------------------------------------------------------------

class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0, merged = 0;
  };
  static constexpr uint64_t kEmpty = ~0ull;

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
  }
  // Later entries for the same pair replace earlier ones, as Hugging Face's
  // HashMap built from the merges list in order does.
  void insert(int32_t a, int32_t b, int32_t rank, int32_t merged) {
    const uint64_t key = pack(a, b);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty || slots_[i].key == key) {
        slots_[i] = {key, rank, merged};
        return;
      }
    }
  }
  const Entry* find(int32_t a, int32_t b) const {
    const uint64_t key = pack(a, b);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static uint64_t pack(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  static size_t hash(uint64_t k) {  // splitmix64 finalizer
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebull;
    return static_cast<size_t>(k ^ (k >> 31));
  }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

// ---------------------------------------------------------------------------
// The tokenizer.
// ---------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string origin;
  // Model.
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab;  // byte-level string -> id
  MergeTable merges;
  std::array<int32_t, 256> byte_id{};  // id of each single byte's symbol
  bool ignore_merges = false;
  // Added tokens (matched before anything else) and the special ones.
  TokenTrie raw_trie, normalized_trie;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added;  // content -> id
  std::vector<bool> is_special;                                                 // by id
  // Pre-tokenizer: Split regexes applied in order (ByteLevel's own last).
  std::vector<std::unique_ptr<Regex>> splits;
  std::array<uint32_t, 256> byte_cp = byte_to_codepoint();
  // Per id: the token string as in the file, its decoded bytes, and whether the
  // id names a token at all.
  std::vector<std::string> token_text, token_bytes;
  std::vector<bool> known;
  std::optional<int32_t> bos;

  // Word cache (raw piece bytes -> ids), guarded with the regex state by mu.
  mutable std::mutex mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;
  mutable std::vector<int32_t> work_ids, work_ranks;

  void encode_text(const char* s, size_t n, std::vector<int32_t>& out) const;
  // Runs the Split steps from `level` on, calling on_word(begin, length) for
  // each final piece.
  template <typename F>
  void split_words(const char* s, size_t n, size_t level, F&& on_word) const;
  void pretokenize(const char* s, size_t n, std::vector<int32_t>& out) const {
    split_words(s, n, 0, [&](const char* w, size_t len) { bpe(w, len, out); });
  }
  void bpe(const char* s, size_t n, std::vector<int32_t>& out) const;
  void bpe_small(const char* s, size_t n, std::vector<int32_t>& out) const;
  void bpe_large(const char* s, size_t n, std::vector<int32_t>& out) const;

  // Loading, in from_json's order: each checks its part of the file and
  // fills the tables above from it.
  void load_model(const json& model);
  void load_vocab(const json& entries, const std::string& where);
  void load_merges(const json& list, const std::string& where);
  void load_added_tokens(const json& root);
  void load_pre_tokenizer(const json& pre);
  void load_bos(std::string_view config_json);
};

// Added tokens with normalized=false are matched on the text first; the
// normalized ones on what remains (the normalizer is the identity here).
void Tokenizer::Impl::encode_text(const char* s, size_t n, std::vector<int32_t>& out) const {
  auto second_pass = [&](const char* p, size_t len) {
    size_t pos = 0, b, e;
    int32_t id;
    while (!normalized_trie.empty() && normalized_trie.find(p, len, pos, b, e, id)) {
      if (pos < b) pretokenize(p + pos, b - pos, out);
      out.push_back(id);
      pos = e;
    }
    if (pos < len) pretokenize(p + pos, len - pos, out);
  };
  size_t pos = 0, b, e;
  int32_t id;
  while (!raw_trie.empty() && raw_trie.find(s, n, pos, b, e, id)) {
    if (pos < b) second_pass(s + pos, b - pos);
    out.push_back(id);
    pos = e;
  }
  if (pos < n) second_pass(s + pos, n - pos);
}

template <typename F>
void Tokenizer::Impl::split_words(const char* s, size_t n, size_t level, F&& on_word) const {
  if (level == splits.size()) return on_word(s, n);
  split_isolated(*splits[level], s, n, [&](size_t b, size_t e) { split_words(s + b, e - b, level + 1, on_word); });
}

// Words at most this long merge by rescanning a rank array (fast for the
// short words that make up almost all text); longer ones use a heap so that a
// pathological 1 MB word stays O(n log n).
constexpr size_t kSmallWord = 64;
// Words up to this many bytes are cached, and the cache is emptied when it
// reaches this many entries, bounding its memory to a few tens of MB.
constexpr size_t kMaxCachedWord = 256;
constexpr size_t kMaxCacheEntries = 1 << 18;

void Tokenizer::Impl::bpe(const char* s, size_t n, std::vector<int32_t>& out) const {
  if (n == 1) {
    out.push_back(byte_id[static_cast<unsigned char>(s[0])]);
    return;
  }
  const std::string_view key(s, n);
  if (n <= kMaxCachedWord) {
    auto it = cache.find(key);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  if (ignore_merges) {  // a word that is itself a token skips the merges
    auto it = vocab.find(byte_level_encode(key, byte_cp));
    if (it != vocab.end()) out.push_back(it->second);
  }
  if (out.size() == first) {
    if (n <= kSmallWord)
      bpe_small(s, n, out);
    else
      bpe_large(s, n, out);
  }
  if (n <= kMaxCachedWord) {
    if (cache.size() >= kMaxCacheEntries) cache.clear();
    cache.emplace(std::string(key), std::vector<int32_t>(out.begin() + static_cast<ptrdiff_t>(first), out.end()));
  }
}

// Repeatedly merges the adjacent pair of lowest rank, leftmost on ties.
// ranks[i] is the rank of the pair (ids[i], ids[i+1]), or INT32_MAX.
void Tokenizer::Impl::bpe_small(const char* s, size_t n, std::vector<int32_t>& out) const {
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  auto& ids = work_ids;
  auto& ranks = work_ranks;
  ids.resize(n);
  ranks.resize(n);
  for (size_t i = 0; i < n; ++i) ids[i] = byte_id[static_cast<unsigned char>(s[i])];
  auto rank_of = [&](size_t i) {
    const MergeTable::Entry* m = merges.find(ids[i], ids[i + 1]);
    return m ? m->rank : kNone;
  };
  size_t m = n;
  for (size_t i = 0; i + 1 < m; ++i) ranks[i] = rank_of(i);
  while (m > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < m; ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == kNone) break;
    ids[best] = merges.find(ids[best], ids[best + 1])->merged;
    // Remove symbol best+1 and the pair it started.
    std::copy(ids.begin() + static_cast<ptrdiff_t>(best) + 2, ids.begin() + static_cast<ptrdiff_t>(m),
              ids.begin() + static_cast<ptrdiff_t>(best) + 1);
    std::copy(ranks.begin() + static_cast<ptrdiff_t>(best) + 2, ranks.begin() + static_cast<ptrdiff_t>(m),
              ranks.begin() + static_cast<ptrdiff_t>(best) + 1);
    --m;
    if (best > 0) ranks[best - 1] = rank_of(best - 1);
    if (best + 1 < m) ranks[best] = rank_of(best);
  }
  out.insert(out.end(), ids.begin(), ids.begin() + static_cast<ptrdiff_t>(m));
}

// The same merges with a linked list of symbols and a min-heap of candidate
// pairs keyed (rank, position). A popped pair is stale if either symbol was
// merged away since, which shows as a different rank for the pair now there.
void Tokenizer::Impl::bpe_large(const char* s, size_t n, std::vector<int32_t>& out) const {
  std::vector<int32_t> ids(n), prev(n), next(n);
  for (size_t i = 0; i < n; ++i) {
    ids[i] = byte_id[static_cast<unsigned char>(s[i])];
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i) + 1 : -1;
  }
  using Cand = std::pair<int32_t, int32_t>;  // (rank, left position)
  std::vector<Cand> heap;
  auto push = [&](int32_t i) {
    if (i < 0 || next[i] < 0) return;
    if (const MergeTable::Entry* m = merges.find(ids[i], ids[next[i]])) {
      heap.emplace_back(m->rank, i);
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const auto [rank, i] = heap.back();
    heap.pop_back();
    if (ids[i] < 0 || next[i] < 0) continue;
    const MergeTable::Entry* m = merges.find(ids[i], ids[next[i]]);
    if (!m || m->rank != rank) continue;
    const int32_t j = next[i];
    ids[i] = m->merged;
    ids[j] = -1;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(ids[i]);
}

// ---------------------------------------------------------------------------
// Loading.
// ---------------------------------------------------------------------------

namespace {

const json& member(const json& obj, const char* key, const std::string& where) {
  DS_CHECK(obj.is_object(), "{}: {} must be a JSON object, got {}", where, where, obj.type_name());
  auto it = obj.find(key);
  DS_CHECK(it != obj.end(), "{}: missing \"{}\"", where, key);
  return *it;
}

const std::string& string_member(const json& obj, const char* key, const std::string& where) {
  const json& v = member(obj, key, where);
  DS_CHECK(v.is_string(), "{}: \"{}\" must be a string, got {}", where, key, v.type_name());
  return v.get_ref<const std::string&>();
}

// An optional boolean flag; `fallback` when absent or null.
bool bool_member(const json& obj, const char* key, bool fallback, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  DS_CHECK(it->is_boolean(), "{}: \"{}\" must be true or false, got {}", where, key, it->type_name());
  return it->get<bool>();
}

// An optional member that only the default value of is supported.
void expect_null_or_empty(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return;
  DS_CHECK(it->is_string() && it->get_ref<const std::string&>().empty(), "{}: \"{}\" = {} is not supported (only null)",
           where, key, it->dump());
}

json parse_json(std::string_view text, const std::string& origin) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    DS_FAIL("{}: not valid JSON: {}", origin, e.what());
  }
}

int32_t token_id(const json& v, const std::string& where) {
  DS_CHECK(v.is_number_integer(), "{}: token id must be an integer, got {}", where, v.dump());
  const int64_t id = v.get<int64_t>();
  DS_CHECK(id >= 0 && id < (int64_t{1} << 30), "{}: token id {} is out of range [0, 2^30)", where, id);
  return static_cast<int32_t>(id);
}

// The normalizer must do nothing: null, or a Sequence of no normalizers.
void check_normalizer(const json& n, const std::string& origin) {
  if (n.is_null()) return;
  const std::string where = origin + ": normalizer";
  const std::string& type = string_member(n, "type", where);
  DS_CHECK(type == "Sequence", "{}: normalizer type {} is not supported (only null or an empty Sequence)", origin,
           type);
  const json& list = member(n, "normalizers", where);
  DS_CHECK(list.is_array(), "{}: \"normalizers\" must be an array", where);
  for (const json& sub : list) check_normalizer(sub, origin);
}

// Post-processor: ByteLevel only adjusts offsets; anything that adds ids is
// not implemented. The decoder must be ByteLevel.
void check_post_processor_and_decoder(const json& root, const std::string& origin) {
  if (auto pp = root.find("post_processor"); pp != root.end() && !pp->is_null()) {
    const std::string& type = string_member(*pp, "type", origin + ": post_processor");
    DS_CHECK(type == "ByteLevel", "{}: post_processor type {} is not supported (only null or ByteLevel)", origin, type);
  }
  const json& dec = member(root, "decoder", origin);
  DS_CHECK(dec.is_object() && string_member(dec, "type", origin + ": decoder") == "ByteLevel",
           "{}: decoder must be ByteLevel, got {}", origin, dec.dump().substr(0, 200));
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  const std::string text = read_file(path, "tokenizer file");
  const auto config_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::string config;
  std::error_code ec;
  if (std::filesystem::is_regular_file(config_path, ec)) config = read_file(config_path.string(), "tokenizer config");
  return from_json(text, config, path);
}

// The model: BPE over the byte-level alphabet.
void Tokenizer::Impl::load_model(const json& model) {
  const std::string where = origin + ": model";
  if (auto ty = model.find("type"); ty != model.end())
    DS_CHECK(*ty == "BPE", "{}: model type {} is not supported (only BPE)", origin, ty->dump());
  if (auto d = model.find("dropout"); d != model.end() && !d->is_null())
    DS_CHECK(d->is_number() && d->get<double>() == 0.0, "{}: dropout {} is not supported", where, d->dump());
  expect_null_or_empty(model, "continuing_subword_prefix", where);
  expect_null_or_empty(model, "end_of_word_suffix", where);
  ignore_merges = bool_member(model, "ignore_merges", false, where);
  // unk_token, fuse_unk and byte_fallback only act on characters missing from
  // the vocabulary; load_vocab checks the byte-level alphabet complete.
  load_vocab(member(model, "vocab", where), where);
  load_merges(member(model, "merges", where), where);
}

void Tokenizer::Impl::load_vocab(const json& entries, const std::string& where) {
  DS_CHECK(entries.is_object(), "{}: \"vocab\" must be an object of token -> id, got {}", where, entries.type_name());
  int32_t size = 0;
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    const int32_t id = token_id(it.value(), fmt::format("{} vocab entry {}", where, json(it.key()).dump()));
    vocab.emplace(it.key(), id);
    size = std::max(size, id + 1);
  }
  const auto model_vocab_size = static_cast<int64_t>(vocab.size());
  {
    std::unordered_map<int32_t, const std::string*> by_id;
    by_id.reserve(vocab.size());
    for (const auto& [tok, id] : vocab) {
      auto [it, fresh] = by_id.emplace(id, &tok);
      DS_CHECK(fresh, "{}: id {} is given to two vocab entries ({} and {})", where, id, json(tok).dump(),
               json(*it->second).dump());
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string sym;
    append_utf8(sym, byte_cp[b]);
    auto it = vocab.find(sym);
    DS_CHECK(it != vocab.end(), "{}: vocab lacks the byte-level symbol {} of byte 0x{:02x}", where, json(sym).dump(),
             b);
    byte_id[b] = it->second;
  }
  // Ids are 0 .. N-1 for N entries, as every released tokenizer has them: an
  // id that names no token could be sampled and then not decoded, and a
  // single huge id would make the id tables huge.
  DS_CHECK(size == model_vocab_size, "{}: vocab ids must be 0 to {} (one per entry, no holes); the largest is {}",
           where, model_vocab_size - 1, size - 1);
  token_text.assign(size, {});
  known.assign(size, false);
  for (const auto& [tok, id] : vocab) {
    known[id] = true;
    token_text[id] = tok;
  }
}

void Tokenizer::Impl::load_merges(const json& list, const std::string& where) {
  DS_CHECK(list.is_array(), "{}: \"merges\" must be an array", where);
  merges.reserve(list.size());
  for (size_t r = 0; r < list.size(); ++r) {
    const json& m = list[r];
    std::string a, b;
    if (m.is_string()) {  // "a b"
      const auto& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      DS_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
               "{}: merge {} ({}) must be two tokens separated by one space", where, r, json(s).dump());
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else {  // ["a", "b"]
      DS_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
               "{}: merge {} must be \"a b\" or [\"a\", \"b\"], got {}", where, r, m.dump());
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    DS_CHECK(ia != vocab.end() && ib != vocab.end() && iab != vocab.end(),
             "{}: merge {} ({} + {}) uses a token missing from the vocab", where, r, json(a).dump(), json(b).dump());
    merges.insert(ia->second, ib->second, static_cast<int32_t>(r), iab->second);
  }
}

// Added tokens. Hugging Face re-derives each id when it loads the file (the
// vocab's id for a known string, else the next free id past the vocab); a
// file whose ids disagree would encode differently there, so it is rejected.
void Tokenizer::Impl::load_added_tokens(const json& root) {
  if (auto at = root.find("added_tokens"); at != root.end() && !at->is_null()) {
    DS_CHECK(at->is_array(), "{}: \"added_tokens\" must be an array", origin);
    const auto model_vocab_size = static_cast<int64_t>(vocab.size());
    int64_t max_added = -1;
    for (size_t k = 0; k < at->size(); ++k) {
      const json& a = (*at)[k];
      const std::string where = fmt::format("{}: added_tokens[{}]", origin, k);
      const int32_t id = token_id(member(a, "id", where), where);
      const std::string& content = string_member(a, "content", where);
      DS_CHECK(!content.empty(), "{}: empty content", where);
      check_utf8(content, where.c_str());
      for (const char* flag : {"single_word", "lstrip", "rstrip"})
        DS_CHECK(!bool_member(a, flag, false, where), "{}: {} = true is not supported", where, flag);
      const bool special = bool_member(a, "special", false, where);
      const bool normalized = bool_member(a, "normalized", !special, where);
      DS_CHECK(!added.count(content), "{}: content {} appears twice", where, json(content).dump());
      int64_t expected;
      if (auto v = vocab.find(content); v != vocab.end())
        expected = v->second;
      else if (max_added < 0)
        expected = model_vocab_size;
      else
        expected = max_added >= model_vocab_size || model_vocab_size == 0 ? max_added + 1 : model_vocab_size;
      DS_CHECK(id == expected,
               "{}: {} has id {} but Hugging Face would give it id {} (ids must follow the vocab in order)", where,
               json(content).dump(), id, expected);
      max_added = std::max<int64_t>(max_added, id);
      added.emplace(content, id);
      (normalized ? normalized_trie : raw_trie).add(content, id);
      if (id >= static_cast<int32_t>(token_text.size())) {
        token_text.resize(id + 1);
        known.resize(id + 1, false);
      }
      known[id] = true;
      token_text[id] = content;
      if (special) {
        is_special.resize(std::max<size_t>(is_special.size(), id + 1), false);
        is_special[id] = true;
      }
    }
  }
  is_special.resize(token_text.size(), false);
}

// The pre-tokenizer: Split* then ByteLevel.
void Tokenizer::Impl::load_pre_tokenizer(const json& pre) {
  std::vector<json> steps;
  DS_CHECK(pre.is_object(), "{}: pre_tokenizer must be an object, got {}", origin, pre.type_name());
  if (string_member(pre, "type", origin + ": pre_tokenizer") == "Sequence") {
    const json& list = member(pre, "pretokenizers", origin + ": pre_tokenizer");
    DS_CHECK(list.is_array(), "{}: \"pretokenizers\" must be an array", origin);
    steps.assign(list.begin(), list.end());
  } else {
    steps.push_back(pre);
  }
  bool byte_level = false;
  for (size_t k = 0; k < steps.size(); ++k) {
    const std::string where = fmt::format("{}: pre_tokenizer step {}", origin, k);
    const std::string& type = string_member(steps[k], "type", where);
    DS_CHECK(!byte_level, "{}: {} after ByteLevel is not supported (ByteLevel must come last)", where, type);
    if (type == "Split") {
      const json& pat = member(steps[k], "pattern", where);
      const std::string behavior = string_member(steps[k], "behavior", where);
      DS_CHECK(behavior == "Isolated", "{}: Split behavior {} is not supported (only Isolated)", where, behavior);
      DS_CHECK(!bool_member(steps[k], "invert", false, where), "{}: Split with invert = true is not supported", where);
      DS_CHECK(pat.is_object() && pat.size() == 1 && (pat.contains("Regex") || pat.contains("String")) &&
                   pat.begin()->is_string(),
               "{}: pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}, got {}", where, pat.dump());
      const std::string& p = pat.begin()->get_ref<const std::string&>();
      splits.push_back(std::make_unique<Regex>(pat.contains("Regex") ? p : quote_literal(p), where));
    } else if (type == "ByteLevel") {
      DS_CHECK(!bool_member(steps[k], "add_prefix_space", true, where),
               "{}: ByteLevel with add_prefix_space = true is not supported", where);
      if (bool_member(steps[k], "use_regex", true, where))
        splits.push_back(std::make_unique<Regex>(kGpt2Pattern, where));
      byte_level = true;
    } else {
      DS_FAIL("{}: pre-tokenizer type {} is not supported (only Split and ByteLevel)", where, type);
    }
  }
  DS_CHECK(byte_level, "{}: the pre_tokenizer must end with ByteLevel (byte-level BPE)", origin);
}

// BOS: tokenizer_config.json's bos_token when add_bos_token is set, else the
// DeepSeek convention.
void Tokenizer::Impl::load_bos(std::string_view config_json) {
  std::string bos_content = "<｜begin▁of▁sentence｜>";
  bool add_bos = true;
  if (!config_json.empty()) {
    const std::string where = origin + ": tokenizer_config.json";
    const json cfg = parse_json(config_json, where);
    DS_CHECK(cfg.is_object(), "{}: must be a JSON object", where);
    add_bos = bool_member(cfg, "add_bos_token", false, where);
    auto b = cfg.find("bos_token");
    if (b == cfg.end() || b->is_null()) {
      add_bos = false;
    } else if (b->is_string()) {
      bos_content = b->get<std::string>();
    } else {
      bos_content = string_member(*b, "content", where + " bos_token");
    }
    if (add_bos) {
      auto id = std::optional<int32_t>{};
      if (auto a = added.find(bos_content); a != added.end())
        id = a->second;
      else if (auto v = vocab.find(bos_content); v != vocab.end())
        id = v->second;
      DS_CHECK(id.has_value(), "{}: bos_token {} is not a token", where, json(bos_content).dump());
      bos = id;
    }
  } else if (auto a = added.find(bos_content); a != added.end()) {
    bos = a->second;
  }
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& origin) {
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.origin = origin;
  const json root = parse_json(tokenizer_json, origin);
  DS_CHECK(root.is_object(), "{}: top level must be a JSON object, got {}", origin, root.type_name());
  if (auto v = root.find("version"); v != root.end())
    DS_CHECK(*v == "1.0", "{}: unknown tokenizer.json version {}", origin, v->dump());
  for (const char* key : {"truncation", "padding"}) {
    auto v = root.find(key);
    DS_CHECK(v == root.end() || v->is_null(), "{}: \"{}\" is not supported (only null)", origin, key);
  }
  t.load_model(member(root, "model", origin));
  t.load_added_tokens(root);
  check_normalizer(root.contains("normalizer") ? root["normalizer"] : json(), origin);
  t.load_pre_tokenizer(member(root, "pre_tokenizer", origin));
  check_post_processor_and_decoder(root, origin);

  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[t.byte_cp[b]] = static_cast<uint8_t>(b);
  t.token_bytes.resize(t.token_text.size());
  for (size_t id = 0; id < t.token_text.size(); ++id)
    if (t.known[id]) t.token_bytes[id] = byte_level_decode(t.token_text[id], cp_to_byte);

  t.load_bos(config_json);
  return Tokenizer(std::move(impl));
}

// ---------------------------------------------------------------------------
// Encoding and decoding.
// ---------------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  check_utf8(text, "text to tokenize");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special_tokens && impl_->bos) out.push_back(*impl_->bos);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->encode_text(text.data(), text.size(), out);
  return out;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  check_utf8(text, "text to pre-tokenize");
  std::vector<std::string> pieces;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->split_words(text.data(), text.size(), 0, [&](const char* w, size_t len) {
    pieces.push_back(byte_level_encode(std::string_view(w, len), impl_->byte_cp));
  });
  return pieces;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  const auto n = static_cast<int32_t>(impl_->token_text.size());
  for (int32_t id : ids) {
    DS_CHECK(id >= 0 && id < n && impl_->known[id], "token id {} names no token (vocab size {})", id, n);
    if (skip_special_tokens && impl_->is_special[id]) continue;
    bytes += impl_->token_bytes[id];
  }
  return utf8_lossy(bytes);
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->token_text.size()); }

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }

const std::string& Tokenizer::id_to_token(int32_t id) const {
  DS_CHECK(id >= 0 && id < vocab_size() && impl_->known[id], "token id {} names no token (vocab size {})", id,
           vocab_size());
  return impl_->token_text[id];
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto a = impl_->added.find(token); a != impl_->added.end()) return a->second;
  if (auto v = impl_->vocab.find(token); v != impl_->vocab.end()) return v->second;
  return std::nullopt;
}

}  // namespace ds::io
