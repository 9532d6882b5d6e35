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

exit $fail
