#!/usr/bin/env python3
"""PyTorch eager on the shapes of bench/cuda_ops_bench.cc, on the same GPU in
the same run, and the ratio of the two times.

    build/bench/cuda_ops_bench --benchmark_format=json > ours.json
    python3 bench/cuda_compare.py ours.json

PyTorch runs each op as a user of it would write it in eager mode (bf16
F.linear with x converted from float32 first, F.rms_norm, F.silu(a) * b,
softmax), timed with CUDA events over 20 launches after a warm-up, median of
several trials. Its bf16 linear writes bf16 where ours writes float32 (ours
moves 2 more bytes per output element).
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

REPS = 20


def time_op(fn, trials=15):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)  # microseconds per op
    return statistics.median(times)


def torch_times():
    dev = torch.device("cuda")
    out = {}
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out["cuda_copy/2GiB"] = time_op(lambda: dst.copy_(src))
    del src, dst
    w = torch.randn(18432, 7168, device=dev).to(torch.bfloat16)
    for m in (1, 8, 64, 512, 4096):
        x = torch.randn(m, 7168, device=dev)
        out[f"cuda_linear_bf16/{m}/18432/7168"] = time_op(lambda: F.linear(x.to(torch.bfloat16), w))
    x = torch.randn(4096, 7168, device=dev)
    g = torch.randn(7168, device=dev)
    out["cuda_rmsnorm/4096/7168"] = time_op(lambda: F.rms_norm(x, (7168,), g, 1e-6))
    a = torch.randn(4096 * 18432, device=dev)
    b = torch.randn_like(a)
    out[f"cuda_silu_mul/{4096 * 18432}"] = time_op(lambda: F.silu(a) * b)
    s = torch.randn(64, 129280, device=dev)
    out["cuda_softmax/64/129280"] = time_op(lambda: torch.softmax(s, dim=-1))
    return out


def main():
    ours = {}
    with open(sys.argv[1]) as f:
        for b in json.load(f)["benchmarks"]:
            name = b["name"].removesuffix("/manual_time")
            ours[name] = b
    theirs = torch_times()
    print(f"GPU: {torch.cuda.get_device_name()}, PyTorch {torch.__version__}")
    print(f"{'op':40s} {'ours us':>10s} {'torch us':>10s} {'torch/ours':>10s} {'ours GB/s':>10s} {'ours TFLOP/s':>12s}")
    for name, t in theirs.items():
        b = ours.get(name)
        if b is None or "error_message" in b:
            print(f"{name:40s} {'-':>10s} {t:10.1f}")
            continue
        us = b["real_time"]  # microseconds (the benchmark's unit)
        gbs, tfl = b.get("GB/s", 0), b.get("TFLOP/s", 0)  # the counters' rates, already in these units
        print(f"{name:40s} {us:10.1f} {t:10.1f} {t / us:10.2f} {gbs:10.0f} {tfl:12.1f}")


if __name__ == "__main__":
    main()
