#!/usr/bin/env bash
# `deepseek serve` through the official client libraries people use:
# OpenAI's and Anthropic's JavaScript SDKs (scripts/fetch_client_sdks.sh
# installs them from npm into .cache/npm-sdk) run tests/client_sdks.cjs
# against a tiny model with DeepSeek's chat tokens, and against a tiny
# model trained here to answer one request with a DeepSeek-V4.1 tool call.
# Exit 77 (ctest: skipped) when node or the SDKs are missing.
# Usage: client_sdks_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
sdk="$src/.cache/npm-sdk/node_modules"
if ! command -v node >/dev/null 2>&1 || [ ! -f "$sdk/openai/package.json" ] ||
  [ ! -f "$sdk/@anthropic-ai/sdk/package.json" ]; then
  echo "SKIPPED: node or the client SDKs are missing (scripts/fetch_client_sdks.sh installs them)"
  exit 77
fi
tmp=$(mktemp -d)
pid=""
pid2=""
trap 'for p in $pid $pid2; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done; rm -rf "$tmp"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

m="$tmp/tiny"
# Room for the V4 format's tool descriptions (about 1,000 tiny-tokenizer tokens).
"$bin" init --config "$src/configs/tiny.yml" --out "$m" --seed 3 --set max_position_embeddings=4096 >/dev/null ||
  { echo "FAIL: init"; exit 1; }
# The tiny test tokenizer with DeepSeek's two chat tokens added, so that the
# chat routes have a format to render.
node -e '
const fs = require("fs");
const t = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
for (const [id, content] of [[292, "<｜User｜>"], [293, "<｜Assistant｜>"], [294, "<｜System｜>"]])
  t.added_tokens.push({id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: false});
fs.writeFileSync(process.argv[2], JSON.stringify(t));
' "$src/tests/data/tokenizer/tiny/tokenizer.json" "$m/tokenizer.json" || { echo "FAIL: tokenizer"; exit 1; }

# A model that calls a tool: the tiny model trained on one conversation,
# the request tests/client_sdks.cjs sends (tools/tool_request.json) in
# DeepSeek-V4.1's format followed by the call the format writes for it, so
# that greedy decoding answers that request with the call. The prompt's ids
# are the server's own (`deepseek chat-template`), the call's are the
# tokenizer's; 300 steps take the loss from 6.2 to about 1e-4.
req="$src/tests/data/chat/tool_request.json"
call='"\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"'
"$bin" chat-template --model "$m" --chat-format deepseek-v4.1 --ids <"$req" >"$tmp/prompt.json" &&
  echo "[$call]" | "$bin" tokenize --tokenizer "$m/tokenizer.json" >"$tmp/call.json" ||
  { echo "FAIL: the tool conversation's ids"; exit 1; }
text=$("$bin" chat-template --model "$m" --chat-format deepseek-v4.1 <"$req")
if [[ "$text" != "<｜begin▁of▁sentence｜>"*"<｜User｜>What is the weather in Paris?<｜Assistant｜></think>" ]]; then
  echo "FAIL: chat-template's text: $text"
  exit 1
fi
node -e '
const fs = require("fs");
const row = JSON.parse(fs.readFileSync(process.argv[1])).concat(JSON.parse(fs.readFileSync(process.argv[2]))[0]);
fs.writeFileSync(process.argv[3], JSON.stringify(Array.from({ length: 300 }, () => [row])));
fs.writeFileSync(process.argv[4], String(row.length - 1));
' "$tmp/prompt.json" "$tmp/call.json" "$tmp/steps.json" "$tmp/seq" || { echo "FAIL: steps"; exit 1; }
cat >"$tmp/caller.yml" <<YML
model_name: $src/configs/tiny.yml
max_position_embeddings: 4096
base_output_directory: $tmp/runs
run_name: caller
dataset_type: json
dataset_path: $tmp/steps.json
tokenizer_path: $m/tokenizer.json
steps: 300
per_device_batch_size: 1
max_target_length: $(cat "$tmp/seq")
learning_rate: 1.0e-2
warmup_steps_fraction: 0.1
eval_interval: -1
checkpoint_period: 300
YML
# DEEPSEEK_FIXTURE_TRAINER, when set, is the program that trains it (the
# sanitized run passes the Release build's: the training is the fixture
# here, not what this test checks).
trainer="${DEEPSEEK_FIXTURE_TRAINER:-$bin}"
if [ ! -x "$trainer" ]; then
  echo "FAIL: DEEPSEEK_FIXTURE_TRAINER is not a program: $trainer"
  exit 1
fi
"$trainer" train "$tmp/caller.yml" >"$tmp/train.out" 2>"$tmp/train.err" &&
  "$bin" export --checkpoint "$tmp/runs/caller/checkpoints/step_300" --out "$tmp/caller" >/dev/null ||
  { echo "FAIL: training the tool caller: $(tail -3 "$tmp/train.err")"; exit 1; }
echo "tool caller: $(cat "$tmp/train.out")"
"$bin" serve --model "$tmp/caller" --port 0 --name caller --max-sequences 2 --chat-format deepseek-v4.1 \
  2>"$tmp/log2" &
pid2=$!

# DeepSeek-V4's chat format: its tool and thinking markup is text, which
# the tiny tokenizer can encode.
"$bin" serve --model "$m" --port 0 --name tiny --max-sequences 4 --chat-format deepseek-v4 2>"$tmp/log" &
pid=$!
port=$(served_port "$tmp/log" 400)
if [ -z "$port" ]; then
  echo "FAIL: serve did not start: $(cat "$tmp/log")"
  exit 1
fi
port2=$(served_port "$tmp/log2" 400)
if [ -z "$port2" ]; then
  echo "FAIL: serve (tool caller) did not start: $(cat "$tmp/log2")"
  exit 1
fi
SDK_DIR="$sdk" TOOL_REQUEST="$req" PROMPT_IDS="$tmp/prompt.json" timeout 300 node "$src/tests/client_sdks.cjs" "http://127.0.0.1:$port" \
  "http://127.0.0.1:$port2"
