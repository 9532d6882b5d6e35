#!/usr/bin/env bash
# The program's edge: help and self-check succeed; bad input gives exactly one
# line on stderr and exit code 2, never a crash.
set -u
bin="$1"
fail=0
expect_error() {
  local err rc
  err=$("$bin" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne 2 ]; then echo "FAIL: deepseek $* exited $rc, want 2"; fail=1; fi
  if [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ] || [[ "$err" != deepseek:\ error:* ]]; then
    echo "FAIL: deepseek $* stderr is not one 'deepseek: error:' line: $err"; fail=1
  fi
}
"$bin" --help >/dev/null || { echo "FAIL: --help"; fail=1; }
"$bin" --version | grep -q "deepseek.cpp" || { echo "FAIL: --version"; fail=1; }
"$bin" selfcheck >/dev/null || { echo "FAIL: selfcheck"; fail=1; }
expect_error --no-such-flag
expect_error --threads 0 selfcheck
expect_error no-such-command
[ "$fail" -eq 0 ] && echo "cli: all checks passed"
exit "$fail"
