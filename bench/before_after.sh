#!/usr/bin/env bash
# Two builds of `deepseek` side by side on the same machine, alternated
# ROUNDS times (default 5): generation (`deepseek bench`, prefill and decode
# tokens/s) and training (`deepseek train`, tokens/s of the steps after the
# first) for a DeepSeek-V3 model (configs/small.yml) and a DeepSeek-V4 one
# (configs/v4-tiny.yml). Prints each figure's median per build and the
# ratio new / old (STEPS=N training steps a run, default 30). Use it to
# show that a change costs no speed:
#
#   bench/before_after.sh OLD/deepseek NEW/deepseek [ROUNDS]
#
# TRAIN_ARGS (space-separated run keys) go to both builds' training runs,
# e.g. a remat policy.
#
# Both builds read the same model folders (written by NEW's `init`), so the
# weights are the same.
set -euo pipefail
old=$1 new=$2 rounds=${3:-5}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$new" init --config "$root/configs/small.yml" --out "$tmp/v3" --seed 1 >/dev/null
"$new" init --config "$root/configs/v4-tiny.yml" --out "$tmp/v4" --seed 1 >/dev/null

gen() {  # BIN MODEL -> "prefill decode"
  "$1" bench --model "$2" --batch 4 --prompt-len 128 --new-tokens 32 --repeat 3 |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["prefill_tokens_per_s"], j["decode_tokens_per_s"])'
}
train() {  # BIN PRESET -> tokens/s (median of the steps after the first)
  local run="$tmp/run.$RANDOM"
  # shellcheck disable=SC2086  # TRAIN_ARGS splits into keys
  "$1" train "$root/configs/train-tiny.yml" "model_name=$2" dataset_type=synthetic "steps=${STEPS:-30}" \
    per_device_batch_size=8 \
    max_target_length=128 enable_checkpointing=false eval_interval=-1 "base_output_directory=$run" run_name=r \
    log_period=1000 ${TRAIN_ARGS:-} 2>/dev/null >/dev/null
  python3 -c 'import json,sys,statistics
v=[json.loads(l)["tokens_per_sec"] for l in open(sys.argv[1])][1:]
print(statistics.median(v))' "$run/r/metrics.jsonl"
  rm -rf "$run"
}

declare -A results
for ((r = 0; r < rounds; ++r)); do
  for who in old new; do
    bin=${!who}
    for m in v3 v4; do
      read -r p d <<<"$(gen "$bin" "$tmp/$m")"
      results[$who.$m.prefill]+="$p "
      results[$who.$m.decode]+="$d "
    done
    results[$who.v3.train]+="$(train "$bin" small) "
    results[$who.v4.train]+="$(train "$bin" v4-tiny) "
  done
done

printf "%-22s %12s %12s %8s\n" "tokens/s (median)" old new "new/old"
for key in v3.prefill v3.decode v3.train v4.prefill v4.decode v4.train; do
  python3 - "${results[old.$key]}" "${results[new.$key]}" "$key" <<'EOF'
import statistics, sys
o = statistics.median(map(float, sys.argv[1].split()))
n = statistics.median(map(float, sys.argv[2].split()))
print(f"{sys.argv[3]:<22} {o:12.0f} {n:12.0f} {n / o:8.3f}")
EOF
done
echo "($rounds alternated rounds; $(nproc) threads; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
