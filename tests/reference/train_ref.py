#!/usr/bin/python3
"""Float64 reference of the DeepSeek-V2/V3 training loss and its parameter gradients.

The forward pass here is written again from the math, batched over [B, T] and
differentiable end to end with torch autograd; it shares only the checkpoint
reader, the config parser, RMSNorm/linear/SiLU and the YaRN frequency and
softmax-scale rules with deepseek_ref.py. What it adds for training:

- packed batches: RoPE uses the given `positions`; query i attends to key j iff
  segment_ids[b, i] == segment_ids[b, j] and j <= i (causality by array index);
- the LM loss with an optional z-loss, masked by `target_segment_ids != 0`:
      xent = lse(z) - z[target] + z_mult * lse(z)^2
      lm_loss = sum(xent * mask) / (sum(mask) + 1e-8)
- the MoE balance loss of every MoE layer (MTP layers included), in the
  per-sequence form  L = w * E^2 * mean_{b,e}(f * P)  with f = top-k hits / T and
  P = mean over t of softmax_e(scores + correction bias), averaged over layers;
- multi-token prediction with the Hugging Face layout (the MTP depth k lives at
  model.layers.{num_hidden_layers + k - 1}): inputs, targets and the target mask
  are shifted left inside each document, the depth's decoder layer runs on
  eh_proj([enorm(embed(ids_k)); hnorm(h_{k-1})]) at the original positions and
  segments, and its logits are lm_head(shared_head.norm(h_k));
      mtp_loss = lambda * sum_k sum(mask_k * CE_k) / (sum_k sum(mask_k) + 1e-8)
- loss = lm_loss + mtp_loss + moe_lb_loss.
- MaxText's seed-era mHC when config.json sets mhc_expansion_rate k > 1: the
  embedding becomes k equal streams [B, T, k, D]; around each layer's attention
  and its FFN a module with its own tensors (prefix mhc_attention / mhc_mlp)
  mixes them (see `mhc` below); after the last layer the streams are summed.
  Its Sinkhorn (mhc_sinkhorn_iterations, default 20) is differentiated through
  every iteration by autograd, like MaxText's.
- MaxText's Engram before the attention of the layers in engram_layers (see
  `engram` below): hashed n-grams of each row's input tokens (never reset at
  document boundaries, as MaxText), their table rows through a gated value
  and a short causal conv added to every stream. The hash multipliers are
  numpy's own draws (default_rng), the primes a plain search.

Routing choices (group-limited top-k over scores + e_score_correction_bias) are
made without gradient, as integer decisions; the combine weights, computed from
the unbiased scores, are differentiable. The correction bias is a constant, not
a trainable parameter, and gets no gradient.

Command line:
  /usr/bin/python3 tests/reference/train_ref.py FIXTURE_DIR
reads FIXTURE_DIR/{config.json, model.safetensors, batch.json} and prints the losses.
"""

import json
import os
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref as ref  # noqa: E402
from deepseek_ref import F64, linear, rms_norm, silu  # noqa: E402

EPS = 1e-8  # added to every token-count normaliser, as the training loop does
LOSS_NAMES = ("loss", "lm_loss", "z_loss", "mtp_loss", "moe_lb_loss")
BATCH_ARRAYS = ("inputs", "targets", "positions", "segment_ids", "target_segment_ids")


# ---------------------------------------------------------------------------
# batch
# ---------------------------------------------------------------------------


def load_batch(path):
    """batch.json -> dict with int64 [B, T] numpy arrays and float/int scalars."""
    with open(path) as f:
        j = json.load(f)
    b = {k: np.asarray(j[k], dtype=np.int64) for k in BATCH_ARRAYS}
    shape = b["inputs"].shape
    if len(shape) != 2:
        raise ValueError(f"{path}: inputs must be [B, T], got {list(shape)}")
    for k in BATCH_ARRAYS:
        if b[k].shape != shape:
            raise ValueError(f"{path}: {k} has shape {list(b[k].shape)}, inputs {list(shape)}")
    b["z_loss_multiplier"] = float(j.get("z_loss_multiplier", 0.0))
    b["load_balance_loss_weight"] = float(j.get("load_balance_loss_weight", 0.0))
    b["mtp_num_layers"] = int(j.get("mtp_num_layers", 0))
    b["mtp_loss_scaling_factor"] = float(j.get("mtp_loss_scaling_factor", 0.0))
    return b


def roll_left(x):
    """Plain left shift by one along T; the vacated last column becomes 0."""
    y = np.zeros_like(x)
    y[:, :-1] = x[:, 1:]
    return y


def roll_left_in_segment(x, seg):
    """Left shift by one inside documents: position i takes the value at i+1, or 0
    where i is the last column, seg[i] != seg[i+1], or seg[i] == 0 (padding)."""
    keep = (seg == roll_left(seg)) & (seg != 0)
    keep[:, -1] = False
    return np.where(keep, roll_left(x), 0)


def attention_mask(seg):
    """[B, T] segment ids -> [B, T, T] bool: True where query i may attend to key j."""
    s = torch.from_numpy(seg)
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # j <= i, by array index
    return (s[:, :, None] == s[:, None, :]) & causal[None]


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def sinkhorn_v1(logits, iters):
    """MaxText's seed-era Sinkhorn over the last two axes [..., k, k]: a softmax down
    each column, then `iters` rounds of dividing each row by its sum and then each
    column by its sum, every sum floored at 1e-12 (a floored sum is a constant, so
    clamp's zero gradient below the floor is the intended one)."""
    t = torch.softmax(logits, dim=-2)
    for _ in range(iters):
        t = t / torch.clamp(t.sum(dim=-1, keepdim=True), min=1e-12)
        t = t / torch.clamp(t.sum(dim=-2, keepdim=True), min=1e-12)
    return t


def is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def engram_tables(cfg):
    """{layer: (multipliers [N] int64, primes [(N - 1) H])} of MaxText's int32 scheme
    over the config's vocabulary (the compressed vocabulary is the vocabulary)."""
    raw = cfg.raw
    layers = raw.get("engram_layers") or []
    N, H = int(raw.get("engram_max_ngram_size", 3)), int(raw.get("engram_num_heads", 8))
    bases, seed = raw["engram_vocab_bases"], int(raw.get("engram_seed", 0))
    bound = max(1, ((2 ** 31 - 1) // cfg.vocab_size) // 2)
    seen, out = set(), {}
    for l in layers:
        r = np.random.default_rng(seed + 10007 * l).integers(0, bound, size=N, dtype=np.int32)
        primes = []
        for n in range(N - 1):
            start = bases[n] - 1
            for _ in range(H):
                q = start + 1
                while not is_prime(q) or q in seen:
                    q += 1
                seen.add(q)
                primes.append(q)
                start = q
        out[l] = (2 * r.astype(np.int64) + 1, primes)
    return out


def engram_ids(tokens, mult, primes, N, H, pad):
    """Table rows [B, T, (N - 1) H] of each position's hashed 2..N-grams (offset per column)."""
    B, T = tokens.shape
    offsets = np.concatenate([[0], np.cumsum(primes)[:-1]]).astype(np.int64)
    back = [np.concatenate([np.full((B, j), pad, np.int64), tokens[:, :T - j].astype(np.int64)], axis=1)
            for j in range(N)]
    acc = back[0] * mult[0]
    ids = np.zeros((B, T, (N - 1) * H), np.int64)
    for n in range(1, N):
        acc = acc ^ (back[n] * mult[n])
        for h in range(H):
            c = (n - 1) * H + h
            ids[:, :, c] = offsets[c] + acc % primes[c]
    return ids


def mhc_streams(cfg):
    """k, the residual streams of a config.json (1: the plain residual)."""
    return int(cfg.raw.get("mhc_expansion_rate") or 1)


def rope(x, pos, freqs):
    """Rotates interleaved pairs (x[2i], x[2i+1]) by pos * f_i.
    x [B, T, d] or [B, T, H, d]; pos [B, T] float64."""
    ang = pos[..., None] * freqs  # [B, T, d/2]
    if x.dim() == 4:
        ang = ang[:, :, None, :]  # [B, T, 1, d/2]
    c, s = torch.cos(ang), torch.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)


class TrainRef:
    """Holds a checkpoint's tensors (float64) and computes the training loss.

    `params` maps Hugging Face names to float64 tensors; every one except the
    e_score_correction_bias tensors is trainable."""

    def __init__(self, model_dir):
        self.cfg, self.w = ref.load_model_dir(model_dir)
        self.freqs = self.cfg.rope_frequencies()
        self.scale = self.cfg.softmax_scale()
        self.last_logits = None  # main-model logits [B, T, V] of the latest forward
        self.last_sums = None  # its {lm_xent_sum, lm_weight, mtp_ce_sum, mtp_weight}

    @staticmethod
    def trainable(name):
        return not name.endswith("e_score_correction_bias")

    def trainable_names(self):
        return [n for n in self.w if self.trainable(n)]

    # --- one forward ------------------------------------------------------------
    def losses(self, params, batch, trace=None):
        """-> dict of 0-d float64 tensors (LOSS_NAMES). `params`: {name: tensor}, the
        trainable tensors (may require grad); missing names fall back to the checkpoint.
        `trace`, if a list, receives one dict per token per MoE layer describing its routing."""
        fw = _Forward(self, params, batch, trace)
        out = fw.run()
        self.last_logits, self.last_sums = fw.logits, fw.sums
        return out

    def loss_and_grads(self, batch, trace=None):
        """-> ({loss name: float}, {param name: float64 gradient of `loss`})."""
        names = self.trainable_names()
        params = {n: self.w[n].clone().requires_grad_(True) for n in names}
        out = self.losses(params, batch, trace)
        grads = torch.autograd.grad(out["loss"], [params[n] for n in names], allow_unused=True)
        g = {n: (gr if gr is not None else torch.zeros_like(params[n])).detach() for n, gr in zip(names, grads)}
        return {k: v.item() for k, v in out.items()}, g


class _Forward:
    def __init__(self, model, params, batch, trace):
        self.m, self.cfg, self.p, self.b, self.trace = model, model.cfg, params, batch, trace
        self.lb_terms = []
        self.logits = None  # main-model logits [B, T, V], kept for cross-checks
        self.sums = {}  # unnormalised loss sums and token counts, kept for cross-checks

    def W(self, name):
        if name in self.p:
            return self.p[name]
        if name not in self.m.w:
            raise KeyError(f"checkpoint lacks {name}")
        return self.m.w[name]

    def norm(self, x, name):
        return rms_norm(x, self.W(name), self.cfg.rms_norm_eps)

    # --- blocks -------------------------------------------------------------------
    def mlp(self, p, x):
        return linear(silu(linear(x, self.W(p + ".gate_proj.weight"))) * linear(x, self.W(p + ".up_proj.weight")),
                      self.W(p + ".down_proj.weight"))

    def mla(self, l, x, pos, mask):
        """x [B, T, D] (normed) -> [B, T, D]."""
        c = self.cfg
        p = f"model.layers.{l}.self_attn."
        B, T = x.shape[:2]
        H, n, r, vd, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank:
            q = linear(self.norm(linear(x, self.W(p + "q_a_proj.weight")), p + "q_a_layernorm.weight"),
                       self.W(p + "q_b_proj.weight"))
        else:
            q = linear(x, self.W(p + "q_proj.weight"))
        q = q.reshape(B, T, H, n + r)
        q_nope, q_pe = q[..., :n], rope(q[..., n:], pos, self.m.freqs)  # [B, T, H, n], [B, T, H, r]
        kv = linear(x, self.W(p + "kv_a_proj_with_mqa.weight"))  # [B, T, R + r]
        latent = self.norm(kv[..., :R], p + "kv_a_layernorm.weight")  # [B, T, R]
        k_pe = rope(kv[..., R:], pos, self.m.freqs)  # [B, T, r], shared by all heads
        kvb = linear(latent, self.W(p + "kv_b_proj.weight")).reshape(B, T, H, n + vd)
        k_nope, v = kvb[..., :n], kvb[..., n:]
        s = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
        s = (s * self.m.scale).masked_fill(~mask[:, None], float("-inf"))  # [B, H, Tq, Tk]
        o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), v).reshape(B, T, H * vd)
        return linear(o, self.W(p + "o_proj.weight"))

    def select(self, l, choice):
        """choice [N, E] float64 (no grad) -> selected experts [N, K] int64 (numpy).
        Ties go to the lower index (stable sort)."""
        c = self.cfg
        E, K, G = c.n_routed_experts, c.num_experts_per_tok, c.n_group
        ch = choice.numpy()
        sel = np.zeros((ch.shape[0], K), dtype=np.int64)
        for t in range(ch.shape[0]):
            row, info = ch[t].copy(), {"layer": l, "token": t, "choice": ch[t].copy()}
            if c.topk_method in ("noaux_tc", "group_limited_greedy"):
                gs = row.reshape(G, E // G)
                gscore = (np.sort(gs, axis=1)[:, ::-1][:, :2].sum(axis=1) if c.topk_method == "noaux_tc"
                          else gs.max(axis=1))
                keep = np.zeros(G, dtype=bool)
                keep[np.argsort(-gscore, kind="stable")[:c.topk_group]] = True
                row = np.where(np.repeat(keep, E // G), row, -np.inf)
                info["group_scores"] = gscore
            elif c.topk_method != "greedy":
                raise ValueError(c.topk_method)
            order = np.argsort(-row, kind="stable")
            sel[t] = order[:K]
            info["masked_choice"], info["order"], info["selected"] = row, order, order[:K]
            if self.trace is not None:
                self.trace.append(info)
        return sel

    def moe(self, l, x):
        """x [B, T, D] (normed) -> [B, T, D]; appends this layer's balance-loss term."""
        c = self.cfg
        p = f"model.layers.{l}.mlp"
        B, T, D = x.shape
        E, K = c.n_routed_experts, c.num_experts_per_tok
        xf = x.reshape(B * T, D)
        logits = linear(xf, self.W(p + ".gate.weight"))  # [N, E]
        if c.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits)
        elif c.scoring_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            raise ValueError(c.scoring_func)
        bname = p + ".gate.e_score_correction_bias"
        bias = self.m.w[bname] if c.topk_method == "noaux_tc" and bname in self.m.w else torch.zeros(E, dtype=F64)
        sel = self.select(l, scores.detach() + bias)  # integer choices, no gradient
        sel_t = torch.from_numpy(sel)
        wts = scores.gather(1, sel_t)  # [N, K], unbiased scores
        if c.norm_topk_prob:
            wts = wts / wts.sum(-1, keepdim=True)
        wts = wts * c.routed_scaling_factor
        out = torch.zeros_like(xf)
        for e in range(E):
            rows, ks = np.nonzero(sel == e)
            if rows.size == 0:
                continue
            rows_t, ks_t = torch.from_numpy(rows), torch.from_numpy(ks)
            y = self.mlp(f"{p}.experts.{e}", xf[rows_t])  # [n_e, D]
            out = out.index_add(0, rows_t, y * wts[rows_t, ks_t][:, None])
        if c.n_shared_experts > 0:
            out = out + self.mlp(p + ".shared_experts", xf)
        # Balance loss: softmax over experts of the biased scores; hits per sequence.
        w = self.b["load_balance_loss_weight"]
        prob = torch.softmax(scores + bias, dim=-1).reshape(B, T, E)
        hits = np.zeros((B, E))
        for bi in range(B):
            hits[bi] = np.bincount(sel.reshape(B, T, K)[bi].reshape(-1), minlength=E)
        f = torch.from_numpy(hits / T)  # [B, E]
        self.lb_terms.append(w * E * E * (f * prob.mean(1)).mean())
        return out.reshape(B, T, D)

    def layer(self, l, h, pos, mask):
        pre = f"model.layers.{l}."
        if l in (self.cfg.raw.get("engram_layers") or []):
            h = self.engram(l, h)
        ffn = (lambda x: self.moe(l, x)) if self.cfg.is_moe_layer(l) else (lambda x: self.mlp(pre + "mlp", x))
        if mhc_streams(self.cfg) > 1:
            h = self.mhc(pre + "mhc_attention", h,
                         lambda u: self.mla(l, self.norm(u, pre + "input_layernorm.weight"), pos, mask))
            return self.mhc(pre + "mhc_mlp", h, lambda u: ffn(self.norm(u, pre + "post_attention_layernorm.weight")))
        h = h + self.mla(l, self.norm(h, pre + "input_layernorm.weight"), pos, mask)
        return h + ffn(self.norm(h, pre + "post_attention_layernorm.weight"))

    def engram(self, l, x):
        """MaxText's Engram on x [B, T, k, D] (or [B, T, D] with one stream): x + o with
        o = u + silu(conv(norm(u))), u = gate * value of the looked-up rows."""
        raw, eps = self.cfg.raw, self.cfg.rms_norm_eps
        N, H = int(raw.get("engram_max_ngram_size", 3)), int(raw.get("engram_num_heads", 8))
        K = int(raw.get("engram_kernel_size", 4))
        mult, primes = engram_tables(self.cfg)[l]
        ids = torch.from_numpy(engram_ids(self.b["inputs"], mult, primes, N, H, int(raw.get("engram_pad_id", 0))))
        x4 = x if x.dim() == 4 else x[:, :, None, :]
        B, T, G, D = x4.shape
        p = f"model.layers.{l}.engram"
        w = lambda n: self.W(f"{p}.{n}")  # noqa: E731
        rms = lambda v, g: v * torch.rsqrt((v * v).mean(-1, keepdim=True) + eps) * g  # noqa: E731
        e = w("embedding.weight")[ids].reshape(B, T, -1)  # [B, T, C Dh]
        xh = rms(x4, self.W(f"model.layers.{l}.engram_layernorm.weight"))
        kh = rms((linear(e, w("key_proj.weight")) + w("key_proj.bias")).reshape(B, T, G, D),
                 w("k_norm.weight").reshape(G, D))
        qh = rms(xh, w("q_norm.weight").reshape(G, D))
        a = (qh * kh).sum(-1) / np.sqrt(D)
        alpha = torch.sigmoid(torch.sign(a) * torch.sqrt(torch.clamp(a.abs(), min=1e-6)))
        v = linear(e, w("value_proj.weight")) + w("value_proj.bias")  # [B, T, D]
        u = alpha[..., None] * v[:, :, None, :]  # [B, T, G, D]
        n = rms(u, w("short_conv.norm.weight").reshape(G, D)).reshape(B, T, G * D)
        conv = w("short_conv.weight")  # [K, G D]; tap r looks (K - 1 - r) N back
        y = torch.zeros_like(n)
        for r in range(K):
            back = (K - 1 - r) * N
            if back < T:
                y = y + conv[r] * torch.cat([torch.zeros(B, back, G * D, dtype=F64), n[:, :T - back]], dim=1)
        o = u + silu(y).reshape(B, T, G, D)
        out = x4 + o
        return out if x.dim() == 4 else out[:, :, 0, :]

    def mhc(self, p, x, branch):
        """One mHC module (tensors p.norm.weight [kD], p.fn [(2+k)k, kD], p.base [(2+k)k],
        p.scale [3]) around `branch` ([B, T, D] -> [B, T, D]); x [B, T, k, D] -> same.
        Per token: n = RMSNorm(x flattened stream-major); logits n fn^T split into k pre,
        k post and k*k res (row-major) entries; pre weights sigmoid(s0 h + b), post
        weights 2 sigmoid(s1 h + b), mixing matrix Sinkhorn(s2 H + B); the branch sees
        the pre-weighted sum of the streams; output stream m is sum_i M[i, m] x_i plus
        its post weight times the branch output."""
        B, T, k, D = x.shape
        n = self.norm(x.reshape(B, T, k * D), p + ".norm.weight")
        logits = n @ self.W(p + ".fn").t()  # [B, T, (2 + k) k]
        s, b = self.W(p + ".scale"), self.W(p + ".base")
        pre_w = torch.sigmoid(s[0] * logits[..., :k] + b[:k])  # [B, T, k]
        post_w = 2.0 * torch.sigmoid(s[1] * logits[..., k:2 * k] + b[k:2 * k])  # [B, T, k]
        res = (s[2] * logits[..., 2 * k:] + b[2 * k:]).reshape(B, T, k, k)  # [i, m]
        mix = sinkhorn_v1(res, int(self.cfg.raw.get("mhc_sinkhorn_iterations") or 20))
        f = branch(torch.einsum("bti,btid->btd", pre_w, x))
        return torch.einsum("btim,btid->btmd", mix, x) + post_w[..., None] * f[:, :, None, :]

    def head_weight(self):
        return self.W("model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight")

    # --- losses -------------------------------------------------------------------
    def run(self):
        c, b = self.cfg, self.b
        emb = self.W("model.embed_tokens.weight")
        pos = torch.from_numpy(b["positions"]).to(F64)
        mask = attention_mask(b["segment_ids"])
        h = emb[torch.from_numpy(b["inputs"])]  # [B, T, D]
        k = mhc_streams(c)
        if k > 1:
            if b["mtp_num_layers"] > 0:
                raise ValueError("MTP is not defined for mHC models")
            h = torch.stack([h] * k, dim=2)  # [B, T, k, D]: k copies, not divided by k
        for l in range(c.num_hidden_layers):
            h = self.layer(l, h, pos, mask)
        if k > 1:
            h = h.sum(dim=2)  # a plain sum over the streams

        z = linear(self.norm(h, "model.norm.weight"), self.head_weight())  # [B, T, V]
        self.logits = z.detach()
        lse = torch.logsumexp(z, dim=-1)
        zt = z.gather(-1, torch.from_numpy(b["targets"])[..., None])[..., 0]
        tmask = torch.from_numpy((b["target_segment_ids"] != 0).astype(np.float64))
        zterm = b["z_loss_multiplier"] * lse * lse
        wsum = tmask.sum()
        lm_loss = ((lse - zt + zterm) * tmask).sum() / (wsum + EPS)
        z_loss = (zterm * tmask).sum() / (wsum + EPS)
        self.sums = {"lm_xent_sum": ((lse - zt + zterm) * tmask).sum().item(), "lm_weight": wsum.item(),
                     "mtp_ce_sum": 0.0, "mtp_weight": 0.0}

        # Multi-token prediction. h_0 is the last hidden state before the final norm.
        D = b["mtp_num_layers"]
        mtp_loss = torch.zeros((), dtype=F64)
        if D > 0:
            ids, tgt = b["inputs"], b["targets"]
            tm = (b["target_segment_ids"] != 0).astype(np.int64)
            seg = b["segment_ids"]
            ce_sum, w_sum, hk = torch.zeros((), dtype=F64), 0.0, h
            for k in range(1, D + 1):
                ids, tgt, tm = (roll_left_in_segment(a, seg) for a in (ids, tgt, tm))
                seg = roll_left(seg)  # the boundary test of the next depth uses plainly shifted ids
                pre = f"model.layers.{c.num_hidden_layers + k - 1}."
                e = self.norm(emb[torch.from_numpy(ids)], pre + "enorm.weight")
                x = linear(torch.cat([e, self.norm(hk, pre + "hnorm.weight")], dim=-1), self.W(pre + "eh_proj.weight"))
                hk = self.layer(c.num_hidden_layers + k - 1, x, pos, mask)  # original positions and segments
                zk = linear(self.norm(hk, pre + "shared_head.norm.weight"), self.head_weight())
                ce = torch.logsumexp(zk, dim=-1) - zk.gather(-1, torch.from_numpy(tgt)[..., None])[..., 0]
                mk = torch.from_numpy(tm.astype(np.float64))
                ce_sum = ce_sum + (ce * mk).sum()
                w_sum += float(tm.sum())
            mtp_loss = b["mtp_loss_scaling_factor"] * ce_sum / (w_sum + EPS)
            self.sums["mtp_ce_sum"], self.sums["mtp_weight"] = ce_sum.item(), w_sum

        lb = torch.stack(self.lb_terms).mean() if self.lb_terms else torch.zeros((), dtype=F64)
        return {"loss": lm_loss + mtp_loss + lb, "lm_loss": lm_loss, "z_loss": z_loss,
                "mtp_loss": mtp_loss, "moe_lb_loss": lb}


def check_mtp_tensors(model, batch):
    """Raises if the batch asks for more MTP depths than the checkpoint holds."""
    c = model.cfg
    for k in range(1, batch["mtp_num_layers"] + 1):
        name = f"model.layers.{c.num_hidden_layers + k - 1}.eh_proj.weight"
        if name not in model.w:
            raise ValueError(f"mtp_num_layers {batch['mtp_num_layers']} but the checkpoint lacks {name}")


def main(argv):
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    torch.set_num_threads(1)
    model = TrainRef(argv[1])
    batch = load_batch(os.path.join(argv[1], "batch.json"))
    check_mtp_tensors(model, batch)
    vals, grads = model.loss_and_grads(batch)
    for k in LOSS_NAMES:
        print(f"{k:12s} {vals[k]:.12f}")
    gn = torch.sqrt(sum((g * g).sum() for g in grads.values())).item()
    print(f"grad norm    {gn:.12f} over {len(grads)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
