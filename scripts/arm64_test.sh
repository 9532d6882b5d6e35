#!/usr/bin/env bash
# Builds deepseek.cpp for 64-bit Arm (aarch64) on a Debian 12 x86-64 machine
# and runs the op and model tests under qemu-aarch64, twice: on an emulated
# CPU with SVE2 (256-bit vectors), where the kernels dispatch to SVE2, and
# with DEEPSEEK_MAX_CPU_ISA=neon, where they run NEON.
#
#   ./scripts/arm64_test.sh
#
# 1. Installs what is missing on the host (Debian packages only): the cross
#    compiler g++-aarch64-linux-gnu, qemu-user, cmake, ninja, pkg-config.
#    The arm64 libraries are NOT installed: arm64 is added as a dpkg foreign
#    architecture only so that apt can fetch arm64 packages; their .debs and
#    runtime dependency closure are downloaded (`apt-get download`) into
#    .cache/arm64-debs and extracted with `dpkg-deb -x` into
#    .cache/arm64-sysroot. The host's amd64 -dev packages stay as they are
#    (checked at the end of this step).
# 2. Configures build-arm64/ with cmake/aarch64-linux-gnu.cmake (Release,
#    benchmarks off) and builds the library, `deepseek` and the tests.
# 3. Runs the GoogleTest executables with `qemu-aarch64 -L <sysroot>`, and
#    the program's shell tests (cli, tokenizer_cli, model_cli) through a
#    wrapper that runs `deepseek` under qemu, once per CPU setting; prints
#    the dispatched SIMD target and passed/failed/skipped counts per run.
#
# Environment: DEEPSEEK_JOBS (build jobs, default 2), DEEPSEEK_ARM64_TESTS
# (space-separated test executables, default every tests/*_test.cc),
# DEEPSEEK_ARM64_RUNS (default "sve2 neon"; "sve" and "scalar" are the other
# caps), DEEPSEEK_ARM64_SVE_BYTES (the emulated SVE vector length in bytes,
# default 32 = 256 bits), DEEPSEEK_ARM64_TEST_JOBS (test executables run at
# once, default 2).
# Exits non-zero if anything fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CACHE="$ROOT/.cache"
SYSROOT="$CACHE/arm64-sysroot"
DEBS="$CACHE/arm64-debs"
BUILD="$ROOT/build-arm64"
JOBS="${DEEPSEEK_JOBS:-2}"
SVE_BYTES="${DEEPSEEK_ARM64_SVE_BYTES:-32}"
RUNS="${DEEPSEEK_ARM64_RUNS:-sve2 neon}"

# The GoogleTest executables to run: by default all of them
# (tests/*_test.cc: the op tests, simd_test, the model tests transformer,
# generate and reference_model, and the small core/io ones; under qemu they
# take about a minute per run). Tests that need network assets (the real
# DeepSeek-V3 tokenizer) skip themselves and are counted as skipped.
TESTS="${DEEPSEEK_ARM64_TESTS:-}"
# Every test runs under qemu, ReferenceModel.LogitsCommand* included: it
# runs the program through DEEPSEEK_TEST_BINARY, the qemu wrapper (a host
# shell cannot execute an aarch64 binary without binfmt_misc).

# Host tools (amd64). Multi-arch-safe: none of these is an :arm64 package.
HOST_PACKAGES=(g++-aarch64-linux-gnu qemu-user cmake ninja-build pkg-config)
# The arm64 packages whose contents (and runtime dependency closure) go into
# the sysroot: every library CMakeLists.txt links except the benchmarks'
# (OpenBLAS, Google Benchmark), plus the runtime libraries for qemu.
ARM64_ROOTS=(libhwy-dev libdnnl-dev libfmt-dev libyaml-cpp-dev libpcre2-dev libicu-dev libboost-dev zlib1g-dev
             libcpp-httplib-dev libgtest-dev libgmock-dev libc6 libstdc++6 libgcc-s1 libgomp1)
# Architecture-independent header-only packages.
ALL_ROOTS=(nlohmann-json3-dev libcli11-dev)
# Provided by the cross toolchain (/usr/aarch64-linux-gnu), or sources only:
# not followed.
ARM64_SKIP=" libc6-dev linux-libc-dev libc-dev-bin libcrypt-dev googletest "

say() { printf '\n=== %s\n' "$*"; }
now() { date +%s; }
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

installed() { dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null | grep -q '^ii'; }

# -------------------------------------------------------------------------
# 1. Packages and sysroot
# -------------------------------------------------------------------------
t_setup=$(now)
say "host packages and arm64 sysroot"

# The host packages installed now (those of scripts/common.sh among them),
# checked again afterwards.
mapfile -t COMMON_PACKAGES < <(sed -n '/^DEEPSEEK_PACKAGES=(/,/^)/p' scripts/common.sh |
  sed '1s/.*(//; s/)//' | tr -s ' \n' '\n' | grep -v '^$' || true)
before=()
for p in "${COMMON_PACKAGES[@]}" "${HOST_PACKAGES[@]}"; do installed "$p" && before+=("$p"); done

apt_updated=0
apt_update() {
  if [ $apt_updated -eq 0 ]; then
    $SUDO apt-get update -qq
    apt_updated=1
  fi
}

missing=()
for p in "${HOST_PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  apt_update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "${missing[@]}"
fi

stamp_text="${ARM64_ROOTS[*]} | ${ALL_ROOTS[*]} | ${ARM64_SKIP}"
if [ -f "$SYSROOT/.complete" ] && [ "$(cat "$SYSROOT/.complete")" = "$stamp_text" ]; then
  echo "sysroot up to date: $SYSROOT"
else
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "adding arm64 as a foreign dpkg architecture (package lists only; nothing arm64 is installed)"
    $SUDO dpkg --add-architecture arm64
    apt_updated=0
  fi
  if ! apt-cache show libhwy-dev:arm64 >/dev/null 2>&1; then apt_update; fi

  # The runtime dependency closure of the roots, breadth first, following
  # Depends and Pre-Depends of arm64 packages only (Multi-Arch: foreign
  # dependencies resolve to the host's packages and are not needed).
  declare -A seen=()
  queue=()
  for p in "${ARM64_ROOTS[@]}"; do queue+=("$p:arm64"); seen["$p:arm64"]=1; done
  while [ ${#queue[@]} -gt 0 ]; do
    batch=("${queue[@]}")
    queue=()
    while read -r dep; do
      name="${dep%%:*}"
      [[ "$ARM64_SKIP" == *" $name "* ]] && continue
      [ -n "${seen[$dep]:-}" ] && continue
      seen["$dep"]=1
      queue+=("$dep")
    done < <(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
               --no-replaces --no-enhances "${batch[@]}" |
             sed -n 's/^ *|\{0,1\}\(Pre\)\{0,1\}Depends: \([^<> ]*:arm64\)$/\2/p')
  done
  # One .deb per package, its file name as apt-get download writes it.
  declare -A debfile=()
  while read -r name ver arch; do
    debfile[$name]="${name}_${ver/:/%3a}_${arch}.deb"
  done < <(apt-cache show --no-all-versions "${!seen[@]}" "${ALL_ROOTS[@]}" |
           awk '/^Package:/ {p = $2} /^Version:/ {v = $2} /^Architecture:/ {a = $2}
                /^$/ {if (p != "") print p, v, a; p = ""} END {if (p != "") print p, v, a}')
  mkdir -p "$DEBS" "$SYSROOT/.extracted"
  need=()
  for name in "${!debfile[@]}"; do
    [ -f "$DEBS/${debfile[$name]}" ] && continue
    case "${debfile[$name]}" in *_all.deb) need+=("$name") ;; *) need+=("$name:arm64") ;; esac
  done
  if [ ${#need[@]} -gt 0 ]; then
    echo "downloading ${#need[@]} packages: ${need[*]}"
    download() { (cd "$DEBS" && apt-get download -o APT::Sandbox::User=root -qq "${need[@]}"); }
    # Stale package lists name versions the mirror no longer has: refresh once.
    download || { apt_update; download; }
  fi
  # Extract each .deb once.
  for name in "${!debfile[@]}"; do
    b="${debfile[$name]}"
    [ -f "$SYSROOT/.extracted/$b" ] && continue
    dpkg-deb -x "$DEBS/$b" "$SYSROOT"
    touch "$SYSROOT/.extracted/$b"
  done
  # Absolute symbolic links point into the host: make them point into the
  # sysroot instead.
  find "$SYSROOT" -type l -lname '/*' -print0 | while IFS= read -r -d '' link; do
    target="$(readlink "$link")"
    ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$SYSROOT$target")" "$link"
  done
  printf '%s' "$stamp_text" > "$SYSROOT/.complete"
  echo "sysroot: $SYSROOT ($(ls "$SYSROOT/.extracted" | wc -l) packages)"
fi

# Nothing of the host's may have gone, and no arm64 package is installed.
lost=()
for p in "${before[@]}"; do installed "$p" || lost+=("$p"); done
if [ ${#lost[@]} -gt 0 ]; then
  echo "error: host packages no longer installed: ${lost[*]}" >&2
  exit 1
fi
n_common=0
for p in "${COMMON_PACKAGES[@]}"; do installed "$p" && n_common=$((n_common + 1)); done
echo "host packages intact: ${#before[@]} checked; scripts/common.sh packages installed: $n_common of ${#COMMON_PACKAGES[@]}"
echo "arm64 packages installed in dpkg: $(dpkg-query -W -f='${Architecture} ${db:Status-Abbrev}\n' 2>/dev/null | grep -c '^arm64 ii' || true)"
t_setup=$(( $(now) - t_setup ))
echo "setup: ${t_setup}s"

# -------------------------------------------------------------------------
# 2. Cross build
# -------------------------------------------------------------------------
say "cross-building into build-arm64/ (Release, -j$JOBS)"
t_build=$(now)
# One executable per test source (DEEPSEEK_TEST_GROUPS=OFF): the steps below
# run them by name.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$ROOT/cmake/aarch64-linux-gnu.cmake" \
  -DDEEPSEEK_ARM64_SYSROOT="$SYSROOT" -DDEEPSEEK_BUILD_BENCH=OFF -DDEEPSEEK_BUILD_TESTS=ON \
  -DDEEPSEEK_TEST_GROUPS=OFF >/dev/null
cmake --build "$BUILD" -j "$JOBS"
file "$BUILD/deepseek" 2>/dev/null | sed 's/, BuildID.*//' || true

QEMU=(qemu-aarch64 -L "$SYSROOT")
# The program through qemu, for the shell tests and the self-check.
cat > "$BUILD/deepseek-qemu" <<WRAP
#!/bin/sh
exec qemu-aarch64 -L "$SYSROOT" "$BUILD/deepseek" "\$@"
WRAP
chmod +x "$BUILD/deepseek-qemu"
t_build=$(( $(now) - t_build ))
echo "build: ${t_build}s"

# -------------------------------------------------------------------------
# 3. Tests under qemu-aarch64
# -------------------------------------------------------------------------
TEST_JOBS="${DEEPSEEK_ARM64_TEST_JOBS:-2}"
RESULTS="$BUILD/arm64-results"
summary=()
status=0

# count PATTERN LOG: how many per-test result lines of gtest match.
count() { grep -cE "^\[ *$1 *\] .* \([0-9]+ ms\)$" "$2" || true; }

run_one() {  # run_one DIR EXE: runs a test executable, leaves DIR/EXE.log and DIR/EXE.rc
  local dir="$1" exe="$2"
  local t0; t0=$(now)
  set +e
  DEEPSEEK_TEST_BINARY="$BUILD/deepseek-qemu" timeout "${DEEPSEEK_ARM64_TEST_TIMEOUT:-900}" "${QEMU[@]}" "$BUILD/tests/$exe" >"$dir/$exe.log" 2>&1
  echo $? >"$dir/$exe.rc"
  set -e
  echo "$(( $(now) - t0 ))" >"$dir/$exe.time"
}

run_suite() {  # run_suite LABEL: env QEMU_CPU / DEEPSEEK_MAX_CPU_ISA already exported
  local label="$1" dir="$RESULTS/$1" t0 passed=0 failed=0 skipped=0 failures=()
  rm -rf "$dir" && mkdir -p "$dir"
  t0=$(now)
  say "run '$label': QEMU_CPU=$QEMU_CPU DEEPSEEK_MAX_CPU_ISA=${DEEPSEEK_MAX_CPU_ISA:-(unset)}"
  # The program's self-check (matmul, RMSNorm, attention through the
  # kernels); it names the SIMD target the kernels ran.
  if "$BUILD/deepseek-qemu" selfcheck >"$dir/selfcheck.log" 2>&1; then
    passed=$((passed + 1)); sed 's/^/  selfcheck: /' "$dir/selfcheck.log"
  else
    failed=$((failed + 1)); failures+=("selfcheck"); cat "$dir/selfcheck.log"
  fi
  local target
  target=$(sed -n 's/^SIMD kernels: \([^ ]*\).*/\1/p' "$dir/selfcheck.log")
  echo "dispatched SIMD target (deepseek selfcheck): ${target:-not reported}"
  # The test executables, TEST_JOBS at a time.
  local exe running=0
  for exe in $TESTS; do
    if [ ! -x "$BUILD/tests/$exe" ]; then
      echo "missing test executable: $exe"; failed=$((failed + 1)); failures+=("$exe (not built)"); continue
    fi
    run_one "$dir" "$exe" &
    running=$((running + 1))
    if [ "$running" -ge "$TEST_JOBS" ]; then wait -n || true; running=$((running - 1)); fi
  done
  wait
  for exe in $TESTS; do
    [ -f "$dir/$exe.rc" ] || continue
    local log="$dir/$exe.log" rc p f s
    rc=$(cat "$dir/$exe.rc")
    p=$(count OK "$log"); f=$(count FAILED "$log"); s=$(count SKIPPED "$log")
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    printf '  %-24s %4d passed %3d failed %3d skipped  %5ss  (exit %s)\n' "$exe" "$p" "$f" "$s" "$(cat "$dir/$exe.time")" "$rc"
    grep -E "^\[  FAILED  \] .* \([0-9]+ ms\)$" "$log" | sed "s/^\[  FAILED  \] /    FAILED /" || true
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
      # A crash, a timeout or a failure outside a test: one failure, with the log's end.
      failed=$((failed + 1)); failures+=("$exe (exit $rc)")
      echo "    $exe exited $rc without a failed test; last lines of $log:"; tail -n 15 "$log" | sed 's/^/      /'
    fi
    if [ "$f" -gt 0 ]; then
      mapfile -t -O "${#failures[@]}" failures < <(grep -E "^\[  FAILED  \] .* \([0-9]+ ms\)$" "$log" | awk '{print $4}')
      # The assertion messages of the failed tests.
      grep -B1 -A6 -E '(Failure|failure)$' "$log" | head -n 60 | sed 's/^/      /' || true
    fi
    if [ "$s" -gt 0 ]; then grep -E "^\[  SKIPPED \] .* \([0-9]+ ms\)$" "$log" | sed 's/^/    /'; fi
  done
  # The program end to end (init, generate, bench, logits, errors) and its
  # command-line edge, through the qemu wrapper.
  local sh
  for sh in cli_test.sh tokenizer_cli_test.sh model_cli_test.sh; do
    local args=("$BUILD/deepseek-qemu")
    [ "$sh" = tokenizer_cli_test.sh ] && args+=("$ROOT/tests/data/tokenizer")
    [ "$sh" = model_cli_test.sh ] && args+=("$ROOT")
    if bash "tests/$sh" "${args[@]}" >"$dir/$sh.log" 2>&1; then
      passed=$((passed + 1)); echo "  $sh passed"
    else
      failed=$((failed + 1)); failures+=("$sh"); echo "  $sh FAILED:"; sed 's/^/    /' "$dir/$sh.log" | tail -n 20
    fi
  done
  local secs=$(( $(now) - t0 ))
  echo "run '$label': $passed passed, $failed failed, $skipped skipped (${secs}s)"
  [ ${#failures[@]} -eq 0 ] || echo "run '$label' failures: ${failures[*]}"
  summary+=("$label [${target:-?}]: $passed passed, $failed failed, $skipped skipped (${secs}s)")
  [ "$failed" -eq 0 ] || status=1
}

if [ -z "$TESTS" ]; then
  TESTS=$(cd tests && ls -- *_test.cc | sed 's/\.cc$//' | tr '\n' ' ')
fi
# Two test processes share the cores: idle OpenMP workers sleep.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
for run in $RUNS; do
  export QEMU_CPU="max,sve-default-vector-length=$SVE_BYTES"
  case "$run" in
    sve2) unset DEEPSEEK_MAX_CPU_ISA ;;
    sve|neon|scalar) export DEEPSEEK_MAX_CPU_ISA="$run" ;;
    *) echo "unknown run '$run' (sve2, sve, neon or scalar)" >&2; exit 2 ;;
  esac
  run_suite "$run"
done
unset QEMU_CPU DEEPSEEK_MAX_CPU_ISA

echo
echo "setup ${t_setup}s, build ${t_build}s"
echo "arm64 summary: $(IFS=';'; echo "${summary[*]}" | sed 's/;/; /g')"
exit "$status"
