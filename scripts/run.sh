#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job. Until training
# lands, the main job checks the build, writes a randomly initialised tiny
# DeepSeek-V3 model and generates from it through the latent KV cache.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
build
./build/deepseek --help
./build/deepseek selfcheck
model=build/models/tiny-random
./build/deepseek init --config configs/tiny.yml --out "$model" --seed 0
cp tests/data/tokenizer/tiny/tokenizer.json "$model/"
./build/deepseek generate --model "$model" --prompt "DeepSeek-V3 says:" --max-new-tokens 32 --seed 0
