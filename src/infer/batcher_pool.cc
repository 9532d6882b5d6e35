// The batcher's cache pool (BatcherOptions::cache_memory) and its prefix
// cache (infer/prefix_cache.h): what every step checks before it runs.
#include <algorithm>
#include <exception>

#include "core/error.h"
#include "infer/batcher.h"
#include "infer/kv_cache.h"

namespace ds::infer {

namespace {

std::string mib(size_t bytes) {
  if (bytes < (1 << 20)) return fmt::format("{} bytes", bytes);
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

// The longest sequence whose cache fits the pool alone.
int64_t Batcher::pool_positions() const {
  const int64_t most = decoder_.max_positions();
  if (opt_.cache_memory == 0) return most;
  DS_CHECK(decoder_.bytes_for(1) <= opt_.cache_memory,
           "the cache pool ({}) cannot hold even a one-token sequence's cache ({}; caches grow in blocks of {} "
           "positions)",
           mib(opt_.cache_memory), mib(decoder_.bytes_for(1)), kCacheRowBlock);
  int64_t lo = 1, hi = most;  // bytes_for(lo) fits
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (decoder_.bytes_for(mid) <= opt_.cache_memory)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

size_t Batcher::pool_bytes() const {
  size_t b = prefixes_ ? prefixes_->bytes() : 0;
  for (size_t i = 0; i < slots_.size(); ++i) b += decoder_.sequence_bytes(static_cast<int64_t>(i));
  return b;
}

void Batcher::count_pool() {
  const uint64_t now = pool_bytes();
  counters_.pool_bytes.store(now, std::memory_order_relaxed);
  if (now > counters_.pool_peak.load(std::memory_order_relaxed))
    counters_.pool_peak.store(now, std::memory_order_relaxed);
  if (!prefixes_) return;
  counters_.prefix_entries.store(prefixes_->entries(), std::memory_order_relaxed);
  counters_.prefix_bytes.store(prefixes_->bytes(), std::memory_order_relaxed);
  counters_.prefix_evictions.store(prefixes_->evictions(), std::memory_order_relaxed);
}

// Slots about to read their prompt take the longest kept prefix of it, when
// the pool has room for the copy (kept prefixes other than it evicted first).
// A request for prompt log-probabilities reads every prompt token.
void Batcher::restore_prefixes() {
  if (!prefixes_) return;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (!s.live || s.following || s.looked_up || s.fed != 0 || s.req.prompt_logprobs) continue;
    s.looked_up = true;
    counters_.prefix_queries.fetch_add(1, std::memory_order_relaxed);
    counters_.prefix_query_tokens.fetch_add(s.req.prompt.size(), std::memory_order_relaxed);
    const PrefixCache::Match m = prefixes_->find(s.req.prompt, decoder_);
    if (!m.snapshot) continue;
    const size_t need = decoder_.bytes_for(m.length);
    while (pool_bytes() + need > opt_.cache_memory && prefixes_->evict(m.snapshot.get())) {
    }
    if (pool_bytes() + need > opt_.cache_memory) continue;
    try {
      decoder_.restore(static_cast<int64_t>(i), *m.snapshot, m.length);
    } catch (const Error&) {
      decoder_.reset(static_cast<int64_t>(i));
      continue;
    }
    s.fed = static_cast<size_t>(m.length);
    // Speculative decoding: the MTP layer reads the positions it had not,
    // with the tokens that follow them, at the next step.
    if (opt_.draft_tokens > 0)
      s.pending.assign(s.req.prompt.begin() + decoder_.drafted(static_cast<int64_t>(i)) + 1,
                       s.req.prompt.begin() + m.length + 1);
    counters_.prefix_hits.fetch_add(1, std::memory_order_relaxed);
    counters_.prefix_hit_tokens.fetch_add(static_cast<uint64_t>(m.length), std::memory_order_relaxed);
  }
  count_pool();
}

// Sequence i's cache goes to make room: it reads its tokens again later
// (its prompt, then the tokens it has handed out but the last, which it
// feeds as usual).
void Batcher::stop_for_room(size_t i) {
  Slot& s = slots_[i];
  decoder_.reset(static_cast<int64_t>(i));
  counters_.preemptions.fetch_add(1, std::memory_order_relaxed);
  s.pending.clear();
  s.fed = 0;
  s.looked_up = false;
  if (s.made == 0) {
    if (s.req.prompt_logprobs) s.prompt_lps.assign(1, TokenLogprob{});
    return;
  }
  s.req.prompt.resize(s.prompt0);
  s.req.prompt.insert(s.req.prompt.end(), s.out.begin(), s.out.end() - 1);
  s.replaying = true;
}

// Leaves slots out of the next step until what it will hold fits the pool:
// kept prefixes go first (least recently used), then the youngest
// sequences' caches. The oldest sequence alone always fits (max_positions()
// is what the pool holds); if it does not, it fails rather than pass the
// bound. False: nothing runs.
bool Batcher::fit_pool() {
  if (opt_.cache_memory == 0) return true;
  for (auto& s : slots_) s.held = false;
  for (;;) {
    bool all_rows = false;
    const auto tokens = plan_step(&all_rows);
    size_t total = prefixes_ ? prefixes_->bytes() : 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const int64_t n = static_cast<int64_t>(tokens[i].size()), si = static_cast<int64_t>(i);
      total += n > 0 ? decoder_.bytes_after(si, n) : decoder_.sequence_bytes(si);
    }
    if (total <= opt_.cache_memory)
      return std::any_of(tokens.begin(), tokens.end(), [](const auto& t) { return !t.empty(); });
    if (prefixes_ && prefixes_->evict()) continue;
    // The youngest slot that holds memory or would take some.
    size_t victim = slots_.size(), running = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (!s.live || s.following || s.held) continue;
      if (tokens[i].empty() && decoder_.sequence_bytes(static_cast<int64_t>(i)) == 0) continue;
      ++running;
      if (victim == slots_.size() || s.order > slots_[victim].order) victim = i;
    }
    if (victim == slots_.size()) return false;
    if (running == 1) {
      free_slot(victim, Finish::Failed,
                fmt::format("the cache pool ({}) cannot hold this sequence's next step", mib(opt_.cache_memory)));
      continue;
    }
    if (decoder_.sequence_bytes(static_cast<int64_t>(victim)) > 0) stop_for_room(victim);
    slots_[victim].held = true;
  }
}

// A finished request's cache, kept for later requests with the same start
// (not a failed step's, whose state is unknown; nor one that holds drafts
// past the tokens handed out).
void Batcher::keep_prefix(size_t i, Finish f) {
  Slot& s = slots_[i];
  const int64_t si = static_cast<int64_t>(i);
  if (!prefixes_ || f == Finish::Failed || s.following || decoder_.length(si) == 0) return;
  std::vector<int32_t> tokens(s.req.prompt.begin(), s.req.prompt.begin() + static_cast<std::ptrdiff_t>(s.prompt0));
  tokens.insert(tokens.end(), s.out.begin(), s.out.end());
  if (static_cast<int64_t>(tokens.size()) < decoder_.length(si)) return;
  std::shared_ptr<const CacheSnapshot> snap;
  try {
    snap = decoder_.take_snapshot(si);
  } catch (const Error&) {
    return;
  }
  if (!snap) return;
  prefixes_->insert(std::move(tokens), std::move(snap), decoder_);
  while (pool_bytes() > opt_.cache_memory && prefixes_->evict()) {
  }
}

void render_pool_metrics(std::string& out, const BatcherCounters& k) {
  auto g = [&](const char* name, const char* type, const char* help, const std::atomic<uint64_t>& v) {
    metrics::scalar(out, name, type, help, static_cast<double>(v.load(std::memory_order_relaxed)));
  };
  g("deepseek_cache_pool_limit_bytes", "gauge", "The cache pool's bound (--cache-memory; 0: none).", k.pool_limit);
  g("deepseek_cache_pool_bytes", "gauge", "Bytes the sequences' caches and the kept prefixes hold after the last step.",
    k.pool_bytes);
  g("deepseek_cache_pool_peak_bytes", "gauge", "The most the cache pool has held.", k.pool_peak);
  g("deepseek_preemptions_total", "counter", "Sequences whose caches went to make room; each read its tokens again.",
    k.preemptions);
  g("deepseek_prefix_cache_queries_total", "counter", "Requests that looked for a kept prefix of their prompt.",
    k.prefix_queries);
  g("deepseek_prefix_cache_query_tokens_total", "counter", "Prompt tokens of those requests.", k.prefix_query_tokens);
  g("deepseek_prefix_cache_hits_total", "counter", "Requests that found a kept prefix.", k.prefix_hits);
  g("deepseek_prefix_cache_hit_tokens_total", "counter", "Prompt tokens taken from kept prefixes rather than read.",
    k.prefix_hit_tokens);
  g("deepseek_prefix_cache_entries", "gauge", "Prefixes kept.", k.prefix_entries);
  g("deepseek_prefix_cache_bytes", "gauge", "Bytes the kept prefixes hold.", k.prefix_bytes);
  g("deepseek_prefix_cache_evictions_total", "counter", "Kept prefixes evicted for room.", k.prefix_evictions);
}

}  // namespace ds::infer
