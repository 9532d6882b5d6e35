// Which SIMD instruction set the hand-written CPU kernels run.
//
// Every kernel is one Highway source (hwy/highway.h), compiled once per
// target: AVX-512 and AVX2 on x86, NEON, SVE and SVE2 on Arm, and a portable
// scalar fallback. At the first call the best target this CPU supports is
// chosen, capped by the environment:
//
//   DEEPSEEK_MAX_CPU_ISA=avx512bf16|avx512|avx2|neon|sve|sve2|scalar
//                                the best target allowed
//   DEEPSEEK_DISABLE_AVX512=1    the same as avx2
//
// so that tests and benchmarks can run every path on one machine (as
// ONEDNN_MAX_CPU_ISA does for oneDNN's kernels). Kernel files call their
// exported functions through DS_DISPATCH, which applies the cap first.
//
// avx512bf16 is AVX-512 with AVX512-BF16's dot products (vdpbf16ps, which
// Highway 1.0 has no target for): the bf16 matmul precision (ops/linear.h)
// runs on them where the CPU has them, unless the cap is avx512 or below.
#pragma once

#include <cstdint>
#include <string>

namespace ds {

// Reads the cap from the environment and applies it. Throws ds::Error naming
// the variable when its value is not a known target. The program calls it at
// start-up; the kernels call it (through ensure_simd_targets) before their
// first dispatch, and there an unknown value is reported once on stderr and
// ignored, since an exception must not leave a parallel region.
void init_simd_targets();

// The name of the target the kernels run ("AVX3" is AVX-512, then "AVX2",
// "NEON", "SVE", "SVE2", "SCALAR"/"EMU128"), after the cap.
std::string simd_target_name();

// Whether kernels may use bf16 dot products: the CPU has AVX512-BF16 and the
// cap allows it. (The kernels use them only where the dispatched target is
// AVX-512 too.)
bool simd_bf16_dot_allowed();

namespace detail {
void init_simd_targets_nothrow();
// For tests: allow (if the CPU has them) or forbid bf16 dot products, whatever
// the environment says.
void set_simd_bf16_dot_allowed(bool allowed);
// The set of Highway targets the cap leaves (HWY_* bits), or 0 without a cap:
// what a test that switches targets must restore afterwards.
int64_t capped_simd_targets();
}  // namespace detail

inline void ensure_simd_targets() {
  static const bool done = (detail::init_simd_targets_nothrow(), true);
  (void)done;
}

}  // namespace ds

// HWY_DYNAMIC_DISPATCH with the environment's cap applied first. For use in
// the HWY_ONCE part of a kernel file, after hwy/highway.h.
#define DS_DISPATCH(FN) (::ds::ensure_simd_targets(), HWY_DYNAMIC_DISPATCH(FN))
