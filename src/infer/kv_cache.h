// KV caches for generation.
//
// Latent (the default, as DeepSeek serves MLA): per layer and token only the
// normalised latent c_kv [kv_lora_rank] and the rotated shared key k_pe
// [qk_rope_head_dim]; attention runs in the latent space (W_UK folded into the
// query, W_UV applied after). Naive: the expanded per-head K [heads, qk_head]
// and V [heads, v_head], the plain formulation, kept as the oracle the latent
// path is checked against.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"

namespace ds::infer {

enum class CacheKind { Latent, Naive };

struct SequenceCache {
  // Empty, with a row list per layer.
  explicit SequenceCache(int64_t num_layers)
      : c_kv(num_layers),
        k_pe(num_layers),
        k(num_layers),
        v(num_layers),
        index_k(num_layers),
        index_scale(num_layers),
        engram(num_layers) {}

  int64_t length = 0;        // tokens cached
  int64_t draft_length = 0;  // positions the MTP layer (the last layer of a drafting cache) has cached
  // Per layer, rows appended as tokens arrive.
  std::vector<std::vector<float>> c_kv, k_pe;  // latent: [T, kv_lora_rank], [T, qk_rope_head_dim]
  std::vector<std::vector<float>> k, v;        // naive: [T, heads, qk_head_dim], [T, heads, v_head_dim]
  // DeepSeek-V3.2 (either kind): the indexer's keys, e4m3 codes [T,
  // index_head_dim] and their scales [T, ceil(index_head_dim / 128)].
  std::vector<std::vector<uint8_t>> index_k;
  std::vector<std::vector<float>> index_scale;
  // Engram layers: the tokens so far (the n-grams' look-back) and, per
  // layer, its conv's input rows [length - engram_first, G D] of positions
  // engram_first.. (the engine drops the oldest once they are more than the
  // conv's look-back needs, keeping some for a draft's rollback).
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> engram;
  int64_t engram_first = 0;
};

// f(rows) for each per-layer row list of one position per row: the latent
// and naive caches and V3.2's indexer keys and scales.
template <class F>
void for_each_row_list(SequenceCache& s, F f) {
  f(s.c_kv);
  f(s.k_pe);
  f(s.k);
  f(s.v);
  f(s.index_k);
  f(s.index_scale);
}

// Keeps the first `length` tokens of the layers below `layers` (a rejected
// draft's rows go; the MTP layer's own rows, if any, stay).
inline void truncate(SequenceCache& s, int64_t length, int64_t layers) {
  if (length >= s.length) return;
  for_each_row_list(s, [&](auto& rows) {
    for (int64_t l = 0; l < layers && l < static_cast<int64_t>(rows.size()); ++l)
      if (!rows[l].empty())
        rows[l].resize(rows[l].size() / static_cast<size_t>(s.length) * static_cast<size_t>(length));
  });
  // Engram's rows start at engram_first: the conv still needs the rows
  // before the new length, so they must not have been dropped.
  for (int64_t l = 0; l < layers && l < static_cast<int64_t>(s.engram.size()); ++l) {
    auto& rows = s.engram[l];
    if (rows.empty()) continue;
    const size_t width = rows.size() / static_cast<size_t>(s.length - s.engram_first);
    if (length < s.engram_first) throw Error("truncate: Engram's rows before the new length were already dropped");
    rows.resize(width * static_cast<size_t>(length - s.engram_first));
  }
  if (s.tokens.size() > static_cast<size_t>(length)) s.tokens.resize(static_cast<size_t>(length));
  s.length = length;
}

// Keeps the first `length` of the `rows` positions of one layer (the MTP
// layer's chained drafts go; its cache holds draft_length positions).
inline void truncate_layer(SequenceCache& s, int64_t layer, int64_t rows, int64_t length) {
  if (length >= rows) return;
  for_each_row_list(s, [&](auto& per_layer) {
    auto& r = per_layer[static_cast<size_t>(layer)];
    if (!r.empty()) r.resize(r.size() / static_cast<size_t>(rows) * static_cast<size_t>(length));
  });
}

// Positions a sequence's row buffers grow by at least (the cache pool's
// unit): capacities are whole multiples of it.
inline constexpr int64_t kCacheRowBlock = 64;

// Elements per position and layer of each row list (0: the list is unused),
// in for_each_row_list's order.
struct RowWidths {
  int64_t c_kv = 0, k_pe = 0, k = 0, v = 0, index_k = 0, index_scale = 0;
  // Bytes of one position over `layers` layers.
  size_t bytes(int64_t layers) const {
    return static_cast<size_t>(layers) *
           (static_cast<size_t>(c_kv + k_pe + k + v + index_scale) * sizeof(float) + static_cast<size_t>(index_k));
  }
};

// The positions a row buffer holding `cap` positions is grown to so that it
// holds `need`: by a quarter at least (a long sequence is copied a bounded
// number of times), in whole blocks, never past `limit` positions unless
// `need` itself is (limit rounded up to a block).
inline int64_t grown_rows(int64_t cap, int64_t need, int64_t limit) {
  if (need <= cap) return cap;
  auto round_up = [](int64_t n) { return (n + kCacheRowBlock - 1) / kCacheRowBlock * kCacheRowBlock; };
  const int64_t want = round_up(std::max(need, cap + cap / 4));
  return std::max(round_up(need), std::min(want, round_up(limit)));
}

// Bytes the row buffers of s have allocated (capacities), and its other
// buffers (Engram's rows and tokens).
inline size_t allocated_bytes(const SequenceCache& s) {
  size_t n = 0;
  for (size_t l = 0; l < s.c_kv.size(); ++l)
    n += (s.c_kv[l].capacity() + s.k_pe[l].capacity() + s.k[l].capacity() + s.v[l].capacity() +
          s.index_scale[l].capacity() + s.engram[l].capacity()) *
             sizeof(float) +
         s.index_k[l].capacity();
  return n + s.tokens.capacity() * sizeof(int32_t);
}

struct KvCache {
  CacheKind kind = CacheKind::Latent;
  std::vector<SequenceCache> seqs;

  KvCache(CacheKind k, int64_t num_sequences, int64_t num_layers)
      : kind(k), seqs(num_sequences, SequenceCache(num_layers)) {}
  // Bytes of cached activations.
  size_t bytes() const {
    size_t n = 0;
    for (const auto& s : seqs)
      for (size_t l = 0; l < s.c_kv.size(); ++l)
        n += (s.c_kv[l].size() + s.k_pe[l].size() + s.k[l].size() + s.v[l].size() + s.index_scale[l].size() +
              s.engram[l].size()) *
                 sizeof(float) +
             s.index_k[l].size();
    return n;
  }
};

}  // namespace ds::infer
