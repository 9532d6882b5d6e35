#!/usr/bin/env bash
# `deepseek tokenize` and `deepseek detokenize` on the tiny fixture tokenizer:
# exact ids (from tests/data/tokenizer/tiny_expected.json, made by Hugging
# Face's library), round trips, and one-line errors with exit code 2.
set -u
bin="$1"
tok="$2/tiny/tokenizer.json"
fail=0
check() {  # check NAME WANT GOT
  if [ "$2" != "$3" ]; then echo "FAIL: $1: got $3, want $2"; fail=1; fi
}
expect_error() {  # expect_error STDIN ARGS...
  local input="$1" err rc
  shift
  err=$(printf '%s' "$input" | "$bin" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne 2 ]; then echo "FAIL: deepseek $* <<< $input exited $rc, want 2"; fail=1; fi
  if [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ] || [[ "$err" != deepseek:\ error:* ]]; then
    echo "FAIL: deepseek $* <<< $input: stderr is not one 'deepseek: error:' line: $err"; fail=1
  fi
}

got=$(echo '["the hello world", "<sep>x", "", "aaaaa"]' | "$bin" tokenize --tokenizer "$tok")
check "tokenize" '[[260,32,262,282,108,100],[289,120],[],[267,268]]' "$got"
got=$(echo '["the hello world", ""]' | "$bin" tokenize --tokenizer "$tok" --add-special-tokens)
check "tokenize --add-special-tokens" '[[285,260,32,262,282,108,100],[285]]' "$got"
got=$(echo '[[260,32,262],[],[285,259,286]]' | "$bin" detokenize --tokenizer "$tok")
check "detokenize" '["the hello","","<｜begin▁of▁sentence｜> the<｜end▁of▁sentence｜>"]' "$got"
# A lone continuation byte decodes to U+FFFD.
got=$(echo '[[130]]' | "$bin" detokenize --tokenizer "$tok")
check "detokenize partial UTF-8" '["�"]' "$got"
input='["café \t\n 12345", "你好 🙂 <tool_call>x", "  "]'
got=$(echo "$input" | "$bin" tokenize --tokenizer "$tok" | "$bin" detokenize --tokenizer "$tok")
check "round trip" '["café \t\n 12345","你好 🙂 <tool_call>x","  "]' "$got"

expect_error 'not json' tokenize --tokenizer "$tok"
expect_error '{"a": 1}' tokenize --tokenizer "$tok"
expect_error '["ok", 3]' tokenize --tokenizer "$tok"
expect_error $'["\xff"]' tokenize --tokenizer "$tok"
expect_error '["x"]' tokenize --tokenizer "$2/no/such/tokenizer.json"
expect_error '["x"]' tokenize
expect_error '[[1, 2' detokenize --tokenizer "$tok"
expect_error '[1, 2]' detokenize --tokenizer "$tok"
expect_error '[[292]]' detokenize --tokenizer "$tok"
expect_error '[[-1]]' detokenize --tokenizer "$tok"
expect_error '[[1.5]]' detokenize --tokenizer "$tok"
expect_error '[["7"]]' detokenize --tokenizer "$tok"
expect_error '[[18446744073709551615]]' detokenize --tokenizer "$tok"
# chat-template reads a chat request as the server does (its successes are
# in client_sdks_test.sh, which has a tokenizer with chat tokens).
tmpd=$(mktemp -d)
cp "$tok" "$tmpd/tokenizer.json"
expect_error '{"messages": [{"role": "user", "content": "hi"}]}' chat-template --model "$tmpd"  # no <｜User｜>
expect_error '{"messages": [' chat-template --model "$tmpd"
expect_error '{"messages": 5}' chat-template --model "$tmpd"
expect_error '{}' chat-template --model "$tmpd" --chat-format deepseek-v9
expect_error '{}' chat-template --model "$tmpd/missing"
rm -rf "$tmpd"
[ "$fail" -eq 0 ] && echo "tokenizer cli: all checks passed"
exit "$fail"
