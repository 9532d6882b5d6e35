#!/usr/bin/python3
"""Writes the fixtures of DeepSeek-V4's C++ ops, computed by deepseek_v4_ref.py in float64:

  tests/data/v4/mhc.json    the mHC parts (hc_pre with its Sinkhorn projection, hc_post, hc_head), with
                            layer 1's hc_attn_* and the model's hc_head_* of a tiny random V4 folder
                            (make_v4_fixtures.py), on random streams X [T, n, d] and output o [T, d]
                            (tests/mhc_test.cc);
  tests/data/v4/quant.json  the fp8 (blocks of 64, power-of-two and plain scales) and fp4 (blocks of 32)
                            quantize-dequantize simulations on random blocks of many magnitudes, blocks
                            below the amax floors and blocks of exact rounding ties (tests/indexer_test.cc).

Every number is written as the float32 nearest to it (inputs exactly, outputs rounded from float64).
Deterministic: reruns write the same files.

  /usr/bin/python3 tests/reference/make_v4_op_fixtures.py [--out DIR]
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref as dr  # noqa: E402
import deepseek_v4_ref as v4  # noqa: E402
import make_v4_fixtures  # noqa: E402

F64 = torch.float64


def f32_list(t):
    return [float(v) for v in np.asarray(t, dtype=np.float64).astype(np.float32).reshape(-1)]


def main():
    ap = argparse.ArgumentParser()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(root, "data", "v4"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        make_v4_fixtures.main(["--out", tmp, "v4_tiny"])
        model = v4.DeepSeekV4Ref(os.path.join(tmp, "v4_tiny"))
    c = model.cfg
    n, d, T = c.hc_mult, c.hidden_size, 3
    rng = np.random.Generator(np.random.PCG64(2024))
    X = torch.from_numpy(rng.standard_normal((T, n, d)).astype(np.float32).astype(np.float64))
    o = torch.from_numpy(rng.standard_normal((T, d)).astype(np.float32).astype(np.float64))
    p = "layers.1.hc_attn_"
    a_, post, comb = model.hc_pre(X, p)
    y = model.hc_post(o, X, post, comb)
    h = model.hc_head(X, "hc_head_")
    out = {
        "tokens": T, "streams": n, "dim": d, "sinkhorn_iters": c.hc_sinkhorn_iters, "eps": c.hc_eps,
        "norm_eps": c.rms_norm_eps,
        "x": f32_list(X), "o": f32_list(o),
        "fn": f32_list(model.W(p + "fn")), "base": f32_list(model.W(p + "base")),
        "scale": f32_list(model.W(p + "scale")),
        "head_fn": f32_list(model.W("hc_head_fn")), "head_base": f32_list(model.W("hc_head_base")),
        "head_scale": f32_list(model.W("hc_head_scale")),
        "a": f32_list(a_), "post": f32_list(post), "comb": f32_list(comb), "x_out": f32_list(y),
        "head": f32_list(h),
    }
    write(os.path.join(a.out, "mhc.json"), out)
    write(os.path.join(a.out, "quant.json"), quant_fixture())


def write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}")


def quant_fixture():
    """Rows of 64 values: random normal blocks scaled by 2^-20 .. 2^12, a block below each amax floor,
    and blocks whose values (after the power-of-two scale) sit exactly on e4m3 / e2m1 rounding midpoints."""
    rng = np.random.Generator(np.random.PCG64(4242))
    rows = [rng.standard_normal(64) * 2.0 ** e for e in range(-20, 13, 3)]
    rows.append(rng.standard_normal(64) * 1e-6)  # below fp8's floor 1e-4
    rows.append(rng.standard_normal(64) * 1e-39)  # below fp4's floor 6 * 2^-126 (float32 subnormals)
    # e2m1 ties: amax 6 x 2^-3 sets the scale 2^-3; midpoints 0.25 .. 5 (and their negatives) times it.
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    t = np.concatenate([[6.0], mids, -mids, mids * 1.000001, np.zeros(32 - 22)])[:32] * 2.0 ** -3
    rows.append(np.concatenate([t, t[::-1]]))
    # e4m3 ties: amax 448 x 2^-5 gives the power-of-two scale 2^-5; midpoints between neighbouring codes.
    pos = dr._E4M3_POS
    k = rng.choice(np.arange(1, 126), 63, replace=False)
    rows.append(np.concatenate([[448.0], (pos[k] + pos[k + 1]) / 2 * np.where(k % 2 == 0, 1, -1)]) * 2.0 ** -5)
    x = torch.from_numpy(np.stack(rows).astype(np.float32).astype(np.float64))
    return {
        "rows": int(x.shape[0]), "cols": 64,
        "x": f32_list(x),
        "fp8_ue8m0": f32_list(v4.fp8_sim(x, 64, "ue8m0")),
        "fp8_plain": f32_list(v4.fp8_sim(x, 64, None)),
        "fp4": f32_list(v4.fp4_sim(x, 32)),
    }


if __name__ == "__main__":
    main()
