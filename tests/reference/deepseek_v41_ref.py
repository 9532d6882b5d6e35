#!/usr/bin/python3
"""Independent float64 reference of the DeepSeek-V4.1-Flash forward pass (text only).

Written from the released config.json and checkpoint tensor names of deepseek-ai/DeepSeek-V4.1-Flash and from a
reading of DeepSeek's official V4.1 inference code (`inference/model.py` and `inference/engram.py` of that Hugging
Face repo, revision dba1be0a40aa45a94ad051997016db3960a90277). No code of it is copied; tests/reference/README.md
("DeepSeek-V4.1 reference") lists every decision taken. It reads a V4.1 model folder
(config.json with a nested `text_config`, or the flat `inference/config.json` ModelArgs names; safetensors with the
hub tensor names) and computes, for a token sequence at positions 0..T-1, the float64 logits of every position:

  embedding -> hc_mult identical streams -> per layer: [Engram update of every stream] -> lagged mHC block
  (the attention input is collapsed with the pre-mix handed down by the previous block's FFN mixes, one-hot for the
  first block; the FFN input with this block's attention pre-mix) with attention over a sliding window plus, for
  compress ratio 1 or 2, the compressed entries the shared CSA2 top-k picks, and the MoE -> collapse by the last
  block's FFN pre-mix -> norm -> head.

Stored values are widened exactly (BF16/F32 as is, F8_E4M3 times its E8M0 block scale, packed E2M1 experts times
their E8M0 scale per 32 inputs, Engram rows times their E8M0 scale per 32 columns). The only roundings simulated are
the three QAT simulations the official code applies on purpose (qat=True, the default; --no-qat drops them): FP8 of
the window K=V vector (all head_dim entries, rope tail included, blocks of 32, power-of-two scales), FP4 of the
compressed latents (groups of 16, E4M3-rounded scales), FP4 of the indexer's queries and keys (blocks of 32,
power-of-two scales). Activation quantization into the FP8/FP4 GEMMs and bf16 storage of intermediates are not
simulated (the same convention as deepseek_v4_ref.py).

Only torch and numpy (Debian's python3-torch / python3-numpy) are used. The safetensors reader/writer, e4m3/e2m1/e8m0
codecs, RoPE, YaRN, RMSNorm, Sinkhorn, FP8/FP4 block simulations, mHC post-mix and SwiGLU come from deepseek_ref.py
and deepseek_v4_ref.py.

Command line (run with /usr/bin/python3):
  deepseek_v41_ref.py MODEL_DIR [--check] [--no-qat]
      reads MODEL_DIR/tokens.json, prints a line per sequence and, with --check, compares with
      MODEL_DIR/expected.safetensors (`logits.{i}`, or `logits_noqat.{i}` with --no-qat, and with QAT also
      `decode_shipped.{i}` where present).
  deepseek_v41_ref.py MODEL_DIR --decode {fixed,as_shipped} [--prefill P]
      token-by-token decode with caches after a prefill of P tokens (default 1); "fixed" must equal the prefill
      logits, "as_shipped" reproduces the official decode's late index-key publication (`Indexer.forward` publishes
      `shared_attn.index_k` only when a key owner has a new latent).
  deepseek_v41_ref.py --selftest [MODEL_DIR]
      Engram hash vectors (the published Flash vectors and a toy layout, derived from DeepSeek's engram.py), gate
      vectors, codecs; with MODEL_DIR also the causal prefix check and decode("fixed") == prefill on the longest
      sequence of its tokens.json.
"""

import json
import math
import os
import re
import sys
import unicodedata

import numpy as np
import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref as dr  # noqa: E402
import deepseek_v4_ref as v4  # noqa: E402
from deepseek_ref import linear, raw_to_f64, read_model_tensors, read_safetensors_raw, rms_norm  # noqa: E402
from deepseek_v4_ref import (E2M1_POS, FP4_MAX, e2m1_decode, e2m1_encode, fp4_sim, fp4_unpack, fp8_sim,  # noqa: E402
                             rope_freqs, rope_tail, sinkhorn, softplus)

F64 = torch.float64

WINDOW_FP8_BLOCK = 32  # window K=V: FP8 simulation over the whole head_dim vector, blocks of 32
LATENT_FP4_GROUP = 16  # compressed latents: FP4 in groups of 16 with an E4M3 scale
LATENT_SCALE_FLOOR = 6.0 * 2.0 ** -9  # amax floor of the latent groups (scale >= the smallest e4m3 subnormal)
INDEX_FP4_BLOCK = 32  # indexer q and k: FP4 in blocks of 32 with an E8M0 (power-of-two) scale
FP4_WEIGHT_BLOCK = 32  # routed experts: one E8M0 scale per 32 inputs
ENGRAM_SCALE_BLOCK = 32  # Engram rows: one E8M0 scale per 32 columns
ENGRAM_GATE_CLAMP = 1e-6  # |dot| floor before the signed square root
MOE_NORM_EPS = 1e-20  # added to the routing normaliser
DEAD = -1  # Engram history entry of an image token

# ---------------------------------------------------------------------------
# FP4 with an E4M3 scale (compressed latents)
# ---------------------------------------------------------------------------


def _grid_tie(a, grid):
    """2|a - midpoint| / spacing of a >= 0 between its two neighbours on an ascending grid (0 at a midpoint)."""
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    return np.abs((a - lo_v) - (hi_v - a)) / (hi_v - lo_v), lo_v, hi_v


def fp4_e4m3_sim(x, group=LATENT_FP4_GROUP, stats=None, tag="fp4e", flip=None):
    """Quantize-dequantize along the last dim in groups of `group`: amax = max(max|v|, 6 * 2^-9),
    s = e4m3(amax / 6) (round to nearest even, not a power of two), value = e2m1(clamp(v / s, +-6)) * s.
    flip (float or None): take the other rounding of every value, and the other e4m3 scale of every group, within
    flip code spacings of a rounding midpoint (the generator's sensitivity run)."""
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"{tag}: last dim {d} is not a multiple of {group}")
    v = x.reshape(-1, group).numpy()
    amax = np.maximum(np.abs(v).max(-1, keepdims=True), LATENT_SCALE_FLOOR)
    r = amax / FP4_MAX
    s = dr.e4m3_decode(dr.e4m3_encode(r))
    stie, slo, shi = _grid_tie(np.minimum(r, dr.E4M3_MAX), dr._E4M3_POS)
    if flip:
        s = np.where(stie < flip, np.where(s == shi, slo, shi), s)
    y = np.clip(v / s, -FP4_MAX, FP4_MAX)
    out = e2m1_decode(e2m1_encode(y))
    tie, lo_v, hi_v = _grid_tie(np.abs(y), E2M1_POS)
    if flip:
        other = np.where(np.abs(out) == hi_v, lo_v, hi_v)
        out = np.where(tie < flip, np.where(np.signbit(y), -other, other), out)
    if stats is not None and v.size:
        stats.append({"kind": tag, "count": v.size, "tie": float(tie.min()), "near": int((tie < 1e-4).sum()),
                      "near_flip": int((tie < flip).sum() + (stie < flip).sum()) if flip else 0,
                      "scale": float(stie.min())})
    return torch.from_numpy(out * s).reshape(x.shape)


# ---------------------------------------------------------------------------
# Engram: derived constants, hash ids, token classes
# ---------------------------------------------------------------------------

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin below 3.3e24


def is_prime(n):
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(layer_ids, max_ngram, n_heads, base):
    """Per Engram layer (in layer_ids order) the flat list of its (N-1)*Hh primes, column c = (k-2)*Hh + h:
    for each order the search restarts at base-1, and one set of handed-out primes is shared by all layers."""
    seen, out = set(), []
    for _ in layer_ids:
        flat = []
        for _k in range(max_ngram - 1):
            cur = base - 1
            for _h in range(n_heads):
                cur += 1
                while cur in seen or not is_prime(cur):
                    cur += 1
                seen.add(cur)
                flat.append(cur)
        out.append(flat)
    return out


def engram_offsets(primes):
    """exclusive prefix sums of each layer's primes (each layer's table starts at row 0)."""
    return [[sum(p[:c]) for c in range(len(p))] for p in primes]


def engram_multipliers(layer_ids, max_ngram, compressed_vocab):
    """int64 [E, N]: 2 r + 1 with r from numpy default_rng(10007 * layer).integers(0, bound, N, int64),
    bound = max(1, floor(floor((2^63 - 1) / V') / 2))."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * int(l)).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            for l in layer_ids]
    return np.stack(rows).astype(np.int64)


def engram_hash_ids(comp, max_ngram, n_heads, pad, primes, offsets, mults):
    """comp: int64 [T] compressed ids of positions 0..T-1 (DEAD = -1 for image positions) -> int64 [T, E, C].
    Sticky blocking: once the look-back passes the sequence start or a DEAD position, every longer look-back
    reads pad. r_1 = p_0 ^ p_1, r_k = r_(k-1) ^ p_k (the hash of the (k+1)-gram), id = r_k mod prime + offset."""
    comp = np.asarray(comp, dtype=np.int64)
    T = comp.shape[0]
    t = np.arange(T)
    toks = np.empty((T, max_ngram), dtype=np.int64)
    blocked = np.zeros(T, dtype=bool)
    for s in range(max_ngram):
        src = comp[np.maximum(t - s, 0)] if T else comp
        blocked = blocked | (t < s) | (src == DEAD)
        toks[:, s] = np.where(blocked, pad, src)
    if (toks < 0).any():
        raise ValueError("engram: negative compressed id")
    prod = toks[:, None, :] * mults[None, :, :]  # [T, E, N]; id * M < 2^63 by the bound
    E, C = mults.shape[0], (max_ngram - 1) * n_heads
    P = np.array(primes, dtype=np.int64)
    O = np.array(offsets, dtype=np.int64)
    out = np.empty((T, E, C), dtype=np.int64)
    r = prod[..., 0]
    for k in range(1, max_ngram):
        r = np.bitwise_xor(r, prod[..., k])
        cs = slice((k - 1) * n_heads, k * n_heads)
        out[:, :, cs] = r[:, :, None] % P[None, :, cs] + O[None, :, cs]
    return out


def engram_update(X, kv, q_weight, k_weight, eps, mask=None):
    """The Engram gate and update. X [T, n, d] streams, kv [T, (n+1) d] (keys for the n streams, then the shared
    value) -> (X + alpha v, alpha [T, n], dot [T, n]). dot = <x, q_weight * k_weight * key> *
    rsqrt(mean x^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(d), per (token, stream);
    alpha = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)); mask [T] False (image positions) -> alpha = 0."""
    T, n, d = X.shape
    key = kv[:, :n * d].reshape(T, n, d)
    val = kv[:, n * d:]
    w = q_weight * k_weight
    rstd = torch.rsqrt((X * X).mean(-1) + eps) * torch.rsqrt((key * key).mean(-1) + eps)
    dot = (X * w * key).sum(-1) * rstd * d ** -0.5
    alpha = torch.sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp(min=ENGRAM_GATE_CLAMP)), dot))
    if mask is not None:
        alpha = alpha.masked_fill(~mask[:, None], 0.0)
    return X + alpha[..., None] * val[:, None, :], alpha, dot


# GPT-2 byte-level alphabet: byte -> one code point (printable Latin-1 kept, the rest from U+0100 on)
def _byte_level_map():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cps, n = {}, 0
    for b in range(256):
        if b in keep:
            cps[b] = b
        else:
            cps[b] = 256 + n
            n += 1
    return {b: chr(c) for b, c in cps.items()}


BYTE_TO_CHAR = _byte_level_map()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def byte_level_encode(text):
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


def byte_level_decode(token):
    out = bytearray()
    for ch in token:
        if ch in CHAR_TO_BYTE:
            out.append(CHAR_TO_BYTE[ch])
        else:
            out += ch.encode("utf-8")
    return out.decode("utf-8", errors="replace")


def class_key(text):
    """Python port of the CompressedTokenizer normaliser (NFKC, NFD, strip accents, lowercase, [ \\t\\r\\n]+ -> ' ',
    a lone ' ' protected through U+E000, strip, U+E000 -> ' '). Uses Python's unicodedata / str.lower / str.strip,
    which can differ from Hugging Face's on exotic characters; used only to check a fixture's tokenizer."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s == " ":
        s = "\ue000"
    return s.strip().replace("\ue000", " ")


def token_classes_from_tokenizer(path, vocab):
    """The compressed-token table of the first `vocab` ids of a byte-level BPE tokenizer.json (decode each id
    alone, keep special tokens; a decode holding U+FFFD is keyed by the raw token string; an empty key by the
    decoded text; first-seen numbering) -> (table list, class count)."""
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    id_to_tok = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a["content"] for a in tj.get("added_tokens") or []}
    seen, table = {}, []
    for i in range(vocab):
        if i in added and id_to_tok.get(i) != added[i]:
            raw, text = added[i], added[i]
        elif i in id_to_tok:
            raw = id_to_tok[i]
            text = byte_level_decode(raw)
        else:
            raise ValueError(f"{path}: id {i} names no token")
        if "\ufffd" in text:
            key = raw
        else:
            key = class_key(text) or text
        table.append(seen.setdefault(key, len(seen)))
    return table, len(seen)


class EngramLayout:
    def __init__(self, layer_ids, max_ngram, n_heads, head_dim, base, compressed_vocab, pad_class, num_embeddings):
        self.layer_ids = list(layer_ids)
        self.N, self.Hh, self.De = max_ngram, n_heads, head_dim
        self.C = (max_ngram - 1) * n_heads
        self.primes = engram_primes(self.layer_ids, max_ngram, n_heads, base)
        self.offsets = engram_offsets(self.primes)
        self.mults = engram_multipliers(self.layer_ids, max_ngram, compressed_vocab)
        self.pad = pad_class
        self.rows = list(num_embeddings) if num_embeddings is not None else [sum(p) for p in self.primes]

    def hash_ids(self, comp):
        return engram_hash_ids(comp, self.N, self.Hh, self.pad, self.primes, self.offsets, self.mults)


# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------

# flat inference/config.json (ModelArgs) names -> the text_config names of the released config.json
FLAT_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_mtp_layers": "num_nextn_predict_layers",
              "n_heads": "num_attention_heads", "rope_head_dim": "qk_rope_head_dim", "window_size": "sliding_window",
              "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
              "candidate_source_layer": "candidate_source_layer_id", "n_activated_experts": "num_experts_per_tok",
              "moe_inter_dim": "moe_intermediate_size", "score_func": "scoring_func",
              "route_scale": "routed_scaling_factor", "norm_eps": "rms_norm_eps",
              "engram_pad_id": "engram_pad_token_id"}


class V41Config:
    """The fields of a V4.1 config.json: the released nesting (root + `text_config`), a bare text config, or the
    flat inference/config.json with ModelArgs names."""

    def __init__(self, j):
        self.raw = j
        q = j.get("quantization_config") or {}
        if "text_config" in j:
            if j.get("model_type") not in (None, "deepseek_v41"):
                raise ValueError(f"model_type {j.get('model_type')!r} is not deepseek_v41")
            t = dict(j["text_config"])
            q = q or t.get("quantization_config") or {}
        elif "dim" in j:  # flat ModelArgs names
            t = {FLAT_NAMES.get(k, k): v for k, v in j.items()}
            if (j.get("original_seq_len") or 0) > 0:
                t["rope_scaling"] = {"type": "yarn", "factor": j.get("rope_factor", 40),
                                     "original_max_position_embeddings": j["original_seq_len"],
                                     "beta_fast": j.get("beta_fast", 32), "beta_slow": j.get("beta_slow", 1)}
            else:
                t["rope_scaling"] = None
            t.setdefault("compress_rope_theta", 40000.0)  # the ModelArgs default
        else:
            t = dict(j)
        mt = t.get("model_type")
        if mt not in (None, "deepseek_v41_text", "deepseek_v41"):
            raise ValueError(f"text model_type {mt!r} is not deepseek_v41_text")
        self.text = t

        def g(k, d=None):
            v = t.get(k, d)
            return d if v is None else v

        self.vocab_size = t["vocab_size"]
        self.hidden_size = t["hidden_size"]
        self.num_hidden_layers = t["num_hidden_layers"]
        self.num_attention_heads = t["num_attention_heads"]
        self.head_dim = t["head_dim"]
        self.rope_dim = t["qk_rope_head_dim"]
        self.q_lora_rank = t["q_lora_rank"]
        self.o_groups = t["o_groups"]
        self.o_lora_rank = t["o_lora_rank"]
        self.sliding_window = t["sliding_window"]
        self.rope_theta = float(g("rope_theta", 10000.0))
        self.rope_scaling = t.get("rope_scaling")
        self.n_routed_experts = t["n_routed_experts"]
        self.n_shared_experts = g("n_shared_experts", 1)
        self.num_experts_per_tok = t["num_experts_per_tok"]
        self.moe_intermediate_size = t["moe_intermediate_size"]
        self.scoring_func = g("scoring_func", "sqrtsoftplus")
        self.norm_topk_prob = bool(g("norm_topk_prob", True))
        self.routed_scaling_factor = float(g("routed_scaling_factor", 1.0))
        self.gate_temp = float(g("gate_temp", 1.0))
        self.swiglu_limit = float(g("swiglu_limit", 0.0))
        self.index_n_heads = g("index_n_heads", 0)
        self.index_head_dim = g("index_head_dim", 0)
        self.index_topk = g("index_topk", 0)
        self.hc_mult = g("hc_mult", 4)
        self.hc_sinkhorn_iters = g("hc_sinkhorn_iters", 20)
        self.hc_eps = float(g("hc_eps", 1e-6))
        self.rms_norm_eps = float(g("rms_norm_eps", 1e-20))
        self.tie_word_embeddings = bool(g("tie_word_embeddings", False))
        self.kv_sources = [int(x) for x in g("kv_source_layer_ids", [])]
        self.index_sources = [int(x) for x in g("index_source_layer_ids", [])]
        self.candidate_source = int(g("candidate_source_layer_id", -1))
        self.candidate_topk_blocks = int(g("candidate_topk_blocks", 0))
        self.candidate_block_size = int(g("candidate_block_size", 0))
        self.engram_layers = [int(x) for x in g("engram_layer_ids", [])]
        self.engram_num_embeddings = g("engram_num_embeddings", None)
        self.engram_max_ngram_size = int(g("engram_max_ngram_size", 1))
        self.engram_n_heads = int(g("engram_n_heads", 0))
        self.engram_head_dim = int(g("engram_head_dim", 0))
        self.engram_vocab_size = int(g("engram_vocab_size", 0))
        self.engram_pad_id = int(g("engram_pad_token_id", g("engram_pad_id", 2)))
        self.engram_compressed_vocab_size = int(g("engram_compressed_vocab_size", 0))
        self.image_token_id = j.get("image_token_id", t.get("image_token_id"))
        self.fp8_block = tuple(q.get("weight_block_size", [32, 32]))
        sf = q.get("scale_fmt", "ue8m0")
        if sf not in (None, "", "ue8m0"):
            raise ValueError(f"scale_fmt {sf!r} not supported")
        self.scale_fmt = "ue8m0"  # the official code's power-of-two activation scales, whatever the file says

        cr = [int(m) for m in t["compress_ratios"]]
        L = self.num_hidden_layers
        if len(cr) < L:
            raise ValueError("compress_ratios has fewer entries than num_hidden_layers")
        self.compress_ratios = cr[:L]
        any_comp = any(self.compress_ratios)
        self.compress_rope_theta = float(t["compress_rope_theta"]) if any_comp else None
        self._check()
        self._roles()

    def _check(self):
        D, R = self.head_dim, self.rope_dim
        if R % 2 or R > D:
            raise ValueError("qk_rope_head_dim must be even and at most head_dim")
        if D % WINDOW_FP8_BLOCK or D % LATENT_FP4_GROUP:
            raise ValueError(f"head_dim must be a multiple of {WINDOW_FP8_BLOCK} (window FP8 blocks) and "
                             f"{LATENT_FP4_GROUP} (latent FP4 groups)")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("num_attention_heads must be a multiple of o_groups")
        if self.n_shared_experts not in (0, 1):
            raise ValueError("n_shared_experts must be 0 or 1 (the official code asserts 1)")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"scoring_func {self.scoring_func!r}")
        if self.rope_scaling:
            typ = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if typ != "yarn":
                raise ValueError(f"rope_scaling type {typ!r} not supported")
        if any(m < 0 for m in self.compress_ratios):
            raise ValueError("negative compress ratio")
        if any(self.compress_ratios):
            Di = self.index_head_dim
            if not self.index_n_heads or Di <= 0 or Di % INDEX_FP4_BLOCK or R > Di or self.index_topk <= 0:
                raise ValueError(f"compressed layers need index_n_heads > 0, index_head_dim a multiple of "
                                 f"{INDEX_FP4_BLOCK} and >= qk_rope_head_dim, and index_topk > 0")
        if self.engram_layers:
            if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim <= 0:
                raise ValueError("engram needs engram_max_ngram_size >= 2, engram_n_heads and engram_head_dim > 0")
            if self.engram_compressed_vocab_size <= 0:
                raise ValueError("engram needs engram_compressed_vocab_size")
            if self.engram_num_embeddings is not None and len(self.engram_num_embeddings) != len(self.engram_layers):
                raise ValueError("engram_num_embeddings needs one entry per Engram layer")

    def _roles(self):
        """Who publishes what (CSA2 sharing through model.py's `SharedAttentionRuntime`). For a layer L with ratio
        m > 0: kv_src[L] = the nearest KV source <= L (its compressed entries), key_src[L] = the nearest KV source
        <= L that is also an index source (its index keys), idx_src[L] = the nearest index source <= L (its top-k).
        Each must exist and have ratio m."""
        L, cr = self.num_hidden_layers, self.compress_ratios
        ks, isrc = set(self.kv_sources), set(self.index_sources)
        for name, s in (("kv_source_layer_ids", ks), ("index_source_layer_ids", isrc)):
            for x in s:
                if not 0 <= x < L or cr[x] == 0:
                    raise ValueError(f"{name}: layer {x} is out of range or has compress ratio 0")
        if not ks <= isrc:
            # The official code computes index keys inside the indexer of a layer that is both; a KV source without
            # an indexer would publish entries whose keys no layer computes.
            raise ValueError("every KV source must also be an index source")
        self.kv_src, self.key_src, self.idx_src = {}, {}, {}
        for layer in range(L):
            m = cr[layer]
            if not m:
                continue
            for tab, pool, what in ((self.kv_src, ks, "KV source"), (self.key_src, ks & isrc, "index-key owner"),
                                    (self.idx_src, isrc, "index source")):
                cand = [x for x in pool if x <= layer]
                if not cand:
                    raise ValueError(f"layer {layer} (ratio {m}) has no {what} at or before it")
                src = max(cand)
                if cr[src] != m:
                    raise ValueError(f"layer {layer} has ratio {m} but its {what} {src} has ratio {cr[src]}")
                tab[layer] = src
        cs = self.candidate_source
        if cs >= 0:
            if cs not in isrc:
                raise ValueError(f"candidate_source_layer_id {cs} is not an index source")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                raise ValueError("a candidate source needs candidate_topk_blocks and candidate_block_size > 0")
            for x in isrc:
                if x > cs and cr[x] != cr[cs]:
                    raise ValueError(f"index source {x} follows candidate source {cs} with another ratio")

    def engram_layout(self):
        if not self.engram_layers:
            return None
        Vc = self.engram_compressed_vocab_size
        lut = stub_token_classes(self.vocab_size, Vc)
        return EngramLayout(self.engram_layers, self.engram_max_ngram_size, self.engram_n_heads,
                            self.engram_head_dim, self.engram_vocab_size, Vc, lut[self.engram_pad_id],
                            self.engram_num_embeddings)


def stub_token_classes(vocab, compressed_vocab):
    """The fixtures' compressed-token table: ids 2k and 2k+1 share class k."""
    if compressed_vocab * 2 != vocab + vocab % 2:
        raise ValueError(f"the reference uses the stub token classes 2k, 2k+1 -> k, which need "
                         f"engram_compressed_vocab_size = ceil(vocab_size / 2), got {compressed_vocab} for {vocab}")
    return [i // 2 for i in range(vocab)]


# ---------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------

SKIP_PREFIXES = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")


def load_v41_dir(model_dir):
    """-> (V41Config, {name: float64 tensor}). FP8 weights times their E8M0 (or F32) block scale
    (`weight_block_size`, 32x32 by default; Engram tables per row and 32 columns), packed FP4 experts times their
    E8M0 scale per 32 inputs. A leading `model.` is stripped; DSpark / vision tensors are skipped."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = V41Config(json.load(f))
    raw = {}
    for k, v in read_model_tensors(model_dir).items():
        kk = k[len("model."):] if k.startswith("model.") else k
        if kk.startswith(SKIP_PREFIXES):
            continue
        if kk in raw:
            raise ValueError(f"tensor {kk} appears twice")
        raw[kk] = v
    br, bc = cfg.fp8_block
    w, used = {}, set()
    for name, (dt, shape, data) in raw.items():
        if name.endswith(".scale") or name.endswith("_scale_inv"):
            continue
        sname = None
        if name.endswith(".weight"):
            for cand in (name[:-len("weight")] + "scale", name + "_scale_inv"):
                if cand in raw:
                    sname = cand
        if dt == "F8_E4M3":
            if sname is None:
                raise ValueError(f"fp8 tensor {name} has no scale")
            out, inn = shape
            rb, cb = (1, ENGRAM_SCALE_BLOCK) if name.endswith("engram.embed.weight") else (br, bc)
            sdt, sshape, sdata = raw[sname]
            want = [-(-out // rb), -(-inn // cb)]
            if list(sshape) != want:
                raise ValueError(f"{sname}: expected shape {want}, got {sshape}")
            s = v4._scale_values(sname, sdt, sshape, sdata)
            s = s.repeat_interleave(rb, 0)[:out].repeat_interleave(cb, 1)[:, :inn]
            t = raw_to_f64(dt, shape, data) * s  # exact: e4m3 times a power of two
        elif dt in ("I8", "U8"):
            if sname is None:
                raise ValueError(f"packed fp4 tensor {name} has no scale")
            sdt, sshape, sdata = raw[sname]
            out, half = shape
            inn = 2 * half
            if inn % FP4_WEIGHT_BLOCK or list(sshape) != [out, inn // FP4_WEIGHT_BLOCK]:
                raise ValueError(f"{sname}: expected shape {[out, inn // FP4_WEIGHT_BLOCK]} for fp4 {name} {shape}")
            codes = fp4_unpack(np.frombuffer(data, dtype=np.uint8).reshape(out, half))
            s = v4._scale_values(sname, sdt, sshape, sdata).repeat_interleave(FP4_WEIGHT_BLOCK, 1)
            t = torch.from_numpy(e2m1_decode(codes)) * s
        else:
            t = raw_to_f64(dt, shape, data)
            if sname is not None:
                raise ValueError(f"{name} ({dt}) has a scale tensor {sname}")
        if sname is not None:
            used.add(sname)
        if torch.isnan(t).any():
            raise ValueError(f"{name} holds NaN")
        w[name] = t
    orphans = [k for k in raw if (k.endswith(".scale") or k.endswith("_scale_inv")) and k not in used]
    if orphans:
        raise ValueError(f"scale tensors without a quantized weight: {orphans[:5]}")
    return cfg, w


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def stable_topk_mask(score, k):
    """bool mask of the k largest entries per row (stable: ties go to the lower index) -> (mask, order)."""
    order = np.argsort(-score.numpy(), axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(score.shape[-1])[None, :].repeat(score.shape[0], 0), axis=-1)
    return torch.from_numpy(rank < k), order


class DecodeState:
    """Per-sequence caches of the token-by-token mode."""

    def __init__(self, cfg):
        n = cfg.num_hidden_layers
        self.hist = []  # compressed ids of positions 0..t-1 (Engram)
        self.win = [[] for _ in range(n)]  # window K=V rows of every position (the last `window` are visible)
        self.pending = {L: [] for L in cfg.kv_sources}  # ratio > 1: (P, Z) rows of the incomplete group
        self.entries = {L: [] for L in cfg.kv_sources}  # compressed entries (post RoPE / QAT)
        self.keys = {L: [] for L in cfg.kv_sources}  # index keys (post RoPE / QAT)
        self.published = None  # as_shipped: the layer whose key cache the shared index-key slot points to


class DeepSeekV41Ref:
    # borrowed from the V4 reference: they read only self.cfg (hc_*, rms_norm_eps, swiglu_limit), self.W, self.trace
    _mix = v4.DeepSeekV4Ref._mix
    swiglu = v4.DeepSeekV4Ref.swiglu
    hc_post = staticmethod(v4.DeepSeekV4Ref.hc_post)
    W = v4.DeepSeekV4Ref.W
    _tr = v4.DeepSeekV4Ref._tr
    _qstats = v4.DeepSeekV4Ref._qstats

    def __init__(self, model_dir, qat=True):
        self.cfg, self.w = load_v41_dir(model_dir)
        self.ints = {}
        self.qat = qat
        c = self.cfg
        self.freqs_swa = rope_freqs(c.rope_dim, c.rope_theta, None)
        self.freqs_comp = (rope_freqs(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
                           if c.compress_rope_theta is not None else None)
        self.engram = c.engram_layout()
        self.lut = stub_token_classes(c.vocab_size, c.engram_compressed_vocab_size) if self.engram else None
        tk = os.path.join(model_dir, "tokenizer.json")
        if self.engram and os.path.exists(tk):
            table, _ = token_classes_from_tokenizer(tk, c.vocab_size)
            if table != self.lut:
                raise ValueError(f"{tk}: the token classes of its first {c.vocab_size} ids are not 2k, 2k+1 -> k")
        if self.engram:
            for e, L in enumerate(c.engram_layers):
                t = self.W(f"layers.{L}.engram.embed.weight")
                if t.shape != (self.engram.rows[e], c.engram_head_dim):
                    raise ValueError(f"layers.{L}.engram.embed.weight: shape {tuple(t.shape)}, expected "
                                     f"{(self.engram.rows[e], c.engram_head_dim)}")
        self.trace = None  # {} collects routing / indexer / candidate / quantization records
        self.flip = None  # see fp8_sim / fp4_sim / fp4_e4m3_sim
        self._cap = None  # capture dict of forward() (seeds the decode caches)

    # --- simulations -----------------------------------------------------------
    def _fp8(self, x, tag):
        return fp8_sim(x, WINDOW_FP8_BLOCK, "ue8m0", self._qstats(), "fp8 " + tag, self.flip)

    def _fp4(self, x, tag):
        return fp4_sim(x, INDEX_FP4_BLOCK, self._qstats(), "fp4 " + tag, self.flip)

    def _fp4e(self, x, tag):
        return fp4_e4m3_sim(x, LATENT_FP4_GROUP, self._qstats(), "fp4e " + tag, self.flip)

    # --- mHC -------------------------------------------------------------------
    def mixes(self, X, p):
        """X [T, n, d] -> (pre [T, n], post [T, n], comb [T, n, n]); p = "...hc_attn_" or "...hc_ffn_"."""
        c = self.cfg
        n = c.hc_mult
        mix = self._mix(X, self.W(p + "fn"))
        sc, base = self.W(p + "scale"), self.W(p + "base")
        pre = torch.sigmoid(mix[:, :n] * sc[0] + base[:n]) + c.hc_eps
        post = 2.0 * torch.sigmoid(mix[:, n:2 * n] * sc[1] + base[n:2 * n])
        comb = sinkhorn((mix[:, 2 * n:] * sc[2] + base[2 * n:]).reshape(-1, n, n), c.hc_sinkhorn_iters, c.hc_eps)
        self._tr("comb", comb)
        return pre, post, comb

    @staticmethod
    def collapse(X, pre):
        return (pre[:, :, None] * X).sum(1)

    # --- Engram ----------------------------------------------------------------
    def hash_ids(self, tokens):
        return self.engram.hash_ids([self.lut[t] for t in tokens])

    def engram_layer(self, L, X, ids):
        """X [T, n, d], ids [T, C] -> updated streams."""
        c, lay = self.cfg, self.engram
        p = f"layers.{L}.engram."
        table = self.W(p + "embed.weight")
        rows = table.shape[0]
        idx = torch.from_numpy(np.ascontiguousarray(ids))
        valid = (idx >= 0) & (idx < rows)  # an id past the table reads a zero row
        e = table[idx.clamp(0, rows - 1)] * valid[..., None]
        kv = linear(e.reshape(X.shape[0], lay.C * lay.De), self.W(p + "wkv.weight"))
        Xn, alpha, dot = engram_update(X, kv, self.W(p + "q_weight"), self.W(p + "k_weight"), c.rms_norm_eps)
        self._tr("engram", {"layer": L, "alpha": alpha, "dot": dot})
        return Xn

    # --- attention pieces ------------------------------------------------------
    def _q_kv(self, p, a, pos, freqs):
        c = self.cfg
        T = a.shape[0]
        qr = rms_norm(linear(a, self.W(p + "wq_a.weight")), self.W(p + "q_norm.weight"), c.rms_norm_eps)
        q = rope_tail(linear(qr, self.W(p + "wq_b.weight")).reshape(T, c.num_attention_heads, c.head_dim), pos, freqs)
        kv = rope_tail(rms_norm(linear(a, self.W(p + "wkv.weight")), self.W(p + "kv_norm.weight"), c.rms_norm_eps),
                       pos, freqs)
        if self.qat:
            kv = self._fp8(kv, "window kv")
        return qr, q, kv

    def _pool(self, p, P, Z):
        """ratio > 1: softmax-gated sum over the group. P, Z [nb, m, D] -> normed latent [nb, D]."""
        C = (torch.softmax(Z, dim=1) * P).sum(1)
        return rms_norm(C, self.W(p + "norm.weight"), self.cfg.rms_norm_eps)

    def compressor(self, p, a, m):
        """a [T, d] (the normed attention input) -> pre-RoPE latents [T // m, D] (none for the incomplete tail)."""
        c = self.cfg
        T = a.shape[0]
        nb = T // m
        if m == 1:
            return rms_norm(linear(a, self.W(p + "wkv.weight")), self.W(p + "norm.weight"), c.rms_norm_eps)
        if nb == 0:
            return torch.zeros(0, c.head_dim, dtype=F64)
        P = linear(a[:nb * m], self.W(p + "wkv.weight")).reshape(nb, m, -1)
        Z = linear(a[:nb * m], self.W(p + "wgate.weight")).reshape(nb, m, -1)
        return self._pool(p, P, Z)

    def index_keys(self, p, latent, pos, freqs):
        """pre-RoPE latents [nb, D] at positions pos [nb] -> index keys [nb, Di]."""
        c = self.cfg
        if latent.shape[0] == 0:
            return torch.zeros(0, c.index_head_dim, dtype=F64)
        k = rms_norm(linear(latent, self.W(p + "wk.weight")), self.W(p + "k_norm.weight"), c.rms_norm_eps)
        k = rope_tail(k, pos, freqs)
        return self._fp4(k, "index k") if self.qat else k

    def entries(self, latent, pos, freqs):
        if latent.shape[0] == 0:
            return latent
        C = rope_tail(latent, pos, freqs)
        return self._fp4e(C, "latent") if self.qat else C

    def index_select(self, L, p, a, qr, pos, freqs, keys, vis, sh):
        """The indexer of index source L. keys [nb, Di] (the key owner's), vis [R] visible entry counts per query
        row -> bool [R, nb] selection; publishes the candidate mask when L is the candidate source."""
        c = self.cfg
        R, nb = a.shape[0], keys.shape[0]
        Hi, Di = c.index_n_heads, c.index_head_dim
        q = rope_tail(linear(qr, self.W(p + "wq_b.weight")).reshape(R, Hi, Di), pos, freqs)
        if self.qat:
            q = self._fp4(q, "index q")
        wts = linear(a, self.W(p + "weights_proj.weight")) * (Di ** -0.5 * Hi ** -0.5)
        score = torch.einsum("th,ths->ts", wts, torch.relu(torch.einsum("thd,sd->ths", q, keys)))
        visible = torch.arange(nb)[None, :] < vis[:, None]
        score = score.masked_fill(~visible, float("-inf"))
        k = min(c.index_topk, nb)
        cs = c.candidate_source
        rec = {"layer": L, "k": k}
        if L == cs:
            sh["cand"] = self.candidate_mask(score, vis, L)
        elif 0 <= cs < L:
            cand = sh.get("cand")
            if cand is None or cand.shape != score.shape:
                raise ValueError(f"layer {L}: the candidate mask of layer {cs} is missing or has another shape")
            free, _ = stable_topk_mask(score, k)
            rec["unrestricted"] = free & visible
            score = score.masked_fill(~cand, float("-inf"))
        finite = torch.isfinite(score)
        nfin = finite.sum(-1)
        amb = (nfin < torch.clamp(vis, max=k)) & (vis > nfin)
        if amb.any():
            raise ValueError(f"layer {L}: fewer finite candidate scores than top-k picks among the visible entries "
                             "(the official top-k would pick an arbitrary masked entry)")
        sel, order = stable_topk_mask(score, k)
        sel = sel & finite
        rec.update({"score": score, "selected": sel, "order": order, "vis": vis, "a": a, "qr": qr, "keys": keys})
        if "unrestricted" in rec:
            rec["restricted_changed"] = int((rec["unrestricted"] != sel).any(-1).sum())
        self._tr("index", rec)
        return sel

    def candidate_mask(self, score, vis, L):
        """Level one of the two-level top-k: per row the candidate_topk_blocks blocks (of candidate_block_size
        positions, scored by their best position, the block holding the newest visible position pinned to +inf) that
        hold a reachable position -> bool [R, nb]."""
        c = self.cfg
        B, K = c.candidate_block_size, c.candidate_topk_blocks
        R, nb = score.shape
        nblk = -(-nb // B)
        pad = torch.full((R, nblk * B), float("-inf"), dtype=F64)
        pad[:, :nb] = score
        bs = pad.reshape(R, nblk, B).max(-1).values
        last = torch.div(vis - 1, B, rounding_mode="floor")
        bs = bs.masked_fill(torch.arange(nblk)[None, :] == last[:, None], float("inf"))
        keep, order = stable_topk_mask(bs, min(K, nblk))
        keep = keep & (bs > float("-inf"))
        self._tr("cand", {"layer": L, "block_score": bs, "keep": keep, "order": order, "K": min(K, nblk)})
        return keep.repeat_interleave(B, 1)[:, :nb]

    def attend(self, p, q, keys, allowed, pos, freqs):
        """q [R, H, D], keys [S, D] (K = V), allowed [R, S] -> attention output [R, d] (sink in the denominator,
        RoPE tail un-rotated at -pos, grouped low-rank output)."""
        c = self.cfg
        R = q.shape[0]
        H, D = c.num_attention_heads, c.head_dim
        s = torch.einsum("thd,sd->ths", q, keys) * D ** -0.5
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        sink = self.W(p + "attn_sink")[None, :].expand(R, H)
        mx = torch.maximum(s.max(-1).values, sink)
        e = torch.exp(s - mx[..., None])
        pr = e / (e.sum(-1) + torch.exp(sink - mx))[..., None]
        o = rope_tail(torch.einsum("ths,sd->thd", pr, keys), -pos, freqs)
        g, r = c.o_groups, c.o_lora_rank
        wa = self.W(p + "wo_a.weight").reshape(g, r, H * D // g)
        z = torch.einsum("tgi,gri->tgr", o.reshape(R, g, H * D // g), wa)
        return linear(z.reshape(R, g * r), self.W(p + "wo_b.weight"))

    def attention(self, L, a, pos, sh):
        """Prefill attention of layer L over positions 0..T-1. a [T, d] normed; sh: the shared slots of this
        forward (compressed entries, index keys, top-k, candidates)."""
        c = self.cfg
        T = a.shape[0]
        m = c.compress_ratios[L]
        p = f"layers.{L}.attn."
        freqs = self.freqs_comp if m else self.freqs_swa
        qr, q, kv = self._q_kv(p, a, pos, freqs)
        t = torch.arange(T)
        allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - c.sliding_window)
        cap = self._cap
        if cap is not None:
            cap["win"][L] = list(kv)
        keys = kv
        if m:
            nb = T // m
            latent = None
            if L in c.kv_sources:
                latent = self.compressor(p + "compressor.", a, m)
                if cap is not None and m > 1:
                    rem = a[nb * m:]
                    cap["pending"][L] = list(zip(linear(rem, self.W(p + "compressor.wkv.weight")),
                                                 linear(rem, self.W(p + "compressor.wgate.weight"))))
            cpos = torch.arange(nb, dtype=F64) * m
            if L in c.index_sources:
                if L in c.kv_sources and nb > 0:
                    sh["keys"] = (L, self.index_keys(p + "indexer.", latent, cpos, freqs))
                    if cap is not None:
                        cap["keys"][L] = list(sh["keys"][1])
                        cap["published"] = L
                if nb == 0:
                    sh["topk"] = torch.zeros(T, 0, dtype=torch.bool)
                else:
                    src, ik = sh["keys"]
                    assert src == c.key_src[L]
                    sh["topk"] = self.index_select(L, p + "indexer.", a, qr, pos, freqs, ik, (t + 1) // m, sh)
            if L in c.kv_sources:
                sh["entries"] = (L, self.entries(latent, cpos, freqs))
                if cap is not None:
                    cap["entries"][L] = list(sh["entries"][1])
            src, C = sh["entries"]
            assert src == c.kv_src[L] and C.shape[0] == nb
            sel = sh["topk"]
            assert sel.shape == (T, nb)
            keys = torch.cat([kv, C], 0)
            allowed = torch.cat([allowed, sel], 1)
        return self.attend(p, q, keys, allowed, pos, freqs)

    # --- MoE -------------------------------------------------------------------
    def moe(self, p, x, layer):
        c = self.cfg
        K = c.num_experts_per_tok
        logits = linear(x, self.W(p + "gate.weight")) / c.gate_temp
        if c.scoring_func == "sqrtsoftplus":
            s = torch.sqrt(softplus(logits))
        elif c.scoring_func == "sigmoid":
            s = torch.sigmoid(logits)
        else:
            s = torch.softmax(logits, dim=-1)
        choice = s + self.W(p + "gate.bias") if (p + "gate.bias") in self.w else s
        order = np.argsort(-choice.numpy(), axis=-1, kind="stable")  # ties -> lower index
        idx = torch.from_numpy(order[:, :K].copy())
        self._tr("route", {"layer": layer, "choice": choice, "order": order})
        wts = s.gather(1, idx)
        if c.norm_topk_prob and K > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + MOE_NORM_EPS)
        wts = wts * c.routed_scaling_factor
        out = torch.zeros_like(x)
        for e in range(c.n_routed_experts):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, wts[rows, slot, None] * self.swiglu(f"{p}experts.{e}.", x[rows]))
        if c.n_shared_experts:
            out = out + self.swiglu(p + "shared_experts.", x)
        return out

    # --- blocks and forward ----------------------------------------------------
    def block(self, L, X, p_in, attn_fn):
        """Lagged mHC block: (X, pre-mix handed down) -> (X, this block's FFN pre-mix)."""
        eps = self.cfg.rms_norm_eps
        p = f"layers.{L}."
        pa, qa, Ma = self.mixes(X, p + "hc_attn_")
        o = attn_fn(rms_norm(self.collapse(X, p_in), self.W(p + "attn_norm.weight"), eps))
        X = self.hc_post(o, X, qa, Ma)
        pf, qf, Mf = self.mixes(X, p + "hc_ffn_")
        y = self.moe(p + "ffn.", rms_norm(self.collapse(X, pa), self.W(p + "ffn_norm.weight"), eps), L)
        return self.hc_post(y, X, qf, Mf), pf

    def head_logits(self, X, p_in):
        y = rms_norm(self.collapse(X, p_in), self.W("norm.weight"), self.cfg.rms_norm_eps)
        return linear(y, self.W("embed.weight" if self.cfg.tie_word_embeddings else "head.weight"))

    def _embed(self, tokens):
        c = self.cfg
        ids = torch.tensor(tokens, dtype=torch.long)
        if (ids < 0).any() or (ids >= c.vocab_size).any():
            raise ValueError("token id out of range")
        X = self.W("embed.weight")[ids][:, None, :].repeat(1, c.hc_mult, 1)
        p_in = torch.zeros(len(tokens), c.hc_mult, dtype=F64)
        p_in[:, 0] = 1.0  # the first block's attention input is stream 0
        return X, p_in

    def forward(self, tokens, capture=None):
        """Full causal forward over one sequence (positions 0..T-1) -> float64 logits [T, V]. capture: a dict that
        receives the caches a decode continuing after these tokens needs."""
        c = self.cfg
        T = len(tokens)
        pos = torch.arange(T, dtype=F64)
        X, p_in = self._embed(tokens)
        hid = self.hash_ids(tokens) if self.engram else None
        sh = {}
        self._cap = capture
        if capture is not None:
            capture.update({"win": {}, "pending": {}, "entries": {}, "keys": {}, "published": None})
        try:
            for L in range(c.num_hidden_layers):
                if self.engram and L in c.engram_layers:
                    X = self.engram_layer(L, X, hid[:, c.engram_layers.index(L)])
                X, p_in = self.block(L, X, p_in, lambda a, L=L: self.attention(L, a, pos, sh))
        finally:
            self._cap = None
        return self.head_logits(X, p_in)

    # --- token-by-token decode ---------------------------------------------------
    def attention_step(self, L, a, t, st, sh, mode):
        """Decode attention of layer L for the one query at position t with the caches st. mode "fixed": every index
        source scores against its own key owner's keys; "as_shipped": against the key cache last published, which a
        ratio-2 owner publishes only at the steps that complete its group (as shipped in model.py's Indexer.forward)."""
        c = self.cfg
        m = c.compress_ratios[L]
        p = f"layers.{L}.attn."
        freqs = self.freqs_comp if m else self.freqs_swa
        pos = torch.tensor([float(t)], dtype=F64)
        qr, q, kv = self._q_kv(p, a, pos, freqs)
        st.win[L].append(kv[0])
        win = st.win[L][max(0, t + 1 - c.sliding_window):]
        keys = torch.stack(win)
        allowed = torch.ones(1, len(win), dtype=torch.bool)
        if m:
            end = t + 1
            nc = end // m
            latent = None
            if L in c.kv_sources:
                cp = p + "compressor."
                if m == 1:
                    latent = self.compressor(cp, a, 1)
                else:
                    st.pending[L].append((linear(a, self.W(cp + "wkv.weight"))[0],
                                          linear(a, self.W(cp + "wgate.weight"))[0]))
                    if end % m == 0:
                        Pg, Zg = (torch.stack(list(v))[None] for v in zip(*st.pending[L]))
                        assert Pg.shape[1] == m
                        latent = self._pool(cp, Pg, Zg)
                        st.pending[L] = []
            cpos = torch.tensor([float(end - m)], dtype=F64)
            if L in c.index_sources:
                if L in c.kv_sources and latent is not None:
                    st.keys[L].append(self.index_keys(p + "indexer.", latent, cpos, freqs)[0])
                    st.published = L
                if nc == 0:
                    sh["topk"] = torch.zeros(1, 0, dtype=torch.bool)
                else:
                    src = c.key_src[L] if mode == "fixed" else st.published
                    if src is None or len(st.keys[src]) < nc:
                        raise ValueError(f"layer {L}, position {t}: no published key cache with {nc} rows")
                    ik = torch.stack(st.keys[src][:nc])
                    sh["topk"] = self.index_select(L, p + "indexer.", a, qr, pos, freqs, ik,
                                                   torch.tensor([nc]), sh)
            if L in c.kv_sources and latent is not None:
                st.entries[L].append(self.entries(latent, cpos, freqs)[0])
            ent = st.entries[c.kv_src[L]]
            assert len(ent) == nc
            sel = sh["topk"]
            assert sel.shape == (1, nc)
            if nc:
                keys = torch.cat([keys, torch.stack(ent)], 0)
                allowed = torch.cat([allowed, sel], 1)
        return self.attend(p, q, keys, allowed, pos, freqs)

    def step(self, t, token, st, mode):
        c = self.cfg
        X, p_in = self._embed([token])
        if self.engram:
            st.hist.append(self.lut[token])
            hid = self.engram.hash_ids(st.hist)[-1:]
        sh = {}
        for L in range(c.num_hidden_layers):
            if self.engram and L in c.engram_layers:
                X = self.engram_layer(L, X, hid[:, c.engram_layers.index(L)])
            X, p_in = self.block(L, X, p_in, lambda a, L=L: self.attention_step(L, a, t, st, sh, mode))
        return self.head_logits(X, p_in)[0]

    def decode(self, tokens, prefill=1, mode="fixed"):
        """Prefill of tokens[:prefill] (positions 0..P-1, the full forward), then one token per step with caches ->
        logits [T, V] (rows < P from the prefill)."""
        if mode not in ("fixed", "as_shipped"):
            raise ValueError(f"decode mode {mode!r}")
        T = len(tokens)
        P = max(1, min(prefill, T))
        cap = {}
        rows = list(self.forward(tokens[:P], capture=cap))
        st = DecodeState(self.cfg)
        if self.engram:
            st.hist = [self.lut[x] for x in tokens[:P]]
        for L, v in cap["win"].items():
            st.win[L] = list(v)
        for k in ("pending", "entries", "keys"):
            for L, v in cap[k].items():
                getattr(st, k)[L] = list(v)
        st.published = cap["published"]
        for t in range(P, T):
            rows.append(self.step(t, tokens[t], st, mode))
        return torch.stack(rows)


# ---------------------------------------------------------------------------
# self-checks
# ---------------------------------------------------------------------------

FLASH_IDS = {  # published Flash ids: layer 1 at t = 0, 3, 7 and layer 14 at t = 7, c = [5, 17, 42, 7, 0, 99, 12, 3]
    (0, 0): [5412672, 18319159, 35492627, 60880252, 74962984, 95657733, 98005115, 127351390, 143494632, 151789366,
             171410756, 185435171, 207165545, 218031260, 226330336, 247008214, 256353435, 276423911, 295874085,
             305599364, 322749888, 348475788, 367405771, 372009279],
    (0, 3): [10635489, 23985305, 39744525, 53818166, 66930043, 81967808, 97486831, 123477372, 129073017, 154417363,
             167160983, 188974908, 201446056, 223683563, 233041460, 245654968, 263877802, 280761434, 292444171,
             306285994, 331514375, 345356492, 353025140, 373940797],
    (0, 7): [2281283, 22914694, 39336035, 58706500, 79763133, 81448893, 98291950, 124831383, 138730329, 147699702,
             165694291, 186661342, 198663874, 220671249, 229689168, 252709460, 261742913, 282854948, 288895694,
             307917918, 325933411, 344957265, 364128322, 372211994],
    (1, 7): [9546311, 26263184, 33523786, 59698642, 72786210, 83648852, 105450518, 116354087, 140323143, 148199242,
             162714869, 178469091, 201609826, 208509387, 230689158, 254086894, 269366022, 276288937, 299456250,
             307100384, 329800989, 343692851, 367577705, 374996942],
}
FLASH_DEAD_T4 = [5702652, 24393184, 39183301, 61503783, 78984481, 90144770, 103724983, 121476532, 131476717, 152385926,
                 164143652, 191599181, 198145581, 217419202, 238329687, 247482304, 257520185, 283540304, 288689443,
                 315264704, 322314652, 348890037, 367865216, 380066193]
TOY_IDS = {0: [[43, 135, 218, 388], [49, 105, 220, 343], [58, 101, 205, 324], [38, 123, 205, 336],
               [50, 144, 244, 347], [81, 198, 271, 419]],
           1: [[54, 175, 251, 460], [21, 226, 297, 486], [58, 124, 260, 400], [60, 221, 343, 385],
               [63, 171, 323, 460], [60, 187, 319, 476]]}


def engram_selftest(verbose=True):
    lines = []
    # Flash layout
    lay = EngramLayout([1, 14], 4, 8, 256, 16000000, 99092, 2, [384006168, 384016682])
    p1, p14 = lay.primes
    assert p1 == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
                  16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
                  16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463], "Flash primes"
    assert (p14[0], p14[7], p14[8], p14[15], p14[16], p14[23]) == (16000477, 16000627, 16000667, 16000769,
                                                                   16000781, 16000889), "Flash layer-14 primes"
    assert [sum(p) for p in lay.primes] == [384006168, 384016682], "Flash table rows"
    assert lay.offsets[0][:4] == [0, 16000057, 32000136, 48000217] and lay.offsets[0][-1] == 368005705
    assert (np.iinfo(np.int64).max // 99092) // 2 == 46539438283891
    assert lay.mults.tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                                  [67716810739261, 51510806800915, 30921347202721, 82619226485591]], "multipliers"
    comp = [5, 17, 42, 7, 0, 99, 12, 3]
    ids = lay.hash_ids(comp)
    for (e, t), want in FLASH_IDS.items():
        assert ids[t, e].tolist() == want, f"Flash ids layer {e} t {t}"
    assert int(ids.sum()) == 73696428952 and int(ids[:, 0].sum()) == 36815482802 and \
        int(ids[:, 1].sum()) == 36880946150, "Flash checksums"
    assert ((ids >= 0) & (ids < np.array(lay.rows)[None, :, None])).all()
    dead = list(comp)
    dead[3] = DEAD
    ids_d = lay.hash_ids(dead)
    changed = sorted(set(np.nonzero((ids_d != ids).any(axis=(1, 2)))[0].tolist()))
    assert changed == [3, 4, 5, 6], f"DEAD at t=3 changes positions {changed}"
    assert ids_d[4, 0].tolist() == FLASH_DEAD_T4 and int(ids_d.sum()) == 73728092226, "DEAD vectors"
    # int64 scheme check: MaxText's engram.py multipliers before its int32 switch (V' = 128, layer 1, N = 3)
    assert engram_multipliers([1], 3, 128).tolist() == [[59325216104801821, 3746820326864245, 27838405073976279]]
    lines.append("Engram Flash layout: 48 primes, table rows 384006168 / 384016682, offsets, multipliers, ids at "
                 "(layer 1, t 0/3/7), (layer 14, t 7), checksums, DEAD at t=3 (positions 3-6 change, t=4 ids, "
                 "total): ok")
    # toy layout
    toy = EngramLayout([0, 1], 3, 2, 2, 100, 256, 1, None)
    assert toy.primes == [[101, 103, 107, 109], [113, 127, 131, 137]] and toy.rows == [420, 508]
    assert toy.mults.tolist() == [[22948963341361471, 9720090748611819, 1476226777048821],
                                  [29662608052400909, 1873410163432121, 13919202536988139]], "toy multipliers"
    tids = toy.hash_ids([5, 17, 42, 7, 0, 99])
    for e in (0, 1):
        assert tids[:, e].tolist() == TOY_IDS[e], f"toy ids layer {e}"
    # invariants: prefill ids = the ids of one-token steps; a class change at t moves only t..t+N-1
    for t in range(6):
        assert (toy.hash_ids([5, 17, 42, 7, 0, 99][:t + 1])[-1] == tids[t]).all()
    alt = toy.hash_ids([5, 17, 43, 7, 0, 99])
    assert sorted(set(np.nonzero((alt != tids).any(axis=(1, 2)))[0].tolist())) == [2, 3, 4]
    lines.append("Engram toy layout: primes, rows 420 / 508, multipliers, ids of 6 positions x 2 layers, "
                 "prefill = per-step ids, locality: ok")
    # gate and update vectors (n = 2, d = 4, C = 2, De = 2)
    n, d = 2, 4
    wkv = torch.tensor([[0.2 * math.sin(o + 2 * i + 1) for i in range(4)] for o in range(12)], dtype=F64)
    qw = torch.tensor([[1 + 0.1 * g - 0.05 * j for j in range(d)] for g in range(n)], dtype=F64)
    kw = torch.tensor([[1 - 0.03 * j + 0.02 * g for j in range(d)] for g in range(n)], dtype=F64)
    e = torch.tensor([[0.1 * (j + 1) * math.cos(j + t) for j in range(4)] for t in range(2)], dtype=F64)
    X = torch.tensor([[[math.cos(t + 1.5 * g + 0.5 * j) for j in range(d)] for g in range(n)] for t in range(2)],
                     dtype=F64)
    out, alpha, dot = engram_update(X, linear(e, wkv), qw, kw, 1e-20)
    want_dot = [[-1.366463, 0.175927], [1.529790, -1.706348]]
    want_alpha = [[0.237043, 0.603348], [0.775015, 0.213111]]
    want_out = [[[0.982136, 0.871796, 0.551914, 0.089071], [0.025267, -0.430874, -0.771588, -0.943327]],
                [[0.510958, 0.039168, -0.420916, -0.774728], [-0.809213, -0.998673, -0.937768, -0.646380]]]
    v0 = linear(e, wkv)[0, n * d:]
    assert np.allclose(dot.numpy(), want_dot, atol=6e-7, rtol=0), dot
    assert np.allclose(alpha.numpy(), want_alpha, atol=6e-7, rtol=0), alpha
    assert np.allclose(v0.numpy(), [-0.075363, -0.024409, 0.048986, 0.077344], atol=6e-7, rtol=0), v0
    assert np.allclose(out.numpy(), want_out, atol=6e-7, rtol=0), out
    _, a0, d0 = engram_update(X, torch.zeros(2, 12, dtype=F64), qw, kw, 1e-20)
    assert (d0 == 0).all() and not torch.signbit(d0).any()
    assert np.allclose(a0.numpy(), 0.500249999979, atol=1e-12, rtol=0), a0
    _, am, _ = engram_update(X, linear(e, wkv), qw, kw, 1e-20, mask=torch.tensor([True, False]))
    assert (am[1] == 0).all()
    lines.append("Engram gate: dot / alpha / v / outputs of the two test tokens (6 digits), +0 dot -> alpha "
                 "0.500249999979, masked position alpha 0: ok")
    # FP4 with E4M3 scale
    x = torch.zeros(2, 16, dtype=F64)
    x[0, :4] = torch.tensor([3.0, 1.1, -0.26, 0.0])  # amax 3: s = e4m3(0.5) = 0.5
    x[1, 0] = 6.0 * 0.59  # r = 0.59 -> e4m3 0.5625 (grid step 1/16 in [0.5, 1)); 3.54 / 0.5625 = 6.29 clamps to 6
    y = fp4_e4m3_sim(x)
    assert y[0, :4].tolist() == [3.0, 1.0, -0.25, 0.0], y[0, :4]
    assert y[1, 0].item() == 6.0 * 0.5625 and (y[1, 1:] == 0).all()
    assert (fp4_e4m3_sim(torch.zeros(1, 16, dtype=F64)) == 0).all()
    rng = np.random.default_rng(3)
    z = torch.from_numpy(rng.standard_normal((50, 64)) * np.exp(rng.standard_normal((50, 1)) * 2))
    yz = fp4_e4m3_sim(z)
    zb = z.reshape(-1, 16).numpy()
    sb = dr.e4m3_decode(dr.e4m3_encode(np.maximum(np.abs(zb).max(-1, keepdims=True), LATENT_SCALE_FLOOR) / 6))
    assert np.isin(np.abs(yz.reshape(-1, 16).numpy() / sb), E2M1_POS).all(), "fp4_e4m3_sim off the grid"
    lines.append("fp4 with e4m3 scales (groups of 16): hand cases, zero group, values on the code grid: ok")
    # token-class port
    assert class_key("Hello") == "hello" and class_key("\uff10") == "0" and class_key("\t") == " " and \
        class_key(" a\t\tB ") == "a b" and class_key("Héllo") == "hello"
    assert byte_level_decode(byte_level_encode("a \u00e9\uff10")) == "a \u00e9\uff10"
    lines.append("token-class normaliser port and byte-level codec: ok")
    if verbose:
        for ln in lines:
            print("selftest:", ln)
    return lines


def causal_check(model, tokens, cuts, tol=1e-12):
    full = model.forward(tokens)
    out = []
    for k in cuts:
        d = (model.forward(tokens[:k]) - full[:k]).abs().max().item()
        out.append((k, d))
        if not d <= tol:
            raise AssertionError(f"causal check: prefix {k} differs by {d:.3e}")
    return out


def model_selftest(model_dir):
    m = DeepSeekV41Ref(model_dir)
    with open(os.path.join(model_dir, "tokens.json")) as f:
        seqs = json.load(f)
    s = max(seqs, key=len)
    c = m.cfg
    T = len(s)
    cuts = sorted({k for k in (1, 2, 3, 4, 5, c.sliding_window, c.sliding_window + 1, 13, T // 2, T - 1)
                   if 1 <= k < T})
    res = causal_check(m, s, cuts)
    print(f"selftest: causal prefix check on a {T}-token sequence, prefixes {cuts}: max diff "
          f"{max(d for _, d in res):.1e}: ok")
    full = m.forward(s)
    for P in (1, (T + 1) // 2):
        dec = m.decode(s, P, "fixed")
        d = (dec - full).abs().max().item()
        assert d < 1e-10, f"decode(fixed, prefill {P}) differs from the prefill by {d:.3e}"
        sh = m.decode(s, P, "as_shipped")
        rows = int(((sh - full).abs().max(-1).values > 1e-10).sum())
        print(f"selftest: decode (prefill {P}, {T - P} steps) 'fixed' = prefill (max diff {d:.1e}): ok; "
              f"'as_shipped' differs in {rows} of {T} rows (max {(sh - full).abs().max().item():.2e})")


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def main(argv):
    torch.set_num_threads(1)
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    if argv[1] == "--selftest":
        v4.codec_selftest(verbose=False)
        engram_selftest()
        if len(argv) > 2:
            model_selftest(argv[2])
        return 0
    d = argv[1]
    qat = "--no-qat" not in argv
    ref = DeepSeekV41Ref(d, qat=qat)
    with open(os.path.join(d, "tokens.json")) as f:
        seqs = json.load(f)
    if "--decode" in argv:
        mode = argv[argv.index("--decode") + 1]
        P = int(argv[argv.index("--prefill") + 1]) if "--prefill" in argv else 1
        for i, s in enumerate(seqs):
            lg = ref.decode(s, P, mode)
            full = ref.forward(s)
            print(f"seq {i}: len {len(s)}, decode {mode} after a prefill of {min(P, len(s))}: max |decode - prefill| "
                  f"{(lg - full).abs().max().item():.3e}")
        return 0
    sfx = "" if qat else "_noqat"
    exp, meta = None, {}
    if "--check" in argv:
        exp, meta = read_safetensors_raw(os.path.join(d, "expected.safetensors"))
    worst = 0.0
    for i, s in enumerate(seqs):
        lg = ref.forward(s)
        line = f"seq {i}: len {len(s)}, logits std {lg.std().item() if lg.numel() > 1 else 0:.3f} " \
               f"max|.| {lg.abs().max().item():.3f}"
        if exp is not None:
            diff = (lg - raw_to_f64(*exp[f"logits{sfx}.{i}"])).abs().max().item()
            line += f", max |ref - expected| {diff:.3e}"
            if qat and f"decode_shipped.{i}" in exp:
                P = int(meta[f"decode_prefill.{i}"])
                dd = (ref.decode(s, P, "as_shipped") - raw_to_f64(*exp[f"decode_shipped.{i}"])).abs().max().item()
                line += f", decode_shipped (prefill {P}) {dd:.3e}"
                diff = max(diff, dd)
            worst = max(worst, diff)
        print(line)
    if exp is not None:
        ok = worst < 1e-5
        print("OK" if ok else "MISMATCH", f"(max diff {worst:.3e}; expected holds float32-rounded values)")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
