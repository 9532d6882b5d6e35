#!/usr/bin/env python3
"""Serving throughput of `deepseek serve` against the same work done offline.

Starts `deepseek serve` on a free port and sends WAVES waves of CLIENTS
concurrent streamed completions (random token-id prompts of PROMPT_LEN tokens,
MAX_TOKENS greedy new tokens each, `ignore_eos` so every request does the same
work). In the same run, `deepseek bench` does one batch of CLIENTS prompts of
the same sizes offline (prefill, then decode, no HTTP), the ceiling the server
is measured against. Prints one JSON line: the server's wall time per wave
and generated tokens/s, time to first token and per-request decode rate
(medians over requests), the offline batch's time for the same work, and
their ratio (offline / server time: 1.0 means the server adds nothing).

Usage: bench/serve_bench.py [--build build] [--model DIR] [--clients 8]
         [--waves 3] [--prompt-len 128] [--max-tokens 32]
The model defaults to a random `small` checkpoint (`deepseek init`) in a
temporary folder. Needs only Python's standard library.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import serving_util


def stream_completion(port, prompt, max_tokens):
    """Sends one streamed completion; returns (ttft_s, total_s, tokens)."""
    ttft, total, ids = serving_util.stream_completion(port, prompt, max_tokens)
    return ttft, total, len(ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    ap.add_argument("--model")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    binary = serving_util.program(a.build)
    tmp = tempfile.mkdtemp()
    model = serving_util.model_or_small(binary, a.model, tmp)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]

    # The offline ceiling: the same batch through `deepseek bench`.
    out = subprocess.run([binary, "bench", "--model", model, "--batch", str(a.clients), "--prompt-len",
                          str(a.prompt_len), "--new-tokens", str(a.max_tokens - 1), "--repeat", "3"],
                         check=True, capture_output=True, text=True).stdout
    offline = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    offline_s = (a.clients * a.prompt_len / offline["prefill_tokens_per_s"] +
                 a.clients * (a.max_tokens - 1) / offline["decode_tokens_per_s"])

    server, port = serving_util.start_server(binary, model, os.path.join(tmp, "serve.log"),
                                             ["--max-sequences", str(a.clients)])
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.clients * (a.waves + 1))]
        results, walls = [], []
        for wave in range(a.waves + 1):  # wave 0 warms up, untimed
            got = [None] * a.clients
            def client(i):
                got[i] = stream_completion(port, prompts[wave * a.clients + i], a.max_tokens)
            threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if any(g is None for g in got):
                sys.exit("error: a request failed")
            if wave > 0:
                walls.append(time.perf_counter() - t0)
                results += got
        if any(tokens != a.max_tokens for _, _, tokens in results):
            sys.exit("error: a request made fewer tokens than max_tokens")
        wall = statistics.median(walls)
        print(json.dumps({
            "clients": a.clients, "waves": a.waves, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
            "server_wave_s": round(wall, 4),
            "server_tokens_per_s": round(a.clients * a.max_tokens / wall, 1),
            "ttft_median_s": round(statistics.median(r[0] for r in results), 4),
            "request_decode_tokens_per_s_median": round(statistics.median(
                (r[2] - 1) / (r[1] - r[0]) for r in results), 1),
            "offline_batch_s": round(offline_s, 4),
            "offline_over_server": round(offline_s / wall, 3),
        }))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
