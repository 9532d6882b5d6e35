#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job. Until training and
# generation exist, the main job is the program's help and its self-check.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
build
./build/deepseek --help
./build/deepseek selfcheck
