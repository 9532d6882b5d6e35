#!/usr/bin/python3
"""Independent float64 reference of the DeepSeek-V4 (Flash / Pro) forward pass.

Written from the semantics of DeepSeek's official V4 inference code; where Hugging Face's port or
MaxText differ, or a point is open, the official code's reading is taken (tests/reference/README.md
lists every such choice). It reads a DeepSeek-V4 model folder
(config.json with model_type "deepseek_v4", safetensors with the upstream tensor names) and
computes, for one token sequence at positions 0..T-1, the logits of every position in float64:

  embedding -> hc_mult identical residual streams -> per layer: hc_pre, attention (sliding window
  plus, for compress ratio 4, compressed entries chosen by the lightning indexer, or, for any other
  nonzero ratio, every visible compressed entry), hc_post, hc_pre, MoE, hc_post -> hc_head -> norm
  -> head. With with_mtp, also the MTP block's logits (row t: the main streams of token t and the
  embedding of token t+1, predicting token t+2).

Stored values are widened exactly: BF16/F32 as is, F8_E4M3 weights times their E8M0 (or F32)
128x128 block scale, packed FP4 E2M1 experts times their E8M0 scale per 32 inputs. The only
roundings simulated are the ones the official code applies on purpose inside attention (qat=True,
the default): FP8 e4m3 rounding of the non-rope dims of every K=V vector (window and compressed
entries, blocks of 64, power-of-two scales), and for the indexer an orthonormal Hadamard rotation
followed by FP4 e2m1 rounding (blocks of 32, power-of-two scales) of its queries and keys.
qat=False (--no-qat) drops those two roundings (Hugging Face's behaviour). Activation quantization
into the FP8/FP4 GEMMs and bf16 storage of intermediates are not simulated.

Only torch and numpy (Debian's python3-torch / python3-numpy) are used. The safetensors reader and
writer, the e4m3 codec, bf16 rounding, RoPE on interleaved pairs, RMSNorm, the Sylvester Hadamard
matrix and the YaRN ramp come from deepseek_ref.py; the E2M1 and E8M0 codecs are defined here.

Command line (run with /usr/bin/python3):
  deepseek_v4_ref.py MODEL_DIR [--check] [--no-qat]
      reads MODEL_DIR/tokens.json (a JSON array of token-id arrays), prints a line per sequence and,
      with --check, compares with MODEL_DIR/expected.safetensors (float32 `logits.{i}` [T, V] and,
      when present, `mtp_logits.{i}` [T-1, V]).
  deepseek_v4_ref.py --selftest [MODEL_DIR]
      codec / Sinkhorn / RoPE / Hadamard self-checks; with MODEL_DIR also the causal prefix check
      on the longest sequence of its tokens.json.
"""

import json
import math
import os
import sys
import types

import numpy as np
import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref as dr  # noqa: E402
from deepseek_ref import (E4M3_MAX, apply_rope, e4m3_decode, e4m3_encode, hadamard, linear,  # noqa: E402
                          pow2_ceil, raw_to_f64, read_model_tensors, read_safetensors_raw, rms_norm, silu)

F64 = torch.float64

# deepseek_ref's safetensors reader/writer know the dtypes by this table; V4 adds the E8M0 scale dtype
# (one byte per value). Extending the table (not copying the reader) lets both handle it.
dr._ITEMSIZE.setdefault("F8_E8M0", 1)

FP8_SIM_BLOCK = 64  # K=V latent: FP8 simulation block along the non-rope dims
FP4_BLOCK = 32  # FP4 weights: one E8M0 scale per 32 inputs; FP4 simulation block
FP4_MAX = 6.0

# ---------------------------------------------------------------------------
# E2M1 (FP4) and E8M0 codecs
# ---------------------------------------------------------------------------

E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0..7
E2M1_TABLE = np.concatenate([E2M1_POS, -E2M1_POS])  # codes 8..15: sign bit set (code 8 is -0.0)


def e2m1_decode(codes):
    return E2M1_TABLE[np.asarray(codes, dtype=np.uint8) & 0x0F]


def e2m1_encode(x):
    """float array -> uint8 E2M1 codes (0..15); round to nearest, ties to the even code, saturating at +-6.
    The sign bit follows the input's sign (so -0.0 and small negatives give code 8)."""
    return dr.encode_nearest_even(x, E2M1_POS, 8, "e2m1_encode")


def fp4_unpack(packed):
    """uint8 [..., n/2] -> codes [..., n]: element 2j in the low nibble, 2j+1 in the high nibble."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


def fp4_pack(codes):
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2 or (c > 15).any():
        raise ValueError("fp4_pack: need an even count of 4-bit codes")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def e8m0_decode(b):
    """uint8 -> float64 2^(b-127); 0xFF is NaN."""
    b = np.asarray(b, dtype=np.uint8)
    v = np.ldexp(1.0, b.astype(np.int64) - 127)
    return np.where(b == 0xFF, np.nan, v)


def e8m0_encode(p):
    """exact powers of two 2^-127 .. 2^127 -> uint8 biased exponents."""
    p = np.asarray(p, dtype=np.float64)
    m, e = np.frexp(p)
    if not ((m == 0.5) & (e - 1 >= -127) & (e - 1 <= 127)).all():
        raise ValueError("e8m0_encode: not a power of two in range")
    return (e - 1 + 127).astype(np.uint8)


_pow2_ceil = np.vectorize(pow2_ceil, otypes=[np.float64])


def _pow2_margin(r):
    """relative distance of r > 0 from the nearest power of two (where 2^ceil(log2 r) jumps)."""
    m, _ = np.frexp(r)  # r = m 2^e, 0.5 <= m < 1
    return np.minimum(m / 0.5 - 1.0, 1.0 - m)


def _block_sim(x, block, maxc, floor, pow2, grid, encode, decode, stats, tag, flip):
    """Shared body of fp8_sim / fp4_sim. flip (a float or None): deliberately take the other rounding for every
    value within flip code spacings of a rounding midpoint (2|x - mid| / spacing < flip), and the other
    power-of-two scale for every block whose amax/maxc lies within a relative flip of a power of two: the
    choices an engine with slightly different arithmetic could make (used to measure how sensitive logits are)."""
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"{tag}: last dim {d} is not a multiple of {block}")
    v = x.reshape(-1, block).numpy()
    amax = np.maximum(np.abs(v).max(-1, keepdims=True), floor)
    r = amax / maxc
    scale = _pow2_ceil(r) if pow2 else r
    if flip and pow2:
        m, _ = np.frexp(r)
        scale = np.where((m > 0.5) & (m / 0.5 - 1.0 < flip), scale / 2, np.where(1.0 - m < flip, scale * 2, scale))
    y = np.clip(v / scale, -maxc, maxc)
    out = decode(encode(y))
    a = np.abs(y)
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, len(grid) - 1)
    tie = np.abs((a - grid[hi - 1]) - (grid[hi] - a)) / (grid[hi] - grid[hi - 1])
    if flip:
        other = np.where(np.abs(out) == grid[hi], grid[hi - 1], grid[hi])
        out = np.where(tie < flip, np.where(np.signbit(y), -other, other), out)
    if stats is not None and v.size:
        stats.append({"kind": tag, "count": v.size, "tie": float(tie.min()), "near": int((tie < 1e-4).sum()),
                      "near_flip": int((tie < flip).sum()) if flip else 0,
                      "scale": float(_pow2_margin(r).min()) if pow2 else 1.0})
    return torch.from_numpy(out * scale).reshape(x.shape)


def fp8_sim(x, block, scale_fmt, stats=None, tag="fp8", flip=None):
    """Quantize-dequantize along the last dim in blocks of `block`: amax = max(max|v|, 1e-4),
    scale = amax/448, rounded up to a power of two when scale_fmt is "ue8m0", value =
    e4m3(clamp(v/scale, +-448)) * scale, e4m3 rounding to nearest even. x: float64 torch tensor."""
    return _block_sim(x, block, E4M3_MAX, 1e-4, scale_fmt == "ue8m0", dr._E4M3_POS, e4m3_encode, e4m3_decode,
                      stats, tag, flip)


def fp4_sim(x, block, stats=None, tag="fp4", flip=None):
    """Quantize-dequantize along the last dim in blocks of `block`: amax = max(max|v|, 6 * 2^-126),
    scale = 2^ceil(log2(amax / 6)), value = e2m1(clamp(v/scale, +-6)) * scale, rounding to nearest even."""
    return _block_sim(x, block, FP4_MAX, FP4_MAX * 2.0 ** -126, True, E2M1_POS, e2m1_encode, e2m1_decode,
                      stats, tag, flip)


# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------


class V4Config:
    """The config.json fields of a V4 hub folder (hub names)."""

    def __init__(self, j):
        self.raw = j
        if j.get("model_type") != "deepseek_v4":
            raise ValueError(f"model_type {j.get('model_type')!r} is not deepseek_v4")

        def g(k, d):
            v = j.get(k, d)
            return d if v is None else v

        self.vocab_size = j["vocab_size"]
        self.hidden_size = j["hidden_size"]
        self.num_hidden_layers = j["num_hidden_layers"]
        self.num_attention_heads = j["num_attention_heads"]
        self.head_dim = j["head_dim"]
        self.rope_dim = j["qk_rope_head_dim"]
        self.nope_dim = self.head_dim - self.rope_dim
        self.q_lora_rank = j["q_lora_rank"]
        self.o_groups = j["o_groups"]
        self.o_lora_rank = j["o_lora_rank"]
        self.sliding_window = j["sliding_window"]
        self.rope_theta = float(g("rope_theta", 10000.0))
        self.rope_scaling = j.get("rope_scaling")
        self.n_routed_experts = j["n_routed_experts"]
        self.n_shared_experts = g("n_shared_experts", 1)
        self.num_experts_per_tok = j["num_experts_per_tok"]
        self.moe_intermediate_size = j["moe_intermediate_size"]
        self.scoring_func = g("scoring_func", "sqrtsoftplus")
        self.routed_scaling_factor = float(g("routed_scaling_factor", 1.0))
        self.num_hash_layers = g("num_hash_layers", 0)
        self.swiglu_limit = float(g("swiglu_limit", 0.0))
        self.index_n_heads = g("index_n_heads", 0)
        self.index_head_dim = g("index_head_dim", 0)
        self.index_topk = g("index_topk", 0)
        self.hc_mult = j["hc_mult"]
        self.hc_sinkhorn_iters = j["hc_sinkhorn_iters"]
        self.hc_eps = float(j["hc_eps"])
        self.rms_norm_eps = float(g("rms_norm_eps", 1e-6))
        self.num_nextn_predict_layers = g("num_nextn_predict_layers", 0)
        self.tie_word_embeddings = g("tie_word_embeddings", False)
        q = j.get("quantization_config") or {}
        self.fp8_block = tuple(q.get("weight_block_size", [128, 128]))
        # Scale format of the in-attention FP8 simulation: quantization_config.scale_fmt, else a top-level
        # scale_fmt, else "ue8m0" (the shipped value and the official power-of-two rule). None/"" would mean amax/448.
        sf = q.get("scale_fmt", j.get("scale_fmt", "ue8m0"))
        if sf not in (None, "", "ue8m0"):
            raise ValueError(f"scale_fmt {sf!r} not supported")
        self.scale_fmt = sf or None

        cr = j.get("compress_ratios")
        if cr is None:  # HF-only configs: layer_types (+ compress_rates)
            rates = j.get("compress_rates") or {}
            kinds = {"sliding_attention": 0,
                     "compressed_sparse_attention": rates.get("compressed_sparse_attention", 4),
                     "heavily_compressed_attention": rates.get("heavily_compressed_attention", 128)}
            cr = [kinds[t] for t in j["layer_types"]]
        self.compress_ratios = [int(m) for m in cr]
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ValueError("compress_ratios has fewer entries than num_hidden_layers")
        any_comp = any(self.compress_ratios[:self.num_hidden_layers])
        self.compress_rope_theta = float(j["compress_rope_theta"]) if any_comp else None

        D, R = self.head_dim, self.rope_dim
        if R % 2 or R > D:
            raise ValueError("qk_rope_head_dim must be even and at most head_dim")
        if self.nope_dim % FP8_SIM_BLOCK:
            raise ValueError(f"head_dim - qk_rope_head_dim = {self.nope_dim} must be a multiple of {FP8_SIM_BLOCK} "
                             "(FP8 simulation blocks of the K=V latent)")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("num_attention_heads must be a multiple of o_groups")
        if self.n_shared_experts not in (0, 1):
            raise ValueError("n_shared_experts must be 0 or 1 (the official code asserts 1)")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"scoring_func {self.scoring_func!r}")
        if 4 in self.compress_ratios[:self.num_hidden_layers]:
            Di = self.index_head_dim
            if not self.index_n_heads or Di <= 0 or Di & (Di - 1) or Di % FP4_BLOCK or R > Di or self.index_topk <= 0:
                raise ValueError("CSA layers need index_n_heads > 0, index_head_dim a power of two, a multiple of "
                                 f"{FP4_BLOCK} and >= qk_rope_head_dim, and index_topk > 0")
        if self.rope_scaling:
            typ = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if typ != "yarn":
                raise ValueError(f"rope_scaling type {typ!r} not supported")

    def mtp_ratio(self, k):
        i = self.num_hidden_layers + k
        return self.compress_ratios[i] if i < len(self.compress_ratios) else 0


def rope_freqs(R, theta, yarn):
    """float64 [R/2]: f_i = theta^(-2i/R); with yarn, blended by the YaRN ramp over the rope dim R
   ."""
    i = torch.arange(R // 2, dtype=F64)
    f = theta ** (-2.0 * i / R)
    if not yarn:
        return f
    factor = float(yarn["factor"])
    orig = float(yarn["original_max_position_embeddings"])
    low, high = dr.Config.yarn_range(types.SimpleNamespace(rope_theta=theta), R, orig,
                                     float(yarn.get("beta_fast", 32.0)), float(yarn.get("beta_slow", 1.0)))
    smooth = dr.Config.yarn_smooth(R, low, high)  # 1 - ramp
    return f / factor * (1.0 - smooth) + f * smooth


# ---------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------


def _scale_values(name, dt, shape, data):
    if dt == "F8_E8M0":
        s = e8m0_decode(np.frombuffer(data, dtype=np.uint8)).reshape(shape)
        if np.isnan(s).any():
            raise ValueError(f"{name}: E8M0 NaN (0xFF) scale")
        return torch.from_numpy(s)
    if dt in ("F32", "BF16", "F64", "F16"):
        return raw_to_f64(dt, shape, data)
    raise ValueError(f"{name}: unsupported scale dtype {dt}")


def load_v4_dir(model_dir):
    """-> (V4Config, {name: float64 tensor}, {name: int64 tensor}); FP8 / FP4 weights dequantized exactly.
    A leading `model.` is stripped; `weight_scale_inv` is accepted for `scale` and `e_score_correction_bias`
    for `gate.bias`."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = V4Config(json.load(f))
    raw = {}
    for k, v in read_model_tensors(model_dir).items():
        kk = k[len("model."):] if k.startswith("model.") else k
        if kk in raw:
            raise ValueError(f"tensor {kk} appears twice")
        raw[kk] = v
    br, bc = cfg.fp8_block
    w, ints, used_scales = {}, {}, set()
    for name, (dt, shape, data) in raw.items():
        if name.endswith(".scale") or name.endswith("_scale_inv"):
            continue
        if name.endswith("e_score_correction_bias"):
            out_name = name[:-len("e_score_correction_bias")] + "bias"
        else:
            out_name = name
        sname = None
        if name.endswith(".weight"):
            for cand in (name[:-len("weight")] + "scale", name + "_scale_inv"):
                if cand in raw:
                    sname = cand
        if dt in ("I64", "I32") or (dt in ("I8", "U8") and sname is None):
            np_dt = {"I64": "<i8", "I32": "<i4", "I8": "i1", "U8": "u1"}[dt]
            ints[out_name] = torch.from_numpy(np.frombuffer(data, dtype=np_dt).astype(np.int64).reshape(shape))
            continue
        if dt == "F8_E4M3":
            if sname is None:
                raise ValueError(f"fp8 tensor {name} has no scale")
            sdt, sshape, sdata = raw[sname]
            out, inn = shape
            want = [-(-out // br), -(-inn // bc)]
            if list(sshape) != want:
                raise ValueError(f"{sname}: expected shape {want}, got {sshape}")
            s = _scale_values(sname, sdt, sshape, sdata)
            s = s.repeat_interleave(br, 0)[:out].repeat_interleave(bc, 1)[:, :inn]
            t = raw_to_f64(dt, shape, data) * s  # exact: e4m3 times a power of two (or an f32 scale)
            used_scales.add(sname)
        elif dt in ("I8", "U8"):  # packed FP4 E2M1, two per byte, E8M0 scale per 32 inputs
            sdt, sshape, sdata = raw[sname]
            out, half = shape
            inn = 2 * half
            if inn % FP4_BLOCK or list(sshape) != [out, inn // FP4_BLOCK]:
                raise ValueError(f"{sname}: expected shape {[out, inn // FP4_BLOCK]} for fp4 {name} {shape}")
            codes = fp4_unpack(np.frombuffer(data, dtype=np.uint8).reshape(out, half))
            s = _scale_values(sname, sdt, sshape, sdata).repeat_interleave(FP4_BLOCK, 1)
            t = torch.from_numpy(e2m1_decode(codes)) * s
            used_scales.add(sname)
        else:
            t = raw_to_f64(dt, shape, data)
            if sname is not None:
                raise ValueError(f"{name} ({dt}) has a scale tensor {sname}")
        if torch.isnan(t).any():
            raise ValueError(f"{name} holds NaN")
        w[out_name] = t
    orphans = [k for k in raw if (k.endswith(".scale") or k.endswith("_scale_inv")) and k not in used_scales]
    if orphans:
        raise ValueError(f"scale tensors without a quantized weight: {orphans[:5]}")
    return cfg, w, ints


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def softplus(x):
    """exact softplus (torch's has a threshold at 20)."""
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs()))


def sinkhorn(M, iters, eps):
    """The official hc_split_sinkhorn: row softmax + eps, column normalization, then
    (iters - 1) times row then column normalization, each dividing by (sum + eps). M [..., n, n]."""
    M = torch.softmax(M, dim=-1) + eps
    M = M / (M.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        M = M / (M.sum(-1, keepdim=True) + eps)
        M = M / (M.sum(-2, keepdim=True) + eps)
    return M


def rope_tail(x, pos, freqs):
    """Rotate the last 2*len(freqs) dims of x [T, ..., d] (interleaved pairs) at positions pos [T]."""
    R = 2 * freqs.shape[0]
    return torch.cat([x[..., :x.shape[-1] - R], apply_rope(x[..., x.shape[-1] - R:], pos, freqs)], -1)


class DeepSeekV4Ref:
    def __init__(self, model_dir, qat=True):
        self.cfg, self.w, self.ints = load_v4_dir(model_dir)
        self.qat = qat
        c = self.cfg
        self.freqs_swa = rope_freqs(c.rope_dim, c.rope_theta, None)
        self.freqs_comp = (rope_freqs(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
                           if c.compress_rope_theta is not None else None)
        if c.index_head_dim:
            self.had = hadamard(c.index_head_dim) * c.index_head_dim ** -0.5
        self.trace = None  # set to {} to collect routing / indexer / quantization / Sinkhorn records
        # flip: None, or a margin; the FP8/FP4 simulations then round the other way every value (and scale) that
        # close to a rounding boundary (fixture sensitivity checks; see _block_sim)
        self.flip = None

    def W(self, name):
        if name not in self.w:
            raise KeyError(f"checkpoint lacks {name}")
        return self.w[name]

    def _tr(self, key, rec):
        if self.trace is not None:
            self.trace.setdefault(key, []).append(rec)

    def _qstats(self):
        return self.trace.setdefault("quant", []) if self.trace is not None else None

    def _fp8(self, x, tag):
        return fp8_sim(x, FP8_SIM_BLOCK, self.cfg.scale_fmt, self._qstats(), "fp8 " + tag, self.flip)

    def _fp4(self, x, tag):
        return fp4_sim(x, FP4_BLOCK, self._qstats(), "fp4 " + tag, self.flip)

    # --- mHC ------------------------------------------------------------------
    def _mix(self, X, fn):
        T = X.shape[0]
        v = X.reshape(T, -1)
        return linear(v, fn) * torch.rsqrt((v * v).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)

    def hc_pre(self, X, p):
        """X [T, n, d] -> (a [T, d], post [T, n], comb [T, n, n]); p = "...hc_attn_" or "...hc_ffn_"."""
        c = self.cfg
        n = c.hc_mult
        mix = self._mix(X, self.W(p + "fn"))
        sc, base = self.W(p + "scale"), self.W(p + "base")
        pre = torch.sigmoid(mix[:, :n] * sc[0] + base[:n]) + c.hc_eps
        post = 2.0 * torch.sigmoid(mix[:, n:2 * n] * sc[1] + base[n:2 * n])
        comb = sinkhorn((mix[:, 2 * n:] * sc[2] + base[2 * n:]).reshape(-1, n, n), c.hc_sinkhorn_iters, c.hc_eps)
        self._tr("comb", comb)
        return (pre[:, :, None] * X).sum(1), post, comb

    @staticmethod
    def hc_post(o, X, post, comb):
        """X'_k = post_k o + sum_j comb[j, k] X_j (sum over the first index)."""
        return post[:, :, None] * o[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, X)

    def hc_head(self, X, p):
        """Final contraction (no Sinkhorn, no post): y = sum_j (sigmoid(mix_j * scale + base_j) + eps) X_j."""
        mix = self._mix(X, self.W(p + "fn"))
        pre = torch.sigmoid(mix * self.W(p + "scale")[0] + self.W(p + "base")) + self.cfg.hc_eps
        return (pre[:, :, None] * X).sum(1)

    # --- attention ------------------------------------------------------------
    def compressor(self, p, a, m, Dc, rotate, freqs):
        """Gated pooling. a [T, d] (the normed attention input) -> entries [T // m, Dc];
        entry b pools window b (tokens bm .. bm+m-1) and, for m == 4, the previous window's first halves."""
        c = self.cfg
        T = a.shape[0]
        nb = T // m
        overlap = m == 4
        cD = (2 if overlap else 1) * Dc
        if nb == 0:
            return torch.zeros(0, Dc, dtype=F64)
        P = linear(a[:nb * m], self.W(p + "wkv.weight")).reshape(nb, m, cD)
        Z = linear(a[:nb * m], self.W(p + "wgate.weight")).reshape(nb, m, cD) + self.W(p + "ape")[None]
        if overlap:
            Pa = torch.zeros(nb, m, Dc, dtype=F64)
            Za = torch.full((nb, m, Dc), float("-inf"), dtype=F64)
            Pa[1:], Za[1:] = P[:-1, :, :Dc], Z[:-1, :, :Dc]  # previous window, first halves
            P = torch.cat([Pa, P[:, :, Dc:]], 1)  # [nb, 2m, Dc]
            Z = torch.cat([Za, Z[:, :, Dc:]], 1)
        C = (torch.softmax(Z, dim=1) * P).sum(1)
        C = rms_norm(C, self.W(p + "norm.weight"), c.rms_norm_eps)
        C = rope_tail(C, torch.arange(nb, dtype=F64) * m, freqs)
        if rotate:  # indexer keys: orthonormal Hadamard, then FP4 simulation
            C = C @ self.had.t()
            if self.qat:
                C = self._fp4(C, "index k")
        elif self.qat:
            N = Dc - c.rope_dim
            C = torch.cat([self._fp8(C[:, :N], "comp kv"), C[:, N:]], 1)
        return C

    def indexer(self, p, a, qr, pos, freqs, layer):
        """Lightning indexer -> bool [T, T // 4]: the compressed entries query t attends."""
        c = self.cfg
        T = a.shape[0]
        Hi, Di, K = c.index_n_heads, c.index_head_dim, c.index_topk
        q = linear(qr, self.W(p + "wq_b.weight")).reshape(T, Hi, Di)
        q = rope_tail(q, pos, freqs) @ self.had.t()
        if self.qat:
            q = self._fp4(q, "index q")
        k = self.compressor(p + "compressor.", a, 4, Di, True, freqs)
        wts = linear(a, self.W(p + "weights_proj.weight")) * (Di ** -0.5 * Hi ** -0.5)
        score = torch.einsum("th,ths->ts", wts, torch.relu(torch.einsum("thd,sd->ths", q, k)))
        nb = k.shape[0]
        visible = torch.arange(nb)[None, :] < ((torch.arange(T) + 1) // 4)[:, None]
        score = score.masked_fill(~visible, float("-inf"))
        order = np.argsort(-score.numpy(), axis=-1, kind="stable")  # ties -> lower index
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(nb)[None, :].repeat(T, 0), axis=-1)
        sel = visible & torch.from_numpy(rank < K)
        self._tr("index", {"layer": layer, "score": score, "selected": sel, "order": order})
        return sel

    def attention(self, p, a, pos, m, layer):
        """a [T, d] (normed) -> [T, d]."""
        c = self.cfg
        T = a.shape[0]
        H, D, N = c.num_attention_heads, c.head_dim, c.nope_dim
        freqs = self.freqs_comp if m else self.freqs_swa
        qr = rms_norm(linear(a, self.W(p + "wq_a.weight")), self.W(p + "q_norm.weight"), c.rms_norm_eps)
        q = linear(qr, self.W(p + "wq_b.weight")).reshape(T, H, D)
        q = q * torch.rsqrt((q * q).mean(-1, keepdim=True) + c.rms_norm_eps)  # per-head, no weight
        q = rope_tail(q, pos, freqs)
        kv = rms_norm(linear(a, self.W(p + "wkv.weight")), self.W(p + "kv_norm.weight"), c.rms_norm_eps)
        kv = rope_tail(kv, pos, freqs)
        if self.qat:
            kv = torch.cat([self._fp8(kv[:, :N], "kv"), kv[:, N:]], 1)
        t = torch.arange(T)
        allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - c.sliding_window)  # [T, T] window
        keys = kv
        if m:
            C = self.compressor(p + "compressor.", a, m, D, False, freqs)
            if m == 4:
                sel = self.indexer(p + "indexer.", a, qr, pos, freqs, layer)
            else:
                sel = torch.arange(C.shape[0])[None, :] < ((t + 1) // m)[:, None]
            keys = torch.cat([kv, C], 0)
            allowed = torch.cat([allowed, sel], 1)
        s = torch.einsum("thd,sd->ths", q, keys) * D ** -0.5
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        sink = self.W(p + "attn_sink")[None, :].expand(T, H)
        mx = torch.maximum(s.max(-1).values, sink)
        e = torch.exp(s - mx[..., None])
        pr = e / (e.sum(-1) + torch.exp(sink - mx))[..., None]  # the sink only enlarges the denominator
        o = torch.einsum("ths,sd->thd", pr, keys)
        o = rope_tail(o, -pos, freqs)  # un-rotate the rope dims at -t
        g, r = c.o_groups, c.o_lora_rank
        wa = self.W(p + "wo_a.weight").reshape(g, r, H * D // g)
        z = torch.einsum("tgi,gri->tgr", o.reshape(T, g, H * D // g), wa)
        return linear(z.reshape(T, g * r), self.W(p + "wo_b.weight"))

    # --- MoE ------------------------------------------------------------------
    def swiglu(self, p, x):
        L = self.cfg.swiglu_limit
        gate = linear(x, self.W(p + "w1.weight"))
        up = linear(x, self.W(p + "w3.weight"))
        if L > 0:
            gate = torch.clamp(gate, max=L)
            up = torch.clamp(up, min=-L, max=L)
        return linear(silu(gate) * up, self.W(p + "w2.weight"))

    def moe(self, p, x, ids, hashed, layer):
        c = self.cfg
        K = c.num_experts_per_tok
        logits = linear(x, self.W(p + "gate.weight"))
        if c.scoring_func == "sqrtsoftplus":
            s = torch.sqrt(softplus(logits))
        elif c.scoring_func == "sigmoid":
            s = torch.sigmoid(logits)
        else:
            s = torch.softmax(logits, dim=-1)
        if hashed:
            idx = self.ints[p + "gate.tid2eid"][ids]
            if idx.shape[1] != K or (idx < 0).any() or (idx >= c.n_routed_experts).any():
                raise ValueError(f"{p}gate.tid2eid: bad shape or expert index")
        else:
            choice = s + self.W(p + "gate.bias") if (p + "gate.bias") in self.w else s
            order = np.argsort(-choice.numpy(), axis=-1, kind="stable")  # ties -> lower index
            idx = torch.from_numpy(order[:, :K].copy())
            self._tr("route", {"layer": layer, "choice": choice, "order": order})
        wts = s.gather(1, idx)
        if c.scoring_func != "softmax":
            wts = wts / wts.sum(-1, keepdim=True)
        wts = wts * c.routed_scaling_factor
        out = torch.zeros_like(x)
        for e in range(c.n_routed_experts):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, wts[rows, slot, None] * self.swiglu(f"{p}experts.{e}.", x[rows]))
        if c.n_shared_experts:
            out = out + self.swiglu(p + "shared_experts.", x)
        return out

    # --- blocks and forward ---------------------------------------------------
    def block(self, p, X, ids, pos, m, hashed, layer):
        eps = self.cfg.rms_norm_eps
        a, post, comb = self.hc_pre(X, p + "hc_attn_")
        o = self.attention(p + "attn.", rms_norm(a, self.W(p + "attn_norm.weight"), eps), pos, m, layer)
        X = self.hc_post(o, X, post, comb)
        a, post, comb = self.hc_pre(X, p + "hc_ffn_")
        y = self.moe(p + "ffn.", rms_norm(a, self.W(p + "ffn_norm.weight"), eps), ids, hashed, layer)
        return self.hc_post(y, X, post, comb)

    def head_logits(self, X, hc_prefix, norm_name):
        y = rms_norm(self.hc_head(X, hc_prefix), self.W(norm_name), self.cfg.rms_norm_eps)
        return linear(y, self.W("embed.weight" if self.cfg.tie_word_embeddings else "head.weight"))

    def has_mtp(self):
        return self.cfg.num_nextn_predict_layers > 0 and "mtp.0.e_proj.weight" in self.w

    def forward(self, tokens, with_mtp=False):
        """Full causal forward over one sequence (positions 0..T-1) -> float64 logits [T, V]; with_mtp:
        (logits, mtp_logits [T-1, V] or None when the checkpoint has no MTP layer)."""
        c = self.cfg
        ids = torch.tensor(tokens, dtype=torch.long)
        if (ids < 0).any() or (ids >= c.vocab_size).any():
            raise ValueError("token id out of range")
        T = ids.shape[0]
        pos = torch.arange(T, dtype=F64)
        X = self.W("embed.weight")[ids][:, None, :].repeat(1, c.hc_mult, 1)
        for L in range(c.num_hidden_layers):
            X = self.block(f"layers.{L}.", X, ids, pos, c.compress_ratios[L], L < c.num_hash_layers, L)
        logits = self.head_logits(X, "hc_head_", "norm.weight")
        if not with_mtp:
            return logits
        return logits, (self.mtp_forward(X, ids) if self.has_mtp() else None)

    def mtp_forward(self, X, ids):
        """MTP block 0: row t uses the main streams of token t and the embedding of token t+1."""
        c = self.cfg
        eps = c.rms_norm_eps
        T = ids.shape[0] - 1
        if T <= 0:
            return torch.zeros(0, c.vocab_size, dtype=F64)
        nxt = ids[1:]
        e = rms_norm(self.W("embed.weight")[nxt], self.W("mtp.0.enorm.weight"), eps)
        h = rms_norm(X[:T], self.W("mtp.0.hnorm.weight"), eps)  # per stream
        Xm = linear(e, self.W("mtp.0.e_proj.weight"))[:, None, :] + linear(h, self.W("mtp.0.h_proj.weight"))
        Xm = self.block("mtp.0.", Xm, nxt, torch.arange(T, dtype=F64), c.mtp_ratio(0), False, "mtp.0")
        return self.head_logits(Xm, "mtp.0.hc_head_", "mtp.0.norm.weight")


# ---------------------------------------------------------------------------
# self-checks
# ---------------------------------------------------------------------------


def codec_selftest(verbose=True):
    lines = []
    # E2M1: every code decodes to the table, encodes back (code 8 = -0.0 included).
    codes = np.arange(16, dtype=np.uint8)
    vals = e2m1_decode(codes)
    assert (vals[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]).all() and (vals[8:] == -vals[:8]).all()
    assert np.signbit(vals[8]) and not np.signbit(vals[0])
    assert (e2m1_encode(vals) == codes).all(), "e2m1 round trip"
    # every midpoint (both signs) rounds to the even code; just off it to the nearer one
    mid = (E2M1_POS[:-1] + E2M1_POS[1:]) / 2
    lo, hi = np.arange(7), np.arange(1, 8)
    even = np.where(lo % 2 == 0, lo, hi)
    assert (e2m1_encode(mid) == even).all(), "e2m1 ties to even"
    assert (e2m1_encode(-mid) == even | 8).all(), "e2m1 ties to even (negative)"
    assert (e2m1_encode(mid * (1 + 1e-12)) == hi).all() and (e2m1_encode(mid * (1 - 1e-12)) == lo).all()
    assert (e2m1_decode(e2m1_encode([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])) == [0, 1, 1, 2, 2, 4, 4]).all()
    assert (e2m1_encode([6.5, 1e9, -7.0, -1e-30, 0.1]) == [7, 7, 15, 8, 0]).all(), "e2m1 saturation / zero"
    # nibble order: element 2j low, 2j+1 high
    rng = np.random.default_rng(7)
    c = rng.integers(0, 16, size=(5, 64)).astype(np.uint8)
    pk = fp4_pack(c)
    assert pk.shape == (5, 32) and (fp4_unpack(pk) == c).all()
    assert fp4_pack(np.array([[0x3, 0xA]]))[0, 0] == 0xA3
    lines.append("fp4 e2m1: 16 codes decode/encode, 7 midpoints x 2 signs tie to even, saturation, nibble order: ok")
    # E8M0
    b = np.arange(256, dtype=np.uint8)
    v = e8m0_decode(b)
    assert np.isnan(v[255]) and v[127] == 1.0 and v[0] == 2.0 ** -127 and v[254] == 2.0 ** 127
    assert (v[:255] == np.ldexp(1.0, np.arange(255) - 127)).all()
    assert (e8m0_encode(v[:255]) == b[:255]).all(), "e8m0 round trip"
    for bad in (3.0, 0.0, 2.0 ** 128):
        try:
            e8m0_encode(np.array([bad]))
            raise AssertionError(f"e8m0_encode accepted {bad}")
        except ValueError:
            pass
    lines.append("e8m0: 255 exponents decode/encode, 0xFF NaN, non-powers refused: ok")
    # power-of-two scale rule and the quantize-dequantize simulations
    assert _pow2_ceil(np.array([1.0, 1.5, 0.75, 2.0 ** -130, 3.0 * 2.0 ** 20])).tolist() == \
        [1.0, 2.0, 1.0, 2.0 ** -130, 2.0 ** 22]
    x = torch.from_numpy(rng.standard_normal((6, 128)) * np.exp(rng.standard_normal((6, 1)) * 3))
    x[0, :64] = 0.0  # an all-zero block: amax floor, stays zero
    for name, fn, grid, top in (("fp8", lambda t: fp8_sim(t, 64, "ue8m0"), dr._E4M3_POS, E4M3_MAX),
                                ("fp4", lambda t: fp4_sim(t, 32), E2M1_POS, FP4_MAX)):
        y = fn(x)
        assert (fn(y) == y).all(), f"{name}_sim is not idempotent"
        blk = 64 if name == "fp8" else 32
        yb, xb = y.reshape(-1, blk).numpy(), x.reshape(-1, blk).numpy()
        sc = _pow2_ceil(np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-4 if name == "fp8" else 6 * 2.0 ** -126)
                        / top)
        q = yb / sc
        assert np.isin(np.abs(q), grid).all(), f"{name}_sim values off the code grid"
        assert (np.abs(q - xb / sc) <= np.diff(grid).max() / 2 + 1e-12).all()
        assert (y.reshape(-1, blk)[0] == 0).all() if name == "fp8" else True
    y = fp8_sim(x, 64, None)  # plain amax/448 scale: the block max is exactly representable (448)
    assert torch.allclose(y.reshape(-1, 64).abs().max(-1).values[1:], x.reshape(-1, 64).abs().max(-1).values[1:],
                          rtol=1e-15, atol=0)
    # flip: a value just past a midpoint goes back to the other neighbour, a scale just past a power of two halves
    z = torch.zeros(1, 32, dtype=F64)
    z[0, 0], z[0, 1], z[0, 2], z[0, 3] = 6.0, 2.5 * (1 + 1e-9), 2.75, 0.6
    assert fp4_sim(z, 32)[0, :4].tolist() == [6.0, 3.0, 3.0, 0.5]
    assert fp4_sim(z, 32, flip=1e-4)[0, :4].tolist() == [6.0, 2.0, 3.0, 0.5]
    z[0, 0] = 6.0 * (1 + 1e-9)  # amax/6 just above 1: scale 2, flipped to 1 (6.000000006 clamps to 6)
    assert fp4_sim(z, 32)[0, :4].tolist() == [6.0, 3.0, 3.0, 1.0]
    assert fp4_sim(z, 32, flip=1e-4)[0, :4].tolist() == [6.0, 2.0, 3.0, 0.5]
    z8 = torch.zeros(1, 64, dtype=F64)
    z8[0, 0], z8[0, 1] = 448.0, 17.0 * (1 - 1e-9)  # e4m3 grid at 16..32 has spacing 2: 17 is a midpoint
    assert fp8_sim(z8, 64, "ue8m0")[0, :2].tolist() == [448.0, 16.0]
    assert fp8_sim(z8, 64, "ue8m0", flip=1e-4)[0, :2].tolist() == [448.0, 18.0]
    lines.append("fp8_sim(64) / fp4_sim(32): idempotent, on the code grid, power-of-two scales, flips: ok")
    # Sinkhorn: the last step normalizes columns, so column sums are S/(S+eps) = 1 - O(eps) always; row sums
    # reach 1 - O(eps) once the iteration has converged (always for mild logits, with more iterations otherwise).
    col, row = {}, {}
    for std in (0.5, 1.0, 3.0):
        M = sinkhorn(torch.from_numpy(rng.standard_normal((2000, 4, 4)) * std), 20, 1e-6)
        assert (M > 0).all()
        col[std] = (M.sum(-2) - 1).abs().max().item()
        row[std] = (M.sum(-1) - 1).abs().max().item()
    M = sinkhorn(torch.from_numpy(rng.standard_normal((2000, 4, 4))), 1000, 1e-6)
    row_long = (M.sum(-1) - 1).abs().max().item()
    assert max(col.values()) < 2e-6, f"Sinkhorn column sums off by {col}"
    assert row[0.5] < 2e-6 and row_long < 2e-6, f"Sinkhorn row sums off by {row[0.5]} / {row_long}"
    lines.append(f"Sinkhorn (eps 1e-6, 2000 random 4x4 per logit std): 20 iters: max |colsum-1| "
                 f"{max(col.values()):.2e}; max |rowsum-1| {row[0.5]:.2e} (std 0.5), {row[1.0]:.2e} (std 1, "
                 f"not converged), {row[3.0]:.2e} (std 3, not converged); 1000 iters, std 1: {row_long:.2e}: ok")
    # RoPE tail: inverse rotation, norm preserved; YaRN ramp of the shipped config
    f = rope_freqs(64, 160000.0, {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                  "beta_fast": 32, "beta_slow": 1})
    f0 = rope_freqs(64, 160000.0, None)
    ramp = (f0 - f) / (f0 - f0 / 16)
    exp_ramp = torch.clamp((torch.arange(32, dtype=F64) - 15) / 10, 0, 1)
    assert torch.allclose(ramp, exp_ramp, rtol=0, atol=1e-12), "YaRN ramp"
    xx = torch.from_numpy(rng.standard_normal((9, 3, 80)))
    pos = torch.arange(9, dtype=F64) * 37
    yy = rope_tail(xx, pos, f)
    assert (yy[..., :16] == xx[..., :16]).all()
    assert torch.allclose(rope_tail(yy, -pos, f), xx, rtol=0, atol=1e-12)
    assert torch.allclose(yy.norm(dim=-1), xx.norm(dim=-1), rtol=1e-14, atol=0)
    # the interleaved pairs are the official complex multiply: view_as_complex over (x[2i], x[2i+1]) times e^(i t f)
    xc = torch.view_as_complex(xx[..., 16:].reshape(9, 3, 32, 2).contiguous())
    ang = pos[:, None] * f[None, :]
    want = torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)[:, None, :]).reshape(9, 3, 64)
    assert torch.allclose(yy[..., 16:], want, rtol=0, atol=1e-12), "RoPE pairs differ from the complex form"
    h = hadamard(32) * 32 ** -0.5
    assert torch.allclose(h @ h.t(), torch.eye(32, dtype=F64), rtol=0, atol=1e-15)
    lines.append("RoPE inverse/norm/complex form, YaRN ramp low 15 / high 25 for the shipped config, "
                 "orthonormal Hadamard: ok")
    if verbose:
        for ln in lines:
            print("selftest:", ln)
    return lines


def causal_check(model, tokens, cuts, tol=1e-12):
    """Logits (and MTP logits) of each prefix tokens[:k] must equal the first rows of the full sequence's.
    -> list of (k, max diff, max mtp diff)."""
    full, full_mtp = model.forward(tokens, with_mtp=True)
    out = []
    for k in cuts:
        lg, mtp = model.forward(tokens[:k], with_mtp=True)
        d = (lg - full[:k]).abs().max().item()
        dm = (mtp - full_mtp[:k - 1]).abs().max().item() if mtp is not None and k > 1 else 0.0
        out.append((k, d, dm))
        if not (d <= tol and dm <= tol):
            raise AssertionError(f"causal check: prefix {k} differs by {d:.3e} (mtp {dm:.3e})")
    return out


def naive_checks(model, T=260, seed=11):
    """Recomputes each layer's attention (window, compressor, indexer, sink, grouped output), the mHC mixing
    and the MoE of a loaded model with per-token / per-entry Python loops written straight from the official
    rules, on random normed inputs, and compares with the vectorized code. -> max abs difference."""
    c = model.cfg
    rng = np.random.default_rng(seed)
    a = torch.from_numpy(rng.standard_normal((T, c.hidden_size)))
    pos = torch.arange(T, dtype=F64)
    H, D, N, R, w = c.num_attention_heads, c.head_dim, c.nope_dim, c.rope_dim, c.sliding_window
    W, eps = model.W, c.rms_norm_eps
    worst = 0.0

    def comp_naive(p, m, Dc, rotate, freqs):
        P = linear(a, W(p + "wkv.weight"))
        Z = linear(a, W(p + "wgate.weight"))
        ape = W(p + "ape")
        rows = []
        for b in range(T // m):
            vals, gates = [], []
            if m == 4:
                if b > 0:
                    for j in range(m):
                        s = (b - 1) * m + j
                        vals.append(P[s, :Dc])
                        gates.append(Z[s, :Dc] + ape[j, :Dc])
                for j in range(m):
                    s = b * m + j
                    vals.append(P[s, Dc:])
                    gates.append(Z[s, Dc:] + ape[j, Dc:])
            else:
                for j in range(m):
                    vals.append(P[b * m + j])
                    gates.append(Z[b * m + j] + ape[j])
            out = torch.zeros(Dc, dtype=F64)
            for ch in range(Dc):
                g = [float(z[ch]) for z in gates]
                mx = max(g)
                e = [math.exp(x - mx) for x in g]
                out[ch] = sum(ei * float(v[ch]) for ei, v in zip(e, vals)) / sum(e)
            out = rms_norm(out, W(p + "norm.weight"), eps)
            out = rope_tail(out[None], torch.tensor([float(b * m)], dtype=F64), freqs)[0]
            if rotate:
                out = out @ model.had.t()
                if model.qat:
                    out = fp4_sim(out[None], FP4_BLOCK)[0]
            elif model.qat:
                out = torch.cat([fp8_sim(out[None, :Dc - R], FP8_SIM_BLOCK, c.scale_fmt)[0], out[Dc - R:]])
            rows.append(out)
        return torch.stack(rows) if rows else torch.zeros(0, Dc, dtype=F64)

    for L in range(c.num_hidden_layers):
        m = c.compress_ratios[L]
        p = f"layers.{L}.attn."
        freqs = model.freqs_comp if m else model.freqs_swa
        qr = rms_norm(linear(a, W(p + "wq_a.weight")), W(p + "q_norm.weight"), eps)
        q = linear(qr, W(p + "wq_b.weight")).reshape(T, H, D)
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps)
        q = rope_tail(q, pos, freqs)
        kv = rope_tail(rms_norm(linear(a, W(p + "wkv.weight")), W(p + "kv_norm.weight"), eps), pos, freqs)
        if model.qat:
            kv = torch.cat([fp8_sim(kv[:, :N], FP8_SIM_BLOCK, c.scale_fmt), kv[:, N:]], 1)
        C = comp_naive(p + "compressor.", m, D, False, freqs) if m else None
        if m and C.numel():
            worst = max(worst, (C - model.compressor(p + "compressor.", a, m, D, False, freqs)).abs().max().item())
        if m == 4:  # naive indexer
            Hi, Di = c.index_n_heads, c.index_head_dim
            iq = rope_tail(linear(qr, W(p + "indexer.wq_b.weight")).reshape(T, Hi, Di), pos, freqs) @ model.had.t()
            if model.qat:
                iq = fp4_sim(iq, FP4_BLOCK)
            ik = comp_naive(p + "indexer.compressor.", 4, Di, True, freqs)
            iw = linear(a, W(p + "indexer.weights_proj.weight")) / math.sqrt(Di * Hi)
        o = torch.zeros(T, H, D, dtype=F64)
        sink = W(p + "attn_sink")
        for t in range(T):
            keys = [kv[s] for s in range(max(0, t - w + 1), t + 1)]
            if m == 4:
                vis = list(range((t + 1) // 4))
                sc = {b: sum(float(iw[t, h]) * max(0.0, float(iq[t, h] @ ik[b])) for h in range(Hi)) for b in vis}
                keys += [C[b] for b in sorted(vis, key=lambda b: (-sc[b], b))[:c.index_topk]]
            elif m:
                keys += [C[b] for b in range((t + 1) // m)]
            for h in range(H):
                sc = [float(q[t, h] @ k) / math.sqrt(D) for k in keys]
                mx = max(sc + [float(sink[h])])
                den = sum(math.exp(x - mx) for x in sc) + math.exp(float(sink[h]) - mx)
                o[t, h] = sum(math.exp(x - mx) / den * k for x, k in zip(sc, keys))
        o = rope_tail(o, -pos, freqs).reshape(T, H * D)
        g, r = c.o_groups, c.o_lora_rank
        wa, gw = W(p + "wo_a.weight"), H * D // g
        z = torch.cat([o[:, i * gw:(i + 1) * gw] @ wa[i * r:(i + 1) * r].t() for i in range(g)], 1)
        ref_out = linear(z, W(p + "wo_b.weight"))
        worst = max(worst, (ref_out - model.attention(p, a, pos, m, L)).abs().max().item())

        # mHC with explicit loops (first few tokens)
        n = c.hc_mult
        X = torch.from_numpy(rng.standard_normal((4, n, c.hidden_size)))
        pp = f"layers.{L}.hc_attn_"
        got_a, got_post, got_comb = model.hc_pre(X, pp)
        fn, base, scale = W(pp + "fn"), W(pp + "base"), W(pp + "scale")
        for t in range(4):
            v = X[t].reshape(-1)
            mix = (fn @ v) / math.sqrt(float((v * v).mean()) + eps)
            pre = [1 / (1 + math.exp(-(float(mix[j]) * float(scale[0]) + float(base[j])))) + c.hc_eps for j in range(n)]
            post = [2 / (1 + math.exp(-(float(mix[n + j]) * float(scale[1]) + float(base[n + j])))) for j in range(n)]
            M = [[float(mix[2 * n + j * n + k]) * float(scale[2]) + float(base[2 * n + j * n + k]) for k in range(n)]
                 for j in range(n)]
            for j in range(n):  # row softmax + eps
                mx = max(M[j])
                e = [math.exp(x - mx) for x in M[j]]
                M[j] = [x / sum(e) + c.hc_eps for x in e]
            for it in range(c.hc_sinkhorn_iters):
                if it:
                    for j in range(n):
                        rs = sum(M[j])
                        M[j] = [x / (rs + c.hc_eps) for x in M[j]]
                for k in range(n):
                    cs = sum(M[j][k] for j in range(n))
                    for j in range(n):
                        M[j][k] /= cs + c.hc_eps
            a_t = sum(pre[j] * X[t, j] for j in range(n))
            worst = max(worst, (a_t - got_a[t]).abs().max().item(),
                        max(abs(post[j] - float(got_post[t, j])) for j in range(n)),
                        max(abs(M[j][k] - float(got_comb[t, j, k])) for j in range(n) for k in range(n)))
            ov = torch.from_numpy(rng.standard_normal(c.hidden_size))
            newX = [post[k] * ov + sum(M[j][k] * X[t, j] for j in range(n)) for k in range(n)]
            got = model.hc_post(ov[None], X[t:t + 1], got_post[t:t + 1], got_comb[t:t + 1])[0]
            worst = max(worst, max((newX[k] - got[k]).abs().max().item() for k in range(n)))

        # MoE with a per-token loop
        if c.scoring_func != "sqrtsoftplus":
            continue
        fp = f"layers.{L}.ffn."
        hashed = L < c.num_hash_layers
        ids = torch.from_numpy(rng.integers(0, c.vocab_size, size=6))
        x = torch.from_numpy(rng.standard_normal((6, c.hidden_size)))
        want = torch.zeros_like(x)
        lim = c.swiglu_limit if c.swiglu_limit > 0 else math.inf
        for t in range(6):
            lg = W(fp + "gate.weight") @ x[t]
            s = [math.sqrt(math.log1p(math.exp(float(v)))) for v in lg]
            if hashed:
                chosen = [int(e) for e in model.ints[fp + "gate.tid2eid"][ids[t]]]
            else:
                bias = W(fp + "gate.bias")
                chosen = sorted(range(c.n_routed_experts), key=lambda e: (-(s[e] + float(bias[e])), e))
                chosen = chosen[:c.num_experts_per_tok]
            tot = sum(s[e] for e in chosen)
            for e in chosen:
                ep = f"{fp}experts.{e}."
                gt = torch.clamp(W(ep + "w1.weight") @ x[t], max=lim)
                up = torch.clamp(W(ep + "w3.weight") @ x[t], -lim, lim)
                want[t] += s[e] / tot * c.routed_scaling_factor * (W(ep + "w2.weight") @ (silu(gt) * up))
            sp = fp + "shared_experts."
            gt = torch.clamp(W(sp + "w1.weight") @ x[t], max=lim)
            up = torch.clamp(W(sp + "w3.weight") @ x[t], -lim, lim)
            want[t] += W(sp + "w2.weight") @ (silu(gt) * up)
        worst = max(worst, (want - model.moe(fp, x, ids, hashed, L)).abs().max().item())
    return worst


def model_selftest(model_dir):
    m = DeepSeekV4Ref(model_dir)
    with open(os.path.join(model_dir, "tokens.json")) as f:
        seqs = json.load(f)
    s = max(seqs, key=len)
    c = m.cfg
    T = len(s)
    cuts = sorted({k for k in (1, 2, 3, 4, 5, c.sliding_window, c.sliding_window + 1, 13, T // 2, 127, 128, 129, T - 1)
                   if 1 <= k < T})
    res = causal_check(m, s, cuts)
    worst = max(max(d, dm) for _, d, dm in res)
    print(f"selftest: causal prefix check on a {T}-token sequence, prefixes {cuts}: max diff {worst:.1e} "
          f"(main and MTP logits): ok")
    for qat in (True, False):
        m.qat = qat
        d = naive_checks(m)
        assert d < 1e-11, f"loop formulation differs by {d:.3e} (qat={qat})"
        print(f"selftest: per-token loop formulation of attention/compressor/indexer/mHC/MoE vs vectorized "
              f"(qat={qat}): max diff {d:.1e}: ok")
    m.qat = True
    m.trace = {}
    m.forward(s)
    comb = torch.cat(m.trace["comb"])
    print(f"selftest: model Sinkhorn matrices ({comb.shape[0]}): max |colsum-1| "
          f"{(comb.sum(-2) - 1).abs().max().item():.2e}, max |rowsum-1| {(comb.sum(-1) - 1).abs().max().item():.2e}")


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def main(argv):
    torch.set_num_threads(1)
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    if argv[1] == "--selftest":
        codec_selftest()
        if len(argv) > 2:
            model_selftest(argv[2])
        return 0
    d = argv[1]
    qat = "--no-qat" not in argv
    ref = DeepSeekV4Ref(d, qat=qat)
    sfx = "" if qat else "_noqat"
    with open(os.path.join(d, "tokens.json")) as f:
        seqs = json.load(f)
    exp = None
    if "--check" in argv:
        exp, _ = read_safetensors_raw(os.path.join(d, "expected.safetensors"))
    worst = 0.0
    for i, s in enumerate(seqs):
        lg, mtp = ref.forward(s, with_mtp=True)
        line = f"seq {i}: len {len(s)}, logits std {lg.std().item() if lg.numel() > 1 else 0:.3f} " \
               f"max|.| {lg.abs().max().item():.3f}"
        if exp is not None:
            e = raw_to_f64(*exp[f"logits{sfx}.{i}"])
            diff = (lg - e).abs().max().item()
            if f"mtp_logits{sfx}.{i}" in exp:
                em = raw_to_f64(*exp[f"mtp_logits{sfx}.{i}"])
                diff = max(diff, (mtp - em).abs().max().item())
            worst = max(worst, diff)
            line += f", max |ref - expected| {diff:.3e}"
        print(line)
    if exp is not None:
        ok = worst < 1e-5
        print("OK" if ok else "MISMATCH", f"(max diff {worst:.3e}; expected holds float32-rounded values)")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
