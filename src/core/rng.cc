#include "core/rng.h"

#include <cmath>

namespace ds {

std::array<uint32_t, 4> Philox::block(uint64_t index) const {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  std::array<uint32_t, 4> c{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                            static_cast<uint32_t>(stream_), static_cast<uint32_t>(stream_ >> 32)};
  uint32_t k0 = key_[0], k1 = key_[1];
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<uint32_t>(p0)};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

float Philox::uniform(uint64_t index) const { return static_cast<float>(u32(index) >> 8) * 0x1p-24f; }

float Philox::normal(uint64_t index) const {
  auto b = block(index);
  // u1 in (0, 1] so the log is finite.
  double u1 = (static_cast<double>(b[0] >> 8) + 1.0) * 0x1p-24;
  double u2 = static_cast<double>(b[1] >> 8) * 0x1p-24;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

void fill_normal(float* x, int64_t n, float std, uint64_t seed, uint64_t stream) {
  Philox rng(seed, stream);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = std * rng.normal(static_cast<uint64_t>(i));
}

void fill_uniform(float* x, int64_t n, float lo, float hi, uint64_t seed, uint64_t stream) {
  Philox rng(seed, stream);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = lo + (hi - lo) * rng.uniform(static_cast<uint64_t>(i));
}

}  // namespace ds
