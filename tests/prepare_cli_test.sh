#!/usr/bin/env bash
# `deepseek prepare` on a few small text files and the tiny fixture
# tokenizer: the shards hold the expected ids (BOS + text + EOS per
# document), the output is the same for the same seed and any thread count,
# shards are cut by --shard-tokens, and bad input gives one error line and
# exit code 2.
# Usage: prepare_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tok="$src/tests/data/tokenizer/tiny/tokenizer.json"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

# The uint32 values of FILE from byte OFFSET on, space-separated.
u32s() { od -An -tu4 -j"$2" "$1" | tr -s ' \n' ' ' | sed 's/^ //; s/ $//'; }

in="$tmp/in"
mkdir -p "$in/sub"
printf 'the hello world\n' >"$in/a.txt"
printf 'aaaaa 12345' >"$in/b.txt"
: >"$in/empty.txt"
printf '{"text": "one"}\n\n{"text": "two", "id": 3}\n{"text": ""}\n' >"$in/c.jsonl"

out="$tmp/out"
summary=$("$bin" prepare --tokenizer "$tok" --input "$in/*.txt" --input "$in/*.jsonl" --out "$out")
check '[ $? -eq 0 ]' "prepare exits 0"
check '[ "$(printf "%s\n" "$summary" | wc -l)" -eq 1 ]' "prepare prints one summary line"
check '[[ "$summary" == "prepared 4 documents (3 train, 1 eval), 26 tokens (21 train, 5 eval) from 4 files into 2 shards"* ]]' \
  "summary: $summary"
check '[[ "$summary" == *"(2 empty documents skipped)" ]]' "summary counts the empty documents"
check '[ -s "$out/meta.json" ] && [ -s "$out/train-00000.tok" ] && [ -s "$out/eval-00000.tok" ]' "meta.json and shards written"
check '! ls "$out" | grep -q tmp' "no temporary files left"
check 'grep -q "\"vocab_size\": 292" "$out/meta.json" && grep -q "\"bos_id\": 285" "$out/meta.json" && grep -q "\"eos_id\": 286" "$out/meta.json"' \
  "meta.json records the tokenizer's vocabulary and special ids"
# Shard layout: 32-byte header, D + 1 offsets, then the tokens.
check '[ "$(head -c 8 "$out/train-00000.tok")" = DSTOKEN1 ]' "shard magic"
check '[ "$(u32s "$out/train-00000.tok" 64)" = "285 260 32 262 282 108 100 10 286 285 267 268 32 275 52 53 286 285 111 271 286" ]' \
  "train shard ids: $(u32s "$out/train-00000.tok" 64)"
check '[ "$(u32s "$out/eval-00000.tok" 48)" = "285 116 119 111 286" ]' "eval shard ids: $(u32s "$out/eval-00000.tok" 48)"

# Unquoted globs (several files after one --input) and one thread give the same bytes.
"$bin" --threads 1 prepare --tokenizer "$tok" --input "$in"/*.txt "$in"/*.jsonl --out "$tmp/again" >/dev/null
check 'cmp -s "$out/train-00000.tok" "$tmp/again/train-00000.tok" && cmp -s "$out/eval-00000.tok" "$tmp/again/eval-00000.tok" && cmp -s "$out/meta.json" "$tmp/again/meta.json"' \
  "prepare is deterministic"

# Small shards: a new shard whenever the next document would pass 10 tokens.
"$bin" prepare --tokenizer "$tok" --input "$in/*" --out "$tmp/small" --shard-tokens 10 --eval-fraction 0.5 --seed 7 >/dev/null
check '[ "$(ls "$tmp/small" | grep -c "\.tok$")" -ge 3 ]' "--shard-tokens cuts shards"
# Preparing into the same folder again with fewer shards removes the old ones.
"$bin" prepare --tokenizer "$tok" --input "$in/a.txt" --out "$tmp/small" >/dev/null
check '[ "$(ls "$tmp/small")" = "$(printf "meta.json\ntrain-00000.tok")" ]' "a re-run leaves only its own shards"
check 'grep -q "\"documents\": 0" "$tmp/small/meta.json"' "one document: an empty eval split"

# Bad input: one line, exit code 2, and nothing half-written reads as complete.
printf 'not json\n' >"$in/sub/bad.jsonl"
printf '{"title": "x"}\n' >"$in/sub/notext.jsonl"
printf '\xff\xfe' >"$in/sub/binary.txt"
: >"$in/sub/empty.txt"
expect_error prepare --tokenizer "$tok" --input "$in/*.txt" --out "$tmp/e1" --eval-fraction 0
expect_error prepare --tokenizer "$tok" --input "$in/*.txt" --out "$tmp/e1" --eval-fraction 1.5
expect_error prepare --tokenizer "$tok" --input "$in/*.txt" --out "$tmp/e1" --shard-tokens 0
expect_error prepare --tokenizer "$tok" --input "$in/*.txt" --out "$tmp/e1" --seed -1
expect_error prepare --tokenizer "$tmp/missing.json" --input "$in/*.txt" --out "$tmp/e1"
expect_error prepare --tokenizer "$tok" --input "$in/*.nothing" --out "$tmp/e1"
expect_error prepare --tokenizer "$tok" --input "$in/sub/bad.jsonl" --out "$tmp/e1"
expect_error prepare --tokenizer "$tok" --input "$in/sub/notext.jsonl" --out "$tmp/e1"
expect_error prepare --tokenizer "$tok" --input "$in/sub/binary.txt" --out "$tmp/e1"
expect_error prepare --tokenizer "$tok" --input "$in/sub/empty.txt" --out "$tmp/e1"
expect_error prepare --tokenizer "$tok" --input "$in/a.txt" --out "$in/a.txt"
expect_error prepare --tokenizer "$tok" --out "$tmp/e1"
expect_error prepare --tokenizer "$tok" --input "$in/a.txt"
check '[ ! -e "$tmp/e1/meta.json" ]' "failed runs leave no meta.json"
err=$("$bin" prepare --tokenizer "$tok" --input "$in/sub/bad.jsonl" --out "$tmp/e1" 2>&1)
check '[[ "$err" == *"bad.jsonl:1: not valid JSON"* ]]' "a bad line is named by file and line: $err"
err=$("$bin" prepare --tokenizer "$tok" --input "$in/*.nothing" --out "$tmp/e1" 2>&1)
check '[[ "$err" == *"matches no file"* ]]' "an empty glob is named: $err"

[ "$fail" -eq 0 ] && echo "prepare cli: all checks passed"
exit "$fail"
