#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
fetch_test_assets
build
cd build
ctest --output-on-failure -j "${DEEPSEEK_JOBS:-$(nproc)}" "$@"
