#!/usr/bin/env bash
# DeepSeek-V4.1 from the command line: `deepseek init` writes a random
# folder in the release's formats (configs/v41-tiny.json: CSA2 sources and
# readers, Engram before layers 0 and 2, the tokenizer's token classes),
# and `generate` (the prompt in one step or in chunks: the same greedy
# text), `logits` (whole and through the cache), `bench` and `serve` run it;
# what the folder lacks or gets wrong is one error line.
# Usage: v41_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tok="$src/tests/data/tokenizer/tiny/tokenizer.json"
tmp=$(mktemp -d)
trap 'kill $server 2>/dev/null; rm -rf "$tmp"' EXIT
server=""
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

out=$("$bin" init --config "$src/configs/v41-tiny.json" --out "$tmp/m" --dtype fp8 --tokenizer "$tok" --seed 3)
check '[ $? -eq 0 ] && [ -s "$tmp/m/model.safetensors" ] && [ -s "$tmp/m/tokenizer.json" ]' "init a V4.1 folder"
check '[[ "$out" == *"deepseek_v41 model (6 layers, hidden 64, 4 routed experts)"* ]]' "init names what it wrote: $out"
check 'grep -q "\"model_type\": \"deepseek_v41\"" "$tmp/m/config.json" && grep -q "\"text_config\"" "$tmp/m/config.json"' \
  "the config nests the text model as the release does"
for name in layers.0.engram.embed.scale layers.2.engram.wkv.scale layers.1.attn.indexer.wk.weight \
  layers.1.attn.compressor.wgate.weight layers.5.attn.indexer.weights_proj.weight layers.3.ffn.experts.0.w1.scale; do
  check 'head -c 65536 "$tmp/m/model.safetensors" | grep -aq "\"$name\""' "the folder holds $name"
done
check '! head -c 65536 "$tmp/m/model.safetensors" | grep -aq "hc_head"' "no hc_head (lagged mHC)"

gen=$("$bin" generate --model "$tmp/m" --prompt "hello world" --max-new-tokens 12 --seed 0 2>"$tmp/gen.err")
check '[ $? -eq 0 ] && [ -n "$gen" ]' "generate ($(tail -1 "$tmp/gen.err"))"
check 'grep -q "KV cache (deepseek_v41)" "$tmp/gen.err"' "generate names the V4.1 cache"
# The prompt in one step and in chunks of 1 and 3 tokens (the ratio-2
# compressor's open pair, the Engram history and the window rings carried
# between steps): the same greedy text.
prompt="hello world hello tool sep hello world tool hello"
whole=$("$bin" generate --model "$tmp/m" --prompt "$prompt" --max-new-tokens 16 --temperature 0 --prefill-chunk 0 \
  2>/dev/null)
for chunk in 1 3; do
  part=$("$bin" generate --model "$tmp/m" --prompt "$prompt" --max-new-tokens 16 --temperature 0 \
    --prefill-chunk $chunk 2>/dev/null)
  check '[ -n "$whole" ] && [ "$part" = "$whole" ]' "prefill in chunks of $chunk: the same greedy text"
done

toks="$tmp/tokens.json"
echo '[[5, 17, 42, 7, 99, 3, 250, 11, 64, 5, 17, 42, 8, 9, 10, 11, 12, 13, 14, 15], [1, 2, 3]]' >"$toks"
"$bin" logits --model "$tmp/m" --tokens "$toks" --out "$tmp/a.safetensors" >/dev/null 2>&1
check '[ $? -eq 0 ] && [ -s "$tmp/a.safetensors" ]' "logits"
"$bin" logits --model "$tmp/m" --tokens "$toks" --out "$tmp/b.safetensors" --incremental 3 >/dev/null 2>&1
check '[ $? -eq 0 ] && [ -s "$tmp/b.safetensors" ]' "logits through the cache"
"$bin" logits --model "$tmp/m" --tokens "$toks" --out "$tmp/d.safetensors" --incremental 3 --late-index-keys \
  >/dev/null 2>&1
check '[ $? -eq 0 ] && ! cmp -s "$tmp/b.safetensors" "$tmp/d.safetensors"' \
  "logits through the cache with the released code's late index keys differ"
shipped=$("$bin" generate --model "$tmp/m" --prompt "$prompt" --max-new-tokens 4 --temperature 0 --late-index-keys \
  2>/dev/null)
check '[ $? -eq 0 ] && [ -n "$shipped" ]' "generate with --late-index-keys"
expect_error generate --model "$src/tests/data/models/v3_qlora_yarn" --prompt hello --late-index-keys \
  --tokenizer "$tok"
"$bin" logits --model "$tmp/m" --tokens "$toks" --out "$tmp/c.safetensors" --no-quant-sim >/dev/null 2>&1
check '[ $? -eq 0 ] && ! cmp -s "$tmp/a.safetensors" "$tmp/c.safetensors"' "logits without the roundings differ"

b=$("$bin" bench --model "$tmp/m" --prompt-len 24 --new-tokens 4 --repeat 1 2>/dev/null)
check '[ $? -eq 0 ] && [[ "$b" == *"\"decode_tokens_per_s\""* ]] && [[ "$b" == *"\"cache_bytes\""* ]]' "bench: $b"

"$bin" serve --model "$tmp/m" --port 0 >"$tmp/serve.log" 2>&1 &
server=$!
port=$(served_port "$tmp/serve.log")
check '[ -n "$port" ]' "serve listens ($(tail -2 "$tmp/serve.log"))"
if [ -n "$port" ]; then
  r=$(curl -s -m 30 "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "hello world", "max_tokens": 6, "temperature": 0}')
  check '[[ "$r" == *"\"text\":"* ]] && [[ "$r" == *"\"completion_tokens\":6"* ]]' "a completion over HTTP: $r"
fi
kill $server 2>/dev/null
wait $server 2>/dev/null
server=""

# Training: from the initialised folder (its fp8 and fp4 weights widened to
# float32) on a small corpus, the loss goes down; the export generates.
"$bin" prepare --tokenizer "$tok" --input "$src/README.md" --input "$src/docs/*.md" --out "$tmp/data" \
  --eval-fraction 0.2 >/dev/null
cat >"$tmp/run.yml" <<YML
base_output_directory: $tmp/runs
run_name: t
load_parameters_path: $tmp/m
dataset_type: tokens
dataset_path: $tmp/data
tokenizer_path: $tok
mtp_num_layers: 0
steps: 30
per_device_batch_size: 4
max_target_length: 32
learning_rate: 3.0e-3
warmup_steps_fraction: 0.1
remat_policy: full
eval_interval: 30
eval_steps: 1
checkpoint_period: 30
YML
"$bin" train "$tmp/run.yml" hf_config="$tmp/m/config.json" >/dev/null 2>"$tmp/train.err"
check '[ $? -eq 0 ]' "train a V4.1 model ($(tail -2 "$tmp/train.err"))"
check 'grep -q "DeepSeek-V4.1 model" "$tmp/train.err"' "the run names the family"
metric() { grep -o "\"$1\":[0-9.e+-]*" "$tmp/runs/t/metrics.jsonl" | cut -d: -f2 | sed -n "$2p"; }
first=$(metric loss 1)
last=$(metric loss 30)
echo "V4.1 training loss: step 1 $first, step 30 $last"
check 'awk -v a="$first" -v b="$last" "BEGIN { exit !(a > 0 && b < a - 1.0) }"' \
  "the loss goes down by more than 1 nat in 30 steps: $first -> $last"
# Stopped at step 15 and resumed: the uninterrupted run's losses.
"$bin" train "$tmp/run.yml" hf_config="$tmp/m/config.json" run_name=r steps=15 learning_rate_schedule_steps=30 \
  checkpoint_period=15 >/dev/null 2>&1 &&
  "$bin" train "$tmp/run.yml" hf_config="$tmp/m/config.json" run_name=r learning_rate_schedule_steps=30 \
    checkpoint_period=15 resume=true >/dev/null 2>&1
check '[ $? -eq 0 ] && diff <(grep -o "\"loss\":[0-9.e+-]*" "$tmp/runs/t/metrics.jsonl") \
  <(grep -o "\"loss\":[0-9.e+-]*" "$tmp/runs/r/metrics.jsonl") >/dev/null' "stopped at step 15 and resumed: the same losses"
# dtype=bfloat16 keeping the named residuals (minimal): V4.1's stages
# round each where they make it, or holding them in bf16 is an error.
"$bin" train "$tmp/run.yml" hf_config="$tmp/m/config.json" run_name=b steps=4 dtype=bfloat16 remat_policy=minimal \
  eval_interval=-1 checkpoint_period=100 >/dev/null 2>"$tmp/b.err"
check '[ $? -eq 0 ] && grep -q "\"dtype\":\"bfloat16\"" "$tmp/runs/b/metrics.jsonl"' \
  "train V4.1 in bfloat16 under remat_policy minimal ($(tail -1 "$tmp/b.err"))"
"$bin" export --checkpoint "$tmp/runs/t/checkpoints/step_30" --out "$tmp/hf" >/dev/null
check '[ $? -eq 0 ] && grep -q "\"deepseek_v41\"" "$tmp/hf/config.json" && [ -s "$tmp/hf/tokenizer.json" ]' \
  "export the trained V4.1 model"
out=$("$bin" generate --model "$tmp/hf" --prompt "the model" --max-new-tokens 8 --temperature 0 2>/dev/null)
check '[ $? -eq 0 ] && [ -n "$out" ]' "generate from the export"

# What the folder lacks or gets wrong: one line each.
cp -r "$tmp/m" "$tmp/notok" && rm "$tmp/notok/tokenizer.json"
expect_error generate --model "$tmp/notok" --prompt "hello" --tokenizer "$tok"
expect_error init --config "$src/configs/v41-tiny.json" --out "$tmp/x" --dtype fp8
expect_error init --config "$src/configs/v41-tiny.json" --out "$tmp/x" --tokenizer "$tok"
sed 's/"kv_source_layer_ids": \[/"kv_source_layer_ids": [2, /' "$src/configs/v41-tiny.json" >"$tmp/bad.json"
expect_error init --config "$tmp/bad.json" --out "$tmp/x" --dtype fp8 --tokenizer "$tok"

exit $fail
