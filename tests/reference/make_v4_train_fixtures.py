#!/usr/bin/python3
"""Generates the DeepSeek-V4 training-gradient fixture v4_train_tiny.

  /usr/bin/python3 tests/reference/make_v4_train_fixtures.py --out DIR

writes DIR/v4_train_tiny/ (there is deliberately no default --out; the committed copy lives in
tests/data/v4/train/):
- config.json: make_v4_fixtures.tiny_config(), narrowed (hidden 32, 2 mHC streams, 4 experts of width 16,
  vocabulary 128), without MTP layer and without quantization_config,
  expert_dtype "fp8" (experts not packed fp4), compress_ratios [0, 4, 128, 4] (window, CSA, HCA, CSA),
  2 hash layers;
- model.safetensors: the upstream tensor names, shapes and random distributions of
  make_v4_fixtures.random_checkpoint, but EVERY tensor stored F32 (ffn.gate.tid2eid I64) and no
  `.scale` tensors: the float32 values are the weights themselves;
- batch.json: {"inputs": [B][T], "targets": [B][T]}, B = 2 rows of T = 136 tokens, targets the next
  tokens; each row is its own sequence at positions 0..T-1 (no packing);
- expected.safetensors (float64 values rounded to float32): `loss` [1] = mean over the B*T positions of
  the cross-entropy of the main logits (no MTP, no auxiliary loss), `logits` [B, T, V], and
  `grad.<name>` for every float tensor of the checkpoint (shape of the weight).

Everything is computed by deepseek_v4_ref.DeepSeekV4Ref with qat=False (no FP8/FP4 simulations), in
float64, gradients by torch autograd. The discrete choices (hash routing, score routing top-k, the
indexer's top-k) are constants: no gradient flows through them, so attn.indexer.* and the routing
biases ffn.gate.bias get zero gradients (kept in the file). The reference picks routed experts and
indexer entries with numpy on tensors that would carry gradient; the subclass GradV4Ref below makes
those choices under no_grad and feeds the chosen experts back through the reference's own
hash-routing path (the combine weights are the unbiased scores of the chosen experts in both paths),
so the reference itself is unchanged and its arithmetic is what gets differentiated.

Deterministic: numpy PCG64 with fixed seeds, one torch thread; a rerun writes byte-identical files.
A seed is skipped (the next one tried) when a routing top-k margin below ROUTE_MARGIN or an indexer
top-k gap below INDEX_MARGIN of the row's max |score| occurs (make_v4_fixtures.margins), so that a
float32 engine makes the same discrete choices, or when a SwiGLU input lies within CLAMP_MARGIN of the
clamp limit (swiglu_limit: the gradient jumps there, so an engine must clamp the same values).
Before writing, the generator checks
- that the loader returns exactly the float32 values written (make_v4_fixtures.check_loader);
- that the gradient-carrying forward gives the logits of the plain reference forward (1e-13) and
  makes the same routing / indexer choices;
- that exactly attn.indexer.* and ffn.gate.bias are outside the autograd graph;
- the autograd gradient against fourth-order central finite differences
  (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h, with the discrete choices and the SwiGLU clamp
  masks of the unperturbed forward held fixed (the smooth piece the gradient belongs to), on
  FD_PER_TENSOR random entries of each tensor in FD_TENSORS: relative error < FD_RTOL.
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
import deepseek_v4_ref as v4  # noqa: E402
import make_v4_fixtures as v4fx  # noqa: E402
from deepseek_ref import linear, silu  # noqa: E402
from make_model_fixtures import write_checkpoint  # noqa: E402

NAME = "v4_train_tiny"
SEED = 4100
MAX_ATTEMPTS = 200
B, T = 2, 136  # T >= 128: the HCA layer has one complete entry; the CSA indexer chooses among up to 34
ROUTE_MARGIN = v4fx.ROUTE_MARGIN
INDEX_MARGIN = v4fx.INDEX_MARGIN
# smallest allowed |v - limit| over the SwiGLU clamps (gate <= limit, -limit <= up <= limit): the loss has a kink
# there, and an engine clamping a value the other way gets a different gradient
CLAMP_MARGIN = 3e-5
FD_SEED = 12345
FD_STEP = 1e-3
FD_RTOL = 1e-6
FD_MIN_GRAD = 1e-5  # entries checked: |grad| >= max(FD_MIN_GRAD, 1e-3 max |grad of the tensor|)
FD_PER_TENSOR = 3
# "{expert}": the routed expert of layer 3 that most tokens chose
FD_TENSORS = ["embed.weight", "layers.1.attn.wkv.weight", "layers.2.attn.compressor.wgate.weight",
              "layers.1.hc_attn_fn", "layers.3.ffn.experts.{expert}.w2.weight", "layers.0.ffn.gate.weight",
              "hc_head_base", "layers.2.attn.attn_sink", "layers.1.attn.compressor.ape",
              "layers.3.attn.compressor.wkv.weight", "layers.3.attn.wo_a.weight", "layers.2.ffn.gate.weight",
              "layers.0.hc_ffn_scale", "norm.weight", "head.weight"]


def config():
    # Narrower than the inference fixtures (every value is stored as float32, and so is its gradient): hidden 32,
    # 2 mHC streams, 4 experts of width 16, vocabulary 128.
    cj = v4fx.tiny_config(num_nextn_predict_layers=0, expert_dtype="fp8", compress_ratios=[0, 4, 128, 4],
                          num_hash_layers=2, sliding_window=8, index_topk=4, vocab_size=128, hidden_size=32,
                          hc_mult=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          q_lora_rank=16, o_lora_rank=8, index_n_heads=2)
    del cj["quantization_config"]
    return cj


# ---------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------


class F32Writer(v4fx.Writer):
    """make_v4_fixtures.Writer with every float tensor stored F32: the same random draws in the same order
    (the 2^k gains per 128x128 block of the would-be fp8 weights included), rounded to float32 only."""

    def bf16(self, n, a):
        self.f32(n, a)

    def fp8(self, n, shape, std, w=None):
        if w is None:
            w = self.normal(shape, std)
        self.f32(n, w * self._block_gain(shape, 128, 128))

    def fp4(self, n, shape, std):
        raise ValueError("the training fixture has no fp4 experts")


def f32_checkpoint(cj, rng):
    """make_v4_fixtures.random_checkpoint (its tensor list, shapes, distributions) with F32Writer."""
    saved = v4fx.Writer
    v4fx.Writer = F32Writer  # random_checkpoint looks the class up in its module at call time
    try:
        wr = v4fx.random_checkpoint(cj, rng, "hub")
    finally:
        v4fx.Writer = saved
    assert isinstance(wr, F32Writer)
    for name, dt, _, _ in wr.raw:
        assert dt == ("I64" if name.endswith("tid2eid") else "F32") and not name.endswith(".scale"), name
    return wr


# ---------------------------------------------------------------------------
# differentiable forward
# ---------------------------------------------------------------------------


class GradV4Ref(v4.DeepSeekV4Ref):
    """DeepSeekV4Ref whose discrete choices are made without gradient (the reference calls .numpy() on the
    routing and indexer scores, which autograd refuses on tensors that require grad) and recorded per forward
    in self.record, together with which SwiGLU inputs are clamped and how close any comes to the limit.
    When self.frozen is such a record, the choices and the clamp masks are taken from it instead: the loss
    restricted to the smooth piece of the unperturbed forward, for finite differences.
    Score routing reuses the reference's hash-routing path with the chosen experts as a one-off tid2eid table
    (token ids 0..T-1): both paths combine the chosen experts with their unbiased scores."""

    record = None
    frozen = None

    def indexer(self, p, a, qr, pos, freqs, layer):
        if self.frozen is not None:
            return self.frozen[("index", layer)]
        with torch.no_grad():
            sel = super().indexer(p, a, qr, pos, freqs, layer)
        self.record[("index", layer)] = sel
        return sel

    def _route(self, p, x, ids, layer):
        outer, self.trace = self.trace, {}
        try:
            with torch.no_grad():
                super().moe(p, x.detach(), ids, False, layer)
            rec = self.trace["route"][0]
        finally:
            self.trace = outer
        if outer is not None:
            outer.setdefault("route", []).append(rec)
        return torch.from_numpy(rec["order"][:, :self.cfg.num_experts_per_tok].copy())

    def moe(self, p, x, ids, hashed, layer):
        if hashed:
            return super().moe(p, x, ids, True, layer)
        if self.frozen is not None:
            idx = self.frozen[("route", layer)]
        else:
            idx = self.record[("route", layer)] = self._route(p, x, ids, layer)
        name = p + "gate.tid2eid"
        assert name not in self.ints
        self.ints[name] = idx
        try:
            return super().moe(p, x, torch.arange(x.shape[0]), True, layer)
        finally:
            del self.ints[name]

    def swiglu(self, p, x):
        lim = self.cfg.swiglu_limit
        if lim <= 0:
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
    named tensor, the discrete choices and SwiGLU clamp masks held at those of the unperturbed forward.
    -> list of (name, index, autograd, fd)."""
    rng = np.random.default_rng(FD_SEED)
    out, failures = [], []
    try:
        for n in names:
            g = grads[n].reshape(-1)
            cand = torch.nonzero(g.abs() >= max(FD_MIN_GRAD, 1e-3 * g.abs().max().item())).reshape(-1).numpy()
            if cand.size == 0:
                raise AssertionError(f"{n}: no gradient entry of at least {FD_MIN_GRAD:g}, nothing to check")
            for i in sorted(rng.choice(cand, size=min(FD_PER_TENSOR, cand.size), replace=False).tolist()):
                f = {}
                for m in (1, -1, 2, -2):
                    t = base[n].clone()
                    t.view(-1)[i] += m * FD_STEP
                    model.w = dict(base)
                    model.w[n] = t
                    with torch.no_grad():
                        f[m] = batch_loss(model, inputs, targets, frozen=records)[0].item()
                fd = (8.0 * (f[1] - f[-1]) - (f[2] - f[-2])) / (12.0 * FD_STEP)
                a = g[i].item()
                out.append((n, i, a, fd))
                if not abs(fd - a) < FD_RTOL * abs(a):
                    failures.append(f"d loss / d {n}[{i}]: autograd {a:.15e}, finite difference {fd:.15e}, "
                                    f"relative error {abs(fd - a) / abs(a):.2e}")
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
    cfg0 = v4.V4Config(cj)
    V = cfg0.vocab_size
    for attempt in range(MAX_ATTEMPTS):
        seed = SEED + attempt
        rng = np.random.default_rng(seed)
        wr = f32_checkpoint(cj, rng)
        toks = rng.integers(0, V, size=(B, T + 1))
        inputs, targets = toks[:, :T].tolist(), toks[:, 1:].tolist()
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cj, f, indent=2)
            f.write("\n")
        write_checkpoint(d, wr.raw, 1)
        plain = v4.DeepSeekV4Ref(d, qat=False)
        v4fx.check_loader(plain, wr)
        with torch.no_grad():
            plain_logits, _, traces = v4fx.run_traced(plain, inputs)
        rep = v4fx.margins(plain, inputs, traces)
        bad = []
        if rep["route"] < ROUTE_MARGIN:
            bad.append(f"routing margin {rep['route']:.2e}")
        if rep["index"] < INDEX_MARGIN:
            bad.append(f"indexer gap {rep['index']:.2e}")
        if not bad:
            # gradients: every float weight a float64 leaf
            model = GradV4Ref(d, qat=False)
            names = [n for n, dt, _, _ in wr.raw if dt == "F32"]
            assert sorted(names) == sorted(model.w), "float tensors of the checkpoint vs the loader's weight dict"
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
            print(f"  {NAME}: seed {seed} rejected ({', '.join(bad)})")
            continue
        break
    else:
        raise RuntimeError(f"{NAME}: no seed with clear margins")

    ldiff = max((a - b).abs().max().item() for a, b in zip(logits, plain_logits))
    assert ldiff <= 1e-13, f"gradient-carrying forward differs from the plain reference by {ldiff:.3e}"
    for b, tr in enumerate(traces):  # the records are the plain forward's choices
        for e in tr["route"]:
            assert (records[b][("route", e["layer"])].numpy() == e["order"][:, :cfg0.num_experts_per_tok]).all()
        for e in tr["index"]:
            assert (records[b][("index", e["layer"])] == e["selected"]).all()
    no_grad = [n for n in names if model.w[n].grad is None]
    outside = [n for n in names if ".attn.indexer." in n or n.endswith("ffn.gate.bias")]
    assert no_grad == outside, f"tensors outside the autograd graph: {no_grad}, expected {outside}"
    grads = {n: (model.w[n].grad if model.w[n].grad is not None else torch.zeros_like(model.w[n])).detach()
             for n in names}
    zero = [n for n in names if n not in outside and not grads[n].abs().max() > 0]
    base = {n: t.detach() for n, t in model.w.items()}
    model.w = base

    usage3 = route_usage(records, 3, cfg0.n_routed_experts)
    fd_names = [n.format(expert=int(np.argmax(usage3))) for n in FD_TENSORS]
    t0 = time.time()
    fd = fd_check(model, inputs, targets, base, grads, records, fd_names)
    fd_s = time.time() - t0

    write_batch(os.path.join(d, "batch.json"), inputs, targets)
    lg = torch.stack(logits).detach()
    exp = [("loss", "F32", [1], np.array([loss.item()], dtype="<f4").tobytes()),
           ("logits", "F32", list(lg.shape), lg.numpy().astype("<f4").tobytes())]
    for n in names:
        exp.append(("grad." + n, "F32", list(grads[n].shape), grads[n].numpy().astype("<f4").tobytes()))
    dr.write_safetensors_raw(os.path.join(d, "expected.safetensors"), exp,
                             {"generator": "tests/reference/make_v4_train_fixtures.py",
                              "note": "float64 loss (mean cross-entropy over B*T), logits and gradients of "
                                      "loss (deepseek_v4_ref, qat off), rounded to float32"})

    n_params = sum(base[n].numel() for n in names)
    masks = [v for r in records for k, v in r.items() if isinstance(k, tuple) and k[0] == "clamp"]
    n_clamped = sum(int(m.sum()) for ms in masks for m in ms)
    n_clamp_in = sum(2 * ms[0].numel() for ms in masks)
    print(f"{NAME}: seed {seed}, B {B} x T {T}, {len(names)} float tensors ({n_params} values), "
          f"loss {loss.item():.12f} (ln V = {np.log(V):.4f}), logits std {lg.std().item():.3f} "
          f"max|.| {lg.abs().max().item():.3f}")
    print(f"  routing: {rep['route_rows']} score-routed rows, min top-k margin {rep['route']:.3e}; expert usage "
          + "; ".join(f"layer {k}: {v.tolist()}" for k, v in rep["usage"].items()))
    print(f"  indexer: {rep['index_rows']} rows with more than {cfg0.index_topk} visible entries, min relative "
          f"top-k gap {rep['index']:.3e}, {rep['index_not_recent']} rows not the most recent entries; "
          f"HCA entries per row: {rep['hca_entries']}")
    print(f"  SwiGLU clamps (limit {cfg0.swiglu_limit:g}): {n_clamped} of {n_clamp_in} inputs clamped, min "
          f"|value - limit| {clamp_gap:.3e}")
    print(f"  forward + backward {grad_s:.1f} s; gradient forward vs plain reference: max logit diff {ldiff:.1e}")
    print(f"  zero gradients: {len(outside)} tensors outside the graph (attn.indexer.*, ffn.gate.bias)"
          + (f", and {zero}" if zero else ", no other"))
    for n in ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.hc_attn_fn",
              "layers.1.attn.wq_a.weight", "layers.1.attn.compressor.wkv.weight", "layers.2.attn.compressor.ape",
              "layers.2.attn.attn_sink", "layers.3.attn.wo_b.weight", "layers.0.ffn.gate.weight",
              "layers.3.ffn.shared_experts.w2.weight"]:
        print(f"    max |grad {n}| {grads[n].abs().max().item():.3e}")
    worst = max(abs(f - a) / abs(a) for _, _, a, f in fd)
    print(f"  finite differences (h {FD_STEP:g}, fourth order, choices and clamp masks held): {len(fd)} entries of "
          f"{len(fd_names)} tensors, max relative error {worst:.2e} ({fd_s:.1f} s)")
    for n, i, a, f in fd:
        print(f"    {n}[{i}]: autograd {a:+.12e}  fd {f:+.12e}  rel {abs(f - a) / abs(a):.1e}")
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
