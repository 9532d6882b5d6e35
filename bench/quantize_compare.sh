#!/usr/bin/env bash
# `deepseek quantize` against llama.cpp's `llama-quantize` on the same
# weights: a bf16 model folder, exported as a bf16 GGUF for llama.cpp, made
# q4_k_m / Q4_K_M and q8_0 / Q8_0 by each, rounds alternating, with every
# thread of the machine (llama-quantize is given nproc). Prints each run's
# wall time, the medians and ours / llama.cpp (below 1: we are faster).
#
#   bench/quantize_compare.sh [BUILD_DIR] [MODEL_DIR]
#
# BUILD_DIR defaults to build/; MODEL_DIR (with its tokenizer.json, which
# the GGUF carries) to a fresh `deepseek init` of configs/bench-1gb.yml
# (1.15 GB in bf16) with TOKENIZER (default run.sh's,
# data/sotu-tokenizer/tokenizer.json). ROUNDS (default 3).
# LLAMACPP_DIR / LLAMACPP_VERSION as bench/llamacpp_compare.sh (llama.cpp is
# built once from node-llama-cpp's bundled source, outside this repository).
# Needs cmake, a C++ compiler, npm and python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
bin="$build/deepseek"
rounds="${ROUNDS:-3}"
threads="$(nproc)"
[ -x "$bin" ] || { echo "no $bin: build first" >&2; exit 1; }
source "$root/bench/llamacpp_build.sh"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model="${2:-}"
if [ -z "$model" ]; then
  tokenizer="${TOKENIZER:-$root/data/sotu-tokenizer/tokenizer.json}"
  [ -f "$tokenizer" ] || { echo "no tokenizer at $tokenizer (run scripts/run.sh, or set TOKENIZER)" >&2; exit 2; }
  model="$tmp/bf16"
  "$bin" init --config "$root/configs/bench-1gb.yml" --seed 1 --out "$model" --tokenizer "$tokenizer" >/dev/null
fi
"$bin" export --model "$model" --format gguf --dtype bf16 --out "$tmp/bf16.gguf" >/dev/null

seconds() {  # wall seconds of a command, its output discarded
  local t0 t1
  t0=$(date +%s.%N)
  "$@" >/dev/null 2>&1
  t1=$(date +%s.%N)
  python3 -c "print(f'{$t1 - $t0:.2f}')"
}
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $threads threads; llama.cpp $version"
for pair in "q4_k_m Q4_K_M" "q8_0 Q8_0"; do
  set -- $pair
  ours=() theirs=()
  for ((r = 0; r < rounds; r++)); do
    rm -rf "$tmp/ours"
    ours+=("$(seconds "$bin" quantize --model "$model" --out "$tmp/ours" --type "$1")")
    theirs+=("$(seconds "$lbin/llama-quantize" "$tmp/bf16.gguf" "$tmp/theirs.gguf" "$2" "$threads")")
  done
  mo=$(median "${ours[@]}") mt=$(median "${theirs[@]}")
  echo "$1: deepseek quantize ${ours[*]} s (median $mo), llama-quantize ${theirs[*]} s (median $mt);" \
    "ours / llama.cpp $(python3 -c "print(f'{$mo / $mt:.2f}')")"
done
