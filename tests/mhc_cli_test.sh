#!/usr/bin/env bash
# MaxText's mHC on a DeepSeek-V3 preset end to end: `deepseek train` with
# mhc_expansion_rate 4 on a small corpus (the loss goes down), `deepseek
# export` to a Hugging Face folder carrying the mHC keys and tensors,
# `deepseek generate` from it; the export loaded back into training and
# exported again gives the same logits byte for byte; `deepseek init` writes
# an mHC model that runs; impossible mHC keys are one error line.
# Usage: mhc_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tok="$src/tests/data/tokenizer/tiny/tokenizer.json"
tmp=$(mktemp -d)
trap "rm -rf \"$tmp\"" EXIT
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

"$bin" prepare --tokenizer "$tok" --input "$src/README.md" --input "$src/docs/*.md" --out "$tmp/data" \
  --eval-fraction 0.2 >/dev/null
check '[ $? -eq 0 ] && [ -s "$tmp/data/meta.json" ]' "prepare the corpus"

cat >"$tmp/run.yml" <<YML
model_name: $src/configs/tiny.yml
base_output_directory: $tmp/runs
run_name: m
dataset_type: tokens
dataset_path: $tmp/data
tokenizer_path: $tok
mhc_expansion_rate: 4
sinkhorn_iterations: 20
mtp_num_layers: 0
steps: 40
per_device_batch_size: 4
max_target_length: 32
learning_rate: 3.0e-3
warmup_steps_fraction: 0.1
remat_policy: full
eval_interval: 40
eval_steps: 1
checkpoint_period: 40
YML

out=$("$bin" train "$tmp/run.yml" 2>"$tmp/train.err")
check '[ $? -eq 0 ]' "train an mHC model ($(tail -2 "$tmp/train.err"))"
check 'grep -q "mHC: 4 residual streams, 20 Sinkhorn iterations" "$tmp/train.err"' "the run says it trains mHC"
metric() { grep -o "\"$2\":[0-9.e+-]*" "$tmp/runs/$1/metrics.jsonl" | cut -d: -f2 | sed -n "$3p"; }
first=$(metric m loss 1)
last=$(metric m loss 40)
echo "mHC training loss: step 1 $first, step 40 $last"
check 'awk -v a="$first" -v b="$last" "BEGIN { exit !(a > 0 && b < a - 1.0) }"' \
  "the loss goes down by more than 1 nat in 40 steps: $first -> $last"

"$bin" export --checkpoint "$tmp/runs/m/checkpoints/step_40" --out "$tmp/hf" >/dev/null
check '[ $? -eq 0 ] && grep -q "\"mhc_expansion_rate\": 4" "$tmp/hf/config.json" &&
  grep -q "\"mhc_sinkhorn_iterations\": 20" "$tmp/hf/config.json"' "the export's config.json carries the mHC keys"
for name in mhc_attention.norm.weight mhc_attention.fn mhc_attention.base mhc_attention.scale mhc_mlp.fn; do
  check 'head -c 65536 "$tmp/hf/model.safetensors" | grep -aq "model.layers.2.$name"' "the export holds $name"
done
gen=$("$bin" generate --model "$tmp/hf" --prompt "the model" --max-new-tokens 12 --seed 0 2>"$tmp/gen.err")
check '[ $? -eq 0 ] && [ -n "$gen" ]' "generate from the mHC export ($(tail -1 "$tmp/gen.err"))"
echo "generated: $gen"

# Round trip: the export as a run's starting point, kept unchanged (learning
# rate 0), exported again: the same logits, prefill and through the cache.
# Its config.json alone says mHC: the run file without the mHC keys.
grep -v "^mhc_expansion_rate\|^sinkhorn_iterations\|^model_name" "$tmp/run.yml" >"$tmp/from.yml"
"$bin" train "$tmp/from.yml" load_parameters_path="$tmp/hf" run_name=r steps=1 learning_rate=0 eval_interval=1 \
  checkpoint_period=1 >/dev/null 2>"$tmp/r.err"
check '[ $? -eq 0 ]' "train from the mHC export ($(tail -1 "$tmp/r.err"))"
"$bin" export --checkpoint "$tmp/runs/r/checkpoints/step_1" --out "$tmp/hf2" >/dev/null
check '[ $? -eq 0 ]' "export it again"
toks="$tmp/tokens.json"
echo '[[5, 17, 42, 7, 99, 3, 250, 11, 64], [1, 2, 3]]' >"$toks"
check 'cmp -s "$tmp/hf/model.safetensors" "$tmp/hf2/model.safetensors"' "export, load, export: the same weights file"
logits_of "$tmp/hf" "$tmp/a.safetensors"
logits_of "$tmp/hf2" "$tmp/b.safetensors"
check '[ -s "$tmp/a.safetensors" ] && cmp -s "$tmp/a.safetensors" "$tmp/b.safetensors"' \
  "export, load, export: identical logits"
logits_of "$tmp/hf2" "$tmp/c.safetensors" --incremental 2
check '[ $? -eq 0 ] && [ -s "$tmp/c.safetensors" ]' "logits through the KV cache"

# `deepseek init` writes an mHC model (MaxText's initialisation) that loads and runs.
"$bin" init --config "$src/configs/tiny.yml" --set mhc_expansion_rate=4 --set sinkhorn_iterations=3 --out "$tmp/init" \
  --seed 1 >/dev/null
check '[ $? -eq 0 ] && grep -q "\"mhc_sinkhorn_iterations\": 3" "$tmp/init/config.json"' "init an mHC model"
"$bin" logits --model "$tmp/init" --tokens "$toks" --out "$tmp/i.safetensors" >/dev/null 2>&1
check '[ $? -eq 0 ] && [ -s "$tmp/i.safetensors" ]' "logits of the initialised mHC model"

# Impossible mHC settings: one line, exit 2.
expect_error train "$tmp/run.yml" run_name=bad mhc_expansion_rate=0
expect_error train "$tmp/run.yml" run_name=bad sinkhorn_iterations=0
expect_error train "$tmp/run.yml" run_name=bad mtp_num_layers=1

exit $fail
