#!/usr/bin/env bash
# DeepSeek-V3.2 sparse attention (DSA) against dense attention on the same
# model, at growing context lengths. Usage:
#   bench/dsa_compare.sh [BUILD_DIR]     # BUILD_DIR defaults to build
# The model is a random checkpoint of the `small` preset with the indexer on
# (use_indexer; INDEX_HEADS heads of INDEX_DIM, top INDEX_TOPK keys). For
# each length in LENGTHS, `deepseek bench` runs batch 1, the whole prompt in
# one prefill step, then NEW_TOKENS decode steps, twice: sparse (the
# indexer picks each query's keys) and --dense-attention (every key, the
# indexer off). Columns: prefill and decode tokens/s of each, their ratio
# sparse / dense (above 1: sparse is faster), and the decode step time.
# Each figure is the median of REPEAT timed runs after a warm-up.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
bin="$build/deepseek"
lengths="${LENGTHS:-2048 8192 32768}"
new_tokens="${NEW_TOKENS:-16}"
repeat="${REPEAT:-1}"
heads="${INDEX_HEADS:-4}"
dim="${INDEX_DIM:-32}"
topk="${INDEX_TOPK:-1024}"

[ -x "$bin" ] || { echo "error: $bin not found; build the project first (or pass BUILD_DIR)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# field JSON KEY: one number of the result line.
field() { sed -E "s/.*\"$2\":([0-9.e+-]+).*/\1/" <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

max=0
for n in $lengths; do [ "$n" -gt "$max" ] && max=$n; done
echo "creating a random V3.2 checkpoint of configs/small.yml (indexer $heads x $dim, top $topk) ..." >&2
"$bin" init --config "$root/configs/small.yml" --out "$tmp/model" --seed 1 --set use_indexer=true \
  --set indexer_n_heads="$heads" --set indexer_head_dim="$dim" --set indexer_topk="$topk" \
  --set max_position_embeddings=$((max + new_tokens + 2)) >&2

printf '| %7s | %14s | %13s | %5s | %13s | %12s | %5s | %15s | %14s |\n' context "prefill sparse" "prefill dense" ratio \
  "decode sparse" "decode dense" ratio "step ms sparse" "step ms dense"
printf '|---------|----------------|---------------|-------|---------------|--------------|-------|-----------------|----------------|\n'
for n in $lengths; do
  args=(--model "$tmp/model" --prompt-len "$n" --new-tokens "$new_tokens" --repeat "$repeat" --prefill-chunk 0)
  echo "context $n: sparse ..." >&2
  s="$("$bin" bench "${args[@]}" | grep '^{' | tail -n 1)"
  echo "context $n: dense ..." >&2
  d="$("$bin" bench "${args[@]}" --dense-attention | grep '^{' | tail -n 1)"
  sp=$(field "$s" prefill_tokens_per_s) dp=$(field "$d" prefill_tokens_per_s)
  sd=$(field "$s" decode_tokens_per_s) dd=$(field "$d" decode_tokens_per_s)
  printf '| %7s | %14.0f | %13.0f | %5s | %13.1f | %12.1f | %5s | %15.2f | %14.2f |\n' "$n" "$sp" "$dp" \
    "$(ratio "$sp" "$dp")" "$sd" "$dd" "$(ratio "$sd" "$dd")" "$(awk -v t="$sd" 'BEGIN { print 1000 / t }')" \
    "$(awk -v t="$dd" 'BEGIN { print 1000 / t }')"
done
