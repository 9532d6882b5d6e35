#!/usr/bin/env bash
# Every GPU check of the CUDA backend in one run, on a machine with an NVIDIA
# Hopper GPU (H100/H200):
#   1. the backend harness (tests/backend_ops_test.cc): every CUDA op against
#      the CPU's on random inputs;
#   2. the same harness under compute-sanitizer's memcheck, where it is
#      installed (out-of-bounds and misaligned accesses; no leak check: the
#      backend keeps its cuBLASLt workspace and scratch buffers for the
#      process's life);
#   3. bench/cuda_ops_bench, then bench/cuda_compare.py: PyTorch eager on the
#      same shapes on the same GPU, and the ratio (skipped without PyTorch).
#
#   cmake -B build-cuda -DDEEPSEEK_CUDA=ON && cmake --build build-cuda -j --target backend_ops_test cuda_ops_bench
#   scripts/cuda_check.sh build-cuda [out-dir]
#
# Logs and the benchmark's JSON go to out-dir (default: build-cuda/cuda_check).
set -uo pipefail
build=${1:?usage: scripts/cuda_check.sh BUILD_DIR [OUT_DIR]}
out=${2:-$build/cuda_check}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$out/gpu.txt"

echo "== backend harness"
"$build/tests/backend_ops_test" 2>&1 | tee "$out/harness.log" | grep -E "^\[  (FAILED|SKIPPED|PASSED) |Failure|rel_err|Expected" 
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
tail -3 "$out/harness.log"

if command -v compute-sanitizer >/dev/null; then
  echo "== harness under compute-sanitizer memcheck"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$build/tests/backend_ops_test" --gtest_filter='BackendOps.*' >"$out/memcheck.log" 2>&1
  rc=$?
  tail -4 "$out/memcheck.log"
  [ $rc -eq 0 ] || { echo "memcheck: exit $rc"; status=1; }
fi

echo "== benchmarks"
"$build/bench/cuda_ops_bench" --benchmark_format=json --benchmark_out="$out/ours.json" \
  --benchmark_out_format=json --benchmark_min_time=0.3 >"$out/bench.log" 2>&1 || { status=1; tail -20 "$out/bench.log"; }
if python3 -c "import torch" 2>/dev/null; then
  python3 "$here/bench/cuda_compare.py" "$out/ours.json" 2>&1 | tee "$out/compare.txt"
else
  echo "PyTorch not found: no comparison"
fi
exit $status
