#!/usr/bin/env python3
"""Time to first token with automatic prefix caching, through `deepseek serve`.

Starts `deepseek serve` on a free port (prefix caching on, the default) and,
ROUNDS times: sends a CACHED-token prompt (one new token, which leaves its
cache kept), then a PROMPT-token prompt that extends it (timed: it reads only
its last PROMPT - CACHED tokens), then an unrelated PROMPT-token prompt
(timed: read from its start). Then a TURNS-turn conversation, each turn's
prompt the last one, its answer and NEW more tokens. Prints one JSON line:
the median time to first token of both kinds and their ratio, and the
prompt tokens the server read and took from its cache in each part, from
its /metrics.

Usage: bench/prefix_cache_bench.py [--build build] [--model DIR] [--rounds 5]
         [--cached 1900] [--prompt 2000] [--turns 10] [--new 40] [--answer 16]
The model defaults to a random `small` checkpoint (`deepseek init`, 4,096
positions) in a temporary folder. Needs only Python's standard library.
"""
import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import urllib.request

import serving_util


def completion(port, prompt, max_tokens):
    """One streamed greedy completion: (time to first token in s, token ids)."""
    ttft, _, ids = serving_util.stream_completion(port, prompt, max_tokens)
    return ttft, ids


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(deepseek_[a-z_]+) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cached", type=int, default=1900)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--answer", type=int, default=16)
    a = ap.parse_args()
    if not 0 < a.cached < a.prompt:
        sys.exit("error: --cached must be in (0, --prompt)")
    binary = serving_util.program(a.build)
    tmp = tempfile.mkdtemp()
    model = serving_util.model_or_small(binary, a.model, tmp)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(vocab) for _ in range(n)]

    server, port = serving_util.start_server(binary, model, os.path.join(tmp, "serve.log"), ["--max-sequences", "1"])
    try:
        completion(port, draw(64), 2)  # warm up
        cached, uncached = [], []
        before = metrics(port)
        for _ in range(a.rounds):
            base = draw(a.cached)
            completion(port, base, 1)
            t, _ = completion(port, base + draw(a.prompt - a.cached), 1)
            cached.append(t)
            t, _ = completion(port, draw(a.prompt), 1)
            uncached.append(t)
        after = metrics(port)
        prompt_read = after["deepseek_prompt_tokens_total"] - before["deepseek_prompt_tokens_total"]
        prompt_hit = after["deepseek_prefix_cache_hit_tokens_total"] - before["deepseek_prefix_cache_hit_tokens_total"]

        # A conversation: each turn resends everything so far.
        prompt, turn_read, turn_sent = draw(a.new), [], []
        for _ in range(a.turns):
            m0 = metrics(port)["deepseek_prompt_tokens_total"]
            _, answer = completion(port, prompt, a.answer)
            turn_read.append(int(metrics(port)["deepseek_prompt_tokens_total"] - m0))
            turn_sent.append(len(prompt))
            prompt = prompt + answer + draw(a.new)
        final = metrics(port)
        ratio = statistics.median(cached) / statistics.median(uncached)
        print(json.dumps({
            "cached_prefix": a.cached, "prompt": a.prompt, "rounds": a.rounds,
            "ttft_extending_cached_s": round(statistics.median(cached), 4),
            "ttft_uncached_s": round(statistics.median(uncached), 4),
            "ttft_ratio": round(ratio, 4),
            "ttft_part_prompt_tokens_read": int(prompt_read), "ttft_part_prompt_tokens_from_cache": int(prompt_hit),
            "chat_turn_tokens_sent": turn_sent, "chat_turn_tokens_read": turn_read,
            "cache_pool_peak_bytes": int(final["deepseek_cache_pool_peak_bytes"]),
            "cache_pool_limit_bytes": int(final["deepseek_cache_pool_limit_bytes"]),
            "prefix_cache_evictions": int(final["deepseek_prefix_cache_evictions_total"]),
        }))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
