// Tokenized corpora on disk, as `deepseek prepare` writes them and the
// `tokens` training dataset reads them.
//
// A corpus is a directory:
//   train-00000.tok, train-00001.tok, ...   the training split
//   eval-00000.tok, ...                     the held-out split (may be absent)
//   meta.json                               written last: a directory without
//                                           it is incomplete and is refused
// meta.json:
//   {"format": "deepseek.cpp token shards", "version": 1, "token_dtype": "uint32",
//    "vocab_size": V, "bos_id": id | null, "eos_id": id | null,
//    "tokenizer": "path/of/tokenizer.json",
//    "splits": {"train": {"documents": D, "tokens": T,
//                         "shards": [{"file": "train-00000.tok", "documents": d, "tokens": t}, ...]},
//               "eval": {...}}}
//
// A shard (all integers little-endian):
//   offset 0   8 bytes   magic "DSTOKEN1"
//          8   uint32    format version (1)
//         12   uint32    token dtype (1: uint32)
//         16   uint64    document count D
//         24   uint64    token count T
//         32   uint64    document offsets o[0..D] (o[0] = 0, non-decreasing, o[D] = T)
//   32+8(D+1)  uint32    tokens t[0..T); document i is t[o[i] .. o[i+1])
// so a shard is exactly 32 + 8 (D + 1) + 4 T bytes. The token array starts at
// a multiple of 8, so the mapped file is read in place.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ds::io {

inline constexpr char kTokenShardMagic[8] = {'D', 'S', 'T', 'O', 'K', 'E', 'N', '1'};
inline constexpr uint32_t kTokenShardVersion = 1;
inline constexpr uint32_t kTokenDtypeUint32 = 1;
inline constexpr uint64_t kTokenShardHeaderBytes = 32;
inline constexpr int kTokenCorpusVersion = 1;
inline constexpr const char* kTokenCorpusFormat = "deepseek.cpp token shards";

// The file name of shard `index` of a split: "train-00003.tok".
std::string token_shard_name(const std::string& split, int64_t index);

// Writes one shard atomically (temporary file, fsync, rename). `offsets` has
// one more entry than there are documents, starts at 0, never decreases and
// ends at tokens.size(); ds::Error otherwise.
void write_token_shard(const std::string& path, std::span<const uint64_t> offsets, std::span<const uint32_t> tokens);

// A shard mapped read-only and validated: header, exact file size, offsets,
// and (when vocab_limit > 0) every id below vocab_limit. Each problem is one
// ds::Error naming the file.
class TokenShard {
 public:
  static TokenShard open(const std::string& path, int64_t vocab_limit = 0);

  const std::string& path() const { return path_; }
  uint64_t num_documents() const { return num_docs_; }
  uint64_t num_tokens() const { return num_tokens_; }
  std::span<const uint64_t> offsets() const { return {offsets_, num_docs_ + 1}; }
  std::span<const uint32_t> tokens() const { return {tokens_, num_tokens_}; }
  std::span<const uint32_t> document(uint64_t i) const;

 private:
  std::string path_;
  std::shared_ptr<void> mapping_;
  uint64_t num_docs_ = 0, num_tokens_ = 0;
  const uint64_t* offsets_ = nullptr;
  const uint32_t* tokens_ = nullptr;
};

struct TokenShardInfo {
  std::string file;  // relative to the corpus directory
  uint64_t documents = 0, tokens = 0;
};

struct TokenSplitInfo {
  uint64_t documents = 0, tokens = 0;
  std::vector<TokenShardInfo> shards;
};

// meta.json.
struct TokenCorpusMeta {
  int version = kTokenCorpusVersion;
  int64_t vocab_size = 0;
  std::optional<int32_t> bos_id, eos_id;
  std::string tokenizer;
  TokenSplitInfo train, eval;

  nlohmann::json to_json() const;
  // Validates types, counts (a split's totals equal the sum over its shards)
  // and shard names; `origin` names the file in errors.
  static TokenCorpusMeta from_json(const nlohmann::json& j, const std::string& origin);
  // Reads DIR/meta.json; a missing one is an error saying the directory is
  // not (or not yet completely) a prepared corpus.
  static TokenCorpusMeta read(const std::string& dir);
  const TokenSplitInfo& split(const std::string& name) const;
};

// Writes a corpus directory document by document. Shards of a split are cut
// when the next document would take the shard past `shard_tokens` tokens (a
// longer document gets a shard of its own). Any meta.json already in the
// directory is removed first, so the directory reads as incomplete until
// finish() writes the new one; finish() also removes shard files of an
// earlier run that the new meta.json does not list.
class TokenCorpusWriter {
 public:
  TokenCorpusWriter(const std::string& dir, uint64_t shard_tokens, int64_t vocab_size);
  // `split` is "train" or "eval"; ids must lie in [0, vocab_size).
  void add(const std::string& split, std::span<const int32_t> document);
  // Flushes the open shards and writes meta.json (the other fields of `meta`
  // are taken as given; the splits are filled in here). Returns the result.
  TokenCorpusMeta finish(TokenCorpusMeta meta);

 private:
  struct Pending {
    std::string name;
    TokenSplitInfo info;
    std::vector<uint64_t> offsets{0};
    std::vector<uint32_t> tokens;
  };
  Pending& pending(const std::string& split);
  void flush(Pending& p);

  std::string dir_;
  uint64_t shard_tokens_;
  int64_t vocab_size_;
  Pending train_, eval_;
  bool finished_ = false;
};

// One split of a corpus: its shards opened and checked against meta.json,
// and its documents numbered 0..num_documents() across the shards in order.
class TokenSplit {
 public:
  // ds::Error for a missing or inconsistent directory, a shard that fails
  // TokenShard::open, or counts that differ from meta.json. Ids are checked
  // against the tokenizer's vocab_size from meta.json and, when
  // vocab_limit > 0, against vocab_limit too.
  static TokenSplit open(const std::string& dir, const std::string& split, int64_t vocab_limit = 0);

  const TokenCorpusMeta& meta() const { return meta_; }
  uint64_t num_documents() const { return starts_.back(); }
  uint64_t num_tokens() const { return num_tokens_; }
  std::span<const uint32_t> document(uint64_t i) const;

 private:
  TokenCorpusMeta meta_;
  std::vector<TokenShard> shards_;
  std::vector<uint64_t> starts_{0};  // first global document index of each shard, then the total
  uint64_t num_tokens_ = 0;
};

}  // namespace ds::io
