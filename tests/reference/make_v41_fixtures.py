#!/usr/bin/python3
"""Writes tiny random DeepSeek-V4.1 model folders in the hub layout, with float64 reference logits.

  /usr/bin/python3 tests/reference/make_v41_fixtures.py [--out DIR] [NAME ...]

writes DIR/NAME/ (default DIR: tests/data/v41/models) for each fixture (all when none is named): config.json (root
`deepseek_v41` with a nested `deepseek_v41_text` text_config), model.safetensors with the hub tensor names,
tokenizer.json (a byte-level BPE whose first 64 ids put 2k and 2k+1 in Engram token class k), tokens.json and
expected.safetensors (float32, rounded from deepseek_v41_ref.py's float64):
  logits.{i} [T, V]          QAT simulations on (the official behaviour)
  logits_noqat.{i} [T, V]    without the three QAT simulations
  flip_delta.{i} [T]         per row, the max |logit change| when every simulated rounding within FLIP code spacings
                             of a midpoint (and every scale within FLIP of its jump) goes the other way
  decode_shipped.{i} [T, V]  for the 15- and 40-token sequences: prefill of decode_prefill.{i} tokens (metadata),
                             then one token per step with the official decode's late index-key publication
                             ("as shipped": model.py's Indexer.forward publishes a ratio-2 owner's index keys
                             only at steps that complete its group); QAT on.

The index sources' weights are shifted so that both index heads are active with positive weights (align_indexers(),
on top of an embedding direction shared by all tokens); without that, exact top-k ties occur in every seed.

Deterministic: numpy PCG64 with fixed seeds, one torch thread; a rerun writes byte-identical files. A seed is skipped
(the next tried) when a discrete choice a float32 engine could make differently is too close to call, in the QAT,
no-QAT and as-shipped decode runs: a routing top-k margin below ROUTE_MARGIN, an indexer top-k gap or a candidate-block
gap below INDEX_MARGIN of the row's max |score| (exact ties included), or any routing / indexer / candidate choice that
changes in the flip run; or when the fixture misses a coverage goal (candidate restriction changing some picks of the
index sources after the candidate source in the 40-token sequence). Before writing, it checks that the loader returns
exactly the values the generator meant, that the tokenizer's token classes are 2k, 2k+1 -> k, that the logits of
prefixes equal the first rows of the longest sequence's (1e-12) and that the "fixed" decode equals the prefill (1e-10).
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
import deepseek_v41_ref as v41  # noqa: E402
import make_v4_fixtures as mk4  # noqa: E402
from make_model_fixtures import write_checkpoint  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUTE_MARGIN = 1e-4
INDEX_MARGIN = 1e-4
MAX_ATTEMPTS = 400
FLIP = 1e-5  # as in make_v4_fixtures.py
LENGTHS = [1, 2, 3, 15, 40]
DECODE_PREFILL = {15: 5, 40: 11}  # sequence length -> prefill length of the as-shipped decode reference
IMAGE_TOKEN_ID = 63  # inside the vocabulary; never drawn into tokens.json (text only)
MIN_RESTRICTED_ROWS = 4  # rows of the 40-token sequence whose picks the candidate restriction changes
EMBED_SHARED = 0.5  # share of the embedding variance along one direction common to all tokens
ALIGN_C = 1.0  # align_indexers(): the shared direction added to the q latents and compressed latents
ALIGN_Q = 1.5  # align_indexers(): the q . k offset, in standard deviations of the random q . k
ALIGN_W = 3.0  # align_indexers(): the smallest head weight after the offset, in standard deviations of the random one
ALIGN_RIDGE = 0.3  # align_indexers(): ridge of the least-squares directions, relative to the mean eigenvalue


def text_config():
    c = {
        "model_type": "deepseek_v41_text",
        "vocab_size": 64,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 1, 1, 1],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 5],
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 4,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 256,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-20,
        "engram_layer_ids": [0, 2],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 16,
        "engram_vocab_size": 100,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 32,
    }
    primes = v41.engram_primes(c["engram_layer_ids"], c["engram_max_ngram_size"], c["engram_n_heads"],
                               c["engram_vocab_size"])
    c["engram_num_embeddings"] = [sum(p) for p in primes]
    return c


def root_config(quantized):
    c = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16" if quantized else "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": IMAGE_TOKEN_ID,
    }
    if quantized:
        c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    c["text_config"] = text_config()
    return c


def fixture_specs():
    return [
        {"name": "v41_tiny", "seed": 41000, "storage": "fp8"},
        {"name": "v41_tiny_f32", "seed": 41500, "storage": "f32"},
    ]


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------

SPECIALS = ["<s>", "<S>", "<pad>", "<PAD>"]  # ids 0-3: bos and eos share class 0, pad (and <PAD>) class 1


def first_tokens():
    """The texts of ids 0..63, two per class: the specials, a/A .. z/Z, ' '/'\\t', and 0/1/2 with their fullwidth
    forms (NFKC folds them)."""
    out = list(SPECIALS)
    for ch in "abcdefghijklmnopqrstuvwxyz":
        out += [ch, ch.upper()]
    out += [" ", "\t", "0", "\uff10", "1", "\uff11", "2", "\uff12"]
    assert len(out) == 64
    return out


def make_tokenizer():
    """A byte-level BPE tokenizer.json: ids 0..63 as first_tokens(), then the rest of the 256-symbol byte alphabet
    (the engine's loader requires the whole alphabet, so the file has more ids than the model's vocabulary; only
    the first vocab_size ids are classed). No merges: the multi-byte tokens are never produced by encoding, but
    decode as themselves."""
    vocab = {}
    for i, text in enumerate(first_tokens()):
        vocab[v41.byte_level_encode(text)] = i
    for b in range(256):
        vocab.setdefault(v41.BYTE_TO_CHAR[b], len(vocab))
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(SPECIALS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


# ---------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------


class Writer41(mk4.Writer):
    """make_v4_fixtures' writer with 32x32 FP8 blocks (per row and 32 columns for Engram tables), or, for the float
    fixture, every tensor F32. Keeps the values it encoded, so that redo() can re-encode a tensor changed later
    without drawing from the generator again."""

    def __init__(self, rng, storage):
        super().__init__(rng, "hub")
        self.float_only = storage == "f32"
        self.values = {}  # name -> (kind, float64 values before encoding, fp8 block)

    def bf16(self, n, a):
        self.values[n] = ("bf16", np.asarray(a, dtype=np.float64), None)
        if self.float_only:
            return self.f32(n, a)
        return super().bf16(n, a)

    def fp8(self, n, shape, std, w=None, block=(32, 32)):
        if w is None:
            w = self.normal(shape, std)
        self._fp8_encode(n, w * self._block_gain(shape, *block), block)

    def _fp8_encode(self, n, w, block):
        self.values[n] = ("fp8", w, block)
        if self.float_only:
            return self.f32(n, w)
        br, bc = block
        shape = w.shape
        gr, gc = -(-shape[0] // br), -(-shape[1] // bc)
        s = np.ones((gr, gc))
        codes = np.zeros(shape, dtype=np.uint8)
        for i in range(gr):
            for j in range(gc):
                blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                s[i, j] = v4._pow2_ceil(np.abs(blk).max() / dr.E4M3_MAX)
                codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = dr.e4m3_encode(blk / s[i, j])
        self.raw.append((n, "F8_E4M3", list(shape), codes.tobytes()))
        self._scale(n, s)
        self.expect[n] = dr.e4m3_decode(codes) * s.repeat(br, 0)[:shape[0]].repeat(bc, 1)[:, :shape[1]]

    def fp4(self, n, shape, std):
        if self.float_only:
            return self.f32(n, self.normal(shape, std) * self._block_gain(shape, 1, v4.FP4_BLOCK))
        return super().fp4(n, shape, std)

    def redo(self, n, w):
        """re-encode tensor n (written by bf16 or fp8) with new values w."""
        kind, _, block = self.values[n]
        drop = {n, n[:-len("weight")] + "scale"}
        self.raw = [t for t in self.raw if t[0] not in drop]
        del self.expect[n]
        if kind == "fp8":
            self._fp8_encode(n, w, block)
        else:
            self.bf16(n, w)


def random_checkpoint(c, rng, storage):
    wr = Writer41(rng, storage)
    d, n, V = c.hidden_size, c.hc_mult, c.vocab_size
    H, D, Lq, g, r = c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank
    E, I = c.n_routed_experts, c.moe_intermediate_size
    Hi, Di = c.index_n_heads, c.index_head_dim
    lay = c.engram_layout()

    def norm(name, dim):
        wr.bf16(name, wr.normal(dim, 0.1, 1.0))

    def hc(prefix):
        rows = (2 + n) * n
        wr.f32(prefix + "fn", wr.normal((rows, n * d), 0.05))
        wr.f32(prefix + "base", wr.normal(rows, 0.5))
        wr.f32(prefix + "scale", 0.5 + rng.random(3))

    # a direction shared by every token (EMBED_SHARED of the variance), as real models have one; align_indexers()
    # builds on it
    mu = wr.normal(d, 1.0)
    wr.bf16("embed.weight", wr.normal((V, d), 1.0) * np.sqrt(1.0 - EMBED_SHARED) + np.sqrt(EMBED_SHARED) * mu[None, :])
    for L in range(c.num_hidden_layers):
        p = f"layers.{L}."
        m = c.compress_ratios[L]
        if L in c.engram_layers:
            e = c.engram_layers.index(L)
            wr.fp8(p + "engram.embed.weight", (lay.rows[e], lay.De), 1.0, block=(1, v41.ENGRAM_SCALE_BLOCK))
            wr.fp8(p + "engram.wkv.weight", ((n + 1) * d, lay.C * lay.De), (lay.C * lay.De) ** -0.5)
            wr.bf16(p + "engram.q_weight", wr.normal((n, d), 0.1, 1.0))
            wr.bf16(p + "engram.k_weight", wr.normal((n, d), 0.1, 1.0))
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        hc(p + "hc_attn_")
        hc(p + "hc_ffn_")
        a = p + "attn."
        wr.fp8(a + "wq_a.weight", (Lq, d), d ** -0.5)
        norm(a + "q_norm.weight", Lq)
        wr.fp8(a + "wq_b.weight", (H * D, Lq), Lq ** -0.5)
        wr.fp8(a + "wkv.weight", (D, d), d ** -0.5)
        norm(a + "kv_norm.weight", D)
        wr.fp8(a + "wo_a.weight", (g * r, H * D // g), (H * D // g) ** -0.5)
        wr.fp8(a + "wo_b.weight", (d, g * r), (g * r) ** -0.5)
        wr.f32(a + "attn_sink", wr.normal(H, 1.0))
        if L in c.kv_sources:
            wr.bf16(a + "compressor.wkv.weight", wr.normal((D, d), d ** -0.5))
            if m > 1:
                wr.bf16(a + "compressor.wgate.weight", wr.normal((D, d), 2.0 * d ** -0.5))
            norm(a + "compressor.norm.weight", D)
        if L in c.index_sources:
            wr.fp8(a + "indexer.wq_b.weight", (Hi * Di, Lq), Lq ** -0.5)
            wr.bf16(a + "indexer.weights_proj.weight", wr.normal((Hi, d), d ** -0.5))
            if L in c.kv_sources:
                wr.bf16(a + "indexer.wk.weight", wr.normal((Di, D), D ** -0.5))
                norm(a + "indexer.k_norm.weight", Di)
        f = p + "ffn."
        wr.bf16(f + "gate.weight", wr.normal((E, d), 2.0 * d ** -0.5))
        wr.f32(f + "gate.bias", wr.normal(E, 0.1))
        wr.f32(f + "gate.bias_vl", wr.normal(E, 0.1))
        for e in range(E):
            ep = f"{f}experts.{e}."
            wr.fp4(ep + "w1.weight", (I, d), 2.0 * d ** -0.5)
            wr.fp4(ep + "w3.weight", (I, d), 2.0 * d ** -0.5)
            wr.fp4(ep + "w2.weight", (d, I), I ** -0.5)
        sp = f + "shared_experts."
        wr.fp8(sp + "w1.weight", (I, d), 2.0 * d ** -0.5)
        wr.fp8(sp + "w3.weight", (I, d), 2.0 * d ** -0.5)
        wr.fp8(sp + "w2.weight", (d, I), I ** -0.5)
    norm("norm.weight", d)
    wr.bf16("head.weight", wr.normal((V, d), 0.25))
    return wr


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def run_traced(model, seqs, fn=None):
    logits, traces = [], []
    for s in seqs:
        model.trace = {}
        logits.append(model.forward(s) if fn is None else fn(s))
        traces.append(model.trace)
        model.trace = None
    return logits, traces


def decisions(model, traces):
    """Every discrete choice: routed expert sets, indexer selections, candidate blocks."""
    K = model.cfg.num_experts_per_tok
    out = []
    for tr in traces:
        out += [np.sort(e["order"][:, :K], axis=1) for e in tr.get("route", [])]
        out += [e["selected"].numpy() for e in tr.get("index", [])]
        out += [e["keep"].numpy() for e in tr.get("cand", [])]
    return out


def _rel_gap(vals, k):
    """vals: finite scores of a row; relative gap between the k-th and (k+1)-th largest."""
    v = np.sort(vals)[::-1]
    top = np.abs(v).max()
    return (v[k - 1] - v[k]) / top if top > 0 else 0.0


def margins(model, traces):
    c = model.cfg
    K = c.num_experts_per_tok
    rep = {"route": np.inf, "index": np.inf, "cand": np.inf, "tie": np.inf, "scale": np.inf, "near": 0,
           "near_flip": 0, "quant_values": 0, "route_rows": 0, "usage": {}, "index_rows": {}, "index_not_recent": 0,
           "cand_rows": 0, "restricted": {}, "alpha": [np.inf, -np.inf]}
    for tr in traces:
        for e in tr.get("route", []):
            ch, order = e["choice"].numpy(), e["order"]
            rows = np.arange(ch.shape[0])
            rep["route_rows"] += ch.shape[0]
            rep["route"] = min(rep["route"], (ch[rows, order[:, K - 1]] - ch[rows, order[:, K]]).min())
            u = rep["usage"].setdefault(e["layer"], np.zeros(c.n_routed_experts, dtype=int))
            np.add.at(u, order[:, :K].reshape(-1), 1)
        for e in tr.get("index", []):
            sc, sel, k, vis = e["score"].numpy(), e["selected"].numpy(), e["k"], e["vis"].numpy()
            for t in range(sc.shape[0]):
                fin = sc[t][np.isfinite(sc[t])]
                if vis[t] > k:
                    rep["index_rows"][e["layer"]] = rep["index_rows"].get(e["layer"], 0) + 1
                    rep["index_not_recent"] += not np.array_equal(np.flatnonzero(sel[t]),
                                                                  np.arange(vis[t] - k, vis[t]))
                if fin.size > k:
                    rep["index"] = min(rep["index"], _rel_gap(fin, k))
            if "restricted_changed" in e:
                rep["restricted"].setdefault(e["layer"], []).append(e["restricted_changed"])
        for e in tr.get("cand", []):
            bs, Kb = e["block_score"].numpy(), e["K"]
            for t in range(bs.shape[0]):
                pinned = int(np.isposinf(bs[t]).sum())
                fin = bs[t][np.isfinite(bs[t])]
                free = Kb - pinned
                if free >= 1 and fin.size > free:
                    rep["cand_rows"] += 1
                    rep["cand"] = min(rep["cand"], _rel_gap(fin, free))
        for e in tr.get("engram", []):
            a = e["alpha"]
            rep["alpha"] = [min(rep["alpha"][0], a.min().item()), max(rep["alpha"][1], a.max().item())]
        for q in tr.get("quant", []):
            rep["tie"] = min(rep["tie"], q["tie"])
            rep["scale"] = min(rep["scale"], q["scale"])
            rep["near"] += q["near"]
            rep["near_flip"] += q["near_flip"]
            rep["quant_values"] += q["count"]
    return rep


def changed_choices(model, traces, base):
    return sum(int((a != b).reshape(a.shape[0], -1).any(axis=-1).sum())
               for a, b in zip(decisions(model, traces), decisions(model, base)))


def check_tokenizer(path, vocab):
    table, count = v41.token_classes_from_tokenizer(path, vocab)
    assert table == [i // 2 for i in range(vocab)] and count == vocab // 2, "tokenizer classes are not 2k, 2k+1 -> k"


def _ones_direction(M):
    """ridge least-squares x with M x ~ 1 (the ridge, ALIGN_RIDGE of the mean eigenvalue of M^T M, keeps x near the
    rows' common direction instead of fitting every row exactly with a large, perturbation-sensitive x)."""
    G = M.T @ M
    return np.linalg.solve(G + ALIGN_RIDGE * np.trace(G) / G.shape[0] * np.eye(G.shape[0]), M.T @ np.ones(M.shape[0]))


def _index_inputs(d, seqs, L):
    """(attention inputs, q latents, keys) that index source L sees on the sequences, without the QAT simulations."""
    model = v41.DeepSeekV41Ref(d, qat=False)
    model.trace = {}
    for s in seqs:
        model.forward(s)
    recs = [e for e in model.trace["index"] if e["layer"] == L]
    return tuple(torch.cat([e[k] for e in recs]).numpy() for k in ("a", "qr", "keys"))


def align_indexers(d, wr, seqs, cfg, rng):
    """Gives every index source positive head weights and mostly positive q_h . k, measured on the fixture's own
    sequences (without the QAT simulations), layer after layer. With random weights a query's head weights and dots
    have random signs, so keys often score exactly 0 (every ReLU zero) or, with one head active, land on the 1-D
    lattice of FP4 dot products, and exact top-k ties occur in every seed; with both heads active and positive
    weights a score is a 2-D lattice combination and ties become rare. For index source L, with av the ridge
    least-squares direction with A av ~ 1 over its attention inputs (they share a direction, EMBED_SHARED):
    - its KV compressor (when L is a KV source) and its q-latent projection wq_a gain rank-1 terms that add a fixed
      random direction, ALIGN_C times as long as their random output, in proportion to av . a; the latents, hence
      the index keys, and the q latents then share a direction;
    - with u, r the ridge directions with K_nope u ~ 1 over the keys and Q r ~ 1 over the q latents, the indexer's
      wq_b gains b_h u r^T, so q_h . k gains b_h (r . qr)(u . k) ~ b_h, ALIGN_Q standard deviations of the random
      q_h . k;
    - weights_proj gains l_h av, l_h such that every measured w_h is at least ALIGN_W standard deviations of the
      random w_h."""
    Hi, Di, R = cfg.index_n_heads, cfg.index_head_dim, cfg.rope_dim
    nope = Di - R
    for L in cfg.index_sources:
        A, _, _ = _index_inputs(d, seqs, L)
        av = _ones_direction(A)
        along = A @ av
        if along.min() <= 0:
            return f"layer {L}: no common direction of the attention inputs"
        p = f"layers.{L}.attn."
        names = [p + "wq_a.weight"] + ([p + "compressor.wkv.weight"] if L in cfg.kv_sources else [])
        for n in names:
            Wm = wr.values[n][1].copy()
            ell = rng.standard_normal(Wm.shape[0])
            ell /= np.linalg.norm(ell)
            Wm += ALIGN_C * np.linalg.norm(A @ Wm.T, axis=1).mean() / along.mean() * np.outer(ell, av)
            wr.redo(n, Wm)
        write_checkpoint(d, wr.raw, 1)
        A, Q, K = _index_inputs(d, seqs, L)
        u, r = _ones_direction(K[:, :nope]), _ones_direction(Q)
        W = wr.values[p + "indexer.wq_b.weight"][1].reshape(Hi, Di, -1).copy()
        e = np.outer(Q @ r, K[:, :nope] @ u)
        for h in range(Hi):
            drand = (Q @ W[h].T) @ K.T
            W[h, :nope] += ALIGN_Q * drand.std() / e.mean() * np.outer(u, r)
        wr.redo(p + "indexer.wq_b.weight", W.reshape(Hi * Di, -1))
        wp = wr.values[p + "indexer.weights_proj.weight"][1].copy()
        along = A @ av
        if along.min() <= 0:
            return f"layer {L}: no common direction of the attention inputs"
        for h in range(Hi):
            w = A @ wp[h]
            wp[h] += (max(0.0, -w.min()) + ALIGN_W * w.std()) / along.min() * av
        wr.redo(p + "indexer.weights_proj.weight", wp)
        write_checkpoint(d, wr.raw, 1)
    return None


def build(spec, root):
    d = os.path.join(root, spec["name"])
    quantized = spec["storage"] != "f32"
    cj = root_config(quantized)
    cfg0 = v41.V41Config(cj)
    lengths = LENGTHS
    long_i = lengths.index(max(lengths))
    cs = cfg0.candidate_source
    for attempt in range(MAX_ATTEMPTS):
        seed = spec["seed"] + attempt
        rng = np.random.default_rng(seed)
        wr = random_checkpoint(cfg0, rng, spec["storage"])
        seqs = [rng.integers(0, IMAGE_TOKEN_ID, size=k).tolist() for k in lengths]
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cj, f, indent=2)
            f.write("\n")
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(make_tokenizer(), f, indent=1, ensure_ascii=False)
            f.write("\n")
        check_tokenizer(os.path.join(d, "tokenizer.json"), cfg0.vocab_size)
        write_checkpoint(d, wr.raw, 1)
        why = align_indexers(d, wr, seqs, cfg0, rng)
        if why:
            print(f"  {spec['name']}: seed {seed} rejected ({why})")
            continue
        model = v41.DeepSeekV41Ref(d)
        mk4.check_loader(model, wr)
        bad = []

        def check(tag, r):
            if r["route"] < ROUTE_MARGIN:
                bad.append(f"{tag}routing margin {r['route']:.2e}")
            if r["index"] < INDEX_MARGIN:
                bad.append(f"{tag}indexer gap {r['index']:.2e}")
            if r["cand"] < INDEX_MARGIN:
                bad.append(f"{tag}candidate-block gap {r['cand']:.2e}")

        logits, traces = run_traced(model, seqs)
        rep = margins(model, traces)
        check("", rep)
        restricted_long = sum(sum(v) for v in margins(model, [traces[long_i]])["restricted"].values())
        if cs >= 0 and restricted_long < MIN_RESTRICTED_ROWS:
            bad.append(f"candidate restriction changes only {restricted_long} rows at T={lengths[long_i]}")
        if not bad:
            model.qat = False
            nq_logits, nq_traces = run_traced(model, seqs)
            model.qat = True
            rep_nq = margins(model, nq_traces)
            check("no-QAT ", rep_nq)
        if not bad:
            dec = {}
            dtr = []
            for i, s in enumerate(seqs):
                if len(s) in DECODE_PREFILL:
                    P = DECODE_PREFILL[len(s)]
                    model.trace = {}
                    dec[i] = model.decode(s, P, "as_shipped")
                    dtr.append(model.trace)
                    model.trace = None
            rep_dec = margins(model, dtr)
            check("as-shipped decode ", rep_dec)
        if not bad:
            model.flip = FLIP
            fl_logits, fl_traces = run_traced(model, seqs)
            model.flip = None
            flips = changed_choices(model, fl_traces, traces)
            if flips:
                bad.append(f"{flips} choices change when the roundings within {FLIP:.0e} of a boundary flip")
        if bad:
            print(f"  {spec['name']}: seed {seed} rejected ({', '.join(bad)})")
            continue
        break
    else:
        raise RuntimeError(f"{spec['name']}: no seed with clear margins")
    n_flipped = margins(model, fl_traces)["near_flip"]
    deltas = [mk4.row_delta(a, b) for a, b in zip(fl_logits, logits)]
    qat_effect = max((a - b).abs().max().item() for a, b in zip(logits, nq_logits))

    longest = seqs[long_i]
    T = len(longest)
    cuts = sorted({k for k in (1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 20, 33, T - 1) if 1 <= k < T})
    res = v41.causal_check(model, longest, cuts)
    worst = max(x for _, x in res)
    dec_fixed = {}
    for i in dec:
        fx = model.decode(seqs[i], DECODE_PREFILL[len(seqs[i])], "fixed")
        dec_fixed[i] = (fx - logits[i]).abs().max().item()
        assert dec_fixed[i] < 1e-10, f"decode(fixed) differs from the prefill by {dec_fixed[i]:.3e}"
        fx1 = model.decode(seqs[i], 1, "fixed")
        assert (fx1 - logits[i]).abs().max().item() < 1e-10, "decode(fixed, prefill 1) differs from the prefill"

    clamp = {"values": 0, "gate": 0, "up": 0}
    limit = cfg0.swiglu_limit

    def counting_swiglu(p, x, inner=model.swiglu):
        g, u = dr.linear(x, model.W(p + "w1.weight")), dr.linear(x, model.W(p + "w3.weight"))
        clamp["values"] += g.numel()
        clamp["gate"] += int((g > limit).sum())
        clamp["up"] += int((u.abs() > limit).sum())
        return inner(p, x)

    model.swiglu = counting_swiglu
    for s in seqs:
        model.forward(s)
    del model.swiglu

    with open(os.path.join(d, "tokens.json"), "w") as f:
        json.dump(seqs, f)
        f.write("\n")
    exp = []

    def put(name, t):
        exp.append((name, "F32", list(t.shape), t.numpy().astype("<f4").tobytes()))

    meta = {"generator": "tests/reference/make_v41_fixtures.py",
            "note": "float64 reference logits rounded to float32"}
    for i in range(len(seqs)):
        put(f"logits.{i}", logits[i])
        put(f"logits_noqat.{i}", nq_logits[i])
        put(f"flip_delta.{i}", deltas[i])
        if i in dec:
            put(f"decode_shipped.{i}", dec[i])
            meta[f"decode_prefill.{i}"] = str(DECODE_PREFILL[len(seqs[i])])
    dr.write_safetensors_raw(os.path.join(d, "expected.safetensors"), exp, meta)

    # coverage summary
    allv = torch.cat([lg.reshape(-1) for lg in logits])
    sizes = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    print(f"{spec['name']}: seed {seed}, {sum(sizes.values()) / 1024:.1f} KiB ("
          + ", ".join(f"{f} {s / 1024:.1f}" for f, s in sizes.items()) + f"), lengths {lengths}, logits std "
          f"{allv.std().item():.2f} max|.| {allv.abs().max().item():.2f}")
    w = cfg0.sliding_window
    print(f"  window {w} < T for T in {[k for k in lengths if k > w]}; odd T (ratio-2 remainder) for "
          f"{[k for k in lengths if k % 2]}")
    print(f"  routing: {rep['route_rows']} rows, min top-k margin {rep['route']:.3e}; expert usage per layer "
          + "; ".join(f"{k}: {v.tolist()}" for k, v in rep["usage"].items())
          + f"; SwiGLU clamps at {limit:g}: {clamp['gate']} gates and {clamp['up']} ups of {clamp['values']}")
    print(f"  indexer: rows with more visible entries than index_topk {cfg0.index_topk}, per index source: "
          f"{rep['index_rows']}; min relative top-k gap {rep['index']:.3e}; {rep['index_not_recent']} rows not the "
          f"most recent entries")
    rl = margins(model, [traces[long_i]])
    print(f"  candidate source {cs}: {rep['cand_rows']} rows with more reachable blocks than "
          f"candidate_topk_blocks, min relative block gap {rep['cand']:.3e}; rows whose picks the candidate "
          f"restriction changes at T={T}: "
          + ", ".join(f"layer {k}: {sum(v)} of {T}" for k, v in rl["restricted"].items()))
    cls = [model.lut[x] for x in longest]
    pairs = sum(1 for i in range(T) for j in range(i) if cls[i] == cls[j] and longest[i] != longest[j])
    print(f"  Engram: alpha in [{rep['alpha'][0]:.3f}, {rep['alpha'][1]:.3f}]; {pairs} position pairs of the {T}-token "
          f"sequence with different raw ids in one token class")
    print(f"  QAT simulation: {rep['quant_values']} rounded values, min distance to a rounding midpoint "
          f"{rep['tie']:.2e} (2|x - mid| / spacing), {rep['near']} values below 1e-4, min scale margin "
          f"{rep['scale']:.2e}; no-QAT run: routing margin {rep_nq['route']:.3e}, indexer gap {rep_nq['index']:.3e}, "
          f"block gap {rep_nq['cand']:.3e}")
    alld = torch.cat(deltas)
    print(f"  flipping every rounding within {FLIP:.0e} of a boundary ({n_flipped} values) changes no choice; logits "
          f"move by at most {alld.max().item():.2e}; QAT vs none: max logit difference {qat_effect:.2e}")
    for i in dec:
        dd = (dec[i] - logits[i]).abs().max(-1).values
        print(f"  decode T={len(seqs[i])} (prefill {DECODE_PREFILL[len(seqs[i])]}): 'fixed' = prefill "
              f"(max diff {dec_fixed[i]:.1e}); 'as_shipped' differs from the prefill in {int((dd > 1e-9).sum())} rows "
              f"(max {dd.max().item():.2e}); its margins: routing {rep_dec['route']:.3e}, indexer "
              f"{rep_dec['index']:.3e}, blocks {rep_dec['cand']:.3e}")
    print(f"  causal prefix check ({T} tokens, prefixes {cuts}): max diff {worst:.1e}")
    return d


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "v41", "models"),
                    help="root folder; fixtures go to OUT/NAME")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # deterministic float64 reductions
    v4.codec_selftest(verbose=False)
    v41.engram_selftest(verbose=False)
    specs = [s for s in fixture_specs() if not a.names or s["name"] in a.names]
    if a.names and len(specs) != len(a.names):
        ap.error(f"unknown fixture name; known: {[s['name'] for s in fixture_specs()]}")
    os.makedirs(a.out, exist_ok=True)
    for s in specs:
        build(s, a.out)


if __name__ == "__main__":
    main()
