#!/usr/bin/python3
"""Writes tiny random DeepSeek-V4 model folders in the hub layout, with float64 reference logits.

  /usr/bin/python3 tests/reference/make_v4_fixtures.py --out DIR [NAME ...]

writes DIR/NAME/ for each fixture (all when none is named): config.json (model_type deepseek_v4),
model.safetensors (or shards + model.safetensors.index.json) with the upstream tensor names of
the official tensor layout, tokens.json and expected.safetensors (float32 `logits.{i}` [T, V]
and `mtp_logits.{i}` [T-1, V] for T >= 2, computed by deepseek_v4_ref.py in float64 from the
checkpoint as written). There is deliberately no default --out.

Deterministic: numpy PCG64 with fixed seeds, one torch thread; a rerun writes byte-identical files.
A seed is skipped (the next one tried) when a discrete choice a float32 engine could make differently
is too close to call: a routing top-k margin below ROUTE_MARGIN, an indexer top-k gap below
INDEX_MARGIN of the row's max |score| (exact ties included), with and without the QAT simulations,
or any routing / indexer choice that changes when every FP8/FP4 simulated rounding within FLIP of a
boundary goes the other way. Such near-boundary roundings cannot all be avoided (there are ~10^5
rounded values); expected.safetensors therefore also holds, per row, how far the logits move when
they all flip (`flip_delta.{i}`), and the logits without the simulations (`logits_noqat.{i}`).
Before writing, it checks that the loader returns exactly the dequantized values the generator
meant, and that the logits of prefixes equal the first rows of the longest sequence's (1e-12).
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref as dr  # noqa: E402
import deepseek_v4_ref as v4  # noqa: E402
from make_model_fixtures import write_checkpoint  # noqa: E402

ROUTE_MARGIN = 1e-4
INDEX_MARGIN = 1e-4
MAX_ATTEMPTS = 100
INDEX_PAIR_ANGLE = 0.1
# Roundings this close to a boundary (2|x - mid| / spacing; relative distance for power-of-two scales) are flipped
# in the sensitivity check: for e4m3 (|x| / spacing < 16) a relative error e of x moves it by up to 32 e, so 1e-5
# covers errors of ~3e-7, a float32 engine's error after a few operations.
FLIP = 1e-5


def tiny_config(**over):
    c = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        # head_dim - qk_rope_head_dim must be a multiple of 64 (FP8 simulation blocks of the K=V latent)
        "head_dim": 80,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        # 4 main layers (SWA, CSA, HCA, CSA), then the MTP layer's entry
        "compress_ratios": [0, 4, 128, 4, 0],
        "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 1.5,
        "num_hash_layers": 2,
        "swiglu_limit": 3.0,
        # index_head_dim: a power of two, a multiple of 32 (FP4 blocks), >= qk_rope_head_dim. With FP4-rounded
        # queries and keys the q.k products lie on a coarse lattice; 4 heads x 64 dims make exact score ties rare.
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    c.update(over)
    return c


def fixture_specs():
    return [
        # fp4 experts with E8M0 scales, fp8 linears with E8M0 128x128 scales, one file, MTP layer.
        {"name": "v4_tiny", "config": tiny_config(), "seed": 7039, "lengths": [1, 5, 40, 260]},
        # -Base style: fp8 experts, F32 block scales, "model." prefix, weight_scale_inv / e_score_correction_bias
        # aliases, two shards, no MTP layer; HCA first (as in Pro), 3 hash layers.
        {"name": "v4_tiny_base", "seed": 8060, "lengths": [1, 6, 41, 259], "storage": "base", "shards": 2,
         "config": tiny_config(expert_dtype="fp8", num_nextn_predict_layers=0, compress_ratios=[128, 4, 0, 4],
                               num_hash_layers=3, quantization_config={
                                   "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                   "weight_block_size": [128, 128], "activation_scheme": "dynamic"})},
    ]


# ---------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------


class Writer:
    """Collects raw safetensors entries and the float64 values the loader must return for them."""

    def __init__(self, rng, storage):
        self.rng, self.storage = rng, storage
        self.raw, self.expect, self.ints = [], {}, {}
        self.base = storage == "base"

    def name(self, n):
        return "model." + n if self.base else n

    def normal(self, shape, std, mean=0.0):
        return self.rng.standard_normal(shape) * std + mean

    def f32(self, n, a):
        a = np.asarray(a, dtype=np.float32)
        self.raw.append((self.name(n), "F32", list(a.shape), a.astype("<f4").tobytes()))
        self.expect[n] = a.astype(np.float64)

    def bf16(self, n, a):
        bits = dr.f32_to_bf16_bits(np.asarray(a, dtype=np.float32))
        self.raw.append((self.name(n), "BF16", list(bits.shape), bits.astype("<u2").tobytes()))
        self.expect[n] = dr.bf16_bits_to_f64(bits)

    def _block_gain(self, shape, br, bc):
        """2^k per (br x bc) block, k uniform in {-1, 0, 1}, so that neighbouring blocks get different scales."""
        g = np.ldexp(1.0, self.rng.integers(-1, 2, size=(-(-shape[0] // br), -(-shape[1] // bc))))
        return g.repeat(br, 0)[:shape[0]].repeat(bc, 1)[:, :shape[1]]

    def _scale(self, n, s):
        if self.base:
            self.raw.append((self.name(n[:-len("weight")] + "weight_scale_inv"), "F32", list(s.shape),
                             s.astype("<f4").tobytes()))
        else:
            self.raw.append((self.name(n[:-len("weight")] + "scale"), "F8_E8M0", list(s.shape),
                             v4.e8m0_encode(s).tobytes()))

    def fp8(self, n, shape, std, w=None):
        br = bc = 128
        if w is None:
            w = self.normal(shape, std)
        w = w * self._block_gain(shape, br, bc)
        gr, gc = -(-shape[0] // br), -(-shape[1] // bc)
        s = np.ones((gr, gc))
        codes = np.zeros(shape, dtype=np.uint8)
        for i in range(gr):
            for j in range(gc):
                blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                s[i, j] = v4._pow2_ceil(np.abs(blk).max() / dr.E4M3_MAX)
                codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = dr.e4m3_encode(blk / s[i, j])
        self.raw.append((self.name(n), "F8_E4M3", list(shape), codes.tobytes()))
        self._scale(n, s)
        self.expect[n] = dr.e4m3_decode(codes) * s.repeat(br, 0)[:shape[0]].repeat(bc, 1)[:, :shape[1]]

    def fp4(self, n, shape, std):
        out, inn = shape
        w = self.normal(shape, std) * self._block_gain(shape, 1, v4.FP4_BLOCK)
        g = w.reshape(out, inn // v4.FP4_BLOCK, v4.FP4_BLOCK)
        s = v4._pow2_ceil(np.abs(g).max(-1) / v4.FP4_MAX)  # [out, in/32]
        codes = v4.e2m1_encode(g / s[..., None]).reshape(out, inn)
        self.raw.append((self.name(n), "I8", [out, inn // 2], v4.fp4_pack(codes).tobytes()))
        self._scale(n, s)
        self.expect[n] = v4.e2m1_decode(codes) * s.repeat(v4.FP4_BLOCK, 1)

    def i64(self, n, a):
        a = np.asarray(a, dtype=np.int64)
        self.raw.append((self.name(n), "I64", list(a.shape), a.astype("<i8").tobytes()))
        self.ints[n] = a


def random_checkpoint(cj, rng, storage):
    c = v4.V4Config(cj)
    wr = Writer(rng, storage)
    d, n, V = c.hidden_size, c.hc_mult, c.vocab_size
    H, D, Lq, g, r = c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank
    E, I, K = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok
    experts_fp4 = cj.get("expert_dtype") == "fp4"

    def norm(name, dim):
        wr.bf16(name, wr.normal(dim, 0.1, 1.0))

    def hc(prefix, rows):
        wr.f32(prefix + "fn", wr.normal((rows, n * d), 0.05))
        wr.f32(prefix + "base", wr.normal(rows, 0.5))
        wr.f32(prefix + "scale", 0.5 + rng.random(3 if rows > n else 1))

    def compressor(p, Dc, m):
        cD = (2 if m == 4 else 1) * Dc
        wr.bf16(p + "wkv.weight", wr.normal((cD, d), d ** -0.5))
        wr.bf16(p + "wgate.weight", wr.normal((cD, d), d ** -0.5))
        wr.f32(p + "ape", wr.normal((m, cD), 0.5))
        norm(p + "norm.weight", Dc)

    def layer(p, m, hashed):
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        hc(p + "hc_attn_", (2 + n) * n)
        hc(p + "hc_ffn_", (2 + n) * n)
        a = p + "attn."
        wr.fp8(a + "wq_a.weight", (Lq, d), d ** -0.5)
        norm(a + "q_norm.weight", Lq)
        wr.fp8(a + "wq_b.weight", (H * D, Lq), Lq ** -0.5)
        wr.fp8(a + "wkv.weight", (D, d), d ** -0.5)
        norm(a + "kv_norm.weight", D)
        wr.fp8(a + "wo_a.weight", (g * r, H * D // g), (H * D // g) ** -0.5)
        wr.fp8(a + "wo_b.weight", (d, g * r), (g * r) ** -0.5)
        wr.f32(a + "attn_sink", wr.normal(H, 1.0))
        if m:
            compressor(a + "compressor.", D, m)
        if m == 4:
            Hi, Di = c.index_n_heads, c.index_head_dim
            wq = wr.normal((Hi, Di, Lq), Lq ** -0.5)
            if Hi % 2 == 0 and INDEX_PAIR_ANGLE is not None:
                # Head h + Hi/2 is nearly opposite to head h (-cos(a) head h + sin(a) its own draw): with
                # independent heads a query-key pair has a zero score (every ReLU zero) a 1/Hi^2 of the time,
                # and such exact ties at zero would often decide the top-k.
                ca = np.cos(INDEX_PAIR_ANGLE)
                wq[Hi // 2:] = -ca * wq[:Hi // 2] + np.sqrt(1 - ca * ca) * wq[Hi // 2:]
            wr.fp8(a + "indexer.wq_b.weight", (Hi * Di, Lq), None, w=wq.reshape(Hi * Di, Lq))
            wr.bf16(a + "indexer.weights_proj.weight", wr.normal((Hi, d), d ** -0.5))
            compressor(a + "indexer.compressor.", Di, 4)
        f = p + "ffn."
        wr.bf16(f + "gate.weight", wr.normal((E, d), 2.0 * d ** -0.5))
        if hashed:
            wr.i64(f + "gate.tid2eid", np.stack([rng.permutation(E)[:K] for _ in range(V)]))
        else:
            bias = wr.normal(E, 0.1)
            if wr.base:  # alias accepted by the official loader
                wr.raw.append((wr.name(f + "gate.e_score_correction_bias"), "F32", [E],
                               bias.astype("<f4").tobytes()))
                wr.expect[f + "gate.bias"] = bias.astype(np.float32).astype(np.float64)
            else:
                wr.f32(f + "gate.bias", bias)
        for e in range(E):
            ep = f"{f}experts.{e}."
            mk = wr.fp4 if experts_fp4 else wr.fp8
            mk(ep + "w1.weight", (I, d), 2.0 * d ** -0.5)
            mk(ep + "w3.weight", (I, d), 2.0 * d ** -0.5)
            mk(ep + "w2.weight", (d, I), I ** -0.5)
        sp = f + "shared_experts."
        wr.fp8(sp + "w1.weight", (I, d), 2.0 * d ** -0.5)
        wr.fp8(sp + "w3.weight", (I, d), 2.0 * d ** -0.5)
        wr.fp8(sp + "w2.weight", (d, I), I ** -0.5)

    wr.bf16("embed.weight", wr.normal((V, d), 1.0))
    for L in range(c.num_hidden_layers):
        layer(f"layers.{L}.", c.compress_ratios[L], L < c.num_hash_layers)
    norm("norm.weight", d)
    hc("hc_head_", n)
    wr.bf16("head.weight", wr.normal((V, d), 0.25))
    for k in range(c.num_nextn_predict_layers):
        p = f"mtp.{k}."
        layer(p, c.mtp_ratio(k), False)
        wr.fp8(p + "e_proj.weight", (d, d), d ** -0.5)
        wr.fp8(p + "h_proj.weight", (d, d), d ** -0.5)
        norm(p + "enorm.weight", d)
        norm(p + "hnorm.weight", d)
        norm(p + "norm.weight", d)
        hc(p + "hc_head_", n)
    return wr


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def run_traced(model, seqs):
    """Runs every sequence with tracing -> (logits, mtp logits, traces)."""
    logits, mtps, traces = [], [], []
    for s in seqs:
        model.trace = {}
        lg, mtp = model.forward(s, with_mtp=True)
        logits.append(lg)
        mtps.append(mtp)
        traces.append(model.trace)
        model.trace = None
    return logits, mtps, traces


def decisions(model, traces):
    """Every discrete choice of the forwards: routed expert sets and indexer selections."""
    K = model.cfg.num_experts_per_tok
    out = []
    for tr in traces:
        out += [np.sort(e["order"][:, :K], axis=1) for e in tr.get("route", [])]
        out += [e["selected"].numpy() for e in tr.get("index", [])]
    return out


def margins(model, seqs, traces):
    c = model.cfg
    K, Ki = c.num_experts_per_tok, c.index_topk
    rep = {"route": np.inf, "index": np.inf, "tie": np.inf, "scale": np.inf, "near": 0, "near_flip": 0,
           "index_rows": 0, "index_not_recent": 0, "quant_values": 0, "usage": {}, "route_rows": 0,
           "hca_entries": max(len(s) for s in seqs) // 128}
    for tr in traces:
        for e in tr.get("route", []):
            ch, order = e["choice"].numpy(), e["order"]
            rows = np.arange(ch.shape[0])
            rep["route_rows"] += ch.shape[0]
            rep["route"] = min(rep["route"], (ch[rows, order[:, K - 1]] - ch[rows, order[:, K]]).min())
            u = rep["usage"].setdefault(e["layer"], np.zeros(c.n_routed_experts, dtype=int))
            np.add.at(u, order[:, :K].reshape(-1), 1)
        for e in tr.get("index", []):
            sc, sel = e["score"].numpy(), e["selected"].numpy()
            for t in range(sc.shape[0]):
                vis = np.sort(sc[t][np.isfinite(sc[t])])[::-1]
                if vis.size <= Ki:
                    continue
                rep["index_rows"] += 1
                top = np.abs(vis).max()
                rep["index"] = min(rep["index"], (vis[Ki - 1] - vis[Ki]) / top if top > 0 else 0.0)
                rep["index_not_recent"] += not np.array_equal(np.flatnonzero(sel[t]),
                                                              np.arange(vis.size - Ki, vis.size))
        for q in tr.get("quant", []):
            rep["tie"] = min(rep["tie"], q["tie"])
            rep["scale"] = min(rep["scale"], q["scale"])
            rep["near"] += q["near"]
            rep["near_flip"] += q["near_flip"]
            rep["quant_values"] += q["count"]
    return rep


def changed_choices(model, traces, base_traces):
    return sum(int((a != b).any(axis=-1).sum())
               for a, b in zip(decisions(model, traces), decisions(model, base_traces)))


def row_delta(a, b):
    """max over the vocabulary of |a - b| per row (None stays None)."""
    return None if a is None else (a - b).abs().max(-1).values if a.numel() else torch.zeros(0, dtype=a.dtype)


def check_loader(model, wr):
    for n, a in wr.expect.items():
        got = model.w.get(n)
        assert got is not None, f"loader lost {n}"
        assert got.shape == tuple(a.shape) and (got.numpy() == a).all(), f"loader value mismatch for {n}"
    for n, a in wr.ints.items():
        assert (model.ints[n].numpy() == a).all(), f"loader int mismatch for {n}"
    extra = set(model.w) - set(wr.expect)
    assert not extra, f"loader produced unexpected tensors {sorted(extra)[:5]}"


def build(spec, root):
    d = os.path.join(root, spec["name"])
    cj = spec["config"]
    cfg0 = v4.V4Config(cj)
    for attempt in range(MAX_ATTEMPTS):
        seed = spec["seed"] + attempt
        rng = np.random.default_rng(seed)
        wr = random_checkpoint(cj, rng, spec.get("storage", "hub"))
        seqs = [rng.integers(0, cfg0.vocab_size, size=k).tolist() for k in spec["lengths"]]
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cj, f, indent=2)
            f.write("\n")
        write_checkpoint(d, wr.raw, spec.get("shards", 1))
        model = v4.DeepSeekV4Ref(d)
        check_loader(model, wr)
        bad = []

        def check(tag, r):
            if r["route"] < ROUTE_MARGIN:
                bad.append(f"{tag}routing margin {r['route']:.2e}")
            if r["index"] < INDEX_MARGIN:
                bad.append(f"{tag}indexer gap {r['index']:.2e}")

        logits, mtps, traces = run_traced(model, seqs)
        rep = margins(model, seqs, traces)
        check("", rep)
        if not bad:
            model.qat = False
            nq_logits, nq_mtps, nq_traces = run_traced(model, seqs)
            model.qat = True
            rep_nq = margins(model, seqs, nq_traces)
            check("no-QAT ", rep_nq)
        if not bad:
            model.flip = FLIP
            fl_logits, fl_mtps, fl_traces = run_traced(model, seqs)
            model.flip = None
            flips = changed_choices(model, fl_traces, traces)
            if flips:
                bad.append(f"{flips} routing/indexer choices change when the FP8/FP4 roundings within {FLIP:.0e} of "
                           "a boundary flip")
        if bad:
            print(f"  {spec['name']}: seed {seed} rejected ({', '.join(bad)})")
            continue
        break
    else:
        raise RuntimeError(f"{spec['name']}: no seed with clear margins")
    n_flipped = margins(model, seqs, fl_traces)["near_flip"]
    deltas = [row_delta(a, b) for a, b in zip(fl_logits, logits)]
    mtp_deltas = [row_delta(a, b) for a, b in zip(fl_mtps, mtps)]
    qat_effect = max((a - b).abs().max().item() for a, b in zip(logits, nq_logits))

    longest = max(seqs, key=len)
    T = len(longest)
    cuts = sorted({k for k in (1, 2, 4, 5, 8, 9, 13, 40, 127, 128, 129, T - 1) if 1 <= k < T})
    res = v4.causal_check(model, longest, cuts)
    worst = max(max(a, b) for _, a, b in res)

    with open(os.path.join(d, "tokens.json"), "w") as f:
        json.dump(seqs, f)
        f.write("\n")
    exp = []

    def put(name, t):
        if t is not None and t.numel() > 0:
            exp.append((name, "F32", list(t.shape), t.numpy().astype("<f4").tobytes()))

    for i in range(len(seqs)):
        put(f"logits.{i}", logits[i])
        put(f"mtp_logits.{i}", mtps[i])
        put(f"logits_noqat.{i}", nq_logits[i])
        put(f"mtp_logits_noqat.{i}", nq_mtps[i])
        put(f"flip_delta.{i}", deltas[i])
        put(f"mtp_flip_delta.{i}", mtp_deltas[i])
    dr.write_safetensors_raw(os.path.join(d, "expected.safetensors"), exp,
                             {"generator": "tests/reference/make_v4_fixtures.py",
                              "note": "float64 reference logits rounded to float32"})

    allv = torch.cat([lg.reshape(-1) for lg in logits])
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"{spec['name']}: seed {seed}, {size / 1024:.1f} KiB, lengths {spec['lengths']}, logits std "
          f"{allv.std().item():.2f} max|.| {allv.abs().max().item():.2f}, MTP {'yes' if model.has_mtp() else 'no'}")
    print(f"  routing: {rep['route_rows']} score-routed rows, min top-k margin {rep['route']:.3e}; expert usage "
          f"per score-routed layer "
          + "; ".join(f"{k}: {v.tolist()}" for k, v in rep["usage"].items()))
    print(f"  indexer: {rep['index_rows']} rows with more than {cfg0.index_topk} visible entries, min relative "
          f"top-k gap {rep['index']:.3e}, {rep['index_not_recent']} rows not the most recent entries")
    print(f"  QAT simulation: {rep['quant_values']} rounded values, min distance to a rounding midpoint "
          f"{rep['tie']:.2e} (2|x - mid| / spacing), {rep['near']} values below 1e-4, min relative distance of "
          f"amax/max_code to a power of two {rep['scale']:.2e}")
    alld = torch.cat([t for t in deltas + mtp_deltas if t is not None])
    print(f"  flipping every rounding within {FLIP:.0e} of a boundary ({n_flipped} values) changes no "
          f"routing/indexer choice; logits move by at most {alld.max().item():.2e} (rows moving > 1e-5: "
          f"{int((alld > 1e-5).sum())} of {alld.numel()}); QAT simulation vs none: max logit difference "
          f"{qat_effect:.2e}")
    print(f"  no-QAT run: min routing margin {rep_nq['route']:.3e}, min indexer gap {rep_nq['index']:.3e}")
    print(f"  HCA entries in the longest sequence: {rep['hca_entries']}")
    print(f"  causal prefix check ({T} tokens, prefixes {cuts}): max diff {worst:.1e}")
    return d


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="root folder; fixtures go to OUT/NAME")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # deterministic float64 reductions
    v4.codec_selftest(verbose=False)
    specs = [s for s in fixture_specs() if not a.names or s["name"] in a.names]
    if a.names and len(specs) != len(a.names):
        ap.error(f"unknown fixture name; known: {[s['name'] for s in fixture_specs()]}")
    os.makedirs(a.out, exist_ok=True)
    for s in specs:
        build(s, a.out)


if __name__ == "__main__":
    main()
