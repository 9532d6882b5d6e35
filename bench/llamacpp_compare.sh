#!/usr/bin/env bash
# A model trained here, run by llama.cpp: deepseek.cpp and llama.cpp side by
# side on the same weights. Usage:
#   bench/llamacpp_compare.sh CHECKPOINT TEXT [BUILD_DIR]
# CHECKPOINT is a training checkpoint (runs/RUN/checkpoints/step_N, as
# scripts/run.sh makes one), TEXT a UTF-8 file for perplexity (e.g. a
# State of the Union address from data/sotu). The script
#  1. builds llama.cpp from the source that npm's node-llama-cpp package
#     bundles (LLAMACPP_VERSION, default 3.22.1), once, in LLAMACPP_DIR
#     (default ~/.cache/deepseek-llamacpp; never inside this repository);
#  2. exports the checkpoint as a Hugging Face folder (bf16) and as GGUF
#     files (`deepseek export --format gguf`: f32, bf16, q8_0);
#  3. greedy text: `deepseek generate` against llama-completion (--temp 0)
#     on each GGUF, PROMPT and NEW_TOKENS, and whether they are the same;
#  4. perplexity: `deepseek perplexity --data TEXT --ctx CTX` against
#     llama-perplexity -f TEXT -c CTX on each GGUF, and their ratio;
#  5. speed: `deepseek bench` (bf16 folder) against llama-bench on the
#     bf16 and q8_0 files, decode (tg) and prefill (pp) tokens/s at batch 1,
#     medians of REPEAT runs, with the ratio ours / llama.cpp.
# Needs cmake, a C++ compiler and npm (only to fetch node-llama-cpp).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ckpt="${1:?usage: llamacpp_compare.sh CHECKPOINT TEXT [BUILD_DIR]}"
text="${2:?usage: llamacpp_compare.sh CHECKPOINT TEXT [BUILD_DIR]}"
build="${3:-$root/build}"
bin="$build/deepseek"
version="${LLAMACPP_VERSION:-3.22.1}"
cache="${LLAMACPP_DIR:-$HOME/.cache/deepseek-llamacpp}"
prompt="${PROMPT:-Fellow citizens, the state of the Union}"
new_tokens="${NEW_TOKENS:-64}"
ctx="${CTX:-128}"
repeat="${REPEAT:-3}"
threads="${THREADS:-$(nproc)}"

source "$root/bench/llamacpp_build.sh"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" export --checkpoint "$ckpt" --out "$tmp/hf" >/dev/null
for t in f32 bf16 q8_0; do "$bin" export --checkpoint "$ckpt" --out "$tmp/m-$t.gguf" --format gguf --dtype "$t" >/dev/null; done
echo "llama.cpp: node-llama-cpp $version ($(git -C "$src" log -1 --format=%h)); threads $threads; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"

echo "## greedy text, $new_tokens tokens after \"$prompt\""
ours=$("$bin" generate --model "$tmp/hf" --prompt "$prompt" --max-new-tokens "$new_tokens" --temperature 0 2>/dev/null)
for t in f32 bf16 q8_0; do
  theirs=$("$lbin/llama-completion" -m "$tmp/m-$t.gguf" -p "$prompt" -n "$new_tokens" --temp 0 -no-cnv -t "$threads" \
    2>/dev/null)
  if [ "$ours" == "$theirs" ]; then same=same; else same=DIFFERENT; fi
  echo "$t: $same"
  [ "$same" == same ] || printf '  ours:      %s\n  llama.cpp: %s\n' "$ours" "$theirs"
done

echo "## perplexity, ctx $ctx, $(basename "$text")"
ppl_ours=$("$bin" perplexity --model "$tmp/hf" --data "$text" --ctx "$ctx" 2>/dev/null | grep -o 'PPL = [0-9.]*' | cut -d' ' -f3)
echo "deepseek.cpp (bf16 folder): $ppl_ours"
for t in f32 bf16 q8_0; do
  p=$("$lbin/llama-perplexity" -m "$tmp/m-$t.gguf" -f "$text" -c "$ctx" -t "$threads" 2>&1 |
    grep -o 'PPL = [0-9.]*' | cut -d' ' -f3)
  echo "llama.cpp $t: $p (ratio ours / llama.cpp $(awk -v a="$ppl_ours" -v b="$p" 'BEGIN { printf "%.4f", a / b }'))"
done

echo "## batch-1 speed (tokens/s, median of $repeat)"
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
pp=64
for k in $(seq "$repeat"); do
  "$bin" bench --model "$tmp/hf" --batch 1 --prompt-len "$pp" --new-tokens "$new_tokens" --repeat 1 2>/dev/null
done >"$tmp/ours.jsonl"
ours_tg=$(grep -o '"decode_tokens_per_s":[0-9.e+-]*' "$tmp/ours.jsonl" | cut -d: -f2 | median)
ours_pp=$(grep -o '"prefill_tokens_per_s":[0-9.e+-]*' "$tmp/ours.jsonl" | cut -d: -f2 | median)
echo "deepseek.cpp bf16: decode $ours_tg, prefill $ours_pp"
for t in bf16 q8_0; do
  "$lbin/llama-bench" -m "$tmp/m-$t.gguf" -p "$pp" -n "$new_tokens" -r "$repeat" -t "$threads" -o csv 2>/dev/null >"$tmp/l.csv"
  # avg_ts of the row with n_prompt = pp, n_gen = 0 (prefill) and of the
  # row with n_prompt = 0, n_gen = new_tokens (decode).
  col() { tr -d '"' <"$tmp/l.csv" | awk -F, -v p="$1" -v g="$2" 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
    $c["n_prompt"] == p && $c["n_gen"] == g { print $c["avg_ts"] }'; }
  tg=$(col 0 "$new_tokens")
  ppt=$(col "$pp" 0)
  echo "llama.cpp $t: decode $tg, prefill $ppt (ours / llama.cpp: decode $(awk -v a="$ours_tg" -v b="$tg" 'BEGIN { printf "%.2f", a / b }'), prefill $(awk -v a="$ours_pp" -v b="$ppt" 'BEGIN { printf "%.2f", a / b }'))"
done
