#!/usr/bin/env bash
# The program's edge: help and self-check succeed; bad input gives exactly one
# line on stderr and exit code 2, never a crash.
set -u
bin="$1"
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
"$bin" --help >/dev/null || { echo "FAIL: --help"; fail=1; }
"$bin" --version | grep -q "deepseek.cpp" || { echo "FAIL: --version"; fail=1; }
"$bin" selfcheck >/dev/null || { echo "FAIL: selfcheck"; fail=1; }
expect_error --no-such-flag
expect_error --threads 0 selfcheck
expect_error no-such-command
# An unknown SIMD cap is refused before any work; a known one is named by selfcheck.
DEEPSEEK_MAX_CPU_ISA=avx9000 expect_error selfcheck
DEEPSEEK_MAX_CPU_ISA=scalar "$bin" selfcheck | grep -Eq "SIMD kernels: (SCALAR|EMU128)" ||
  { echo "FAIL: selfcheck does not name the capped scalar target"; fail=1; }
[ "$fail" -eq 0 ] && echo "cli: all checks passed"
exit "$fail"
