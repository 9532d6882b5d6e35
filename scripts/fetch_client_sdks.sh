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
source "$ROOT/scripts/npm_install_into.sh"
npm_install_into "$PREFIX" fetch_client_sdks "the client SDK test will skip" "${PACKAGES[@]}"
exit 0
