// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// A value is a pure function of (seed, stream, index): initialization and
// sampling give the same numbers whatever the thread count or the order in
// which elements are visited, and any element can be regenerated alone.
#pragma once

#include <array>
#include <cstdint>

namespace ds {

class Philox {
 public:
  explicit Philox(uint64_t seed, uint64_t stream = 0)
      : key_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}, stream_(stream) {}

  // Four 32-bit words for counter `index`.
  std::array<uint32_t, 4> block(uint64_t index) const;
  uint32_t u32(uint64_t index) const { return block(index)[0]; }
  // Uniform in [0, 1) with 24 random bits (exactly representable in float).
  float uniform(uint64_t index) const;
  // Standard normal via Box-Muller on one counter block.
  float normal(uint64_t index) const;

 private:
  std::array<uint32_t, 2> key_;
  uint64_t stream_;
};

// Fills x[0..n) with values from N(0, std^2) (stream `stream` of `seed`).
void fill_normal(float* x, int64_t n, float std, uint64_t seed, uint64_t stream = 0);
// Fills x[0..n) uniformly from [lo, hi).
void fill_uniform(float* x, int64_t n, float lo, float hi, uint64_t seed, uint64_t stream = 0);

}  // namespace ds
