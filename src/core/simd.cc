#include "core/simd.h"

// One tiny kernel compiled for every target, so that simd_target_name()
// reports the target a dispatch really reaches, not what the CPU supports.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/simd.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ds {
namespace HWY_NAMESPACE {
namespace {
int64_t DispatchedTarget() { return HWY_TARGET; }
}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <hwy/targets.h>

#include <algorithm>
#include <atomic>
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
    {"avx512bf16", HWY_AVX3},
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

// DEEPSEEK_DISABLE_AVX512 set to anything but empty or 0.
bool avx512_disabled_by_environment() {
  const char* no512 = std::getenv("DEEPSEEK_DISABLE_AVX512");
  return no512 && *no512 && std::string(no512) != "0";
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
  if (avx512_disabled_by_environment()) {
#if HWY_ARCH_X86
    return HWY_AVX2 - 1;
#endif
  }
  return 0;
}

// Whether the environment's cap leaves bf16 dot products: none, or avx512bf16.
bool bf16_dot_allowed_by_environment() {
  const char* isa = std::getenv("DEEPSEEK_MAX_CPU_ISA");
  if (isa && *isa) return lower(isa) == "avx512bf16";
  return !avx512_disabled_by_environment();
}

bool cpu_has_bf16_dot() {
#if HWY_ARCH_X86 && defined(__GNUC__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace

// The capped set of targets, 0 while there is no cap.
std::atomic<int64_t> g_capped{0};
// Whether bf16 dot products may run (set with the cap).
std::atomic<bool> g_bf16_dot{false};

void init_simd_targets() {
  const int64_t disabled = disabled_by_environment();
  static std::once_flag once;
  std::call_once(once, [&] {
    g_bf16_dot = cpu_has_bf16_dot() && bf16_dot_allowed_by_environment();
    if (!disabled) return;
    // Not hwy::DisableTargets: Highway 1.0's SupportedTargets() resets the
    // dispatch choice to every target the CPU has before it applies that
    // mask, so any later call of it (a test's loop over targets, a report)
    // would silently undo the cap. A fixed set of supported targets is
    // returned as it is and leaves the choice alone.
    int64_t capped = hwy::SupportedTargets() & ~disabled;
    if (capped == 0) capped = HWY_STATIC_TARGET;
    g_capped = capped;
    hwy::SetSupportedTargetsForTest(capped);
  });
}

namespace detail {
int64_t capped_simd_targets() {
  ensure_simd_targets();
  return g_capped;
}

void set_simd_bf16_dot_allowed(bool allowed) {
  ensure_simd_targets();
  g_bf16_dot = allowed && cpu_has_bf16_dot();
}

void init_simd_targets_nothrow() {
  try {
    init_simd_targets();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deepseek: warning: %s; no cap applied\n", e.what());
  }
}
}  // namespace detail

HWY_EXPORT(DispatchedTarget);

bool simd_bf16_dot_allowed() {
  ensure_simd_targets();
  return g_bf16_dot;
}

std::string simd_target_name() { return hwy::TargetName(DS_DISPATCH(DispatchedTarget)()); }

}  // namespace ds
#endif  // HWY_ONCE
