#!/usr/bin/python3
"""Generates the training-loss fixtures under tests/data/train/.

Each fixture folder holds a random Hugging Face-format checkpoint (config.json +
model.safetensors, every tensor F32), batch.json (one packed batch and the loss
settings) and expected.safetensors with the float64 values computed by
train_ref.py: `loss`, `lm_loss`, `z_loss`, `mtp_loss`, `moe_lb_loss` (shape [1])
and `grad.<tensor name>` for every tensor except the routing correction biases.

  /usr/bin/python3 tests/reference/make_train_fixtures.py [--out DIR] [NAME ...]
  /usr/bin/python3 tests/reference/make_train_fixtures.py --check [--fd] [NAME ...]

Deterministic: numpy's PCG64 generator with fixed seeds, one torch thread. A
seed is skipped (the next one tried) if any routing decision of the main or the
MTP layers is within MARGIN of a tie, so that a float32 engine makes the same
choices. Before writing, the generator
- checks the main logits of every document against deepseek_ref.DeepSeekRef (a
  separate, unbatched forward) to 1e-10; for mHC fixtures, which deepseek_ref
  does not model, train_ref's mHC against published test vectors instead;
- checks that the masked LM and MTP loss sums of the packed batch equal the
  sums over its documents run one at a time;
- checks the autograd gradient of each loss term against fourth-order central
  finite differences on sampled entries of every parameter tensor.
--check recomputes the losses and gradients from the committed checkpoint and
batch and compares them with expected.safetensors; with --fd it also repeats the
finite-difference check.
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
import deepseek_ref as ref  # noqa: E402
import train_ref  # noqa: E402
from make_model_fixtures import routing_report  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARGIN = 1e-3  # smallest allowed gap at a routing decision boundary
FD_STEP = 1e-4  # finite-difference step on one parameter entry
FD_RTOL = 1e-6  # allowed |autograd - finite difference| relative to |autograd| ...
FD_ATOL = 1e-10  # ... plus this, for the rounding noise of the loss differences over h
CHECK_RTOL, CHECK_ATOL = 1e-7, 1e-30  # recomputation vs committed values (float32-rounded)

# ---------------------------------------------------------------------------
# fixture definitions
# ---------------------------------------------------------------------------


def fixture_specs():
    v3 = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 12,
        # With rope dim 8 and original length 16, DeepSeek's betas 32/1 give the correction
        # range [0, 1], so smooth = [1, 0, 0, 0]: only the first frequency is left unscaled.
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    v2 = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "rope_scaling": None,
        "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        # moe_layer_freq 2: layers 0 and 2 are MoE, layer 1 is dense.
        "first_k_dense_replace": 0, "moe_layer_freq": 2,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    # mHC (k = 4 streams) around a dense and a MoE layer, with 3 Sinkhorn
    # iterations and with MaxText's default 20.
    mhc = dict(v3, vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
               q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
               rope_scaling=None, n_routed_experts=4, n_group=2, topk_group=1, num_nextn_predict_layers=0,
               mhc_expansion_rate=4, mhc_sinkhorn_iterations=3)
    # Engram before the attention of both layers of a two-stream mHC model,
    # and of one layer of a plain-residual model: small prime tables (so that
    # rows collide), a three-tap conv.
    engram = dict(engram_max_ngram_size=3, engram_num_heads=2, engram_head_dim=4, engram_vocab_bases=[11, 13],
                  engram_kernel_size=3, engram_seed=5, engram_pad_id=0)
    engram_mhc = dict(mhc, mhc_expansion_rate=2, engram_layers=[0, 1], **engram)
    engram_plain = dict(mhc, mhc_expansion_rate=1, engram_layers=[1], **engram)
    return [
        {"name": "v3_engram", "config": engram_mhc, "seed": 9200, "T": 8, "docs": [[8], [3, 4]],
         "z_loss_multiplier": 1e-3, "load_balance_loss_weight": 0.01,
         "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.0},
        {"name": "v3_engram_plain", "config": engram_plain, "seed": 9300, "T": 8, "docs": [[6, 2], [8]],
         "z_loss_multiplier": 0.0, "load_balance_loss_weight": 0.01,
         "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.0},
        {"name": "v3_mhc", "config": mhc, "seed": 9000, "T": 8, "docs": [[8], [3, 4]],
         "z_loss_multiplier": 1e-3, "load_balance_loss_weight": 0.01,
         "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.0},
        {"name": "v3_mhc_iters20", "config": dict(mhc, mhc_sinkhorn_iterations=20), "seed": 9100, "T": 8,
         "docs": [[5, 3], [8]], "z_loss_multiplier": 0.0, "load_balance_loss_weight": 0.01,
         "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.0},
        {"name": "v3_packed", "config": v3, "seed": 7000, "T": 12, "docs": [[12], [5, 4, 3]],
         "z_loss_multiplier": 1e-3, "load_balance_loss_weight": 0.01,
         "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3},
        {"name": "v2_plain", "config": v2, "seed": 8000, "T": 10, "docs": [[10]],
         "z_loss_multiplier": 0.0, "load_balance_loss_weight": 0.0,
         "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.0},
    ]


# ---------------------------------------------------------------------------
# tensors and batch
# ---------------------------------------------------------------------------

STD_EMBED, STD_LINEAR, STD_GATE, STD_HEAD, STD_NORM, STD_BIAS = 1.0, 0.2, 0.3, 0.3, 0.1, 0.1
# mHC: far from MaxText's initialisation (scales 0.01, biases 0), so that the
# pre/post weights and the Sinkhorn's matrix differ from token to token.
STD_MHC_FN, STD_MHC_BASE, MEAN_MHC_SCALE, STD_MHC_SCALE = 0.3, 0.5, 0.8, 0.3
# Engram: a conv far from MaxText's zero initialisation, so that it matters.
STD_ENGRAM_CONV = 0.3


def random_tensors(cj, rng, mtp_layers):
    """-> list of (name, float32 array) in checkpoint order: embedding, decoder layers,
    final norm, lm_head, then `mtp_layers` complete MTP layers."""
    c = ref.Config(cj)
    D, H = c.hidden_size, c.num_attention_heads
    n, r, vd, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    out = []

    def add(name, shape, std, mean=0.0):
        out.append((name, (rng.standard_normal(shape) * std + mean).astype(np.float32)))

    def norm(name, width):
        add(name, (width,), STD_NORM, 1.0)

    def mlp(p, width):
        add(p + ".gate_proj.weight", (width, D), STD_LINEAR)
        add(p + ".up_proj.weight", (width, D), STD_LINEAR)
        add(p + ".down_proj.weight", (D, width), STD_LINEAR)

    def decoder_layer(l):
        p = f"model.layers.{l}"
        norm(p + ".input_layernorm.weight", D)
        a = p + ".self_attn."
        if c.q_lora_rank:
            add(a + "q_a_proj.weight", (c.q_lora_rank, D), STD_LINEAR)
            norm(a + "q_a_layernorm.weight", c.q_lora_rank)
            add(a + "q_b_proj.weight", (H * (n + r), c.q_lora_rank), STD_LINEAR)
        else:
            add(a + "q_proj.weight", (H * (n + r), D), STD_LINEAR)
        add(a + "kv_a_proj_with_mqa.weight", (R + r, D), STD_LINEAR)
        norm(a + "kv_a_layernorm.weight", R)
        add(a + "kv_b_proj.weight", (H * (n + vd), R), STD_LINEAR)
        add(a + "o_proj.weight", (D, H * vd), STD_LINEAR)
        norm(p + ".post_attention_layernorm.weight", D)
        if c.is_moe_layer(l):
            add(p + ".mlp.gate.weight", (c.n_routed_experts, D), STD_GATE)
            if c.topk_method == "noaux_tc":
                add(p + ".mlp.gate.e_score_correction_bias", (c.n_routed_experts,), STD_BIAS)
            for e in range(c.n_routed_experts):
                mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size)
            if c.n_shared_experts:
                mlp(p + ".mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        else:
            mlp(p + ".mlp", c.intermediate_size)
        k = train_ref.mhc_streams(c)
        if k > 1:
            for m in ("mhc_attention", "mhc_mlp"):
                norm(f"{p}.{m}.norm.weight", k * D)
                add(f"{p}.{m}.fn", ((2 + k) * k, k * D), STD_MHC_FN)
                add(f"{p}.{m}.base", ((2 + k) * k,), STD_MHC_BASE)
                add(f"{p}.{m}.scale", (3,), STD_MHC_SCALE, MEAN_MHC_SCALE)
        if l in (c.raw.get("engram_layers") or []):
            raw, GD = c.raw, k * D
            _, primes = train_ref.engram_tables(c)[l]
            cols = (raw["engram_max_ngram_size"] - 1) * raw["engram_num_heads"] * raw["engram_head_dim"]
            norm(p + ".engram_layernorm.weight", D)
            add(p + ".engram.embedding.weight", (sum(primes), raw["engram_head_dim"]), STD_EMBED)
            add(p + ".engram.key_proj.weight", (GD, cols), STD_LINEAR)
            add(p + ".engram.key_proj.bias", (GD,), STD_BIAS)
            add(p + ".engram.value_proj.weight", (D, cols), STD_LINEAR)
            add(p + ".engram.value_proj.bias", (D,), STD_BIAS)
            for m in ("q_norm", "k_norm", "short_conv.norm"):
                norm(f"{p}.engram.{m}.weight", GD)
            add(p + ".engram.short_conv.weight", (raw["engram_kernel_size"], GD), STD_ENGRAM_CONV)

    add("model.embed_tokens.weight", (c.vocab_size, D), STD_EMBED)
    for l in range(c.num_hidden_layers):
        decoder_layer(l)
    norm("model.norm.weight", D)
    if not c.tie_word_embeddings:
        add("lm_head.weight", (c.vocab_size, D), STD_HEAD)
    for k in range(1, mtp_layers + 1):
        l = c.num_hidden_layers + k - 1
        p = f"model.layers.{l}"
        norm(p + ".enorm.weight", D)
        norm(p + ".hnorm.weight", D)
        add(p + ".eh_proj.weight", (D, 2 * D), STD_LINEAR)
        decoder_layer(l)
        norm(p + ".shared_head.norm.weight", D)
    return out


def random_batch(rng, spec, vocab):
    """Packed rows: documents one after another, segment ids 1, 2, ... per row, positions
    restarting at 0, targets = the next token of the same document (0 with target segment 0
    at a document's last token), zero padding after the last document."""
    T = spec["T"]
    b = {k: [] for k in train_ref.BATCH_ARRAYS}
    for lengths in spec["docs"]:
        row = {k: [] for k in train_ref.BATCH_ARRAYS}
        for s, n in enumerate(lengths, 1):
            toks = rng.integers(0, vocab, size=n).tolist()
            row["inputs"] += toks
            row["targets"] += toks[1:] + [0]
            row["positions"] += list(range(n))
            row["segment_ids"] += [s] * n
            row["target_segment_ids"] += [s] * (n - 1) + [0]
        assert len(row["inputs"]) <= T, spec["name"]
        for k in train_ref.BATCH_ARRAYS:
            b[k].append(row[k] + [0] * (T - len(row[k])))
    for k in ("z_loss_multiplier", "load_balance_loss_weight", "mtp_num_layers", "mtp_loss_scaling_factor"):
        b[k] = spec[k]
    return b


def write_batch(path, b):
    with open(path, "w") as f:
        f.write("{\n")
        items = list(b.items())
        for i, (k, v) in enumerate(items):
            sep = "," if i + 1 < len(items) else ""
            if isinstance(v, list):
                rows = ",\n    ".join(json.dumps(r, separators=(", ", ": ")) for r in v)
                f.write(f'  "{k}": [\n    {rows}\n  ]{sep}\n')
            else:
                f.write(f'  "{k}": {json.dumps(v)}{sep}\n')
        f.write("}\n")


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def selections(trace):
    return [tuple(t["selected"].tolist()) for t in trace]


def check_logits_against_inference_ref(d, model, batch):
    """Every document of the batch, run alone through DeepSeekRef.forward, must give the
    main logits of its slice of the packed batch (positions restart at 0 per document)."""
    inf = ref.DeepSeekRef(d)
    worst = 0.0
    for bi in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][bi]
        for s in sorted(set(seg.tolist()) - {0}):
            idx = np.nonzero(seg == s)[0]
            assert (batch["positions"][bi, idx] == np.arange(idx.size)).all(), "positions must restart per document"
            lg = inf.forward(batch["inputs"][bi, idx].tolist())
            worst = max(worst, (lg - model.last_logits[bi, idx]).abs().max().item())
    assert worst < 1e-10, f"packed logits differ from deepseek_ref by {worst:.3e}"
    return worst


def check_mhc_vectors():
    """train_ref's mHC pieces against the published test vectors of MaxText's seed-era
    mHC: its Sinkhorn (20 and 1 iterations) and a toy module (k = 3, d = 4, S = 2, the
    branch tanh, no norm on the branch input, eps 1e-6). Returns the largest difference."""
    A = torch.tensor([[0.5, -1, 2, 0], [1, 0, -0.5, 0.3], [-2, 1.5, 0, 0.7], [0.2, 0.1, -0.3, 1]], dtype=ref.F64)
    want20 = [[.196148, .037219, .672114, .094519], [.532491, .166584, .090842, .210082],
              [.021444, .603897, .121149, .253509], [.249916, .192301, .115895, .441889]]
    worst = (train_ref.sinkhorn_v1(A, 20) - torch.tensor(want20, dtype=ref.F64)).abs().max().item()
    worst = max(worst, (train_ref.sinkhorn_v1(A, 1)[0] -
                        torch.tensor([.219834, .04223, .70147, .107017], dtype=ref.F64)).abs().max().item())
    k, D, S = 3, 4, 2
    x = torch.tensor([[[np.sin(0.3 * (s + 1) * (i + 1) + 0.7 * j) for j in range(D)] for i in range(k)]
                      for s in range(S)], dtype=ref.F64)[None]  # [1, S, k, D]
    kd = k * D
    fn = torch.zeros((2 + k) * k, kd, dtype=ref.F64)
    for m in range(kd):
        for i in range(k):
            fn[i, m] = 0.05 * np.sin(m + 2 * i + 1)
            fn[k + i, m] = 0.05 * np.cos(m - i)
        for n in range(k * k):
            fn[2 * k + n, m] = 0.05 * np.sin(0.5 * m + n)
    base = torch.tensor([0.1 * i for i in range(k)] + [-0.1 * i for i in range(k)] +
                        [0.2 if i == m else -0.1 for i in range(k) for m in range(k)], dtype=ref.F64)
    w = {"t.norm.weight": torch.tensor([1 + 0.1 * np.cos(m) for m in range(kd)], dtype=ref.F64), "t.fn": fn,
         "t.base": base, "t.scale": torch.tensor([0.7, 0.9, 1.1], dtype=ref.F64)}
    toy = train_ref._Forward.__new__(train_ref._Forward)
    toy.p, toy.m = w, None
    toy.cfg = ref.Config({"model_type": "deepseek_v3", "vocab_size": 1, "hidden_size": D, "intermediate_size": 1,
                          "num_hidden_layers": 1, "num_attention_heads": 1, "kv_lora_rank": 1,
                          "qk_nope_head_dim": 1, "qk_rope_head_dim": 2, "v_head_dim": 1, "rms_norm_eps": 1e-6,
                          "mhc_sinkhorn_iterations": 20})
    y = toy.mhc("t", x, torch.tanh)[0]
    worst = max(worst, (y[0, 0] - torch.tensor([1.214618, 1.811332, 1.760824, .996041], dtype=ref.F64)).abs().max()
                .item())
    worst = max(worst, (y[1, 2] - torch.tensor([1.669223, 1.642321, .97788, -.425249], dtype=ref.F64)).abs().max()
                .item())
    assert worst < 2e-6, f"train_ref's mHC differs from the published test vectors by {worst:.2e}"
    return worst


def check_packing(model, batch):
    """The masked LM and MTP loss sums of the packed batch must equal the sums over its
    documents run one at a time (a batch of one row holding only that document): the
    segment mask, the restarting positions and the in-document shifts isolate documents."""
    model.losses({}, batch)
    packed = dict(model.last_sums)
    alone = {k: 0.0 for k in packed}
    for bi in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][bi]
        for s in sorted(set(seg.tolist()) - {0}):
            idx = np.nonzero(seg == s)[0]
            one = dict(batch)
            for k in train_ref.BATCH_ARRAYS:
                one[k] = batch[k][bi:bi + 1, idx]
            model.losses({}, one)
            for k in alone:
                alone[k] += model.last_sums[k]
    worst = 0.0
    for k in packed:
        worst = max(worst, abs(packed[k] - alone[k]))
        assert abs(packed[k] - alone[k]) < 1e-10, f"packing changes {k}: {packed[k]!r} vs {alone[k]!r}"
    return packed, worst


def fd_check(model, batch, name):
    """Autograd gradient of each loss term vs finite differences on sampled entries of every
    trainable tensor: the entry with the largest |gradient|, a random entry with a nonzero
    gradient and a random entry. The stencil is the fourth-order central difference
    (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h. Asserts that the routing choices
    never change under the perturbation (the loss is smooth only between routing changes)."""
    names = model.trainable_names()
    params = {n: model.w[n].clone().requires_grad_(True) for n in names}
    trace0 = []
    out = model.losses(params, batch, trace0)
    sel0 = selections(trace0)
    terms = [k for k in ("loss", "lm_loss", "mtp_loss", "moe_lb_loss") if out[k].requires_grad]
    ad = {}
    for k in terms:
        gs = torch.autograd.grad(out[k], [params[n] for n in names], retain_graph=True, allow_unused=True)
        ad[k] = {n: (g if g is not None else torch.zeros_like(params[n])).reshape(-1) for n, g in zip(names, gs)}
    base = {n: model.w[n] for n in names}
    rng = np.random.default_rng(12345)
    stats = {"entries": 0, "tensors": len(names), "terms": terms, "rel_big": 0.0, "rel_all": 0.0, "abs": 0.0}
    failures = []
    for n in names:
        g = ad["loss"][n]
        picks = [int(g.abs().argmax())]
        nz = torch.nonzero(g).reshape(-1).numpy()
        if nz.size:
            picks.append(int(nz[rng.integers(nz.size)]))
        picks.append(int(rng.integers(g.numel())))
        for i in dict.fromkeys(picks):  # unique, in order
            f = {}
            for m in (1, -1, 2, -2):
                t = base[n].clone()
                t.view(-1)[i] += m * FD_STEP
                p = dict(base)
                p[n] = t
                tr = []
                with torch.no_grad():
                    f[m] = model.losses(p, batch, tr)
                if selections(tr) != sel0:
                    raise AssertionError(f"{name}: perturbing {n}[{i}] by {m * FD_STEP:g} changed a routing choice")
            stats["entries"] += 1
            for k in terms:
                fd = (8.0 * (f[1][k] - f[-1][k]).item() - (f[2][k] - f[-2][k]).item()) / (12.0 * FD_STEP)
                a = ad[k][n][i].item()
                err = abs(fd - a)
                stats["abs"] = max(stats["abs"], err)
                if abs(a) > 1e-6:
                    stats["rel_all"] = max(stats["rel_all"], err / abs(a))
                if abs(a) > 1e-3:
                    stats["rel_big"] = max(stats["rel_big"], err / abs(a))
                if err > FD_RTOL * abs(a) + FD_ATOL:
                    failures.append(f"{k} d/d{n}[{i}]: autograd {a:.12e}, finite difference {fd:.12e}")
    if failures:
        raise AssertionError(f"{name}: gradient check failed:\n  " + "\n  ".join(failures[:20]))
    return stats


def fd_summary(st):
    return (f"finite differences: {st['entries']} entries of {st['tensors']} tensors, terms {st['terms']}: "
            f"max rel err {st['rel_big']:.1e} where |grad| > 1e-3, {st['rel_all']:.1e} where |grad| > 1e-6; "
            f"max abs err {st['abs']:.1e}")


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def build(spec, root):
    d = os.path.join(root, spec["name"])
    cj = spec["config"]
    cfg0 = ref.Config(cj)
    grouped = cfg0.topk_method != "greedy" and cfg0.topk_group < cfg0.n_group
    for attempt in range(50):
        seed = spec["seed"] + attempt
        rng = np.random.default_rng(seed)
        tensors = random_tensors(cj, rng, spec["mtp_num_layers"])
        b = random_batch(rng, spec, cfg0.vocab_size)
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cj, f, indent=2)
            f.write("\n")
        raw = [(nm, "F32", list(a.shape), a.astype("<f4").tobytes()) for nm, a in tensors]
        ref.write_safetensors_raw(os.path.join(d, "model.safetensors"), raw, {"format": "pt"})
        write_batch(os.path.join(d, "batch.json"), b)

        model = train_ref.TrainRef(d)
        batch = train_ref.load_batch(os.path.join(d, "batch.json"))
        train_ref.check_mtp_tensors(model, batch)
        trace = []
        vals, grads = model.loss_and_grads(batch, trace)
        min_k, min_g, changed, usage = routing_report(trace, model.cfg)
        if min(min_k, min_g) < MARGIN or (grouped and changed == 0):
            print(f"  {spec['name']}: seed {seed} rejected (margins {min_k:.2e}/{min_g:.2e}, "
                  f"group-limited changes {changed})")
            continue
        break
    else:
        raise RuntimeError(f"{spec['name']}: no seed with clear routing margins")

    engram = bool(model.cfg.raw.get("engram_layers"))
    if train_ref.mhc_streams(model.cfg) > 1:
        # deepseek_ref has no mHC: its published test vectors instead.
        ldiff, lwhat = check_mhc_vectors(), "mHC test vectors (6 digits)"
    elif engram:
        ldiff, lwhat = float("nan"), "no deepseek_ref check (it has no Engram)"
    else:
        ldiff, lwhat = check_logits_against_inference_ref(d, model, batch), "logits vs deepseek_ref per document"
    if engram:
        # Engram's n-grams run across the documents of a row (as MaxText's): packing matters.
        model.losses({}, batch)
        sums, pdiff = dict(model.last_sums), float("nan")
    else:
        sums, pdiff = check_packing(model, batch)
    t0 = time.time()
    st = fd_check(model, batch, spec["name"])
    fd_s = time.time() - t0

    # float64 values rounded to float32: what a float32 engine is checked against.
    exp = [(k, "F32", [1], np.array([vals[k]], dtype="<f4").tobytes()) for k in train_ref.LOSS_NAMES]
    for nm, _ in tensors:
        if nm in grads:
            g = grads[nm]
            exp.append(("grad." + nm, "F32", list(g.shape), g.numpy().astype("<f4").tobytes()))
    ref.write_safetensors_raw(os.path.join(d, "expected.safetensors"), exp,
                              {"generator": "tests/reference/make_train_fixtures.py",
                               "note": "float64 training losses and gradients of loss, rounded to float32"})

    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"{spec['name']}: seed {seed}, {size / 1024:.1f} KiB, " +
          ", ".join(f"{k} {vals[k]:.10f}" for k in train_ref.LOSS_NAMES))
    print(f"  routing: min top-k margin {min_k:.3e}, min group margin {min_g:.3e}, "
          f"group limit changed {changed}/{len(trace)} selections")
    for l, u in sorted(usage.items()):
        print(f"  layer {l} expert usage {u.tolist()}")
    print(f"  {lwhat}: max diff {ldiff:.2e}; packed vs one document at a time: "
          f"max diff {pdiff:.2e} over the loss sums and counts {sums}")
    print(f"  {fd_summary(st)} ({fd_s:.1f} s)")
    return d


def check(spec, root, fd):
    d = os.path.join(root, spec["name"])
    model = train_ref.TrainRef(d)
    batch = train_ref.load_batch(os.path.join(d, "batch.json"))
    train_ref.check_mtp_tensors(model, batch)
    vals, grads = model.loss_and_grads(batch)
    exp, _ = ref.read_safetensors_raw(os.path.join(d, "expected.safetensors"))
    want = {"grad." + n for n in grads} | set(train_ref.LOSS_NAMES)
    if set(exp) != want:
        print(f"{spec['name']}: MISMATCH in tensor names: extra {sorted(set(exp) - want)[:5]}, "
              f"missing {sorted(want - set(exp))[:5]}")
        return False
    worst, ok = 0.0, True
    for k, (dt, shape, data) in exp.items():
        e = ref.raw_to_f64(dt, shape, data)
        got = torch.tensor([vals[k]], dtype=ref.F64) if k in train_ref.LOSS_NAMES else grads[k[5:]]
        if list(got.shape) != list(shape):
            print(f"  {k}: shape {list(got.shape)} vs expected {shape}")
            ok = False
            continue
        diff = (got - e).abs()
        worst = max(worst, diff.max().item())
        if (diff > CHECK_RTOL * e.abs() + CHECK_ATOL).any():
            print(f"  {k}: max diff {diff.max().item():.3e}")
            ok = False
    line = f"{spec['name']}: " + ", ".join(f"{k} {vals[k]:.10f}" for k in train_ref.LOSS_NAMES)
    print(line + f"; max |recomputed - expected| {worst:.3e} over {len(exp)} tensors")
    if fd:
        print("  " + fd_summary(fd_check(model, batch, spec["name"])))
    print("OK" if ok else "MISMATCH")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "train"))
    ap.add_argument("--check", action="store_true", help="compare committed fixtures with a recomputation")
    ap.add_argument("--fd", action="store_true", help="with --check: repeat the finite-difference check")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(1)  # deterministic float64 reductions
    specs = [s for s in fixture_specs() if not a.names or s["name"] in a.names]
    if a.names and len(specs) != len(a.names):
        ap.error(f"unknown fixture name; known: {[s['name'] for s in fixture_specs()]}")
    if a.check:
        ok = all([check(s, a.out, a.fd) for s in specs])
        return 0 if ok else 1
    os.makedirs(a.out, exist_ok=True)
    for s in specs:
        build(s, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
