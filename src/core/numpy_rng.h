// numpy's default generator, bit for bit: np.random.default_rng(seed)
// (SeedSequence -> PCG64) and Generator.integers(0, high, dtype=int32|int64)
// with numpy's Lemire rejection. Engram's hash multipliers are defined as
// draws from it (MaxText and DeepSeek both seed it with seed + 10007 layer),
// so a model trained elsewhere hashes its n-grams to the same rows here.
// Checked against numpy 1.24's own draws in tests/numpy_rng_test.cc.
#pragma once

#include <cstdint>
#include <vector>

namespace ds {

class NumpyPcg64 {
 public:
  // np.random.default_rng(seed) for a non-negative integer seed.
  explicit NumpyPcg64(uint64_t seed);
  uint64_t next_u64();
  uint32_t next_u32();  // numpy's: the low half of a 64-bit draw, then its high half
  // Generator.integers(0, high, size=n, dtype=np.int32) (0 < high < 2^31).
  std::vector<int32_t> integers_i32(int32_t high, int64_t n);
  // Generator.integers(0, high, size=n, dtype=np.int64) (0 < high).
  std::vector<int64_t> integers_i64(int64_t high, int64_t n);

 private:
  uint32_t bounded_u32(uint32_t rng);  // uniform in [0, rng], numpy's way
  unsigned __int128 state_ = 0, inc_ = 0;
  bool has_u32_ = false;
  uint32_t u32_ = 0;
};

}  // namespace ds
