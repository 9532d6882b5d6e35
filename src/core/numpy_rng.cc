#include "core/numpy_rng.h"

#include <array>

#include "core/error.h"

namespace ds {
namespace {

// SeedSequence(seed).generate_state(4, uint64): numpy's hash mixing of the
// seed's 32-bit words into a pool of four, then four 64-bit words out.
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875, kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;
constexpr uint32_t kMixL = 0xca01f9dd, kMixR = 0x4973f715;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> 16;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixL * x - kMixR * y;
  return r ^ (r >> 16);
}

std::array<uint64_t, 4> seed_sequence_state(uint64_t seed) {
  std::vector<uint32_t> entropy;  // little-endian 32-bit words; 0 is one zero word
  do {
    entropy.push_back(static_cast<uint32_t>(seed));
    seed >>= 32;
  } while (seed != 0);
  std::array<uint32_t, 4> pool{};
  uint32_t hc = kInitA;
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = hashmix(i < entropy.size() ? entropy[i] : 0u, hc);
  for (size_t src = 0; src < pool.size(); ++src)
    for (size_t dst = 0; dst < pool.size(); ++dst)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hc));
  for (size_t src = pool.size(); src < entropy.size(); ++src)
    for (size_t dst = 0; dst < pool.size(); ++dst) pool[dst] = mix(pool[dst], hashmix(entropy[src], hc));
  uint32_t hb = kInitB;
  std::array<uint32_t, 8> words{};
  for (size_t i = 0; i < words.size(); ++i) {
    uint32_t v = pool[i % pool.size()];
    v ^= hb;
    hb *= kMultB;
    v *= hb;
    v ^= v >> 16;
    words[i] = v;
  }
  std::array<uint64_t, 4> out{};
  for (size_t i = 0; i < out.size(); ++i) out[i] = words[2 * i] | (static_cast<uint64_t>(words[2 * i + 1]) << 32);
  return out;
}

constexpr unsigned __int128 kPcgMult =
    (static_cast<unsigned __int128>(0x2360ED051FC65DA4ULL) << 64) | 0x4385DF649FCCF645ULL;

}  // namespace

NumpyPcg64::NumpyPcg64(uint64_t seed) {
  const auto s = seed_sequence_state(seed);
  const unsigned __int128 initstate = (static_cast<unsigned __int128>(s[0]) << 64) | s[1];
  const unsigned __int128 initseq = (static_cast<unsigned __int128>(s[2]) << 64) | s[3];
  inc_ = (initseq << 1) | 1u;
  state_ = inc_;  // 0 * mult + inc
  state_ += initstate;
  state_ = state_ * kPcgMult + inc_;
}

uint64_t NumpyPcg64::next_u64() {
  state_ = state_ * kPcgMult + inc_;
  const uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (x >> rot) | (x << ((64u - rot) & 63u));
}

uint32_t NumpyPcg64::next_u32() {
  if (has_u32_) {
    has_u32_ = false;
    return u32_;
  }
  const uint64_t v = next_u64();
  has_u32_ = true;
  u32_ = static_cast<uint32_t>(v >> 32);
  return static_cast<uint32_t>(v);
}

uint32_t NumpyPcg64::bounded_u32(uint32_t rng) {
  // numpy's buffered_bounded_lemire_uint32 for the inclusive range [0, rng].
  if (rng == 0) return 0;
  if (rng == 0xFFFFFFFFu) return next_u32();
  const uint32_t excl = rng + 1u;
  uint64_t m = static_cast<uint64_t>(next_u32()) * excl;
  uint32_t left = static_cast<uint32_t>(m);
  if (left < excl) {
    const uint32_t threshold = (UINT32_MAX - rng) % excl;
    while (left < threshold) {
      m = static_cast<uint64_t>(next_u32()) * excl;
      left = static_cast<uint32_t>(m);
    }
  }
  return static_cast<uint32_t>(m >> 32);
}

std::vector<int32_t> NumpyPcg64::integers_i32(int32_t high, int64_t n) {
  DS_CHECK(high > 0 && n >= 0, "integers_i32: high {} must be positive", high);
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& o : out) o = static_cast<int32_t>(bounded_u32(static_cast<uint32_t>(high) - 1u));
  return out;
}

std::vector<int64_t> NumpyPcg64::integers_i64(int64_t high, int64_t n) {
  DS_CHECK(high > 0 && n >= 0, "integers_i64: high {} must be positive", high);
  std::vector<int64_t> out(static_cast<size_t>(n));
  const uint64_t rng = static_cast<uint64_t>(high) - 1u;
  for (auto& o : out) {
    if (rng == 0) {
      o = 0;
      continue;
    }
    if (rng <= 0xFFFFFFFFULL) {  // numpy draws 32-bit words for a range that fits in them
      o = static_cast<int64_t>(bounded_u32(static_cast<uint32_t>(rng)));
      continue;
    }
    const uint64_t excl = rng + 1u;
    unsigned __int128 m = static_cast<unsigned __int128>(next_u64()) * excl;
    uint64_t left = static_cast<uint64_t>(m);
    if (left < excl) {
      const uint64_t threshold = (UINT64_MAX - rng) % excl;
      while (left < threshold) {
        m = static_cast<unsigned __int128>(next_u64()) * excl;
        left = static_cast<uint64_t>(m);
      }
    }
    o = static_cast<int64_t>(m >> 64);
  }
  return out;
}

}  // namespace ds
