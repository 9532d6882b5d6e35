#!/usr/bin/env bash
# MaxText's Engram on a DeepSeek-V3 preset end to end: `deepseek train` with
# an Engram layer over the tokenizer's token classes and two mHC streams on a
# small corpus (the loss goes down), `deepseek export` to a Hugging Face
# folder carrying the Engram keys, tensors and tokenizer, `deepseek generate`
# and `logits` (prefill and through the cache) from it; the export loaded
# back into training and exported again gives the same logits byte for byte;
# `deepseek init` writes an Engram model that runs; impossible Engram keys
# are one error line.
# Usage: engram_cli_test.sh DEEPSEEK SOURCE_DIR
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
run_name: e
dataset_type: tokens
dataset_path: $tmp/data
tokenizer_path: $tok
mhc_expansion_rate: 2
mtp_num_layers: 0
engram_layers: [1]
engram_num_heads: 2
engram_head_dim: 16
engram_vocab_bases: [401, 409]
engram_compress_tokens: true
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

"$bin" train "$tmp/run.yml" >/dev/null 2>"$tmp/train.err"
check '[ $? -eq 0 ]' "train an Engram model ($(tail -2 "$tmp/train.err"))"
check 'grep -q "Engram on layers \[1\]: 2..3-grams, 2 hash heads each, .* token classes of the 512 ids" "$tmp/train.err"' \
  "the run says it trains Engram over token classes"
metric() { grep -o "\"$2\":[0-9.e+-]*" "$tmp/runs/$1/metrics.jsonl" | cut -d: -f2 | sed -n "$3p"; }
first=$(metric e loss 1)
last=$(metric e loss 40)
echo "Engram training loss: step 1 $first, step 40 $last"
check 'awk -v a="$first" -v b="$last" "BEGIN { exit !(a > 0 && b < a - 1.0) }"' \
  "the loss goes down by more than 1 nat in 40 steps: $first -> $last"

"$bin" export --checkpoint "$tmp/runs/e/checkpoints/step_40" --out "$tmp/hf" >/dev/null
check '[ $? -eq 0 ] && grep -q "\"engram_compress_tokens\": true" "$tmp/hf/config.json" &&
  grep -q "\"engram_layers\"" "$tmp/hf/config.json" && [ -s "$tmp/hf/tokenizer.json" ]' \
  "the export carries the Engram keys and the tokenizer"
for name in engram_layernorm.weight engram.embedding.weight engram.key_proj.bias engram.short_conv.weight; do
  check 'head -c 65536 "$tmp/hf/model.safetensors" | grep -aq "model.layers.1.$name"' "the export holds $name"
done
gen=$("$bin" generate --model "$tmp/hf" --prompt "the model" --max-new-tokens 12 --seed 0 2>"$tmp/gen.err")
check '[ $? -eq 0 ] && [ -n "$gen" ]' "generate from the Engram export ($(tail -1 "$tmp/gen.err"))"
echo "generated: $gen"
# The prompt in chunks of 1 and 3 tokens (the history of each sequence's
# n-grams and convolution rows carried between steps): the same greedy text.
whole=$("$bin" generate --model "$tmp/hf" --prompt "the model and the data" --max-new-tokens 16 --temperature 0 \
  --prefill-chunk 0 2>/dev/null)
for chunk in 1 3; do
  part=$("$bin" generate --model "$tmp/hf" --prompt "the model and the data" --max-new-tokens 16 --temperature 0 \
    --prefill-chunk $chunk 2>/dev/null)
  check '[ -n "$whole" ] && [ "$part" = "$whole" ]' "prefill in chunks of $chunk: the same greedy text"
done

# Round trip: the export as a run's starting point, kept unchanged (learning
# rate 0), exported again: the same weights and logits. Its config.json alone
# says Engram: the run file without the Engram keys.
grep -v "^engram_\|^mhc_expansion_rate\|^model_name" "$tmp/run.yml" >"$tmp/from.yml"
"$bin" train "$tmp/from.yml" load_parameters_path="$tmp/hf" run_name=r steps=1 learning_rate=0 eval_interval=1 \
  checkpoint_period=1 >/dev/null 2>"$tmp/r.err"
check '[ $? -eq 0 ]' "train from the Engram export ($(tail -1 "$tmp/r.err"))"
"$bin" export --checkpoint "$tmp/runs/r/checkpoints/step_1" --out "$tmp/hf2" >/dev/null
check '[ $? -eq 0 ] && cmp -s "$tmp/hf/model.safetensors" "$tmp/hf2/model.safetensors"' \
  "export, load, export: the same weights file"
toks="$tmp/tokens.json"
echo '[[5, 17, 42, 7, 99, 3, 250, 11, 64, 5, 17, 42], [1, 2, 3]]' >"$toks"
logits_of "$tmp/hf" "$tmp/a.safetensors"
logits_of "$tmp/hf2" "$tmp/b.safetensors"
check '[ -s "$tmp/a.safetensors" ] && cmp -s "$tmp/a.safetensors" "$tmp/b.safetensors"' \
  "export, load, export: identical logits"
logits_of "$tmp/hf2" "$tmp/c.safetensors" --incremental 2
check '[ $? -eq 0 ] && [ -s "$tmp/c.safetensors" ]' "logits through the KV cache"

# `deepseek init` writes an Engram model (MaxText's initialisation) that runs.
"$bin" init --config "$src/configs/tiny.yml" --set mhc_expansion_rate=2 --set 'engram_layers=[0,2]' \
  --set engram_head_dim=8 --set 'engram_vocab_bases=[101,103]' --out "$tmp/init" --seed 1 >/dev/null
check '[ $? -eq 0 ] && grep -q "\"engram_head_dim\": 8" "$tmp/init/config.json"' "init an Engram model"
"$bin" logits --model "$tmp/init" --tokens "$toks" --out "$tmp/i.safetensors" >/dev/null 2>&1
check '[ $? -eq 0 ] && [ -s "$tmp/i.safetensors" ]' "logits of the initialised Engram model"

# Impossible Engram settings: one line, exit 2.
expect_error train "$tmp/run.yml" run_name=bad 'engram_layers=[7]'
expect_error train "$tmp/run.yml" run_name=bad 'engram_vocab_bases=[401]'
expect_error train "$tmp/run.yml" run_name=bad engram_head_dim=0
expect_error train "$tmp/run.yml" run_name=bad tokenizer_path="$tmp/none.json"

exit $fail
