#!/usr/bin/env bash
# `deepseek serve` through the official client libraries people use:
# OpenAI's and Anthropic's JavaScript SDKs (scripts/fetch_client_sdks.sh
# installs them from npm into .cache/npm-sdk) run tests/client_sdks.cjs
# against a tiny model with DeepSeek's chat tokens. Exit 77 (ctest: skipped)
# when node or the SDKs are missing.
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
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; rm -rf "$tmp"' EXIT
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
for (const [id, content] of [[292, "<｜User｜>"], [293, "<｜Assistant｜>"]])
  t.added_tokens.push({id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: false});
fs.writeFileSync(process.argv[2], JSON.stringify(t));
' "$src/tests/data/tokenizer/tiny/tokenizer.json" "$m/tokenizer.json" || { echo "FAIL: tokenizer"; exit 1; }

# DeepSeek-V4's chat format: its tool and thinking markup is text, which
# the tiny tokenizer can encode.
"$bin" serve --model "$m" --port 0 --name tiny --max-sequences 4 --chat-format deepseek-v4 2>"$tmp/log" &
pid=$!
port=$(served_port "$tmp/log" 400)
if [ -z "$port" ]; then
  echo "FAIL: serve did not start: $(cat "$tmp/log")"
  exit 1
fi
SDK_DIR="$sdk" timeout 300 node "$src/tests/client_sdks.cjs" "http://127.0.0.1:$port"
