// The SIMD target the kernels dispatch to, and the environment's cap on it.
#include "core/simd.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "test_util.h"

namespace {
namespace simd_test {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

bool is_fallback(const std::string& t) { return t == "SCALAR" || t == "EMU128"; }

// Under DEEPSEEK_MAX_CPU_ISA (ctest runs the kernel tests again with it) the
// dispatched target is the capped one wherever the CPU has it; without a cap
// it is the best one the CPU has.
TEST(SimdTargets, CapFromTheEnvironmentIsHonoured) {
  const std::string target = ds::simd_target_name(), cap = env("DEEPSEEK_MAX_CPU_ISA");
  RecordProperty("simd_target", target);
  std::printf("dispatched SIMD target: %s (cap: %s)\n", target.c_str(), cap.empty() ? "none" : cap.c_str());
  if (cap == "scalar") {
    EXPECT_TRUE(is_fallback(target)) << target;
    return;
  }
#if defined(__x86_64__)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  // bf16 dot products: wherever the CPU has them, unless the cap is below
  // avx512bf16.
  const bool bf16_dot = __builtin_cpu_supports("avx512bf16");
  const bool dot_capped = !(cap.empty() || cap == "avx512bf16") || env("DEEPSEEK_DISABLE_AVX512") == "1";
  EXPECT_EQ(ds::simd_bf16_dot_allowed(), bf16_dot && !dot_capped) << "cap " << cap;
  if (cap == "avx2" || env("DEEPSEEK_DISABLE_AVX512") == "1") {
    EXPECT_EQ(target, avx2 ? "AVX2" : target) << "capped to AVX2";
    EXPECT_NE(target, "AVX3");
  } else if (cap.empty() || cap == "avx512bf16" || cap == "avx512") {
    if (avx512) {
      EXPECT_EQ(target, "AVX3");
    } else if (avx2) {
      EXPECT_EQ(target, "AVX2");
    }
  }
#elif defined(__aarch64__)
  if (cap == "neon") {
    EXPECT_EQ(target, "NEON");
  }
  if (cap == "sve") {
    EXPECT_NE(target, "SVE2");
  }
  EXPECT_FALSE(is_fallback(target)) << "every aarch64 CPU has NEON";
#endif
}

// The name is that of the target a dispatch reaches, and nothing resets it:
// neither Highway's own query of the CPU's targets (which in Highway 1.0
// refreshes the dispatch choice) nor a loop over every target.
TEST(SimdTargets, CapSurvivesQueriesAndTargetLoops) {
  const std::string before = ds::simd_target_name();
  (void)hwy::SupportedTargets();
  EXPECT_EQ(ds::simd_target_name(), before);
  ds::test::for_each_simd_target([](const char*) {});
  EXPECT_EQ(ds::simd_target_name(), before);
  (void)hwy::SupportedTargets();
  EXPECT_EQ(ds::simd_target_name(), before);
}

// A cap that names no target is one clear error for the program to report.
TEST(SimdTargets, UnknownCapIsAnError) {
  const std::string saved = env("DEEPSEEK_MAX_CPU_ISA");
  setenv("DEEPSEEK_MAX_CPU_ISA", "avx9000", 1);
  EXPECT_THROW(ds::init_simd_targets(), ds::Error);
  if (saved.empty())
    unsetenv("DEEPSEEK_MAX_CPU_ISA");
  else
    setenv("DEEPSEEK_MAX_CPU_ISA", saved.c_str(), 1);
}

// The test harness's loop over targets really switches the dispatch: every
// target it names is the one the kernels run while it is current.
TEST(SimdTargets, EveryTargetCanBeDispatchedInTurn) {
  int visited = 0;
  ds::test::for_each_simd_target([&](const char* name) {
    EXPECT_EQ(ds::simd_target_name(), name);
    ++visited;
  });
  EXPECT_GE(visited, 1);
#if defined(__x86_64__)
  // The scalar fallback plus at least AVX2 on any CPU that has it, unless capped.
  if (__builtin_cpu_supports("avx2") && env("DEEPSEEK_MAX_CPU_ISA") != "scalar") {
    EXPECT_GE(visited, 2);
  }
#endif
}

}  // namespace simd_test
}  // namespace
