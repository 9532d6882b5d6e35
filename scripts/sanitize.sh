#!/usr/bin/env bash
# Builds everything (library, `deepseek`, every test) with AddressSanitizer
# (LeakSanitizer included) and UndefinedBehaviorSanitizer into build-asan/, and
# runs the ctest suite under them: the GoogleTest cases, the op tests' reruns
# with the SIMD kernels capped (avx2/..., scalar/...; the model tests'
# capped reruns run in the Release build only, see below), and the shell tests,
# which run build-asan/deepseek (ctest passes them the binary of the build
# folder it runs in; reference_model_test runs the same one).
#
#   ./scripts/sanitize.sh                 # everything
#   ./scripts/sanitize.sh -R tokenizer    # extra arguments go to ctest
#
# Debug build at -Og -g1, so assert() stays on (no NDEBUG) and the reports name
# file:line (line tables; full -g costs a quarter more build time). -Og
# rather than -O1: the instrumented build is 30% shorter (the sanitizers'
# code generation dominates it) and the tests about 10% longer;
# -D_GLIBCXX_ASSERTIONS adds libstdc++'s bounds checks. Benchmarks
# are off. Every sanitizer report ends its process (abort_on_error,
# halt_on_error, -fno-sanitize-recover=all). AddressSanitizer and
# LeakSanitizer write theirs to build-asan/sanitizer-reports/asan.<program>.<pid>
# rather than stderr, so a report counts even where a shell test discards the
# program's stderr and exit status; at the end each report's first line,
# SUMMARY and top frames are printed. GCC's UndefinedBehaviorSanitizer runtime
# ignores log_path: its reports stay on stderr, which ctest keeps in
# build-asan/Testing/Temporary/LastTest.log, searched at the end as well.
#
# Environment: DEEPSEEK_JOBS (build jobs and tests run at once, default 2);
# DEEPSEEK_DIST_STEPS (dist_mpi's run length, default 8 here, see below);
# DEEPSEEK_DIST_SUBSET (dist_mpi's runs: sanitized here, see below);
# DEEPSEEK_SANITIZE_CAPPED_MODELS=1 (the model tests' AVX2 reruns as well,
# see below); DEEPSEEK_FIXTURE_TRAINER (a `deepseek` that trains
# client_sdks' tool-calling fixture, which this build's program then exports
# and serves: scripts/test.sh passes the Release one it has just built,
# which trains it in 5 s where this build takes 250 s).
# ASAN_OPTIONS, UBSAN_OPTIONS and LSAN_OPTIONS given by the caller are
# appended to the defaults below (later settings win). LeakSanitizer
# suppressions, for third-party libraries only, go in scripts/sanitize.supp
# (used when present; none are needed so far: OpenMP and oneDNN report
# nothing).
# Exits non-zero if the build fails, a test fails, or any sanitizer reported.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

BUILD="$ROOT/build-asan"
REPORTS="$BUILD/sanitizer-reports"
JOBS="${DEEPSEEK_JOBS:-2}"
SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"

install_missing_packages
fetch_test_assets

# Set for the build as well: gtest_discover_tests runs each test executable
# (--gtest_list_tests) right after linking it.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:halt_on_error=1:strict_string_checks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:log_exe_name=1:log_path=$REPORTS/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1:report_error_type=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
SUPP="$ROOT/scripts/sanitize.supp"
[ -f "$SUPP" ] && export LSAN_OPTIONS="suppressions=$SUPP:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
# The tests must run this build's program, not one named from outside.
unset DEEPSEEK_TEST_BINARY
# Two test processes share the cores: idle OpenMP workers sleep.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
# dist_mpi's loss-comparing runs take 8 steps here instead of 20: the same
# cases and code paths, with two fifths of the instrumented steps (the first 8
# steps of the same runs; tests/dist_mpi_test.sh).
export DEEPSEEK_DIST_STEPS="${DEEPSEEK_DIST_STEPS:-8}"
# and leave out the 7 of its runs whose code paths its other runs take (its
# json and tokens data at data=2 and at fsdp=2, kept at data=2 x fsdp=2; the
# batch split at expert=2 with allgather, for V3 and V4; V4's synthetic rows
# at data=2); the Release run does them all.
export DEEPSEEK_DIST_SUBSET="${DEEPSEEK_DIST_SUBSET:-sanitized}"

rm -rf "$REPORTS"
mkdir -p "$REPORTS"

# This build only runs here: on an x86 CPU without AVX-512 its AVX-512 kernels
# could never run, so they are not compiled (about a minute less to build).
HWY_ARGS=(-DDEEPSEEK_SKIP_AVX512=OFF)
if [ "$(uname -m)" = x86_64 ] && ! grep -qw avx512f /proc/cpuinfo; then
  HWY_ARGS=(-DDEEPSEEK_SKIP_AVX512=ON)
fi

# Programs linked position-dependent (-no-pie): a sanitized PIE carries about
# two million relocations (ASan's and UBSan's tables of globals and check
# sites), which every process applied at start, touching 60 MB: 0.75 s for
# each `deepseek` the script tests start, 0.27 s without.
t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug "${HWY_ARGS[@]}" \
  -DCMAKE_CXX_FLAGS_DEBUG="-Og -g1" \
  -DCMAKE_CXX_FLAGS="$SAN_FLAGS -D_GLIBCXX_ASSERTIONS" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN_FLAGS -no-pie" \
  -DDEEPSEEK_BUILD_TESTS=ON -DDEEPSEEK_BUILD_BENCH=OFF
nice -n 10 cmake --build "$BUILD" -j "$JOBS"
t_build=$(( $(date +%s) - t0 ))
echo "sanitized build: ${t_build}s"

t0=$(date +%s)
status=0
rm -f "$BUILD/Testing/Temporary/LastTest.log"
# The model tests' AVX2 reruns (label capped_model) are left out: the op
# tests' capped reruns check the capped kernels' memory accesses here, and
# the Release run checks the models on them (tests/CMakeLists.txt).
# DEEPSEEK_SANITIZE_CAPPED_MODELS=1 runs them too.
LABEL_ARGS=(-LE capped_model)
[ "${DEEPSEEK_SANITIZE_CAPPED_MODELS:-0}" = 1 ] && LABEL_ARGS=()
(cd "$BUILD" && nice -n 10 ctest --output-on-failure -j "$JOBS" "${LABEL_ARGS[@]}" "$@") || status=$?
t_test=$(( $(date +%s) - t0 ))

# Every AddressSanitizer / LeakSanitizer report: its first line, summary and
# top frames.
shopt -s nullglob
reports=("$REPORTS"/*)
if [ ${#reports[@]} -gt 0 ]; then
  status=1
  echo
  echo "=== ${#reports[@]} AddressSanitizer/LeakSanitizer report(s) in $REPORTS:"
  for r in "${reports[@]}"; do
    echo "--- $(basename "$r")"
    grep -m1 -E 'ERROR: ' "$r" || true
    grep -m1 '^SUMMARY:' "$r" || true
    grep -m8 -E '^ *#[0-9]+ ' "$r" || true
  done
fi
# UndefinedBehaviorSanitizer reports (and any other sanitizer output that
# reached a test's output), each under the name of the test that printed it.
LOG="$BUILD/Testing/Temporary/LastTest.log"
SAN_PATTERN='ERROR: (Address|Leak)Sanitizer|runtime error:|SUMMARY: (Address|Leak|UndefinedBehavior)Sanitizer'
n_ub=0
if [ -f "$LOG" ] && grep -qE "$SAN_PATTERN" "$LOG"; then
  status=1
  n_ub=$(grep -cE "$SAN_PATTERN" "$LOG")
  echo
  echo "=== $n_ub sanitizer report(s) in test output ($LOG):"
  awk -v pat="$SAN_PATTERN" '
    /^[0-9]+\/[0-9]+ Testing: / { sub(/^[0-9]+\/[0-9]+ Testing: /, ""); test = $0; next }
    $0 ~ pat { print "--- " test; print; frames = 6; next }
    frames > 0 && /^ *#[0-9]+ / { print; frames-- ; next }
    { frames = 0 }' "$LOG"
fi

echo
echo "sanitized build ${t_build}s, tests ${t_test}s; sanitizer reports: ${#reports[@]} ASan/LSan, $n_ub in test output"
exit "$status"
