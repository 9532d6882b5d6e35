#!/usr/bin/python3
"""Writes a randomly initialised DeepSeek-V4 model folder for speed and memory benchmarks.

  /usr/bin/python3 bench/make_v4_random.py --out DIR [--layers 4] [--experts 16] [--seed 0] [--vocab 129280]

writes DIR/config.json (model_type deepseek_v4) and DIR/model.safetensors in the upstream (hub) tensor
layout, with V4-Flash's layer shapes (hidden 4096, 64 heads of 512, q/o LoRA ranks 1024, 8 output groups,
experts of width 2048, top-6 routing, mHC with 4 streams, the lightning indexer on CSA layers) but only
--layers layers and --experts routed experts. The layer kinds follow Flash's pattern: layer 0 attends over
the sliding window only, then CSA (compress ratio 4) and HCA (128) alternate; the first min(3, layers)
layers route by token id. There is no MTP layer. The engine reads the result with

  deepseek bench --model DIR

Storage is that of the released checkpoint: fp8 e4m3 projections with one E8M0 scale per 128x128 block,
packed fp4 (e2m1) routed experts with one E8M0 scale per 32 inputs, bf16 embedding, head, norms, router
and compressor weights, float32 mHC mixes, sinks, position embeddings and router biases, int64 hash
tables. The values are random but of realistic size (projections ~ N(0, 1/in), norms 1), so that the
engine runs without NaN or overflow; they carry no meaning. Every large tensor is drawn as random bytes
mapped through a code table (normal quantiles encoded to the stored format), which is much faster than
drawing and encoding float32 normals. The safetensors header is written first from the known tensor
list, then each tensor is streamed in chunks of CHUNK_BYTES, so memory stays small whatever the size.
Deterministic: the same arguments write byte-identical files.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

CHUNK_BYTES = 64 << 20
FP8_BLOCK = 128  # fp8 projections: one scale per 128 x 128 block
FP4_BLOCK = 32   # fp4 experts: one scale per 32 inputs of a row
E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # of uniform codes
FP8_CODE_STD = 64.0  # std of the e4m3 code table (its largest magnitude is ~2.7 std, well below 448)

DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}


def flash_config(layers, experts, vocab):
    """V4-Flash's config.json with `layers` layers and `experts` routed experts."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab,
        "hidden_size": 4096,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        # layer 0: sliding window only; then CSA (4) and HCA (128) alternate
        "compress_ratios": [0] + [4 if k % 2 else 128 for k in range(1, layers)],
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 1.5,
        "num_hash_layers": min(3, layers),
        "swiglu_limit": 10.0,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 0,
        "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


# ---------------------------------------------------------------------------
# code tables
# ---------------------------------------------------------------------------


def normal_quantiles(n):
    """The n quantiles (k + 0.5) / n of N(0, 1): a table that turns uniform indices into normal values."""
    inv = statistics.NormalDist().inv_cdf
    return np.array([inv((k + 0.5) / n) for k in range(n)])


def e4m3_values():
    """float64 value of every e4m3 code (NaN for 0x7F and 0xFF)."""
    c = np.arange(256)
    e, m = (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where(c & 0x80, -mag, mag)
    v[(c & 0x7F) == 0x7F] = np.nan
    return v


def f32_to_bf16_bits(a):
    """bf16 bit patterns of float32 values, rounded to nearest even."""
    b = np.atleast_1d(np.asarray(a, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    sh = np.uint64(16)
    return ((b + np.uint64(0x7FFF) + ((b >> sh) & np.uint64(1))) >> sh).astype(np.uint16)


def e8m0(exponent):
    """E8M0 byte of the scale 2^exponent."""
    assert -127 <= exponent <= 127, exponent
    return exponent + 127


class Tables:
    """Code tables indexed by random 16-bit words."""

    def __init__(self):
        self.q16 = normal_quantiles(1 << 16)
        self.bf16 = {}
        vals = e4m3_values()
        finite = np.flatnonzero(~np.isnan(vals))
        target = normal_quantiles(256) * FP8_CODE_STD
        # nearest finite e4m3 code to each quantile: a byte -> code table
        near = finite[np.abs(vals[finite][None, :] - target[:, None]).argmin(1)].astype(np.uint16)
        self.fp8_std = float(np.sqrt(np.mean(vals[near] ** 2)))
        # two independent codes per 16-bit index (little-endian: low byte first)
        k = np.arange(1 << 16)
        self.fp8_pair = (near[k & 255] | (near[k >> 8] << 8)).astype("<u2")

    def bf16_table(self, std):
        """16-bit index -> bf16 bits of a N(0, std^2) quantile."""
        if std not in self.bf16:
            self.bf16[std] = f32_to_bf16_bits(self.q16 * std).astype("<u2")
        return self.bf16[std]


# ---------------------------------------------------------------------------
# tensors: (name, dtype, shape, fill) where fill(gen, n_bytes) yields the data in chunks
# ---------------------------------------------------------------------------


def random_words(gen, n_bytes):
    """Uniform random bytes: an array of n_bytes uint8 (fast: raw SFC64 output)."""
    return gen.bit_generator.random_raw(-(-n_bytes // 8)).view(np.uint8)[:n_bytes]


def chunked(n_bytes, make):
    """Yields make(k) for consecutive chunk sizes k (multiples of 8 bytes but the last) summing to n_bytes."""
    done = 0
    while done < n_bytes:
        k = min(CHUNK_BYTES, n_bytes - done)
        yield make(k)
        done += k


def table_fill(table):
    """Data made of table[u16] for uniform random 16-bit words u16."""
    def fill(gen, n_bytes):
        return chunked(n_bytes, lambda k: table[random_words(gen, k).view("<u2")])
    return fill


def const_fill(byte_pattern):
    """Data repeating byte_pattern (e.g. bf16 1.0 or one E8M0 scale)."""
    def fill(gen, n_bytes):
        p = np.frombuffer(byte_pattern, dtype=np.uint8)
        return chunked(n_bytes, lambda k: np.tile(p, k // len(p)))
    return fill


def bytes_fill(gen, n_bytes):
    """Uniform random bytes: packed fp4 nibbles (all 16 e2m1 codes are finite)."""
    return chunked(n_bytes, lambda k: random_words(gen, k))


def f32_fill(draw):
    """Small float32 tensors: draw(gen, count) -> float values."""
    def fill(gen, n_bytes):
        yield np.asarray(draw(gen, n_bytes // 4), dtype="<f4")
    return fill


def tid2eid_fill(experts, k):
    """Hash table rows: k distinct expert ids in [0, experts) per token."""
    def fill(gen, n_bytes):
        rows = n_bytes // (8 * k)
        step = max(1, (1 << 22) // experts)
        for r in range(0, rows, step):
            ids = gen.random((min(step, rows - r), experts)).argsort(axis=1)[:, :k]
            yield ids.astype("<i8")
    return fill


def v4_tensors(cfg, tables):
    """Every tensor of the model in the order of the engine's parameter tree (for_each_v4_param)."""
    d, n, V = cfg["hidden_size"], cfg["hc_mult"], cfg["vocab_size"]
    H, D, Lq = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    g, r = cfg["o_groups"], cfg["o_lora_rank"]
    E, I, K = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    Hi, Di = cfg["index_n_heads"], cfg["index_head_dim"]
    mix = (2 + n) * n
    out = []

    def bf16(name, shape, std):
        out.append((name, "BF16", shape, table_fill(tables.bf16_table(std))))

    def norm(name, dim):
        out.append((name, "BF16", [dim], const_fill(f32_to_bf16_bits(1.0).astype("<u2").tobytes())))

    def f32(name, shape, draw):
        out.append((name, "F32", shape, f32_fill(draw)))

    def normal(std, mean=0.0):
        return lambda gen, k: gen.standard_normal(k) * std + mean

    def hc(prefix, rows, scales):
        f32(prefix + "fn", [rows, n * d], normal(0.05))
        f32(prefix + "base", [rows], normal(0.5))
        f32(prefix + "scale", [scales], lambda gen, k: 0.5 + gen.random(k))

    def fp8(name, shape):
        o, i = shape
        exp = round(math.log2(i ** -0.5 / tables.fp8_std))
        out.append((name, "F8_E4M3", shape, table_fill(tables.fp8_pair)))
        out.append((name[:-len("weight")] + "scale", "F8_E8M0", [-(-o // FP8_BLOCK), -(-i // FP8_BLOCK)],
                    const_fill(bytes([e8m0(exp)]))))

    def fp4(name, shape):
        o, i = shape
        exp = round(math.log2(i ** -0.5 / E2M1_RMS))
        out.append((name, "I8", [o, i // 2], bytes_fill))
        out.append((name[:-len("weight")] + "scale", "F8_E8M0", [o, i // FP4_BLOCK], const_fill(bytes([e8m0(exp)]))))

    def compressor(p, Dc, m):
        width = (2 if m == 4 else 1) * Dc
        bf16(p + "wkv.weight", [width, d], d ** -0.5)
        bf16(p + "wgate.weight", [width, d], d ** -0.5)
        f32(p + "ape", [m, width], normal(0.5))
        norm(p + "norm.weight", Dc)

    def mlp(p, routed):
        mk = fp4 if routed else fp8
        mk(p + "w1.weight", [I, d])
        mk(p + "w3.weight", [I, d])
        mk(p + "w2.weight", [d, I])

    bf16("embed.weight", [V, d], 1.0)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        m = cfg["compress_ratios"][layer]
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        hc(p + "hc_attn_", mix, 3)
        hc(p + "hc_ffn_", mix, 3)
        a = p + "attn."
        fp8(a + "wq_a.weight", [Lq, d])
        norm(a + "q_norm.weight", Lq)
        fp8(a + "wq_b.weight", [H * D, Lq])
        fp8(a + "wkv.weight", [D, d])
        norm(a + "kv_norm.weight", D)
        fp8(a + "wo_a.weight", [g * r, H * D // g])
        fp8(a + "wo_b.weight", [d, g * r])
        f32(a + "attn_sink", [H], normal(1.0))
        if m > 0:
            compressor(a + "compressor.", D, m)
        if m == 4:
            fp8(a + "indexer.wq_b.weight", [Hi * Di, Lq])
            bf16(a + "indexer.weights_proj.weight", [Hi, d], d ** -0.5)
            compressor(a + "indexer.compressor.", Di, 4)
        f = p + "ffn."
        bf16(f + "gate.weight", [E, d], d ** -0.5)
        if layer < cfg["num_hash_layers"]:
            out.append((f + "gate.tid2eid", "I64", [V, K], tid2eid_fill(E, K)))
        else:
            f32(f + "gate.bias", [E], normal(0.1))
        for e in range(E):
            mlp(f"{f}experts.{e}.", True)
        mlp(f + "shared_experts.", False)
    norm("norm.weight", d)
    hc("hc_head_", n, 1)
    bf16("head.weight", [V, d], d ** -0.5)
    return out


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


def safetensors_header(tensors, metadata):
    """The header bytes (length prefix included) and the data size of `tensors`."""
    h, off = {"__metadata__": metadata}, 0
    for name, dtype, shape, _ in tensors:
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
        off += size
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, off


def write_model(path, tensors, gen, metadata):
    header, data_size = safetensors_header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(header)
        for name, dtype, shape, fill in tensors:
            size, written = math.prod(shape) * DTYPE_BYTES[dtype], 0
            for chunk in fill(gen, size):
                b = memoryview(np.ascontiguousarray(chunk)).cast("B")
                f.write(b)
                written += len(b)
            assert written == size, f"{name}: wrote {written} bytes, expected {size}"
    assert os.path.getsize(path) == len(header) + data_size
    return len(header) + data_size


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="model folder to write (created if missing)")
    ap.add_argument("--layers", type=int, default=4, help="num_hidden_layers (default 4)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts per layer, >= 6 (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--vocab", type=int, default=129280, help="vocab_size (default 129280)")
    a = ap.parse_args(argv)
    if a.layers < 1:
        ap.error("--layers must be >= 1")
    if a.experts < 6:
        ap.error("--experts must be >= 6 (num_experts_per_tok)")
    if a.vocab < 2:
        ap.error("--vocab must be >= 2 (bos and eos tokens)")
    if a.seed < 0:
        ap.error("--seed must be >= 0")

    t0 = time.time()
    cfg = flash_config(a.layers, a.experts, a.vocab)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    tensors = v4_tensors(cfg, Tables())
    gen = np.random.Generator(np.random.SFC64(a.seed))
    meta = {"format": "pt", "generator": "bench/make_v4_random.py", "seed": str(a.seed)}
    size = write_model(os.path.join(a.out, "model.safetensors"), tensors, gen, meta)
    total = size + os.path.getsize(os.path.join(a.out, "config.json"))
    print(f"wrote {a.out}: {len(tensors)} tensors, {total} bytes ({total / 2 ** 30:.2f} GiB) "
          f"in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
