#!/usr/bin/env bash
# Training-step throughput of deepseek.cpp against the same step in PyTorch eager
# mode (bench/torch_train.py) on this CPU, in one run. Usage:
#   bench/train_compare.sh [BUILD_DIR]                  # BUILD_DIR defaults to build
#   PRECISION=bf16 bench/train_compare.sh [BUILD_DIR]   # both sides in bf16
# PRECISION=bf16: ours is train_step_bench's TrainStepBf16 (dtype=bfloat16:
# bf16 matmul operands, float32 sums and weights), PyTorch's forward runs
# under torch.autocast("cpu", dtype=torch.bfloat16); the ceiling is then the
# bf16 dot-product rate (peak_bench dot_peak/bf16) and the float32 step of
# ours is measured beside it (the "vs f32" column: ours / ours in float32).
# Needs BUILD_DIR/bench/{train_step_bench,matmul_bench,peak_bench}
# (cmake --build BUILD_DIR --target train_step_bench matmul_bench peak_bench).
#
# One step = forward + backward of the LM loss (mean cross-entropy over the
# targets; no MTP, no z-loss, no balance loss) on a batch of 8 x 128 random
# tokens, random weights (N(0, 0.02) matrices, unit norms), every core:
#   ours:  train_step_bench's TrainStep/PRESET/POLICY case (model::loss_and_grad
#          into a gradient buffer), median of REPS Google Benchmark repetitions
#          after a warm-up; POLICY is the remat policy (full keeps the fewest
#          residuals and recomputes the most; minimal keeps every projection's
#          output);
#   torch: torch_train.py on the same preset and shape (zero_grad(set_to_none),
#          forward, loss.backward(); eager autograd keeps every residual),
#          median of the timed steps after warm-up steps.
# ratio = ours / torch tokens/s (above 1: the engine is faster). TFLOP/s is
# MaxText's accounting (6 x the matmul parameters each token meets, plus causal
# attention; recompute not counted), the same FLOPs per token for both sides;
# "% sgemm" divides it by the raw dnnl_sgemm rate of matmul_bench at
# 1024 x 1024 x 1024 measured in the same run (the BLAS the engine calls).
# cblas_sgemm (OpenBLAS, the BLAS Debian's PyTorch calls) is printed beside it.
# "% peak" divides it by the float32 FMA ceiling of every core at once
# (peak_bench, same run), and "3x torch" is what three times PyTorch's tokens/s
# would need of that ceiling: above 100% no float32 step can reach it here.
#
# Settings (environment): PRESETS (default "tiny small"), POLICIES (default
# "full minimal"), REPS (3), MIN_TIME (seconds per repetition, 1),
# TORCH_STEPS_tiny / TORCH_STEPS_small (timed steps, 30 / 7), TORCH_WARMUP (3).
# Ours runs with OMP_WAIT_POLICY=active (as the deepseek program sets for
# itself), PyTorch with PASSIVE (its fastest here: with ACTIVE its OpenMP and
# OpenBLAS pools fight over the cores); override with OURS_OMP_WAIT_POLICY /
# TORCH_OMP_WAIT_POLICY.
# ISA=avx2 caps both sides to AVX2 on an AVX-512 machine, as an AVX2-only CPU
# would run them: the engine's SIMD kernels (DEEPSEEK_MAX_CPU_ISA) and oneDNN
# (ONEDNN_MAX_CPU_ISA), PyTorch's own kernels (ATEN_CPU_CAPABILITY) and
# OpenBLAS (OPENBLAS_CORETYPE=Haswell).
# Needs Debian's python3-torch and python3-numpy (PYTHON, default /usr/bin/python3).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
train_bench="$build/bench/train_step_bench"
matmul_bench="$build/bench/matmul_bench"
peak_bench="$build/bench/peak_bench"
py="${PYTHON:-/usr/bin/python3}"
presets="${PRESETS:-tiny small}"
precision="${PRECISION:-f32}"
case "$precision" in
  f32) step_case=TrainStep peak_case=fma_peak/f32/all_threads ;;
  bf16) step_case=TrainStepBf16 peak_case=dot_peak/bf16/all_threads ;;
  *) echo "error: PRECISION=$precision: f32 or bf16" >&2; exit 1 ;;
esac
policies="${POLICIES:-full minimal}"
reps="${REPS:-3}"
min_time="${MIN_TIME:-1}"
torch_warmup="${TORCH_WARMUP:-3}"
batch=8 seq=128 # the shape train_step_bench registers
threads="$(nproc)"
ours_wait="${OURS_OMP_WAIT_POLICY:-active}"
torch_wait="${TORCH_OMP_WAIT_POLICY:-PASSIVE}"
case "${ISA:-}" in
  "") ;;
  avx2) export DEEPSEEK_MAX_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell ;;
  *) echo "error: ISA=$ISA: only avx2 can be capped to" >&2; exit 1 ;;
esac

for b in "$train_bench" "$matmul_bench" "$peak_bench"; do
  [ -x "$b" ] || {
    echo "error: $b not found; build it first (cmake --build $build --target train_step_bench matmul_bench peak_bench) or pass BUILD_DIR" >&2
    exit 1
  }
done
"$py" -c "import torch, numpy" 2>/dev/null ||
  { echo "error: $py cannot import torch and numpy (apt-get install python3-torch python3-numpy)" >&2; exit 1; }
for p in $presets; do
  [ -f "$root/configs/$p.yml" ] || { echo "error: no preset configs/$p.yml" >&2; exit 1; }
done

load_at_start="$(cut -d' ' -f1-3 /proc/loadavg)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# gbench_counter FILE NAME_PREFIX COUNTER: COUNTER of the median aggregate (or
# the single run) of the first benchmark in Google Benchmark JSON FILE whose
# name starts with NAME_PREFIX; "real_time_ms" gives its time per iteration in ms.
gbench_counter() {
  "$py" - "$@" <<'EOF'
import json, sys
path, prefix, key = sys.argv[1:]
runs = [b for b in json.load(open(path))["benchmarks"] if b["name"].startswith(prefix)]
med = [b for b in runs if b.get("aggregate_name") == "median"] or [b for b in runs if b.get("run_type") == "iteration"]
if not med:
    sys.exit(f"error: no result for {prefix} in {path}")
b = med[0]
if key == "real_time_ms":
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
    print(b["real_time"] * scale)
else:
    print(b[key])
EOF
}
# field JSON KEY: one value of a flat JSON object.
field() { "$py" -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
# last_json: the last line of stdin that is a JSON object (the result line).
last_json() { grep '^{' | tail -n 1 || true; }
calc() { awk "BEGIN { printf \"$1\", $2 }"; }

# Raw sgemm rates, GFLOP/s (matmul_bench registers dnnl before cblas, so
# OpenBLAS's spinning threads cannot slow the oneDNN run).
echo "matmul_bench: raw sgemm 1024 x 1024 x 1024 ..." >&2
OMP_WAIT_POLICY="$ours_wait" "$matmul_bench" --benchmark_filter='^matmul/(dnnl|cblas)_sgemm/1024x1024x1024/' \
  --benchmark_min_time=0.5 --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  --benchmark_format=json >"$tmp/sgemm.json" 2>"$tmp/sgemm.err" ||
  { cat "$tmp/sgemm.err" >&2; echo "error: matmul_bench failed" >&2; exit 1; }
dnnl_gflops="$(gbench_counter "$tmp/sgemm.json" matmul/dnnl_sgemm/1024x1024x1024 GFLOP/s)"
cblas_gflops="$(gbench_counter "$tmp/sgemm.json" matmul/cblas_sgemm/1024x1024x1024 GFLOP/s)"
echo "peak_bench: $precision ceiling ($peak_case), every core ..." >&2
OMP_WAIT_POLICY="$ours_wait" "$peak_bench" --benchmark_filter="^$peak_case" --benchmark_min_time=0.5 \
  --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  --benchmark_format=json >"$tmp/peak.json" 2>"$tmp/peak.err" ||
  { cat "$tmp/peak.err" >&2; echo "error: peak_bench failed" >&2; exit 1; }
peak_gflops="$(gbench_counter "$tmp/peak.json" "$peak_case" GFLOP/s)"
awk -v p="$peak_gflops" 'BEGIN { exit !(p > 0) }' ||
  { echo "error: no $peak_case ceiling here (the CPU has no bf16 dot products, or the cap forbids them)" >&2; exit 1; }

rows=()
for p in $presets; do
  # Ours: every policy of this preset in one process.
  pol_re="$(tr ' ' '|' <<<"$policies")"
  echo "$p: deepseek.cpp train_step_bench ($policies) ..." >&2
  OMP_WAIT_POLICY="$ours_wait" OMP_NUM_THREADS="$threads" "$train_bench" \
    --benchmark_filter="^(TrainStep|$step_case)/$p/($pol_re)/$batch/$seq/" --benchmark_min_warmup_time=0.5 \
    --benchmark_min_time="$min_time" --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
    --benchmark_format=json >"$tmp/ours_$p.json" 2>"$tmp/ours_$p.err" ||
    { cat "$tmp/ours_$p.err" >&2; echo "error: train_step_bench failed" >&2; exit 1; }

  echo "$p: torch ..." >&2
  steps_var="TORCH_STEPS_$p"
  default_steps=7
  [ "$p" = tiny ] && default_steps=30
  theirs="$(OMP_WAIT_POLICY="$torch_wait" "$py" "$root/bench/torch_train.py" --config "$root/configs/$p.yml" \
    --batch "$batch" --seq "$seq" --threads "$threads" --warmup "$torch_warmup" --precision "$precision" \
    --steps "${!steps_var:-$default_steps}" | last_json)"
  [ -n "$theirs" ] || { echo "error: torch_train.py printed no JSON result" >&2; exit 1; }
  tt="$(field "$theirs" tokens_per_s)" tms="$(field "$theirs" step_ms)"

  for pol in $policies; do
    name="$step_case/$p/$pol/$batch/$seq/"
    ot="$(gbench_counter "$tmp/ours_$p.json" "$name" tokens_per_s)"
    o32="$(gbench_counter "$tmp/ours_$p.json" "TrainStep/$p/$pol/$batch/$seq/" tokens_per_s)"
    oms="$(gbench_counter "$tmp/ours_$p.json" "$name" real_time_ms)"
    otf="$(gbench_counter "$tmp/ours_$p.json" "$name" TFLOP_per_s)"
    ttf="$(calc %.4f "$otf * $tt / $ot")" # same FLOPs per token
    rows+=("$(printf '%-6s %-8s | %9.0f %9.0f %6s %6s | %8.1f %8.1f | %7.3f %7.3f | %5s%% %5s%% | %5s%% %5s%% | %7s%%' \
      "$p" "$pol" "$ot" "$tt" "$(calc %.2f "$ot / $tt")" "$(calc %.2f "$ot / $o32")" "$oms" "$tms" "$otf" "$ttf" \
      "$(calc %.1f "100 * $otf * 1000 / $dnnl_gflops")" "$(calc %.1f "100 * $ttf * 1000 / $dnnl_gflops")" \
      "$(calc %.1f "100 * $otf * 1000 / $peak_gflops")" "$(calc %.1f "100 * $ttf * 1000 / $peak_gflops")" \
      "$(calc %.0f "300 * $ttf * 1000 / $peak_gflops")")")
  done
done

echo
echo "machine: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1), $(nproc) cores," \
  "$(grep -q avx512f /proc/cpuinfo && echo AVX-512 || echo no AVX-512)," \
  "load average $load_at_start at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end"
echo "torch:   $("$py" -c 'import torch; print(torch.__version__)') (eager, $precision), threads $threads," \
  "OMP_WAIT_POLICY $torch_wait${ISA:+ (capped: ISA=$ISA)}"
echo "ours:    $(basename "$build")/bench/train_step_bench, OMP_WAIT_POLICY $ours_wait, OMP threads $threads${ISA:+ (capped: ISA=$ISA)}"
echo "step:    forward + backward, batch $batch x $seq random tokens, random weights, $precision" \
  "(ours: $step_case; vs f32 = ours / ours in float32)"
printf 'sgemm:   dnnl_sgemm %.1f GFLOP/s, cblas_sgemm (OpenBLAS) %.1f GFLOP/s at 1024^3 (matmul_bench, this run)\n' \
  "$dnnl_gflops" "$cblas_gflops"
printf 'peak:    %s %.1f GFLOP/s, every core at once (peak_bench, this run)\n' "$peak_case" "$peak_gflops"
echo
printf '%-15s | %-33s | %-17s | %-15s | %-13s | %-13s | %s\n' "" "tokens/s" "ms / step" "TFLOP/s" "% dnnl_sgemm" \
  "% peak" "3x torch"
printf '%-6s %-8s | %9s %9s %6s %6s | %8s %8s | %7s %7s | %6s %6s | %6s %6s | %8s\n' preset policy ours torch ratio \
  "vs f32" ours torch ours torch ours torch ours torch "% peak"
echo "----------------+-----------------------------------+-------------------+-----------------+---------------+---------------+---------"
for r in "${rows[@]}"; do echo "$r"; done
