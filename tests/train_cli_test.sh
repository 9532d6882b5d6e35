#!/usr/bin/env bash
# `deepseek train` end to end on the tiny preset: a corpus prepared with the
# fixture tokenizer, a few steps with eval and checkpoints, metrics and the
# loss curve in the run folder, `deepseek export` to a Hugging Face folder
# that `deepseek generate` runs; the same for a DeepSeek-V4 preset; and bad input (unknown key, missing corpus,
# impossible sizes, a corrupt checkpoint) gives one error line and exit code
# 2 without losing a checkpoint.
# Usage: train_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tok="$src/tests/data/tokenizer/tiny/tokenizer.json"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

# A small corpus: the project's own documentation, one document per file.
"$bin" prepare --tokenizer "$tok" --input "$src/README.md" --input "$src/docs/*.md" --input "$src/configs/*.yml" \
  --out "$tmp/data" --eval-fraction 0.3 >/dev/null
check '[ $? -eq 0 ] && [ -s "$tmp/data/meta.json" ]' "prepare the corpus"

cat >"$tmp/run.yml" <<YML
model_name: $src/configs/tiny.yml
base_output_directory: $tmp/runs
run_name: t
dataset_type: tokens
dataset_path: $tmp/data
tokenizer_path: $tok
steps: 6
per_device_batch_size: 2
max_target_length: 32
learning_rate: 1.0e-3
mtp_num_layers: 1
routed_bias_update_rate: 1.0e-3
eval_interval: 3
eval_steps: 2
checkpoint_period: 3
YML

out=$("$bin" train "$tmp/run.yml" 2>"$tmp/train.err")
check '[ $? -eq 0 ]' "train exits 0 ($(tail -2 "$tmp/train.err"))"
run="$tmp/runs/t"
check '[[ "$out" == "trained t: steps 0 -> 6, loss "*", eval loss "* ]]' "train summary: $out"
check '[ "$(wc -l <"$run/metrics.jsonl")" -eq 6 ]' "one metrics line per step"
for key in step loss lm_loss lr grad_norm tokens_per_sec tflops_per_sec mtp_loss expert_load; do
  check 'head -1 "$run/metrics.jsonl" | grep -q "\"$key\""' "metrics carry $key"
done
check '[ "$(grep -c eval_loss "$run/metrics.jsonl")" -eq 3 ]' "eval at steps 0, 3 and the last"
check 'head -c 4 "$run/loss.svg" | grep -q "<svg"' "loss.svg written"
check '[ -f "$run/checkpoints/step_3/state.json" ] && [ -f "$run/checkpoints/step_6/params.safetensors" ]' \
  "checkpoints step_3 and step_6"
check 'grep -q "step 6/6" "$tmp/train.err"' "progress lines on stderr"

# MaxText's dtype=bfloat16: the same run with bf16 matmuls and float32
# master weights, reported in the metrics, its eval loss close to float32's;
# checkpoints stay float32.
"$bin" train "$tmp/run.yml" run_name=tb dtype=bfloat16 >/dev/null 2>"$tmp/tb.err"
check '[ $? -eq 0 ] && grep -q "dtype=bfloat16: matmul operands and activations rounded to bf16" "$tmp/tb.err"' \
  "train in bfloat16 ($(tail -1 "$tmp/tb.err"))"
check 'grep -q "\"dtype\":\"bfloat16\"" "$tmp/runs/tb/metrics.jsonl" && grep -q "\"weight_dtype\":\"float32\"" "$tmp/runs/tb/metrics.jsonl" &&
  grep -q "\"dtype\":\"float32\"" "$run/metrics.jsonl"' "metrics say each run's dtype"
ev() { grep -o '"eval_loss":[0-9.e+-]*' "$1/metrics.jsonl" | tail -1 | cut -d: -f2; }
check 'awk -v a="$(ev "$run")" -v b="$(ev "$tmp/runs/tb")" "BEGIN { d = a - b; exit !(a != b && (d < 0 ? -d : d) < 0.02 * a) }"' \
  "bf16 eval loss $(ev "$tmp/runs/tb") within 2% of float32's $(ev "$run")"
check 'grep -q "\"dtype\":\"F32\"" <(head -c 4096 "$tmp/runs/tb/checkpoints/step_6/params.safetensors" | tr -d "\0")' \
  "bf16 checkpoints hold float32 weights"
expect_error train "$tmp/run.yml" run_name=tc weight_dtype=bfloat16
# quantization=fp8_full (with bf16 arithmetic, as MaxText runs it): named in
# the metrics, its eval loss close to float32's after the same steps.
"$bin" train "$tmp/run.yml" run_name=tq dtype=bfloat16 quantization=fp8_full >/dev/null 2>"$tmp/tq.err"
check '[ $? -eq 0 ] && grep -q "\"quantization\":\"fp8_full\"" "$tmp/runs/tq/metrics.jsonl"' \
  "train with quantization=fp8_full ($(tail -1 "$tmp/tq.err"))"
check 'awk -v a="$(ev "$run")" -v b="$(ev "$tmp/runs/tq")" "BEGIN { d = a - b; exit !(a != b && (d < 0 ? -d : d) < 0.05 * a) }"' \
  "fp8_full eval loss $(ev "$tmp/runs/tq") within 5% of float32's $(ev "$run")"
expect_error train "$tmp/run.yml" run_name=tc quantization=int8

# Export and generate from the export.
exp=$("$bin" export --checkpoint "$run/checkpoints/step_6" --out "$tmp/hf")
check '[ $? -eq 0 ] && [ -f "$tmp/hf/config.json" ] && [ -f "$tmp/hf/model.safetensors" ] && [ -f "$tmp/hf/tokenizer.json" ]' \
  "export writes config, weights and tokenizer: $exp"
check 'grep -q "\"num_nextn_predict_layers\": 1" "$tmp/hf/config.json"' "export keeps the MTP layer"
# The tiny tokenizer's BOS and EOS are ids 285 and 286: generation must stop
# at the EOS the documents were trained with, not the config default of 1.
check 'grep -q "\"bos_token_id\": 285" "$tmp/hf/config.json" && grep -q "\"eos_token_id\": 286" "$tmp/hf/config.json"' \
  "export takes BOS and EOS from the run's tokenizer"
gen=$("$bin" generate --model "$tmp/hf" --prompt "the model" --max-new-tokens 8 --seed 0 2>/dev/null)
check '[ $? -eq 0 ] && [ -n "$gen" ]' "generate from the exported folder"

# DeepSeek-V4 from MaxText's keys (configs/v4-tiny.yml): the same run file
# (its MTP layer included), export to a deepseek_v4 folder that `deepseek
# generate` runs.
"$bin" train "$tmp/run.yml" model_name="$src/configs/v4-tiny.yml" run_name=v4 steps=4 eval_interval=2 \
  checkpoint_period=4 >/dev/null 2>"$tmp/v4.err"
check '[ $? -eq 0 ] && grep -q "DeepSeek-V4 model" "$tmp/v4.err"' "train a V4 model ($(tail -1 "$tmp/v4.err"))"
check '[ "$(wc -l <"$tmp/runs/v4/metrics.jsonl")" -eq 4 ] && grep -q "\"expert_load\"" "$tmp/runs/v4/metrics.jsonl" &&
  grep -q "\"mtp_loss\":0\.[0-9]*[1-9]" "$tmp/runs/v4/metrics.jsonl"' "V4 metrics with each layer's expert load and the MTP loss"
"$bin" export --checkpoint "$tmp/runs/v4/checkpoints/step_4" --out "$tmp/hf4" >/dev/null
check '[ $? -eq 0 ] && grep -q "\"model_type\": \"deepseek_v4\"" "$tmp/hf4/config.json" &&
  grep -q "\"num_nextn_predict_layers\": 1" "$tmp/hf4/config.json"' "the V4 export is a deepseek_v4 folder with its MTP layer"
gen=$("$bin" generate --model "$tmp/hf4" --prompt "the model" --max-new-tokens 8 --seed 0 2>/dev/null)
check '[ $? -eq 0 ] && [ -n "$gen" ]' "generate from the V4 export"
expect_error train "$tmp/run.yml" model_name="$src/configs/v4-tiny.yml" run_name=v4b mtp_num_layers=2
expect_error train "$tmp/run.yml" model_name="$src/configs/v4-tiny.yml" run_name=v4b mtp_num_layers=0 base_num_kv_heads=2

# Bad input: one line, exit 2.
expect_error train "$tmp/run.yml" no_such_key=1
expect_error train "$tmp/run.yml" run_name=u dataset_path="$tmp/missing"
expect_error train "$tmp/run.yml" run_name=u max_target_length=100000
expect_error train "$tmp/run.yml" run_name=u per_device_batch_size=1.5
expect_error train "$tmp/missing.yml"
expect_error train "$tmp/run.yml"  # the run exists: resume=true or another run_name
expect_error export --checkpoint "$tmp/missing" --out "$tmp/hf2"
# GGUF: the tiny tokenizer's pre-tokenizer is not one llama.cpp has, so the
# export is refused (model/gguf_export.h; tests/gguf_export_test.cc writes
# one), leaving nothing behind; so are an unknown format and type.
expect_error export --checkpoint "$run/checkpoints/step_6" --out "$tmp/m.gguf" --format gguf
check '[ ! -e "$tmp/m.gguf" ] && [ ! -e "$tmp/m.gguf.hf-export" ]' "a refused GGUF export leaves no file"
expect_error export --checkpoint "$run/checkpoints/step_6" --out "$tmp/m.gguf" --format ggml
expect_error export --checkpoint "$run/checkpoints/step_6" --out "$tmp/m.gguf" --format gguf --dtype q4_k
# A corrupt newest checkpoint: resume refuses it and both checkpoints stay.
head -c 100 "$run/checkpoints/step_6/params.safetensors" >"$tmp/cut" && mv "$tmp/cut" "$run/checkpoints/step_6/params.safetensors"
expect_error train "$tmp/run.yml" resume=true steps=8
check '[ -d "$run/checkpoints/step_3" ] && [ -d "$run/checkpoints/step_6" ]' "no checkpoint lost"

# DeepSeek-V3.2 (DSA) in three runs from one folder, as the paper trains it
# from a dense checkpoint: 100 dense steps with the indexers idle (the
# model memorizes the synthetic batch), 100 steps of the dense warm-up (only
# the indexers train, from their KL alone: the KL falls, the LM loss stays
# put), then 40 steps of the sparse stage (attention over the indexer's top
# 16 of up to 64 keys), whose LM loss tracks 40 dense steps from the same
# checkpoint. The warm-up's export is a V3.2 folder that generates.
dsa() {
  local run=$1 steps=$2
  shift 2
  "$bin" --threads 2 train "$src/configs/tiny.yml" use_indexer=true indexer_n_heads=4 indexer_head_dim=16 \
    indexer_topk=16 max_target_length=64 per_device_batch_size=4 dataset_type=synthetic tokenizer_path="$tok" \
    base_output_directory="$tmp/runs" run_name="$run" steps="$steps" "$@" >/dev/null 2>"$tmp/$run.err"
}
metric() { grep -o "\"$2\":[0-9.e+-]*" "$tmp/runs/$1/metrics.jsonl" | cut -d: -f2 | sed -n "$3p"; }
dsa dsa 100 learning_rate=3.0e-3
check '[ $? -eq 0 ] && grep -q "the dense warm-up, attention dense; the indexer is not trained" "$tmp/dsa.err"' \
  "DSA dense steps ($(tail -1 "$tmp/dsa.err"))"
dsa dsa 200 resume=true learning_rate=1.0e-2 "trainable_parameters_mask=['.*indexer.*']" indexer_loss_scaling_factor=1
check '[ $? -eq 0 ] && grep -q "the indexer learns from its KL loss" "$tmp/dsa.err"' "DSA warm-up ($(tail -1 "$tmp/dsa.err"))"
check 'awk -v a="$(metric dsa indexer_loss 101)" -v b="$(metric dsa indexer_loss 200)" "BEGIN { exit !(a > 0 && b < 0.5 * a) }"' \
  "the warm-up's KL falls by half or more: $(metric dsa indexer_loss 101) -> $(metric dsa indexer_loss 200)"
check '[ -n "$(metric dsa lm_loss 101)" ] && [ "$(metric dsa lm_loss 101)" = "$(metric dsa lm_loss 200)" ]' \
  "the frozen model's LM loss stays put: $(metric dsa lm_loss 101) -> $(metric dsa lm_loss 200)"
"$bin" export --checkpoint "$tmp/runs/dsa/checkpoints/step_200" --out "$tmp/hf32" >/dev/null
check '[ $? -eq 0 ] && grep -q "\"index_n_heads\": 4" "$tmp/hf32/config.json"' "the DSA export is a V3.2 folder"
long="a model that trains and serves mixtures of experts with sparse attention on every machine it meets"
gen=$("$bin" generate --model "$tmp/hf32" --prompt "$long" --max-new-tokens 4 --seed 0 2>/dev/null)
check '[ $? -eq 0 ] && [ -n "$gen" ]' "generate from the DSA export past indexer_topk"
for stage in sparse dense; do
  cp -r "$tmp/runs/dsa" "$tmp/runs/dsa-$stage"
  dsa dsa-$stage 240 resume=true learning_rate=3.0e-3 indexer_loss_scaling_factor=1 \
    indexer_sparse_training=$([ $stage = sparse ] && echo true || echo false)
  check '[ $? -eq 0 ]' "DSA $stage steps resume the warm-up ($(tail -1 "$tmp/dsa-$stage.err"))"
done
check 'grep -q "the sparse stage, attention over the indexer.s top 16 keys" "$tmp/dsa-sparse.err"' "the sparse stage says so"
check 'awk -v s="$(metric dsa-sparse lm_loss 240)" -v d="$(metric dsa-dense lm_loss 240)" \
  "BEGIN { r = s / d; exit !(s != d && r > 0.95 && r < 1.05) }"' \
  "the sparse stage tracks dense: LM loss $(metric dsa-sparse lm_loss 240) vs $(metric dsa-dense lm_loss 240)"

# A real V3.2 layout with fp8 weights (ue8m0 scales) as the starting point
# of the sparse stage: widened to float32, it trains.
v32="$src/tests/data/models/v32_fp8_ue8m0"
printf 'hf_config: %s/config.json\nload_parameters_path: %s\n' "$v32" "$v32" >"$tmp/v32.yml"
"$bin" --threads 2 train "$tmp/v32.yml" dataset_type=synthetic max_target_length=64 per_device_batch_size=2 steps=2 \
  base_output_directory="$tmp/runs" run_name=v32 indexer_sparse_training=true indexer_loss_scaling_factor=0.01 \
  >/dev/null 2>"$tmp/v32.err"
check '[ $? -eq 0 ] && [ -n "$(metric v32 indexer_loss 2)" ]' "the sparse stage from an fp8 V3.2 folder ($(tail -1 "$tmp/v32.err"))"
# The same in bf16 with fp8_full (the indexer itself stays float32).
"$bin" --threads 2 train "$tmp/v32.yml" dataset_type=synthetic max_target_length=64 per_device_batch_size=2 steps=2 \
  base_output_directory="$tmp/runs" run_name=v32q indexer_sparse_training=true indexer_loss_scaling_factor=0.01 \
  dtype=bfloat16 quantization=fp8_full >/dev/null 2>"$tmp/v32q.err"
check '[ $? -eq 0 ] && [ -n "$(metric v32q indexer_loss 2)" ] && grep -q "\"quantization\":\"fp8_full\"" "$tmp/runs/v32q/metrics.jsonl"' \
  "the sparse stage in bf16 with fp8_full ($(tail -1 "$tmp/v32q.err"))"

exit $fail
