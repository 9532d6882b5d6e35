#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: once on the
# Release build, then once more built with AddressSanitizer and
# UndefinedBehaviorSanitizer (scripts/sanitize.sh; about 15 more minutes on 2
# cores from clean: 8.5 to build, 6.5 to test). DEEPSEEK_SANITIZE=0 skips
# the sanitized run. Extra arguments go to both ctest runs (e.g. -R tokenizer).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
fetch_test_assets
build
(cd build && ctest --output-on-failure -j "${DEEPSEEK_JOBS:-$(nproc)}" "$@")
if [ "${DEEPSEEK_SANITIZE:-1}" != 0 ]; then
  "$ROOT/scripts/sanitize.sh" "$@"
fi
