// core/numpy_rng.h against draws made by numpy 1.24 itself
// (np.random.PCG64(seed).random_raw and default_rng(seed).integers), including
// the Engram multipliers of MaxText's int32 scheme and DeepSeek's int64 one.
#include "core/numpy_rng.h"

#include <gtest/gtest.h>

namespace {
namespace numpy_rng_test {

TEST(NumpyRng, RawDrawsMatchNumpy) {
  ds::NumpyPcg64 a(10007);
  EXPECT_EQ(a.next_u64(), 15187255322829266483ULL);
  EXPECT_EQ(a.next_u64(), 959186003677246517ULL);
  EXPECT_EQ(a.next_u64(), 7126631698937927467ULL);
  ds::NumpyPcg64 b(0);
  EXPECT_EQ(b.next_u64(), 11749869230777074271ULL);
  EXPECT_EQ(b.next_u64(), 4976686463289251617ULL);
}

TEST(NumpyRng, BoundedIntegersMatchNumpy) {
  // One generator, three calls in a row (a seed wider than 32 bits).
  ds::NumpyPcg64 g((1ULL << 40) + 5);
  EXPECT_EQ(g.integers_i32(7, 5), (std::vector<int32_t>{0, 0, 3, 2, 6}));
  EXPECT_EQ(g.integers_i64(3LL << 40, 3), (std::vector<int64_t>{499397022642, 1385252762119, 3252079054762}));
  EXPECT_EQ(g.integers_i64(1000, 3), (std::vector<int64_t>{587, 71, 361}));
}

TEST(NumpyRng, EngramMultiplierDraws) {
  // V' = 128: int32 bound floor(floor((2^31 - 1) / 128) / 2), int64 likewise from 2^63 - 1.
  const int32_t hb32 = ((INT32_MAX) / 128) / 2;
  auto odd32 = [](std::vector<int32_t> r) {
    for (auto& v : r) v = 2 * v + 1;
    return r;
  };
  EXPECT_EQ(odd32(ds::NumpyPcg64(10007).integers_i32(hb32, 3)), (std::vector<int32_t>{2516509, 13812727, 10401139}));
  EXPECT_EQ(odd32(ds::NumpyPcg64(4 * 10007).integers_i32(hb32, 3)),
            (std::vector<int32_t>{16580071, 14827181, 6383963}));
  const int64_t hb64 = (INT64_MAX / 128) / 2;
  auto r = ds::NumpyPcg64(10007).integers_i64(hb64, 3);
  for (auto& v : r) v = 2 * v + 1;
  EXPECT_EQ(r, (std::vector<int64_t>{59325216104801821, 3746820326864245, 27838405073976279}));
}

}  // namespace numpy_rng_test
}  // namespace
