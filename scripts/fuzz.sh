#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with clang (ASan + UBSan, -O1 -g) into
# build-fuzz/ and runs each one on a copy of its seed corpus.
#
#   ./scripts/fuzz.sh                       # every target, 1,000,000 inputs each
#   FUZZ_RUNS=100000 ./scripts/fuzz.sh config_json_fuzz token_lists_fuzz
#
# Targets (fuzz/<target>.cc, seeds in fuzz/corpus/<name without _fuzz>/):
# safetensors_header_fuzz, config_json_fuzz, tokenizer_json_fuzz,
# token_lists_fuzz, token_shard_fuzz, token_meta_fuzz, train_config_fuzz,
# json_dataset_fuzz, server_request_fuzz, gguf_fuzz. Arguments name the targets to run (default: all). Each
# target gets a libFuzzer dictionary: fuzz/<name without _fuzz>.dict where
# there is one (train_config: YAML and the run config's keys; token_shard:
# the shard header's magic and edge-case integers; server_request: HTTP
# framing and the API's keys), else fuzz/json.dict (JSON
# syntax, edge-case numbers, the keys the JSON parsers read).
#
# The seed corpus is copied into a temporary folder so that the repository's
# corpus is never grown; crash, timeout and out-of-memory inputs are written
# to FUZZ_ARTIFACTS/<target>/ (kept, printed in the summary) and the log of
# each run lies beside them. One summary line per target; exits non-zero if
# any target found a crash (or its build failed).
#
# Environment:
#   FUZZ_RUNS       inputs per target (libFuzzer -runs), default 1000000
#   FUZZ_MAX_TIME   seconds per target at most (-max_total_time), default 0 = no limit
#   FUZZ_TIMEOUT    seconds one input may take before it counts as a hang, default 25
#   FUZZ_ARTIFACTS  where findings and logs go, default a new folder under ${TMPDIR:-/tmp}
#   FUZZ_KEEP_GOING 1: go on after a finding (libFuzzer fork mode, one worker, with
#                   -ignore_crashes/-ignore_ooms/-ignore_timeouts), so that one run
#                   collects every kind of crash a target hits; default 0 (stop at the first)
#   FUZZ_ARGS       further libFuzzer flags for every target (e.g. "-seed=1")
#   DEEPSEEK_JOBS   build jobs, default 2
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

RUNS="${FUZZ_RUNS:-1000000}"
MAX_TIME="${FUZZ_MAX_TIME:-0}"
TIMEOUT="${FUZZ_TIMEOUT:-25}"
KEEP_GOING=()
[ "${FUZZ_KEEP_GOING:-0}" = 1 ] && KEEP_GOING=(-fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1)
JOBS="${DEEPSEEK_JOBS:-2}"
BUILD=build-fuzz
ALL_TARGETS=(safetensors_header_fuzz config_json_fuzz tokenizer_json_fuzz token_lists_fuzz token_shard_fuzz
  token_meta_fuzz train_config_fuzz json_dataset_fuzz server_request_fuzz gguf_fuzz)
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL_TARGETS[@]}")

# Longest input libFuzzer may generate, per target.
max_len() {
  case "$1" in
    tokenizer_json_fuzz | safetensors_header_fuzz) echo 16384 ;;
    *) echo 4096 ;;
  esac
}

# The libFuzzer dictionary of a target.
dict() {
  local own="fuzz/${1%_fuzz}.dict"
  if [ -f "$own" ]; then echo "$own"; else echo fuzz/json.dict; fi
}

for t in "${TARGETS[@]}"; do
  [ -f "fuzz/$t.cc" ] || { echo "fuzz.sh: unknown target '$t' (known: ${ALL_TARGETS[*]})" >&2; exit 2; }
done
for tool in clang clang++ cmake ninja; do
  command -v "$tool" >/dev/null 2>&1 || { echo "fuzz.sh: $tool not found (Debian: apt-get install clang cmake ninja-build)" >&2; exit 2; }
done

CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g" \
  -DDEEPSEEK_BUILD_TESTS=OFF -DDEEPSEEK_BUILD_BENCH=OFF -DDEEPSEEK_FUZZ=ON >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

ARTIFACTS="${FUZZ_ARTIFACTS:-$(mktemp -d "${TMPDIR:-/tmp}/deepseek-fuzz.XXXXXX")}"
mkdir -p "$ARTIFACTS"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/deepseek-fuzz-corpus.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# UBSan reports abort (the library is also built with -fno-sanitize-recover);
# leak checking stays on: a leak is a finding too.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:symbolize=1}"

failed=0
summary=()
for t in "${TARGETS[@]}"; do
  seeds="fuzz/corpus/${t%_fuzz}"
  corpus="$WORK/$t"
  out="$ARTIFACTS/$t"
  log="$out/fuzz.log"
  mkdir -p "$corpus" "$out"
  [ -d "$seeds" ] && cp -r "$seeds/." "$corpus/"
  echo "== $t: $RUNS runs, -max_len=$(max_len "$t"), -dict=$(dict "$t"), log $log"
  rc=0
  start=$SECONDS
  # shellcheck disable=SC2086  # FUZZ_ARGS is a list of flags
  "$BUILD/fuzz/$t" -runs="$RUNS" -max_total_time="$MAX_TIME" -timeout="$TIMEOUT" -max_len="$(max_len "$t")" \
    -dict="$(dict "$t")" \
    -artifact_prefix="$out/" -print_final_stats=1 "${KEEP_GOING[@]}" ${FUZZ_ARGS:-} "$corpus" >"$log" 2>&1 || rc=$?
  secs=$((SECONDS - start))
  # Inputs run: the final stats, or the last progress line (fork mode, or a
  # run that stopped at a finding).
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  [ -n "$runs" ] || runs=$(sed -n 's/^#\([0-9][0-9]*\).*/\1/p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  [ -n "$rate" ] || { [ -n "$runs" ] && [ "$secs" -gt 0 ] && rate=$((runs / secs)); } || true
  files=$(find "$corpus" -type f | wc -l)
  found=$(find "$out" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' -o -name 'leak-*' \) |
    sort)
  if [ "$rc" -eq 0 ] && [ -z "$found" ]; then
    line="$t: clean, ${runs:-?} inputs in $secs s (${rate:-?} exec/s), corpus $files files"
  else
    failed=1
    # (NEW_FUNC lines name newly covered functions, whose names can match.)
    what=$(grep -v 'NEW_FUNC' "$log" |
      grep -m 1 -E '^==[0-9]+==ERROR|runtime error:|^SUMMARY:|deadly signal|out-of-memory|timeout after|terminate called' ||
      true)
    line="$t: FINDING (exit $rc) after ${runs:-?} inputs, $secs s: ${what:-see log}; $(echo "$found" | grep -c .) input(s): $(echo "$found" | tr '\n' ' ')log $log"
  fi
  echo "$line"
  summary+=("$line")
  # What each finding is, from running the target on it once more.
  for input in $found; do
    why=$("$BUILD/fuzz/$t" "$input" 2>&1 | grep -E 'what\(\)|runtime error:|ERROR: [A-Za-z]*Sanitizer|out-of-memory|timeout' |
      head -n 1 | sed 's/^ *//' || true)
    echo "  $input: ${why:-did not reproduce alone}"
    summary+=("  $input: ${why:-did not reproduce alone}")
  done
done

echo
echo "fuzz summary (findings and logs in $ARTIFACTS):"
printf '  %s\n' "${summary[@]}"
exit "$failed"
