#include "infer/prefix_cache.h"

#include <algorithm>

namespace ds::infer {

namespace {

// Tokens a and b share from the start.
int64_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return static_cast<int64_t>(ia - a.begin());
}

}  // namespace

PrefixCache::Match PrefixCache::find(const std::vector<int32_t>& prompt, const Decoder& decoder) {
  const int64_t most = static_cast<int64_t>(prompt.size()) - 1;
  auto best = entries_.end();
  int64_t best_len = 0;
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    const int64_t shared = std::min(common_prefix(prompt, it->tokens), most);
    if (shared <= best_len) continue;
    const int64_t m = decoder.restorable(*it->snapshot, shared);
    if (m > best_len) {
      best = it;
      best_len = m;
    }
  }
  if (best == entries_.end()) return {};
  entries_.splice(entries_.begin(), entries_, best);
  return {entries_.front().snapshot, best_len};
}

void PrefixCache::insert(std::vector<int32_t> tokens, std::shared_ptr<const CacheSnapshot> snapshot,
                         const Decoder& decoder) {
  const int64_t n = snapshot->length();
  tokens.resize(static_cast<size_t>(n));
  for (auto it = entries_.begin(); it != entries_.end();) {
    const int64_t held = it->snapshot->length(), shared = common_prefix(tokens, it->tokens);
    // An entry that holds all of these tokens and can give them.
    if (shared == n && held >= n && decoder.restorable(*it->snapshot, n) == n) {
      entries_.splice(entries_.begin(), entries_, it);
      return;
    }
    // An entry the new one holds and can give.
    if (shared == held && decoder.restorable(*snapshot, held) == held) {
      bytes_ -= it->snapshot->bytes();
      it = entries_.erase(it);
      continue;
    }
    ++it;
  }
  bytes_ += snapshot->bytes();
  entries_.push_front({std::move(tokens), std::move(snapshot)});
}

bool PrefixCache::evict(const CacheSnapshot* keep) {
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    if (it->snapshot.get() == keep) continue;
    bytes_ -= it->snapshot->bytes();
    entries_.erase(std::next(it).base());
    ++evictions_;
    return true;
  }
  return false;
}

}  // namespace ds::infer
