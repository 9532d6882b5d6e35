#!/usr/bin/python3
"""Generates the tiny DeepSeek model fixtures under tests/data/models/.

Each fixture folder holds a random Hugging Face-format checkpoint (config.json +
model.safetensors, or model.safetensors.index.json + shards), tokens.json (a
JSON array of token-id arrays) and expected.safetensors with float32
`logits.{i}` [len(tokens[i]), vocab] computed by deepseek_ref.py in float64
from the checkpoint as written.

  /usr/bin/python3 tests/reference/make_model_fixtures.py [--out DIR] [NAME ...]

Deterministic: numpy's PCG64 generator with fixed seeds. A seed is skipped
(next one tried) if any routing decision is too close to call (top-k or group
margin below MARGIN) or, for V3.2 sparse attention, any indexer top-k selection
is (a gap below INDEX_MARGIN of the row's max |score|, or a change under tiny
perturbations inside the indexer), so that a float32 engine must make the same
choices.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref as ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARGIN = 1e-3  # smallest allowed gap at a routing decision boundary
INDEX_MARGIN = 1e-4  # smallest allowed indexer top-k gap, relative to the row's max |score|
INDEX_PERTURB, INDEX_PERTURB_RUNS = 1e-5, 4  # relative noise inside the indexer, and how many runs
MAX_ATTEMPTS = 200

# ---------------------------------------------------------------------------
# fixture definitions
# ---------------------------------------------------------------------------


def _v3_common():
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "num_experts_per_tok": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def fixture_specs():
    v3 = _v3_common()
    v3.update({
        "vocab_size": 160, "hidden_size": 48, "intermediate_size": 80, "moe_intermediate_size": 24,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 24,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 12,
        # beta_fast/beta_slow chosen (not DeepSeek's 32/1) so that with a rope dim of 8 the
        # correction range is [low=1, high=4]: smooth = [1, 1, 2/3, 1/3], a real ramp.
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                         "beta_fast": 0.1, "beta_slow": 0.001, "mscale": 1.0, "mscale_all_dim": 1.0},
    })
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
        # moe_layer_freq 2: layers 0 and 2 are MoE, layer 1 is dense (l % freq != 0).
        "first_k_dense_replace": 0, "moe_layer_freq": 2,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    fp8 = _v3_common()
    fp8.update({
        "vocab_size": 144, "hidden_size": 40, "intermediate_size": 72, "moe_intermediate_size": 20,
        "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 24, "kv_lora_rank": 20,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "num_nextn_predict_layers": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [16, 16]},
    })
    v32_yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    v32 = _v3_common()
    v32.update({
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "torch_dtype": "float32",
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "rope_scaling": dict(v32_yarn),
        "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
    })
    v32_bf16 = _v3_common()
    v32_bf16.update({
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "vocab_size": 112, "hidden_size": 40, "intermediate_size": 72, "moe_intermediate_size": 20,
        "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 28, "kv_lora_rank": 20,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "rope_scaling": dict(v32_yarn),
        "index_n_heads": 2, "index_head_dim": 32, "index_topk": 8,
        "scale_fmt": "ue8m0",
    })
    v32_fp8 = _v3_common()
    v32_fp8.update({
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "vocab_size": 104, "hidden_size": 40, "intermediate_size": 72, "moe_intermediate_size": 20,
        "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 24, "kv_lora_rank": 20,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "rope_scaling": dict(v32_yarn),
        "index_n_heads": 4, "index_head_dim": 16, "index_topk": 12,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [16, 16], "scale_fmt": "ue8m0"},
    })
    return [
        {"name": "v3_qlora_yarn", "config": v3, "seed": 1000, "storage": "bf16", "lengths": [1, 5, 20]},
        {"name": "v2_plain_softmax", "config": v2, "seed": 2000, "storage": "f32", "lengths": [1, 5, 20]},
        {"name": "v3_fp8_sharded", "config": fp8, "seed": 3000, "storage": "fp8", "lengths": [1, 5, 20],
         "shards": 2, "mtp": True},
        {"name": "v32_sparse_f32", "config": v32, "seed": 4000, "storage": "f32", "lengths": [1, 5, 40]},
        {"name": "v32_bf16_scale_fmt", "config": v32_bf16, "seed": 5000, "storage": "bf16", "lengths": [1, 5, 40],
         "index_pair_angle": 0.1},
        {"name": "v32_fp8_ue8m0", "config": v32_fp8, "seed": 6000, "storage": "fp8", "lengths": [1, 5, 40],
         "shards": 2},
    ]


# ---------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------

STD_EMBED, STD_LINEAR, STD_GATE, STD_HEAD, STD_NORM, STD_BIAS = 1.0, 0.2, 0.3, 0.3, 0.1, 0.1
STD_INDEX_WEIGHTS = 0.5  # indexer weights_proj


def random_tensors(cj, rng, with_mtp, index_pair_angle=None):
    """-> list of (name, float32 array, kind) with kind in {'linear', 'norm', 'norm_bias', 'gate', 'bias', 'embed',
    'head', 'index_weights'}; 'linear' weights become fp8 in an fp8 checkpoint, 'bias' is always F32."""
    c = ref.Config(cj)
    D, H = c.hidden_size, c.num_attention_heads
    n, r, vd, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    out = []

    def normal(shape, std, mean=0.0):
        return (rng.standard_normal(shape) * std + mean).astype(np.float32)

    def add(name, shape, kind, std=None):
        if kind == "norm":
            out.append((name, normal(shape, STD_NORM, 1.0), kind))
        else:
            out.append((name, normal(shape, std), kind))

    def mlp(p, width):
        add(p + ".gate_proj.weight", (width, D), "linear", STD_LINEAR)
        add(p + ".up_proj.weight", (width, D), "linear", STD_LINEAR)
        add(p + ".down_proj.weight", (D, width), "linear", STD_LINEAR)

    def attn(p):
        if c.q_lora_rank:
            add(p + "q_a_proj.weight", (c.q_lora_rank, D), "linear", STD_LINEAR)
            add(p + "q_a_layernorm.weight", (c.q_lora_rank,), "norm")
            add(p + "q_b_proj.weight", (H * (n + r), c.q_lora_rank), "linear", STD_LINEAR)
        else:
            add(p + "q_proj.weight", (H * (n + r), D), "linear", STD_LINEAR)
        add(p + "kv_a_proj_with_mqa.weight", (R + r, D), "linear", STD_LINEAR)
        add(p + "kv_a_layernorm.weight", (R,), "norm")
        add(p + "kv_b_proj.weight", (H * (n + vd), R), "linear", STD_LINEAR)
        add(p + "o_proj.weight", (D, H * vd), "linear", STD_LINEAR)
        if c.index_n_heads:  # V3.2 lightning indexer, in every decoder layer
            Hi, Di = c.index_n_heads, c.index_head_dim
            add(p + "indexer.wq_b.weight", (Hi * Di, c.q_lora_rank), "linear", STD_LINEAR)
            if index_pair_angle is not None:
                # Head h + Hi/2 is nearly opposite to head h: -cos(a) * head h + sin(a) * its own draw, so
                # that a key rarely has q . k <= 0 for every head (an all-zero score, tying exactly).
                w = out[-1][1].reshape(Hi, Di, -1).astype(np.float64)
                a, half = index_pair_angle, Hi // 2
                w[half:2 * half] = -np.cos(a) * w[:half] + np.sin(a) * w[half:2 * half]
                out[-1] = (out[-1][0], w.reshape(Hi * Di, -1).astype(np.float32), "linear")
            add(p + "indexer.wk.weight", (Di, D), "linear", STD_LINEAR)
            add(p + "indexer.k_norm.weight", (Di,), "norm")
            add(p + "indexer.k_norm.bias", (Di,), "norm_bias", STD_NORM)
            add(p + "indexer.weights_proj.weight", (Hi, D), "index_weights", STD_INDEX_WEIGHTS)

    add("model.embed_tokens.weight", (c.vocab_size, D), "embed", STD_EMBED)
    for l in range(c.num_hidden_layers):
        p = f"model.layers.{l}"
        add(p + ".input_layernorm.weight", (D,), "norm")
        attn(p + ".self_attn.")
        add(p + ".post_attention_layernorm.weight", (D,), "norm")
        if c.is_moe_layer(l):
            add(p + ".mlp.gate.weight", (c.n_routed_experts, D), "gate", STD_GATE)
            if c.topk_method == "noaux_tc":
                add(p + ".mlp.gate.e_score_correction_bias", (c.n_routed_experts,), "bias", STD_BIAS)
            for e in range(c.n_routed_experts):
                mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size)
            if c.n_shared_experts:
                mlp(p + ".mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        else:
            mlp(p + ".mlp", c.intermediate_size)
    add("model.norm.weight", (D,), "norm")
    add("lm_head.weight", (c.vocab_size, D), "head", STD_HEAD)
    if with_mtp:
        # A multi-token-prediction layer at index num_hidden_layers: the engine and the
        # reference must ignore it. A subset of its tensors is enough for that.
        p = f"model.layers.{c.num_hidden_layers}"
        add(p + ".enorm.weight", (D,), "norm")
        add(p + ".hnorm.weight", (D,), "norm")
        add(p + ".eh_proj.weight", (D, 2 * D), "linear", STD_LINEAR)
        add(p + ".input_layernorm.weight", (D,), "norm")
        add(p + ".self_attn.kv_a_proj_with_mqa.weight", (R + r, D), "linear", STD_LINEAR)
        add(p + ".self_attn.kv_a_layernorm.weight", (R,), "norm")
        add(p + ".mlp.gate.weight", (c.n_routed_experts, D), "gate", STD_GATE)
        add(p + ".mlp.gate.e_score_correction_bias", (c.n_routed_experts,), "bias", STD_BIAS)
        add(p + ".shared_head.norm.weight", (D,), "norm")
    return out


def quantize_fp8(w, br, bc):
    """DeepSeek-style block fp8: scale_inv = amax(block) / 448 (float32), q = e4m3(w / scale_inv)
    (round to nearest even, saturating). Returns (uint8 codes, float32 scale_inv)."""
    out, inn = w.shape
    gr, gc = -(-out // br), -(-inn // bc)
    s = np.zeros((gr, gc), dtype=np.float32)
    q = np.zeros(w.shape, dtype=np.uint8)
    w64 = w.astype(np.float64)
    for i in range(gr):
        for j in range(gc):
            blk = w64[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = np.abs(blk).max()
            s[i, j] = np.float32(amax / ref.E4M3_MAX) if amax > 0 else np.float32(1.0)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = ref.e4m3_encode(blk / np.float64(s[i, j]))
    return q, s


def encode(tensors, storage, block):
    """-> list of (name, dtype, shape, bytes)."""
    raw = []
    for name, a, kind in tensors:
        shape = list(a.shape)
        if kind == "bias" or storage == "f32":
            raw.append((name, "F32", shape, a.astype("<f4").tobytes()))
        elif storage == "fp8" and kind == "linear":
            q, s = quantize_fp8(a, *block)
            raw.append((name, "F8_E4M3", shape, q.tobytes()))
            raw.append((name + "_scale_inv", "F32", list(s.shape), s.astype("<f4").tobytes()))
        else:
            raw.append((name, "BF16", shape, ref.f32_to_bf16_bits(a).astype("<u2").tobytes()))
    return raw


def write_checkpoint(d, raw, shards):
    if shards <= 1:
        ref.write_safetensors_raw(os.path.join(d, "model.safetensors"), raw, {"format": "pt"})
        return
    total = sum(len(t[3]) for t in raw)
    groups = [[] for _ in range(shards)]
    acc = 0
    for t in raw:  # consecutive split by bytes; a weight and its scale_inv may land in different shards
        groups[min(shards - 1, acc * shards // total)].append(t)
        acc += len(t[3])
    weight_map = {}
    for k, g in enumerate(groups):
        fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        ref.write_safetensors_raw(os.path.join(d, fn), g, {"format": "pt"})
        for t in g:
            weight_map[t[0]] = fn
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def routing_report(trace, cfg):
    """Smallest margins at the routing decision boundaries, and how often group limiting changed the choice."""
    K, G = cfg.num_experts_per_tok, cfg.n_group
    min_k, min_g, changed, usage = np.inf, np.inf, 0, {}
    for t in trace:
        ch, order = t["masked_choice"], t["order"]
        min_k = min(min_k, ch[order[K - 1]] - ch[order[K]])  # inf when the next one is masked
        if "group_scores" in t:
            gs = np.sort(t["group_scores"])[::-1]
            if cfg.topk_group < G:
                min_g = min(min_g, gs[cfg.topk_group - 1] - gs[cfg.topk_group])
            free = set(np.argsort(-t["choice"], kind="stable")[:K].tolist())
            changed += free != set(order[:K].tolist())
        for e in order[:K].tolist():
            usage.setdefault(t["layer"], np.zeros(cfg.n_routed_experts, dtype=int))[e] += 1
    return min_k, min_g, changed, usage


def index_report(model, trace, seed):
    """Checks every sparse indexer row (more visible keys than index_topk) of the full forwards in trace:
    -> (sparse rows, smallest relative top-k gap, rows whose selection differs from the index_topk most recent
    keys, rows whose selection changed in a perturbed run)."""
    K = model.cfg.index_topk
    rows, min_rel, not_window = 0, np.inf, 0
    for e in trace:
        sc = e["scores"].numpy()
        for t in range(sc.shape[0]):
            if t + 1 <= K:
                continue
            rows += 1
            v = np.sort(sc[t, :t + 1])[::-1]
            top = np.abs(v).max()
            min_rel = min(min_rel, (v[K - 1] - v[K]) / top if top > 0 else 0.0)
            sel = np.flatnonzero(e["selected"][t].numpy())
            not_window += not np.array_equal(sel, np.arange(t + 1 - K, t + 1))
    flips = 0
    for run in range(INDEX_PERTURB_RUNS):
        prng = np.random.default_rng([seed, run])

        def perturb(a):
            return a * (1.0 + INDEX_PERTURB * torch.from_numpy(prng.standard_normal(tuple(a.shape))))

        for e in trace:
            q, k, w = model.indexer_qkw(e["layer"], e["x"], e["qr"], e["pos"], perturb=perturb)
            sc = model.index_scores(q, k, w, perturb=perturb)
            sc = sc.masked_fill(torch.ones_like(sc, dtype=torch.bool).triu(1), float("-inf"))
            flips += int((model.index_select(sc) != e["selected"]).any(-1).sum())
    return rows, min_rel, not_window, flips


def codec_selftest():
    t = ref.E4M3_TABLE
    assert t[0x7E] == 448.0 and np.isnan(t[0x7F]) and np.isnan(t[0xFF]) and t[0x01] == 2.0 ** -9
    assert t[0x08] == 2.0 ** -6 and t[0x38] == 1.0 and t[0xB8] == -1.0
    codes = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)
    assert (ref.e4m3_encode(t[codes]) == codes).all(), "e4m3 round trip"
    pos = t[:127]
    mid = (pos[:-1] + pos[1:]) / 2
    even = np.where(np.arange(126) % 2 == 0, np.arange(126), np.arange(1, 127))
    assert (ref.e4m3_encode(mid) == even).all(), "e4m3 ties to even"
    assert (ref.e4m3_encode(mid * (1 + 1e-12)) == np.arange(1, 127)).all()
    assert (ref.e4m3_encode(np.array([464.0, 1e9, -1e9, -500.0])) == [0x7E, 0x7E, 0xFE, 0xFE]).all()
    x = np.random.default_rng(1).standard_normal(10000).astype(np.float32) * 3
    x[:4] = [0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8]  # exact bf16 ties
    mine = ref.f32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (mine == theirs).all(), "bf16 rounding disagrees with torch"
    assert (ref.bf16_bits_to_f64(mine) == ref.raw_to_f64("BF16", [x.size], mine.tobytes()).numpy()).all()


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def build(spec, root):
    d = os.path.join(root, spec["name"])
    cj = spec["config"]
    cfg0 = ref.Config(cj)
    block = tuple(cj["quantization_config"]["weight_block_size"]) if "quantization_config" in cj else None
    for attempt in range(MAX_ATTEMPTS):
        seed = spec["seed"] + attempt
        rng = np.random.default_rng(seed)
        tensors = random_tensors(cj, rng, spec.get("mtp", False), spec.get("index_pair_angle"))
        seqs = [rng.integers(0, cfg0.vocab_size, size=n).tolist() for n in spec["lengths"]]
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cj, f, indent=2)
            f.write("\n")
        write_checkpoint(d, encode(tensors, spec["storage"], block), spec.get("shards", 1))

        model = ref.DeepSeekRef(d)
        model.route_trace = []
        sparse = model.cfg.index_n_heads > 0
        if sparse:
            model.index_trace = []
        logits = [model.forward(s) for s in seqs]
        trace, model.route_trace = model.route_trace, None
        itrace, model.index_trace = model.index_trace, None
        min_k, min_g, changed, usage = routing_report(trace, model.cfg)
        grouped = model.cfg.topk_method != "greedy" and model.cfg.topk_group < model.cfg.n_group
        if min(min_k, min_g) < MARGIN or (grouped and changed == 0):
            print(f"  {spec['name']}: seed {seed} rejected (margins {min_k:.2e}/{min_g:.2e}, "
                  f"group-limited changes {changed})")
            continue
        if sparse:
            irows, imin, inotwin, iflips = index_report(model, itrace, seed)
            if imin < INDEX_MARGIN or iflips or 2 * inotwin < irows:
                print(f"  {spec['name']}: seed {seed} rejected (indexer: min relative gap {imin:.2e}, "
                      f"{iflips} rows changed under perturbation, {inotwin}/{irows} rows not a sliding window)")
                continue
        break
    else:
        raise RuntimeError(f"{spec['name']}: no seed with clear routing and indexer margins")

    # Second and third computations of the same logits: token by token with a cache of the
    # expanded per-head K/V, and with the absorbed latent cache (MLA decode form).
    for i, s in enumerate(seqs):
        for absorbed in (False, True):
            inc = model.forward_incremental(s, absorbed=absorbed)
            diff = (inc - logits[i]).abs().max().item()
            assert diff < 1e-10, f"{spec['name']} seq {i}: incremental (absorbed={absorbed}) differs by {diff:.3e}"

    with open(os.path.join(d, "tokens.json"), "w") as f:
        json.dump(seqs, f)
        f.write("\n")
    exp = [(f"logits.{i}", "F32", list(lg.shape), lg.numpy().astype("<f4").tobytes()) for i, lg in enumerate(logits)]
    ref.write_safetensors_raw(os.path.join(d, "expected.safetensors"), exp,
                              {"generator": "tests/reference/make_model_fixtures.py",
                               "note": "float64 reference logits rounded to float32"})

    allv = torch.cat([lg.reshape(-1) for lg in logits])
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"{spec['name']}: seed {seed}, {size / 1024:.1f} KiB, logits std {allv.std().item():.2f} "
          f"max|.| {allv.abs().max().item():.2f}, softmax_scale {model.scale:.6f}, "
          f"rope freqs {[round(v, 6) for v in model.freqs.tolist()]}")
    print(f"  routing: min top-k margin {min_k:.3e}, min group margin {min_g:.3e}, "
          f"group limit changed {changed}/{len(trace)} selections")
    for l, u in sorted(usage.items()):
        print(f"  layer {l} expert usage {u.tolist()}")
    if sparse:
        print(f"  indexer: {irows} sparse rows (top-{model.cfg.index_topk}), min relative top-k gap {imin:.3e}, "
              f"{inotwin}/{irows} differ from the {model.cfg.index_topk} most recent keys, "
              f"stable under {INDEX_PERTURB_RUNS} perturbed runs, scale_fmt {model.cfg.scale_fmt}")
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "models"))
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(1)  # deterministic float64 reductions
    codec_selftest()
    specs = [s for s in fixture_specs() if not a.names or s["name"] in a.names]
    if a.names and len(specs) != len(a.names):
        ap.error(f"unknown fixture name; known: {[s['name'] for s in fixture_specs()]}")
    os.makedirs(a.out, exist_ok=True)
    for s in specs:
        build(s, a.out)


if __name__ == "__main__":
    main()
