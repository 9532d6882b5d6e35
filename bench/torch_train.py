#!/usr/bin/python3
"""One DeepSeek training step (forward + backward) in PyTorch eager mode (float32, CPU).

The competitor for bench/train_step_bench.cc: the same model (MLA with q-LoRA and
YaRN RoPE, DeepSeekMoE with group-limited top-k routing and shared experts, dense
first layers) and the same loss (mean cross-entropy over the targets; no MTP, no
z-loss, no balance loss), written for speed the way a competent PyTorch user would:
batched matmuls, fused gate|up and q_a|kv_a projections, experts that each run
once on the tokens routed to them (gathered with index_select after a sort by
expert, scattered back with index_add), F.cross_entropy, loss.backward(),
gradients reset with set_to_none. Autograd is on for the whole step; nothing runs
under torch.no_grad. The routing decisions (top-k over the scores plus the
correction bias) are integers without gradient; the combine weights come from the
unbiased scores and are differentiated, as in tests/reference/train_ref.py.

Only torch and numpy are needed (Debian's python3-torch / python3-numpy, run with
/usr/bin/python3). The YAML preset reader, the safetensors loader and the config
rules (YaRN frequencies, softmax scale) are the ones bench/torch_generate.py and
tests/reference/deepseek_ref.py use.

Usage:
  torch_train.py --config configs/small.yml --batch 8 --seq 128 [--threads T]
                 [--warmup W] [--steps N] [--seed S] [--weights DIR]
      Random weights (N(0, 0.02) matrices, unit norms, zero routing bias, as
      train_step_bench initialises them) or a checkpoint folder (--weights, which
      then also gives the config), and random input and target tokens. Runs W
      untimed steps, then N timed ones, and prints one JSON line:
        {"impl": "torch", "step_ms": median ms per step,
         "tokens_per_s": batch * seq / median seconds, "loss": ..., ...}
  torch_train.py --check [--deepseek BIN]
      Correctness in float32 against float64 results:
      - tests/data/train/v2_plain: loss and every parameter gradient against the
        fixture (made by tests/reference/train_ref.py);
      - tests/data/train/v3_packed: the LM loss (with its z-loss term; packed
        documents, so per-row positions and segment masks);
      - a random checkpoint of configs/tiny.yml: loss and gradients on a random
        batch against tests/reference/train_ref.py directly;
      - with --deepseek BIN: random float32 checkpoints of tiny and small made by
        `BIN init --dtype f32`, the loss here against the cross-entropy of the
        logits `BIN logits` computes for the same tokens.
      Exits 1 on a mismatch.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

# Debian's torch runs elementwise ops on an OpenMP pool and matmuls in OpenBLAS
# (its own pthread pool); with libgomp's default spin-waiting the two pools fight
# over the cores between ops. Idle OpenMP workers sleep unless the caller chose a
# policy (see bench/torch_generate.py). Must come before the first torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

from deepseek_ref import Config, raw_to_f64, read_safetensors_raw, write_safetensors_raw  # noqa: E402
from torch_generate import hf_config_from_yaml, load_weights_f32, select_experts  # noqa: E402

F32 = torch.float32
EPS = 1e-8  # added to the target count, as the engine's loss does

# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, freqs_cis):
    """Rotates the interleaved pairs (x[2i], x[2i+1]) of x [B, T, h, r] as complex
    numbers, as DeepSeek's own model.py does; freqs_cis [T, 1, r/2] or [B, T, 1, r/2]."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2)


def param(shape):
    return torch.nn.Parameter(torch.empty(shape, dtype=F32))


class Mlp(torch.nn.Module):
    """SwiGLU with gate and up in one [2F, D] weight: down(silu(gate x) * up x)."""

    def __init__(self, d, f):
        super().__init__()
        self.f = f
        self.gate_up = param((2 * f, d))
        self.down = param((d, f))

    def forward(self, x):
        g, u = F.linear(x, self.gate_up).split(self.f, dim=-1)
        return F.linear(F.silu(g) * u, self.down)

    def hf(self, p):
        """(Hugging Face name, parameter, first row) of the checkpoint tensors stored here."""
        return [(p + ".gate_proj.weight", self.gate_up, 0), (p + ".up_proj.weight", self.gate_up, self.f),
                (p + ".down_proj.weight", self.down, 0)]


class Attention(torch.nn.Module):
    """Multi-head latent attention over a whole sequence (training: no cache)."""

    def __init__(self, c):
        super().__init__()
        D, H = c.hidden_size, c.num_attention_heads
        self.H, self.n, self.r, self.vd, self.R = H, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.ql = c.q_lora_rank
        self.eps = c.rms_norm_eps
        # x -> [q latent (or q itself without q-LoRA) | kv latent | shared k_pe] in one
        # product: q_a (or q_proj) and kv_a_proj_with_mqa fused.
        self.q_rows = self.ql if self.ql else H * (self.n + self.r)
        self.a = param((self.q_rows + self.R + self.r, D))
        if self.ql:
            self.q_a_norm = param((self.ql,))
            self.q_b = param((H * (self.n + self.r), self.ql))
        self.kv_a_norm = param((self.R,))
        self.kv_b = param((H * (self.n + self.vd), self.R))
        self.o = param((D, H * self.vd))

    def forward(self, x, freqs_cis, mask, scale):
        B, T, _ = x.shape
        H, n, r, vd = self.H, self.n, self.r, self.vd
        a = F.linear(x, self.a)
        q, kv_lat, k_pe = a.split([self.q_rows, self.R, r], dim=-1)
        if self.ql:
            q = F.linear(rms_norm(q, self.q_a_norm, self.eps), self.q_b)
        q = q.view(B, T, H, n + r)
        q_nope, q_pe = q.split([n, r], dim=-1)
        q_pe = rope(q_pe, freqs_cis)
        k_pe = rope(k_pe.unsqueeze(2), freqs_cis)  # [B, T, 1, r], shared by the heads
        kv = F.linear(rms_norm(kv_lat, self.kv_a_norm, self.eps), self.kv_b).view(B, T, H, n + vd)
        k_nope, v = kv.split([n, vd], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, T, n + r]
        k = torch.cat((k_nope, k_pe.expand(B, T, H, r)), dim=-1).transpose(1, 2)
        s = torch.matmul(q * scale, k.transpose(2, 3)) + mask  # [B, H, T, T]
        o = torch.matmul(F.softmax(s, dim=-1), v.transpose(1, 2))  # [B, H, T, vd]
        return F.linear(o.transpose(1, 2).reshape(B, T, H * vd), self.o)

    def hf(self, p):
        out = []
        if self.ql:
            out += [(p + "q_a_proj.weight", self.a, 0), (p + "q_a_layernorm.weight", self.q_a_norm, None),
                    (p + "q_b_proj.weight", self.q_b, None)]
        else:
            out += [(p + "q_proj.weight", self.a, 0)]
        return out + [(p + "kv_a_proj_with_mqa.weight", self.a, self.q_rows),
                      (p + "kv_a_layernorm.weight", self.kv_a_norm, None), (p + "kv_b_proj.weight", self.kv_b, None),
                      (p + "o_proj.weight", self.o, None)]


class Moe(torch.nn.Module):
    """Routed experts (each runs once on the rows routed to it) plus shared experts."""

    def __init__(self, c):
        super().__init__()
        D, E = c.hidden_size, c.n_routed_experts
        self.c = c
        self.router = param((E, D))
        self.register_buffer("bias", torch.zeros(E, dtype=F32))  # e_score_correction_bias: no gradient
        self.experts = torch.nn.ModuleList(Mlp(D, c.moe_intermediate_size) for _ in range(E))
        self.shared = Mlp(D, c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else None

    def route(self, x):
        """x [N, D] -> (expert ids [N, k], combine weights [N, k] with gradient)."""
        c = self.c
        logits = F.linear(x, self.router)
        if c.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        elif c.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            raise ValueError(f"scoring_func {c.scoring_func} not supported")
        choice = scores.detach()  # which experts: an integer decision, no gradient
        if c.topk_method == "noaux_tc":
            choice = choice + self.bias
        return select_experts(c, scores, choice)

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        idx, weights = self.route(x)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort()  # (token, slot) pairs grouped by expert
        rows = order.div(k, rounding_mode="floor")  # their token rows
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        xs = x.index_select(0, rows).split(counts)  # each expert's rows, gathered once
        ys = [self.experts[e](xe) for e, xe in enumerate(xs) if counts[e]]
        y = torch.cat(ys) * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = y.new_zeros(x.shape).index_add(0, rows, y)  # (y is bf16 under autocast)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(B, T, D)

    def hf(self, p):
        out = [(p + "gate.weight", self.router, None)]
        for e, m in enumerate(self.experts):
            out += m.hf(f"{p}experts.{e}")
        if self.shared is not None:
            out += self.shared.hf(p + "shared_experts")
        return out


class Layer(torch.nn.Module):
    def __init__(self, c, l):
        super().__init__()
        self.eps = c.rms_norm_eps
        self.input_norm = param((c.hidden_size,))
        self.post_norm = param((c.hidden_size,))
        self.attn = Attention(c)
        self.moe = c.is_moe_layer(l)
        self.ffn = Moe(c) if self.moe else Mlp(c.hidden_size, c.intermediate_size)

    def forward(self, h, freqs_cis, mask, scale):
        h = h + self.attn(rms_norm(h, self.input_norm, self.eps), freqs_cis, mask, scale)
        return h + self.ffn(rms_norm(h, self.post_norm, self.eps))

    def hf(self, p):
        return ([(p + "input_layernorm.weight", self.input_norm, None),
                 (p + "post_attention_layernorm.weight", self.post_norm, None)] + self.attn.hf(p + "self_attn.") +
                self.ffn.hf(p + "mlp." if self.moe else p + "mlp"))


class DeepSeekTrain(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = param((c.vocab_size, c.hidden_size))
        self.layers = torch.nn.ModuleList(Layer(c, l) for l in range(c.num_hidden_layers))
        self.norm = param((c.hidden_size,))
        self.lm_head = None if c.tie_word_embeddings else param((c.vocab_size, c.hidden_size))
        self.scale = c.softmax_scale()
        self.inv_freq = c.rope_frequencies()  # float64 [r/2], YaRN-blended

    def freqs_cis(self, positions):
        """e^(i pos f) as complex64: [T, 1, r/2] for positions [T], [B, T, 1, r/2] for [B, T]."""
        ang = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq
        return torch.polar(torch.ones_like(ang), ang).to(torch.complex64).unsqueeze(-2)

    def hf_pieces(self):
        """(Hugging Face name, parameter, first row or None for the whole tensor) of every
        checkpoint tensor, routing biases excluded (they are buffers)."""
        out = [("model.embed_tokens.weight", self.embed, None)]
        for l, L in enumerate(self.layers):
            out += L.hf(f"model.layers.{l}.")
        out.append(("model.norm.weight", self.norm, None))
        if self.lm_head is not None:
            out.append(("lm_head.weight", self.lm_head, None))
        return out

    @torch.no_grad()  # initialisation and loading only, never in the step
    def init_random(self, seed, std=0.02):
        """N(0, std) matrices, unit norms, zero routing bias (train_step_bench's init)."""
        g = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)

    @torch.no_grad()
    def load(self, w):
        """w: {Hugging Face name: float32 tensor}."""
        for name, p, row in self.hf_pieces():
            t = w[name]
            if row is None:
                p.copy_(t)
            else:
                p[row:row + t.shape[0]].copy_(t)
        for l, L in enumerate(self.layers):
            if L.moe:
                b = w.get(f"model.layers.{l}.mlp.gate.e_score_correction_bias")
                L.ffn.bias.copy_(b if b is not None else torch.zeros_like(L.ffn.bias))

    def hf_grads(self):
        """{Hugging Face name: gradient} (the fused weights split back)."""
        out = {}
        for name, p, row in self.hf_pieces():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if row is None:
                out[name] = g
            else:
                n = self._piece_rows(name, p, row)
                out[name] = g[row:row + n]
        return out

    def _piece_rows(self, name, p, row):
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return p.shape[0] // 2
        if name.endswith(("q_a_proj.weight", "q_proj.weight")):
            return self.c.q_lora_rank or self.c.num_attention_heads * (self.c.qk_nope_head_dim +
                                                                        self.c.qk_rope_head_dim)
        return p.shape[0] - row  # kv_a_proj_with_mqa: the rest

    def forward(self, inputs, targets, positions=None, segment_ids=None, target_mask=None, z_loss=0.0):
        """Mean cross-entropy of targets [B, T] given inputs [B, T] (long). positions and
        segment_ids [B, T] describe packed documents (query i sees key j iff same segment
        and j <= i); without them every row is one causal sequence at positions 0..T-1.
        target_mask [B, T] float: which targets count (all when None)."""
        B, T = inputs.shape
        if positions is None:
            freqs_cis = self.freqs_cis(torch.arange(T))
            mask = torch.full((T, T), float("-inf")).triu_(1)
        else:
            freqs_cis = self.freqs_cis(positions)
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
            mask = torch.zeros(B, 1, T, T).masked_fill_(~allowed.unsqueeze(1), float("-inf"))
        h = F.embedding(inputs, self.embed)
        for L in self.layers:
            h = L(h, freqs_cis, mask, self.scale)
        head = self.embed if self.lm_head is None else self.lm_head
        z = F.linear(rms_norm(h, self.norm, self.c.rms_norm_eps), head).view(B * T, -1)
        t = targets.reshape(-1)
        if z_loss:
            lse = torch.logsumexp(z, dim=-1)
            xent = lse - z.gather(1, t.unsqueeze(1)).squeeze(1) + z_loss * lse * lse
        else:
            xent = F.cross_entropy(z, t, reduction="none")
        if target_mask is None:
            return xent.sum() / (B * T + EPS)
        m = target_mask.reshape(-1)
        return (xent * m).sum() / (m.sum() + EPS)


def build_model(config_path=None, weights=None, seed=0):
    if weights:
        with open(os.path.join(weights, "config.json")) as f:
            c = Config(json.load(f))
        model = DeepSeekTrain(c)
        model.load(load_weights_f32(weights, c))
    else:
        c = Config(hf_config_from_yaml(config_path))
        model = DeepSeekTrain(c)
        model.init_random(seed)
    return model


def train_step(model, inputs, targets, precision="f32"):
    """One training step as timed: reset the gradients, forward, backward. With
    precision bf16 the forward runs under torch.autocast("cpu", bfloat16), as a
    PyTorch user trains in bf16 with float32 weights (the backward follows the
    forward's dtypes)."""
    model.zero_grad(set_to_none=True)
    if precision == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(inputs, targets)
    else:
        loss = model(inputs, targets)
    loss.backward()
    return loss


# ---------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------


def bench(args):
    torch.set_num_threads(args.threads)
    model = build_model(args.config, args.weights, args.seed)
    c = model.c
    gen = torch.Generator().manual_seed(args.seed + 1)
    inputs = torch.randint(0, c.vocab_size, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, c.vocab_size, (args.batch, args.seq), generator=gen)
    first = None
    for _ in range(args.warmup):  # untimed: allocator growth, first-touch of the gradients
        loss = train_step(model, inputs, targets, args.precision)
        first = first if first is not None else loss.item()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(model, inputs, targets, args.precision)
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    nparams = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "impl": "torch",
        "config": args.weights or args.config,
        "batch": args.batch,
        "seq": args.seq,
        "step_ms": round(med * 1e3, 3),
        "step_ms_min": round(min(times) * 1e3, 3),
        "step_ms_max": round(max(times) * 1e3, 3),
        "tokens_per_s": round(args.batch * args.seq / med, 3),
        "loss_first": first,  # about ln(vocab) on random init
        "ln_vocab": math.log(c.vocab_size),
        "parameters": nparams,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__,
        "precision": args.precision,
    }))
    return 0


# ---------------------------------------------------------------------------
# --check
# ---------------------------------------------------------------------------


def rel_err(a, b):
    """max |a - b| relative to max |b| (float64)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def load_batch_json(path):
    with open(path) as f:
        j = json.load(f)
    t = {k: torch.tensor(j[k], dtype=torch.long) for k in ("inputs", "targets", "positions", "segment_ids",
                                                           "target_segment_ids")}
    t["z_loss_multiplier"] = float(j.get("z_loss_multiplier", 0.0))
    t["plain"] = (j.get("mtp_num_layers", 0) == 0 and float(j.get("load_balance_loss_weight", 0.0)) == 0.0)
    return t


def check_fixture(d, tol):
    """Loss (and, where the fixture's loss is the LM loss alone, every gradient) of a
    tests/data/train fixture against its float64 expectation."""
    name = os.path.basename(d)
    model = build_model(weights=d)
    b = load_batch_json(os.path.join(d, "batch.json"))
    expected, _ = read_safetensors_raw(os.path.join(d, "expected.safetensors"))
    model.zero_grad(set_to_none=True)
    loss = model(b["inputs"], b["targets"], b["positions"], b["segment_ids"],
                 (b["target_segment_ids"] != 0).to(F32), b["z_loss_multiplier"])
    loss.backward()
    want = raw_to_f64(*expected["lm_loss"]).item()
    errs = {"lm_loss": abs(loss.item() - want) / abs(want)}
    if b["plain"]:  # loss == lm_loss: the fixture's gradients are this loss's
        worst, worst_name = 0.0, ""
        for n, g in model.hf_grads().items():
            e = rel_err(g, raw_to_f64(*expected["grad." + n]))
            if e > worst:
                worst, worst_name = e, n
        errs["grads"] = worst
        detail = f", worst gradient {worst_name}"
    else:
        detail = " (gradients not compared: the fixture's include MTP and balance-loss terms)"
    ok = all(e <= tol for e in errs.values())
    print(f"{name}: loss {loss.item():.7f} vs {want:.7f}; relative errors "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + detail + (" ok" if ok else " MISMATCH"))
    return ok


def random_checkpoint(model, out_dir):
    """Writes model's parameters as a float32 Hugging Face checkpoint."""
    c = model.c
    tensors = [(n, "F32", list(t.shape), t.detach().contiguous().numpy().astype("<f4").tobytes())
               for n, t in ((n, (p if row is None else p[row:row + model._piece_rows(n, p, row)]))
                            for n, p, row in model.hf_pieces())]
    for l, L in enumerate(model.layers):
        if L.moe and c.topk_method == "noaux_tc":
            tensors.append((f"model.layers.{l}.mlp.gate.e_score_correction_bias", "F32", [c.n_routed_experts],
                            L.ffn.bias.numpy().astype("<f4").tobytes()))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c.raw, f)
    write_safetensors_raw(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})


def check_against_train_ref(tmp, tol):
    """A random tiny-preset checkpoint (random routing bias, so that the bias matters)
    and a random 2 x 48 batch: loss and gradients against train_ref.py in float64."""
    import train_ref  # float64 reference of the training loss (slow; small shapes only)

    model = build_model(os.path.join(ROOT, "configs", "tiny.yml"), seed=3)
    with torch.no_grad():  # setup only: larger weights give sharper, less tied routing
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
        for L in model.layers:
            if L.moe:
                L.ffn.bias.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(4))
    d = os.path.join(tmp, "tiny_ref")
    random_checkpoint(model, d)
    B, T, V = 2, 48, model.c.vocab_size
    g = torch.Generator().manual_seed(5)
    inputs, targets = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    model.zero_grad(set_to_none=True)
    loss = model(inputs, targets)
    loss.backward()
    ref = train_ref.TrainRef(d)
    pos = np.tile(np.arange(T), (B, 1))
    batch = {"inputs": inputs.numpy(), "targets": targets.numpy(), "positions": pos,
             "segment_ids": np.ones((B, T), dtype=np.int64), "target_segment_ids": np.ones((B, T), dtype=np.int64),
             "z_loss_multiplier": 0.0, "load_balance_loss_weight": 0.0, "mtp_num_layers": 0,
             "mtp_loss_scaling_factor": 0.0}
    vals, grads = ref.loss_and_grads(batch)
    el = abs(loss.item() - vals["loss"]) / vals["loss"]
    eg = max(rel_err(gr, grads[n]) for n, gr in model.hf_grads().items())
    ok = el <= tol and eg <= tol
    print(f"tiny preset, random weights, batch {B} x {T}, vs train_ref.py: loss {loss.item():.7f} vs "
          f"{vals['loss']:.7f}; relative errors loss {el:.1e}, worst gradient {eg:.1e} {'ok' if ok else 'MISMATCH'}")
    return ok


def check_against_engine(binary, tmp, tol):
    """Random f32 checkpoints of tiny and small from `deepseek init`; the loss here on
    random tokens against the float64 cross-entropy of the engine's `logits`."""
    ok = True
    for preset, B, T in (("tiny", 2, 64), ("small", 2, 128)):
        d = os.path.join(tmp, preset)
        subprocess.run([binary, "init", "--config", os.path.join(ROOT, "configs", preset + ".yml"), "--out", d,
                        "--seed", "1", "--dtype", "f32"], check=True, stdout=subprocess.DEVNULL)
        model = build_model(weights=d)
        V = model.c.vocab_size
        g = torch.Generator().manual_seed(11)
        seqs = torch.randint(0, V, (B, T + 1), generator=g)
        inputs, targets = seqs[:, :-1], seqs[:, 1:]
        tok_file, out_file = os.path.join(tmp, preset + ".json"), os.path.join(tmp, preset + ".logits.safetensors")
        with open(tok_file, "w") as f:
            json.dump(inputs.tolist(), f)
        subprocess.run([binary, "logits", "--model", d, "--tokens", tok_file, "--out", out_file], check=True,
                       stdout=subprocess.DEVNULL)
        got, _ = read_safetensors_raw(out_file)
        ce = []
        for i in range(B):
            z = raw_to_f64(*got[f"logits.{i}"])  # [T, V]
            ce.append(torch.logsumexp(z, -1) - z.gather(1, targets[i].unsqueeze(1)).squeeze(1))
        theirs = torch.cat(ce).mean().item()
        ours = model(inputs, targets).item()
        e = abs(ours - theirs) / theirs
        good = e <= tol
        ok &= good
        print(f"{preset} preset, `deepseek init --dtype f32` weights, batch {B} x {T}: loss here {ours:.7f}, "
              f"from the engine's logits {theirs:.7f} (ln V = {math.log(V):.4f}); relative error {e:.1e} "
              f"{'ok' if good else 'MISMATCH'}")
    return ok


def check(args, tol=1e-4):
    torch.set_num_threads(args.threads)
    ok = True
    for name in ("v2_plain", "v3_packed"):
        ok &= check_fixture(os.path.join(ROOT, "tests", "data", "train", name), tol)
    with tempfile.TemporaryDirectory() as tmp:
        ok &= check_against_train_ref(tmp, tol)
        if args.deepseek:
            ok &= check_against_engine(args.deepseek, tmp, tol)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


# ---------------------------------------------------------------------------


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "small.yml"), help="YAML preset")
    ap.add_argument("--weights", help="Hugging Face checkpoint folder (its config.json replaces --config)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=5, help="timed steps; the median is reported")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    ap.add_argument("--precision", choices=("f32", "bf16"), default="f32",
                    help="bf16: the forward under torch.autocast(\"cpu\", dtype=torch.bfloat16)")
    ap.add_argument("--check", action="store_true", help="check losses and gradients, then exit")
    ap.add_argument("--deepseek", help="with --check: the deepseek binary, to compare with its logits")
    args = ap.parse_args(argv)
    if args.check:
        return check(args)
    if min(args.batch, args.seq, args.threads, args.steps) < 1 or args.warmup < 0:
        ap.error("--batch, --seq, --threads and --steps must be positive, --warmup not negative")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
