#!/usr/bin/env bash
# `deepseek tokenizer train`: trains from globbed text and .jsonl files, the
# output loads in `deepseek tokenize` (BOS 0 prepended) and round-trips text
# through `detokenize`, a second run gives the same bytes, and bad input is one
# 'deepseek: error:' line with exit code 2 that leaves no output behind.
set -u
bin="$1"
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mkdir -p "$tmp/corpus" "$tmp/out" "$tmp/out2"
for i in 1 2 3 4 5; do
  printf 'hello world %s, the quick brown fox jumps over the lazy dog.\n你好，世界！ 12345\n' "$i" \
    >"$tmp/corpus/doc$i.txt"
done
printf '{"text": "hello again, world"}\n\n{"text": "deepseek tokenizer"}\n' >"$tmp/corpus/more.jsonl"

summary=$("$bin" tokenizer train --input "$tmp/corpus/*.txt" --input "$tmp/corpus/*.jsonl" --vocab-size 300 \
  --out "$tmp/out/tokenizer.json")
check '[ $? -eq 0 ]' "tokenizer train exits 0"
check '[[ "$summary" == *"7 documents"* && "$summary" == *"vocabulary 300"* && "$summary" == *"42 merges"* ]]' \
  "summary line: $summary"
check '[ "$(printf "%s\n" "$summary" | wc -l)" -eq 1 ]' "one summary line"
check '[ -s "$tmp/out/tokenizer.json" ] && [ -s "$tmp/out/tokenizer_config.json" ]' \
  "tokenizer.json and tokenizer_config.json written"
check '[ -z "$(ls "$tmp/out" | grep tmp)" ]' "no temporary files left"

got=$(echo '["hello world"]' | "$bin" tokenize --tokenizer "$tmp/out/tokenizer.json" --add-special-tokens)
check '[[ "$got" == "[[0,"* ]]' "BOS id 0 first: $got"
input='["hello world", "unseen: zebra 🙂 \t\n 9876543210", "", "  spaces  "]'
got=$(echo "$input" | "$bin" tokenize --tokenizer "$tmp/out/tokenizer.json" |
  "$bin" detokenize --tokenizer "$tmp/out/tokenizer.json")
want='["hello world","unseen: zebra 🙂 \t\n 9876543210","","  spaces  "]'
check '[ "$got" = "$want" ]'  "round trip: $got"

"$bin" tokenizer train --input "$tmp/corpus/*" --vocab-size 300 --out "$tmp/out2/tokenizer.json" >/dev/null
check 'cmp -s "$tmp/out/tokenizer.json" "$tmp/out2/tokenizer.json"' "same input, same bytes"

printf 'bad \xff byte\n' >"$tmp/bad.txt"
printf '{"text": 1}\n' >"$tmp/bad.jsonl"
: >"$tmp/empty.txt"
mkdir -p "$tmp/e"
expect_error tokenizer train --input "$tmp/nothing/*.txt" --vocab-size 300 --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --input "$tmp/empty.txt" --vocab-size 300 --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --input "$tmp/bad.txt" --vocab-size 300 --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --input "$tmp/bad.jsonl" --vocab-size 300 --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --input "$tmp/corpus/*.txt" --vocab-size 100 --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --input "$tmp/corpus/*.txt" --vocab-size 2000000 --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --input "$tmp/corpus/*.txt" --vocab-size 300 --out "$tmp/no/such/tokenizer.json"
expect_error tokenizer train --input "$tmp/corpus" --vocab-size 300 --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --input "$tmp/corpus/*.txt" --vocab-size 300 --out "$tmp/e/tokenizer_config.json"
expect_error tokenizer train --input "$tmp/corpus/*.txt" --out "$tmp/e/tokenizer.json"
expect_error tokenizer train --vocab-size 300 --out "$tmp/e/tokenizer.json"
expect_error tokenizer
check '[ -z "$(ls "$tmp/e")" ]' "failed runs write nothing"

[ "$fail" -eq 0 ] && echo "tokenizer train cli: all checks passed"
exit "$fail"
