#!/usr/bin/env bash
# Fetches the official client libraries that tests/client_sdks_test.sh runs
# against `deepseek serve` from the npm registry into .cache/npm-sdk
# (git-ignored, never committed): OpenAI's (`openai`) and Anthropic's
# (`@anthropic-ai/sdk`) JavaScript SDKs. Does nothing when both are present.
# Never fails: without npm or the network that test reports itself skipped.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$ROOT/.cache/npm-sdk"
# Pinned, so that a new SDK release cannot change what the test checks
# without a commit here.
PACKAGES=("openai@7.59.0" "@anthropic-ai/sdk@1.14.0")

if [ -f "$PREFIX/node_modules/openai/package.json" ] && [ -f "$PREFIX/node_modules/@anthropic-ai/sdk/package.json" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_client_sdks: npm not found; the client SDK test will skip" >&2
  exit 0
fi
mkdir -p "$PREFIX"
# A package.json of its own keeps npm from walking up into the repository.
[ -f "$PREFIX/package.json" ] || echo '{"name": "deepseek-cpp-client-sdks", "private": true}' >"$PREFIX/package.json"
echo "fetch_client_sdks: installing ${PACKAGES[*]} into $PREFIX"
if ! (cd "$PREFIX" && timeout 300 npm install --no-audit --no-fund --ignore-scripts --no-package-lock \
        --fetch-retries=1 --fetch-retry-mintimeout=2000 --fetch-retry-maxtimeout=10000 --fetch-timeout=60000 \
        --loglevel=error "${PACKAGES[@]}" >&2); then
  echo "fetch_client_sdks: npm install failed; the client SDK test will skip" >&2
fi
exit 0
