#include "model/engram_hash.h"

#include <set>

#include "core/error.h"
#include "core/numpy_rng.h"

namespace ds::model {

bool is_prime(int64_t n) {
  if (n < 4) return n >= 2;
  if (n % 2 == 0 || n % 3 == 0) return false;
  for (int64_t d = 5; d <= n / d; d += 6)  // 6k - 1 and 6k + 1
    if (n % d == 0 || n % (d + 2) == 0) return false;
  return true;
}

std::vector<EngramLayerHash> engram_hash_tables(const EngramHashSpec& s) {
  const int64_t N = s.max_ngram, H = s.heads;
  DS_CHECK(N >= 2, "engram: engram_max_ngram_size must be >= 2, got {}", N);
  DS_CHECK(H >= 1, "engram: engram_num_heads must be positive, got {}", H);
  DS_CHECK(static_cast<int64_t>(s.vocab_bases.size()) == N - 1,
           "engram: engram_vocab_bases needs {} entries (one per n-gram order 2..{}), got {}", N - 1, N,
           s.vocab_bases.size());
  DS_CHECK(s.compressed_vocab >= 1, "engram: the compressed vocabulary must be positive, got {}", s.compressed_vocab);
  DS_CHECK(s.seed >= 0, "engram: engram_seed must be non-negative, got {}", s.seed);
  const int64_t limit = s.scheme == EngramHashScheme::Int32 ? INT32_MAX : INT64_MAX;
  const int64_t bound = std::max<int64_t>(1, (limit / s.compressed_vocab) / 2);
  std::set<int64_t> seen;
  std::vector<EngramLayerHash> out;
  for (int64_t layer : s.layers) {
    EngramLayerHash t;
    NumpyPcg64 rng(static_cast<uint64_t>(s.seed + 10007 * layer));
    if (s.scheme == EngramHashScheme::Int32) {
      for (int32_t r : rng.integers_i32(static_cast<int32_t>(bound), N)) t.multipliers.push_back(2 * int64_t{r} + 1);
    } else {
      for (int64_t r : rng.integers_i64(bound, N)) t.multipliers.push_back(2 * r + 1);
    }
    for (int64_t n = 0; n < N - 1; ++n) {
      DS_CHECK(s.vocab_bases[n] >= 1 && s.vocab_bases[n] <= (int64_t{1} << 40),
               "engram: engram_vocab_bases[{}] = {} outside [1, 2^40]", n, s.vocab_bases[n]);
      int64_t start = s.vocab_bases[n] - 1;
      for (int64_t h = 0; h < H; ++h) {
        int64_t p = start + 1;
        while (!is_prime(p) || seen.count(p)) ++p;
        seen.insert(p);
        t.primes.push_back(p);
        start = p;
      }
    }
    for (int64_t p : t.primes) {
      t.offsets.push_back(t.rows);
      t.rows += p;
    }
    DS_CHECK(t.rows < INT32_MAX, "engram: layer {}'s table would have {} rows, above 2^31 - 1", layer, t.rows);
    out.push_back(std::move(t));
  }
  return out;
}

void engram_hash_ids(int32_t* ids, const int32_t* c, int64_t rows, int64_t seq, const int32_t* history, int32_t pad,
                     const EngramLayerHash& t, int64_t N, int64_t H) {
  const int64_t C = (N - 1) * H;
  for (int64_t b = 0; b < rows; ++b) {
    const int32_t* row = c + b * seq;
    const int32_t* hist = history ? history + b * (N - 1) : nullptr;
    for (int64_t i = 0; i < seq; ++i) {
      // s_j: j tokens back; before the row, the history (its last entry is
      // the token just before), before that pad.
      bool blocked = false;  // sticky: once a look-back is blocked, every longer one is
      auto back = [&](int64_t j) -> int64_t {
        const int64_t k = i - j;
        int64_t v = kEngramDead;
        if (k >= 0)
          v = row[k];
        else if (hist && k >= -(N - 1))
          v = hist[N - 1 + k];
        blocked = blocked || v == kEngramDead;
        return blocked ? pad : v;
      };
      int64_t acc = back(0) * t.multipliers[0];
      int32_t* out = ids + (b * seq + i) * C;
      for (int64_t n = 1; n < N; ++n) {
        acc ^= back(n) * t.multipliers[n];
        for (int64_t h = 0; h < H; ++h) {
          const int64_t col = (n - 1) * H + h;
          out[col] = static_cast<int32_t>(t.offsets[col] + acc % t.primes[col]);
        }
      }
    }
  }
}

}  // namespace ds::model
