#!/usr/bin/env bash
# Generation throughput of deepseek.cpp against the same model in PyTorch eager
# mode (float32, bench/torch_generate.py) on this CPU. Usage:
#   bench/generate_compare.sh [BUILD_DIR]     # BUILD_DIR defaults to build
# Both sides run a random checkpoint of the `small` preset (made by
# `deepseek init`), a PROMPT_LEN-token prompt and NEW_TOKENS greedy decode steps
# for each batch size in BATCHES, with every core. The ratio columns are
# ours / torch (above 1: the engine is faster).
# Prefill tok/s = batch * prompt_len / prefill seconds (the prefill also makes
# each sequence's first new token); decode tok/s = batch * NEW_TOKENS / decode
# seconds, over NEW_TOKENS decode steps. Each side reports the median of 3 runs
# after a warm-up.
# The prefill's FLOP rate is the model's FLOPs (MaxText's accounting, as
# `deepseek bench` reports them: every weight a token meets, causal attention,
# the unembedding for each prompt's last token) times tokens/s, the same FLOPs
# per token for both sides; "% peak" divides it by the float32 FMA ceiling of
# every core at once (BUILD_DIR/bench/peak_bench, this run), and "2x torch"
# is the share of that ceiling twice PyTorch's prefill would need.
# ISA=avx2 caps both sides to AVX2 on an AVX-512 machine, as an AVX2-only CPU
# would run them: the engine's SIMD kernels (DEEPSEEK_MAX_CPU_ISA) and oneDNN
# (ONEDNN_MAX_CPU_ISA), PyTorch's own kernels (ATEN_CPU_CAPABILITY) and
# OpenBLAS (OPENBLAS_CORETYPE=Haswell).
# PRECISION=bf16 runs both sides in bfloat16: the engine with
# `--matmul-precision bf16` (linear layers on x rounded to bf16, on
# AVX512-BF16's dot products where the CPU has them), PyTorch with its model
# in bfloat16 as Hugging Face runs one (torch_generate.py --dtype bfloat16).
# "% peak" still divides by the float32 FMA ceiling; bf16 dot products
# have twice that ceiling.
# ROUNDS=N (default 1) runs the two sides N times each per batch size, in
# alternation (ours, torch, ours, torch, ...), so that a slow spell of the
# machine falls on both; the table then shows each side's median over the
# rounds, and a last column the lowest and highest of the rounds' own
# prefill ratios.
# Needs Debian's python3-torch and python3-numpy (PYTHON, default
# /usr/bin/python3); jq is used for the JSON when installed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
bin="$build/deepseek"
peak_bench="$build/bench/peak_bench"
py="${PYTHON:-/usr/bin/python3}"
batches="${BATCHES:-1 8}"
prompt_len="${PROMPT_LEN:-128}"
new_tokens="${NEW_TOKENS:-32}"
rounds="${ROUNDS:-1}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "error: ROUNDS=$rounds: a positive integer" >&2; exit 1; }
threads="$(nproc)"
case "${ISA:-}" in
  "") ;;
  avx2) export DEEPSEEK_MAX_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell ;;
  *) echo "error: ISA=$ISA: only avx2 can be capped to" >&2; exit 1 ;;
esac
case "${PRECISION:-f32}" in
  f32) ours_precision=f32 torch_dtype=float32 ;;
  bf16) ours_precision=bf16 torch_dtype=bfloat16 ;;
  *) echo "error: PRECISION=$PRECISION: f32 or bf16" >&2; exit 1 ;;
esac

[ -x "$bin" ] || { echo "error: $bin not found; build the project first (or pass BUILD_DIR)" >&2; exit 1; }
[ -x "$peak_bench" ] ||
  { echo "error: $peak_bench not found; build it first (cmake --build $build --target peak_bench)" >&2; exit 1; }
"$py" -c "import torch, numpy" 2>/dev/null ||
  { echo "error: $py cannot import torch and numpy (apt-get install python3-torch python3-numpy)" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# field JSON KEY: one value of a flat JSON object.
if command -v jq >/dev/null 2>&1; then
  field() { jq -r ".$2" <<<"$1"; }
else
  field() { "$py" -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
fi
# last_json: the last line of stdin that is a JSON object (the result line).
last_json() { grep '^{' | tail -n 1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

echo "peak_bench: float32 FMA ceiling, every core ..." >&2
peak="$(OMP_WAIT_POLICY=active "$peak_bench" --benchmark_filter='^fma_peak/f32/all_threads' \
  --benchmark_min_time=0.5 --benchmark_format=json | "$py" -c 'import json, sys
print(json.load(sys.stdin)["benchmarks"][0]["GFLOP/s"])')"

echo "creating a random checkpoint of configs/small.yml ..." >&2
"$bin" init --config "$root/configs/small.yml" --out "$tmp/small" --seed 1 >&2

args=(--model "$tmp/small" --prompt-len "$prompt_len" --new-tokens "$new_tokens")
rows=()
# median V...: the median of the values.
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
for b in $batches; do
  ops=() tps=() ods=() tds=() prs=()
  for ((r = 1; r <= rounds; r++)); do
    echo "batch $b, round $r of $rounds: deepseek.cpp ..." >&2
    ours="$("$bin" --threads "$threads" --matmul-precision "$ours_precision" bench "${args[@]}" --batch "$b" |
      last_json)"
    echo "batch $b, round $r of $rounds: torch ..." >&2
    theirs="$("$py" "$root/bench/torch_generate.py" "${args[@]}" --batch "$b" --threads "$threads" \
      --dtype "$torch_dtype" | last_json)"
    if [ -z "$ours" ] || [ -z "$theirs" ]; then
      echo "error: a benchmark printed no JSON result" >&2
      exit 1
    fi
    ops+=("$(field "$ours" prefill_tokens_per_s)") tps+=("$(field "$theirs" prefill_tokens_per_s)")
    ods+=("$(field "$ours" decode_tokens_per_s)") tds+=("$(field "$theirs" decode_tokens_per_s)")
    prs+=("$(ratio "${ops[-1]}" "${tps[-1]}")")
  done
  op="$(median "${ops[@]}")" tp="$(median "${tps[@]}")" od="$(median "${ods[@]}")" td="$(median "${tds[@]}")"
  spread=""
  if [ "$rounds" -gt 1 ]; then spread="$(printf '%s\n' "${prs[@]}" | sort -g | sed -n '1p;$p' | paste -sd- -)"; fi
  flops="$(field "$ours" prefill_model_flops_per_token)"
  pct() { awk -v r="$1" -v f="$flops" -v p="$peak" 'BEGIN { printf "%.0f%%", 100 * r * f * 1e-9 / p }'; }
  rows+=("$(printf '%5s | %10.1f %10.1f %6s | %6.1f %6s %6s %8s | %10.1f %10.1f %6s%s' \
    "$b" "$op" "$tp" "$(ratio "$op" "$tp")" "$(awk -v r="$op" -v f="$flops" 'BEGIN { print r * f * 1e-9 }')" \
    "$(pct "$op")" "$(pct "$tp")" "$(pct "$(awk -v t="$tp" 'BEGIN { print 2 * t }')")" \
    "$od" "$td" "$(ratio "$od" "$td")" "${spread:+ | $spread}")")
done

echo
echo "machine: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1), $(nproc) cores," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "torch:   $("$py" -c 'import torch; print(torch.__version__)') ($torch_dtype eager), threads $threads," \
  "OMP_WAIT_POLICY ${OMP_WAIT_POLICY:-PASSIVE}"
echo "ours:    SIMD kernels $("$bin" selfcheck | sed -n 's/^SIMD kernels: \([A-Z0-9]*\).*/\1/p')${ISA:+ (capped: ISA=$ISA)}," \
  "matmul precision $ours_precision$([[ "$(field "$ours" bf16_dot_products)" =~ ^[Tt]rue$ ]] && echo ' (bf16 dot products)')"
echo "model:   configs/small.yml (random weights), prompt $prompt_len tokens, $new_tokens decode steps, greedy"
printf 'peak:    float32 FMA %.1f GFLOP/s, every core at once (peak_bench, this run)\n' "$peak"
head1="" head2="" rule=""
if [ "$rounds" -gt 1 ]; then
  echo "rounds:  $rounds alternated runs of each side per batch size; tok/s are the medians"
  head1=" | prefill ratio" head2=" | rounds' range" rule="+---------------"
fi
echo
decode_head="decode tok/s"
[ -z "$head1" ] || decode_head="$(printf '%-28s' "$decode_head")"
printf '%5s | %-28s | %-29s | %s%s\n' "" "prefill tok/s" "prefill GFLOP/s, % of peak" "$decode_head" "$head1"
printf '%5s | %10s %10s %6s | %6s %6s %6s %8s | %10s %10s %6s%s\n' batch ours torch ratio ours ours torch "2x torch" \
  ours torch ratio "$head2"
echo "------+------------------------------+-------------------------------+------------------------------$rule"
for r in "${rows[@]}"; do echo "$r"; done
