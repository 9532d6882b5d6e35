// Tests for the counter-based generator (Philox4x32-10 against the Random123
// known-answer vectors, the mapping of seed/stream/index onto key and counter
// words, uniform and normal statistics) and for the thread helpers, including
// fills that must not depend on the thread count.
#include "core/rng.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace ds {
namespace {
namespace rng_test {

using Words = std::array<uint32_t, 4>;

// Philox(seed, stream).block(index) evaluates Philox4x32-10 with
//   key     = {seed low 32 bits, seed high 32 bits}
//   counter = {index low, index high, stream low, stream high}.
Words philox(Words counter, std::array<uint32_t, 2> key) {
  const uint64_t seed = static_cast<uint64_t>(key[1]) << 32 | key[0];
  const uint64_t index = static_cast<uint64_t>(counter[1]) << 32 | counter[0];
  const uint64_t stream = static_cast<uint64_t>(counter[3]) << 32 | counter[2];
  return Philox(seed, stream).block(index);
}

TEST(Philox, Random123KnownAnswers) {
  // From Random123's tests/kat_vectors ("philox4x32 10 <ctr x4> <key x2> <out x4>").
  EXPECT_EQ(philox({0, 0, 0, 0}, {0, 0}), (Words{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (Words{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  // Distinct words everywhere: this one pins the word order of key and counter.
  EXPECT_EQ(philox({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (Words{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
  // The same vector through the public arguments spelled out.
  EXPECT_EQ(Philox(0x299f31d0a4093822ull, 0x0370734413198a2eull).block(0x85a308d3243f6a88ull),
            (Words{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, SeedStreamAndIndexAllMatter) {
  const Philox a(7, 0), b(8, 0), c(7, 1);
  EXPECT_NE(a.block(0), b.block(0));
  EXPECT_NE(a.block(0), c.block(0));
  EXPECT_NE(a.block(0), a.block(1));
  EXPECT_NE(a.block(0), a.block(1ull << 32));                  // the index's high word is used
  EXPECT_NE(Philox(1).block(0), Philox(1ull << 32).block(0));  // and the seed's
  EXPECT_EQ(a.block(12345), Philox(7, 0).block(12345));        // a pure function
  EXPECT_EQ(a.u32(99), a.block(99)[0]);
}

TEST(Philox, UniformIsInUnitIntervalWith24Bits) {
  const Philox rng(2024, 3);
  const int n = 100000;
  double sum = 0, lo = 1, hi = 0;
  for (int i = 0; i < n; ++i) {
    const float u = rng.uniform(static_cast<uint64_t>(i));
    // Documented construction: the top 24 bits of the first word, scaled by 2^-24.
    ASSERT_EQ(u, static_cast<float>(rng.u32(static_cast<uint64_t>(i)) >> 8) * 0x1p-24f);
    sum += u;
    lo = std::min(lo, static_cast<double>(u));
    hi = std::max(hi, static_cast<double>(u));
  }
  EXPECT_GE(lo, 0.0);
  EXPECT_LT(hi, 1.0);
  // Mean of n uniforms: sd sqrt(1/12/n) = 0.00091; allow 5 sigma.
  EXPECT_NEAR(sum / n, 0.5, 5 * std::sqrt(1.0 / 12 / n));
  EXPECT_EQ(Philox(0).uniform(0), static_cast<float>(0x6627e8d5u >> 8) * 0x1p-24f);  // from the KAT above
}

TEST(Philox, NormalMoments) {
  const Philox rng(77, 5);
  const int n = 100000;
  std::vector<double> x(n);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    x[i] = rng.normal(static_cast<uint64_t>(i));
    ASSERT_TRUE(std::isfinite(x[i]));
    sum += x[i];
  }
  const double mean = sum / n;
  double var = 0, tail = 0, lag1 = 0;
  for (int i = 0; i < n; ++i) {
    var += (x[i] - mean) * (x[i] - mean);
    tail += std::fabs(x[i]) > 1.959964 ? 1 : 0;
    if (i) lag1 += x[i] * x[i - 1];
  }
  var /= n - 1;
  // All bounds are 5 standard deviations of the statistic for N(0, 1) samples:
  EXPECT_NEAR(mean, 0.0, 5 / std::sqrt(n));                     // sd of the mean: 1/sqrt(n) = 0.0032
  EXPECT_NEAR(var, 1.0, 5 * std::sqrt(2.0 / n));                // sd of the sample variance: sqrt(2/n) = 0.0045
  EXPECT_NEAR(tail / n, 0.05, 5 * std::sqrt(0.05 * 0.95 / n));  // P(|x| > 1.96) = 0.05, binomial sd 0.00069
  EXPECT_NEAR(lag1 / n, 0.0, 5 / std::sqrt(n));                 // neighbours uncorrelated: sd 1/sqrt(n)
}

// Runs `f` with the OpenMP thread count set to `t`, restoring it afterwards.
template <typename F>
void with_threads(int t, F&& f) {
  const int saved = num_threads();
  set_num_threads(t);
  f();
  set_num_threads(saved);
}

TEST(Philox, FillIsIndependentOfThreadsAndChunking) {
  // 200000 elements: well above the size at which the fills go parallel.
  const int64_t n = 200000;
  std::vector<std::vector<float>> normal(3, std::vector<float>(n)), uniform(3, std::vector<float>(n));
  for (int t = 1; t <= 3; ++t) {
    with_threads(t, [&] {
      fill_normal(normal[t - 1].data(), n, 0.02f, 11, 4);
      fill_uniform(uniform[t - 1].data(), n, -0.5f, 0.25f, 11, 4);
    });
  }
  for (int t = 1; t < 3; ++t) {
    EXPECT_EQ(normal[t], normal[0]) << "fill_normal differs with " << t + 1 << " threads";
    EXPECT_EQ(uniform[t], uniform[0]) << "fill_uniform differs with " << t + 1 << " threads";
  }
  // Element i depends only on (seed, stream, i): the same as drawing it alone,
  // and a shorter fill (serial, below the parallel threshold) is a prefix.
  const Philox rng(11, 4);
  for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{65535}, int64_t{65536}, int64_t{123457}, n - 1}) {
    EXPECT_EQ(normal[0][i], 0.02f * rng.normal(static_cast<uint64_t>(i))) << i;
    EXPECT_EQ(uniform[0][i], -0.5f + 0.75f * rng.uniform(static_cast<uint64_t>(i))) << i;
  }
  std::vector<float> prefix(1000);
  fill_normal(prefix.data(), 1000, 0.02f, 11, 4);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), normal[0].begin()));
  for (float u : uniform[0]) {
    ASSERT_GE(u, -0.5f);
    ASSERT_LT(u, 0.25f);
  }
  // Another stream of the same seed is a different sequence.
  std::vector<float> other(1000);
  fill_normal(other.data(), 1000, 0.02f, 11, 5);
  EXPECT_NE(other, prefix);
}

TEST(Parallel, ThreadCountHelpers) {
  const int saved = num_threads();
  set_num_threads(3);
  EXPECT_EQ(num_threads(), 3);
  set_num_threads(1);
  EXPECT_EQ(num_threads(), 1);
  EXPECT_THROW(set_num_threads(0), Error);
  EXPECT_THROW(set_num_threads(-2), Error);
  EXPECT_EQ(num_threads(), 1);  // a rejected call changes nothing
  set_num_threads(saved);
}

TEST(Parallel, ReduceBlocks) {
  EXPECT_EQ(reduce_blocks(0), 0);
  EXPECT_EQ(reduce_blocks(1), 1);
  EXPECT_EQ(reduce_blocks(kReduceBlock), 1);
  EXPECT_EQ(reduce_blocks(kReduceBlock + 1), 2);
  EXPECT_EQ(reduce_blocks(10 * kReduceBlock), 10);
}

TEST(Parallel, TasksRunOnceEachAndPassOnTheLowestError) {
  const int saved = num_threads();
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    for (bool parallel : {false, true}) {
      std::vector<int> runs(37, 0);
      std::vector<int> team(37, 0);
      parallel_tasks(37, parallel, [&](int64_t t) {
        ++runs[static_cast<size_t>(t)];
        team[static_cast<size_t>(t)] = omp_get_num_threads();
      });
      EXPECT_EQ(runs, std::vector<int>(37, 1)) << threads << " threads, parallel " << parallel;
      // Each task is on one thread of a team of all of them (or alone).
      for (int n : team) EXPECT_EQ(n, parallel ? threads : 1);
    }
    // Every task still runs when some fail; the lowest failing task's error
    // is the one raised (the sequential fallback stops at the first anyway).
    std::vector<int> runs(20, 0);
    try {
      parallel_tasks(20, true, [&](int64_t t) {
        ++runs[static_cast<size_t>(t)];
        if (t == 7 || t == 13) throw Error("task " + std::to_string(t));
      });
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "task 7");
    }
    if (threads > 1) {
      EXPECT_EQ(runs, std::vector<int>(20, 1));
    }
  }
  set_num_threads(saved);
}

TEST(Parallel, ZeroFillsExactlyTheRange) {
  const int saved = num_threads();
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{1} << 18, (int64_t{1} << 19) + 3}) {
      std::vector<float> v(static_cast<size_t>(n + 2), 1.5f);
      parallel_zero(v.data() + 1, n);
      EXPECT_EQ(v.front(), 1.5f);
      EXPECT_EQ(v.back(), 1.5f);
      for (int64_t i = 1; i <= n; ++i) ASSERT_EQ(v[static_cast<size_t>(i)], 0.0f) << n << " " << i;
    }
  }
  set_num_threads(saved);
}

}  // namespace rng_test
}  // namespace
}  // namespace ds
