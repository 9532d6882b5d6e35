#!/usr/bin/env bash
# The model commands end to end: `init` writes a folder that `generate`,
# `bench` and `logits` read; bad input gives one error line and exit code 2.
# Usage: model_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

m="$tmp/tiny"
check '"$bin" init --config "$src/configs/tiny.yml" --out "$m" --seed 3 >/dev/null' "init tiny"
check '[ -s "$m/config.json" ] && [ -s "$m/model.safetensors" ]' "init wrote config.json and model.safetensors"
check '! ls "$m" | grep -q tmp' "init left no temporary files"
# The same seed gives the same bytes; another seed does not.
"$bin" init --config "$src/configs/tiny.yml" --out "$tmp/again" --seed 3 >/dev/null
"$bin" init --config "$src/configs/tiny.yml" --out "$tmp/other" --seed 4 >/dev/null
check 'cmp -s "$m/model.safetensors" "$tmp/again/model.safetensors"' "init is deterministic"
check '! cmp -s "$m/model.safetensors" "$tmp/other/model.safetensors"' "init seed changes the weights"
"$bin" init --config "$src/configs/tiny.yml" --out "$tmp/fp8" --seed 3 --dtype fp8 >/dev/null
check 'grep -q "\"quant_method\": \"fp8\"" "$tmp/fp8/config.json"' "init --dtype fp8 writes a quantization_config"
check '"$bin" bench --model "$tmp/fp8" --batch 2 --prompt-len 5 --new-tokens 3 | grep -q decode_tokens_per_s' \
  "an fp8 checkpoint from init runs"
"$bin" init --config "$tmp/fp8/config.json" --out "$tmp/fp8_to_bf16" >/dev/null
check '! grep -q quantization_config "$tmp/fp8_to_bf16/config.json"' "a bf16 folder made from an fp8 config.json claims no quantization"
# A written config.json is a valid init source too, and --set overrides YAML keys.
check '"$bin" init --config "$m/config.json" --out "$tmp/fromjson" >/dev/null' "init from config.json"
check '"$bin" init --config "$src/configs/tiny.yml" --set base_num_decoder_layers=2 --out "$tmp/two" >/dev/null' "init --set"
check 'grep -q "\"num_hidden_layers\": 2" "$tmp/two/config.json"' "--set reached config.json"
# A DeepSeek-V4 preset (decoder_block deepseek4) or deepseek_v4 config.json
# gives a deepseek_v4 folder that bench runs; from its own config.json the
# same seed writes the same bytes; --set reaches it; fp8 and a key V4 has
# not are one error line each.
v4="$tmp/v4"
check '"$bin" init --config "$src/configs/v4-tiny.yml" --out "$v4" --seed 3 | grep -q "deepseek_v4 model (4 layers"' \
  "init a V4 preset"
check 'grep -q "\"model_type\": \"deepseek_v4\"" "$v4/config.json" && [ -s "$v4/model.safetensors" ]' \
  "init wrote a deepseek_v4 folder"
check '"$bin" bench --model "$v4" --batch 2 --prompt-len 20 --new-tokens 3 --repeat 1 | grep -q "\"attention\":\"deepseek_v4\""' \
  "a V4 folder from init runs"
"$bin" init --config "$v4/config.json" --out "$tmp/v4again" --seed 3 >/dev/null
check 'cmp -s "$v4/model.safetensors" "$tmp/v4again/model.safetensors"' "V4 init from its config.json is the same bytes"
"$bin" init --config "$src/configs/v4-tiny.yml" --out "$tmp/v4two" --set base_num_decoder_layers=2 --set "compress_ratios=[0, 4]" >/dev/null
check 'grep -q "\"num_hidden_layers\": 2" "$tmp/v4two/config.json"' "--set reaches a V4 preset"
expect_error init --config "$src/configs/v4-tiny.yml" --out "$tmp/v4fp8" --dtype fp8
expect_error init --config "$src/configs/v4-tiny.yml" --out "$tmp/v4bad" --set mystery_key=1
# V4 speculative decoding: a folder without an MTP layer is refused; the
# fixture made by DeepSeek's code (mtp.0) drafts chains of two.
expect_error bench --model "$v4" --batch 1 --prompt-len 8 --new-tokens 4 --speculative mtp
check '"$bin" bench --model "$src/tests/data/v4/models/v4_tiny" --batch 2 --prompt-len 12 --new-tokens 16 --repeat 1 \
  --speculative mtp --draft-tokens 2 | grep -q "\"draft_tokens\":2.*\"speculative\":\"mtp\""' "bench --speculative mtp on V4"

cp "$src/tests/data/tokenizer/tiny/tokenizer.json" "$m/"
out=$("$bin" generate --model "$m" --prompt "hello world" --max-new-tokens 12 --temperature 0 2>"$tmp/stats")
check '[ $? -eq 0 ]' "generate exits 0"
check '[[ "$out" == "hello world"* ]]' "generate prints the prompt, then the continuation"
check 'grep -q "prefill: .*tok/s); decode: 11 tokens" "$tmp/stats"' "generate reports prefill and decode speed"
check 'grep -q "KV cache (latent)" "$tmp/stats"' "generate reports the cache"
naive=$("$bin" generate --model "$m" --prompt "hello world" --max-new-tokens 12 --temperature 0 --kv-cache naive 2>/dev/null)
check '[ "$out" == "$naive" ]' "greedy text is the same with the naive cache"
chunked=$("$bin" generate --model "$m" --prompt "hello world" --max-new-tokens 12 --temperature 0 --prefill-chunk 1 2>/dev/null)
check '[ "$chunked" == "$out" ]' "a prefill one token per step generates the same text"
a=$("$bin" generate --model "$m" --prompt "hi" --max-new-tokens 8 --temperature 1 --top-k 20 --top-p 0.9 --seed 5 2>/dev/null)
b=$("$bin" generate --model "$m" --prompt "hi" --max-new-tokens 8 --temperature 1 --top-k 20 --top-p 0.9 --seed 5 2>/dev/null)
check '[ "$a" == "$b" ]' "sampling is reproducible with a seed"

json=$("$bin" bench --model "$m" --batch 2 --prompt-len 5 --new-tokens 3)
check '[[ "$json" == *"\"decode_tokens_per_s\""* && "$json" == *"\"prefill_tokens_per_s\""* ]]' "bench prints a JSON line: $json"
check '[[ "$json" == *"\"prefill_model_flops_per_token\":"[1-9]* && "$json" == *"\"prefill_gflop_per_s\":"[0-9]* ]]' \
  "bench reports the prefill's model FLOPs per token and its FLOP rate: $json"
# DEEPSEEK_STAGE_TIMES=1 prints each layer stage's time at exit, a table
# for the prefill steps and one for the decode steps (every stage a MoE
# model meets, with a nonzero total); off, nothing.
times=$(DEEPSEEK_STAGE_TIMES=1 "$bin" bench --model "$m" --batch 2 --prompt-len 20 --new-tokens 3 --repeat 1 2>&1 >/dev/null)
prefill_times=${times#*prefill steps:}
prefill_times=${prefill_times%%stage times*}
decode_times=${times#*decode steps:}
check '[[ "$times" == *"prefill steps:"* && "$times" == *"decode steps:"* && "$times" != *"other calls"* ]]' \
  "stage times has a prefill and a decode table, nothing else: $times"
for part in "$prefill_times" "$decode_times"; do
  for stage in norms "query projection" "key/value projection" attention "output projection" "routing and gather" \
    experts combine "dense MLP"; do
    check '[[ "$part" == *"  $stage "*" ms "*"%"* ]]' "stage times list '$stage': $part"
  done
  # A decode step of this model takes microseconds on a fast CPU, below the
  # table's 0.1 ms resolution: the share of the total says it was timed.
  check '[[ "$part" =~ attention\ +[0-9]+\.[0-9]\ ms\ +([0-9]+\.[0-9])% && "${BASH_REMATCH[1]}" != "0.0" ]]' \
    "the attention stage took some time: $part"
done
check '[[ "$("$bin" bench --model "$m" --batch 2 --prompt-len 5 --new-tokens 1 --repeat 1 2>&1 >/dev/null)" != *"stage times"* ]]' \
  "no stage times unless asked"

# The bf16 matmul precision runs every path (bf16 weights, fp8 weights,
# generation) and says so; an unknown precision is one error line.
json=$("$bin" --matmul-precision bf16 bench --model "$m" --batch 2 --prompt-len 20 --new-tokens 3 --repeat 1)
check '[[ "$json" == *"\"matmul_precision\":\"bf16\""* ]]' "bench --matmul-precision bf16 reports it: $json"
check '"$bin" --matmul-precision bf16 bench --model "$tmp/fp8" --batch 2 --prompt-len 20 --new-tokens 3 --repeat 1 | grep -q "\"matmul_precision\":\"bf16\""' \
  "an fp8 checkpoint runs in bf16 precision"
bf16_out=$("$bin" --matmul-precision bf16 generate --model "$m" --prompt "hello world" --max-new-tokens 12 --temperature 0 2>/dev/null)
check '[[ "$bf16_out" == "hello world"* ]]' "generate runs in bf16 precision"
expect_error --matmul-precision fp8 bench --model "$m"

# --quantized-x: bench reports it (int8 by default); an unknown value is one error line.
check '"$bin" bench --model "$m" --batch 1 --prompt-len 5 --new-tokens 1 --repeat 1 | grep -q "\"quantized_x\":\"int8\""' \
  "bench reports quantized_x int8 by default"
check '"$bin" --quantized-x f32 bench --model "$m" --batch 1 --prompt-len 5 --new-tokens 1 --repeat 1 | grep -q "\"quantized_x\":\"f32\""' \
  "bench --quantized-x f32 reports it"
expect_error --quantized-x int4 bench --model "$m"

# DeepSeek-V3.2 (use_indexer): init writes the indexer, and generation runs
# past index_topk on sparse attention, the same text through either cache.
v32=(--set use_indexer=true --set indexer_n_heads=2 --set indexer_head_dim=16 --set indexer_topk=8)
check '"$bin" init --config "$src/configs/tiny.yml" "${v32[@]}" --out "$tmp/v32" --seed 3 >/dev/null' "init a V3.2 model"
check 'grep -q "\"model_type\": \"deepseek_v32\"" "$tmp/v32/config.json" && grep -q "\"index_topk\": 8" "$tmp/v32/config.json"' \
  "use_indexer writes a deepseek_v32 config.json"
cp "$src/tests/data/tokenizer/tiny/tokenizer.json" "$tmp/v32/"
sparse=$("$bin" generate --model "$tmp/v32" --prompt "hello world" --max-new-tokens 30 --temperature 0 2>/dev/null)
sparse_naive=$("$bin" generate --model "$tmp/v32" --prompt "hello world" --max-new-tokens 30 --temperature 0 \
  --kv-cache naive 2>/dev/null)
check '[ -n "$sparse" ] && [ "$sparse" == "$sparse_naive" ]' "V3.2 generates past index_topk, the same with either cache"
json=$("$bin" bench --model "$tmp/v32" --prompt-len 20 --new-tokens 4 --repeat 1 --dense-attention)
check '[[ "$json" == *"\"attention\":\"dense\""* ]]' "bench --dense-attention runs the V3.2 model densely: $json"
expect_error bench --model "$m" --prompt-len 5 --new-tokens 2 --dense-attention
expect_error init --config "$src/configs/tiny.yml" --set indexer_n_heads=2 --out "$tmp/noindexer"

echo '[[1, 2, 3], [4]]' > "$tmp/tokens.json"
check '"$bin" logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/l.safetensors" >/dev/null' "logits"

expect_error init --config "$src/configs/tiny.yml" --set no_such_key=1 --out "$tmp/bad"
expect_error init --config "$src/configs/tiny.yml" --out "$src/tests/data/models/v3_fp8_sharded"
expect_error generate --model "$tmp/missing" --prompt x
expect_error generate --model "$tmp/again" --prompt x
expect_error generate --model "$m" --prompt x --kv-cache fancy
expect_error generate --model "$m" --prompt x --top-p 0
expect_error generate --model "$m" --prompt x --prefill-chunk -1
expect_error bench --model "$m" --prompt-len 5000
echo '[[1, 100000]]' > "$tmp/oov.json"
expect_error logits --model "$m" --tokens "$tmp/oov.json" --out "$tmp/x.safetensors"
echo '[[1, 2' > "$tmp/broken.json"
expect_error logits --model "$m" --tokens "$tmp/broken.json" --out "$tmp/x.safetensors"
expect_error logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/x.safetensors" --incremental 9
check '[ ! -e "$tmp/x.safetensors" ]' "failed logits commands wrote no output"

[ "$fail" -eq 0 ] && echo "model_cli: all checks passed"
exit "$fail"
