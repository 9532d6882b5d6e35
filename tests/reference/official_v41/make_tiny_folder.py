#!/usr/bin/python3
"""Write a tiny random DeepSeek-V4.1 model folder in checkpoint format, for trying run_official.py end to end
before (or besides) the committed fixtures of tests/data/v41/models/.

It follows the v41_tiny fixture layout (its config; the checkpoint's hub tensor names): FP8 E4M3 weights with
E8M0 scales over 32x32 blocks, packed e2m1 routed experts (I8, the even element in the low nibble) with an
E8M0 scale per 32 inputs, FP8 Engram tables with an E8M0 scale per 32 columns of a row, BF16 / F32 for the
rest. With --float every tensor is F32, the Engram table has no scale and there is no quantization_config.
Also written: tokens.json (lengths 1, 2, 3, 15, 40) and a WordLevel tokenizer.json in which ids 2k and 2k+1
("wK" and "WK") lower-case alike, so they share an Engram token class.

  make_tiny_folder.py OUT_DIR [--seed N] [--float] [--engram-head-dim 16] [--set KEY=JSON ...]

--set overrides a text_config value (e.g. --set index_topk=64 --set candidate_topk_blocks=16 makes every
visible compressed entry selected, so bf16 / zero-score ties in the indexer cannot matter).

Run with /usr/bin/python3; torch, numpy and sympy only. Deterministic for a given seed.
"""

import argparse
import json
import os
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from sympy import nextprime  # noqa: E402

import deepseek_ref as dr  # noqa: E402
import kernel_shim as ks  # noqa: E402

dr._ITEMSIZE.setdefault("F8_E8M0", 1)


def tiny_text_config(engram_head_dim):
    c = {
        "model_type": "deepseek_v41_text",
        "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 6, "num_nextn_predict_layers": 0,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32,
        "sliding_window": 8, "compress_ratios": [0, 2, 2, 1, 1, 1],
        "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5], "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 2, "candidate_block_size": 4,
        "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 256,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
        "engram_layer_ids": [0, 2], "engram_max_ngram_size": 3, "engram_n_heads": 2,
        "engram_head_dim": engram_head_dim, "engram_vocab_size": 100,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 32,
    }
    c["engram_num_embeddings"] = [sum(p) for p in engram_primes(c)]
    return c


def engram_primes(c):
    """As DeepSeek's engram.py computes them: ascending primes above engram_vocab_size - 1, handed out in
    (layer, order, head) order."""
    per_layer, p = [], c["engram_vocab_size"] - 1
    for _ in c["engram_layer_ids"]:
        layer = []
        for _ in range((c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]):
            p = int(nextprime(p))
            layer.append(p)
        per_layer.append(layer)
    return per_layer


class Writer:
    def __init__(self, seed, as_float):
        self.g = torch.Generator().manual_seed(seed)
        self.as_float = as_float
        self.out = []

    def randn(self, *shape, std=1.0):
        return torch.randn(*shape, generator=self.g, dtype=torch.float64) * std

    def raw(self, name, dt, t):
        if dt == "F32":
            data = t.float().contiguous().numpy().tobytes()
        elif dt == "BF16":
            data = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        else:  # uint8 codes: F8_E4M3, F8_E8M0, I8 (packed e2m1)
            data = t.to(torch.uint8).contiguous().numpy().tobytes()
        self.out.append((name, dt, list(t.shape), data))

    def plain(self, name, t, dt):
        self.raw(name, "F32" if self.as_float else dt, t)

    def fp8(self, name, out_f, in_f, std):
        """FP8 E4M3 weight [out, in] with an E8M0 scale per 32x32 block."""
        w = self.randn(out_f, in_f, std=std).float()
        if self.as_float:
            return self.raw(name, "F32", w)
        rb, cb = -(-out_f // 32), -(-in_f // 32)
        pad = torch.zeros(rb * 32, cb * 32)
        pad[:out_f, :in_f] = w
        amax = pad.view(rb, 32, cb, 32).abs().amax(dim=(1, 3))
        s = ks.pow2_scale(amax.clamp_min(1e-30), 1.0 / ks.FP8_MAX)  # [rb, cb]
        s_full = s.repeat_interleave(32, 0)[:out_f].repeat_interleave(32, 1)[:, :in_f]
        self.raw(name, "F8_E4M3", ks.encode_e4m3(ks.round_e4m3(w / s_full)))
        self.raw(name[: -len("weight")] + "scale", "F8_E8M0", e8m0_bytes(s))

    def fp4(self, name, out_f, in_f, std):
        """packed e2m1 weight [out, in/2] with an E8M0 scale per 32 inputs."""
        w = self.randn(out_f, in_f, std=std).float()
        if self.as_float:
            return self.raw(name, "F32", w)
        s = ks.pow2_scale(w.view(out_f, -1, 32).abs().amax(-1).clamp_min(1e-30), 1.0 / ks.FP4_MAX)
        codes = ks.encode_e2m1(ks.round_e2m1(w / s.repeat_interleave(32, 1)))
        self.raw(name, "I8", codes[:, 0::2] | (codes[:, 1::2] << 4))
        self.raw(name[: -len("weight")] + "scale", "F8_E8M0", e8m0_bytes(s))

    def engram_table(self, name, rows, dim):
        """FP8 rows with an E8M0 scale per 32 columns (one partial group when dim < 32)."""
        w = self.randn(rows, dim).float()
        if self.as_float:
            return self.raw(name, "F32", w)
        groups = -(-dim // 32)
        pad = torch.zeros(rows, groups * 32)
        pad[:, :dim] = w
        s = ks.pow2_scale(pad.view(rows, groups, 32).abs().amax(-1).clamp_min(1e-30), 1.0 / ks.FP8_MAX)
        self.raw(name, "F8_E4M3", ks.encode_e4m3(ks.round_e4m3(w / s.repeat_interleave(32, 1)[:, :dim])))
        self.raw(name[: -len("weight")] + "scale", "F8_E8M0", e8m0_bytes(s))


def e8m0_bytes(s):
    _, e = torch.frexp(s)  # s = 0.5 * 2^e exactly
    return (e - 1 + 127).to(torch.uint8)


def write_weights(c, w):
    d, hc, hd = c["hidden_size"], c["hc_mult"], c["head_dim"]
    mix = (2 + hc) * hc
    w.plain("embed.weight", w.randn(c["vocab_size"], d), "BF16")
    w.plain("head.weight", w.randn(c["vocab_size"], d, std=d**-0.5), "BF16")
    w.plain("norm.weight", 1 + w.randn(d, std=0.1), "BF16")
    n_cols = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
    for L in range(c["num_hidden_layers"]):
        p = f"layers.{L}."
        ratio = c["compress_ratios"][L]
        for s in ("attn", "ffn"):
            w.plain(p + f"{s}_norm.weight", 1 + w.randn(d, std=0.1), "BF16")
            w.raw(p + f"hc_{s}_fn", "F32", w.randn(mix, hc * d, std=0.05))
            w.raw(p + f"hc_{s}_base", "F32", w.randn(mix, std=0.5))
            w.raw(p + f"hc_{s}_scale", "F32", 0.5 + torch.rand(3, generator=w.g, dtype=torch.float64))
        a = p + "attn."
        w.fp8(a + "wq_a.weight", c["q_lora_rank"], d, d**-0.5)
        w.plain(a + "q_norm.weight", 1 + w.randn(c["q_lora_rank"], std=0.1), "BF16")
        w.fp8(a + "wq_b.weight", c["num_attention_heads"] * hd, c["q_lora_rank"], c["q_lora_rank"] ** -0.5)
        w.fp8(a + "wkv.weight", hd, d, d**-0.5)
        w.plain(a + "kv_norm.weight", 1 + w.randn(hd, std=0.1), "BF16")
        wo_in = c["num_attention_heads"] * hd // c["o_groups"]
        w.fp8(a + "wo_a.weight", c["o_groups"] * c["o_lora_rank"], wo_in, wo_in**-0.5)
        w.fp8(a + "wo_b.weight", d, c["o_groups"] * c["o_lora_rank"], (c["o_groups"] * c["o_lora_rank"]) ** -0.5)
        w.raw(a + "attn_sink", "F32", w.randn(c["num_attention_heads"]))
        if L in c["kv_source_layer_ids"]:
            w.plain(a + "compressor.wkv.weight", w.randn(hd, d, std=d**-0.5), "BF16")
            if ratio == 2:
                w.plain(a + "compressor.wgate.weight", w.randn(hd, d, std=d**-0.5), "BF16")
            w.plain(a + "compressor.norm.weight", 1 + w.randn(hd, std=0.1), "BF16")
            w.plain(a + "indexer.wk.weight", w.randn(c["index_head_dim"], hd, std=hd**-0.5), "BF16")
            w.plain(a + "indexer.k_norm.weight", 1 + w.randn(c["index_head_dim"], std=0.1), "BF16")
        if L in c["index_source_layer_ids"]:
            w.fp8(a + "indexer.wq_b.weight", c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"],
                  c["q_lora_rank"] ** -0.5)
            w.plain(a + "indexer.weights_proj.weight", w.randn(c["index_n_heads"], d, std=d**-0.5), "BF16")
        f = p + "ffn."
        E, I = c["n_routed_experts"], c["moe_intermediate_size"]
        w.plain(f + "gate.weight", w.randn(E, d, std=d**-0.5), "BF16")
        w.raw(f + "gate.bias", "F32", w.randn(E, std=0.1))
        w.raw(f + "gate.bias_vl", "F32", w.randn(E, std=0.1))
        for e in range(E):
            w.fp4(f + f"experts.{e}.w1.weight", I, d, d**-0.5)
            w.fp4(f + f"experts.{e}.w3.weight", I, d, d**-0.5)
            w.fp4(f + f"experts.{e}.w2.weight", d, I, I**-0.5)
        w.fp8(f + "shared_experts.w1.weight", I, d, d**-0.5)
        w.fp8(f + "shared_experts.w3.weight", I, d, d**-0.5)
        w.fp8(f + "shared_experts.w2.weight", d, I, I**-0.5)
        if L in c["engram_layer_ids"]:
            E_idx = c["engram_layer_ids"].index(L)
            g = p + "engram."
            w.engram_table(g + "embed.weight", c["engram_num_embeddings"][E_idx], c["engram_head_dim"])
            kin = n_cols * c["engram_head_dim"]
            w.fp8(g + "wkv.weight", (hc + 1) * d, kin, kin**-0.5)
            w.plain(g + "q_weight", 1 + w.randn(hc, d, std=0.1), "BF16")
            w.plain(g + "k_weight", 1 + w.randn(hc, d, std=0.1), "BF16")


def tokenizer_json(vocab):
    """WordLevel over "w0", "W0", "w1", "W1", ...: lower-casing puts ids 2k and 2k+1 in one class."""
    words = {("w" if i % 2 == 0 else "W") + str(i // 2): i for i in range(vocab)}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--float", action="store_true", help="every tensor F32, no quantization_config")
    ap.add_argument("--engram-head-dim", type=int, default=16,
                    help="16 as in the v41_tiny fixture layout; 32 is the smallest width REF itself accepts")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a text_config value")
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    c = tiny_text_config(a.engram_head_dim)
    for kv in a.set:
        k, v = kv.split("=", 1)
        if k not in c:
            raise SystemExit(f"--set {k}: not a text_config key of the tiny config")
        c[k] = json.loads(v)
    root = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 63, "text_config": c}
    if not a.float:
        root["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    w = Writer(a.seed, a.float)
    write_weights(c, w)
    os.makedirs(a.out_dir, exist_ok=True)
    dr.write_safetensors_raw(os.path.join(a.out_dir, "model.safetensors"), w.out)
    with open(os.path.join(a.out_dir, "config.json"), "w") as f:
        json.dump(root, f, indent=2)
    with open(os.path.join(a.out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(c["vocab_size"]), f)
    g = torch.Generator().manual_seed(a.seed + 1000)
    tokens = [torch.randint(0, c["vocab_size"], (n,), generator=g).tolist() for n in (1, 2, 3, 15, 40)]
    with open(os.path.join(a.out_dir, "tokens.json"), "w") as f:
        json.dump(tokens, f)
    print(f"wrote {a.out_dir}: {len(w.out)} tensors, engram rows {c['engram_num_embeddings']}")


if __name__ == "__main__":
    main(sys.argv[1:])
