#!/usr/bin/python3
"""Generates the DeepSeek-V4.1 training-gradient fixture v41_train_tiny.

  /usr/bin/python3 tests/reference/make_v41_train_fixtures.py --out DIR

writes DIR/v41_train_tiny/ (there is deliberately no default --out; the committed copy lives in
tests/data/v41/train/):
- config.json: make_v41_fixtures.root_config() for float weights (root `deepseek_v41` with its `text_config`, no
  quantization_config), narrowed: hidden 32, 2 mHC streams, 2 heads of 32 dims (rope 8), o_lora_rank 16; the rest
  as v41_tiny (vocabulary 64, 6 layers with compress_ratios [0, 2, 2, 1, 1, 1], KV sources [1, 3], index sources
  [1, 3, 5], candidate source 3, 4 experts top-2 + 1 shared, Engram on layers 0 and 2 with 420 / 508 rows);
- tokenizer.json: the v41 fixtures' tokenizer (ids 2k, 2k+1 in Engram token class k);
- model.safetensors: the hub tensor names, shapes and random distributions of make_v41_fixtures.random_checkpoint,
  with its align_indexers() shaping (measured on this batch), EVERY tensor stored F32 and no `.scale` tensors: the
  float32 values are the weights themselves;
- batch.json: {"inputs": [B][T], "targets": [B][T]}, B = 2 rows of T = 40 tokens, targets the next tokens; each row
  is its own sequence at positions 0..T-1 (no packing); ids below image_token_id (63);
- expected.safetensors (float64 values rounded to float32): `loss` [1] = mean over the B*T positions of the
  cross-entropy of the main logits (no MTP, no auxiliary loss), `logits` [B, T, V], and `grad.<name>` for every
  tensor of the checkpoint (shape of the weight).

Everything is computed by deepseek_v41_ref.DeepSeekV41Ref with qat=False (no FP8/FP4 simulations), in float64,
gradients by torch autograd. The discrete choices (score routing top-k, the index sources' top-k, the candidate
blocks) are constants: no gradient flows through them, so attn.indexer.* and the routing biases ffn.gate.bias get
zero gradients, as does ffn.gate.bias_vl, which the text forward never reads (all kept in the file). An Engram table
gets gradient only in the rows the batch's hash ids look up. The reference picks experts, index entries and
candidate blocks with numpy on tensors that would carry gradient; the subclass GradV41Ref below makes those choices
under no_grad (with the reference's own code) and records them. Its MoE repeats the reference's combination of the
chosen experts (unbiased scores / (sum + 1e-20) * routed_scaling_factor, the clamped SwiGLU, the shared expert) with
the recorded choice; the check below requires it to give the reference's logits.

Deterministic: numpy PCG64 with fixed seeds, one torch thread; a rerun writes byte-identical files.
A seed is skipped (the next one tried) when a routing top-k margin below ROUTE_MARGIN, or an indexer top-k gap or a
candidate-block gap below INDEX_MARGIN of the row's max |score| occurs (make_v41_fixtures.margins), so that a float32
engine makes the same discrete choices; when a SwiGLU input lies within CLAMP_MARGIN of the clamp limit, or an
Engram gate's |dot| below DOT_MARGIN (the gate is sigmoid(sign(dot) sqrt(max(|dot|, 1e-6)))): the gradient jumps or
is steep there; when align_indexers() finds no common input direction; or when the candidate restriction changes
fewer than MIN_RESTRICTED_ROWS rows of the batch (coverage).
Before writing, the generator checks
- that the loader returns exactly the float32 values written (make_v4_fixtures.check_loader), and the tokenizer's
  token classes;
- that the gradient-carrying forward gives the logits of the plain reference forward (1e-13) and makes the same
  routing / indexer / candidate choices;
- that exactly attn.indexer.*, ffn.gate.bias and ffn.gate.bias_vl are outside the autograd graph, and that the
  Engram tables' gradient rows that are nonzero are exactly the rows looked up;
- the autograd gradient against fourth-order central finite differences
  (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h, with the discrete choices and the SwiGLU clamp masks of the
  unperturbed forward held fixed (the smooth piece the gradient belongs to), on FD_PER_TENSOR random entries of each
  tensor in FD_TENSORS: relative error < FD_RTOL. The step h is the largest of FD_STEPS at which no Engram gate's dot
  moves by more than DOT_FD_MOVE of its value (so no gate crosses its kink and its sqrt stays nearly linear).
It also reports, without checking, how much the logits and gradients move when every weight moves by a relative
2^-24 (a float32 rounding), as a guide to the tolerance of a float32 engine.
"""

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref as dr  # noqa: E402
import deepseek_v41_ref as v41  # noqa: E402
import make_v4_fixtures as mk4  # noqa: E402
import make_v41_fixtures as mk41  # noqa: E402
from deepseek_ref import linear, silu  # noqa: E402
from deepseek_v4_ref import softplus  # noqa: E402
from make_model_fixtures import write_checkpoint  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "v41_train_tiny"
SEED = 41700
MAX_ATTEMPTS = 200
B, T = 2, 40  # T = 40: the window (8) slides, 20 ratio-2 and 40 ratio-1 entries, up to 10 candidate blocks
ROUTE_MARGIN = mk41.ROUTE_MARGIN
INDEX_MARGIN = mk41.INDEX_MARGIN
# smallest allowed |v - limit| over the SwiGLU clamps (gate <= limit, -limit <= up <= limit): the loss has a kink
# there, and an engine clamping a value the other way gets a different gradient
CLAMP_MARGIN = 3e-5
# smallest allowed |dot| of an Engram gate: alpha = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) has a kink at dot = 0
# and the slope 1 / (2 sqrt|dot|) near it
DOT_MARGIN = 1e-3
MIN_RESTRICTED_ROWS = 4  # rows of the batch whose picks of an index source the candidate restriction changes
FD_SEED = 12345
# the steps tried, largest first: the first at which no Engram gate's dot moves by more than DOT_FD_MOVE of its value
# over w +- 2h is used. The gate is sqrt(|dot|)-shaped, the smallest dots are a few 1e-3, and some single weights move
# a dot by ~1 per unit (at h = 1e-3 such a dot changes sign); the fourth-order error of that dot's term grows as the
# fourth power of its relative move (at a move of 0.1, relative errors up to 4e-7 were seen), and the rounding error
# of the difference quotient is about 1e-15 / h absolute.
FD_STEPS = (1e-3, 2.5e-4, 6.25e-5, 1.5625e-5)
DOT_FD_MOVE = 0.03
FD_RTOL = 1e-6
FD_MIN_GRAD = 1e-5  # entries checked: |grad| >= max(FD_MIN_GRAD, 1e-3 max |grad of the tensor|)
FD_PER_TENSOR = 3
# "{expert}": the routed expert of that layer that most tokens chose
FD_TENSORS = [
    "embed.weight", "norm.weight", "head.weight",
    "layers.0.engram.embed.weight", "layers.2.engram.embed.weight", "layers.0.engram.wkv.weight",
    "layers.2.engram.wkv.weight", "layers.0.engram.q_weight", "layers.2.engram.q_weight", "layers.0.engram.k_weight",
    "layers.2.engram.k_weight",
    "layers.0.hc_attn_fn", "layers.0.hc_ffn_base", "layers.2.hc_attn_scale", "layers.3.hc_ffn_fn",
    "layers.5.hc_attn_base", "layers.5.hc_ffn_scale",
    "layers.0.attn_norm.weight", "layers.4.ffn_norm.weight",
    "layers.1.attn.wq_a.weight", "layers.2.attn.q_norm.weight", "layers.5.attn.wq_b.weight",
    "layers.0.attn.wkv.weight", "layers.4.attn.kv_norm.weight", "layers.0.attn.attn_sink", "layers.2.attn.attn_sink",
    "layers.3.attn.wo_a.weight", "layers.1.attn.wo_b.weight",
    "layers.1.attn.compressor.wkv.weight", "layers.1.attn.compressor.wgate.weight",
    "layers.1.attn.compressor.norm.weight", "layers.3.attn.compressor.wkv.weight",
    "layers.3.attn.compressor.norm.weight",
    "layers.0.ffn.gate.weight", "layers.4.ffn.gate.weight", "layers.3.ffn.experts.{expert}.w1.weight",
    "layers.3.ffn.experts.{expert}.w2.weight", "layers.5.ffn.experts.{expert}.w3.weight",
    "layers.1.ffn.shared_experts.w1.weight", "layers.2.ffn.shared_experts.w2.weight",
    "layers.5.ffn.shared_experts.w3.weight",
]


def config():
    """make_v41_fixtures.root_config(quantized=False) narrowed: every value is stored as float32, and so is its
    gradient."""
    cj = mk41.root_config(False)
    assert "quantization_config" not in cj
    t = cj["text_config"]
    t.update(hidden_size=32, hc_mult=2, num_attention_heads=2, head_dim=32, qk_rope_head_dim=8, o_lora_rank=16)
    want = {"vocab_size": 64, "num_hidden_layers": 6, "compress_ratios": [0, 2, 2, 1, 1, 1],
            "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5], "candidate_source_layer_id": 3,
            "candidate_topk_blocks": 2, "candidate_block_size": 4, "q_lora_rank": 32, "o_groups": 2,
            "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "engram_layer_ids": [0, 2],
            "engram_num_embeddings": [420, 508], "engram_pad_token_id": 2, "engram_compressed_vocab_size": 32,
            "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 16, "engram_vocab_size": 100,
            "scoring_func": "sqrtsoftplus", "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
            "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                             "beta_slow": 1}}
    for k, v in want.items():
        assert t[k] == v, (k, t[k], v)
    return cj


# ---------------------------------------------------------------------------
# differentiable forward
# ---------------------------------------------------------------------------


class GradV41Ref(v41.DeepSeekV41Ref):
    """DeepSeekV41Ref whose discrete choices are made without gradient (the reference calls .numpy() on the routing,
    indexer and candidate-block scores, which autograd refuses on tensors that require grad) and recorded per
    forward in self.record, together with which SwiGLU inputs are clamped, how close any comes to the limit, and the
    Engram gates' dots. When self.frozen is such a record, the choices and the clamp masks are taken from it instead
    (and the Engram gates' branches are checked to be the same): the loss restricted to the smooth piece of the
    unperturbed forward, for finite differences."""

    record = None
    frozen = None
    _routing = False  # inside the no_grad routing pass of moe()

    def index_select(self, L, p, a, qr, pos, freqs, keys, vis, sh):
        if self.frozen is not None:
            return self.frozen[("index", L)]
        with torch.no_grad():  # the reference's own indexer (and candidate blocks at the candidate source)
            sel = super().index_select(L, p, a, qr, pos, freqs, keys, vis, sh)
        self.record[("index", L)] = sel
        if L == self.cfg.candidate_source:
            self.record[("cand", L)] = sh["cand"]
        return sel

    def _route(self, p, x, layer):
        """the reference's routing of x (its MoE run without gradient) -> chosen experts [T, K]."""
        outer, self.trace = self.trace, {}
        self._routing = True
        try:
            with torch.no_grad():
                super().moe(p, x.detach(), layer)
            rec = self.trace["route"][0]
        finally:
            self.trace, self._routing = outer, False
        if outer is not None:
            outer.setdefault("route", []).append(rec)
        return torch.from_numpy(rec["order"][:, :self.cfg.num_experts_per_tok].copy())

    def moe(self, p, x, layer):
        """DeepSeekV41Ref.moe with the chosen experts idx held constant: the same arithmetic after the top-k."""
        c = self.cfg
        K = c.num_experts_per_tok
        if self.frozen is not None:
            idx = self.frozen[("route", layer)]
        else:
            idx = self.record[("route", layer)] = self._route(p, x, layer)
        logits = linear(x, self.W(p + "gate.weight")) / c.gate_temp
        if c.scoring_func == "sqrtsoftplus":
            s = torch.sqrt(softplus(logits))
        elif c.scoring_func == "sigmoid":
            s = torch.sigmoid(logits)
        else:
            s = torch.softmax(logits, dim=-1)
        wts = s.gather(1, idx)
        if c.norm_topk_prob and K > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + v41.MOE_NORM_EPS)
        wts = wts * c.routed_scaling_factor
        out = torch.zeros_like(x)
        for e in range(c.n_routed_experts):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, wts[rows, slot, None] * self.swiglu(f"{p}experts.{e}.", x[rows]))
        if c.n_shared_experts:
            out = out + self.swiglu(p + "shared_experts.", x)
        return out

    def swiglu(self, p, x):
        lim = self.cfg.swiglu_limit
        if lim <= 0 or self._routing:
            return super().swiglu(p, x)
        if self.frozen is None:
            with torch.no_grad():
                gate = linear(x, self.W(p + "w1.weight"))
                up = linear(x, self.W(p + "w3.weight"))
                self.record[("clamp", p)] = (gate > lim, up > lim, up < -lim)
                if x.shape[0]:
                    gap = min((gate - lim).abs().min().item(), (up.abs() - lim).abs().min().item())
                    self.record["clamp_gap"] = min(self.record.get("clamp_gap", np.inf), gap)
            return super().swiglu(p, x)  # the reference's clamps, differentiated by autograd
        g_hi, u_hi, u_lo = self.frozen[("clamp", p)]
        gate = linear(x, self.W(p + "w1.weight"))
        up = linear(x, self.W(p + "w3.weight"))
        full = torch.full_like(gate, lim)
        gate = torch.where(g_hi, full, gate)
        up = torch.where(u_hi, full, torch.where(u_lo, -full, up))
        return linear(silu(gate) * up, self.W(p + "w2.weight"))

    def _tr(self, key, rec):
        if key == "engram" and self.record is not None:
            dot = rec["dot"].detach()
            k = ("engram", rec["layer"])
            if self.frozen is None:
                self.record[k] = dot
            else:  # how far the gates' dots moved, relative to their unperturbed values
                ref = self.frozen[k]
                move = ((dot - ref).abs() / ref.abs()).max().item()
                self.record["dot_move"] = max(self.record.get("dot_move", 0.0), move)
        super()._tr(key, rec)

    def row(self, tokens, frozen=None):
        """-> (logits [T, V], record of the discrete choices)."""
        self.record, self.frozen = {}, frozen
        try:
            return self.forward(tokens), self.record
        finally:
            self.record, self.frozen = None, None


def batch_loss(model, inputs, targets, frozen=None):
    """-> (mean cross-entropy over all B*T positions, logits per row, records per row)."""
    total, logits, records = 0.0, [], []
    for b in range(len(inputs)):
        lg, rec = model.row(inputs[b], frozen[b] if frozen is not None else None)
        total = total + torch.nn.functional.cross_entropy(lg, torch.tensor(targets[b]), reduction="sum")
        logits.append(lg)
        records.append(rec)
    return total / sum(len(r) for r in inputs), logits, records


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def fd_check(model, inputs, targets, base, grads, records, names):
    """Autograd vs fourth-order central finite differences on FD_PER_TENSOR random entries (among those with
    |grad| >= max(FD_MIN_GRAD, 1e-3 max |grad| of the tensor), where a relative comparison is meaningful) of each
    named tensor, the discrete choices and SwiGLU clamp masks held at those of the unperturbed forward. The step is
    the first of FD_STEPS at which no Engram gate's dot moves by more than DOT_FD_MOVE of its value (the gate is
    sqrt(|dot|)-shaped: a larger relative move makes the difference quotient inaccurate, or crosses its kink).
    -> list of (name, index, autograd, fd, step)."""
    rng = np.random.default_rng(FD_SEED)
    out, failures = [], []
    try:
        for n in names:
            g = grads[n].reshape(-1)
            cand = torch.nonzero(g.abs() >= max(FD_MIN_GRAD, 1e-3 * g.abs().max().item())).reshape(-1).numpy()
            if cand.size == 0:
                raise AssertionError(f"{n}: no gradient entry of at least {FD_MIN_GRAD:g}, nothing to check")
            for i in sorted(rng.choice(cand, size=min(FD_PER_TENSOR, cand.size), replace=False).tolist()):
                a = g[i].item()
                for h in FD_STEPS:
                    f, move = {}, 0.0
                    for m in (1, -1, 2, -2):
                        t = base[n].clone()
                        t.view(-1)[i] += m * h
                        model.w = dict(base)
                        model.w[n] = t
                        with torch.no_grad():
                            loss, _, recs = batch_loss(model, inputs, targets, frozen=records)
                        f[m] = loss.item()
                        move = max([move] + [r.get("dot_move", 0.0) for r in recs])
                    if move <= DOT_FD_MOVE:
                        break
                else:
                    failures.append(f"d loss / d {n}[{i}]: an Engram dot moves by {move:.2e} of its value even at "
                                    f"step {h:g}")
                    continue
                fd = (8.0 * (f[1] - f[-1]) - (f[2] - f[-2])) / (12.0 * h)
                out.append((n, i, a, fd, h))
                if not abs(fd - a) < FD_RTOL * abs(a):
                    failures.append(f"d loss / d {n}[{i}]: autograd {a:.15e}, finite difference {fd:.15e} (step "
                                    f"{h:g}), relative error {abs(fd - a) / abs(a):.2e}")
    finally:
        model.w = base
    if failures:
        raise AssertionError("gradient check failed:\n  " + "\n  ".join(failures))
    return out


def route_usage(records, layer, E):
    u = np.zeros(E, dtype=int)
    for rec in records:
        np.add.at(u, rec[("route", layer)].numpy().reshape(-1), 1)
    return u


def tensor_class(n):
    """layers.L.ffn.experts.E.w1.weight -> ffn.experts.*.w1.weight"""
    parts = n.split(".")
    if parts[0] == "layers":
        parts = parts[2:]
    return ".".join("*" if (i and parts[i - 1] == "experts") else x for i, x in enumerate(parts))


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def write_batch(path, inputs, targets):
    with open(path, "w") as f:
        f.write("{\n")
        for k, v, sep in (("inputs", inputs, ","), ("targets", targets, "")):
            rows = ",\n    ".join(json.dumps(r, separators=(", ", ": ")) for r in v)
            f.write(f'  "{k}": [\n    {rows}\n  ]{sep}\n')
        f.write("}\n")


def build(root):
    d = os.path.join(root, NAME)
    cj = config()
    cfg0 = v41.V41Config(cj)
    V = cfg0.vocab_size
    for attempt in range(MAX_ATTEMPTS):
        seed = SEED + attempt
        rng = np.random.default_rng(seed)
        wr = mk41.random_checkpoint(cfg0, rng, "f32")
        toks = rng.integers(0, mk41.IMAGE_TOKEN_ID, size=(B, T + 1))
        inputs, targets = toks[:, :T].tolist(), toks[:, 1:].tolist()
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cj, f, indent=2)
            f.write("\n")
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(mk41.make_tokenizer(), f, indent=1, ensure_ascii=False)
            f.write("\n")
        mk41.check_tokenizer(os.path.join(d, "tokenizer.json"), V)
        committed = os.path.join(REPO, "tests", "data", "v41", "models", "v41_tiny", "tokenizer.json")
        if os.path.exists(committed):
            with open(committed, "rb") as f, open(os.path.join(d, "tokenizer.json"), "rb") as g:
                assert f.read() == g.read(), "tokenizer.json differs from the v41_tiny fixture's"
        write_checkpoint(d, wr.raw, 1)
        bad = []
        why = mk41.align_indexers(d, wr, inputs, cfg0, rng)
        if why:
            bad.append(why)
        else:
            plain = v41.DeepSeekV41Ref(d, qat=False)
            mk4.check_loader(plain, wr)
            with torch.no_grad():
                plain_logits, traces = mk41.run_traced(plain, inputs)
            rep = mk41.margins(plain, traces)
            if rep["route"] < ROUTE_MARGIN:
                bad.append(f"routing margin {rep['route']:.2e}")
            if rep["index"] < INDEX_MARGIN:
                bad.append(f"indexer gap {rep['index']:.2e}")
            if rep["cand"] < INDEX_MARGIN:
                bad.append(f"candidate-block gap {rep['cand']:.2e}")
            restricted = sum(sum(v) for v in rep["restricted"].values())
            if restricted < MIN_RESTRICTED_ROWS:
                bad.append(f"candidate restriction changes only {restricted} rows")
            dot_gap = min(e["dot"].abs().min().item() for tr in traces for e in tr["engram"])
            if dot_gap < DOT_MARGIN:
                bad.append(f"Engram |dot| {dot_gap:.2e}")
        if not bad:
            # gradients: every weight a float64 leaf
            model = GradV41Ref(d, qat=False)
            names = [n for n, dt, _, _ in wr.raw]
            assert all(dt == "F32" and not n.endswith(".scale") for n, dt, _, _ in wr.raw)
            assert sorted(names) == sorted(model.w), "tensors of the checkpoint vs the loader's weight dict"
            for n in names:
                model.w[n] = model.w[n].detach().clone().requires_grad_(True)
            t0 = time.time()
            loss, logits, records = batch_loss(model, inputs, targets)
            loss.backward()
            grad_s = time.time() - t0
            clamp_gap = min(r["clamp_gap"] for r in records)
            if clamp_gap < CLAMP_MARGIN:
                bad.append(f"SwiGLU clamp margin {clamp_gap:.2e}")
        if bad:
            print(f"  {NAME}: seed {seed} rejected ({', '.join(bad)})", flush=True)
            continue
        break
    else:
        raise RuntimeError(f"{NAME}: no seed with clear margins")

    # the gradient-carrying forward is the reference's forward, with the same choices
    ldiff = max((a - b).abs().max().item() for a, b in zip(logits, plain_logits))
    assert ldiff <= 1e-13, f"gradient-carrying forward differs from the plain reference by {ldiff:.3e}"
    K = cfg0.num_experts_per_tok
    n_choices = 0
    for b, tr in enumerate(traces):
        for e in tr["route"]:
            assert (records[b][("route", e["layer"])].numpy() == e["order"][:, :K]).all()
            n_choices += 1
        for e in tr["index"]:
            assert (records[b][("index", e["layer"])] == e["selected"]).all()
            n_choices += 1
        for e in tr["cand"]:
            assert (records[b][("cand", e["layer"])] == e["keep"].repeat_interleave(cfg0.candidate_block_size, 1)
                    [:, :records[b][("cand", e["layer"])].shape[1]]).all()
            n_choices += 1
        for e in tr["engram"]:
            assert (records[b][("engram", e["layer"])] == e["dot"]).all()
    # which tensors are outside the graph
    no_grad = [n for n in names if model.w[n].grad is None]
    outside = [n for n in names if ".attn.indexer." in n or n.endswith("ffn.gate.bias") or n.endswith("gate.bias_vl")]
    assert no_grad == outside, f"tensors outside the autograd graph: {no_grad}, expected {outside}"
    grads = {n: (model.w[n].grad if model.w[n].grad is not None else torch.zeros_like(model.w[n])).detach()
             for n in names}
    zero = [n for n in names if n not in outside and not grads[n].abs().max() > 0]
    assert not zero, f"tensors in the graph with an all-zero gradient: {zero}"
    # Engram tables: gradient exactly in the rows looked up
    lay = plain.engram
    looked = {}
    for e, L in enumerate(cfg0.engram_layers):
        rows = sorted(set(np.concatenate([plain.hash_ids(s)[:, e].reshape(-1) for s in inputs]).tolist()))
        g = grads[f"layers.{L}.engram.embed.weight"]
        nz = torch.nonzero(g.abs().sum(-1) > 0).reshape(-1).tolist()
        assert nz == rows, f"layer {L}: Engram rows with gradient differ from the rows looked up"
        looked[L] = (len(rows), lay.rows[e])
    base = {n: t.detach() for n, t in model.w.items()}
    model.w = base

    E = cfg0.n_routed_experts
    fd_names = []
    for n in FD_TENSORS:
        if "{expert}" in n:
            n = n.format(expert=int(np.argmax(route_usage(records, int(n.split(".")[1]), E))))
        assert n in base, n
        fd_names.append(n)
    t0 = time.time()
    fd = fd_check(model, inputs, targets, base, grads, records, fd_names)
    fd_s = time.time() - t0

    # conditioning (report only): the gradients again after every weight is multiplied by 1 + u 2^-24, u uniform in
    # [-1, 1] (the size of a float32 rounding), the choices and clamp masks held
    prng = np.random.default_rng(FD_SEED + 1)
    model.w = {n: (base[n] * (1.0 + torch.from_numpy(prng.uniform(-1.0, 1.0, tuple(base[n].shape))) * 2.0 ** -24))
               .requires_grad_(True) for n in names}
    loss_p, logits_p, _ = batch_loss(model, inputs, targets, frozen=records)
    loss_p.backward()
    grads_p = {n: model.w[n].grad for n in names if n not in outside}
    model.w = base
    sens_logits = max((a - b).abs().max().item() for a, b in zip(logits_p, logits))

    write_batch(os.path.join(d, "batch.json"), inputs, targets)
    lg = torch.stack(logits).detach()
    exp = [("loss", "F32", [1], np.array([loss.item()], dtype="<f4").tobytes()),
           ("logits", "F32", list(lg.shape), lg.numpy().astype("<f4").tobytes())]
    for n in names:
        exp.append(("grad." + n, "F32", list(grads[n].shape), grads[n].numpy().astype("<f4").tobytes()))
    dr.write_safetensors_raw(os.path.join(d, "expected.safetensors"), exp,
                             {"generator": "tests/reference/make_v41_train_fixtures.py",
                              "note": "float64 loss (mean cross-entropy over B*T), logits and gradients of "
                                      "loss (deepseek_v41_ref, qat off), rounded to float32"})

    # report
    n_params = sum(base[n].numel() for n in names)
    masks = [v for r in records for k, v in r.items() if isinstance(k, tuple) and k[0] == "clamp"]
    n_gate = sum(int(ms[0].sum()) for ms in masks)
    n_up = sum(int(ms[1].sum() + ms[2].sum()) for ms in masks)
    n_clamp_in = sum(ms[0].numel() for ms in masks)
    print(f"{NAME}: seed {seed}, B {B} x T {T}, {len(names)} tensors ({n_params} values), "
          f"loss {loss.item():.12f} (ln V = {np.log(V):.4f}), logits std {lg.std().item():.3f} "
          f"max|.| {lg.abs().max().item():.3f}")
    print(f"  routing: {rep['route_rows']} rows, min top-k margin {rep['route']:.3e}; expert usage "
          + "; ".join(f"layer {k}: {v.tolist()}" for k, v in rep["usage"].items()))
    print(f"  indexer: rows with more visible entries than index_topk {cfg0.index_topk}: {rep['index_rows']}; min "
          f"relative top-k gap {rep['index']:.3e}; {rep['index_not_recent']} rows not the most recent entries")
    print(f"  candidate blocks: {rep['cand_rows']} rows with more reachable blocks than candidate_topk_blocks, min "
          f"relative block gap {rep['cand']:.3e}; rows whose picks the candidate restriction changes: "
          + ", ".join(f"layer {k}: {sum(v)} of {B * T}" for k, v in rep["restricted"].items()))
    print(f"  Engram: alpha in [{rep['alpha'][0]:.3f}, {rep['alpha'][1]:.3f}], min |dot| {dot_gap:.3e}; rows looked "
          "up " + ", ".join(f"layer {L}: {a} of {r}" for L, (a, r) in looked.items()))
    print(f"  SwiGLU clamps (limit {cfg0.swiglu_limit:g}): {n_gate} gates and {n_up} ups of {n_clamp_in} clamped, "
          f"min |value - limit| {clamp_gap:.3e}")
    print(f"  forward + backward {grad_s:.1f} s; gradient forward vs plain reference: max logit diff {ldiff:.1e}; "
          f"{n_choices} choice records equal")
    print(f"  zero gradients: {len(outside)} tensors outside the graph (attn.indexer.*, ffn.gate.bias, "
          f"ffn.gate.bias_vl), no other")
    print("  gradient magnitudes per tensor class (over layers / experts): max |grad|, rms, the smallest max |grad| "
          f"of a tensor; and the max |change| of the gradient, relative to the tensor's max |grad|, when every weight "
          f"moves by a relative 2^-24 (logits move by {sens_logits:.1e}, the loss by {abs(loss_p - loss).item():.1e})")
    classes = {}
    for n in names:
        if n not in outside:
            classes.setdefault(tensor_class(n), []).append(n)
    for k, ns in classes.items():
        flat = torch.cat([grads[n].reshape(-1) for n in ns])
        sens = max(((grads_p[n] - grads[n]).abs().max() / grads[n].abs().max()).item() for n in ns)
        print(f"    {k:32s} {flat.abs().max().item():.3e}  {flat.pow(2).mean().sqrt().item():.3e}  "
              f"{min(grads[n].abs().max().item() for n in ns):.3e}  {sens:.1e}  ({len(ns)} tensors)")
    worst = max(abs(f - a) / abs(a) for _, _, a, f, _ in fd)
    steps = {h: sum(1 for x in fd if x[4] == h) for h in FD_STEPS}
    print("  finite differences (fourth order, choices and clamp masks held; entries per step "
          + ", ".join(f"h {h:g}: {k}" for h, k in steps.items()) + f"): {len(fd)} entries of {len(fd_names)} tensors, "
          f"max relative error {worst:.2e} ({fd_s:.1f} s)")
    for n, i, a, f, h in fd:
        print(f"    {n}[{i}]: autograd {a:+.12e}  fd {f:+.12e}  h {h:g}  rel {abs(f - a) / abs(a):.1e}")
    sizes = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    print("  files: " + ", ".join(f"{f} {s} B" for f, s in sizes.items())
          + f"; total {sum(sizes.values()) / 1024:.1f} KiB")
    return d


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help=f"root folder; the fixture goes to OUT/{NAME}")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # deterministic float64 reductions
    os.makedirs(a.out, exist_ok=True)
    build(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
