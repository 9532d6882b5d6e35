// A polynomial exp for the CPU kernels' inner loops. libm's expf does not
// vectorize (no -ffast-math, so no vector math library); this does, inside
// the target_clones kernels that call it, at about one cycle per element with
// AVX-512.
#pragma once

#include <bit>
#include <cstdint>

namespace ds::ops {

// exp(x) for x <= 88, within about 1 ulp (x = n ln2 + r with |r| <= ln2/2,
// exp(r) by the degree-6 minimax polynomial of Cephes' expf, times 2^n built
// as a float from its exponent bits); exp(0) is exactly 1. The kernels call it
// with x <= 0 (x - max, -|a|; a tiny positive x from rounding is fine).
// Below ln(FLT_MIN) = -87.33654, where exp leaves the normal range, the
// result is flushed to 0, -inf included; the clamp keeps 2^n a normal
// number. A NaN argument (of either sign) gives NaN. The clamp and the flush
// are bit masks rather than conditionals: GCC does not if-convert a float
// comparison under the default -ftrapping-math, and a conditional would keep
// the loops from vectorizing.
inline float fast_exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kMin = -87.33654f;
  // All ones unless x < kMin (so NaN keeps its bits and propagates).
  const int32_t keep = -static_cast<int32_t>(!(x < kMin));
  const float xc = std::bit_cast<float>((std::bit_cast<int32_t>(x) & keep) | (std::bit_cast<int32_t>(kMin) & ~keep));
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;  // ln2 split in two: n * kLn2Hi is exact for |n| <= 128
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n (n >= -126: a normal float), or 0 where the result is flushed.
  const int32_t scale = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(scale & keep);
}

}  // namespace ds::ops
