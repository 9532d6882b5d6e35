#!/usr/bin/env bash
# `deepseek perplexity` end to end on tiny V3 and V4 folders: a text, a
# token file and a prepared corpus split, llama-perplexity's final line and
# the JSON object, and one error line with exit code 2 for bad input. The
# arithmetic is checked in tests/perplexity_test.cc.
# Usage: perplexity_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

m="$tmp/tiny"
"$bin" init --config "$src/configs/tiny.yml" --out "$m" --seed 3 >/dev/null || { echo "FAIL: init"; exit 1; }
cp "$src/tests/data/tokenizer/tiny/tokenizer.json" "$m/"
field() { grep -o "\"$1\":[0-9.e+-]*" <<<"$2" | cut -d: -f2; }

out=$("$bin" perplexity --model "$m" --data "$src/README.md" --ctx 64 --chunks 3 --json 2>"$tmp/err")
check '[ $? -eq 0 ]' "perplexity --data ($(tail -1 "$tmp/err"))"
check '[ "$(field chunks "$out")" = 3 ] && [ "$(field scored "$out")" = 93 ]' "3 chunks of 64, 31 scored each: $out"
check 'awk -v p="$(field ppl "$out")" -v n="$(field mean_nll "$out")" "BEGIN { exit !(p > 1 && (p - exp(n))^2 < 1e-12 * p * p) }"' \
  "ppl is exp(mean NLL): $out"
check 'grep -q "^\[1\][0-9.]*,\[2\][0-9.]*,\[3\][0-9.]*," "$tmp/err"' "running values on stderr as llama-perplexity prints them"
check '"$bin" perplexity --model "$m" --data "$src/README.md" --ctx 64 --chunks 2 2>/dev/null | grep -q "^Final estimate: PPL = [0-9.]* +/- [0-9.]*$"' \
  "llama-perplexity's final line"

# A token file (one list here; several are joined in order).
seq_ids=$(seq 0 299 | awk '{ printf "%s%d", (NR > 1 ? "," : ""), ($1 * 37) % 280 }')
echo "[[$seq_ids]]" >"$tmp/ids.json"
a=$("$bin" perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 50 --json 2>/dev/null)
check '[ "$(field chunks "$a")" = 6 ] && [ "$(field tokens "$a")" = 300 ]' "perplexity --tokens: $a"
b=$("$bin" perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 50 --chunks 2 --json 2>/dev/null)
check '[ "$(field chunks "$b")" = 2 ] && [ "$(field ppl "$b")" != "$(field ppl "$a")" ]' "--chunks 2: $b"

# --prefill N: the rest of each chunk one token a step (the decode path);
# with float weights the same perplexity up to the order of sums.
for n in 1 10; do
  e=$("$bin" perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 50 --prefill $n --json 2>/dev/null)
  check 'awk -v a="$(field ppl "$a")" -v e="$(field ppl "$e")" "BEGIN { exit !((a - e)^2 < 1e-10 * a * a) }"' \
    "--prefill $n gives the one-step perplexity: $e against $a"
  check '[ "$(field prefill "$e")" = $n ]' "--prefill $n is reported: $e"
done

# A prepared corpus's eval split.
"$bin" prepare --tokenizer "$m/tokenizer.json" --input "$src/docs/*.md" --out "$tmp/corpus" --eval-fraction 0.3 >/dev/null
c=$("$bin" perplexity --model "$m" --corpus "$tmp/corpus" --ctx 128 --chunks 4 --json 2>/dev/null)
check '[ "$(field chunks "$c")" = 4 ]' "perplexity --corpus: $c"
check '"$bin" perplexity --model "$m" --corpus "$tmp/corpus" --split train --ctx 128 --chunks 1 >/dev/null 2>&1' "--split train"

# A DeepSeek-V4 folder through the same command.
"$bin" init --config "$src/configs/v4-tiny.yml" --out "$tmp/v4" --seed 3 >/dev/null
d=$("$bin" perplexity --model "$tmp/v4" --tokens "$tmp/ids.json" --ctx 50 --chunks 2 --json 2>/dev/null)
check '[ "$(field chunks "$d")" = 2 ]' "perplexity of a V4 folder: $d"

expect_error perplexity --model "$m"
expect_error perplexity --model "$m" --data "$src/README.md" --tokens "$tmp/ids.json"
expect_error perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 200
expect_error perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 5000
expect_error perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 2
expect_error perplexity --model "$m" --tokens "$tmp/ids.json" --chunks 0
expect_error perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 50 --prefill 51
expect_error perplexity --model "$m" --tokens "$tmp/ids.json" --ctx 50 --prefill -1
expect_error perplexity --model "$m" --corpus "$tmp/corpus" --split test
expect_error perplexity --model "$m" --corpus "$tmp/missing"
echo '[[1, 2, 99999]]' >"$tmp/bad.json"
expect_error perplexity --model "$m" --tokens "$tmp/bad.json"
echo '[[1, 2' >"$tmp/cut.json"
expect_error perplexity --model "$m" --tokens "$tmp/cut.json"
printf '\xff\xfe' >"$tmp/bad.txt"
expect_error perplexity --model "$m" --data "$tmp/bad.txt"
expect_error perplexity --model "$tmp/missing" --tokens "$tmp/ids.json"

[ "$fail" -eq 0 ] && echo "perplexity cli: all checks passed"
exit "$fail"
