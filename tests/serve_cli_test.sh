#!/usr/bin/env bash
# `deepseek serve` as a user runs it: it says where it listens, answers a
# completion with the tokens `deepseek generate` makes, stops cleanly on
# SIGTERM (exit 0), and refuses a missing model, a bad option or a port in
# use with one error line and exit 2. HTTP goes through bash's /dev/tcp, so
# nothing beyond bash is needed.
# Usage: serve_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tmp=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; rm -rf "$tmp"' EXIT
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

m="$tmp/tiny"
"$bin" init --config "$src/configs/tiny.yml" --out "$m" --seed 3 >/dev/null || { echo "FAIL: init"; exit 1; }
cp "$src/tests/data/tokenizer/tiny/tokenizer.json" "$m/"

expect_error serve --model "$tmp/missing" --port 0
expect_error serve --model "$m" --port 70000
expect_error serve --model "$m" --max-sequences 0
expect_error serve --model "$m" --tokenizer "$tmp/none.json"
expect_error serve --model "$m" --speculative maybe
expect_error serve --model "$m" --speculative mtp  # the tiny preset has no MTP layer
expect_error serve --model "$m" --port 0 --cache-memory lots
expect_error serve --model "$m" --port 0 --cache-memory 2KiB  # not even one token's cache

# http METHOD PATH [BODY]: the response (status line, headers, body) of one
# request to the server on $port.
http() {
  exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
  printf '%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: %s\r\n\r\n%s' \
    "$1" "$2" "${#3}" "$3" >&3
  timeout 60 cat <&3
  exec 3<&-
}

"$bin" serve --model "$m" --port 0 --max-sequences 2 --cache-memory 4MiB 2>"$tmp/log" &
pid=$!
port=$(served_port "$tmp/log")
check '[ -n "$port" ]' "serve says the address it listens on: $(cat "$tmp/log")"
if [ -n "$port" ]; then
  check 'http GET /health "" | grep -q "\"status\":\"ok\""' "GET /health answers ok"
  resp=$(http POST /v1/completions '{"prompt": "hello world", "max_tokens": 6, "temperature": 0}')
  check '[[ "$resp" == "HTTP/1.1 200"* ]]' "a completion answers 200: $resp"
  # The JSON string's escapes (\uXXXX, \t, ...) as bash's printf %b reads them.
  text=$(printf '%b' "$(printf '%s' "$resp" | sed -n 's/.*"text":"\([^"]*\)".*/\1/p')")
  want=$("$bin" generate --model "$m" --prompt "hello world" --max-new-tokens 6 --temperature 0 2>/dev/null)
  check '[ "hello world$text" == "$want" ]' "the completion is what generate prints ('$text' against '$want')"
  check 'grep -q "cache pool 4.0 MiB (sequences of up to [0-9]* tokens), prefix caching on" "$tmp/log"' \
    "serve says its cache pool: $(cat "$tmp/log")"
  # The same prompt again: its tokens but the last come from the kept cache.
  resp=$(http POST /v1/completions '{"prompt": "hello world", "max_tokens": 6, "temperature": 0}')
  again=$(printf '%b' "$(printf '%s' "$resp" | sed -n 's/.*"text":"\([^"]*\)".*/\1/p')")
  check '[ "$again" == "$text" ]' "a prompt read from the prefix cache makes the same text ('$again' against '$text')"
  check 'http GET /health "" | grep -q "\"prefix_hits\":1"' "GET /health counts the prefix cache's hit"
  resp=$(http POST /v1/completions '{"prompt": [1, 2], "max_tokens": "six"}')
  check '[[ "$resp" == "HTTP/1.1 400"* ]] && [[ "$resp" == *"max_tokens"* ]]' "a bad field answers 400: $resp"
  # lm-evaluation-harness' log-likelihood request: the prompt's logprobs, nothing generated.
  resp=$(http POST /v1/completions '{"prompt": [1, 2, 3], "max_tokens": 0, "echo": true, "logprobs": 1}')
  check '[[ "$resp" == "HTTP/1.1 200"* ]] && [[ "$resp" == *"\"token_logprobs\":[null,-"*",-"*"]"* ]]' \
    "echo with max_tokens 0 gives the prompt's logprobs: $resp"
  metrics=$(http GET /metrics "")
  check '[[ "$metrics" == *"deepseek_requests_total{route=\"/v1/completions\",status=\"200\"} 3"* ]]' \
    "GET /metrics counts the completions: $metrics"
  check '[[ "$metrics" == *"deepseek_prefix_cache_hits_total 1"* ]]' "GET /metrics counts the prefix cache's hit"
  check '[[ "$metrics" == *"deepseek_requests_total{route=\"/v1/completions\",status=\"400\"} 1"* ]]' \
    "GET /metrics counts the refusal"
  # A second server on the same port is refused.
  expect_error serve --model "$m" --port "$port"
fi
kill -TERM "$pid"
wait "$pid"
rc=$?
pid=""
check '[ "$rc" -eq 0 ]' "serve exits 0 on SIGTERM (got $rc)"
check 'grep -q "SIGTERM, stopping" "$tmp/log"' "serve says why it stops"

# Speculative decoding with a chain of three drafts: the same greedy text,
# and /metrics counts each draft position.
"$bin" init --config "$src/configs/tiny.yml" --out "$tmp/mtp" --seed 3 --set mtp_num_layers=1 >/dev/null
cp "$src/tests/data/tokenizer/tiny/tokenizer.json" "$tmp/mtp/"
expect_error serve --model "$tmp/mtp" --speculative mtp --draft-tokens 9
expect_error serve --model "$tmp/mtp" --speculative mtp --draft-max-sequences -1
"$bin" serve --model "$tmp/mtp" --port 0 --speculative mtp --draft-tokens 3 --draft-max-sequences 4 2>"$tmp/log3" &
pid=$!
port=$(served_port "$tmp/log3")
check '[ -n "$port" ]' "serve --speculative mtp --draft-tokens 3 starts: $(cat "$tmp/log3")"
if [ -n "$port" ]; then
  resp=$(http POST /v1/completions '{"prompt": "hello world", "max_tokens": 12, "temperature": 0}')
  text=$(printf '%b' "$(printf '%s' "$resp" | sed -n 's/.*"text":"\([^"]*\)".*/\1/p')")
  want=$("$bin" generate --model "$tmp/mtp" --prompt "hello world" --max-new-tokens 12 --temperature 0 2>/dev/null)
  check '[ "hello world$text" == "$want" ]' "drafting three a step changes no greedy token ('$text' against '$want')"
  metrics=$(http GET /metrics "")
  check '[[ "$metrics" == *"deepseek_draft_tokens_by_position_total{position=\"3\"}"* ]] &&
    [[ "$metrics" == *"deepseek_draft_accepted_by_position_total{position=\"1\"}"* ]]' \
    "GET /metrics counts drafts by position: $(grep -a by_position <<<"$metrics")"
fi
kill -TERM "$pid" 2>/dev/null
wait "$pid"
pid=""

[ "$fail" -eq 0 ] && echo "serve_cli: all checks passed"
exit "$fail"
