#!/usr/bin/python3
"""Greedy generation with a DeepSeek-V2/V3 model in PyTorch eager mode (float32, CPU).

The competitor for the engine's `bench` command: an idiomatic float32 inference
implementation written the way Hugging Face's modeling_deepseek.py runs the model
(torch.nn.functional ops, an expanded per-head K/V cache, MoE by gathering each
expert's tokens), so that the comparison measures the engine, not a strawman.

Only torch and numpy are needed (Debian's python3-torch / python3-numpy, run with
/usr/bin/python3). The safetensors reader and the e4m3 codec come from the float64
reference in tests/reference/deepseek_ref.py, which also documents the conventions
followed here (interleaved YaRN RoPE, mscale, the routing variants).

Usage:
  torch_generate.py --model DIR --batch B --prompt-len P --new-tokens N --threads T
                    [--seed S] [--repeat R] [--dtype float32|bfloat16]
      Prefills B random prompts of P tokens in one forward, which gives each
      sequence its first new token, then runs N greedy decode steps (one batched
      forward each, tokens 2..N+1), as the engine's `bench` command does. After a
      warm-up run, R timed runs (default 3); prints one JSON line with the median
      of each phase:
        {"impl": "torch", "batch": B, "prompt_len": P, "new_tokens": N,
         "prefill_tokens_per_s": B*P / prefill seconds,
         "decode_tokens_per_s": B*N / decode seconds, ...}
  torch_generate.py --check [--models-dir DIR] [--dtype float32|bfloat16]
      Checks the logits against every fixture under tests/data/models (full forward
      and prefill + cached decode, single and batched); exits 1 on a mismatch.
      With --dtype bfloat16 it prints how far the bf16 model moves (and, its
      tolerance being float32's, reports a mismatch).
  torch_generate.py --make-random DIR --config-yaml PRESET [--seed S]
      Writes a random BF16 checkpoint (config.json + model.safetensors, Hugging Face
      names) of a YAML preset's shape, for trying the benchmark by hand.
"""

import argparse
import json
import math
import os
import sys
import time

# Debian's torch runs elementwise ops on an OpenMP pool and matmuls in the system
# BLAS (OpenBLAS: its own pthread pool). With libgomp's default spin-waiting the
# two pools fight over the cores between every op (on 2 cores that made prefill
# ~20x slower), so idle OpenMP workers sleep unless the caller chose a policy.
# This must come before the first torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))

from deepseek_ref import (  # noqa: E402  (path set up above)
    Config,
    e4m3_decode,
    f32_to_bf16_bits,
    raw_to_f64,
    read_model_tensors,
    read_safetensors_raw,
    write_safetensors_raw,
)

F32 = torch.float32

# ---------------------------------------------------------------------------
# loading: every weight widened to float32 once
# ---------------------------------------------------------------------------


def raw_to_f32(dt, shape, raw):
    """Stored bytes -> float32 tensor (BF16/F16/F8 widen exactly; F64 rounds)."""
    if dt == "F32":
        a = np.frombuffer(raw, dtype="<f4")
    elif dt == "F64":
        a = np.frombuffer(raw, dtype="<f8").astype(np.float32)
    elif dt == "F16":
        a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dt == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        a = bits.view(np.float32)
    elif dt == "F8_E4M3":
        a = e4m3_decode(np.frombuffer(raw, dtype=np.uint8)).astype(np.float32)
    else:
        raise ValueError(f"dtype {dt} is not a float dtype")
    return torch.from_numpy(a.copy()).reshape(shape)


def load_weights_f32(model_dir, cfg):
    """{name: float32 tensor} for the tensors the forward pass uses; fp8 weights are
    dequantized with their block weight_scale_inv (in float32, as Hugging Face does).
    MTP layers (index >= num_hidden_layers) are skipped."""
    raw = read_model_tensors(model_dir)
    br, bc = cfg.fp8_block
    out = {}
    for name, (dt, shape, data) in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= cfg.num_hidden_layers:
                continue
        t = raw_to_f32(dt, shape, data)
        if dt == "F8_E4M3":
            sname = name + "_scale_inv"
            if sname not in raw:
                raise ValueError(f"fp8 tensor {name} has no {sname}")
            s = raw_to_f32(*raw[sname])
            rows, cols = shape
            s = s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
            t = t * s
        out[name] = t.contiguous()
    return out


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def rms_norm(x, w, eps):
    """Hugging Face's DeepseekV3RMSNorm: float32 inside, the result in x's dtype."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return w * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb for DeepSeek: the stored rope channels are
    interleaved pairs (x[2i], x[2i+1]); they are regrouped to [evens | odds] and
    rotated with rotate_half. q and k get the same permutation, so q.k is the
    interleaved rotation's. q [B,H,T,r], k [B,1,T,r], cos/sin [T,r]."""
    b, h, s, d = q.shape
    q = q.reshape(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.reshape(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def select_experts(c, scores, choice):
    """DeepSeek's top-k over `choice` (scores, plus the correction bias for
    noaux_tc; group-limited for noaux_tc and group_limited_greedy) ->
    (expert ids [N, k], combine weights [N, k] from the unbiased `scores`)."""
    if c.topk_method in ("noaux_tc", "group_limited_greedy"):
        N, E, G = choice.shape[0], c.n_routed_experts, c.n_group
        grouped = choice.view(N, G, E // G)
        if c.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        group_idx = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros(N, G, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, E)
    elif c.topk_method != "greedy":
        raise ValueError(f"topk_method {c.topk_method} not supported")
    idx = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, idx)
    if c.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights * c.routed_scaling_factor


class Mlp:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, w, prefix):
        self.gate = w[prefix + ".gate_proj.weight"]
        self.up = w[prefix + ".up_proj.weight"]
        self.down = w[prefix + ".down_proj.weight"]

    def __call__(self, x):
        return F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)


class KvCache:
    """Expanded per-head keys ([k_nope | k_pe], k_pe repeated over heads) and values of
    every layer, preallocated for max_len positions (a static cache)."""

    def __init__(self, cfg, batch, max_len, dtype=F32):
        H = cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.k = [torch.empty(batch, H, max_len, qk, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(batch, H, max_len, cfg.v_head_dim, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.length = 0  # positions filled (the same for every sequence of the batch)


class Layer:
    def __init__(self, cfg, w, l):
        p = f"model.layers.{l}."
        self.input_norm = w[p + "input_layernorm.weight"]
        self.post_norm = w[p + "post_attention_layernorm.weight"]
        a = p + "self_attn."
        if cfg.q_lora_rank:
            self.q_a = w[a + "q_a_proj.weight"]
            self.q_a_norm = w[a + "q_a_layernorm.weight"]
            self.q_b = w[a + "q_b_proj.weight"]
        else:
            self.q_proj = w[a + "q_proj.weight"]
        self.kv_a = w[a + "kv_a_proj_with_mqa.weight"]
        self.kv_a_norm = w[a + "kv_a_layernorm.weight"]
        self.kv_b = w[a + "kv_b_proj.weight"]
        self.o_proj = w[a + "o_proj.weight"]
        self.moe = cfg.is_moe_layer(l)
        if self.moe:
            self.gate = w[p + "mlp.gate.weight"]
            self.bias = w.get(p + "mlp.gate.e_score_correction_bias") if cfg.topk_method == "noaux_tc" else None
            self.experts = [Mlp(w, f"{p}mlp.experts.{e}") for e in range(cfg.n_routed_experts)]
            self.shared = Mlp(w, p + "mlp.shared_experts") if cfg.n_shared_experts > 0 else None
        else:
            self.mlp = Mlp(w, p + "mlp")


class TorchDeepSeek:
    """dtype float32 (the default) runs everything in float32; bfloat16 runs the model
    as Hugging Face's does when loaded with torch_dtype=torch.bfloat16: weights,
    activations and cache in bf16, RMSNorm and the attention softmax in float32 (cast
    back), the router's logits in float32 from a float32 gate."""

    def __init__(self, model_dir, dtype=F32):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = c = Config(json.load(f))
        self.dtype = dtype
        w = load_weights_f32(model_dir, c)
        w = {k: v if k.endswith((".mlp.gate.weight", "e_score_correction_bias")) else v.to(dtype) for k, v in w.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if c.tie_word_embeddings else w["lm_head.weight"]
        self.layers = [Layer(c, w, l) for l in range(c.num_hidden_layers)]
        self.eps = c.rms_norm_eps
        self.scale = c.softmax_scale()  # (qk_nope + qk_rope)^-0.5 * mscale^2
        # YaRN-blended frequencies; cos/sin tables in the [evens | odds] layout of apply_rotary.
        self.inv_freq = c.rope_frequencies()  # float64 [r/2]
        self.cos = self.sin = torch.empty(0, c.qk_rope_head_dim)
        self._rope_tables(int(c.raw.get("max_position_embeddings") or 4096))

    def _rope_tables(self, n):
        if self.cos.shape[0] >= n:
            return
        ang = torch.outer(torch.arange(n, dtype=torch.float64), self.inv_freq)
        emb = torch.cat((ang, ang), dim=-1)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def new_cache(self, batch, max_len):
        self._rope_tables(max_len)
        return KvCache(self.cfg, batch, max_len, self.dtype)

    # --- blocks ---------------------------------------------------------------
    def attention(self, L, l, x, cache, mask):
        """Multi-head latent attention with the expanded K/V cache. x [B,T,D] (normed)."""
        c = self.cfg
        B, T, _ = x.shape
        H, n, r, vd, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        start = cache.length
        if c.q_lora_rank:
            q = F.linear(rms_norm(F.linear(x, L.q_a), L.q_a_norm, self.eps), L.q_b)
        else:
            q = F.linear(x, L.q_proj)
        q = q.view(B, T, H, n + r).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [n, r], dim=-1)
        compressed_kv, k_pe = torch.split(F.linear(x, L.kv_a), [R, r], dim=-1)
        k_pe = k_pe.view(B, T, 1, r).transpose(1, 2)
        kv = F.linear(rms_norm(compressed_kv, L.kv_a_norm, self.eps), L.kv_b).view(B, T, H, n + vd).transpose(1, 2)
        k_nope, v = torch.split(kv, [n, vd], dim=-1)
        q_pe, k_pe = apply_rotary(q_pe, k_pe, self.cos[start:start + T], self.sin[start:start + T])

        # Append this step's keys and values, then attend over the whole prefix.
        ck, cv = cache.k[l], cache.v[l]
        end = start + T
        ck[:, :, start:end, :n] = k_nope
        ck[:, :, start:end, n:] = k_pe
        cv[:, :, start:end] = v
        q = torch.cat((q_nope, q_pe), dim=-1)
        att = torch.matmul(q, ck[:, :, :end].transpose(2, 3)) * self.scale
        if mask is not None:
            att = att + mask
        att = F.softmax(att, dim=-1, dtype=F32).to(q.dtype)
        o = torch.matmul(att, cv[:, :, :end])  # [B,H,T,vd]
        return F.linear(o.transpose(1, 2).reshape(B, T, H * vd), L.o_proj)

    def route(self, L, x):
        """x [N, D] -> (expert ids [N,k], weights [N,k])."""
        c = self.cfg
        logits = F.linear(x.float(), L.gate)
        if c.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        elif c.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=F32)
        else:
            raise ValueError(f"scoring_func {c.scoring_func} not supported")
        choice = scores if L.bias is None else scores + L.bias
        return select_experts(c, scores, choice)

    def moe(self, L, x):
        """Routed experts (each runs once on the rows routed to it) plus shared experts."""
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        idx, weights = self.route(L, x)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort()
        rows = order // k  # token row of each (token, slot), grouped by expert
        slot_w = weights.reshape(-1)[order].unsqueeze(-1)
        counts = torch.bincount(flat, minlength=len(L.experts)).tolist()
        out = torch.zeros_like(x)
        begin = 0
        for e, cnt in enumerate(counts):
            if cnt == 0:
                continue
            r = rows[begin:begin + cnt]
            out.index_add_(0, r, L.experts[e](x[r]) * slot_w[begin:begin + cnt].to(x.dtype))
            begin += cnt
        if L.shared is not None:
            out = out + L.shared(x)
        return out.view(B, T, D)

    # --- forward --------------------------------------------------------------
    def forward(self, tokens, cache, all_logits=False):
        """tokens [B,T] long at positions cache.length.. -> float32 logits [B,T,V]
        (all_logits) or [B,1,V] for the last position; the cache grows by T."""
        B, T = tokens.shape
        start = cache.length
        mask = None
        if T > 1:  # causal: query start+i sees keys 0..start+i
            mask = torch.full((T, start + T), float("-inf"), dtype=self.dtype).triu_(start + 1)
        h = F.embedding(tokens, self.embed)
        for l, L in enumerate(self.layers):
            h = h + self.attention(L, l, rms_norm(h, L.input_norm, self.eps), cache, mask)
            x = rms_norm(h, L.post_norm, self.eps)
            h = h + (self.moe(L, x) if L.moe else L.mlp(x))
        cache.length = start + T
        if not all_logits:
            h = h[:, -1:]
        return F.linear(rms_norm(h, self.norm, self.eps), self.lm_head).float()


# ---------------------------------------------------------------------------
# generation benchmark
# ---------------------------------------------------------------------------


def generate(model, prompts, decode_steps):
    """Greedy decoding: the prefill forward makes token 1 of every sequence, then each
    decode step (one batched forward) makes one more. prompts [B,P] long ->
    (new tokens [B, 1 + decode_steps], prefill seconds, decode seconds)."""
    B, P = prompts.shape
    cache = model.new_cache(B, P + decode_steps)
    t0 = time.perf_counter()
    nxt = model.forward(prompts, cache)[:, -1].argmax(dim=-1)
    t1 = time.perf_counter()
    out = [nxt]
    for _ in range(decode_steps):
        nxt = model.forward(nxt.unsqueeze(1), cache)[:, -1].argmax(dim=-1)
        out.append(nxt)
    t2 = time.perf_counter()
    return torch.stack(out, dim=1), t1 - t0, t2 - t1


def bench(args):
    torch.set_num_threads(args.threads)
    model = TorchDeepSeek(args.model, torch.bfloat16 if args.dtype == "bfloat16" else F32)
    V = model.cfg.vocab_size
    rng = np.random.Generator(np.random.PCG64(args.seed))
    prompts = torch.from_numpy(rng.integers(0, V, size=(args.batch, args.prompt_len), dtype=np.int64))
    prefill, decode = [], []
    with torch.inference_mode():
        generate(model, prompts, 1)  # warm-up, not timed: touches every weight, grows the allocator
        for _ in range(args.repeat):
            _, prefill_s, decode_s = generate(model, prompts, args.new_tokens)
            prefill.append(args.batch * args.prompt_len / prefill_s)
            decode.append(args.batch * args.new_tokens / decode_s)
    print(json.dumps({
        "impl": "torch",
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_tokens_per_s": round(float(np.median(prefill)), 3),
        "decode_tokens_per_s": round(float(np.median(decode)), 3),
        "repeat": args.repeat,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "dtype": args.dtype,
        "torch": torch.__version__,
    }))
    return 0


# ---------------------------------------------------------------------------
# --check: logits against the fixtures of the float64 reference
# ---------------------------------------------------------------------------


def rel_err(a, b):
    """max |a - b| relative to max |b|."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(models_dir, dtype=F32, tol=1e-4):
    torch.set_num_threads(1)
    worst_all = 0.0
    ok = True
    for name in sorted(os.listdir(models_dir)):
        d = os.path.join(models_dir, name)
        if not os.path.exists(os.path.join(d, "expected.safetensors")):
            continue
        model = TorchDeepSeek(d, dtype)
        with open(os.path.join(d, "tokens.json")) as f:
            seqs = json.load(f)
        expected, _ = read_safetensors_raw(os.path.join(d, "expected.safetensors"))
        # DeepSeek-V3.2 attends sparsely past index_topk tokens; this model is
        # dense, so only the shorter sequences (where both agree) are checked.
        topk = model.cfg.raw.get("index_topk") if model.cfg.raw.get("model_type") == "deepseek_v32" else None
        full = []
        with torch.inference_mode():
            for i, s in enumerate(seqs):
                T = len(s)
                if topk is not None and T > topk:
                    print(f"{name} seq {i} (len {T}): skipped, sparse attention past index_topk {topk}")
                    continue
                toks = torch.tensor([s], dtype=torch.long)
                # 1. full causal forward vs the reference.
                lg = model.forward(toks, model.new_cache(1, T), all_logits=True)[0]
                full.append(lg)
                e1 = rel_err(lg.double(), raw_to_f64(*expected[f"logits.{i}"]))
                # 2. prefill of the first half, then one token at a time through the cache.
                k = max(1, T // 2)
                cache = model.new_cache(1, T)
                parts = [model.forward(toks[:, :k], cache, all_logits=True)[0]]
                for t in range(k, T):
                    parts.append(model.forward(toks[:, t:t + 1], cache)[0])
                e2 = rel_err(torch.cat(parts), lg)
                good = e1 <= tol and e2 <= tol
                ok &= good
                worst_all = max(worst_all, e1, e2)
                print(f"{name} seq {i} (len {T}): full vs expected {e1:.2e}, "
                      f"prefill {k} + decode vs full {e2:.2e} {'ok' if good else 'MISMATCH'}")
            # 3. a batch of different sequences of one length (the longest, reversed and
            #    rotated): batched prefill + decode vs each sequence's own full forward.
            s = max((q for q in seqs if topk is None or len(q) <= topk), key=len)
            T = len(s)
            if T > 1:
                batch = [s, s[::-1], s[T // 3:] + s[:T // 3]]
                toks = torch.tensor(batch, dtype=torch.long)
                ref = torch.stack([model.forward(toks[b:b + 1], model.new_cache(1, T), all_logits=True)[0]
                                   for b in range(len(batch))])
                k = T // 2
                cache = model.new_cache(len(batch), T)
                parts = [model.forward(toks[:, :k], cache, all_logits=True)]
                for t in range(k, T):
                    parts.append(model.forward(toks[:, t:t + 1], cache))
                e3 = rel_err(torch.cat(parts, dim=1), ref)
                good = e3 <= tol
                ok &= good
                worst_all = max(worst_all, e3)
                print(f"{name} batch of {len(batch)} x len {T}: batched prefill {k} + decode vs single "
                      f"{e3:.2e} {'ok' if good else 'MISMATCH'}")
    print(("OK" if ok else "MISMATCH") + f" (worst relative error {worst_all:.2e}, tolerance {tol:.0e})")
    return 0 if ok else 1


# ---------------------------------------------------------------------------
# --make-random: a checkpoint of a YAML preset's shape
# ---------------------------------------------------------------------------

# YAML preset key (MaxText names) -> Hugging Face config.json key.
_YAML_TO_HF = {
    "vocab_size": "vocab_size",
    "base_emb_dim": "hidden_size",
    "base_mlp_dim": "intermediate_size",
    "base_moe_mlp_dim": "moe_intermediate_size",
    "base_num_decoder_layers": "num_hidden_layers",
    "base_num_query_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "rope_max_timescale": "rope_theta",
    "max_position_embeddings": "max_position_embeddings",
    "num_experts": "n_routed_experts",
    "shared_experts": "n_shared_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "n_routing_groups": "n_group",
    "topk_routing_group": "topk_group",
    "routed_scaling_factor": "routed_scaling_factor",
    "routed_score_func": "scoring_func",
    "topk_method": "topk_method",
    "norm_topk_prob": "norm_topk_prob",
    "first_num_dense_layers": "first_k_dense_replace",
    "interleave_moe_layer_step": "moe_layer_freq",
    "normalization_layer_epsilon": "rms_norm_eps",
    "logits_via_embedding": "tie_word_embeddings",
    "model_type": "model_type",
}
_YAML_ROPE = {"original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow", "mscale", "use_yarn"}
_YAML_IGNORED = {"decoder_block", "routed_bias_update_rate", "mtp_num_layers"}


def _parse_scalar(v):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~", ""):
        return None
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v.strip("\"'")


def read_flat_yaml(path):
    """The presets are flat `key: value` mappings with # comments."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                key, _, val = line.partition(":")
                out[key.strip()] = _parse_scalar(val.strip())
    return out


def hf_config_from_yaml(path):
    y = read_flat_yaml(path)
    unknown = set(y) - set(_YAML_TO_HF) - _YAML_ROPE - _YAML_IGNORED
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    j = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
         "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
         "first_k_dense_replace": 0, "moe_layer_freq": 1, "tie_word_embeddings": False, "bos_token_id": 0,
         "eos_token_id": 1, "torch_dtype": "bfloat16"}
    for k, v in y.items():
        if k in _YAML_TO_HF:
            j[_YAML_TO_HF[k]] = v
    j["num_key_value_heads"] = j["num_attention_heads"]
    for k in ("rope_theta", "routed_scaling_factor", "rms_norm_eps"):
        if k in j:
            j[k] = float(j[k])
    if y.get("use_yarn", float(y.get("rope_factor", 1.0)) > 1.0):
        m = float(y.get("mscale", 1.0))
        j["rope_scaling"] = {"type": "yarn", "factor": float(y["rope_factor"]),
                             "original_max_position_embeddings": int(y["original_max_position_embeddings"]),
                             "beta_fast": float(y.get("beta_fast", 32.0)), "beta_slow": float(y.get("beta_slow", 1.0)),
                             "mscale": m, "mscale_all_dim": m}
    else:
        j["rope_scaling"] = None
    return j


def make_random(out_dir, yaml_path, seed, std=0.006):
    """Random N(0, std) BF16 matrices, unit norms and a zero routing bias (F32)."""
    j = hf_config_from_yaml(yaml_path)
    c = Config(j)
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors = []

    def mat(name, shape):
        a = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
        tensors.append((name, "BF16", list(shape), f32_to_bf16_bits(a).tobytes()))

    def f32(name, shape, value):
        tensors.append((name, "F32", list(shape), np.full(shape, value, dtype="<f4").tobytes()))

    def mlp(p, width):
        mat(p + ".gate_proj.weight", (width, D))
        mat(p + ".up_proj.weight", (width, D))
        mat(p + ".down_proj.weight", (D, width))

    D, H = c.hidden_size, c.num_attention_heads
    qk, R, r = c.qk_nope_head_dim + c.qk_rope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim
    mat("model.embed_tokens.weight", (c.vocab_size, D))
    for l in range(c.num_hidden_layers):
        p = f"model.layers.{l}."
        f32(p + "input_layernorm.weight", (D,), 1.0)
        f32(p + "post_attention_layernorm.weight", (D,), 1.0)
        a = p + "self_attn."
        if c.q_lora_rank:
            mat(a + "q_a_proj.weight", (c.q_lora_rank, D))
            f32(a + "q_a_layernorm.weight", (c.q_lora_rank,), 1.0)
            mat(a + "q_b_proj.weight", (H * qk, c.q_lora_rank))
        else:
            mat(a + "q_proj.weight", (H * qk, D))
        mat(a + "kv_a_proj_with_mqa.weight", (R + r, D))
        f32(a + "kv_a_layernorm.weight", (R,), 1.0)
        mat(a + "kv_b_proj.weight", (H * (c.qk_nope_head_dim + c.v_head_dim), R))
        mat(a + "o_proj.weight", (D, H * c.v_head_dim))
        if c.is_moe_layer(l):
            mat(p + "mlp.gate.weight", (c.n_routed_experts, D))
            if c.topk_method == "noaux_tc":
                f32(p + "mlp.gate.e_score_correction_bias", (c.n_routed_experts,), 0.0)
            for e in range(c.n_routed_experts):
                mlp(f"{p}mlp.experts.{e}", c.moe_intermediate_size)
            if c.n_shared_experts:
                mlp(p + "mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        else:
            mlp(p + "mlp", c.intermediate_size)
    f32("model.norm.weight", (D,), 1.0)
    if not c.tie_word_embeddings:
        mat("lm_head.weight", (c.vocab_size, D))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(j, f, indent=2)
        f.write("\n")
    write_safetensors_raw(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
    n = sum(math.prod(t[2]) for t in tensors)
    print(f"wrote {out_dir}: {len(tensors)} tensors, {n / 1e6:.1f}M parameters")
    return 0


# ---------------------------------------------------------------------------


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face DeepSeek model folder")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts (or weights)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs; the median is reported")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's dtype for the benchmark and --check (bfloat16: as Hugging Face runs bf16)")
    ap.add_argument("--check", action="store_true", help="check logits against tests/data/models and exit")
    ap.add_argument("--models-dir", default=os.path.join(HERE, "..", "tests", "data", "models"))
    ap.add_argument("--make-random", metavar="DIR", help="write a random checkpoint of --config-yaml to DIR")
    ap.add_argument("--config-yaml", help="YAML preset for --make-random")
    args = ap.parse_args(argv)
    if args.check:
        return check(args.models_dir, torch.bfloat16 if args.dtype == "bfloat16" else F32)
    if args.make_random:
        if not args.config_yaml:
            ap.error("--make-random needs --config-yaml")
        return make_random(args.make_random, args.config_yaml, args.seed)
    if not args.model:
        ap.error("--model is required")
    if min(args.batch, args.prompt_len, args.new_tokens, args.threads, args.repeat) < 1:
        ap.error("--batch, --prompt-len, --new-tokens, --threads and --repeat must be positive")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
