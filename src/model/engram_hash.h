// Engram's integer preprocessing: the hashed n-gram ids a layer looks up.
//
// For every Engram layer, tables of primes (one per hash column: N - 1
// n-gram orders times H heads) and N odd multipliers, derived once from the
// config exactly as MaxText and DeepSeek derive them:
//   primes  one set of used primes shared by all layers; for each layer (in
//           engram_layers order) and order n = 2..N, H times the smallest
//           unused prime above start (start = the order's base - 1, then the
//           prime just taken);
//   offsets each column's first row in the layer's table: the exclusive
//           prefix sum of the layer's primes;
//   multipliers numpy's default_rng(seed + 10007 layer).integers(0, bound, N)
//           * 2 + 1, bound = max(1, floor(floor(limit / V') / 2)), with
//           limit 2^31 - 1 (MaxText's int32 scheme) or 2^63 - 1 (DeepSeek's
//           int64 scheme), V' the compressed vocabulary.
// The id of column (n - 2) H + h at position t, with s_j = c[t - j] (the
// compressed token j back, pad' before the row's start), is
//   acc_n = (s_0 m_0) xor (s_1 m_1) xor ... xor (s_{n-1} m_{n-1})
//   id    = offset + acc_n mod prime          (the hashes are cumulative)
// Every product stays below 2^63, so int64 arithmetic is exact for both
// schemes (and equals int32's for MaxText's).
#pragma once

#include <cstdint>
#include <vector>

namespace ds::model {

enum class EngramHashScheme { Int32, Int64 };

struct EngramHashSpec {
  std::vector<int64_t> layers;       // decoder layers with Engram, in order
  int64_t max_ngram = 3;             // N: 2-grams .. N-grams
  int64_t heads = 8;                 // H per order
  std::vector<int64_t> vocab_bases;  // N - 1 prime-search bases, one per order
  int64_t seed = 0;
  int64_t compressed_vocab = 0;  // V'
  EngramHashScheme scheme = EngramHashScheme::Int32;
};

struct EngramLayerHash {
  std::vector<int64_t> multipliers;  // [N]
  std::vector<int64_t> primes;       // [(N - 1) H], column (n - 2) H + h
  std::vector<int64_t> offsets;      // [(N - 1) H]
  int64_t rows = 0;                  // the table's rows: the primes' sum
};

// The tables of every layer of spec.layers (same order). ds::Error on an
// impossible spec.
std::vector<EngramLayerHash> engram_hash_tables(const EngramHashSpec& spec);

// Row ids [rows, seq, (N - 1) H] for `rows` sequences of `seq` compressed
// tokens c (each in [0, V')); `history` holds the N - 1 compressed tokens
// before each row's first (oldest first, [rows, N - 1]; null: every row
// starts its sequence, so earlier positions read pad).
//
// kEngramDead (DeepSeek-V4.1's image positions) blocks the look-back: an
// n-gram that reaches a dead position reads pad there and at every position
// further back (the block is sticky), as the start of a sequence does.
inline constexpr int32_t kEngramDead = -1;
void engram_hash_ids(int32_t* ids, const int32_t* c, int64_t rows, int64_t seq, const int32_t* history, int32_t pad,
                     const EngramLayerHash& t, int64_t max_ngram, int64_t heads);

// Whether n is prime (n < 2^62).
bool is_prime(int64_t n);

}  // namespace ds::model
