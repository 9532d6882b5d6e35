#!/usr/bin/python3
"""Writes tests/data/v4/mhc.json: DeepSeek-V4's mHC parts (hc_pre with its Sinkhorn projection, hc_post,
hc_head) computed by deepseek_v4_ref.py in float64, for the C++ ops' test (tests/mhc_test.cc).

The mixing weights are those of a tiny random V4 folder written by make_v4_fixtures.py (layer 1's
hc_attn_* and the model's hc_head_*, float32 as stored); the streams X [T, n, d] and the sub-layer output
o [T, d] are random float32 values. Every number is written as the float32 nearest to it (inputs exactly,
outputs rounded from float64). Deterministic: reruns write the same file.

  /usr/bin/python3 tests/reference/make_mhc_fixture.py [--out FILE]
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
import deepseek_v4_ref as v4  # noqa: E402
import make_v4_fixtures  # noqa: E402

F64 = torch.float64


def f32_list(t):
    return [float(v) for v in np.asarray(t, dtype=np.float64).astype(np.float32).reshape(-1)]


def main():
    ap = argparse.ArgumentParser()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(root, "data", "v4", "mhc.json"))
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
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {a.out}: T={T} n={n} d={d}")


if __name__ == "__main__":
    main()
