#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: once on the
# Release build, then once more built with AddressSanitizer and
# UndefinedBehaviorSanitizer (scripts/sanitize.sh). Where nvcc is found, the
# CUDA backend is compiled too (not run: that needs a GPU and
# scripts/cuda_check.sh). Each phase prints its time; on 2 cores from clean
# the whole takes 30 to 45 minutes, as fast as the machine is.
# DEEPSEEK_SANITIZE=0 skips the sanitized run. Extra arguments go to both
# ctest runs (e.g. -R tokenizer).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
t0=$(date +%s)
install_missing_packages
fetch_test_assets
echo "set-up: $(($(date +%s) - t0))s"
t0=$(date +%s)
build
echo "release build: $(($(date +%s) - t0))s"
t0=$(date +%s)
# Two test processes share the cores: idle OpenMP workers sleep rather than
# spin (as scripts/sanitize.sh runs them). Spinning workers of one process
# take the cores the other's need: the Release suite took 250 s on 2 cores
# (Zen 3), 177 s with them asleep.
(cd build && OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}" ctest --output-on-failure -j "${DEEPSEEK_JOBS:-$(nproc)}" "$@")
echo "release tests: $(($(date +%s) - t0))s"
t0=$(date +%s)
compile_cuda_backend
echo "CUDA backend compile: $(($(date +%s) - t0))s"
if [ "${DEEPSEEK_SANITIZE:-1}" != 0 ]; then
  # client_sdks' fixture (a model trained to call a tool) is trained by the
  # Release program built above; the sanitized one exports and serves it.
  DEEPSEEK_FIXTURE_TRAINER="$ROOT/build/deepseek" "$ROOT/scripts/sanitize.sh" "$@"
fi
