#!/usr/bin/env bash
# Crafted and broken input against the `deepseek` program: every case must
# end in one "deepseek: error:" line and exit code 2 (never a crash, a hang,
# a silent success or a replaced file), and errors that the request itself
# causes must come before any weight is read.
# Usage: hardening_cli_test.sh DEEPSEEK SOURCE_DIR
set -u
bin="$1"
src="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

m="$tmp/tiny"
"$bin" init --config "$src/configs/tiny.yml" --out "$m" --seed 3 >/dev/null || { echo "FAIL: init"; exit 1; }
cp "$src/tests/data/tokenizer/tiny/tokenizer.json" "$m/"
echo '[[1, 2, 3], [4, 5]]' > "$tmp/tokens.json"

# variant NAME SED: a copy of the tiny model whose config.json is edited by SED.
variant() {
  mkdir -p "$tmp/$1"
  cp "$m/model.safetensors" "$m/tokenizer.json" "$tmp/$1/"
  sed -E "$2" "$m/config.json" > "$tmp/$1/config.json"
}

# ---- 1. sizes from files and the command line are bounded and checked ----
variant heads 's/"num_attention_heads": 4/"num_attention_heads": 2305843009213693956/; s/"num_key_value_heads": 4/"num_key_value_heads": 2305843009213693956/'
expect_error generate --model "$tmp/heads" --prompt hi --max-new-tokens 2
check '"$bin" generate --model "$tmp/heads" --prompt hi 2>&1 | grep -q "num_attention_heads = 2305843009213693956 is above"' \
  "the error names the key and its value"
expect_error init --config "$src/configs/tiny.yml" --set vocab_size=4611686018427387904 --out "$tmp/never"
check '[ ! -e "$tmp/never" ]' "a rejected init writes nothing"
expect_error init --config "$src/configs/tiny.yml" --set num_experts=65536 --set base_moe_mlp_dim=1048576 --out "$tmp/never"
expect_error bench --model "$m" --batch 1000000000000
expect_error bench --model "$m" --batch 65536 --prompt-len 1000 --new-tokens 1
expect_error generate --model "$m" --prompt hi --max-new-tokens 99999999999999999999
long=$(printf '9%.0s' $(seq 400))
err=$("$bin" bench --model "$m" --batch "$long" 2>&1 >/dev/null)
check '[ ${#err} -lt 300 ]' "a 400-digit value gives a short error line (${#err} characters)"
check '[[ "$err" == deepseek:\ error:* ]]' "a 400-digit value gives an error line: $err"

# ---- 2. nothing wrong passes as a result ----
variant layers 's/"num_hidden_layers": 3/"num_hidden_layers": 2/'
expect_error logits --model "$tmp/layers" --tokens "$tmp/tokens.json" --out "$tmp/l.safetensors"
check '"$bin" logits --model "$tmp/layers" --tokens "$tmp/tokens.json" --out "$tmp/l.safetensors" 2>&1 | grep -q "belongs to layer 2"' \
  "a config with fewer layers than the checkpoint names the stray layer"
variant mtp 's/"num_hidden_layers": 3/"num_hidden_layers": 2/; s/"num_nextn_predict_layers": 0/"num_nextn_predict_layers": 1/'
check '"$bin" logits --model "$tmp/mtp" --tokens "$tmp/tokens.json" --out "$tmp/mtp.safetensors" >/dev/null' \
  "layers in [L, L + num_nextn_predict_layers) load as MTP layers"
variant float 's/"hidden_size": 64/"hidden_size": 64.9/'
expect_error generate --model "$tmp/float" --prompt hi
variant floatzero 's/"hidden_size": 64/"hidden_size": 64.0/'
expect_error generate --model "$tmp/floatzero" --prompt hi
variant string 's/"hidden_size": 64/"hidden_size": "64"/'
expect_error generate --model "$tmp/string" --prompt hi
expect_error logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/l.safetensors" --incremental -5
expect_error logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/l.safetensors" --incremental 0
check '"$bin" logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/inc.safetensors" --incremental 2 >/dev/null' \
  "--incremental 2 runs"

# ---- 3. outputs never replace what is not a plain file ----
echo old > "$tmp/target"
ln -s "$tmp/target" "$tmp/link"
check '"$bin" logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/link" >/dev/null' "--out through a symlink"
check '[ -L "$tmp/link" ] && [ "$(head -c 8 "$tmp/target" | wc -c)" -eq 8 ] && ! grep -q "^old$" "$tmp/target"' \
  "the symlink stays a symlink and its target holds the logits"
mkfifo "$tmp/fifo"
expect_error logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/fifo"
check '[ -p "$tmp/fifo" ]' "a FIFO given as --out is still a FIFO"
mkdir "$tmp/adir"
expect_error logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/adir"
check '[ -d "$tmp/adir" ]' "a folder given as --out is still a folder"
ln -s "$tmp/fifo" "$tmp/fifolink"
expect_error logits --model "$m" --tokens "$tmp/tokens.json" --out "$tmp/fifolink"
check '[ -p "$tmp/fifo" ] && [ -L "$tmp/fifolink" ]' "a symlink to a FIFO is refused, both left alone"
# (A device node is covered by hardening_test, which only resolves the path:
# a regression here must not be able to replace /dev/null on the test machine.)
# The output folder is checked before the model: a model folder that would
# fail to load must not be reached.
mkdir "$tmp/broken"
cp "$m/config.json" "$tmp/broken/"
echo garbage > "$tmp/broken/model.safetensors"
check '"$bin" logits --model "$tmp/broken" --tokens "$tmp/tokens.json" --out "$tmp/missing/l.safetensors" 2>&1 | grep -q "does not exist"' \
  "a --out in a missing folder fails before the model loads"
expect_error init --config "$src/configs/tiny.yml" --out "$tmp/target"

# ---- 4. lost output is an error ----
if [ -w /dev/full ]; then
  check '! echo "[\"hi\"]" | "$bin" tokenize --tokenizer "$m/tokenizer.json" >/dev/full 2>/dev/null' "tokenize to a full disk fails"
  check '! echo "[[1, 2]]" | "$bin" detokenize --tokenizer "$m/tokenizer.json" >/dev/full 2>/dev/null' "detokenize to a full disk fails"
  check '! "$bin" generate --model "$m" --prompt hi --max-new-tokens 2 >/dev/full 2>/dev/null' "generate to a full disk fails"
  err=$(echo '["hi"]' | "$bin" tokenize --tokenizer "$m/tokenizer.json" 2>&1 >/dev/full)
  check '[[ "$err" == "deepseek: error: writing to standard output failed"* ]]' "a full disk is reported: $err"
fi
check '! echo "[\"hi\"]" | "$bin" tokenize --tokenizer "$m/tokenizer.json" 2>/dev/null >&-' "tokenize to a closed stdout fails"
check '! "$bin" generate --model "$m" --prompt hi --max-new-tokens 2 2>/dev/null >&-' "generate to a closed stdout fails"

# ---- 5. no resource bombs ----
sed 's/"Ġhello": 284/"Ġhello": 67108864/' "$m/tokenizer.json" > "$tmp/huge_id.json"
start=$(date +%s%N)
expect_error tokenize --tokenizer "$tmp/huge_id.json" <<< '["hi"]'
ms=$(( ($(date +%s%N) - start) / 1000000 ))
check '[ "$ms" -lt 2000 ]' "a tokenizer with one id of 2^26 is refused at once (${ms} ms)"
sed 's/"Ġhello": 284/"Ġhello": 1073741823/' "$m/tokenizer.json" > "$tmp/huge_id2.json"
expect_error tokenize --tokenizer "$tmp/huge_id2.json" <<< '["hi"]'

# ---- 6. failing at the start, not midway ----
# A tokenizer with a hole in its ids is refused when it loads.
sed 's/"Ġhello": 284/"Ġhello": 290/' "$m/tokenizer.json" > "$tmp/hole.json"
expect_error generate --model "$m" --tokenizer "$tmp/hole.json" --prompt hi
# Sampling options and lengths are checked before the weights are read.
for opt in "--temperature -1" "--temperature nan" "--top-p 0" "--top-p 1.5" "--top-k -1"; do
  # shellcheck disable=SC2086
  err=$("$bin" generate --model "$tmp/broken" --tokenizer "$m/tokenizer.json" --prompt hi $opt 2>&1 >/dev/null)
  check '[[ "$err" == deepseek:\ error:* && "$err" != *safetensors* ]]' "$opt is refused before the weights: $err"
done
out=$("$bin" generate --model "$m" --prompt hi --temperature -1 2>/dev/null)
check '[ -z "$out" ]' "a refused generate prints nothing (not even the prompt)"
long_prompt=$(printf 'hello %.0s' $(seq 1100))
err=$("$bin" generate --model "$tmp/broken" --tokenizer "$m/tokenizer.json" --prompt "$long_prompt" 2>&1 >/dev/null)
check '[[ "$err" == *max_position_embeddings* ]]' "a prompt beyond max_position_embeddings is refused first: $err"
# A DeepSeek-V3.2 config (read first, so the broken weight file is not reached).
sed -E 's/"model_type": "deepseek_v3"/"model_type": "deepseek_v32", "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8/' \
  "$m/config.json" > "$tmp/broken/config.json"
echo '[[1, 2, 512]]' > "$tmp/oov.json"
err=$("$bin" logits --model "$tmp/broken" --tokens "$tmp/oov.json" --out "$tmp/x.safetensors" 2>&1 >/dev/null)
check '[[ "$err" == *"not a token id in [0, 512)"* ]]' "an out-of-vocabulary id is refused before the weights: $err"

# ---- 7. training and export ----
cat > "$tmp/run.yml" <<YML
model_name: $src/configs/tiny.yml
base_output_directory: $tmp/runs
dataset_type: synthetic
per_device_batch_size: 1
max_target_length: 8
steps: 2
log_period: 1000
YML
check '"$bin" train "$tmp/run.yml" run_name=t >/dev/null 2>&1' "a tiny run trains"
ck="$tmp/runs/t/checkpoints/step_2"
# Export checks every output path before writing: a FIFO as tokenizer.json.
mkdir "$tmp/hf_fifo"
mkfifo "$tmp/hf_fifo/tokenizer.json"
err=$("$bin" export --checkpoint "$ck" --out "$tmp/hf_fifo" 2>&1 >/dev/null)
check '[[ "$err" == *"hf_fifo/tokenizer.json'"'"' exists and is not a regular file"* ]] && [ ! -e "$tmp/hf_fifo/model.safetensors" ]' \
  "export into a folder whose tokenizer.json is a FIFO fails before writing, naming it: $err"
# Another model's tokenizer files go when the run recorded none.
mkdir "$tmp/hf_old"
cp "$m/tokenizer.json" "$tmp/hf_old/"
echo '{}' > "$tmp/hf_old/tokenizer_config.json"
out=$("$bin" export --checkpoint "$ck" --out "$tmp/hf_old")
check '[ $? -eq 0 ] && [ -f "$tmp/hf_old/model.safetensors" ] && [ ! -e "$tmp/hf_old/tokenizer.json" ] && [ ! -e "$tmp/hf_old/tokenizer_config.json" ]' \
  "export removes another model's tokenizer files when the run has none: $out"
# A flipped byte in the checkpoint: refused, nothing exported.
cp -r "$ck" "$tmp/step_2"
printf '\x55' | dd of="$tmp/step_2/params.safetensors" bs=1 seek=$(( $(stat -c %s "$tmp/step_2/params.safetensors") - 5 )) conv=notrunc 2>/dev/null
expect_error export --checkpoint "$tmp/step_2" --out "$tmp/hf_bad"
check '[ ! -e "$tmp/hf_bad/model.safetensors" ]' "a corrupt checkpoint exports nothing"
# A second trainer in a running run's folder is refused at once, naming the holder.
"$bin" train "$tmp/run.yml" run_name=busy steps=100000 checkpoint_period=1000000 >/dev/null 2>&1 &
first=$!
for _ in $(seq 100); do grep -q "^pid $first " "$tmp/runs/busy/run.lock" 2>/dev/null && break; sleep 0.1; done
err=$("$bin" train "$tmp/run.yml" run_name=busy resume=true 2>&1 >/dev/null)
check '[[ "$err" == "deepseek: error: run folder '"'"'$tmp/runs/busy'"'"' is in use by another trainer (pid $first on host "* ]]' \
  "a second trainer in one run folder is refused: $err"
kill -TERM "$first"
wait "$first"
# Impossible runs are refused in milliseconds, naming the keys.
start=$(date +%s%N)
err=$("$bin" train "$tmp/run.yml" run_name=big per_device_batch_size=1000000 max_target_length=1024 2>&1 >/dev/null)
ms=$(( ($(date +%s%N) - start) / 1000000 ))
check '[[ "$err" == *"per_device_batch_size 1000000 x max_target_length 1024"*"more than this machine"* ]] && [ "$ms" -lt 3000 ]' \
  "a batch beyond memory is refused at once (${ms} ms): $err"
expect_error train "$tmp/run.yml" run_name=big per_device_batch_size=1000000 max_target_length=1024
printf 'steps: 3\nlearning_rate: 1e-3\nsteps: 4\n' >> "$tmp/run.yml"
err=$("$bin" train "$tmp/run.yml" run_name=twice 2>&1 >/dev/null)
check '[[ "$err" == *"run.yml: key '"'"'steps'"'"' is given twice (lines 6 and 8)"* ]]' "a key given twice in one file: $err"
expect_error train "$tmp/run.yml" run_name=twice
# num_experts=0 on a MoE preset; errors about the user's keys name where they were given, not the preset.
printf 'model_name: %s\nbase_output_directory: %s\ndataset_type: synthetic\nper_device_batch_size: 1\nmax_target_length: 8\nsteps: 1\nnum_experts: 0\n' \
  "$src/configs/tiny.yml" "$tmp/runs" > "$tmp/moe.yml"
err=$("$bin" train "$tmp/moe.yml" 2>&1 >/dev/null)
check '[[ "$err" == "deepseek: error: $tmp/moe.yml: num_experts=0 on a mixture-of-experts model"* ]]' "num_experts=0: $err"
expect_error train "$tmp/moe.yml"
err=$("$bin" train "$tmp/moe.yml" num_experts=8 base_emb_dim=0 2>&1 >/dev/null)
check '[[ "$err" == "deepseek: error: $tmp/moe.yml and command line: model keys num_experts=8, base_emb_dim=0 on top of preset"*"hidden_size must be positive"* ]]' \
  "a model key that breaks the preset names the user's file and the command line: $err"
err=$("$bin" train "$tmp/moe.yml" model_name="$src/configs/v4-tiny.yml" 2>&1 >/dev/null)
check '[[ "$err" == "deepseek: error: $tmp/moe.yml: model keys num_experts=0 on top of preset '"'"'$src/configs/v4-tiny.yml'"'"': "* ]]' \
  "the same for a DeepSeek-V4 preset: $err"
# Command-line bounds name the real range, not DBL_MAX; -1 does not wrap around.
err=$("$bin" --threads 0 selfcheck 2>&1 >/dev/null)
check '[[ "$err" == *"Value 0 not in range 1 to 65536"* ]]' "--threads 0: $err"
expect_error --threads 0 selfcheck
err=$("$bin" prepare --tokenizer "$m/tokenizer.json" --input "$tmp/run.yml" --out "$tmp/p" --seed -1 2>&1 >/dev/null)
check '[[ "$err" == *"Value -1 not in range 0 to 18446744073709551615"* ]] && [ ! -e "$tmp/p" ]' "prepare --seed -1: $err"
expect_error prepare --tokenizer "$m/tokenizer.json" --input "$tmp/run.yml" --out "$tmp/p" --seed -1

exit $fail
