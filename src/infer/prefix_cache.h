// Automatic prefix caching: the caches of finished requests, kept so that a
// later request that starts with the same tokens (the next turn of a chat,
// which resends the conversation; many requests with one system prompt)
// reads only the tokens after the longest kept prefix.
//
// An entry is a sequence's whole cache (Decoder::take_snapshot) with the
// tokens it holds. A request copies the first m positions of the entry that
// shares the most tokens with its prompt into its own sequence (m at most
// the prompt's length less one: the last prompt token is always read, for
// the logits of the first new token). An entry whose tokens begin another
// entry's, and which that entry can stand in for, is dropped. Entries are
// evicted least recently used when the batcher's cache pool needs room.
//
// Not thread-safe: the batcher's thread owns it.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <vector>

#include "infer/generate.h"

namespace ds::infer {

class PrefixCache {
 public:
  struct Match {
    std::shared_ptr<const CacheSnapshot> snapshot;  // null: no match
    int64_t length = 0;                             // positions to restore
  };
  // The longest prefix of `prompt` (at most its length less one) that an
  // entry holds and `decoder` can restore; marks that entry used.
  Match find(const std::vector<int32_t>& prompt, const Decoder& decoder);
  // Keeps `snapshot` (holding the first snapshot->length() of `tokens`).
  // Entries it stands in for go; if an entry already stands in for it,
  // that one is marked used instead.
  void insert(std::vector<int32_t> tokens, std::shared_ptr<const CacheSnapshot> snapshot, const Decoder& decoder);
  // Drops the least recently used entry other than `keep`; false when
  // there is none.
  bool evict(const CacheSnapshot* keep = nullptr);

  size_t bytes() const { return bytes_; }
  size_t entries() const { return entries_.size(); }
  uint64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    std::vector<int32_t> tokens;  // snapshot->length() of them
    std::shared_ptr<const CacheSnapshot> snapshot;
  };
  std::list<Entry> entries_;  // most recently used first
  size_t bytes_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace ds::infer
