#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: a DeepSeek-style
# model trained from scratch on real text, then sampled.
#   1. the State of the Union corpus into data/sotu (scripts/fetch_corpus.sh);
#   2. a byte-level BPE tokenizer trained on it (1024 tokens);
#   3. the corpus tokenized into shards with a held-out eval split;
#   4. `deepseek train configs/train-tiny.yml`: the tiny preset (MLA + MoE with
#      a shared expert + MTP) for 5-8 minutes on 2 cores (by CPU), with eval loss,
#      metrics.jsonl, loss.svg and checkpoints in runs/RUN;
#   5. the last checkpoint exported as a Hugging Face folder (runs/RUN/hf);
#   6. a sample generated from the export.
# Extra key=value arguments go to `deepseek train` (e.g. steps=200).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
build
./build/deepseek selfcheck

bash scripts/fetch_corpus.sh data/sotu
if [ ! -f data/sotu-tokenizer/tokenizer.json ]; then
  mkdir -p data/sotu-tokenizer
  ./build/deepseek tokenizer train --input 'data/sotu/*.txt' --vocab-size 1024 \
    --out data/sotu-tokenizer/tokenizer.json
fi
if [ ! -f data/sotu-tokens/meta.json ]; then
  ./build/deepseek prepare --tokenizer data/sotu-tokenizer/tokenizer.json --input 'data/sotu/*.txt' \
    --out data/sotu-tokens --eval-fraction 0.02 --seed 0
fi

run="tiny-sotu-$(date +%Y%m%d-%H%M%S)"
./build/deepseek train configs/train-tiny.yml run_name="$run" "$@"
last=$(ls -d runs/"$run"/checkpoints/step_* | sort -t_ -k2 -n | tail -1)
./build/deepseek export --checkpoint "$last" --out runs/"$run"/hf
echo "--- a sample from runs/$run/hf:"
./build/deepseek generate --model runs/"$run"/hf --prompt "Fellow citizens, the state of the Union" \
  --max-new-tokens 96 --temperature 0.8 --top-k 40 --seed 0
echo
echo "metrics: runs/$run/metrics.jsonl  loss curve: runs/$run/loss.svg  model: runs/$run/hf"
