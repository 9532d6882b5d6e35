#!/usr/bin/env bash
# Decode where it is bound by memory: deepseek.cpp against llama.cpp on the
# same ~1.2 GB DeepSeek-V3-shaped model (configs/bench-1gb.yml, random
# weights), in bf16, 8-bit and 4-bit, each engine in its own formats:
#   ours       the bf16 folder, `deepseek quantize --type q8_0`,
#              `--type q4_k_m` and `--type q4_k` (every matrix 4-bit but the
#              output head; its row is against llama.cpp's Q4_K_M too);
#   llama.cpp  the same folder exported as a bf16 GGUF (`deepseek export
#              --model`), `llama-quantize` Q8_0 and Q4_K_M of it.
# Prints decode (batch 1) and prefill tokens/s of both (medians of REPEAT
# runs: `deepseek bench` and llama-bench), their ratios, our batch-8 decode,
# the bytes a decode step reads (every tensor, the routed experts at
# top-k / experts of their bytes, one row of the embedding) and the share of
# the memory's read bandwidth each decode reaches (peak_bench's
# read_bandwidth in the same run; a share above 1 means the active experts
# of consecutive tokens were still in the caches).
# Usage: bench/llamacpp_quant_compare.sh [BUILD_DIR]
#   TOKENIZER (default data/sotu-tokenizer/tokenizer.json, run.sh's; the
#   config's vocabulary is its 1024), REPEAT (3), NEW_TOKENS (64), PP (64),
#   LLAMACPP_DIR / LLAMACPP_VERSION as bench/llamacpp_compare.sh.
# Needs cmake, a C++ compiler, npm (to fetch node-llama-cpp) and python3.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
bin="$build/deepseek"
tokenizer="${TOKENIZER:-$root/data/sotu-tokenizer/tokenizer.json}"
repeat="${REPEAT:-3}"
new_tokens="${NEW_TOKENS:-64}"
pp="${PP:-64}"
threads="${THREADS:-$(nproc)}"
[ -f "$tokenizer" ] || { echo "no tokenizer at $tokenizer (run scripts/run.sh, or set TOKENIZER)" >&2; exit 2; }
source "$root/bench/llamacpp_build.sh"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" init --config "$root/configs/bench-1gb.yml" --seed 1 --out "$tmp/bf16" --tokenizer "$tokenizer" >/dev/null
"$bin" quantize --model "$tmp/bf16" --out "$tmp/q8_0" --type q8_0 >/dev/null
"$bin" quantize --model "$tmp/bf16" --out "$tmp/q4_k_m" --type q4_k_m >/dev/null
"$bin" quantize --model "$tmp/bf16" --out "$tmp/q4_k" --type q4_k >/dev/null
"$bin" export --model "$tmp/bf16" --format gguf --dtype bf16 --out "$tmp/bf16.gguf" >/dev/null
"$lbin/llama-quantize" "$tmp/bf16.gguf" "$tmp/q8_0.gguf" Q8_0 "$threads" >/dev/null 2>&1
"$lbin/llama-quantize" "$tmp/bf16.gguf" "$tmp/q4_k_m.gguf" Q4_K_M "$threads" >/dev/null 2>&1
bw=$("$build/bench/peak_bench" --benchmark_filter=read_bandwidth 2>/dev/null | grep -o 'GB/s=[0-9.]*' | cut -d= -f2)
echo "llama.cpp: node-llama-cpp $version ($(git -C "$src" log -1 --format=%h)); threads $threads;" \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); read bandwidth $bw GB/s"

# Bytes a decode step reads from a safetensors folder or a GGUF file.
step_mb() {
  python3 - "$1" <<'PY'
import json, struct, sys
path = sys.argv[1]
k, E = 4, 32  # configs/bench-1gb.yml: num_experts_per_tok, num_experts
def st(folder):
    with open(folder + "/model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    for name, t in h.items():
        if name == "__metadata__": continue
        b = t["data_offsets"][1] - t["data_offsets"][0]
        yield name, b, t["shape"][0]
def gguf_sizes(p):
    # GGUF v3: tensor infos (name, dims, type, offset); sizes from the offsets.
    import os
    f = open(p, "rb"); r = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))
    assert f.read(4) == b"GGUF"; ver, nt, nkv = r("I")[0], r("Q")[0], r("Q")[0]
    def rs(): n = r("Q")[0]; return f.read(n).decode()
    def skip(t):
        if t == 8: rs()
        elif t == 9:
            at, n = r("I")[0], r("Q")[0]
            for _ in range(n): skip(at)
        else: f.read({0:1,1:1,2:2,3:2,4:4,5:4,6:4,7:1,10:8,11:8,12:8}[t])
    align = 32
    for _ in range(nkv):
        key = rs(); t = r("I")[0]
        if key == "general.alignment": align = r("I")[0]
        else: skip(t)
    infos = []
    for _ in range(nt):
        name = rs(); nd = r("I")[0]; dims = r("Q" * nd); t = r("I")[0]; off = r("Q")[0]
        infos.append((name, dims, off))
    data = (f.tell() + align - 1) // align * align
    end = os.path.getsize(p) - data
    infos.sort(key=lambda i: i[2])
    for i, (name, dims, off) in enumerate(infos):
        nxt = infos[i + 1][2] if i + 1 < len(infos) else end
        yield name, nxt - off, dims[-1] if len(dims) > 1 else 1
total = 0.0
items = gguf_sizes(path) if path.endswith(".gguf") else st(path)
for name, b, rows in items:
    if name in ("model.embed_tokens.weight", "token_embd.weight"): b /= rows
    elif ".mlp.experts." in name: b *= k / E
    elif "_exps." in name: b *= k / E
    total += b
print(f"{total / 1e6:.1f}")
PY
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ours() {  # FOLDER BATCH FIELD
  for k in $(seq "$repeat"); do
    "$bin" bench --model "$1" --batch "$2" --prompt-len "$pp" --new-tokens "$new_tokens" --repeat 1 2>/dev/null
  done | grep -o "\"$3\":[0-9.e+-]*" | cut -d: -f2 | median
}
printf '%-7s | %-24s | %-24s | %-8s | %-8s | %-22s | %s\n' format "decode b1 ours/llama" "prefill ours/llama" \
  "ours b8" "MB/step" "share of bandwidth" "llama MB/step"
for t in bf16 q8_0 q4_k_m q4_k; do
  g=$t
  [ "$t" = q4_k ] && g=q4_k_m  # llama.cpp's 4-bit file for both of our 4-bit recipes
  o_tg=$(ours "$tmp/$t" 1 decode_tokens_per_s)
  o_pp=$(ours "$tmp/$t" 1 prefill_tokens_per_s)
  o_b8=$(ours "$tmp/$t" 8 decode_tokens_per_s)
  "$lbin/llama-bench" -m "$tmp/$g.gguf" -p "$pp" -n "$new_tokens" -r "$repeat" -t "$threads" -o csv 2>/dev/null >"$tmp/l.csv"
  col() { tr -d '"' <"$tmp/l.csv" | awk -F, -v p="$1" -v g="$2" 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
    $c["n_prompt"] == p && $c["n_gen"] == g { print $c["avg_ts"] }'; }
  l_tg=$(col 0 "$new_tokens")
  l_pp=$(col "$pp" 0)
  o_mb=$(step_mb "$tmp/$t")
  l_mb=$(step_mb "$tmp/$g.gguf")
  printf '%-7s | %7.1f / %7.1f = %4.2f | %7.1f / %7.1f = %4.2f | %8.1f | %8s | ours %4.2f, llama %4.2f | %s\n' \
    "$t" "$o_tg" "$l_tg" "$(awk -v a="$o_tg" -v b="$l_tg" 'BEGIN { print a / b }')" \
    "$o_pp" "$l_pp" "$(awk -v a="$o_pp" -v b="$l_pp" 'BEGIN { print a / b }')" "$o_b8" "$o_mb" \
    "$(awk -v t="$o_tg" -v m="$o_mb" -v b="$bw" 'BEGIN { print t * m / 1000 / b }')" \
    "$(awk -v t="$l_tg" -v m="$l_mb" -v b="$bw" 'BEGIN { print t * m / 1000 / b }')" "$l_mb"
done
