#!/usr/bin/python3
"""Independent float64 reference of the DeepSeek-V2/V3/V3.2 forward pass.

Written from the math of the DeepSeek-V2/V3 papers and the semantics of
Hugging Face DeepSeek checkpoints, not from any other implementation. V3.2's
sparse attention (the lightning indexer, DSA) follows the semantics of
DeepSeek's V3.2 inference code. It reads a Hugging
Face model folder (config.json + model.safetensors, or
model.safetensors.index.json with shards) and computes logits in float64 from
the stored weights (BF16 / F8_E4M3 values are widened exactly; fp8 weights are
multiplied by their block `weight_scale_inv`).

Only torch and numpy (Debian's python3-torch / python3-numpy) are used; the
safetensors reader/writer and the e4m3 codec are implemented here.

Command line:
  /usr/bin/python3 tests/reference/deepseek_ref.py MODEL_DIR [--check]
reads MODEL_DIR/tokens.json, computes the logits and, with --check, compares
them with MODEL_DIR/expected.safetensors (prints the max abs difference).
"""

import json
import math
import os
import struct
import sys

import numpy as np
import torch

F64 = torch.float64

# ---------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "U8": 1, "I8": 1}


def read_safetensors_raw(path):
    """Returns {name: (dtype, shape, bytes)} and the __metadata__ dict."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = memoryview(blob)[8 + n:]
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        dt, shape, (b, e) = info["dtype"], list(info["shape"]), info["data_offsets"]
        if dt not in _ITEMSIZE:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dt}")
        count = 1
        for s in shape:
            count *= s
        if e - b != count * _ITEMSIZE[dt] or e > len(data):
            raise ValueError(f"{path}: tensor {name} has inconsistent data_offsets")
        out[name] = (dt, shape, bytes(data[b:e]))
    return out, meta


def write_safetensors_raw(path, tensors, metadata=None):
    """tensors: list of (name, dtype, shape, bytes). Written in that order, except that wider
    dtypes come first (stable), so every tensor's offset is a multiple of its element size."""
    tensors = sorted(tensors, key=lambda t: -_ITEMSIZE[t[1]])
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dt, shape, raw in tensors:
        count = 1
        for s in shape:
            count *= s
        assert len(raw) == count * _ITEMSIZE[dt], (name, dt, shape, len(raw))
        assert off % _ITEMSIZE[dt] == 0, (name, off)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((-len(hj)) % 8)  # data starts 8-byte aligned, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for _, _, _, raw in tensors:
            f.write(raw)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# dtype codecs
# ---------------------------------------------------------------------------


def _e4m3_table():
    t = np.zeros(256, dtype=np.float64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 0x7
        if e == 0xF and m == 0x7:
            t[b] = np.nan  # 0x7f / 0xff; e4m3fn has no infinities
        elif e == 0:
            t[b] = s * m * 2.0 ** -9  # subnormal: m/8 * 2^(1-7)
        else:
            t[b] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3_TABLE = _e4m3_table()
E4M3_MAX = 448.0
_E4M3_POS = E4M3_TABLE[:127]  # codes 0x00..0x7e, ascending 0 .. 448


def e4m3_decode(codes):
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def encode_nearest_even(x, positives, sign_bit, what):
    """float array -> uint8 codes of a small float format whose non-negative values, in code order,
    are `positives` (ascending, the last the largest finite one): round to nearest, ties to the even
    code, saturating at the largest; the sign (of -0.0 too) sets `sign_bit`."""
    x = np.asarray(x, dtype=np.float64)
    if np.isnan(x).any():
        raise ValueError(f"{what}: NaN input")
    a = np.minimum(np.abs(x), positives[-1])
    hi = np.clip(np.searchsorted(positives, a, side="left"), 1, len(positives) - 1)
    lo = hi - 1
    dlo = a - positives[lo]
    dhi = positives[hi] - a
    take_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(take_hi, hi, lo).astype(np.uint8)
    return code | np.where(np.signbit(x), sign_bit, 0).astype(np.uint8)


def e4m3_encode(x):
    """float array -> uint8 e4m3fn codes; round to nearest, ties to even, saturating at +-448."""
    return encode_nearest_even(x, _E4M3_POS, 0x80, "e4m3_encode")


def f32_to_bf16_bits(x):
    """float array -> uint16 bf16 bit patterns, round to nearest even (finite inputs)."""
    b = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f64(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def raw_to_f64(dt, shape, raw):
    """Stored bytes -> float64 torch tensor (exact widening)."""
    if dt == "F32":
        a = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    elif dt == "F64":
        a = np.frombuffer(raw, dtype="<f8").astype(np.float64)
    elif dt == "F16":
        a = np.frombuffer(raw, dtype="<f2").astype(np.float64)
    elif dt == "BF16":
        t = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16) if raw else torch.zeros(0, dtype=torch.bfloat16)
        return t.to(F64).reshape(shape)
    elif dt == "F8_E4M3":
        a = e4m3_decode(np.frombuffer(raw, dtype=np.uint8))
    else:
        raise ValueError(f"dtype {dt} is not a float dtype")
    return torch.from_numpy(a.copy()).reshape(shape)


# ---------------------------------------------------------------------------
# checkpoint folder
# ---------------------------------------------------------------------------


def read_model_tensors(model_dir):
    """{name: (dtype, shape, bytes)} over model.safetensors or the shards of the index."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wm = json.load(f)["weight_map"]
        out = {}
        for shard in sorted(set(wm.values())):
            ts, _ = read_safetensors_raw(os.path.join(model_dir, shard))
            for k, v in ts.items():
                if k in out:
                    raise ValueError(f"tensor {k} appears in two shards")
                if wm.get(k) != shard:
                    raise ValueError(f"index places {k} in {wm.get(k)}, found in {shard}")
                out[k] = v
        missing = set(wm) - set(out)
        if missing:
            raise ValueError(f"index lists tensors no shard holds: {sorted(missing)[:5]}")
        return out
    ts, _ = read_safetensors_raw(os.path.join(model_dir, "model.safetensors"))
    return ts


class Config:
    def __init__(self, j):
        self.raw = j
        mt = j["model_type"]
        if mt not in ("deepseek_v2", "deepseek_v3", "deepseek_v32"):
            raise ValueError(f"model_type {mt} not supported")
        v2 = mt == "deepseek_v2"

        def g(k, d):
            v = j.get(k, d)
            return d if v is None else v

        self.model_type = mt
        self.vocab_size = j["vocab_size"]
        self.hidden_size = j["hidden_size"]
        self.intermediate_size = j["intermediate_size"]
        self.num_hidden_layers = j["num_hidden_layers"]
        self.num_attention_heads = j["num_attention_heads"]
        self.q_lora_rank = g("q_lora_rank", 0)
        self.kv_lora_rank = j["kv_lora_rank"]
        self.qk_nope_head_dim = j["qk_nope_head_dim"]
        self.qk_rope_head_dim = j["qk_rope_head_dim"]
        self.v_head_dim = j["v_head_dim"]
        self.rope_theta = float(g("rope_theta", 10000.0))
        self.rope_scaling = j.get("rope_scaling")
        self.n_routed_experts = g("n_routed_experts", 0 if v2 else 256)
        self.moe_intermediate_size = g("moe_intermediate_size", 0)
        self.n_shared_experts = g("n_shared_experts", 0 if v2 else 1)
        self.num_experts_per_tok = g("num_experts_per_tok", 0 if v2 else 8)
        self.n_group = g("n_group", 1 if v2 else 8)
        self.topk_group = g("topk_group", 1 if v2 else 4)
        self.topk_method = g("topk_method", "greedy" if v2 else "noaux_tc")
        self.scoring_func = g("scoring_func", "softmax" if v2 else "sigmoid")
        self.norm_topk_prob = g("norm_topk_prob", not v2)
        self.routed_scaling_factor = float(g("routed_scaling_factor", 1.0 if v2 else 2.5))
        self.first_k_dense_replace = g("first_k_dense_replace", 0 if v2 else 3)
        self.moe_layer_freq = g("moe_layer_freq", 1)
        self.rms_norm_eps = float(g("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = g("tie_word_embeddings", False)
        if g("hidden_act", "silu") != "silu":
            raise ValueError("only silu")
        q = j.get("quantization_config")
        self.fp8_block = tuple(q.get("weight_block_size", [128, 128])) if q else (128, 128)
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")
        # Activation scale format of the V3.2 indexer's fp8 quantization: quantization_config.scale_fmt,
        # else a top-level scale_fmt. "ue8m0": power-of-two scales; absent/null: plain amax / 448.
        sf = q.get("scale_fmt") if q else None
        if sf is None:
            sf = j.get("scale_fmt")
        if sf not in (None, "ue8m0"):
            raise ValueError(f"scale_fmt {sf!r} not supported")
        self.scale_fmt = sf
        # V3.2 sparse attention (lightning indexer); index_n_heads absent or 0: dense attention.
        self.index_n_heads = g("index_n_heads", 0)
        self.index_head_dim = g("index_head_dim", 0)
        self.index_topk = g("index_topk", 0)
        if self.index_n_heads:
            Di = self.index_head_dim
            if not self.q_lora_rank:
                raise ValueError("the indexer needs q_lora_rank")
            if Di <= 0 or Di & (Di - 1):
                raise ValueError(f"index_head_dim {Di} must be a power of two")
            if self.qk_rope_head_dim > Di:
                raise ValueError("qk_rope_head_dim > index_head_dim")
            if self.index_topk <= 0:
                raise ValueError("index_topk must be positive")

    def is_moe_layer(self, l):
        return self.n_routed_experts > 0 and l >= self.first_k_dense_replace and l % self.moe_layer_freq == 0

    # --- RoPE / YaRN -------------------------------------------------------
    def yarn(self):
        r = self.rope_scaling
        if not r:
            return None
        typ = r.get("type", r.get("rope_type"))
        if typ != "yarn":
            raise ValueError(f"rope_scaling type {typ} not supported")
        return r

    def rope_frequencies(self):
        """float64 [d/2]: f_i = theta^(-2i/d), blended by YaRN when rope_scaling is present."""
        d = self.qk_rope_head_dim
        i = torch.arange(d // 2, dtype=F64)
        f = self.rope_theta ** (-2.0 * i / d)
        r = self.yarn()
        if r is None:
            return f
        factor = float(r["factor"])
        orig = float(r["original_max_position_embeddings"])
        beta_fast = float(r.get("beta_fast", 32.0))
        beta_slow = float(r.get("beta_slow", 1.0))
        low, high = self.yarn_range(d, orig, beta_fast, beta_slow)
        smooth = self.yarn_smooth(d, low, high)
        return f / factor * (1.0 - smooth) + f * smooth

    def yarn_range(self, d, orig, beta_fast, beta_slow):
        two_ln = 2.0 * math.log(self.rope_theta)
        low = math.floor(d * math.log(orig / (beta_fast * 2.0 * math.pi)) / two_ln)
        high = math.ceil(d * math.log(orig / (beta_slow * 2.0 * math.pi)) / two_ln)
        return max(low, 0), min(high, d - 1)

    @staticmethod
    def yarn_smooth(d, low, high):
        i = torch.arange(d // 2, dtype=F64)
        den = (high - low) if high > low else 0.001
        return 1.0 - torch.clamp((i - low) / den, 0.0, 1.0)

    def softmax_scale(self):
        s = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        r = self.yarn()
        if r is not None:
            factor = float(r["factor"])

            def msc(m):
                return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0

            mad = float(r.get("mscale_all_dim", 0.0) or 0.0)
            if msc(float(r.get("mscale", 1.0))) != msc(mad):
                raise NotImplementedError("rope_scaling.mscale != mscale_all_dim (cos/sin magnitude scaling)")
            if mad != 0.0:
                m = msc(mad)
                s *= m * m
        return s


def load_model_dir(model_dir):
    """-> (Config, {name: float64 tensor}) with fp8 weights dequantized."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = Config(json.load(f))
    raw = read_model_tensors(model_dir)
    br, bc = cfg.fp8_block
    w = {}
    for name, (dt, shape, data) in raw.items():
        if name.endswith("_scale_inv"):
            continue
        t = raw_to_f64(dt, shape, data)
        if dt == "F8_E4M3":
            sname = name + "_scale_inv"
            if sname not in raw:
                raise ValueError(f"fp8 tensor {name} has no {sname}")
            sdt, sshape, sdata = raw[sname]
            out, inn = shape
            if sdt != "F32" or list(sshape) != [-(-out // br), -(-inn // bc)]:
                raise ValueError(f"{sname}: expected F32 [{-(-out // br)}, {-(-inn // bc)}], got {sdt} {sshape}")
            s = raw_to_f64(sdt, sshape, sdata)
            s = s.repeat_interleave(br, 0)[:out].repeat_interleave(bc, 1)[:, :inn]
            t = t * s  # exact in float64: 4-bit x 24-bit significands
        if torch.isnan(t).any():
            raise ValueError(f"{name} holds NaN")
        w[name] = t
    return cfg, w


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def linear(x, w):
    return x @ w.t()


def silu(x):
    return x * torch.sigmoid(x)


def apply_rope(x, pos, freqs):
    """Interleaved pairs (x[2i], x[2i+1]). x [T, ..., d], pos [T] float64."""
    ang = pos[:, None] * freqs[None, :]  # [T, d/2]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [freqs.shape[0]]
    c, s = torch.cos(ang).reshape(shape), torch.sin(ang).reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = torch.empty_like(x)
    y[..., 0::2] = x0 * c - x1 * s
    y[..., 1::2] = x1 * c + x0 * s
    return y


def apply_rope_half(x, pos, freqs):
    """Half-split pairs (x[i], x[i + r/2]) of the first r = 2 * len(freqs) entries of the last dim; the rest
    is untouched. x [T, ..., d], pos [T] float64."""
    h = freqs.shape[0]
    ang = pos[:, None] * freqs[None, :]  # [T, r/2]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [h]
    c, s = torch.cos(ang).reshape(shape), torch.sin(ang).reshape(shape)
    x0, x1 = x[..., :h], x[..., h:2 * h]
    y = x.clone()
    y[..., :h] = x0 * c - x1 * s
    y[..., h:2 * h] = x1 * c + x0 * s
    return y


def hadamard(n):
    """Sylvester Hadamard matrix H_n (n a power of two), float64."""
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def layer_norm(x, w, b, eps=1e-6):
    """LayerNorm over the last dim with the biased variance."""
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def pow2_ceil(s):
    """2^ceil(log2(s)) for s > 0, exactly."""
    m, e = math.frexp(s)  # s = m * 2^e, 0.5 <= m < 1
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def act_quant_fp8(x, scale_fmt):
    """Per-block fp8 e4m3 quantization along the last dim (blocks of 128 consecutive values; a dim of at most
    128 is one block) -> dequantized float64 tensor of the same shape. amax = max(max|v|, 1e-4),
    scale = amax / 448 (or 2^ceil(log2(amax / 448)) with ue8m0), code = e4m3(clamp(v / scale)) nearest even."""
    d = x.shape[-1]
    b = min(d, 128)
    if d % b:
        raise ValueError(f"act_quant_fp8: last dim {d} is not a multiple of {b}")
    v = x.reshape(-1, d // b, b).numpy()
    amax = np.maximum(np.abs(v).max(-1), 1e-4)  # [N, d/b]
    scale = amax / E4M3_MAX
    if scale_fmt == "ue8m0":
        scale = np.vectorize(pow2_ceil, otypes=[np.float64])(scale)
    scale = scale[..., None]
    codes = e4m3_encode(np.clip(v / scale, -E4M3_MAX, E4M3_MAX))
    return torch.from_numpy(e4m3_decode(codes) * scale).reshape(x.shape)


class DeepSeekRef:
    def __init__(self, model_dir):
        self.cfg, self.w = load_model_dir(model_dir)
        c = self.cfg
        self.freqs = c.rope_frequencies()
        self.scale = c.softmax_scale()
        self.route_trace = None  # list of dicts when set to []
        self.index_trace = None  # list of dicts (full forward) when set to []
        if c.index_n_heads:
            self.hadamard = hadamard(c.index_head_dim) * c.index_head_dim ** -0.5

    def W(self, name):
        if name not in self.w:
            raise KeyError(f"checkpoint lacks {name}")
        return self.w[name]

    # --- blocks ---------------------------------------------------------------
    def mlp(self, p, x):
        return linear(silu(linear(x, self.W(p + ".gate_proj.weight"))) * linear(x, self.W(p + ".up_proj.weight")),
                      self.W(p + ".down_proj.weight"))

    def qkv(self, l, x, pos):
        """x [T, D] (normed) -> q_nope [T,H,n], q_pe [T,H,r] (rotated), latent [T,R] (normed),
        k_pe [T,r] (rotated), k_nope [T,H,n], v [T,H,v]."""
        c = self.cfg
        p = f"model.layers.{l}.self_attn."
        T, H = x.shape[0], c.num_attention_heads
        n, r, vd, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank:
            q = linear(self.q_latent(l, x), self.W(p + "q_b_proj.weight"))
        else:
            q = linear(x, self.W(p + "q_proj.weight"))
        q = q.reshape(T, H, n + r)
        q_nope, q_pe = q[..., :n], apply_rope(q[..., n:], pos, self.freqs)
        kv = linear(x, self.W(p + "kv_a_proj_with_mqa.weight"))
        latent = rms_norm(kv[:, :R], self.W(p + "kv_a_layernorm.weight"), c.rms_norm_eps)
        k_pe = apply_rope(kv[:, R:], pos, self.freqs)
        kvb = linear(latent, self.W(p + "kv_b_proj.weight")).reshape(T, H, n + vd)
        return q_nope, q_pe, latent, k_pe, kvb[..., :n], kvb[..., n:]

    def q_latent(self, l, x):
        """MLA's normed q latent q_a_layernorm(q_a_proj(x)) [T, q_lora_rank]."""
        c = self.cfg
        p = f"model.layers.{l}.self_attn."
        return rms_norm(linear(x, self.W(p + "q_a_proj.weight")), self.W(p + "q_a_layernorm.weight"), c.rms_norm_eps)

    def attend(self, q_nope, q_pe, k_nope, k_pe, v, causal, selected=None):
        """q [Tq,H,*], k_nope/v [Tk,H,*], k_pe [Tk,r] -> [Tq, H*v]. selected: bool [Tq, Tk] (sparse attention),
        keys not selected are masked."""
        s = torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_pe, k_pe)
        s = s * self.scale
        if causal:
            Tq, Tk = q_nope.shape[0], k_nope.shape[0]
            mask = torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq)
            s = s.masked_fill(mask, float("-inf"))
        if selected is not None:
            s = s.masked_fill(~selected, float("-inf"))
        pr = torch.softmax(s, dim=-1)
        o = torch.einsum("hts,shd->thd", pr, v)
        return o.reshape(o.shape[0], -1)

    def mla(self, l, x, pos):
        q_nope, q_pe, _, k_pe, k_nope, v = self.qkv(l, x, pos)
        selected = None
        if self.cfg.index_n_heads:
            qr = self.q_latent(l, x)
            iq, ik, iw = self.indexer_qkw(l, x, qr, pos)
            scores = self.index_scores(iq, ik, iw)
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            selected = self.index_select(scores)
            if self.index_trace is not None:
                self.index_trace.append({"layer": l, "x": x, "qr": qr, "pos": pos, "scores": scores,
                                         "selected": selected})
        o = self.attend(q_nope, q_pe, k_nope, k_pe, v, causal=True, selected=selected)
        return linear(o, self.W(f"model.layers.{l}.self_attn.o_proj.weight"))

    # --- V3.2 lightning indexer -----------------------------------------------
    def indexer_qkw(self, l, x, qr, pos, perturb=None):
        """x [T, D] (the normed layer input), qr [T, q_lora] (MLA's normed q latent) -> dequantized fp8 indexer
        queries q [T, Hi, Di], keys k [T, Di] and head weights w [T, Hi]. perturb, when given, maps a tensor
        to a slightly perturbed copy; it is applied to q and k before quantization and to w."""
        c = self.cfg
        p = f"model.layers.{l}.self_attn.indexer."
        T, Hi, Di = x.shape[0], c.index_n_heads, c.index_head_dim
        q = linear(qr, self.W(p + "wq_b.weight")).reshape(T, Hi, Di)
        k = layer_norm(linear(x, self.W(p + "wk.weight")), self.W(p + "k_norm.weight"), self.W(p + "k_norm.bias"))
        q = apply_rope_half(q, pos, self.freqs)  # the first qk_rope_head_dim entries, MLA's frequencies
        k = apply_rope_half(k, pos, self.freqs)
        q = q @ self.hadamard.t()
        k = k @ self.hadamard.t()
        w = linear(x, self.W(p + "weights_proj.weight")) * (Hi ** -0.5 * Di ** -0.5)
        if perturb is not None:
            q, k, w = perturb(q), perturb(k), perturb(w)
        return act_quant_fp8(q, c.scale_fmt), act_quant_fp8(k, c.scale_fmt), w

    @staticmethod
    def index_scores(q, k, w, perturb=None):
        """q [Tq, Hi, Di], k [Tk, Di], w [Tq, Hi] -> score [Tq, Tk] = sum_h w[t,h] * relu(q[t,h] . k[s]).
        perturb, when given, is applied to the dot products."""
        dots = torch.einsum("thd,sd->ths", q, k)
        if perturb is not None:
            dots = perturb(dots)
        return torch.einsum("th,ths->ts", w, torch.relu(dots))

    def index_select(self, scores):
        """scores [Tq, Tk], -inf at keys a query cannot see -> bool [Tq, Tk]: the index_topk keys with the
        largest score (stable: ties to the lower index), or every visible key when there are at most index_topk."""
        K = self.cfg.index_topk
        sel = torch.isfinite(scores)
        for t in range(scores.shape[0]):
            if int(sel[t].sum()) > K:
                order = np.argsort(-scores[t].numpy(), kind="stable")
                row = torch.zeros(scores.shape[1], dtype=torch.bool)
                row[torch.from_numpy(order[:K].copy())] = True
                sel[t] = row
        return sel

    def route(self, l, x):
        """x [T, D] -> (experts [T,k] long, weights [T,k] float64)."""
        c = self.cfg
        p = f"model.layers.{l}.mlp.gate."
        E, K = c.n_routed_experts, c.num_experts_per_tok
        logits = linear(x, self.W(p + "weight"))
        if c.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits)
        elif c.scoring_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            raise ValueError(c.scoring_func)
        choice = scores.clone()
        if c.topk_method == "noaux_tc" and (p + "e_score_correction_bias") in self.w:
            choice = choice + self.w[p + "e_score_correction_bias"]
        experts, weights = [], []
        for t in range(x.shape[0]):
            ch = choice[t].numpy().copy()
            info = {"layer": l, "token": t, "choice": ch.copy()}
            if c.topk_method in ("noaux_tc", "group_limited_greedy"):
                G = c.n_group
                gs = ch.reshape(G, E // G)
                if c.topk_method == "noaux_tc":
                    gscore = np.sort(gs, axis=1)[:, ::-1][:, :2].sum(axis=1)
                else:
                    gscore = gs.max(axis=1)
                gorder = np.argsort(-gscore, kind="stable")
                keep = np.zeros(G, dtype=bool)
                keep[gorder[:c.topk_group]] = True
                info["group_scores"], info["group_order"] = gscore, gorder
                ch = np.where(np.repeat(keep, E // G), ch, -np.inf)
            elif c.topk_method != "greedy":
                raise ValueError(c.topk_method)
            order = np.argsort(-ch, kind="stable")  # descending, ties -> lower index
            sel = order[:K]
            info["masked_choice"], info["order"] = ch, order
            w = scores[t, torch.from_numpy(sel.copy())]
            if c.norm_topk_prob:
                w = w / w.sum()
            w = w * c.routed_scaling_factor
            experts.append(torch.from_numpy(sel.copy()))
            weights.append(w)
            if self.route_trace is not None:
                self.route_trace.append(info)
        return torch.stack(experts), torch.stack(weights)

    def moe(self, l, x):
        c = self.cfg
        p = f"model.layers.{l}.mlp"
        experts, weights = self.route(l, x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e, wk in zip(experts[t].tolist(), weights[t]):
                out[t] += wk * self.mlp(f"{p}.experts.{e}", x[t:t + 1])[0]
        if c.n_shared_experts > 0:
            out = out + self.mlp(p + ".shared_experts", x)
        return out

    def ffn(self, l, x):
        return self.moe(l, x) if self.cfg.is_moe_layer(l) else self.mlp(f"model.layers.{l}.mlp", x)

    def head(self, h):
        c = self.cfg
        h = rms_norm(h, self.W("model.norm.weight"), c.rms_norm_eps)
        return linear(h, self.W("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"))

    # --- forward passes -------------------------------------------------------
    def forward(self, tokens):
        """Full causal forward over one sequence (positions 0..T-1) -> float64 logits [T, V]."""
        c = self.cfg
        ids = torch.tensor(tokens, dtype=torch.long)
        h = self.W("model.embed_tokens.weight")[ids]
        pos = torch.arange(len(tokens), dtype=F64)
        for l in range(c.num_hidden_layers):
            pre = f"model.layers.{l}."
            h = h + self.mla(l, rms_norm(h, self.W(pre + "input_layernorm.weight"), c.rms_norm_eps), pos)
            h = h + self.ffn(l, rms_norm(h, self.W(pre + "post_attention_layernorm.weight"), c.rms_norm_eps))
        return self.head(h)

    def forward_incremental(self, tokens, absorbed=False):
        """Token by token with a KV cache. absorbed=False caches the expanded per-head
        k (= [k_nope | k_pe]) and v; absorbed=True caches only [latent | k_pe] and folds
        kv_b_proj into q (k part) and the output (v part), as MLA decode does."""
        c = self.cfg
        H, n, vd = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        L = c.num_hidden_layers
        cache = [{"k_nope": [], "k_pe": [], "v": [], "latent": [], "index_k": []} for _ in range(L)]
        rows = []
        for t, tok in enumerate(tokens):
            h = self.W("model.embed_tokens.weight")[torch.tensor([tok])]
            pos = torch.tensor([float(t)], dtype=F64)
            for l in range(L):
                pre = f"model.layers.{l}."
                x = rms_norm(h, self.W(pre + "input_layernorm.weight"), c.rms_norm_eps)
                q_nope, q_pe, latent, k_pe, k_nope, v = self.qkv(l, x, pos)
                cc = cache[l]
                cc["k_nope"].append(k_nope[0])
                cc["k_pe"].append(k_pe[0])
                cc["v"].append(v[0])
                cc["latent"].append(latent[0])
                K_pe = torch.stack(cc["k_pe"])  # [t+1, r]
                selected = None
                if c.index_n_heads:  # the indexer keeps its own cache of quantized keys
                    iq, ik, iw = self.indexer_qkw(l, x, self.q_latent(l, x), pos)
                    cc["index_k"].append(ik[0])
                    selected = self.index_select(self.index_scores(iq, torch.stack(cc["index_k"]), iw))
                if not absorbed:
                    o = self.attend(q_nope, q_pe, torch.stack(cc["k_nope"]), K_pe, torch.stack(cc["v"]), causal=False,
                                    selected=selected)
                else:
                    wkv = self.W(pre + "self_attn.kv_b_proj.weight").reshape(H, n + vd, c.kv_lora_rank)
                    w_k, w_v = wkv[:, :n], wkv[:, n:]  # [H, n, R], [H, v, R]
                    lat = torch.stack(cc["latent"])  # [S, R]
                    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_k)
                    s = torch.einsum("thr,sr->hts", q_lat, lat) + torch.einsum("thd,sd->hts", q_pe, K_pe)
                    s = s * self.scale
                    if selected is not None:
                        s = s.masked_fill(~selected, float("-inf"))
                    pr = torch.softmax(s, dim=-1)
                    o_lat = torch.einsum("hts,sr->thr", pr, lat)
                    o = torch.einsum("thr,hvr->thv", o_lat, w_v).reshape(1, H * vd)
                h = h + linear(o, self.W(pre + "self_attn.o_proj.weight"))
                h = h + self.ffn(l, rms_norm(h, self.W(pre + "post_attention_layernorm.weight"), c.rms_norm_eps))
            rows.append(self.head(h)[0])
        return torch.stack(rows)


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    d = argv[1]
    ref = DeepSeekRef(d)
    with open(os.path.join(d, "tokens.json")) as f:
        seqs = json.load(f)
    exp = None
    if "--check" in argv:
        exp, _ = read_safetensors_raw(os.path.join(d, "expected.safetensors"))
    worst = 0.0
    for i, s in enumerate(seqs):
        lg = ref.forward(s)
        line = f"seq {i}: len {len(s)}, logits std {lg.std().item() if lg.numel() > 1 else 0:.3f} " \
               f"max|.| {lg.abs().max().item():.3f}"
        if exp is not None:
            e = raw_to_f64(*exp[f"logits.{i}"])
            diff = (lg - e).abs().max().item()
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
