#!/usr/bin/env bash
# Runs one test executable with the SIMD kernels capped to ISA (and oneDNN to
# AVX2, as ctest's environment for these tests says):
#
#   capped_test.sh ISA TEST_BINARY [ARGS...]
#
# The capped rerun exists to prove, on a CPU with wider vectors, the path that
# smaller CPUs take. On a CPU whose own best already is that path (x86 without
# AVX-512, AVX-VNNI or AMX, where Highway and oneDNN both pick AVX2; Arm
# without SVE, where Highway picks NEON) the uncapped run of the same
# executable has run exactly these kernels, so this one reports itself
# skipped (exit 77, ctest's SKIP_RETURN_CODE) instead of repeating it.
set -euo pipefail
isa="$1"
shift
flags="$(grep -m1 -E '^(flags|Features)[[:space:]]*:' /proc/cpuinfo 2>/dev/null || true)"
wider=1
case "$isa" in
  avx2) grep -qwE 'avx512f|avx_vnni|amx_tile' <<<"$flags" || wider=0 ;;
  neon) grep -qwE 'sve|sve2' <<<"$flags" || wider=0 ;;
esac
if [ -n "$flags" ] && [ "$wider" = 0 ]; then
  echo "skipped: this CPU's own best SIMD path is $isa, which the uncapped run of $(basename "$1") already tested"
  exit 77
fi
exec "$@"
