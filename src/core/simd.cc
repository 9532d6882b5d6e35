#include "core/simd.h"

#include <hwy/targets.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/error.h"

namespace ds {

namespace {

struct Cap {
  const char* name;
  int64_t target;
};

// Highway's targets are bits, better ones lower; a cap disables every bit
// below its own.
constexpr Cap kCaps[] = {
#if HWY_ARCH_X86
    {"avx512", HWY_AVX3},
    {"avx3", HWY_AVX3},
    {"avx2", HWY_AVX2},
#elif HWY_ARCH_ARM
    {"sve2", HWY_SVE2},
    {"sve", HWY_SVE},
    {"neon", HWY_NEON},
#endif
    {"scalar", HWY_SCALAR},
};

std::string lower(const char* s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

// The mask of targets to disable, from the environment (0: no cap).
int64_t disabled_by_environment() {
  const char* isa = std::getenv("DEEPSEEK_MAX_CPU_ISA");
  if (isa && *isa) {
    const std::string v = lower(isa);
    for (const Cap& c : kCaps)
      if (v == c.name) {
        // The scalar cap keeps whichever fallback Highway built (EMU128 or
        // SCALAR, both below every SIMD target).
        const int64_t keep = c.target == HWY_SCALAR ? HWY_EMU128 : c.target;
        return keep - 1;
      }
    std::string known;
    for (const Cap& c : kCaps) known += std::string(known.empty() ? "" : ", ") + c.name;
    DS_FAIL("DEEPSEEK_MAX_CPU_ISA={} is not a target of this CPU family (one of: {})", isa, known);
  }
  const char* no512 = std::getenv("DEEPSEEK_DISABLE_AVX512");
  if (no512 && *no512 && std::string(no512) != "0") {
#if HWY_ARCH_X86
    return HWY_AVX2 - 1;
#endif
  }
  return 0;
}

}  // namespace

void init_simd_targets() {
  const int64_t disabled = disabled_by_environment();
  static std::once_flag once;
  std::call_once(once, [&] {
    if (disabled) hwy::DisableTargets(disabled);
  });
}

namespace detail {
void init_simd_targets_nothrow() {
  try {
    init_simd_targets();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deepseek: warning: %s; no cap applied\n", e.what());
  }
}
}  // namespace detail

std::string simd_target_name() {
  ensure_simd_targets();
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  // The best (lowest) bit is the one dispatch picks.
  return hwy::TargetName(targets & -targets);
}

}  // namespace ds
