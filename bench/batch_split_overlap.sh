#!/usr/bin/env bash
# How much of a step's communication the batch-split schedule hides, on one
# machine: `mpirun -np 2` with expert parallelism 2 (expert_dispatch
# alltoall), the per-layer collectives (the expert exchange, and the
# non-expert weights' all-gathers and gradient reduce-scatters over the two
# ranks that shard them) delivered through a modeled link
# (link_model_latency_us, link_model_gbps; dist/link_model.h). Usage:
#   bench/batch_split_overlap.sh [BUILD_DIR]          # BUILD_DIR defaults to build
# Environment: PRESET (configs/NAME.yml, default small), BATCH (per rank,
# default 8), SEQ (default 128), STEPS (default 12; the median of the steps
# after the first 2 is used), LATENCY_US (default 20), RATIO (default 1: the
# link's bandwidth is set so that the modeled communication of a step equals
# its compute; 0.5 makes communication half the compute).
#
# Four runs, batch-split off and on (batch_split_factor 2), each without and
# with the link model. Without it the step is compute (plus the shared-memory
# exchange); the link model's own count of latency + bytes / bandwidth is the
# communication a step would wait for if nothing overlapped. Printed: those
# times, max(compute, comm), compute + comm, and the share of the
# communication hidden = 1 - (step with link - step without) / comm.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
bin="$build/deepseek"
preset="${PRESET:-small}"
batch="${BATCH:-8}"
seq="${SEQ:-128}"
steps="${STEPS:-12}"
latency="${LATENCY_US:-20}"
ratio="${RATIO:-1}"

[ -x "$bin" ] || { echo "error: $bin not found; build the project first (or pass BUILD_DIR)" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "error: mpirun not found (apt-get install openmpi-bin)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1

cat >"$tmp/run.yml" <<YML
model_name: $root/configs/$preset.yml
base_output_directory: $tmp/runs
dataset_type: synthetic
steps: $steps
per_device_batch_size: $batch
max_target_length: $seq
enable_checkpointing: false
ici_expert_parallelism: 2
ici_fsdp_parallelism: 1
expert_dispatch: alltoall
log_period: 1000
YML

# median KEY RUN: the median of KEY over the steps after the first two.
median() {
  grep -o "\"$1\":[0-9.e+-]*" "$tmp/runs/$2/metrics.jsonl" | cut -d: -f2 | tail -n +3 | sort -g |
    awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
run() {  # run NAME KEY=VALUE...
  local name=$1
  shift
  mpirun -np 2 "$bin" --threads 1 train "$tmp/run.yml" run_name="$name" "$@" >/dev/null 2>"$tmp/$name.err" ||
    { cat "$tmp/$name.err" >&2; exit 1; }
}

echo "compute only (no link model) ..." >&2
run off use_batch_split_schedule=false
run on use_batch_split_schedule=true batch_split_factor=2
t_off=$(median step_time_seconds off)
t_on=$(median step_time_seconds on)
# The exchange's bytes per step at this shape: one probe step through a fast link.
run probe link_model_gbps=1000 steps=3
probe_seconds=$(median link_model_seconds probe)  # seconds per step at 1000 GB/s (plus latency)
# Bandwidth for communication = RATIO x compute (latency included in the count).
gbps=$(awk -v s="$probe_seconds" -v c="$t_on" -v r="$ratio" 'BEGIN { printf "%.4f", 1000 * s / (r * c) }')
echo "link model: ${latency} us latency, ${gbps} GB/s ..." >&2
run link-off use_batch_split_schedule=false link_model_latency_us="$latency" link_model_gbps="$gbps"
run link-on use_batch_split_schedule=true batch_split_factor=2 link_model_latency_us="$latency" link_model_gbps="$gbps"
l_off=$(median step_time_seconds link-off)
l_on=$(median step_time_seconds link-on)
c_off=$(median link_model_seconds link-off)
c_on=$(median link_model_seconds link-on)
x_off=$(median expert_exchange link-off)
x_on=$(median expert_exchange link-on)

awk -v t_off="$t_off" -v t_on="$t_on" -v l_off="$l_off" -v l_on="$l_on" -v c_off="$c_off" -v c_on="$c_on" \
  -v x_off="$x_off" -v x_on="$x_on" \
  -v preset="$preset" -v b="$batch" -v t="$seq" -v lat="$latency" -v gbps="$gbps" 'BEGIN {
  printf "%s, 2 ranks (expert=2, alltoall), %d x %d tokens per rank, link %s us + %s GB/s; seconds per step (median)\n",
    preset, b, t, lat, gbps
  printf "| batch split | compute (no link) | comm (modeled) | of which expert exchange | max(compute, comm) | compute + comm | step with link | comm hidden |\n"
  printf "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
  n = split("off on", name, " ")
  tc[1] = t_off; tc[2] = t_on; tl[1] = l_off; tl[2] = l_on; cm[1] = c_off; cm[2] = c_on; xe[1] = x_off; xe[2] = x_on
  for (i = 1; i <= 2; ++i) {
    mx = tc[i] > cm[i] ? tc[i] : cm[i]
    hidden = cm[i] > 0 ? 1 - (tl[i] - tc[i]) / cm[i] : 0
    printf "| %s | %.4f | %.4f | %.4f | %.4f | %.4f | %.4f | %.0f%% |\n", name[i], tc[i], cm[i], xe[i], mx, tc[i] + cm[i], tl[i], 100 * hidden
  }
}'
